"""Adversarial round on FP8 in (dequantization to BF16/F16): exact bits against a numpy
reference, refusals, folders, verify. The bugs this round found are fixed; each has its test."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_one_error_line, tensor_bytes, write_safetensors

NP = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
TO = {"BF16": "bf16", "F16": "fp16"}
CT = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        }
    },
}


def e4m3(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def ref_dequant(q: np.ndarray, s: np.ndarray, s_dtype: str, target: str) -> np.ndarray:
    """`q.to(scale dtype) * scale`, then to the target: the reference's steps."""
    rows, cols = q.shape
    sd = NP[s_dtype]
    if s.size == 1:
        full = s.reshape(1, 1)
    elif s.shape == (rows, 1):
        full = s
    else:
        full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:rows, :cols]
    with np.errstate(over="ignore", invalid="ignore"):  # F16 products may overflow, as in torch
        prod = q.view(ml_dtypes.float8_e4m3fn).astype(sd) * full.astype(sd)
        return prod.astype(sd).astype(NP[target]).view(np.uint16)


def fp8_file(path: Path, q, scale_name: str, s_dtype: str, scale, extra=None) -> Path:
    s = np.asarray(scale).astype(NP[s_dtype])
    tensors = {
        "a.weight": ("F8_E4M3", list(q.shape), q),
        scale_name: (s_dtype, list(s.shape), s),
    }
    tensors.update(extra or {})
    return write_safetensors(path, tensors)


