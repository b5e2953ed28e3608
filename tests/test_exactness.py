"""Exactness of the real kernels, each instruction set pinned, through files.

- F32: 2^24 bit patterns per run (every special class plus a seeded random sample) against
  ml_dtypes, NaN encodings included. The full 2^32 sweep against an independent rule runs in
  `cargo test --release` (rust/kernels.rs).
- F16: all 2^16 patterns against ml_dtypes.
- F64: the oracle is an exact reference (one correct rounding), vectorised below and itself
  checked against `fractions` (tests/reference.py), never a package: torch rounds F64 twice
  (via F32), ml_dtypes did before 0.7 and rounds once from 0.7 on. A test states which rounding
  the installed ml_dtypes does and checks it.
- torch, when installed: equal on every non-NaN value.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import stcast
from conftest import read_safetensors, write_safetensors
from reference import f64_bits_to_bf16_exact
from stcast import _core

ISAS = ["scalar", "avx2", "avx512"]
SEED = 0x5EED_B16
F32_PATTERNS = 1 << 24


def convert_pinned(src: Path, dst: Path, isa: str) -> dict[str, np.ndarray]:
    """Convert with one kernel family (skip if this CPU lacks it); the output tensors' bits."""
    try:
        _core.convert(str(src), str(dst), tuning={"isa": isa, "window_mib": 4})
    except ValueError as e:
        if "not available" in str(e):
            pytest.skip(f"{isa} is not available on this CPU")
        raise
    _, items, data = read_safetensors(dst)
    out = {}
    for name, info in items:
        if name == "__metadata__":  # the record of convert's options
            continue
        info = dict(info)
        assert info["dtype"] == "BF16", name
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], np.uint16)
    return out


def split(values: np.ndarray, sizes: list[int]) -> dict[str, np.ndarray]:
    """Cut into tensors of odd sizes, so that kernels start and end at every alignment."""
    parts = {}
    start = 0
    for i, n in enumerate([*sizes, len(values) - sum(sizes)]):
        parts[f"t{i}"] = values[start : start + n]
        start += n
    return parts


def write_parts(path: Path, dtype: str, parts: dict[str, np.ndarray]) -> Path:
    return write_safetensors(path, {k: (dtype, [len(v)], v) for k, v in parts.items()})


def joined(out: dict[str, np.ndarray], parts: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([out[k] for k in parts])


def first_difference(got: np.ndarray, want: np.ndarray, inputs: np.ndarray) -> str:
    bad = np.flatnonzero(got != want)
    if bad.size == 0:
        return ""
    i = bad[0]
    width = inputs.dtype.itemsize * 2
    return (
        f"{bad.size} mismatches; first at {i}: input 0x{int(inputs[i]):0{width}X} "
        f"-> 0x{int(got[i]):04X}, expected 0x{int(want[i]):04X}"
    )


# --- F32 ----------------------------------------------------------------------------------


def f32_patterns() -> np.ndarray:
    """2^24 F32 bit patterns: every special class, then a seeded random sample."""
    highs = np.arange(1 << 16, dtype=np.uint32) << 16
    # Every sign and exponent, with the low halves that decide rounding: exact, just above,
    # ties (0x8000), just around them, and the largest; NaN payloads in the low half only.
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    classes = [(highs[:, None] | lows[None, :]).ravel()]
    # Whole low halves where every bit matters: zero and tiny subnormals, subnormal to normal,
    # around 1, FLT_MAX and overflow, infinity and the NaN classes, each with both signs.
    full = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x7F7F, 0x7F80, 0x7F81, 0x7FBF, 0x7FC0]
    full += [0x7FFF]
    low = np.arange(1 << 16, dtype=np.uint32)
    for h in full:
        for sign in (0, 0x8000):
            classes.append(((h | sign) << 16) | low)
    special = np.concatenate(classes)
    print(f"F32 patterns: {special.size} special, random rest with seed {SEED:#x}")
    rng = np.random.default_rng(SEED)
    random = rng.integers(0, 1 << 32, F32_PATTERNS - special.size, dtype=np.uint32)
    return np.concatenate([special, random])


