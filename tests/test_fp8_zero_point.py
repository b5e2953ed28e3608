"""FP8 input with zero points (compressed-tensors' asymmetric schemes) and scales stcast must
refuse: `(q - zp) * s` exactly as compressed-tensors 0.19 computes it (docs/rounding.md
derives the steps), against an independent numpy reference; verify recomputes it; what
cannot be proved exact is refused in one line naming the tensor (issue 30, findings 8, 11).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_one_error_line, tensor_bytes, write_safetensors

NP = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
ZP = {"I8": np.int8, "I16": np.int16, "I32": np.int32}
TO = {"BF16": "bf16", "F16": "fp16"}
FIX = Path(__file__).parent / "fixtures" / "fp8"


def e4m3(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def index_map(layout: str, rows: int, cols: int, scale_shape: tuple[int, ...]) -> np.ndarray:
    """For each element of a rows x cols weight, the flat index of its scale (and zero
    point): compressed-tensors' broadcasting of `[1]`, `[O, 1]`, `[O, G]` (groups of I/G
    columns) and `[ceil(O/128), ceil(I/128)]` (128x128 blocks, edge blocks partial)."""
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    if layout == "tensor":
        return np.zeros((rows, cols), np.int64)
    if layout == "channel":
        return np.broadcast_to(r, (rows, cols))
    if layout == "group":
        groups = scale_shape[1]
        return r * groups + c // (cols // groups)
    return (r // 128) * -(-cols // 128) + c // 128


def zp_as_f32(zp: np.ndarray, zp_dtype: str) -> np.ndarray:
    """`zp.to(float32)`: E4M3 exactly; integers by C's int-to-float cast (RNE)."""
    if zp_dtype == "F8_E4M3":
        return zp.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return zp.astype(np.float32)


def to_s(x: np.ndarray, s_dtype: str) -> np.ndarray:
    """Round f32 values to the scale's dtype S (RNE) and widen back to f32 (exact)."""
    return x.astype(NP[s_dtype]).astype(np.float32)