def folder(root: Path, shards: list[dict], config=CT) -> Path:
    root.mkdir()
    (root / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "torch_dtype": "bfloat16", "quantization_config": config}
        )
    )
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(root / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def dtypes_in(dst: Path) -> dict[str, str]:
    files = [dst] if dst.is_file() else sorted(dst.glob("*.safetensors"))
    return {k: v[0] for f in files for k, v in tensor_bytes(f).items()}


def ones_bf16(n):
    return ("BF16", [n], np.ones(n, ml_dtypes.bfloat16))


W = e4m3(np.arange(32).reshape(4, 8) - 16)
S = np.array([[0.5], [2.0], [0.25], [1.0]], np.float32)


# --- what holds ------------------------------------------------------------------------------


@pytest.mark.parametrize("s_dtype", ["F32", "BF16", "F16"])
@pytest.mark.parametrize("target", ["BF16", "F16"])
@pytest.mark.parametrize(
    "layout, shape", [("tensor", (129, 130)), ("channel", (300, 1)), ("block", (257, 700))]
)
def test_every_code_exact_and_verified(tmp_path, rng, run_main, s_dtype, target, layout, shape):
    """All 256 E4M3 codes (NaNs too), scales over a wide range (F16 ones overflow to inf)."""
    rows, cols = shape
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    if layout == "tensor":
        s = np.array(rng.standard_normal() * 3)
    elif layout == "channel":
        s = rng.standard_normal((rows, 1)) * 1e-3
    else:
        s = np.exp(rng.standard_normal((-(-rows // 128), -(-cols // 128))) * 8)
    with np.errstate(over="ignore"):
        s = s.astype(NP[s_dtype])
    src = fp8_file(tmp_path / "in.safetensors", q, "a.weight_scale", s_dtype, s)
    dst = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, dst, "--to", TO[target], "-q")
    assert rc == 0, err
    out = tensor_bytes(dst)
    assert sorted(out) == ["a.weight"]
    got = np.frombuffer(out["a.weight"][2], np.uint16).reshape(shape)
    assert np.array_equal(got, ref_dequant(q, s, s_dtype, target))
    assert run_main("verify", src, dst, "--to", TO[target])[0] == 0


def test_deepseek_scale_inv_multithreaded_window(tmp_path, rng, run_main):
    """A weight over 512 KiB (split across threads), 128x128 weight_scale_inv blocks."""
    q = rng.integers(0, 256, (1000, 1100), dtype=np.uint8)
    s = np.exp(rng.standard_normal((8, 9))).astype(np.float32)
    src = fp8_file(tmp_path / "in.safetensors", q, "a.weight_scale_inv", "F32", s)
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    got = np.frombuffer(tensor_bytes(dst)["a.weight"][2], np.uint16).reshape(q.shape)
    assert np.array_equal(got, ref_dequant(q, s, "F32", "BF16"))
    assert run_main("verify", src, dst)[0] == 0


@pytest.mark.parametrize("s_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("target", ["BF16", "F16"])
def test_scale_inv_in_16_bits_rounds_once(tmp_path, rng, run_main, s_dtype, target):
    """A `weight_scale_inv` in BF16 (Qwen3's FP8 releases) or F16: transformers'
    `Fp8Dequantize`, DeepSeek's `weight_dequant` and compressed-tensors' `FP8BlockDequantizer`
    multiply in f32 and round once to the target, never to the scale's dtype first (attack a3
    F2: an F16 scale under bf16, a BF16 one under fp16, rounded twice, differed on about 1
    element in 9). The f32 product of an E4M3 code and a 16-bit scale is exact, so numpy's
    f32 product and one cast is that reference."""
    q = rng.integers(0, 256, (300, 260), dtype=np.uint8)
    s = np.exp(rng.uniform(-12, 6, (3, 3))).astype(NP[s_dtype])
    s.reshape(-1)[:3] = [0.0, np.nan, -1.5]
    src = fp8_file(tmp_path / "in.safetensors", q, "a.weight_scale_inv", s_dtype, s)
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", TO[target], "-q")[0] == 0
    got = np.frombuffer(tensor_bytes(dst)["a.weight"][2], np.uint16).reshape(q.shape)
    full = np.repeat(np.repeat(s.astype(np.float32), 128, axis=0), 128, axis=1)[:300, :260]
    with np.errstate(over="ignore", invalid="ignore"):
        prod = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * full
        want = prod.astype(NP[target]).view(np.uint16)
    nan = np.isnan(prod)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(np.frombuffer(got[nan].tobytes(), NP[target])).all()
    assert run_main("verify", src, dst)[0] == 0


def test_odd_scales_exact(tmp_path, run_main):
    """NaN, inf, negative, zero and subnormal scales: the product, bit for bit."""
    s = np.array([[np.nan], [np.inf], [-2.0], [0.0], [1e-45], [1e-40], [6e-8], [-0.0]], np.float32)
    q = e4m3(np.linspace(-400, 400, 64).reshape(8, 8))
    src = fp8_file(tmp_path / "in.safetensors", q, "a.weight_scale", "F32", s)
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    got = np.frombuffer(tensor_bytes(dst)["a.weight"][2], np.uint16).reshape(8, 8)
    assert np.array_equal(got, ref_dequant(q, s, "F32", "BF16"))
    assert run_main("verify", src, dst)[0] == 0


def test_scales_dropped_and_input_scale_dropped(tmp_path, run_main):
    src = fp8_file(
        tmp_path / "in.safetensors",
        W,
        "a.weight_scale",
        "F32",
        S,
        {"a.input_scale": ("F32", [1], np.float32([3])), "norm.weight": ones_bf16(8)},
    )
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    assert dtypes_in(dst) == {"a.weight": "BF16", "norm.weight": "BF16"}


@pytest.mark.parametrize(
    "case",
    ["scale_shape", "e5m2", "one_d", "not_weight"],
)
def test_not_dequantizable_refused_one_line(tmp_path, run_main, case):
    """What cannot be dequantized stays a quantized checkpoint: refused, nothing written."""
    q, scale, weight, dtype = W, S, "a.weight", "F8_E4M3"
    if case == "scale_shape":
        scale = np.ones((2, 1), np.float32)
    elif case == "e5m2":
        dtype = "F8_E5M2"
    elif case == "one_d":
        q = W.reshape(32)
        scale = np.float32([2])
    else:
        weight = "a.w"
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {weight: (dtype, list(q.shape), q), f"{weight}_scale": ("F32", list(scale.shape), scale)},
    )
    dst = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16")
    assert rc == 1
    # A scale of no layout of its weight is named with its shape (issue 30).
    want = "shape [2, 1]" if case == "scale_shape" else "quantized checkpoint"
    assert want in assert_one_error_line(err)
    assert not dst.exists()


def test_int8_config_folder_refused(tmp_path, run_main):
    config = json.loads(json.dumps(CT))
    config["config_groups"]["group_0"]["weights"]["type"] = "int"
    src = folder(
        tmp_path / "in",
        [
            {
                "a.weight": ("I8", [4, 8], W.view(np.int8)),
                "a.weight_scale": ("F32", [4, 1], S),
                "norm.weight": ("F32", [8], np.ones(8, np.float32)),
            }
        ],
        config,
    )
    rc, _, err = run_main("convert", src, tmp_path / "out", "--to", "bf16")
    assert rc == 1
    # Its I8 weights with scales are int-quantized ones, which a config of float weights
    # does not describe (issue 32).
    assert "not a scheme stcast dequantizes" in assert_one_error_line(err)
    assert not (tmp_path / "out").exists()


def test_single_shard_folder_dequantized_and_verified(tmp_path, run_main):
    src = folder(
        tmp_path / "in",
        [{"a.weight": ("F8_E4M3", [4, 8], W), "a.weight_scale": ("F32", [4, 1], S)}],
    )
    dst = tmp_path / "out"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["a.weight"]
    assert run_main("verify", src, dst)[0] == 0


def test_verify_tampered_element_and_readded_scale(tmp_path, run_main):
    src = fp8_file(tmp_path / "in.safetensors", W, "a.weight_scale", "F32", S)
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    good = np.frombuffer(tensor_bytes(dst)["a.weight"][2], ml_dtypes.bfloat16).reshape(4, 8).copy()
    bad = good.copy()
    bad.view(np.uint16)[2, 3] ^= 1
    t1 = write_safetensors(tmp_path / "t1.safetensors", {"a.weight": ("BF16", [4, 8], bad)})
    rc, _, err = run_main("verify", src, t1)
    assert rc == 1 and "a.weight" in assert_one_error_line(err)
    t2 = write_safetensors(
        tmp_path / "t2.safetensors",
        {"a.weight": ("BF16", [4, 8], good), "a.weight_scale": ("F32", [4, 1], S)},
    )
    assert run_main("verify", src, t2)[0] == 1


# --- bugs ------------------------------------------------------------------------------------


def no_raw_fp8_left(rc: int, err: str, dst: Path) -> None:
    """Refused in one line with nothing written, or every FP8 weight dequantized."""
    if rc != 0:
        assert_one_error_line(err)
        assert not dst.exists()
    else:
        assert "F8_E4M3" not in dtypes_in(dst).values()


def test_verify_two_shard_dequantized_folder(tmp_path, run_main):
    src = folder(
        tmp_path / "in",
        [
            {"a.weight": ("F8_E4M3", [4, 8], W), "a.weight_scale": ("F32", [4, 1], S)},
            {"b.weight": ("F8_E4M3", [4, 8], W), "b.weight_scale": ("F32", [4, 1], S)},
        ],
    )
    dst = tmp_path / "out"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err


def test_verify_fp16_dequantization_without_to(tmp_path, run_main):
    src = fp8_file(tmp_path / "in.safetensors", W, "a.weight_scale", "F32", S)
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "fp16", "-q")[0] == 0
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err


def test_scale_in_other_shard(tmp_path, run_main):
    src = folder(
        tmp_path / "in",
        [
            {
                "a.weight": ("F8_E4M3", [4, 8], W),
                "a.weight_scale": ("F32", [4, 1], S),
                "b.weight_scale": ("F32", [4, 1], S),
            },
            {"b.weight": ("F8_E4M3", [4, 8], W), "norm.weight": ones_bf16(8)},
        ],
    )
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16", "-q")
    no_raw_fp8_left(rc, err, dst)


@pytest.mark.parametrize("scale", ["none", "bad_shape"])
def test_unscaled_fp8_weight_in_bf16_shard(tmp_path, run_main, scale):
    second = {"b.weight": ("F8_E4M3", [4, 8], W), "norm.weight": ones_bf16(8)}
    if scale == "bad_shape":
        second["b.weight_scale"] = ("BF16", [3, 1], np.ones((3, 1), ml_dtypes.bfloat16))
    src = folder(
        tmp_path / "in",
        [{"a.weight": ("F8_E4M3", [4, 8], W), "a.weight_scale": ("F32", [4, 1], S)}, second],
    )
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16", "-q")
    no_raw_fp8_left(rc, err, dst)


def test_f64_scale(tmp_path, run_main):
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {
            "a.weight": ("F8_E4M3", [4, 8], W),
            "a.weight_scale": ("F64", [4, 1], S.astype(np.float64)),
        },
    )
    dst = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16", "-q")
    no_raw_fp8_left(rc, err, dst)


def test_verify_names_the_missing_tensor(tmp_path, run_main):
    src = fp8_file(
        tmp_path / "in.safetensors",
        W,
        "a.weight_scale",
        "F32",
        S,
        {
            "a.input_scale": ("F32", [1], np.float32([1])),
            "norm.weight": ("F32", [8], np.ones(8, np.float32)),
        },
    )
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    weight = tensor_bytes(dst)["a.weight"][2]
    t = write_safetensors(tmp_path / "t.safetensors", {"a.weight": ("BF16", [4, 8], weight)})
    rc, _, err = run_main("verify", src, t)
    assert rc == 1
    assert "norm.weight" in assert_one_error_line(err)


def test_verify_loose_missing_tensor_for_a_readded_scale(tmp_path, run_main):
    src = fp8_file(
        tmp_path / "in.safetensors",
        W,
        "a.weight_scale",
        "F32",
        S,
        {"norm.weight": ("F32", [8], np.ones(8, np.float32))},
    )
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    weight = tensor_bytes(dst)["a.weight"][2]
    t = write_safetensors(
        tmp_path / "t.safetensors",
        {"a.weight": ("BF16", [4, 8], weight), "a.weight_scale": ("F32", [4, 1], S)},
    )
    assert run_main("verify", src, t, "--loose")[0] == 1


def test_file_fp8_weight_without_scale_beside_a_dequantized_one(tmp_path, run_main):
    src = fp8_file(
        tmp_path / "in.safetensors",
        W,
        "a.weight_scale",
        "F32",
        S,
        {"b.weight": ("F8_E4M3", [4, 8], W)},
    )
    dst = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16", "-q")
    no_raw_fp8_left(rc, err, dst)


def test_fp8_weight_without_scale_alone_refused(tmp_path, run_main):
    """Without any dequantizable weight, an unscaled FP8 weight changes nothing: exit 1."""
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {"b.weight": ("F8_E4M3", [4, 8], W), "norm.weight": ones_bf16(8)},
    )
    dst = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16")
    assert rc == 1
    assert_one_error_line(err)
    assert not dst.exists()


def test_shards_finalize_and_resume_fp8_folder(tmp_path, run_main):
    shards = [
        {"a.weight": ("F8_E4M3", [4, 8], W), "a.weight_scale": ("F32", [4, 1], S)},
        {
            "b.weight": ("F8_E4M3", [4, 8], W),
            "b.weight_scale": ("F32", [4, 1], S),
            "norm.weight": ones_bf16(8),
        },
    ]
    src = folder(tmp_path / "in", shards)
    whole = tmp_path / "whole"
    assert run_main("convert", src, whole, "--to", "bf16", "-q")[0] == 0
    out = tmp_path / "dst"
    for i in (1, 2):
        rc, _, err = run_main("convert", src, out, "--to", "bf16", "--shard", f"{i}/2", "-q")
        assert rc == 0, err
    assert run_main("finalize", src, out)[0] == 0
    want = {p.name: p.read_bytes() for p in whole.iterdir()}
    assert {p.name: p.read_bytes() for p in out.iterdir()} == want
    assert run_main("convert", src, whole, "--to", "bf16", "--resume", "-q")[0] == 0
    assert {p.name: p.read_bytes() for p in whole.iterdir()} == want


def test_refused_run_leaves_dst(tmp_path, run_main):
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {"a.weight": ("F8_E4M3", [4, 8], W), "a.weight_scale": ("F32", [3, 1], S[:3])},
    )
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    rc, _, err = run_main("convert", src, dst, "--to", "bf16", "--force")
    assert rc == 1
    assert_one_error_line(err)
    assert dst.read_bytes() == b"old"


