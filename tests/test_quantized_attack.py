"""Quantized inputs an adversary built (stop 38's attack): each once wrote a broken
checkpoint with exit 0, passed verify, or panicked. Each is now refused in one line before
anything is written, or converted as the reference would."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_one_error_line, write_safetensors

FIXTURES = Path(__file__).parent / "fixtures" / "packed"


def _read(path: Path) -> tuple[dict, bytes]:
    """A file's header (tensors by name) and its data section."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n :]


def _packed_int4(path: Path, columns: int = 120) -> Path:
    """A W4A16-style pack (`weight_packed` I32, `weight_shape`, `weight_scale`) beside an
    F32 weight."""
    rng = np.random.default_rng(0)
    words = -(-columns * 4 // 32)
    packed = rng.integers(-(2**31), 2**31, (8, words), dtype=np.int64).astype(np.int32)
    return write_safetensors(
        path,
        {
            "m.weight_packed": ("I32", [8, words], packed),
            "m.weight_shape": ("I64", [2], np.array([8, columns], np.int64)),
            "m.weight_scale": ("F32", [8, 1], np.full((8, 1), 0.01, np.float32)),
            "q.weight": ("F32", [64, 64], rng.standard_normal((64, 64)).astype(np.float32)),
        },
    )


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_packed_codes_under_an_fp8_target_are_refused(tmp_path, run_main, to):
    """An FP8 target copied the I32 codes and the shape beside FP8 weights, rounded the F32
    scale to BF16, wrote an `ignore` of nothing, and exited 0 (verify then refused convert's
    own output). Packed inputs, lone or in a folder, are quantized already."""
    src = _packed_int4(tmp_path / "pk.safetensors")
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", to)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "already quantized (tensor `m.weight_packed`" in line, line
    assert not out.exists()
    for fixture in ("llama-bf16.w4a16", "llama-bf16.nvfp4a16", "gpt-oss-mxfp4"):
        dst = tmp_path / f"{fixture}-{to}"
        rc, _, err = run_main("convert", FIXTURES / fixture, dst, "--to", to)
        assert rc == 1, (fixture, err)
        assert "already quantized" in assert_one_error_line(err)
        assert not dst.exists()


def test_a_weight_shape_past_u64_is_refused_not_a_panic(tmp_path, run_main):
    """`weight_shape` [8, 2^62]: columns x bits overflowed u64 (a panic in convert, inspect
    and verify)."""
    src = write_safetensors(
        tmp_path / "w.safetensors",
        {
            "m.weight_packed": ("I32", [8, 15], np.zeros((8, 15), np.int32)),
            "m.weight_shape": ("I64", [2], np.array([8, 2**62], np.int64)),
            "m.weight_scale": ("F32", [8, 1], np.zeros((8, 1), np.float32)),
        },
    )
    for command in ("convert", "inspect"):
        rc, _, err = run_main(command, src)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert "do not tell one bit width for 4611686018427387904 columns" in line, line


def test_a_weight_shape_not_two_integers_is_shown_plainly(tmp_path, run_main):
    src = write_safetensors(
        tmp_path / "w.safetensors",
        {
            "m.weight_packed": ("I32", [8, 15], np.zeros((8, 15), np.int32)),
            "m.weight_shape": ("I64", [2], np.array([4, 120], np.int64)),
            "m.weight_scale": ("F32", [8, 1], np.zeros((8, 1), np.float32)),
        },
    )
    rc, _, err = run_main("convert", src)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "holds [4, 120], not [8, columns]" in line and "Some(" not in line, line


def test_plain_tensors_named_like_packs_are_converted(tmp_path, run_main):
    """`seq_packed` (I32) and `x_blocks` (F32) are no quantized layout: an integer is copied,
    a float converted, as in any checkpoint."""
    src = write_safetensors(
        tmp_path / "m.safetensors",
        {
            "w": ("F32", [4], np.ones(4, np.float32)),
            "seq_packed": ("I32", [4], np.arange(4, dtype=np.int32)),
            "x_blocks": ("F32", [2, 2], np.ones((2, 2), np.float32)),
        },
    )
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out)
    assert rc == 0, err
    got = _read(out)[0]
    assert got["seq_packed"]["dtype"] == "I32" and got["x_blocks"]["dtype"] == "BF16"


def _gpt_oss_without(tmp_path: Path, rename: str | None) -> Path:
    """The gpt-oss fixture with one expert's `_blocks` renamed (or, None, deleted)."""
    src = tmp_path / "G"
    shutil.copytree(FIXTURES / "gpt-oss-mxfp4", src)
    path = src / "model.safetensors"
    header, data = _read(path)
    name = next(k for k in header if k.endswith("down_proj_blocks"))
    tensors = {
        k: (v["dtype"], v["shape"], data[v["data_offsets"][0] : v["data_offsets"][1]])
        for k, v in header.items()
    }
    entry = tensors.pop(name)
    if rename is not None:
        tensors[name[: -len("_blocks")] + rename] = entry
    write_safetensors(path, tensors)
    index = src / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"].pop(name, None)
        if rename is not None:
            doc["weight_map"][name[: -len("_blocks")] + rename] = "model.safetensors"
        index.write_text(json.dumps(doc))
    return src


@pytest.mark.parametrize("rename", ["_blockz", None])
def test_gpt_oss_scales_without_their_blocks_are_refused(tmp_path, run_main, rename):
    """A renamed or missing `_blocks` left its `_scales` (U8) copied beside dequantized
    experts, with the config's quantization_config gone: exit 0, and verify passed it."""
    src = _gpt_oss_without(tmp_path, rename)
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "down_proj_scales` is a gpt-oss MXFP4 tensor" in line, line
    assert "no `_blocks` beside it" in line, line
    assert not dst.exists()


def test_activation_scales_of_a_packed_weight_are_dropped(tmp_path, run_main):
    """NVFP4 W4A4's `input_global_scale` (F32) was rounded to BF16 and kept, an orphan in a
    dense checkpoint; like FP8's `input_scale`, it goes with the weight's quantization."""
    src = tmp_path / "W4"
    shutil.copytree(FIXTURES / "llama-bf16.nvfp4a16", src)
    path = src / "model.safetensors"
    tensors, data = _read(path)
    rebuilt = {
        k: (v["dtype"], v["shape"], data[v["data_offsets"][0] : v["data_offsets"][1]])
        for k, v in tensors.items()
    }
    added = []
    for k in list(rebuilt):
        if k.endswith(".weight_global_scale"):
            name = k.replace(".weight_global_scale", ".input_global_scale")
            rebuilt[name] = ("F32", [1], np.array([3.7], np.float32))
            added.append(name)
    assert added
    write_safetensors(path, rebuilt)
    index = src / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"].update({k: "model.safetensors" for k in added})
        index.write_text(json.dumps(doc))
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst)
    assert rc == 0, err
    got = _read(dst / "model.safetensors")[0]
    assert not [k for k in got if "global_scale" in k]
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err


