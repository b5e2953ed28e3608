"""Conversions through `stcast.convert`: exact bits, layout, files, reports."""

from __future__ import annotations

import json
import os
import stat
import threading
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import stcast
from conftest import (
    DTYPE_BITS,
    listing,
    nbytes,
    read_safetensors,
    tensor_bytes,
    write_raw,
    write_safetensors,
)
from reference import bf16_bits_ml_dtypes, f64_bits_to_bf16_exact
from stcast import _core

VECTORS = json.loads((Path(__file__).parent / "data" / "bf16-vectors.json").read_text())["vectors"]

FLOAT_TARGET = {"F32": "BF16", "F16": "BF16", "F64": "BF16"}


def convert_one(tmp_path: Path, dtype: str, values: np.ndarray, **kw) -> np.ndarray:
    """Convert one tensor and return the output bits as uint16."""
    src = write_safetensors(tmp_path / "in.safetensors", {"t": (dtype, [values.size], values)})
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst, **kw)
    out_dtype, shape, raw = tensor_bytes(dst)["t"]
    assert out_dtype == "BF16" and shape == [values.size]
    return np.frombuffer(raw, dtype=np.uint16)


def assert_same_bits(inputs: np.ndarray, got: np.ndarray, want: np.ndarray) -> None:
    bad = np.flatnonzero(got != want)
    if bad.size:
        width = inputs.dtype.itemsize * 2
        bits = inputs.view(f"u{inputs.dtype.itemsize}")
        rows = [
            f"{int(bits[i]):0{width}X} -> {int(got[i]):04X}, want {int(want[i]):04X}"
            for i in bad[:20]
        ]
        pytest.fail(f"{bad.size} of {got.size} differ:\n" + "\n".join(rows))


# --- dtypes and tensor shapes ---------------------------------------------------------------

NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "U16": np.uint16,
    "U32": np.uint32,
    "U64": np.uint64,
    "BOOL": np.bool_,
}


def test_every_numpy_dtype_written_by_safetensors(tmp_path, rng):
    tensors = {}
    for name, dt in NUMPY_DTYPES.items():
        if dt is np.bool_:
            tensors[name.lower()] = rng.integers(0, 2, size=(3, 5)).astype(np.bool_)
        elif np.issubdtype(dt, np.floating):
            tensors[name.lower()] = rng.standard_normal((3, 5)).astype(dt)
        else:
            info = np.iinfo(dt)
            tensors[name.lower()] = rng.integers(info.min, info.max, size=(3, 5), dtype=dt)
    src = tmp_path / "in.safetensors"
    dst = tmp_path / "out.safetensors"
    safetensors.numpy.save_file(tensors, str(src), metadata={"format": "np"})
    report = stcast.convert(src, dst)
    assert report.tensors_converted == 3
    assert report.tensors_copied == len(NUMPY_DTYPES) - 3

    loaded = safetensors.numpy.load_file(str(dst))
    assert set(loaded) == set(tensors)
    for name, arr in tensors.items():
        out = loaded[name]
        assert out.shape == arr.shape
        if name.upper() in FLOAT_TARGET:
            assert out.dtype == ml_dtypes.bfloat16, name
            if name == "f64":
                want = np.array(
                    [f64_bits_to_bf16_exact(int(b)) for b in arr.view(np.uint64).ravel()]
                )
            else:
                want = bf16_bits_ml_dtypes(arr).ravel()
            np.testing.assert_array_equal(out.view(np.uint16).ravel(), want)
        else:
            assert out.dtype == arr.dtype, name
            assert out.tobytes() == arr.tobytes(), name