def ref_dequant(q, s, zp, zp_dtype, s_dtype, target, layout) -> np.ndarray:
    """compressed-tensors' `_dequantize` in S, step by step (each op of torch on bf16/f16
    tensors runs in f32 and rounds to S), then `.to(target)`: uint16 bits."""
    rows, cols = q.shape
    at = index_map(layout, rows, cols, s.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        x = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # q.to(S): exact
        if zp is not None:
            z = to_s(zp_as_f32(zp, zp_dtype), s_dtype).reshape(-1)[at]  # zp.to(S)
            x = to_s(x - z, s_dtype)  # - in S
        scale = s.astype(np.float32).reshape(-1)[at]
        prod = to_s(x * scale, s_dtype)  # * s in S
        return prod.astype(NP[s_dtype]).astype(NP[target]).view(np.uint16)


def same_bits(got: np.ndarray, want: np.ndarray, target: str) -> bool:
    """Equal bits, but any NaN for a NaN (NaN payloads are not a policy: torch's depend on
    its code path; docs/rounding.md)."""
    nan = 0x7F80 if target == "BF16" else 0x7C00

    def is_nan(b):
        return (b & nan == nan) & (b & ~np.uint16(nan | 0x8000) != 0)

    gn, wn = is_nan(got), is_nan(want)
    return bool(np.array_equal(gn, wn) and np.array_equal(got[~gn], want[~wn]))


def zero_points(rng, zp_dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Zero points over the dtype's range, edges included: every E4M3 code (NaN too), the
    integer extremes, and for I32 values whose f32 and bf16 roundings differ (2^24+2^16+1
    rounds twice: to 2^24+2^16 in f32, then to 2^24 in bf16, not 2^24+2^17)."""
    n = int(np.prod(shape))
    if zp_dtype == "F8_E4M3":
        edges = np.arange(256, dtype=np.uint8)
        return np.resize(np.concatenate([edges, rng.integers(0, 256, n, np.uint8)]), n).reshape(
            shape
        )
    info = np.iinfo(ZP[zp_dtype])
    edges = [0, 1, -1, 7, -448, 448, 257, -257, info.min, info.max]
    if zp_dtype == "I32":
        edges += [2**24 + 2**16 + 1, -(2**24 + 3), 65519, 65520, 2**30 + 2**22 + 2**7]
    small = rng.integers(-600, 600, n)
    wide = rng.integers(info.min, info.max, n, endpoint=True)
    mixed = np.where(rng.random(n) < 0.7, small.clip(info.min, info.max), wide)
    out = np.resize(np.concatenate([np.array(edges), mixed]), n)
    return out.astype(ZP[zp_dtype]).reshape(shape)


# name -> (layout, weight shape, scale shape)
LAYOUTS = {
    "tensor": ("tensor", (129, 130), (1,)),
    "channel": ("channel", (300, 64), (300, 1)),
    "group128": ("group", (7, 384), (7, 3)),
    "group96": ("group", (5, 384), (5, 4)),
    "block": ("block", (257, 700), (3, 6)),
}


def zp_file(path: Path, q, s, s_dtype, zp, zp_dtype, extra=None) -> Path:
    tensors = {
        "a.weight": ("F8_E4M3", list(q.shape), q),
        "a.weight_scale": (s_dtype, list(s.shape), s),
    }
    if zp is not None:
        tensors["a.weight_zero_point"] = (zp_dtype, list(zp.shape), zp)
    tensors.update(extra or {})
    return write_safetensors(path, tensors)


def make_case(rng, name, s_dtype, zp_dtype):
    _, shape, s_shape = LAYOUTS[name]
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    q.reshape(-1)[:256] = np.arange(256)  # every E4M3 code, NaNs too
    with np.errstate(over="ignore"):
        s = np.exp(rng.standard_normal(s_shape) * 6).astype(NP[s_dtype])
    s.reshape(-1)[0] = 0.5
    zp = zero_points(rng, zp_dtype, s_shape)
    if zp.size == 1:  # one zero point: not 0 (nor NaN), so that it shows
        zp[...] = e4m3([-5.0])[0] if zp_dtype == "F8_E4M3" else 77
    return q, s, zp


@pytest.mark.parametrize("zp_dtype", ["F8_E4M3", "I8", "I16", "I32"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("s_dtype", ["F32", "BF16", "F16"])
def test_zero_point_exact_and_verified(tmp_path, rng, run_main, s_dtype, name, zp_dtype):
    """All 256 E4M3 codes, zero points over their dtype's range, scales over a wide range:
    both targets bit for bit against the reference; verify passes what convert wrote; the
    zero point is dropped with the scale."""
    layout = LAYOUTS[name][0]
    q, s, zp = make_case(rng, name, s_dtype, zp_dtype)
    src = zp_file(tmp_path / "in.safetensors", q, s, s_dtype, zp, zp_dtype)
    for target in ("BF16", "F16"):
        dst = tmp_path / f"out-{target}.safetensors"
        rc, _, err = run_main("convert", src, dst, "--to", TO[target], "-q")
        assert rc == 0, err
        out = tensor_bytes(dst)
        assert sorted(out) == ["a.weight"]
        got = np.frombuffer(out["a.weight"][2], np.uint16).reshape(q.shape)
        want = ref_dequant(q, s, zp, zp_dtype, s_dtype, target, layout)
        assert same_bits(got, want, target)
        # Not what a dequantization without the zero point gives (the bug this fixes).
        without = ref_dequant(q, s, None, None, s_dtype, target, layout)
        assert not same_bits(got, without, target)
        rc, _, err = run_main("verify", src, dst, "--to", TO[target])
        assert rc == 0, err


def test_scalar_scale_and_zero_point_shapes(tmp_path, rng, run_main):
    """One scale: `[]`, `[1]` or `[1, 1]` for both, in any pairing."""
    q = rng.integers(0, 256, (3, 5), dtype=np.uint8)
    for s_shape, z_shape in [((), ()), ((1,), ()), ((), (1, 1)), ((1, 1), (1,))]:
        s = np.full(s_shape, 0.75, np.float32)
        zp = np.full(z_shape, 3, np.int8)
        src = zp_file(tmp_path / "in.safetensors", q, s, "F32", zp, "I8")
        dst = tmp_path / "out.safetensors"
        rc, _, err = run_main("convert", src, dst, "--to", "bf16", "-q", "--force")
        assert rc == 0, err
        got = np.frombuffer(tensor_bytes(dst)["a.weight"][2], np.uint16).reshape(q.shape)
        want = ref_dequant(q, s.reshape(1), zp.reshape(1), "I8", "F32", "BF16", "tensor")
        assert same_bits(got, want, "BF16")
        assert run_main("verify", src, dst)[0] == 0


def test_reference_steps_on_known_values():
    """The reference against values worked by hand: (q - zp) * s, each step in S."""
    q = e4m3([[3.0, -448.0, 0.0625]])
    # bf16: 3 - 257 -> zp 257 rounds to 256 in bf16; (3 - 256) = -253 -> bf16 -253 (exact);
    # * 0.5 = -126.5 -> bf16 -126.5 (8 significant bits: exact).
    s = np.array([[0.5]], ml_dtypes.bfloat16)
    got = ref_dequant(q, s, np.int32([[257]]), "I32", "BF16", "BF16", "channel")
    want = np.array([-126.5, (-448 - 256) * 0.5, (0.0625 - 256) * 0.5], np.float32)
    assert np.array_equal(got[0], want.astype(ml_dtypes.bfloat16).view(np.uint16))
    # I32 zero point rounded twice (f32, then bf16): 2^24 + 2^16 + 1 -> 2^24.
    z = to_s(zp_as_f32(np.int32([2**24 + 2**16 + 1]), "I32"), "BF16")
    assert z[0] == 2.0**24


def test_tampered_zero_point_caught(tmp_path, rng, run_main):
    """verify recomputes with the zero point: an output made without it fails, and so does
    the right output against a SRC whose zero point changed in one group."""
    q, s, zp = make_case(rng, "channel", "F32", "I8")
    zp[:] = np.where(zp == 0, 1, zp)
    src = zp_file(tmp_path / "in.safetensors", q, s, "F32", zp, "I8")
    dst = tmp_path / "out.safetensors"
    assert run_main("convert", src, dst, "--to", "bf16", "-q")[0] == 0
    assert run_main("verify", src, dst)[0] == 0
    # The output without the zero point (`q * s`, what stcast wrote before).
    wrong = ref_dequant(q, s, None, None, "F32", "BF16", "channel")
    bad = write_safetensors(
        tmp_path / "bad.safetensors", {"a.weight": ("BF16", list(q.shape), wrong)}
    )
    rc, _, err = run_main("verify", src, bad)
    assert rc == 1 and "a.weight" in err, err
    # One zero point changed in SRC.
    zp2 = zp.copy()
    zp2[17, 0] = zp2[17, 0] + 1 if zp2[17, 0] < 127 else 0
    src2 = zp_file(tmp_path / "in2.safetensors", q, s, "F32", zp2, "I8")
    rc, _, err = run_main("verify", src2, dst)
    assert rc == 1 and "a.weight" in err, err
    # And a DST that kept the zero point beside its dequantized weight is not convert's.
    out = tensor_bytes(dst)["a.weight"]
    kept = write_safetensors(
        tmp_path / "kept.safetensors",
        {"a.weight": out, "a.weight_zero_point": ("I8", list(zp.shape), zp)},
    )
    rc, _, err = run_main("verify", src, kept)
    assert rc == 1 and "a.weight_zero_point" in err, err


@pytest.mark.parametrize("with_zero_point", [True, False])
def test_folder_with_zero_points_sharded_and_verified(tmp_path, rng, run_main, with_zero_point):
    """A two-shard folder (with zero points, or without): converted, and resharded with
    each weight's scale and zero point in its shard even where the weight alone is over the
    size (the cut left them apart, and the weight was copied as FP8, exit 0); every scale and
    zero point dropped from the index; verified."""
    shards = []
    for name in ("a", "b"):
        q, s, zp = make_case(rng, "channel", "BF16", "F8_E4M3")
        shards.append(
            {
                f"{name}.weight": ("F8_E4M3", list(q.shape), q),
                f"{name}.weight_scale": ("BF16", list(s.shape), s),
            }
        )
        if with_zero_point:
            shards[-1][f"{name}.weight_zero_point"] = ("F8_E4M3", list(zp.shape), zp)
    # (Without zero points the config says symmetric: an asymmetric one is refused, below.)
    root = asym_folder(tmp_path / "in", shards, symmetric=not with_zero_point)
    for extra in ([], ["--max-shard-size", "30KB"]):
        dst = tmp_path / f"out{len(extra)}"
        rc, _, err = run_main("convert", root, dst, "--to", "bf16", "-q", *extra)
        assert rc == 0, err
        names = {}
        for f in sorted(dst.glob("*.safetensors")):
            names.update({k: v[0] for k, v in tensor_bytes(f).items()})
        assert names == {"a.weight": "BF16", "b.weight": "BF16"}
        index = dst / "model.safetensors.index.json"
        if index.exists():
            assert set(json.loads(index.read_text())["weight_map"]) == set(names)
        rc, _, err = run_main("verify", root, dst)
        assert rc == 0, err


def asym_folder(root: Path, shards: list[dict], symmetric: bool = False) -> Path:
    """A folder of compressed-tensors asymmetric FP8 shards (`symmetric`: symmetric ones),
    with its config and index."""
    root.mkdir()
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(root / fname, tensors)
        weight_map.update(dict.fromkeys(tensors, fname))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    weights = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": symmetric}
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    doc = {"model_type": "llama", "torch_dtype": "bfloat16", "quantization_config": config}
    (root / "config.json").write_text(json.dumps(doc))
    return root


@pytest.mark.parametrize("zp_dtype", ["F8_E4M3", "I8"])
@pytest.mark.parametrize("extra", [[], ["--max-shard-size", "30KB"]])
def test_zero_point_in_another_shard_refused(tmp_path, rng, run_main, zp_dtype, extra):
    """A weight dequantized in one shard while its zero point is in another would be `q * s`:
    the whole folder is refused, naming the weight that its asymmetric config says has a zero
    point its shard lacks (or the stray zero point), and nothing is written."""
    q, s, zp = make_case(rng, "channel", "BF16", zp_dtype)
    src = asym_folder(
        tmp_path / "in",
        [
            {
                "a.weight": ("F8_E4M3", list(q.shape), q),
                "a.weight_scale": ("BF16", list(s.shape), s),
            },
            {
                "a.weight_zero_point": (zp_dtype, list(zp.shape), zp),
                "norm.weight": ("BF16", [4], np.ones(4, ml_dtypes.bfloat16)),
            },
        ],
    )
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16", *extra)
    assert rc == 1
    line = assert_one_error_line(err)
    assert "`a.weight_zero_point`" in line or "`a.weight`" in line, line
    assert "zero point" in line, line
    assert not dst.exists()


# --- refused: one line, naming the tensor and what is wrong; nothing written --------------

W = e4m3(np.arange(32).reshape(4, 8) - 16)
S = np.array([[0.5], [2.0], [0.25], [1.0]], np.float32)
ZP8 = np.int8([[1], [2], [3], [4]])


def refused(tmp_path, run_main, tensors, *expected: str) -> str:
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    dst = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16")
    line = assert_one_error_line(err)
    assert rc == 1, err
    for e in expected:
        assert e in line, line
    assert not dst.exists()
    return line


def test_two_scales_refused_naming_both(tmp_path, run_main):
    """Finding 11: both `weight_scale` and `weight_scale_inv`: ambiguous, not "a scale whose
    weight is not in this file"."""
    line = refused(
        tmp_path,
        run_main,
        {
            "a.weight": ("F8_E4M3", [4, 8], W),
            "a.weight_scale": ("F32", [4, 1], S),
            "a.weight_scale_inv": ("F32", [4, 1], S),
        },
        "`a.weight`",
        "`a.weight_scale`",
        "`a.weight_scale_inv`",
        "ambiguous",
    )
    assert "not in this file" not in line


@pytest.mark.parametrize("dtype", ["I32", "I8", "U8", "F64", "F8_E4M3"])
def test_scale_dtype_refused_naming_it(tmp_path, run_main, dtype):
    """Finding 11: an FP8 weight with an integer (or F64, or FP8) scale is named with the
    dtype, not "nothing to convert ... a copy of the input"."""
    np_dtype = {"I32": np.int32, "I8": np.int8, "U8": np.uint8, "F64": np.float64}
    data = e4m3(S) if dtype == "F8_E4M3" else S.astype(np_dtype[dtype])
    line = refused(
        tmp_path,
        run_main,
        {"a.weight": ("F8_E4M3", [4, 8], W), "a.weight_scale": (dtype, [4, 1], data)},
        "`a.weight_scale`",
        f"in {dtype}",
        "`a.weight`",
    )
    assert "nothing to convert" not in line


@pytest.mark.parametrize(
    "zp_dtype, zp_shape, words",
    [
        ("F32", [4, 1], ["`a.weight_zero_point`", "in F32", "zero points in"]),
        ("BF16", [4, 1], ["`a.weight_zero_point`", "in BF16"]),
        ("U8", [4, 1], ["`a.weight_zero_point`", "in U8"]),
        ("I64", [4, 1], ["`a.weight_zero_point`", "in I64"]),
        # compressed-tensors' packed int4 zero points: [O, ceil(G/8)] int32.
        ("I32", [1, 1], ["`a.weight_zero_point`", "shape [1, 1]", "[4, 1]"]),
        ("I8", [4], ["`a.weight_zero_point`", "shape [4]"]),
        ("I8", [1, 4], ["`a.weight_zero_point`", "shape [1, 4]"]),
    ],
)
def test_zero_point_format_refused(tmp_path, run_main, zp_dtype, zp_shape, words):
    """A zero point stcast cannot prove exact (dtype, or not shaped as its scale, as packed
    ones are not) is refused naming it: never ignored nor copied."""
    n = int(np.prod(zp_shape))
    np_dtype = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "U8": np.uint8, "I64": np.int64}
    data = np.ones(n, np_dtype.get(zp_dtype, ZP.get(zp_dtype)))
    refused(
        tmp_path,
        run_main,
        {
            "a.weight": ("F8_E4M3", [4, 8], W),
            "a.weight_scale": ("F32", [4, 1], S),
            "a.weight_zero_point": (zp_dtype, zp_shape, data),
        },
        *words,
    )


def test_zero_point_beside_scale_inv_refused(tmp_path, run_main):
    refused(
        tmp_path,
        run_main,
        {
            "a.weight": ("F8_E4M3", [4, 8], W),
            "a.weight_scale_inv": ("F32", [4, 1], S),
            "a.weight_zero_point": ("I8", [4, 1], ZP8),
        },
        "`a.weight_zero_point`",
        "`a.weight_scale_inv`",
    )


def test_zero_point_without_scale_refused(tmp_path, run_main):
    """A weight with a zero point and no scale; a zero point whose weight is not FP8."""
    refused(
        tmp_path,
        run_main,
        {
            "a.weight": ("F8_E4M3", [4, 8], W),
            "a.weight_scale": ("F32", [4, 1], S),
            "b.weight": ("F8_E4M3", [4, 8], W),
            "b.weight_zero_point": ("I8", [4, 1], ZP8),
        },
        "`b.weight`",
        "without a scale",
    )
    refused(
        tmp_path,
        run_main,
        {
            "a.weight": ("F8_E4M3", [4, 8], W),
            "a.weight_scale": ("F32", [4, 1], S),
            "b.weight": ("BF16", [4, 8], np.ones(32, ml_dtypes.bfloat16)),
            "b.weight_zero_point": ("I8", [4, 1], ZP8),
        },
        "`b.weight_zero_point`",
        "is a zero point (I8) whose weight is not in this file",
    )


def test_scale_shape_refused_naming_it(tmp_path, run_main):
    refused(
        tmp_path,
        run_main,
        {"a.weight": ("F8_E4M3", [4, 8], W), "a.weight_scale": ("F32", [2, 1], S[:2])},
        "`a.weight_scale`",
        "[2, 1]",
        "[4, 8]",
    )


def test_verify_names_a_source_convert_refuses(tmp_path, run_main):
    """verify of a SRC whose zero point convert refuses (F32) fails naming it, even against
    what stcast wrote before: `q * s`, the zero point converted as any F32 tensor."""
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {
            "a.weight": ("F8_E4M3", [4, 8], W),
            "a.weight_scale": ("F32", [4, 1], S),
            "a.weight_zero_point": ("F32", [4, 1], S),
        },
    )
    without = ref_dequant(W, S, None, None, "F32", "BF16", "channel")
    dst = write_safetensors(
        tmp_path / "out.safetensors",
        {
            "a.weight": ("BF16", [4, 8], without),
            "a.weight_zero_point": ("BF16", [4, 1], S.astype(ml_dtypes.bfloat16)),
        },
    )
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and "a.weight_zero_point" in err and "F32" in err, err


