"""The reference of the engine's JSON writer is Python's json module, the writer the tools
that read these files use (transformers, compressed-tensors). `tests/fixtures/json`
holds documents and what that module makes of them, which the engine's Rust tests match
byte for byte (`rust/run/json.rs`, `documents_written_anew_are_python_s_json_dumps`).
Here the Python running the tests writes that file again: it must be the same."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "json"


def test_the_committed_json_texts_are_what_this_python_s_json_module_writes():
    spec = importlib.util.spec_from_file_location("make_json", FIXTURE / "make_json.py")
    assert spec is not None and spec.loader is not None
    make_json = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_json)
    committed = (FIXTURE / "json-dumps.json").read_text(encoding="ascii")
    cases = json.loads(committed)["cases"]
    assert len(cases) > 100
    assert sum(c["text"] is None for c in cases) == 2  # indexes written with no source's
    assert make_json.text(json.loads(committed)["python"]) == committed