def test_raw_dtypes_are_copied_bytewise(tmp_path, rng):
    """Dtypes numpy cannot hold go through the raw writer; all non-float ones are copied."""
    tensors = {}
    for dtype in ["BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "C64", "I64", "U8", "BOOL", "F32"]:
        shape = [2, 3]
        n = nbytes(dtype, shape)
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if dtype == "BOOL":
            data = bytes(b & 1 for b in data)
        tensors[f"t_{dtype}"] = (dtype, shape, data)
    tensors["f4"] = ("F4", [2, 4], b"\x12\x34\x56\x78")
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    dst = tmp_path / "out.safetensors"
    # F8/F4 tensors beside an F32 one: a quantized checkpoint, refused unless allowed.
    with pytest.raises(stcast.StcastError, match="quantized checkpoint") as e:
        stcast.convert(src, dst)
    assert e.value.kind == "refused" and not dst.exists()
    report = _core.convert(src, dst, allow_quantized=True)
    assert [kind for kind, _ in report["warnings"]] == ["quantized"]
    assert (report["tensors_converted"], report["tensors_copied"]) == (1, len(tensors) - 1)
    out = tensor_bytes(dst)
    assert set(out) == set(tensors)
    for name, (dtype, shape, data) in tensors.items():
        if dtype == "F32":
            continue
        assert out[name] == (dtype, shape, data), name
    # The reference parser accepts the result.
    parsed = dict(safetensors.deserialize(dst.read_bytes()))
    assert {k: v["dtype"] for k, v in parsed.items()} == {
        k: ("BF16" if d == "F32" else d) for k, (d, _, _) in tensors.items()
    }


@pytest.mark.filterwarnings("ignore:nothing to convert")
@pytest.mark.parametrize("dtype", ["F32", "F16", "F64", "I32", "BF16", "U8"])
def test_scalar_and_empty_tensors(tmp_path, dtype):
    size = DTYPE_BITS[dtype] // 8
    tensors = {
        "scalar": (dtype, [], bytes(range(1, size + 1))),
        "empty": (dtype, [0, 7], b""),
        "empty2": (dtype, [5, 0], b""),
        "vec": (dtype, [2], bytes(range(10, 10 + 2 * size))),
        "empty_last": (dtype, [0], b""),
        # Something to convert: a run that would only copy is refused.
        "f": ("F32", [1], b"\x00\x00\x80\x3f"),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst)
    out = tensor_bytes(dst)
    assert out["scalar"][1] == [] and out["empty"][1] == [0, 7] and out["empty2"][1] == [5, 0]
    assert out["empty"][2] == b"" and out["empty2"][2] == b"" and out["empty_last"][2] == b""
    want_size = 2 if dtype in FLOAT_TARGET else size
    assert len(out["scalar"][2]) == want_size
    assert len(out["vec"][2]) == 2 * want_size
    safetensors.deserialize(dst.read_bytes())  # the reference parser accepts it


def test_empty_tensor_with_huge_dimension(tmp_path):
    huge = (1 << 64) - 1
    tensors = {"e": ("F32", [0, huge], b""), "x": ("F64", [1], np.float64(1).tobytes())}
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst)
    out = tensor_bytes(dst)
    assert out["e"] == ("BF16", [0, huge], b"")
    assert out["x"] == ("BF16", [1], b"\x80\x3f")


def test_non_ascii_names_and_metadata(tmp_path):
    one = np.float32(1.5).tobytes()
    tensors = {
        "模型.权重": ("F32", [1], one),
        "café": ("F32", [1], one),
        'quote"and\\slash': ("I8", [1], b"\x07"),
        "emoji 🦀": ("F16", [1], np.float16(2.0).tobytes()),
    }
    meta = {"ключ": "значение", "z": "1", "a": "€", "ctrl": "tab\tnew\nline"}
    src = write_safetensors(tmp_path / "in.safetensors", tensors, metadata=meta)
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst)
    _, items, _ = read_safetensors(dst)
    # The input's keys in their order, then the record of convert's options.
    assert items[0] == ("__metadata__", [*meta.items(), ("stcast", '{"to":"bf16"}')])
    stcast.convert(src, dst, no_record=True, force=True)
    _, items, _ = read_safetensors(dst)
    assert items[0] == ("__metadata__", list(meta.items()))
    out = tensor_bytes(dst)
    assert set(out) == set(tensors)
    assert out["模型.权重"] == ("BF16", [1], b"\xc0\x3f")
    assert out["emoji 🦀"] == ("BF16", [1], b"\x00\x40")
    info = stcast.inspect(src)
    assert [t.name for t in info.tensors] == list(tensors)
    assert info.metadata == meta and list(info.metadata) == list(meta)


def test_metadata_absent_gets_only_the_record(tmp_path):
    src = write_safetensors(tmp_path / "in.safetensors", {"a": ("F32", [1], b"\0\0\x80\x3f")})
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst)
    _, items, _ = read_safetensors(dst)
    assert items[0] == ("__metadata__", [("stcast", '{"to":"bf16"}')])
    assert [k for k, _ in items] == ["__metadata__", "a"]
    # `no_record`: none is added when absent.
    stcast.convert(src, dst, no_record=True, force=True)
    _, items, _ = read_safetensors(dst)
    assert [k for k, _ in items] == ["a"]
    assert stcast.inspect(src).metadata is None


def test_empty_metadata_is_kept(tmp_path):
    src = write_safetensors(
        tmp_path / "in.safetensors", {"a": ("F32", [1], b"\0\0\x80\x3f")}, metadata={}
    )
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst, no_record=True)
    _, items, _ = read_safetensors(dst)
    assert items[0] == ("__metadata__", [])
    assert stcast.inspect(src).metadata == {}