def test_sigint_mid_dequantization_leaves_dst(tmp_path, rng, cli_process):
    q = rng.integers(0, 126, (4096, 4096), dtype=np.uint8)
    src = fp8_file(tmp_path / "in.safetensors", q, "a.weight_scale", "F32", np.ones((4096, 1)))
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    rc, _, _ = cli_process(
        "convert",
        src,
        dst,
        "--to",
        "bf16",
        "--force",
        env={"STCAST_FAILPOINT": "mid-tensor=sigint"},
    )
    assert rc != 0
    assert dst.read_bytes() == b"old"


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_fp8_out_odd_shapes_exact(tmp_path, rng, run_main, to):
    """[1, n], [n, 1], 129x129 near F16's largest values, subnormal amax in F16 and BF16."""
    from test_fp8 import ref_quantize

    tensors = {}
    for i, shape in enumerate([(1, 300), (300, 1), (129, 129)]):
        w = np.clip(rng.standard_normal(shape) * 3e4, -65504, 65504).astype(np.float16)
        tensors[f"l{i}.weight"] = ("F16", list(shape), w)
    tensors["sub.weight"] = ("F16", [3, 4], np.full((3, 4), 6e-8, np.float16))
    tensors["bsub.weight"] = ("BF16", [3, 4], np.full((3, 4), 1e-39, ml_dtypes.bfloat16))
    tensors["big.weight"] = ("F16", [2, 2], np.array([[65504, -65504], [1, 0]], np.float16))
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", to, "-q")[0] == 0
    out = tensor_bytes(dst)
    for name, (d, _, w) in tensors.items():
        q, s = ref_quantize(w, d, to)
        assert out[name][2] == q.tobytes() and out[f"{name}_scale"][2] == s.tobytes(), name
    assert run_main("verify", src, dst)[0] == 0


