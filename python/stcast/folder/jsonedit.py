"""Edit JSON files (configs, indexes) in their own text: only the values that change are
replaced, so key order, indentation and number spelling stay as the author wrote them."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

# The config keys that name the model's dtype (`torch_dtype`, and `dtype` since
# transformers 4.56).
DTYPE_KEYS = frozenset({"torch_dtype", "dtype"})
# Configs and indexes are a few levels deep; far deeper is an attack on the recursive walks.
MAX_DEPTH = 100


def depth(doc: Any) -> int:
    """How deeply `doc` nests lists and objects (iteratively: any depth is safe)."""
    deepest, pending = 0, [(doc, 1)]
    while pending:
        node, d = pending.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            pending.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


_WS = re.compile(r"[ \t\n\r]*")


def member_spans(text: str, wanted: Callable[[tuple[Any, ...]], bool]) -> list[tuple[int, int]]:
    """(start, end) of the value of every object member whose key path `wanted` accepts.

    `text` must already have passed `json.loads`. Only those spans are replaced afterwards,
    so every other byte (order, indentation, number spelling) stays as it was.
    """
    decoder = json.JSONDecoder()
    spans = []

    def skip(i: int) -> int:
        m = _WS.match(text, i)
        return m.end() if m else i

    def value(i: int, path: tuple[Any, ...]) -> int:
        c = text[i]
        if c == "{":
            i = skip(i + 1)
            if text[i] == "}":
                return i + 1
            while True:
                key, i = decoder.raw_decode(text, i)
                start = skip(skip(i) + 1)  # past the colon
                end = value(start, (*path, key))
                if wanted((*path, key)):
                    spans.append((start, end))
                i = skip(end)
                if text[i] == "}":
                    return i + 1
                i = skip(i + 1)  # past the comma
        if c == "[":
            i = skip(i + 1)
            if text[i] == "]":
                return i + 1
            k = 0
            while True:
                i = skip(value(i, (*path, k)))
                k += 1
                if text[i] == "]":
                    return i + 1
                i = skip(i + 1)
        return decoder.raw_decode(text, i)[1]

    value(skip(0), ())
    return spans


def replace_spans(text: str, spans: list[tuple[int, int]], new: str) -> str:
    for start, end in sorted(spans, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def set_dtypes(text: str, dtype_name: str) -> bytes | None:
    """The config with every `torch_dtype`/`dtype` string set to `dtype_name`, or None if none.

    Nested sub-configs (`text_config`, ...) count; `quantization_config` is left alone.
    """

    def wanted(path: tuple[Any, ...]) -> bool:
        return path[-1] in DTYPE_KEYS and "quantization_config" not in path

    spans = [
        (a, b)
        for a, b in member_spans(text, wanted)
        if text[a] == '"' or text[a:b] == "null"  # only names, never a nested object
    ]
    if not spans:
        return None
    return replace_spans(text, spans, json.dumps(dtype_name)).encode("utf-8")


def set_total_size(text: str, total: int) -> bytes:
    """The index text with `metadata.total_size` set to `total`, all else unchanged."""
    spans = member_spans(text, lambda path: path == ("metadata", "total_size"))
    if spans:
        return replace_spans(text, spans, str(total)).encode("utf-8")
    # No total_size to replace: rebuild the document, in the original's style.
    doc = json.loads(text)
    metadata = {"total_size": total, **(doc.get("metadata") or {})}
    if "metadata" in doc:
        doc["metadata"] = metadata  # keeps its place
    else:
        doc = {"metadata": metadata, **doc}
    m = re.search(r"\n([ \t]+)\S", text)
    indent = m.group(1) if m else None
    separators = None if indent is not None or '": ' in text else (",", ":")
    out = json.dumps(
        doc,
        indent=indent,
        separators=separators,
        ensure_ascii=text.isascii() and "\\u" in text,
    )
    return (out + ("\n" if text.endswith("\n") else "")).encode("utf-8")


def rename_shards(text: str, names: dict[str, str]) -> str:
    """The index text with each `weight_map` shard name found in `names` replaced by its new
    name, all else unchanged."""
    spans = member_spans(text, lambda path: len(path) == 2 and path[0] == "weight_map")
    pieces, at = [], 0
    for start, end in sorted(spans):
        old = json.loads(text[start:end])
        if isinstance(old, str) and old in names:
            pieces += [text[at:start], json.dumps(names[old])]
            at = end
    pieces.append(text[at:])
    return "".join(pieces)