@pytest.fixture(scope="module")
def f32_case(tmp_path_factory):
    bits = f32_patterns()
    assert bits.size == F32_PATTERNS
    with np.errstate(invalid="ignore", over="ignore"):
        want = bits.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    parts = split(bits, [1, 3, 17, 1023, 65537, 4_000_001])
    src = write_parts(tmp_path_factory.mktemp("f32") / "f32.safetensors", "F32", parts)
    return src, parts, bits, want


def test_f32_reference_is_the_documented_rule(f32_case):
    """ml_dtypes agrees with the README's integer rule, NaN included, on every pattern used."""
    _, _, u, want = f32_case
    rule = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rule[nan] = ((u[nan] >> 16) & 0x8000).astype(np.uint16) | 0x7FC0
    assert first_difference(rule, want, u) == ""


@pytest.mark.parametrize("isa", ISAS)
def test_f32_to_bf16_matches_ml_dtypes(f32_case, tmp_path, isa):
    src, parts, bits, want = f32_case
    got = joined(convert_pinned(src, tmp_path / "out.safetensors", isa), parts)
    assert first_difference(got, want, bits) == ""


# --- F16 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
def test_all_f16_to_bf16_match_ml_dtypes(tmp_path, isa):
    bits = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):
        want = bits.view(np.float16).astype(ml_dtypes.bfloat16).view(np.uint16)
    parts = split(bits, [7, 33, 1000])
    src = write_parts(tmp_path / "f16.safetensors", "F16", parts)
    got = joined(convert_pinned(src, tmp_path / "out.safetensors", isa), parts)
    assert first_difference(got, want, bits) == ""


# --- F64 ----------------------------------------------------------------------------------


