"""How often each option's name appears in python/stcast (issue 31 asks for at most four).

    python scripts/option_counts.py [--list] [python/stcast]

Counts code, not prose (docstrings and comments are left out), two ways:
- `refs`: the places that reference an option as one: an attribute (`o.force`), a keyword
  argument or parameter (`force=`), a string equal to its name or flag (`"force"`,
  `"--force"`);
- `all`: those and every bare identifier of that name (`report`, `name`, `to` and
  `progress` are also local variables, hence their large counts).
Then the files holding the references; `--list` prints each reference (file:line, what it
is, the line) instead, for a reader to tell an option from a homonym.

Two homonyms are never an option, whatever the code around them, and are left out of both
counts: Python's sort key (`key=` given to `sorted`, `min`, `max`, `.sort`), and the name
of a dataclass field (`f.name` where `f` is one of `dataclasses.fields(...)`). Any other
homonym (a tensor's `t.name`, a report's `report.to`, a progress callback) still counts.
Needs the built package (`_core.OPTIONS`).
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


def homonyms(tree: ast.AST) -> set[int]:
    """The ids of the nodes of `tree` that are never an option: a sort key (`key=` of
    `sorted`, `min`, `max`, `.sort`) and a dataclass field's name (`f.name` for `f` in
    `fields(...)`, in the comprehension or loop that takes it from there)."""
    found: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            sorting = isinstance(f, ast.Name) and f.id in ("sorted", "min", "max")
            if sorting or (isinstance(f, ast.Attribute) and f.attr == "sort"):
                found.update(id(k) for k in n.keywords if k.arg == "key")
        loops = []
        if isinstance(n, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            loops = [(g.target, g.iter, [n]) for g in n.generators]
        elif isinstance(n, ast.For):
            loops = [(n.target, n.iter, n.body)]
        for target, it, scope in loops:
            field = isinstance(it, ast.Call) and getattr(it.func, "id", None) == "fields"
            if not (field and isinstance(target, ast.Name)):
                continue
            for part in scope:
                for m in ast.walk(part):
                    if (
                        isinstance(m, ast.Attribute)
                        and m.attr == "name"
                        and isinstance(m.value, ast.Name)
                        and m.value.id == target.id
                    ):
                        found.add(id(m))
    return found


def references(tree: ast.AST) -> list[tuple[str, str, int]]:
    """Each reference to an option name in `tree`: (name, what it is, line)."""
    found = []
    docs, skip = docstrings(tree), homonyms(tree)
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Attribute):
            found.append((n.attr, "attribute", n))
        elif isinstance(n, ast.keyword):
            found.append((n.arg, "keyword", n))
        elif isinstance(n, ast.arg):
            found.append((n.arg, "parameter", n))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            found.append((FLAGS.get(n.value, n.value), "string", n))
    return [(w, what, n.lineno) for w, what, n in found if w in FLAGS.values()]


def count(tree: ast.AST) -> tuple[Counter[str], Counter[str]]:
    """(references, all occurrences) of each option name in `tree`."""
    refs = Counter(word for word, _, _ in references(tree))
    names = Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in NAMES)
    return refs, refs + names


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--list"]
    root = Path(args[0] if args else "python/stcast")
    if "--list" in sys.argv:
        for path in sorted(root.rglob("*.py*")):
            if path.suffix in (".py", ".pyi"):
                text = path.read_text(encoding="utf-8")
                lines = text.splitlines()
                for word, what, line in sorted(references(ast.parse(text)), key=lambda r: r[2]):
                    where = f"{path.relative_to(root).as_posix()}:{line}"
                    print(f"{word:16s} {where:24s} {what:9s} {lines[line - 1].strip()}")
        return
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