def _overflowing_fp8(path: Path) -> Path:
    """An FP8 weight whose codes x scale overflow F16 (448 x 1000)."""
    return write_safetensors(
        path,
        {
            "m.weight": ("F8_E4M3", [4, 16], b"\x7e" * 64),
            "m.weight_scale": ("F32", [4, 1], np.full((4, 1), 1000, np.float32)),
        },
    )


def test_keep_refuses_a_dequantized_overflow_when_resharding_too(tmp_path, run_main):
    """`--on-overflow keep` cannot keep a dequantized weight: a lone file was refused, but a
    re-sharding wrote ±inf, exited 0 and verify passed it."""
    src = _overflowing_fp8(tmp_path / "f8.safetensors")
    for extra in ([], ["--max-shard-size", "1TB"]):
        dst = tmp_path / ("rs" if extra else "one.safetensors")
        rc, _, err = run_main("convert", src, dst, "--to", "fp16", "--on-overflow", "keep", *extra)
        assert rc == 1, (extra, err)
        assert "would become ±inf in F16 once dequantized" in err, err
        assert not dst.exists()


@pytest.mark.parametrize(
    "scale",
    [
        ("m.weight_scale", "F32", [4, 1], np.full((4, 1), 0.5, np.float32)),
        ("m.weight_scale_inv", "F32", [1, 1], np.full((1, 1), 0.5, np.float32)),
        ("m.weight_scale_inv", "F8_E8M0", [1, 1], np.full((1, 1), 126, np.uint8)),
        ("m.weight_scale", "U8", [4, 2], np.full((4, 2), 126, np.uint8)),
    ],
)
@pytest.mark.parametrize("loose", [False, True])
def test_fp8_codes_kept_without_their_scale_fail_verify(tmp_path, run_main, scale, loose):
    """A dequantized output that holds an FP8 weight's codes as they are, its scale left
    out, beside a BF16 tensor: `verify --loose` took the codes for a tensor kept in its
    dtype and passed it (attack a3 F1); a loader reads them as the weight, off by the
    scale."""
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 0x7E, (4, 64), dtype=np.uint8)
    norm = rng.standard_normal(64).astype(np.float32)
    name, dtype, shape, data = scale
    src = write_safetensors(
        tmp_path / "src.safetensors",
        {
            "m.weight": ("F8_E4M3", [4, 64], codes),
            name: (dtype, shape, data),
            "n.weight": ("F32", [64], norm),
        },
    )
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out)
    assert rc == 0, err
    rc, _, err = run_main("verify", src, out, *(["--loose"] if loose else []))
    assert rc == 0, err
    bad = write_safetensors(
        tmp_path / "bad.safetensors",
        {
            "m.weight": ("F8_E4M3", [4, 64], codes),
            "n.weight": ("BF16", [64], norm.astype(ml_dtypes.bfloat16)),
        },
    )
    rc, _, err = run_main("verify", src, bad, *(["--loose"] if loose else []))
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "bad.safetensors: tensor `m.weight` is F8_E4M3 in DST, but its scales are not" in line