def test_file_without_tensors(tmp_path):
    src = write_raw(tmp_path / "in.safetensors", {"__metadata__": {"k": "v"}})
    dst = tmp_path / "out.safetensors"
    with pytest.raises(stcast.Refused, match="nothing to convert"):
        stcast.convert(src, dst)
    assert not dst.exists()
    # inspect describes the file; given the destination, it refuses as convert does.
    info = stcast.inspect(src)
    # The header alone: `{"__metadata__":{"k":"v","stcast":"{\"to\":\"bf16\"}"}}`, 52
    # bytes padded to 56.
    assert info.tensors == [] and info.output_bytes == 8 + 56
    assert stcast.inspect(src, no_record=True).output_bytes == 8 + 32
    with pytest.raises(stcast.Refused, match="nothing to convert"):
        stcast.inspect(src, dst)


# --- exact bits -----------------------------------------------------------------------------

F32_EDGES = [
    0x00000000,
    0x80000000,  # +-0
    0x7F800000,
    0xFF800000,  # +-inf
    0x7F7FFFFF,
    0xFF7FFFFF,  # +-FLT_MAX -> +-inf
    0x7F7F7FFF,
    0x7F7F8000,
    0x7F7F0000,  # around the overflow midpoint
    0x3F800000,
    0x3F808000,
    0x3F818000,
    0xBF808000,
    0xBF818000,  # exact and ties
    0x3F807FFF,
    0x3F808001,
    0x3F817FFF,
    0x3F818001,  # around ties (sticky bits)
    0x3F80FFFF,
    0x3F800001,  # sticky
    0x3FFF8000,
    0x3FFFFFFF,
    0x407F8000,
    0xBFFF8000,  # carry into the exponent
    0x00000001,
    0x80000001,
    0x007FFFFF,
    0x807FFFFF,  # subnormals, never flushed
    0x00008000,
    0x00018000,
    0x00008001,
    0x00010000,
    0x00007FFF,  # subnormal ties
    0x007F8000,
    0x007F7FFF,
    0x00800000,
    0x80800000,  # into the smallest normal
    0x7F800001,
    0xFF800001,
    0x7FA00000,
    0x7F80FFFF,
    0x7FC00000,
    0xFFC00000,  # NaNs
    0x7FC00001,
    0x7FFF8000,
    0x7FFFFFFF,
    0xFFFFFFFF,
    0xFFFF8001,
    0xFF808000,
    0x7FBFFFFF,
    0x3DCCCCCD,
    0x40490FDB,
    0x4B800001,
    0x33800000,
    0x2F800000,
]


def test_f32_edges_match_ml_dtypes(tmp_path):
    x = np.array(F32_EDGES, dtype=np.uint32).view(np.float32)
    got = convert_one(tmp_path, "F32", x)
    assert_same_bits(x, got, bf16_bits_ml_dtypes(x))
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[nan], (x.view(np.uint32)[nan] >> 16) & 0x8000 | 0x7FC0)


def test_f32_random_bits_match_ml_dtypes(tmp_path, rng):
    # Random bit patterns (all exponents, NaNs included) and values near ties.
    bits = rng.integers(0, 1 << 32, 300_000, dtype=np.uint64).astype(np.uint32)
    near = (bits & 0xFFFF0000) | rng.choice([0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF], bits.size)
    x = np.concatenate([bits, near.astype(np.uint32)]).view(np.float32)
    assert_same_bits(x, convert_one(tmp_path, "F32", x), bf16_bits_ml_dtypes(x))


def test_f16_all_halves_match_ml_dtypes(tmp_path):
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    assert_same_bits(x, convert_one(tmp_path, "F16", x), bf16_bits_ml_dtypes(x))


@pytest.mark.parametrize("source", ["F32", "F16", "F64"])
def test_reference_vectors(tmp_path, source):
    rows = [v for v in VECTORS if v["from"] == source]
    assert rows
    kind = {"F32": np.uint32, "F16": np.uint16, "F64": np.uint64}[source]
    fdt = {"F32": np.float32, "F16": np.float16, "F64": np.float64}[source]
    x = np.array([int(v["input"], 16) for v in rows], dtype=kind).view(fdt)
    want = np.array([int(v["bf16"], 16) for v in rows], dtype=np.uint16)
    assert_same_bits(x, convert_one(tmp_path, source, x), want)