def bf16_exact_f64(x: np.ndarray) -> np.ndarray:
    """bf16 bits of float64 values rounded once, to nearest, ties to even.

    Why every step is exact: `lo`, |x| truncated to the bf16 grid, is computed by clearing
    mantissa bits (normal range) or as floor(|x| * 2^133) * 2^-133 (subnormal range; scaling
    by powers of two is exact here). `lo` and `hi`, the next bf16 value (2^128 past the
    largest finite), have at most 8 significant bits, so they convert to float32 exactly, and
    their sum (at most 9 bits over one binade) and half of it, the midpoint, are exact in
    float64. Comparing |x| with the midpoint is then exact: below -> lo, above -> hi, equal ->
    the even one. Reaching 2^128 means infinity.
    """
    bits = x.view(np.uint64)
    sign = ((bits >> np.uint64(48)) & np.uint64(0x8000)).astype(np.uint16)
    a = np.abs(x)
    nan = np.isnan(x)
    big = ~nan & (a >= 2.0**128)  # infinities included
    small = ~nan & (a < 2.0**-126)
    normal = ~nan & ~big & ~small
    lo = np.zeros_like(a)
    mask = np.uint64(~((1 << 45) - 1) & 0xFFFF_FFFF_FFFF_FFFF)
    lo[normal] = (a[normal].view(np.uint64) & mask).view(np.float64)
    lo[small] = np.floor(a[small] * 2.0**133) * 2.0**-133
    lo_bits = (lo.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    hi_bits = lo_bits + np.uint16(1)
    hi = (hi_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    hi[hi_bits == 0x7F80] = 2.0**128
    mid = (lo + hi) / 2
    up = (a > mid) | ((a == mid) & (lo_bits & 1 == 1))
    out = np.where(up, hi_bits, lo_bits)
    out[big] = 0x7F80
    out[nan] = 0x7FC0
    return out | sign


def is_bf16_nan(b: np.ndarray) -> np.ndarray:
    return ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)


def bf16_value(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


WITNESSES = [
    (1 + 2**-8 + 2**-40, 0x3F81),  # torch and ml_dtypes: 0x3F80
    (2**-134 + 2**-160, 0x0001),  # torch and ml_dtypes: 0x0000
    (struct.unpack("<d", (0x47EFEFFFFFFFFFFF).to_bytes(8, "little"))[0], 0x7F7F),  # vs inf
    (-(1 + 2**-8 + 2**-40), 0xBF81),
    (2.0**128, 0x7F80),
    (-(2.0**128), 0xFF80),
    (1e300, 0x7F80),
    (-1.7976931348623157e308, 0xFF80),
    (2.0**128 - 2.0**119, 0x7F80),  # the tie above the largest finite: to even, infinity
    (np.nextafter(2.0**128 - 2.0**119, 0), 0x7F7F),
    (2.0**-134, 0x0000),  # the tie between 0 and the smallest subnormal: to even, 0
    (3 * 2.0**-134, 0x0002),
    (5e-324, 0x0000),
    (-5e-324, 0x8000),
    (0.0, 0x0000),
    (-0.0, 0x8000),
    (math.inf, 0x7F80),
    (-math.inf, 0xFF80),
    (math.nan, 0x7FC0),
    (-math.nan, 0xFFC0),
]
NAN_PAYLOADS = [0x7FF0000000000001, 0xFFF0000000000001, 0x7FF8000000000000, 0xFFFFFFFFFFFFFFFF]
NAN_PAYLOADS += [0x7FF00000FFFFFFFF, 0x7FF7FFFFFFFFFFFF]


def f64_values() -> np.ndarray:
    """The witnesses, values at and around every kind of bf16 tie, and random values."""
    rng = np.random.default_rng(SEED + 64)
    print(f"F64 values: seed {SEED + 64:#x}")
    # Ties: midpoints between random adjacent bf16 values of all finite exponents, and values
    # just beside them (1 ulp, below the F32 half-ulp where double rounding goes wrong, ...).
    base = rng.integers(0, 0x7F80, 200_000, dtype=np.uint16)
    lo, hi = bf16_value(base), bf16_value(base + np.uint16(1))
    hi[base == 0x7F7F] = 2.0**128
    mid = (lo + hi) / 2
    gap = hi - lo
    near = [
        mid,
        np.nextafter(mid, np.inf),
        np.nextafter(mid, 0),
        mid + gap * 2.0**-17,
        mid - gap * 2.0**-17,
        mid + gap * 2.0**-30,
    ]
    ties = np.concatenate(near)
    ties *= np.where(rng.random(ties.size) < 0.5, -1.0, 1.0)
    # Random: every bit pattern (NaN, huge, tiny included), and values in bf16's range.
    any_bits = rng.integers(0, 1 << 64, 300_000, dtype=np.uint64, endpoint=False).view(np.float64)
    exps = rng.integers(-140, 129, 500_000)
    in_range = np.ldexp(1 + rng.random(500_000), exps) * np.where(rng.random(500_000) < 0.5, -1, 1)
    witnesses = np.array([w for w, _ in WITNESSES])
    payloads = np.array(NAN_PAYLOADS, np.uint64).view(np.float64)
    return np.concatenate([witnesses, payloads, ties, any_bits, in_range])


@pytest.fixture(scope="module")
def f64_case(tmp_path_factory):
    x = f64_values()
    assert x.size >= 10**6 + len(WITNESSES)
    with np.errstate(invalid="ignore", over="ignore"):
        want = bf16_exact_f64(x)
    parts = split(x, [len(WITNESSES), 5, 999, 1_000_003])
    src = write_parts(tmp_path_factory.mktemp("f64") / "f64.safetensors", "F64", parts)
    return src, parts, x, want


def test_f64_reference_is_exact(f64_case):
    """The vectorised reference against `fractions` (tests/reference.py) on a subset."""
    _, _, x, want = f64_case
    rng = np.random.default_rng(SEED + 1)
    idx = np.concatenate([np.arange(len(WITNESSES) + 6), rng.choice(x.size, 20_000)])
    bits = x.view(np.uint64)
    for i in idx:
        assert want[i] == f64_bits_to_bf16_exact(int(bits[i])), hex(int(bits[i]))
    for i, (_, expected) in enumerate(WITNESSES):
        assert want[i] == expected, WITNESSES[i]
    nan = np.isnan(x)
    assert np.all((want[nan] & 0x7FFF) == 0x7FC0)


@pytest.mark.parametrize("isa", ISAS)
def test_f64_to_bf16_is_rounded_once(f64_case, tmp_path, isa):
    src, parts, x, want = f64_case
    got = joined(convert_pinned(src, tmp_path / "out.safetensors", isa), parts)
    assert first_difference(got, want, x.view(np.uint64)) == ""


def double_rounded(x: np.ndarray) -> np.ndarray:
    """bf16 bits of float64 values rounded twice, to F32 and then to BF16 (torch's way)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def ml_dtypes_rounds_f64_once() -> bool:
    """ml_dtypes rounds F64 -> BF16 once from 0.7.0 on; before, twice via F32."""
    major, minor = (int(p) for p in ml_dtypes.__version__.split(".")[:2])
    return (major, minor) >= (0, 7)


def test_f64_witnesses_in_verify(tmp_path):
    """verify recomputes F64 correctly too: a double-rounded file is refused, ours accepted."""
    x = np.array([w for w, _ in WITNESSES])
    src = write_safetensors(tmp_path / "w.safetensors", {"w": ("F64", [len(x)], x)})
    ours = tmp_path / "ours.safetensors"
    _core.convert(str(src), str(ours))
    assert stcast.verify(src, ours).ok
    twice = double_rounded(x)
    theirs = write_safetensors(tmp_path / "twice.safetensors", {"w": ("BF16", [len(x)], twice)})
    m = stcast.verify(src, theirs, loose=True).mismatch
    assert m is not None and (m.index, m.expected_bits, m.found_bits) == (0, "0x3F81", "0x3F80")


def test_ml_dtypes_f64_rounding_is_what_its_version_says(f64_case):
    """The installed ml_dtypes rounds F64 as its version says: once (>= 0.7), else twice.

    Either way stcast is checked against the exact reference above, not against ml_dtypes;
    this test only keeps the docs' statement about ml_dtypes true for the version installed.
    """
    _, _, x, want = f64_case
    with np.errstate(over="ignore", invalid="ignore"):
        theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    expected = want if ml_dtypes_rounds_f64_once() else double_rounded(x)
    print(
        f"ml_dtypes {ml_dtypes.__version__} rounds F64 -> BF16",
        "once" if ml_dtypes_rounds_f64_once() else "twice (via F32)",
    )
    assert first_difference(theirs[~nan], expected[~nan], x.view(np.uint64)[~nan]) == ""
    # The witnesses tell the two roundings apart.
    assert not np.array_equal(want[: len(WITNESSES)], double_rounded(x[: len(WITNESSES)]))


# --- torch --------------------------------------------------------------------------------


def test_equals_torch_on_every_non_nan(f32_case, tmp_path):
    torch = pytest.importorskip("torch")
    _, _, bits, _ = f32_case
    f32 = bits[: 4 << 20].view(np.float32)  # every special class and 2.3M random ones
    f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    src = write_safetensors(
        tmp_path / "ckpt.safetensors",
        {"w": ("F32", [f32.size], f32), "h": ("F16", [f16.size], f16)},
    )
    out = tmp_path / "ckpt-bf16.safetensors"
    _core.convert(str(src), str(out))
    _, items, data = read_safetensors(out)
    for name, values in (("w", f32), ("h", f16)):
        a, b = dict(dict(items)[name])["data_offsets"]
        ours = np.frombuffer(data[a:b], np.uint16)
        theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy()
        theirs = theirs.view(np.uint16)
        nan = np.isnan(values)
        assert np.array_equal(is_bf16_nan(ours), nan) and np.array_equal(is_bf16_nan(theirs), nan)
        inputs = values.view(np.uint16 if name == "h" else np.uint32)
        assert first_difference(ours[~nan], theirs[~nan], inputs[~nan]) == "", name
