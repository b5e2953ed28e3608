"""The engine's JSON texts (rust/run/json.rs) against Python's json module, the writer the
tools that read them (transformers, compressed-tensors) use: every document stcast writes
anew is `json.dumps` of the document `json.loads` reads, byte for byte, whatever its
numbers, escapes and duplicate keys. The in-place edits have Rust unit tests."""

from __future__ import annotations

import json
import random
import struct

import pytest
from stcast import _core

KEYS = ["torch_dtype", "dtype", "metadata", "weight_map", "a", "é", "😀", 'b"q', "\x7f", "\ud800"]


def _value(rng: random.Random, depth: int) -> object:
    pick = rng.randrange(12)
    if depth > 3 or pick < 6:
        return rng.choice(
            [
                None,
                True,
                rng.randrange(-(10**30), 10**30),
                struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0],
                rng.random() * 10 ** rng.randrange(-20, 20),
                rng.choice(["", "é\n\x01", "😀", "\ud83d", "a\\b", "\x7f"]),
            ]
        )
    if pick < 8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(KEYS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _text(rng: random.Random) -> str:
    doc = {k: _value(rng, 1) for k in rng.sample(KEYS, rng.randrange(1, 6))}
    doc["metadata"] = rng.choice([None, {}, {"total_size": 1, "x": [1.5]}])
    indent = rng.choice([None, 2, "\t"])
    text = json.dumps(doc, indent=indent, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.3:  # a duplicated key: the last value counts, in the first place
        text = '{"a": [1, 2], "metadata": {"total_size": 2},' + text[1:]
    return text + rng.choice(["", "\n"])


def _dtypes_set(v: object, quantization: bool = False) -> object:
    """`v` with every dtype key that names a dtype (a string or null) set to bfloat16,
    outside `quantization_config`: what the engine's in-place edit means."""
    if isinstance(v, list):
        return [_dtypes_set(x, quantization) for x in v]
    if not isinstance(v, dict):
        return v
    names = ("torch_dtype", "dtype")
    return {
        k: "bfloat16"
        if k in names and not quantization and (x is None or isinstance(x, str))
        else _dtypes_set(x, quantization or k == "quantization_config")
        for k, x in v.items()
    }


@pytest.mark.parametrize("seed", range(4))
def test_documents_written_anew_are_json_dumps(seed):
    rng = random.Random(seed)
    for _ in range(300):
        text = _text(rng)
        try:
            text.encode()
        except UnicodeEncodeError:
            continue  # not a file's text (a lone surrogate unescaped)
        doc = json.loads(text)
        weight_map = {f"t{i}é": f"m-{i}.safetensors" for i in range(rng.randrange(3))}
        for sort_keys in (False, True):
            want = dict(doc)
            want["metadata"] = {**(doc.get("metadata") or {}), "total_size": 7}
            want["weight_map"] = weight_map
            got = _core.index_text(
                text, total=7, weight_map=[*weight_map.items()], sort_keys=sort_keys
            )
            assert got == (json.dumps(want, indent=2, sort_keys=sort_keys) + "\n").encode()
        dtyped = _dtypes_set(doc)
        assert isinstance(dtyped, dict)
        plain = {k: v for k, v in dtyped.items() if k not in _core.QUANTIZATION_KEYS}
        end = "\n" if text.endswith("\n") else ""
        want_config = json.dumps(plain, indent=2 if "\n" in text else None) + end
        assert _core.config_text(text, "bf16", dequantize=True) == want_config.encode()