F64_WITNESSES = {
    0x3FF0100000001000: 0x3F81,  # via F32 it lands on a tie and goes down
    0x3790000004000000: 0x0001,  # subnormal: via F32 it becomes 0
    0x47EFEFFFFFFFFFFF: 0x7F7F,  # below the overflow midpoint: via F32 it becomes inf
    0x47EFF00000000000: 0x7F80,  # exactly the overflow midpoint: ties to even = inf
    0xC7EFEFFFFFFFFFFF: 0xFF7F,
    0x47F0000000000000: 0x7F80,  # 2**128
    0x7FEFFFFFFFFFFFFF: 0x7F80,  # DBL_MAX
    0xFFEFFFFFFFFFFFFF: 0xFF80,
    0x0000000000000001: 0x0000,  # smallest double subnormal
    0x8000000000000001: 0x8000,
    0x3780000000000000: 0x0000,  # 2**-135, below half the smallest bf16 subnormal
    0x3790000000000000: 0x0000,  # 2**-134: exact tie with 0 -> even 0
    0x3790000000000001: 0x0001,  # just above that tie
    0x37A0000000000000: 0x0001,  # 2**-133 smallest bf16 subnormal
    0x37A8000000000000: 0x0002,  # 1.5 * 2**-133: tie, odd -> 2
    0x7FF0000000000000: 0x7F80,
    0xFFF0000000000000: 0xFF80,
    0x7FF0000000000001: 0x7FC0,  # signalling NaN
    0xFFF8000000000000: 0xFFC0,
    0x7FFFFFFFFFFFFFFF: 0x7FC0,
    0xFFFFFFFFFFFFFFFF: 0xFFC0,
    0x8000000000000000: 0x8000,
}


def test_f64_witnesses(tmp_path):
    bits = np.array(list(F64_WITNESSES), dtype=np.uint64)
    want = np.array(list(F64_WITNESSES.values()), dtype=np.uint16)
    # The table itself agrees with the exact reference.
    assert [f64_bits_to_bf16_exact(int(b)) for b in bits] == want.tolist()
    x = bits.view(np.float64)
    assert_same_bits(x, convert_one(tmp_path, "F64", x), want)


def test_f64_random_and_ties_match_exact_rounding(tmp_path, rng):
    n = 1500
    # Random patterns over all exponents, then values in bf16 range, subnormal range and
    # around overflow, then exact ties and their neighbours (the sticky bits far below).
    random_bits = rng.integers(0, 1 << 64, n, dtype=np.uint64)
    exps = rng.integers(1023 - 140, 1023 + 130, n, dtype=np.uint64)
    mant = rng.integers(0, 1 << 52, n, dtype=np.uint64)
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(63)
    in_range = sign | (exps << np.uint64(52)) | mant
    # Ties: bf16 keeps 7 mantissa bits; set bit 44 (the half) and clear the rest, then +-1 ulp.
    tie = (in_range & ~np.uint64((1 << 45) - 1)) | np.uint64(1 << 44)
    ties = np.concatenate(
        [
            tie,
            tie + np.uint64(1),
            tie - np.uint64(1),
            tie | np.uint64(1 << 20),
            tie | np.uint64(1 << 28),
        ]
    )
    # bf16-subnormal ties come from the exact grid: k * 2**-134 with k odd.
    k = rng.integers(0, 256, 300) * 2 + 1
    sub = np.ldexp(k.astype(np.float64), -134)
    sub = np.concatenate([sub, np.nextafter(sub, 0), np.nextafter(sub, 1)])
    x = np.concatenate(
        [random_bits.view(np.float64), in_range.view(np.float64), ties.view(np.float64), sub, -sub]
    )
    want = np.array([f64_bits_to_bf16_exact(int(b)) for b in x.view(np.uint64)], np.uint16)
    assert_same_bits(x, convert_one(tmp_path, "F64", x), want)