# --- model_free_ptq's own asymmetric FP8 output --------------------------------------------

ASYM_FILE = FIX / "expected-dequant-asym.json"
ASYM = json.loads(ASYM_FILE.read_text()) if ASYM_FILE.exists() else {"folders": {}}


def nan_canonical(raw: bytes, dtype: str) -> str:
    """sha256 of 16-bit floats with every NaN made +NaN (0x7FC0 / 0x7E00): NaN payloads are
    not compared (torch's depend on its code path)."""
    a = np.frombuffer(raw, np.uint16).copy()
    exp, quiet = (0x7F80, 0x7FC0) if dtype == "BF16" else (0x7C00, 0x7E00)
    nan = (a & exp == exp) & (a & ~np.uint16(exp | 0x8000) != 0)
    a[nan] = quiet
    return hashlib.sha256(a.tobytes()).hexdigest()


@pytest.mark.parametrize("to", ["bf16", "fp16"])
@pytest.mark.parametrize("folder", sorted(ASYM["folders"]))
def test_model_free_ptq_asymmetric_output(tmp_path, run_main, folder, to):
    """Finding 8: model_free_ptq's asymmetric FP8 (zero points in F8_E4M3) was refused as
    "quantized without a scale"; now every tensor is compressed-tensors' own dequantization
    (`CompressedTensorsDequantizer`), NaN payloads aside, and verify proves the folder."""
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", FIX / folder, dst, "--to", to, "--from-bf16", "-q")
    assert rc == 0, err
    want = ASYM["folders"][folder][to]
    got = tensor_bytes(dst / "model.safetensors")
    assert set(got) == set(want)
    for name, w in want.items():
        dtype, shape, raw = got[name]
        assert (dtype, shape) == (w["dtype"], w["shape"]), name
        assert nan_canonical(raw, dtype) == w["sha256_nan_canonical"], name
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    rc, _, err = run_main("verify", FIX / folder, dst, "--from-bf16")
    assert rc == 0, err


