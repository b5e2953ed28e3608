"""The import graph of `python/stcast` has no cycles.

Built from the source with `ast`, so that no import hides: function-local imports count
as edges (a cycle behind one only waits for the call that closes it), `from pkg import x`
is an edge to `pkg` and, where `pkg.x` is a module, to `pkg.x`, relative imports are
resolved, and only the bodies of `if TYPE_CHECKING:` are left out. A package's
`__init__.py` is the package's module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "python"
PACKAGE = "stcast"


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, but those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


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
                targets.append(pkg)
                targets.extend(f"{pkg}.{alias.name}" for alias in node.names)
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
    assert {"stcast", "stcast.folder", "stcast.folder.walk", "stcast.errors"} <= set(edges)
    assert "stcast.errors" in edges["stcast.reports"]
    assert "stcast.folder" in edges["stcast._api"]  # a function-local import counts


def test_rules_on_a_made_up_cycle(tmp_path: Path) -> None:
    # The rules themselves: a function-local import closes a cycle, TYPE_CHECKING does not.
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import hidden\n"
        "def f():\n    from .other import x\n"
    )
    names = [n.module for n in _imports(tree) if isinstance(n, ast.ImportFrom)]
    assert sorted(str(n) for n in names) == ["other", "typing"]


def test_no_import_cycles() -> None:
    found = cycles(graph())
    assert not found, "import cycles in python/stcast:\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found
    )