@pytest.mark.parametrize("source", ["F32", "F64"])
def test_fp16_target_matches_numpy(tmp_path, rng, source):
    """`to="fp16"`: finite values and infinities round like numpy; NaN stays NaN, with sign."""
    fdt = np.float32 if source == "F32" else np.float64
    x = np.concatenate(
        [
            rng.standard_normal(20_000) * 10.0 ** rng.integers(-9, 7, 20_000),
            [
                0.0,
                -0.0,
                np.inf,
                -np.inf,
                65504.0,
                65520.0,
                65519.99,
                2.0**-24,
                2.0**-25,
                3 * 2.0**-26,
                1 + 2.0**-11,
                1 + 3 * 2.0**-11,
                np.nan,
                -np.nan,
            ],
        ]
    ).astype(fdt)
    src = write_safetensors(tmp_path / "in.safetensors", {"t": (source, [x.size], x)})
    dst = tmp_path / "out.safetensors"
    report = stcast.convert(src, dst, to="fp16")
    assert report.to == "fp16"
    dtype, _, raw = tensor_bytes(dst)["t"]
    assert dtype == "F16"
    got = np.frombuffer(raw, np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert_same_bits(x[~nan], got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()
    np.testing.assert_array_equal(got[nan] & 0x8000, np.signbit(x[nan]) * 0x8000)


# --- output layout --------------------------------------------------------------------------


def test_layout_grouped_by_width_aligned_and_padded(tmp_path):
    # Data order mixes widths; each group must keep this order.
    tensors = {
        "i8_a": ("I8", [3], b"\x01\x02\x03"),
        "f32_a": ("F32", [3], np.arange(3, dtype=np.float32)),
        "f4": ("F4", [2], b"\x21"),
        "i64_a": ("I64", [1], np.int64(-5).tobytes()),
        "f64_a": ("F64", [1], np.float64(0.5).tobytes()),
        "bool": ("BOOL", [1], b"\x01"),
        "bf16": ("BF16", [1], b"\x80\x3f"),
        "i32": ("I32", [1], np.int32(9).tobytes()),
        "f16": ("F16", [3], np.ones(3, np.float16)),
        "u64": ("U64", [1], np.uint64(7).tobytes()),
        "f32_b": ("F32", [1], np.float32(-2).tobytes()),
        "i16": ("I16", [1], np.int16(3).tobytes()),
        "i8_b": ("I8", [1], b"\x09"),
    }
    meta = {"b": "1", "a": "2"}
    src = write_safetensors(tmp_path / "in.safetensors", tensors, metadata=meta)
    dst = tmp_path / "out.safetensors"
    # F4 beside F32: quantized, so allowed explicitly (at the engine: the layout is its).
    _core.convert(src, dst, allow_quantized=True, no_record=True)
    n, items, data = read_safetensors(dst)
    assert n % 8 == 0
    assert items[0] == ("__metadata__", [("b", "1"), ("a", "2")])
    names = [k for k, _ in items[1:]]
    # Output widths: I64/U64 (8), I32 (4), then 2-byte ones (converted floats become 2-byte)
    # in input order, then bytes, then sub-byte.
    assert names == [
        "i64_a",
        "u64",
        "i32",
        "f32_a",
        "f64_a",
        "bf16",
        "f16",
        "f32_b",
        "i16",
        "i8_a",
        "bool",
        "i8_b",
        "f4",
    ]
    end = 0
    for name, info in items[1:]:
        info = dict(info)
        a, b = info["data_offsets"]
        assert a == end, name  # contiguous, in header order
        size = max(DTYPE_BITS[info["dtype"]] // 8, 1)
        assert (8 + n + a) % size == 0 and a % size == 0, name
        end = b
    assert end == len(data)
    # Headers keys are in data order in the output.
    assert stcast.inspect(dst).tensors[0].name == "i64_a"


def test_header_key_order_differs_from_data_order(tmp_path):
    tensors = {
        "first": ("F32", [2], np.array([1.0, 2.0], np.float32)),
        "second": ("I16", [1], np.int16(-1).tobytes()),
        "third": ("F32", [1], np.float32(3.0).tobytes()),
    }
    src = write_safetensors(
        tmp_path / "in.safetensors",
        tensors,
        metadata={"m": "x"},
        key_order=["third", "second", "__metadata__", "first"],
    )
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst)
    out = tensor_bytes(dst)
    assert out["first"][2] == np.array([1.0, 2.0], ml_dtypes.bfloat16).tobytes()
    assert out["second"][2] == np.int16(-1).tobytes()
    assert out["third"][2] == np.array([3.0], ml_dtypes.bfloat16).tobytes()
    _, items, _ = read_safetensors(dst)
    # All three are 2-byte in the output: data order.
    assert [k for k, _ in items] == ["__metadata__", "first", "second", "third"]
    assert [t.name for t in stcast.inspect(src).tensors] == ["first", "second", "third"]


def test_unpadded_input_header(tmp_path):
    src = write_safetensors(
        tmp_path / "in.safetensors", {"ab": ("F32", [1], b"\0\0\x80\x3f")}, pad=False
    )
    assert (src.stat().st_size - 4 - 8) % 8 != 0
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst)
    n, _, data = read_safetensors(dst)
    assert n % 8 == 0 and data == b"\x80\x3f"


def test_byte_reproducible(tmp_path, rng):
    tensors = {
        "w": ("F32", [64, 33], rng.standard_normal((64, 33)).astype(np.float32)),
        "i": ("I64", [5], np.arange(5)),
        "h": ("F16", [7], rng.standard_normal(7).astype(np.float16)),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors, metadata={"x": "y"})
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    stcast.convert(src, a)
    stcast.convert(src, b, threads=1)
    assert a.read_bytes() == b.read_bytes()


# --- files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o027])
def test_new_file_mode_follows_umask(tmp_path, umask):
    src = write_safetensors(tmp_path / "in.safetensors", {"a": ("F32", [1], b"\0\0\0\0")})
    dst = tmp_path / "out.safetensors"
    old = os.umask(umask)
    try:
        stcast.convert(src, dst)
    finally:
        os.umask(old)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o666 & ~umask


def test_force_keeps_mode_of_replaced_file(tmp_path):
    src = write_safetensors(tmp_path / "in.safetensors", {"a": ("F32", [1], b"\0\0\x80\x3f")})
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    os.chmod(dst, 0o640)
    stcast.convert(src, dst, force=True)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o640
    assert tensor_bytes(dst)["a"][2] == b"\x80\x3f"
    assert listing(tmp_path) == ["in.safetensors", "out.safetensors"]


def test_force_does_not_copy_setuid_bits(tmp_path):
    src = write_safetensors(tmp_path / "in.safetensors", {"a": ("F32", [1], b"\0\0\x80\x3f")})
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    os.chmod(dst, 0o6755)
    stcast.convert(src, dst, force=True)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o755


def test_default_destination(tmp_path):
    src = write_safetensors(tmp_path / "model.v2.safetensors", {"a": ("F32", [1], b"\0\0\0\0")})
    report = stcast.convert(src)
    assert report.dst == str(tmp_path / "model.v2-bf16.safetensors")
    assert Path(report.dst).exists()
    report = stcast.convert(str(src), to="fp16")
    assert report.dst == str(tmp_path / "model.v2-fp16.safetensors")


def test_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_safetensors("in.safetensors", {"a": ("F32", [1], b"\0\0\0\0")})
    report = stcast.convert("in.safetensors", "out.safetensors")
    assert report.dst == "out.safetensors"
    assert listing(tmp_path) == ["in.safetensors", "out.safetensors"]


# --- windows and threads --------------------------------------------------------------------


def test_tensor_larger_than_window(tmp_path, rng):
    # 3.3 MiB of F32 in 1 MiB windows, between tensors of other widths, so windows start
    # mid-tensor and at odd offsets.
    big = rng.integers(0, 1 << 32, 865_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    f64 = rng.standard_normal(300_000)
    tensors = {
        "pre": ("I8", [3], b"\x01\x02\x03"),
        "big": ("F32", [big.size], big),
        "f64": ("F64", [f64.size], f64),
        "tail": ("F16", [5], np.arange(5, dtype=np.float16)),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    outs = []
    for threads in (1, 2):
        dst = tmp_path / f"out{threads}.safetensors"
        report = _core.convert(str(src), str(dst), threads=threads, tuning={"window_mib": 1})
        assert report["threads"] == threads
        outs.append(dst.read_bytes())
    assert outs[0] == outs[1]
    out = tensor_bytes(tmp_path / "out1.safetensors")
    assert_same_bits(big, np.frombuffer(out["big"][2], np.uint16), bf16_bits_ml_dtypes(big))
    sample = rng.choice(f64.size, 2000, replace=False)
    want = np.array([f64_bits_to_bf16_exact(int(b)) for b in f64.view(np.uint64)[sample]])
    np.testing.assert_array_equal(np.frombuffer(out["f64"][2], np.uint16)[sample], want)
    assert out["pre"][2] == b"\x01\x02\x03"
    # The default window gives the same bytes.
    stcast.convert(src, tmp_path / "default.safetensors")
    assert (tmp_path / "default.safetensors").read_bytes() == outs[0]


def test_threads_do_not_change_bytes(tmp_path, rng):
    x = rng.standard_normal(600_000).astype(np.float32)  # above the parallel threshold
    src = write_safetensors(tmp_path / "in.safetensors", {"x": ("F32", [x.size], x)})
    outs = []
    for threads in (1, 2, 3):
        dst = tmp_path / f"out{threads}.safetensors"
        assert stcast.convert(src, dst, threads=threads).threads == threads
        outs.append(dst.read_bytes())
    assert outs[0] == outs[1] == outs[2]


# --- reports, progress, cancel --------------------------------------------------------------


def test_convert_report(tmp_path):
    tensors = {
        "a": ("F32", [4], np.arange(4, dtype=np.float32)),
        "b": ("I32", [2], np.arange(2, dtype=np.int32)),
        "c": ("F64", [1], np.float64(1).tobytes()),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors, metadata={"k": "v"})
    dst = tmp_path / "out.safetensors"
    report = stcast.convert(src, dst, threads=2)
    assert isinstance(report, stcast.ConvertReport)
    d = report.to_dict()
    assert list(d) == [
        "src",
        "dst",
        "to",
        "tensors_converted",
        "tensors_copied",
        "bytes_in",
        "bytes_out",
        "seconds",
        "threads",
        "isa",
        "warnings",
        "tensors_kept",
        "bytes_kept",
        "kept",
        "on_overflow",
        "numerics",
        "folder",
        "files",
        "shard",
        "complete",
    ]
    assert not report.folder and report.files == [] and report.complete
    assert report.src == str(src) and report.dst == str(dst) and report.to == "bf16"
    assert (report.tensors_converted, report.tensors_copied) == (2, 1)
    assert report.bytes_in == src.stat().st_size
    assert report.bytes_out == dst.stat().st_size
    assert report.seconds >= 0 and report.threads == 2
    assert isinstance(report.isa, str) and report.isa
    assert report.warnings == []
    json.dumps(d)


def test_progress_is_monotone_and_ends_at_total(tmp_path, rng):
    x = rng.standard_normal(3_000_000).astype(np.float32)  # 12 MB
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [x.size], x), "y": ("I8", [5], b"12345")}
    )
    calls = []
    stcast.convert(src, tmp_path / "out.safetensors", progress=lambda d, t: calls.append((d, t)))
    assert len(calls) >= 2
    totals = {t for _, t in calls}
    assert totals == {x.nbytes + 5}
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[0] == 0 and done[-1] == x.nbytes + 5


