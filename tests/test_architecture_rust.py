"""The engine's modules form no cycle (pure Python: parses `rust/**/*.rs`, builds nothing).

Each file is a module (`rust/lib.rs` is the crate, `x/mod.rs` is `x`, `x/y.rs` is `x::y`).
A module depends on another when its code names it: `use crate::a::b`, a path
`crate::a::b::C`, or `super::...` (resolved from where it is written, inline modules
included). A path names the longest module that is its prefix. Declaring a child (`mod x;`)
is not a dependency, nor is naming oneself. `#[cfg(test)]` modules (inline or files) and
test folders are left out. `python` (the PyO3 adapter) may use anything; nothing may use it.
"""

from __future__ import annotations

import re
from pathlib import Path

RUST = Path(__file__).resolve().parent.parent / "rust"

_CFG_TEST = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])")
_MOD_BLOCK = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*\{")
_USE = re.compile(r"\buse\s+([^;]*);")
_RAW = re.compile(r'b?r(#*)"')
_CHAR = re.compile(r"'(\\.[^']*|[^\\'])'")
_PATH = re.compile(r"(?<![\w:])((?:crate|super)(?:\s*::\s*\w+)+)")


def module_of(path: Path) -> tuple[str, ...]:
    """The module path of a file (`()` is the crate)."""
    parts = path.relative_to(RUST).with_suffix("").parts
    if parts == ("lib",):
        return ()
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def strip(text: str) -> str:
    """The code without comments, string and char literals (lengths kept)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif (
            c in "br"
            and (m := _RAW.match(text, i))
            and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))
        ):
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i : j + 1]))
            i = j + 1
        elif c == "'" and (m := _CHAR.match(text, i)):
            out.append(" " * (m.end() - i))
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(code: str, open_at: int) -> int:
    """The index just past the `}` matching the `{` at `open_at`."""
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


def expand_use(tree: str) -> list[str]:
    """`crate::a::{b, c::{d, self}}` as `crate::a::b`, `crate::a::c::d`, `crate::a::c`."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    brace = tree.find("{")
    if brace < 0:
        return [tree.removesuffix("::self").removesuffix("::*")]
    head, body = tree[:brace], tree[brace + 1 : tree.rfind("}")]
    items, depth, start = [], 0, 0
    for j, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:j])
            start = j + 1
    items.append(body[start:])
    out = []
    for item in filter(None, items):
        out += [p for p in expand_use(head + item) if p]
    return out


def resolve(path: str, here: tuple[str, ...]) -> tuple[str, ...] | None:
    """The module path a `crate::`/`super::` path starts from, and its rest."""
    parts = [p for p in re.split(r"\s*::\s*", path) if p and p not in ("self", "*")]
    if not parts:
        return None
    if parts[0] == "crate":
        return tuple(parts[1:])
    if parts[0] != "super":
        return None
    base = list(here)
    while parts and parts[0] == "super":
        if not base:
            return None
        base.pop()
        parts.pop(0)
    return tuple(base + parts)


def parse(files: dict[tuple[str, ...], Path]) -> tuple[set[tuple[str, ...]], dict]:
    """Excluded (test) modules, and for each module the module paths its code names."""
    excluded: set[tuple[str, ...]] = set()
    refs: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for mod, path in files.items():
        code = strip(path.read_text())
        # Inline `#[cfg(test)] mod x { ... }` blocks go; `#[cfg(test)] mod x;` files too.
        for m in reversed(list(_CFG_TEST.finditer(code))):
            if m.group(2) == ";":
                excluded.add(mod + (m.group(1),))
            else:
                end = block_end(code, m.end() - 1)
                code = code[: m.start()] + re.sub(r"[^\n]", " ", code[m.start() : end]) + code[end:]
        # Where each inline module spans, for `super::`.
        spans = [
            (m.end() - 1, block_end(code, m.end() - 1), m.group(1))
            for m in _MOD_BLOCK.finditer(code)
        ]

        def here_at(pos: int, mod: tuple[str, ...] = mod, spans: list = spans) -> tuple[str, ...]:
            inner = [name for (a, b, name) in sorted(spans) if a < pos < b]
            return mod + tuple(inner)

        found: set[tuple[str, ...]] = set()
        for m in _USE.finditer(code):
            for p in expand_use(m.group(1)):
                r = resolve(p, here_at(m.start()))
                if r is not None:
                    found.add(r)
        for m in _PATH.finditer(code):
            r = resolve(m.group(1), here_at(m.start()))
            if r is not None:
                found.add(r)
        refs[mod] = found
    return excluded, refs


