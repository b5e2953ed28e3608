"""A whole tiny gpt-oss checkpoint in MXFP4 (tests/fixtures/packed/gpt-oss-tiny, made by
make_gpt_oss_tiny.py with transformers 5.17): stcast's bf16 and fp16 outputs hold, name for
name and bit for bit, the state `GptOssForCausalLM.from_pretrained` loads with
`Mxfp4Config(dequantize=True)`, and that same state loads from them (checked once by the
script, with torch; its hashes are committed in gpt-oss-tiny.json). CI has no torch: it
compares stcast's outputs with those hashes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import main_in_process, tensor_bytes

FIX = Path(__file__).parent / "fixtures" / "packed"
SRC = FIX / "gpt-oss-tiny"
REFERENCE = json.loads((FIX / "gpt-oss-tiny.json").read_text())


@pytest.mark.parametrize("to", ["bf16", "fp16"])
def test_output_is_transformers_dequantized_state(tmp_path, to):
    assert REFERENCE[f"{to}_check"] == "passed"
    out = tmp_path / "out"
    extra = ["--from-bf16"] if to == "fp16" else []
    rc, _, err = main_in_process("convert", SRC, out, "--to", to, *extra)
    assert rc == 0, err
    got = {
        name: {"dtype": dtype, "shape": shape, "sha256": hashlib.sha256(data).hexdigest()}
        for name, (dtype, shape, data) in tensor_bytes(out / "model.safetensors").items()
    }
    assert sorted(got) == sorted(REFERENCE[to])  # name for name: nothing more, nothing less
    assert got == REFERENCE[to]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["GptOssForCausalLM"]
    rc, _, err = main_in_process("verify", SRC, out, *extra)
    assert rc == 0, err