def test_progress_many_steps(tmp_path):
    # More than the 64 MiB step: progress is called in between.
    n = (80 << 20) // 4
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [n], np.ones(n, np.float32))}
    )
    calls = []
    stcast.convert(src, tmp_path / "out.safetensors", progress=lambda d, t: calls.append(d))
    assert len(calls) >= 3 and calls == sorted(calls) and calls[-1] == 4 * n
    assert 0 < calls[1] < 4 * n


class Boom(Exception):
    pass


@pytest.mark.parametrize("when", [0, 1])
def test_exception_in_progress_cancels_cleanly(tmp_path, when):
    n = (80 << 20) // 4
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [n], np.ones(n, np.float32))}
    )
    before = listing(tmp_path)
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) > when:
            raise Boom(f"stop at {done}")

    with pytest.raises(Boom):
        stcast.convert(src, tmp_path / "out.safetensors", progress=progress)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("size", [1000, (80 << 20) // 4])
def test_cancel_from_progress(tmp_path, size):
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [size], np.ones(size, np.float32))}
    )
    before = listing(tmp_path)
    cancel = threading.Event()
    with pytest.raises(stcast.Cancelled):
        stcast.convert(
            src, tmp_path / "out.safetensors", cancel=cancel, progress=lambda d, t: cancel.set()
        )
    assert listing(tmp_path) == before