# --- Adversarial round 2 (branch `attack`): overflow of a dequantization, config keys ---


def fp8_overflow_file(path: Path, scale: float) -> Path:
    """`l.weight` E4M3 codes 448 with a per-channel F32 scale [scale, 1], and a norm."""
    codes = np.full((2, 4), 448, np.float32).astype(ml_dtypes.float8_e4m3fn)
    return write_safetensors(
        path,
        {
            "l.weight": ("F8_E4M3", [2, 4], codes.tobytes()),
            "l.weight_scale": ("F32", [2, 1], np.float32([[scale], [1.0]]).tobytes()),
            "n.weight": ("F32", [4], np.ones(4, np.float32)),
        },
    )


def test_fp8_dequant_to_fp16_overflow_error(tmp_path, run_main):
    """448 * 1000 is finite and beyond fp16. Was: `--on-overflow error` exit 0 with four inf
    written (a dequantization's overflow was not counted). Now: exit 1, nothing written."""
    src = fp8_overflow_file(tmp_path / "in.safetensors", 1000.0)
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", "fp16", "--on-overflow", "error")
    assert rc == 1, err
    assert_one_error_line(err)
    assert "l.weight" in err and "4 finite values" in err, err
    assert not out.exists()


def test_fp8_dequant_to_fp16_overflow_warned(tmp_path, run_main):
    """Was: `--on-overflow warn` wrote inf silently. Now the inf are written and warned
    about, naming the tensor, as any conversion's; verify passes what convert wrote."""
    src = fp8_overflow_file(tmp_path / "in.safetensors", 1000.0)
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", "fp16", "--on-overflow", "warn")
    assert rc == 0, err
    assert "4 finite values" in err and "l.weight" in err, err
    raw = tensor_bytes(out)["l.weight"][2]
    assert int(np.isinf(np.frombuffer(raw, np.float16)).sum()) == 4
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err