def test_a_symmetric_config_over_zero_points_is_refused(tmp_path, run_main):
    """A folder whose config calls its FP8 weights symmetric while they have zero points:
    compressed-tensors' dequantization of a symmetric scheme leaves the zero points unread
    (other bits than `(q - zp) * s`), so the folder is refused in one line naming the config
    (it was converted with the zero points applied)."""
    src = tmp_path / "src"
    shutil.copytree(FIX / "llama-fp32.fp8-asym-channel", src)
    config = json.loads((src / "config.json").read_text())
    for g in config["quantization_config"]["config_groups"].values():
        g["weights"]["symmetric"] = True
    (src / "config.json").write_text(json.dumps(config))
    for extra in ([], ["--max-shard-size", "40KB"]):
        rc, _, err = run_main("convert", src, tmp_path / "out", *extra)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert "symmetric true" in line and "a zero point" in line, line
        assert "config.json" in line and "allow" not in line, line
        assert not (tmp_path / "out").exists()


def test_an_asymmetric_config_over_weights_without_zero_points_is_refused(tmp_path, run_main):
    """An asymmetric FP8 config (`symmetric: false`) whose weights carry no zero points:
    compressed-tensors 0.19's dequantizer takes every parameter its compressor names for an
    asymmetric scheme, `weight_zero_point` among them, and fails (KeyError) on the first
    weight without one, so there are no reference bits to match: refused in one line naming
    the file, the tensor and why, nothing written (as a folder, and re-sharded)."""
    src = tmp_path / "src"
    shutil.copytree(FIX / "llama-fp32.fp8-asym-channel", src)
    t = tensor_bytes(src / "model.safetensors")
    t = {k: v for k, v in t.items() if not k.endswith(".weight_zero_point")}
    write_safetensors(src / "model.safetensors", t, metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in t}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())["quantization_config"]
    assert all(g["weights"]["symmetric"] is False for g in config["config_groups"].values())
    for extra in ([], ["--max-shard-size", "40KB"], ["--to", "fp16"]):
        rc, _, err = run_main("convert", src, tmp_path / "out", *extra)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert "model.safetensors" in line and "_proj.weight`" in line, line
        assert "symmetric false" in line and "no zero point" in line, line
        assert "allow" not in line, line
        assert not (tmp_path / "out").exists()