def module_graph() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    files: dict[tuple[str, ...], Path] = {}
    for path in sorted(RUST.rglob("*.rs")):
        if "tests" in path.relative_to(RUST).parts[:-1]:
            continue
        files[module_of(path)] = path
    excluded, refs = parse(files)

    def is_excluded(mod: tuple[str, ...]) -> bool:
        return any(mod[: len(e)] == e for e in excluded)

    modules = {m for m in files if not is_excluded(m)}
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in modules}
    for mod in modules:
        for target in refs[mod]:
            # The longest module that is a prefix of the path.
            best = max(
                (m for m in modules if target[: len(m)] == m),
                key=len,
                default=None,
            )
            if best is not None and best != mod and best != ():
                graph[mod].add(best)
    return graph


def name(mod: tuple[str, ...]) -> str:
    return "::".join(("crate",) + mod)


def cycles(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[tuple[str, ...]]]:
    """Strongly connected components of more than one module (Tarjan), each with a cycle."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    out: list[list[tuple[str, ...]]] = []
    counter = [0]

    def visit(v: tuple[str, ...]) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def one_cycle(graph: dict, comp: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """A shortest cycle through the component's first module, as a path back to it."""
    members = set(comp)
    start = comp[0]
    prev: dict = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def test_the_graph_sees_the_engine():
    graph = module_graph()
    # Sanity: the parse finds known modules and known edges, so an empty cycle list means
    # something.
    assert ("convert",) in graph and ("torch", "tensor") in graph
    assert ("error",) in graph[("convert",)]
    assert ("torch",) in graph[("torch", "tensor")]  # `use super::Storage`
    assert not any((m and m[-1] == "tests") or m == ("testutil",) for m in graph)


def test_no_module_cycles():
    graph = module_graph()
    found = [" -> ".join(name(m) for m in one_cycle(graph, c)) for c in cycles(graph)]
    assert not found, "module cycles in rust/:\n" + "\n".join(found)


def top_level(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> dict:
    """The graph of the crate's top-level modules, a folder module (`input/`, `torch/`) one
    node with all its files: a file of `input/` using `error` while `error` uses another
    file of `input/` is a cycle between the two modules."""
    out: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for mod, deps in graph.items():
        out.setdefault(mod[:1], set()).update(d[:1] for d in deps if d[:1] != mod[:1])
    return out


def test_no_cycles_between_top_level_modules():
    graph = top_level(module_graph())
    found = [" -> ".join(name(m) for m in one_cycle(graph, c)) for c in cycles(graph)]
    assert not found, "module cycles between rust/'s top-level modules:\n" + "\n".join(found)


def test_nothing_uses_the_python_adapter():
    graph = module_graph()
    users = sorted(name(m) for m, deps in graph.items() if ("python",) in deps)
    assert not users, f"modules that use crate::python: {users}"


def test_expand_use():
    assert expand_use("crate::a::{b, c::{d, self}, e as f}") == [
        "crate::a::b",
        "crate::a::c::d",
        "crate::a::c",
        "crate::a::e",
    ]
    assert resolve("super::super::x::Y", ("a", "b", "c")) == ("a", "x", "Y")


def test_cycles_are_found_and_shown():
    a, b, c, d = ("a",), ("b",), ("c",), ("d",)
    graph = {a: {b}, b: {c}, c: {a}, d: {a}}
    (comp,) = cycles(graph)
    assert comp == [a, b, c]
    assert one_cycle(graph, comp) == [a, b, c, a]
    assert cycles({a: {b}, b: set()}) == []
    # Files of one folder module are one node: x::p -> y -> x::q is a cycle of x and y.
    nested = {("x", "p"): {("y",)}, ("y",): {("x", "q")}, ("x", "q"): set()}
    assert cycles(top_level(nested)) == [[("x",), ("y",)]]
