"""The import graph of `python/stcast` has no cycles, and its file-system calls only shrink.

Built from the source with `ast`, so that no import hides: function-local imports count
as edges (a cycle behind one only waits for the call that closes it), and so do imports
under `if TYPE_CHECKING:` (a cycle a type checker sees is one a reader must untangle too).
`from pkg import x` is an edge to `pkg.x` where that is a module (the native `_core`,
through its stub, is one), else to `pkg`; relative imports are resolved. A package's
`__init__.py` is the package's module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "python"
PACKAGE = "stcast"


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (an extension module by its stub)."""
    found = {}
    for path in sorted([*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / PACKAGE).rglob("*.pyi")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth (`if TYPE_CHECKING:` bodies too)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    mods = modules()
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".")
                    if not is_package:
                        base.pop()
                    base = base[: len(base) - (node.level - 1)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                # Importing a submodule runs its package's `__init__` first, but takes
                # nothing from it: the edge is to the submodule. A name is the package's.
                names = [f"{pkg}.{alias.name}" for alias in node.names]
                targets.extend(n for n in names if n in mods)
                if len(targets) < len(names):
                    targets.append(pkg)
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_graph_sees_the_package() -> None:
    # The walk must see the modules and their edges, or "no cycles" would prove nothing.
    edges = graph()
    assert {"stcast", "stcast._api", "stcast._engine", "stcast.errors"} <= set(edges)
    assert "stcast.errors" in edges["stcast.reports"]
    assert "stcast.cli" in edges["stcast.__main__"]  # a function-local import counts
    assert "stcast._types" in edges["stcast.reports"]  # a TYPE_CHECKING import counts
    # `from .. import _core` is an edge to the extension (its stub), not to the package.
    assert "stcast._core" in edges["stcast.errors"] and "stcast" not in edges["stcast.errors"]


def test_rules_on_a_made_up_cycle(tmp_path: Path) -> None:
    # The rules themselves: a function-local import closes a cycle, and so does TYPE_CHECKING.
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import hidden\n"
        "def f():\n    from .other import x\n"
    )
    names = [a.name for n in _imports(tree) for a in n.names]
    assert sorted(names) == ["TYPE_CHECKING", "hidden", "x"]


def test_no_import_cycles() -> None:
    found = cycles(graph())
    assert not found, "import cycles in python/stcast:\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found
    )


# ------------------------------------------------------------------ file-system calls

# Issue 31's end state: outside the terminal (`_console.py`) and `demo.py`, the package
# makes no file-system call: the engine decides every question about files.
FS_FREE = {"stcast/_console.py", "stcast/demo.py"}
# `os` functions that touch the file system (the rest are process or string functions).
OS_FS = {
    "access", "chmod", "close", "fstat", "fsync", "link", "listdir", "lstat", "makedirs",
    "mkdir", "open", "read", "readlink", "remove", "rename", "replace", "rmdir", "scandir",
    "stat", "statvfs", "symlink", "unlink", "utime", "walk", "write",
}  # fmt: skip
# `os.path` functions that ask the file system (join, basename, ... only handle strings).
OS_PATH_FS = {
    "abspath", "exists", "getmtime", "getsize", "isdir", "isfile", "islink", "lexists",
    "realpath", "samefile",
}  # fmt: skip
# Methods of `pathlib.Path` that touch the file system, whatever object they are called on.
PATH_METHODS = {
    "exists", "is_dir", "is_file", "is_symlink", "iterdir", "lstat", "mkdir", "read_bytes",
    "read_text", "resolve", "rglob", "rmdir", "samefile", "stat", "touch", "unlink",
    "write_bytes", "write_text",
}  # fmt: skip


def fs_calls(tree: ast.AST) -> list[str]:
    """The file-system calls in `tree`, as written (`os.stat`, `open`, `p.exists`, ...)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        head, _, last = name.rpartition(".")
        if (
            name in ("open", "io.open")
            or (head == "os" and last in OS_FS)
            or (head == "os.path" and last in OS_PATH_FS)
            or head in ("shutil", "glob")
            or (head and head not in ("os", "os.path") and last in PATH_METHODS)
        ):
            found.append(name)
    return found


def test_no_file_system_calls() -> None:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        calls = [] if rel in FS_FREE else fs_calls(ast.parse(path.read_text()))
        if calls:
            found[rel] = calls
    assert not found, f"file-system calls (the engine decides): {found}"


def test_fs_calls_sees_them() -> None:
    tree = ast.parse(
        "import os\nos.stat(p)\nos.path.join(a, b)\nos.path.isdir(p)\nopen(p)\n"
        "q.read_text()\nshutil.copyfile(a, b)\nos.getpid()\nx.stat()\n"
    )
    want = ["os.stat", "os.path.isdir", "open", "q.read_text", "shutil.copyfile", "x.stat"]
    assert fs_calls(tree) == want
