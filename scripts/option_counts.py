"""How often each option's name appears in python/stcast (issue 31 asks for at most four).

    python scripts/option_counts.py [python/stcast]

Counts code, not prose (docstrings and comments are left out), two ways:
- `refs`: the places that reference an option as one: an attribute (`o.force`), a keyword
  argument or parameter (`force=`), a string equal to its name or flag (`"force"`,
  `"--force"`);
- `all`: those and every bare identifier of that name (`report`, `name`, `to` and
  `progress` are also local variables, hence their large counts).
Then the files holding the references. Needs the built package (`_core.OPTIONS`).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

from stcast import _core

NAMES = sorted({row["name"] for row in _core.OPTIONS})
FLAGS = {"--" + n.replace("_", "-"): n for n in NAMES}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of `tree`'s module, classes and functions."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, kinds)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }


def count(tree: ast.AST) -> tuple[Counter[str], Counter[str]]:
    """(references, all occurrences) of each option name in `tree`."""
    refs: Counter[str] = Counter()
    names: Counter[str] = Counter()
    docs = docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names[n.id] += 1
            continue
        word = None
        if isinstance(n, ast.Attribute):
            word = n.attr
        elif isinstance(n, (ast.keyword, ast.arg)):
            word = n.arg
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            word = FLAGS.get(n.value, n.value)
        if word is not None:
            refs[word] += 1
    keep = set(NAMES)
    refs = Counter({k: v for k, v in refs.items() if k in keep})
    names = Counter({k: v for k, v in names.items() if k in keep})
    return refs, refs + names


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "python/stcast")
    refs: Counter[str] = Counter()
    every: Counter[str] = Counter()
    where: dict[str, Counter[str]] = {}
    for path in sorted(root.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        r, a = count(ast.parse(path.read_text(encoding="utf-8")))
        refs.update(r)
        every.update(a)
        for name, n in r.items():
            where.setdefault(name, Counter())[path.relative_to(root).as_posix()] = n
    print(f"{'refs':>5} {'all':>5}  option            files (refs)")
    for name in sorted(NAMES, key=lambda n: (-refs[n], n)):
        files = ", ".join(f"{f}:{n}" for f, n in where.get(name, Counter()).most_common())
        print(f"{refs[name]:5d} {every[name]:5d}  {name:16s}  {files}")
    over = sum(1 for n in NAMES if refs[n] > 4)
    print(f"{over} of {len(NAMES)} options referenced more than four times")


if __name__ == "__main__":
    main()
