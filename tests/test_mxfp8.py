"""FP8 weights with E8M0 scales back to bf16/fp16 (issue 32): compressed-tensors
`mxfp8-quantized` (an E4M3 weight, a U8 E8M0 exponent per 32 columns) as llm-compressor's
`model_free_ptq` wrote it, and transformers' FP8 `weight_scale_inv` in F8_E8M0 or U8, each
equal to the reference's own dequantization (tests/fixtures/mxfp8: hashes made by
compressed-tensors 0.19 and transformers 5.17), every E4M3 code against every E8M0 byte.
What has no reference is refused in one line naming the tensor.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_error_line, main_in_process, tensor_bytes, write_safetensors

FIX = Path(__file__).parent / "fixtures" / "mxfp8"
EXPECTED = json.loads((FIX / "expected.json").read_text())
FOLDER = FIX / "llama-bf16.mxfp8a16"
TO = {"bf16": ("bf16", []), "fp16": ("fp16", ["--from-bf16"])}
# A NaN's bits as the references' hashes write every NaN (make_mxfp8.py `canonical_sha`).
QUIET = {"BF16": (0x7F80, 0x007F, 0x7FC0), "F16": (0x7C00, 0x03FF, 0x7E00)}


def run(*args: object) -> tuple[int, str, str]:
    return main_in_process(*args)


def hashes(folder: Path) -> dict[str, tuple[str, list[int], str]]:
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors"))
    out = {}
    for f in files:
        for name, (dtype, shape, data) in tensor_bytes(f).items():
            out[name] = (dtype, shape, hashlib.sha256(data).hexdigest())
    return out


def want(to: str) -> dict[str, tuple[str, list[int], str]]:
    return {k: (v["dtype"], v["shape"], v["sha256"]) for k, v in EXPECTED["folder"][to].items()}


def canonical_sha(dtype: str, data: bytes) -> str:
    """sha256 of 16-bit floats with every NaN written as the dtype's quiet NaN."""
    exp, man, quiet = QUIET[dtype]
    bits = np.frombuffer(data, np.uint16).copy()
    bits[((bits & exp) == exp) & ((bits & man) != 0)] = quiet
    return hashlib.sha256(bits.tobytes()).hexdigest()


def codes() -> tuple[np.ndarray, np.ndarray]:
    """Every E4M3 code (row r: codes 0..255) against every E8M0 byte (row r's 8 groups of
    32 columns: byte r), as make_mxfp8.py builds them."""
    q = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    s = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
    return q, s


@pytest.mark.parametrize("to", sorted(TO))
def test_model_free_ptq_mxfp8_equals_compressed_tensors(tmp_path, to):
    name, extra = TO[to]
    src = FOLDER / "model.safetensors"
    out = tmp_path / "out.safetensors"
    rc, _, err = run("convert", src, out, "--to", name, *extra)
    assert rc == 0, err
    assert hashes(out) == want(to)
    rc, _, err = run("verify", src, out, *extra)
    assert rc == 0, err
    runs = [(tmp_path / "dir", []), (tmp_path / "shards", ["--max-shard-size", "40KB"])]
    for dst, sharded in runs:
        rc, _, err = run("convert", FOLDER, dst, "--to", name, *extra, *sharded)
        assert rc == 0, err
        assert hashes(dst) == want(to)
        config = json.loads((dst / "config.json").read_text())
        assert "quantization_config" not in config
        rc, _, err = run("verify", FOLDER, dst, *extra)
        assert rc == 0, err
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) > 1


def test_verify_fails_on_a_changed_code(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FOLDER, src)
    out = tmp_path / "out"
    rc, _, err = run("convert", src, out)
    assert rc == 0, err
    tensors = tensor_bytes(src / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    dtype, shape, data = tensors[name]
    assert dtype == "F8_E4M3"
    tensors[name] = (dtype, shape, bytes([data[0] ^ 0x21]) + data[1:])
    write_safetensors(src / "model.safetensors", tensors)
    rc, _, err = run("verify", src, out)
    assert rc == 1
    assert name in assert_one_error_line(err)


@pytest.mark.parametrize(
    ("scale", "dtype", "key"),
    [
        ("weight_scale", "U8", "codes"),
        ("weight_scale_inv", "F8_E8M0", "codes_scale_inv_f8_e8m0"),
        ("weight_scale_inv", "U8", "codes_scale_inv_u8"),
    ],
)
@pytest.mark.parametrize("to", sorted(TO))
def test_every_code_against_every_e8m0_byte(tmp_path, scale, dtype, key, to):
    """compressed-tensors' MXFP8 `decompress` (U8 `weight_scale`) and transformers'
    `Fp8Dequantize` (`weight_scale_inv` in F8_E8M0 or U8), bit for bit but NaN payloads."""
    q, s = codes()
    src = write_safetensors(
        tmp_path / "q.safetensors",
        {"m.weight": ("F8_E4M3", [256, 256], q), f"m.{scale}": (dtype, [256, 8], s)},
    )
    out = tmp_path / "out.safetensors"
    rc, _, err = run("convert", src, out, "--to", to)
    assert rc == 0, err
    got = tensor_bytes(out)
    assert sorted(got) == ["m.weight"]
    out_dtype, shape, data = got["m.weight"]
    assert (out_dtype, shape) == (to.upper().replace("FP", "F"), [256, 256])
    assert canonical_sha(out_dtype, data) == EXPECTED[key][to]
    rc, _, err = run("verify", src, out)
    assert rc == 0, err


def refused(tmp_path: Path, tensors: dict) -> str:
    src = write_safetensors(tmp_path / "bad.safetensors", tensors)
    out = tmp_path / "bad-out.safetensors"
    rc, _, err = run("convert", src, out)
    assert rc == 1, err
    assert not out.exists()
    line = assert_one_error_line(err)
    assert "allow" not in line, line
    return line


def test_what_has_no_reference_is_refused(tmp_path):
    q = np.zeros((4, 64), np.uint8)
    w = ("F8_E4M3", [4, 64], q)
    # compressed-tensors casts the codes to an F8_E8M0 `weight_scale`'s dtype: no reference.
    line = refused(
        tmp_path, {"m.weight": w, "m.weight_scale": ("F8_E8M0", [4, 2], np.ones((4, 2), np.uint8))}
    )
    assert "`m.weight_scale`" in line and "F8_E8M0" in line, line
    # MXFP8 scales cover 32 columns.
    four = ("U8", [4, 4], np.ones((4, 4), np.uint8))
    line = refused(tmp_path, {"m.weight": w, "m.weight_scale": four})
    assert "`m.weight_scale`" in line and "mxfp8-quantized" in line and "32 columns" in line, line
    # MXFP8 is symmetric.
    line = refused(
        tmp_path,
        {
            "m.weight": w,
            "m.weight_scale": ("U8", [4, 2], np.ones((4, 2), np.uint8)),
            "m.weight_zero_point": ("I8", [4, 2], np.zeros((4, 2), np.int8)),
        },
    )
    assert "`m.weight_zero_point`" in line and "symmetric" in line, line
    # A ceil-divided 128x128 E8M0 grid transformers reads as 100-row blocks.
    big = ("F8_E4M3", [200, 128], np.zeros((200, 128), np.uint8))
    line = refused(
        tmp_path,
        {"m.weight": big, "m.weight_scale_inv": ("F8_E8M0", [2, 1], np.ones((2, 1), np.uint8))},
    )
    assert "`m.weight_scale_inv`" in line and "transformers" in line, line