@pytest.mark.parametrize("to", ["bf16", "fp8"])
def test_cancel_once_told_of_the_end_leaves_nothing(tmp_path, to):
    """A cancel flag set in the last progress call, `(total, total)`, told before the
    output is published: `Cancelled`, and neither the output nor a file beside it (fp8's
    quantization_config) is left. (A regression of the engine's one entry per command
    published it: the flag was read before that call, not after.)"""
    w = np.ones((64, 64), np.float32)
    src = write_safetensors(
        tmp_path / "in.safetensors", {"model.layers.0.mlp.down_proj.weight": ("F32", [64, 64], w)}
    )
    before = listing(tmp_path)
    cancel = threading.Event()

    def progress(done, total):
        if done == total:
            cancel.set()

    with pytest.raises(stcast.Cancelled), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no model config describes an FP8 output)
        stcast.convert(src, tmp_path / "out.safetensors", to=to, cancel=cancel, progress=progress)
    assert listing(tmp_path) == before


def test_cancel_from_another_thread(tmp_path):
    n = (130 << 20) // 4  # three 64 MiB steps
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [n], np.ones(n, np.float32))}
    )
    before = listing(tmp_path)
    cancel = threading.Event()
    started = threading.Event()
    errors = []

    def work():
        try:
            stcast.convert(
                src,
                tmp_path / "out.safetensors",
                cancel=cancel,
                progress=lambda d, t: started.set(),
            )
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    assert started.wait(30)
    cancel.set()
    t.join(60)
    assert not t.is_alive()
    if errors:  # on a very fast machine it may finish before the flag is seen
        assert isinstance(errors[0], stcast.Cancelled)
        assert listing(tmp_path) == before