def test_fp8_dequant_to_fp16_overflow_keep_refused(tmp_path, run_main):
    """Was: `--on-overflow keep` wrote inf silently. A dequantized weight has no dtype of its
    own to keep (its FP8 codes mean nothing without the scale dequantization drops): the
    run is refused in one line naming the tensor, nothing written. Within range it passes."""
    src = fp8_overflow_file(tmp_path / "in.safetensors", 1000.0)
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", "fp16", "--on-overflow", "keep")
    assert rc == 1, err
    # The notice of keep's extra read, then the error line.
    assert_one_error_line(err.splitlines(keepends=True)[-1])
    assert "`l.weight`" in err and "once dequantized" in err, err
    assert not out.exists()
    ok = fp8_overflow_file(tmp_path / "ok.safetensors", 2.0)
    rc, _, err = run_main("convert", ok, out, "--to", "fp16", "--on-overflow", "keep")
    assert rc == 0, err
    assert tensor_bytes(out)["l.weight"][0] == "F16"


def modelopt_folder(path: Path, quantization_config: dict, index: bool = True) -> Path:
    """FP8 weights with per-tensor F32 scales (as NVIDIA ModelOpt's FP8 releases hold them),
    an index and a config.json with `quantization_config`."""
    path.mkdir()
    codes = np.full((4, 8), 1.0, np.float32).astype(ml_dtypes.float8_e4m3fn)
    half = np.float32(0.5).reshape(())
    tensors = {
        "l.weight": ("F8_E4M3", [4, 8], codes.tobytes()),
        "l.weight_scale": ("F32", [], half.tobytes()),
        "l.input_scale": ("F32", [], half.tobytes()),
        "n.weight": ("BF16", [8], np.ones(8, ml_dtypes.bfloat16)),
    }
    write_safetensors(path / "model.safetensors", tensors)
    if index:
        doc = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
        (path / "model.safetensors.index.json").write_text(json.dumps(doc))
    config = {"model_type": "llama", "quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(config))
    return path


UNREAD = pytest.mark.parametrize(
    "qc",
    [{"quant_method": "modelopt", "quant_algo": "FP8"}, {"quant_method": "compressed-tensors"}],
    ids=["modelopt", "ct-no-groups"],
)


@UNREAD
@pytest.mark.parametrize("index", [True, False])
def test_fp8_folder_unknown_config_refused_up_front(tmp_path, run_main, qc, index):
    """A config whose quantization stcast does not read (ModelOpt's, compressed-tensors
    without config_groups) over FP8 weights with scales. Was: with an index, exit 1 mid-run
    leaving a manifest and a shard in DST; without, dequantized with the config still
    saying quantized, and verify passed. Now refused before anything is written, naming the
    config, whatever flag; verify refuses an output of such a source."""
    src = modelopt_folder(tmp_path / "src", qc, index)
    out = tmp_path / "out"
    for extra in ([], ["--allow-quantized"]):
        rc, _, err = run_main("convert", src, out, "--to", "bf16", *extra)
        assert rc == 1, err
        assert_one_error_line(err)
        assert "config.json" in err and "not a scheme stcast dequantizes" in err, err
        assert not out.exists()
    # Another tool's dequantization that kept the config: verify refuses it.
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "model.safetensors").unlink()
    codes = np.full((4, 8), 0.5, ml_dtypes.bfloat16)
    write_safetensors(
        out / "model.safetensors",
        {
            "l.weight": ("BF16", [4, 8], codes),
            "n.weight": ("BF16", [8], np.ones(8, ml_dtypes.bfloat16)),
        },
    )
    if index:
        (out / "model.safetensors.index.json").unlink()
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", src, out, *loose)
        assert rc == 1, err


def test_fp8_folder_compression_config_dropped_after_dequantization(tmp_path, run_main):
    """The committed model_free_ptq output with its scheme under `compression_config` (the
    older key, which vLLM still reads). Was: dequantized, but config.json kept the key and
    verify passed. Now the key is dropped as `quantization_config` is, and verify wants so."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(Path(__file__).parent / "fixtures" / "fp8" / "llama-fp32.fp8-dynamic", src)
    doc = json.loads((src / "config.json").read_text())
    doc["compression_config"] = doc.pop("quantization_config")
    (src / "config.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, "--to", "bf16")
    assert rc == 0, err
    got = json.loads((out / "config.json").read_text())
    assert "compression_config" not in got and "quantization_config" not in got
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err
    (out / "config.json").write_text((src / "config.json").read_text())
    rc, _, err = run_main("verify", src, out, "--loose")
    assert rc == 1, err


def test_fp8_one_row_group_scale_ambiguous_refused(tmp_path, run_main):
    """Weight [1, 200], scales [1, 2], config `strategy: group, group_size: 100`. Was: read
    as 128-column blocks (columns 100..127 scaled by 1, not 2), exit 0, verify agreeing.
    `[1, 2]` is both layouts of a one-row weight 128 does not divide: refused as ambiguous,
    naming the scale, nothing written; a width 128 divides is dequantized as before."""
    src = tmp_path / "src"
    src.mkdir()
    codes = np.ones((1, 200), np.float32).astype(ml_dtypes.float8_e4m3fn)
    write_safetensors(
        src / "model.safetensors",
        {
            "a.weight": ("F8_E4M3", [1, 200], codes.tobytes()),
            "a.weight_scale": ("F32", [1, 2], np.float32([[1.0, 2.0]]).tobytes()),
        },
    )
    group = json.loads(json.dumps(CT))
    group["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=100)
    config = {"model_type": "llama", "quantization_config": group}
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, "--to", "bf16")
    assert rc == 1, err
    assert_one_error_line(err)
    assert "a.weight_scale" in err and "ambiguous" in err, err
    assert not out.exists()
    lone = tmp_path / "one.safetensors"
    rc, _, err = run_main("convert", src / "model.safetensors", lone, "--to", "bf16")
    assert rc == 1 and "ambiguous" in err, err
    codes = np.ones((1, 256), np.float32).astype(ml_dtypes.float8_e4m3fn)
    wide = write_safetensors(
        tmp_path / "wide.safetensors",
        {
            "a.weight": ("F8_E4M3", [1, 256], codes.tobytes()),
            "a.weight_scale": ("F32", [1, 2], np.float32([[1.0, 2.0]]).tobytes()),
        },
    )
    rc, _, err = run_main("convert", wide, lone, "--to", "bf16")
    assert rc == 0, err
    got = np.frombuffer(tensor_bytes(lone)["a.weight"][2], ml_dtypes.bfloat16).astype(np.float32)
    assert got.tolist() == [1.0] * 128 + [2.0] * 128