def test_unset_cancel_does_not_stop(tmp_path):
    src = write_safetensors(tmp_path / "in.safetensors", {"x": ("F32", [1], b"\0\0\0\0")})
    stcast.convert(src, tmp_path / "out.safetensors", cancel=threading.Event())
    assert (tmp_path / "out.safetensors").exists()


def test_warnings_are_issued_before_writing(tmp_path):
    tensors = {
        "w": ("BF16", [1], b"\x80\x3f"),
        "norm": ("F32", [1], np.float32(1).tobytes()),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    with pytest.warns(stcast.StcastWarning, match=r"1 BF16 tensor is copied") as rec:
        report = stcast.convert(src, tmp_path / "out.safetensors", to="fp16")
    assert len(rec) == 1
    assert report.warnings == [str(rec[0].message)]
    # Turned into an error, the warning stops the conversion before anything is written.
    before = listing(tmp_path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", stcast.StcastWarning)
        with pytest.raises(stcast.StcastWarning):
            stcast.convert(src, tmp_path / "out2.safetensors", to="fp16")
    assert listing(tmp_path) == before


def test_unknown_target(tmp_path):
    src = write_safetensors(tmp_path / "in.safetensors", {"x": ("F32", [1], b"\0\0\0\0")})
    with pytest.raises(stcast.UsageError, match="to: 'int8' is not one of bf16, fp16"):
        stcast.convert(src, tmp_path / "out.safetensors", to="int8")
    assert listing(tmp_path) == ["in.safetensors"]


# --- inspect --------------------------------------------------------------------------------


def test_inspect_fields(tmp_path):
    tensors = {
        "a": ("F32", [2, 2], np.arange(4, dtype=np.float32)),
        "b": ("I64", [1], np.int64(3).tobytes()),
        "c": ("BF16", [], b"\x80\x3f"),
    }
    src = write_safetensors(
        tmp_path / "in.safetensors",
        tensors,
        metadata={"z": "1", "a": "2"},
        key_order=["c", "__metadata__", "b", "a"],
    )
    info = stcast.inspect(src)
    assert isinstance(info, stcast.InspectReport)
    n, _, data = read_safetensors(src)
    assert info.path == str(src)
    assert info.to == "bf16"
    assert info.header_bytes == n
    assert info.data_bytes == len(data) == 16 + 8 + 2
    assert info.file_bytes == src.stat().st_size
    assert info.metadata == {"z": "1", "a": "2"} and list(info.metadata) == ["z", "a"]
    assert [t.to_dict() for t in info.tensors] == [
        {
            "name": "a",
            "dtype": "F32",
            "shape": [2, 2],
            "bytes": 16,
            "data_offsets": [0, 16],
            "target_dtype": "BF16",
            "target_bytes": 8,
            "action": "convert",
            "target_offsets": [8, 16],
            "reason": "converted",
            "pattern": None,
            "numerics": None,
        },
        {
            "name": "b",
            "dtype": "I64",
            "shape": [1],
            "bytes": 8,
            "data_offsets": [16, 24],
            "target_dtype": "I64",
            "target_bytes": 8,
            "action": "copy",
            "target_offsets": [0, 8],
            "reason": "not_float",
            "pattern": None,
            "numerics": None,
        },
        {
            "name": "c",
            "dtype": "BF16",
            "shape": [],
            "bytes": 2,
            "data_offsets": [24, 26],
            "target_dtype": "BF16",
            "target_bytes": 2,
            "action": "copy",
            "target_offsets": [16, 18],
            "reason": "already_target",
            "pattern": None,
            "numerics": None,
        },
    ]
    assert info.warnings == []
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst)
    assert info.output_bytes == dst.stat().st_size
    json.dumps(info.to_dict())
    fp16 = stcast.inspect(src, to="fp16")
    assert fp16.to == "fp16"
    assert [t.target_dtype for t in fp16.tensors] == ["F16", "I64", "BF16"]


def test_inspect_warnings(tmp_path):
    src = write_safetensors(tmp_path / "in.safetensors", {"x": ("BF16", [1], b"\0\0")})
    info = stcast.inspect(src)
    assert len(info.warnings) == 1 and "nothing to convert" in info.warnings[0]
