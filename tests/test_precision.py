"""Precision control (issue 7): --keep, --keep-min-size, fp16 with the overflow guard, and
`inspect` as a dry-run plan that matches what `convert` then does.

Outputs are read back with the test's own reader (conftest) and checked bit for bit against
numpy / ml_dtypes; nothing here trusts stcast's own report of what it wrote. The exhaustive
2^32 sweep of the F32 -> F16 kernel against an independent rule is in rust/kernels.rs
(`f32_to_f16_all_floats`, `cargo test --release`), and all 2^16 BF16 -> F16 patterns are
checked there (`bf16_to_f16_all_bf16s`) and here against numpy.
"""

from __future__ import annotations

import json
import warnings

import ml_dtypes
import numpy as np
import pytest
import stcast
from conftest import (
    assert_one_error_line,
    listing,
    read_safetensors,
    tensor_bytes,
    write_safetensors,
)
from stcast import _core

ELEM = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "U8": 1}
NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
OVERFLOW_WARNING = "became ±inf"


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)


def f16_bits(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x).astype(np.float16).view(np.uint16)


def layout(path) -> list[tuple[str, str, int, int]]:
    """(name, dtype, absolute start, end) of every tensor of a file, in data order."""
    n, items, _ = read_safetensors(path)
    rows = []
    for name, info in items:
        if name == "__metadata__":
            continue
        info = dict(info)
        a, b = info["data_offsets"]
        rows.append((name, info["dtype"], 8 + n + a, 8 + n + b))
    return sorted(rows, key=lambda r: (r[2], r[3]))


def assert_aligned_and_grouped(path) -> None:
    """Every tensor starts at a multiple of its element size; widths never increase."""
    rows = layout(path)
    widths = [ELEM[dtype] for _, dtype, _, _ in rows]
    assert widths == sorted(widths, reverse=True), rows
    for name, dtype, start, _ in rows:
        assert start % ELEM[dtype] == 0, (name, dtype, start)


def mixed_model(tmp_path, rng):
    """A small checkpoint with norms, biases, a router, odd sizes and every width."""
    f32 = lambda n: (rng.standard_normal(n) * 3).astype(np.float32)  # noqa: E731
    tensors = {
        "model.embed_tokens.weight": ("F32", [7, 3], f32(21)),
        "model.layers.0.input_layernorm.weight": ("F32", [5], f32(5)),
        "model.layers.0.mlp.gate.weight": ("F32", [3, 3], f32(9)),
        "model.layers.0.mlp.experts.0.w1": ("F32", [3, 5], f32(15)),
        "model.layers.0.self_attn.q_proj.bias": ("F32", [3], f32(3)),
        "model.norm.weight": ("F64", [3], rng.standard_normal(3)),
        "rotary.inv_freq": ("F32", [1], np.float32([0.5])),
        "position_ids": ("I64", [3], np.arange(3, dtype=np.int64)),
        "lm_head.weight": ("F16", [3, 3], rng.standard_normal(9).astype(np.float16)),
        "scale_shift_table": ("BF16", [3], bf16_bits(np.float32([1, 2, 3]))),
        "mask": ("U8", [3], np.uint8([1, 0, 1])),
    }
    return write_safetensors(tmp_path / "model.safetensors", tensors), tensors


def expected_bits(dtype: str, data, target: str) -> bytes:
    """What one converted tensor must hold (independent of stcast)."""
    x = np.frombuffer(np.ascontiguousarray(data).tobytes(), NP[dtype])
    if target == "bf16":
        return bf16_bits(x).tobytes()
    return f16_bits(x).tobytes()


# --- --keep and --keep-min-size ------------------------------------------------------------


@pytest.mark.parametrize("to", ["bf16", "fp16"])
def test_keep_mixed_output_is_exact_and_aligned(tmp_path, rng, to):
    src, tensors = mixed_model(tmp_path, rng)
    dst = tmp_path / f"out-{to}.safetensors"
    keep = ["*norm*", "*mlp.gate.weight"]
    with warnings.catch_warnings():
        # fp16: the BF16 tensor is copied, so the output mixes BF16 and F16 (tested below).
        warnings.filterwarnings("ignore", "1 BF16 tensor is copied", stcast.StcastWarning)
        report = stcast.convert(src, dst, to=to, keep=keep, keep_min_size=4)
    out = tensor_bytes(dst)
    kept = {
        "model.layers.0.input_layernorm.weight": "keep_pattern",
        "model.norm.weight": "keep_pattern",
        "model.layers.0.mlp.gate.weight": "keep_pattern",
        "model.layers.0.self_attn.q_proj.bias": "keep_min_size",
        "rotary.inv_freq": "keep_min_size",
    }
    target = "BF16" if to == "bf16" else "F16"
    for name, (dtype, shape, data) in tensors.items():
        got_dtype, got_shape, got = out[name]
        assert got_shape == shape, name
        raw = np.ascontiguousarray(data).tobytes()
        converts = dtype in ("F32", "F64") or (dtype == "F16" and to == "bf16")
        if name in kept or not converts:
            assert (got_dtype, got) == (dtype, raw), name
        else:
            assert got_dtype == target, name
            assert got == expected_bits(dtype, data, to), name
    assert_aligned_and_grouped(dst)
    assert report.tensors_kept == len(kept)
    assert report.bytes_kept == sum(len(out[n][2]) for n in kept)
    assert {k["name"]: k["reason"] for k in report.kept} == kept
    patterns = {k["name"]: k["pattern"] for k in report.kept}
    assert patterns["model.norm.weight"] == "*norm*"
    assert patterns["model.layers.0.mlp.gate.weight"] == "*mlp.gate.weight"
    assert patterns["rotary.inv_freq"] is None
    # stcast's own checker agrees, in strict mode (order, header bytes, alignment), given
    # the same precision options; without them it names a kept tensor and the way out.
    assert stcast.verify(src, dst, to=to, keep=keep, keep_min_size=4).ok
    # Without options, as DST records them; others given override them and fail it.
    assert stcast.verify(src, dst).ok
    bare = stcast.verify(src, dst, to=to, keep=["nothing"], keep_min_size=0)
    assert not bare.ok and bare.mismatch is not None
    assert "kept in F" in bare.mismatch.message and "keep patterns" in bare.mismatch.message
    assert stcast.verify(src, dst, loose=True).ok


def test_kept_f32_lands_before_bf16(tmp_path):
    """Odd element counts: a kept F32 tensor after a converted one would be misaligned."""
    tensors = {
        "a": ("F32", [3], np.float32([1, 2, 3])),
        "a.norm": ("F32", [1], np.float32([4])),
        "b": ("F32", [5], np.arange(5, dtype=np.float32)),
        "b.norm": ("F32", [3], np.float32([5, 6, 7])),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst, keep=["*.norm"])
    rows = layout(dst)
    assert [(r[0], r[1]) for r in rows] == [
        ("a.norm", "F32"),
        ("b.norm", "F32"),
        ("a", "BF16"),
        ("b", "BF16"),
    ]
    assert_aligned_and_grouped(dst)


def test_keep_pattern_matching_nothing_warns(tmp_path, rng):
    src, _ = mixed_model(tmp_path, rng)
    with pytest.warns(stcast.StcastWarning, match=r"keep pattern `\*nrom\*` matches no tensor"):
        report = stcast.convert(src, tmp_path / "out.safetensors", keep=["*norm*", "*nrom*"])
    assert any("*nrom*" in w for w in report.warnings)
    # A pattern that matches only a tensor that is not converted anyway still matched.
    with warnings.catch_warnings():
        warnings.simplefilter("error", stcast.StcastWarning)
        stcast.convert(src, tmp_path / "out2.safetensors", keep=["position_ids"])


def test_strict_refuses_an_unmatched_pattern_before_writing(tmp_path, rng, run_main):
    src, _ = mixed_model(tmp_path, rng)
    before = listing(tmp_path)
    with pytest.raises(
        stcast.Refused, match=r"`\*nrom\*`.*; nothing was written \(strict=True makes"
    ) as e:
        stcast.convert(src, tmp_path / "out.safetensors", keep=["*nrom*"], strict=True)
    assert e.value.kind == "refused"
    assert listing(tmp_path) == before
    rc, out, err = run_main("convert", src, tmp_path / "o.safetensors", "--keep", "x", "--strict")
    assert (rc, out) == (1, "")
    line = assert_one_error_line(err)
    assert "--keep pattern `x` matches no tensor name" in line and "(--strict makes" in line
    rc, out, err = run_main("convert", src, "--keep", "x", "--strict", "--json")
    assert rc == 1
    assert json.loads(out)["error"]["kind"] == "refused"
    assert listing(tmp_path) == before


def test_invalid_pattern_is_a_clear_error(tmp_path, rng):
    src, _ = mixed_model(tmp_path, rng)
    with pytest.raises(stcast.UsageError, match=r"keep: invalid pattern `a\[`") as e:
        stcast.convert(src, tmp_path / "out.safetensors", keep=["a["])
    assert e.value.kind == "usage" and e.value.option == "keep"
    with pytest.raises(stcast.UsageError, match="keep: 1 is not a string"):
        stcast.convert(src, tmp_path / "out.safetensors", keep=[1])  # type: ignore[list-item]


def test_keep_accepts_a_lone_string_and_fnmatch_stars(tmp_path, rng):
    src, _ = mixed_model(tmp_path, rng)
    # `**` is `*` (fnmatch), not a path wildcard; a str is one pattern.
    report = stcast.convert(src, tmp_path / "out.safetensors", keep="model.**.weight")
    assert report.tensors_kept == 4  # embed, layernorm, gate, norm (F64); not w1, bias, lm_head
    names = sorted(k["name"] for k in report.kept)
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.norm.weight",
    ]


def test_cli_reports_kept_tensors(tmp_path, rng, run_main):
    src, _ = mixed_model(tmp_path, rng)
    args = ("--keep", "*norm*", "--keep", "*router*", "--keep-min-size", "4")
    rc, out, err = run_main("convert", src, tmp_path / "o.safetensors", *args)
    assert rc == 0, err
    assert "kept     4 tensors (" in out and "(2 by --keep, 2 by min size)" in out
    assert "`*router*` matches no tensor name" in err
    rc, out, err = run_main("convert", src, tmp_path / "o2.safetensors", *args, "--json", "-q")
    result = json.loads(out)["result"]
    assert (result["tensors_kept"], len(result["kept"])) == (4, 4)
    rc, _, err = run_main("convert", src, "--keep-min-size", "-1")
    assert rc == 2 and "-1 is not from 0 to" in err


# --- --to fp16 -----------------------------------------------------------------------------


F32_EDGES = np.array(
    [
        0.0,
        -0.0,
        1.0,
        1 + 2.0**-11,  # tie, to even
        1 + 3 * 2.0**-11,  # tie, to odd -> up
        65504.0,
        np.nextafter(np.float32(65520), np.float32(0)),  # last value below the overflow tie
        65520.0,  # ties to inf
        -65520.0,
        np.finfo(np.float32).max,
        np.inf,
        -np.inf,
        2.0**-14,  # smallest normal
        np.nextafter(np.float32(2.0**-14), np.float32(0)),  # rounds up into the normals
        2.0**-24,  # smallest subnormal
        2.0**-25,  # ties to zero
        np.nextafter(np.float32(2.0**-25), np.float32(1)),
        1.5 * 2.0**-24,
        2.5 * 2.0**-24,
        -3.5 * 2.0**-24,
        np.finfo(np.float32).smallest_subnormal,
    ],
    dtype=np.float32,
)


def nan_patterns_f32() -> np.ndarray:
    return np.array(
        [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F801FFF, 0xFFBFFFFF],
        dtype=np.uint32,
    )


def assert_fp16(x: np.ndarray, got: np.ndarray) -> None:
    """Non-NaN inputs round like numpy; NaN becomes sign | 0x7E00 exactly."""
    nan = np.isnan(x)
    want = f16_bits(x)
    bad = np.flatnonzero(got[~nan] != want[~nan])
    assert bad.size == 0, f"{bad.size} mismatches, first input {x[~nan][bad[0]]!r}"
    sign = np.signbit(x[nan]).astype(np.uint16) << 15
    np.testing.assert_array_equal(got[nan], sign | 0x7E00)


def convert_fp16(tmp_path, dtype: str, x: np.ndarray, isa: str | None = None, **kw) -> np.ndarray:
    src = write_safetensors(tmp_path / f"{dtype}.safetensors", {"t": (dtype, [x.size], x)})
    dst = tmp_path / f"{dtype}-fp16-{isa}.safetensors"
    _core.convert(str(src), str(dst), to="fp16", tuning={"isa": isa, "window_mib": 1}, **kw)
    got_dtype, _, raw = tensor_bytes(dst)["t"]
    assert got_dtype == "F16"
    return np.frombuffer(raw, np.uint16)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_fp16_f32_edges_and_sample_match_numpy(tmp_path, isa):
    seed = 0xF16
    print(f"seed {seed:#x}")
    rng = np.random.default_rng(seed)
    bits = np.concatenate(
        [
            F32_EDGES.view(np.uint32),
            nan_patterns_f32(),
            rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32),
            # Magnitudes around f16's range, where all the rounding cases are.
            (rng.integers(0x3200_0000, 0x4780_0000, 1 << 18, dtype=np.uint32))
            | (rng.integers(0, 2, 1 << 18, dtype=np.uint32) << 31),
        ]
    )
    x = bits.view(np.float32)
    try:
        got = convert_fp16(tmp_path, "F32", x, isa)
    except ValueError as e:
        if "not available" in str(e):
            pytest.skip(f"{isa} is not available here")
        raise
    assert_fp16(x, got)


def test_fp16_f64_edges_and_sample_match_numpy(tmp_path):
    """numpy rounds F64 -> F16 once, as stcast does, so it is a valid oracle here."""
    seed = 0xF64
    print(f"seed {seed:#x}")
    rng = np.random.default_rng(seed)
    edges = np.array(
        [
            65519.999999999,
            65520.0,
            -65520.0,
            1e300,
            2.0**-25,
            2.0**-25 * (1 + 2.0**-40),  # just above the tie: rounds up, once
            1 + 2.0**-11 + 2.0**-40,  # likewise: double rounding via F32 would go down
            np.nan,
            -np.nan,
            np.inf,
            5e-324,
        ]
    )
    x = np.concatenate(
        [
            edges,
            rng.integers(0, 1 << 64, 1 << 17, dtype=np.uint64).view(np.float64),
            rng.standard_normal(1 << 17) * 10.0 ** rng.integers(-9, 7, 1 << 17),
        ]
    )
    assert_fp16(x, convert_fp16(tmp_path, "F64", x))


def test_from_bf16_converts_every_bf16_pattern_like_numpy(tmp_path):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = (bits.astype(np.uint32) << 16).view(np.float32)  # the exact value of each bf16
    got = convert_fp16(tmp_path, "BF16", bits, from_bf16=True)
    assert_fp16(x, got)


def test_fp16_without_from_bf16_copies_bf16_and_says_so(tmp_path, run_main):
    tensors = {
        "w": ("F32", [2], np.float32([1, 2])),
        "b": ("BF16", [2], bf16_bits(np.float32([3, 4]))),
    }
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    with pytest.warns(stcast.StcastWarning, match="the output mixes BF16 and F16.*from_bf16=True"):
        stcast.convert(src, tmp_path / "out.safetensors", to="fp16")
    out = tensor_bytes(tmp_path / "out.safetensors")
    assert out["b"] == ("BF16", [2], bf16_bits(np.float32([3, 4])).tobytes())
    assert out["w"][0] == "F16"
    rc, _, err = run_main("convert", src, tmp_path / "o2.safetensors", "--to", "fp16")
    assert rc == 0 and "mixes BF16 and F16 (--from-bf16 converts them too)" in err
    rc, _, err = run_main(
        "convert", src, tmp_path / "o3.safetensors", "--to", "fp16", "--from-bf16"
    )
    assert (rc, err) == (0, "")
    assert tensor_bytes(tmp_path / "o3.safetensors")["b"][0] == "F16"
    assert stcast.verify(src, tmp_path / "o3.safetensors", to="fp16", from_bf16=True).ok
    # Without from_bf16, verify expects the BF16 tensor kept, as convert did: unless DST
    # records from_bf16 (an output without a record needs it given).
    assert stcast.verify(src, tmp_path / "out.safetensors", to="fp16").ok
    assert stcast.verify(src, tmp_path / "o3.safetensors", to="fp16").ok
    o4 = tmp_path / "o4.safetensors"
    stcast.convert(src, o4, to="fp16", from_bf16=True, no_record=True)
    assert not stcast.verify(src, o4, to="fp16").ok
    assert stcast.verify(src, o4, to="fp16", from_bf16=True).ok


# --- the overflow guard --------------------------------------------------------------------


def overflow_model(tmp_path):
    """Tensors with known numbers of finite values that overflow in fp16 (and in bf16)."""
    f32 = np.float32
    below = np.nextafter(f32(65520), f32(0))
    tensors = {
        # 65520 and beyond overflow; 65519.996 and inf/NaN inputs do not count.
        "big": ("F32", [8], f32([65520, -65520, 1e30, below, np.inf, np.nan, 1, -7e4])),
        "bigger": ("F64", [6], np.float64([1e300, -1e300, 65520, 7e4, 65519.999, -np.inf])),
        "some": ("F32", [4], f32([0.5, 1e5, 2, 3])),
        "fine": ("F32", [3], f32([1, 2, 65504])),
        "brain": ("BF16", [4], bf16_bits(f32([65536, 65280, -65536, 1]))),
        "huge": ("F32", [3], f32([np.finfo(f32).max, 3.3e38, 1])),
    }
    # fp16 (from_bf16): big 4, bigger 4, some 1, fine 0, brain 2, huge 2.
    # bf16: only values >= 2^128 - 2^119 overflow: huge 1 (FLT_MAX; 3.3e38 stays finite),
    # bigger 2 (+-1e300).
    return write_safetensors(tmp_path / "ovf.safetensors", tensors)


FP16_OVERFLOW = {"big": 4, "bigger": 4, "some": 1, "fine": 0, "brain": 2, "huge": 2}
BF16_OVERFLOW = {"big": 0, "bigger": 2, "some": 0, "fine": 0, "huge": 1}


@pytest.mark.parametrize("to", ["fp16", "bf16"])
def test_overflow_counts_are_exact(tmp_path, to):
    src = overflow_model(tmp_path)
    want = FP16_OVERFLOW if to == "fp16" else BF16_OVERFLOW
    info = stcast.inspect(src, to=to, from_bf16=True, scan=True)
    assert info.scanned
    got = {t.name: t.numerics["overflow"] for t in info.tensors if t.numerics is not None}
    assert got == want
    inf_in = {t.name: t.numerics["inf_in"] for t in info.tensors if t.numerics is not None}
    assert (inf_in["big"], inf_in["bigger"]) == (1, 1)
    # The conversion itself counts the same, and the output holds that many new infinities.
    dst = tmp_path / f"out-{to}.safetensors"
    with pytest.warns(stcast.StcastWarning, match=OVERFLOW_WARNING) as record:
        stcast.convert(src, dst, to=to, from_bf16=True)
    message = next(str(w.message) for w in record if OVERFLOW_WARNING in str(w.message))
    total = sum(want.values())
    tensors = sum(1 for n in want.values() if n)
    assert message.startswith(f"{total} finite values in {tensors} tensors became ±inf")
    out = tensor_bytes(dst)
    for name, n in want.items():
        bits = np.frombuffer(out[name][2], np.uint16)
        exp = 0x7C00 if to == "fp16" else 0x7F80
        infinities = int(np.count_nonzero((bits & 0x7FFF) == exp))
        source_inf = inf_in.get(name, 0)
        assert infinities - source_inf == n, name


def test_overflow_warning_names_the_worst_tensors_first(tmp_path, run_main):
    src = overflow_model(tmp_path)
    with pytest.warns(stcast.StcastWarning, match=OVERFLOW_WARNING) as record:
        stcast.convert(src, tmp_path / "out.safetensors", to="fp16", from_bf16=True)
    message = next(str(w.message) for w in record if OVERFLOW_WARNING in str(w.message))
    assert "in F16: `big` (4), `bigger` (4), `brain` (2), `huge` (2), `some` (1) (" in message
    assert 'on_overflow="keep" or a keep pattern' in message
    rc, _, err = run_main("convert", src, tmp_path / "o.safetensors", "--to", "fp16")
    assert rc == 0
    lines = [line for line in err.splitlines() if OVERFLOW_WARNING in line]
    assert len(lines) == 1 and lines[0].startswith("stcast: warning: 11 finite values"), err
    assert "--on-overflow keep or a --keep pattern" in lines[0]


def test_on_overflow_error_leaves_nothing_behind(tmp_path, run_main):
    src = overflow_model(tmp_path)
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    before = listing(tmp_path)
    with pytest.raises(stcast.StcastError) as e:
        stcast.convert(src, dst, to="fp16", force=True, from_bf16=True, on_overflow="error")
    assert e.value.kind == "refused"
    message = str(e.value)
    assert message.startswith(f"{src}: 13 finite values in 5 tensors would become ±inf in F16")
    assert "most in tensor `big` (4)" in message and "nothing was written" in message
    assert listing(tmp_path) == before and dst.read_bytes() == b"old"
    args = ("--to", "fp16", "--from-bf16", "--on-overflow", "error")
    rc, out, err = run_main("convert", src, tmp_path / "o.safetensors", *args)
    assert (rc, out) == (1, "")
    assert "would become ±inf" in assert_one_error_line(err)
    assert listing(tmp_path) == before
    # No overflow: the guard lets it through.
    fine = write_safetensors(tmp_path / "fine.safetensors", {"t": ("F32", [2], np.float32([1, 2]))})
    stcast.convert(fine, tmp_path / "fine-out.safetensors", to="fp16", on_overflow="error")


def test_on_overflow_keep_keeps_exactly_what_would_overflow(tmp_path, run_main):
    src = overflow_model(tmp_path)
    dst = tmp_path / "out.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error", stcast.StcastWarning)  # no overflow warning now
        report = stcast.convert(src, dst, to="fp16", from_bf16=True, on_overflow="keep")
    would = {n for n, c in FP16_OVERFLOW.items() if c}
    assert {k["name"] for k in report.kept} == would
    assert {k["reason"] for k in report.kept} == {"keep_overflow"}
    assert report.on_overflow == "keep"
    out = tensor_bytes(dst)
    src_tensors = tensor_bytes(src)
    for name in FP16_OVERFLOW:
        if name in would:
            assert out[name] == src_tensors[name], name
        else:
            assert out[name][0] == "F16", name
    assert_aligned_and_grouped(dst)
    assert stcast.verify(src, dst, to="fp16", from_bf16=True, on_overflow="keep").ok
    assert stcast.verify(src, dst).ok  # as DST records it
    assert not stcast.verify(src, dst, to="fp16", from_bf16=True, on_overflow="warn").ok
    # A --keep pattern that already keeps one is its reason; the scan keeps the others.
    options = {"to": "fp16", "from_bf16": True, "on_overflow": "keep"}
    report = stcast.convert(src, tmp_path / "o2.safetensors", keep=["big"], **options)
    reasons = {k["name"]: k["reason"] for k in report.kept}
    overflow = "keep_overflow"
    assert reasons == {
        "big": "keep_pattern",
        "bigger": overflow,
        "some": overflow,
        "brain": overflow,
        "huge": overflow,
    }
    args = ("--to", "fp16", "--from-bf16", "--on-overflow", "keep")
    rc, _, err = run_main("convert", src, tmp_path / "o3.safetensors", *args)
    assert rc == 0
    assert "reading the float tensors once first" in err
    assert OVERFLOW_WARNING not in err


def test_on_overflow_keep_reports_progress_over_both_reads(tmp_path):
    src = overflow_model(tmp_path)
    calls = []
    stcast.convert(
        src,
        tmp_path / "out.safetensors",
        to="fp16",
        from_bf16=True,
        on_overflow="keep",
        progress=lambda done, total: calls.append((done, total)),
    )
    totals = {t for _, t in calls}
    assert len(totals) == 1, calls
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == totals.pop()


def test_on_overflow_rejects_unknown_modes(tmp_path, run_main):
    src = overflow_model(tmp_path)
    with pytest.raises(ValueError, match="on_overflow"):
        stcast.convert(src, tmp_path / "o.safetensors", on_overflow="ignore")
    rc, _, err = run_main("convert", src, "--on-overflow", "ignore")
    assert rc == 2 and "invalid choice" in err


# --- inspect: the dry-run plan -----------------------------------------------------------


PLANS = [
    {"to": "bf16"},
    {"to": "fp16"},
    {"to": "bf16", "keep": ["*norm*", "*gate.weight"], "keep_min_size": 4},
    {"to": "fp16", "keep": ["*norm*"], "from_bf16": True},
    {"to": "fp16", "keep_min_size": 2, "on_overflow": "keep"},
]


@pytest.mark.parametrize("options", PLANS, ids=lambda o: json.dumps(o, sort_keys=True))
def test_inspect_plan_matches_convert(tmp_path, rng, options):
    src, _ = mixed_model(tmp_path, rng)
    # An overflowing tensor, so that the overflow plan has something to keep.
    tensors = tensor_bytes(src)
    extra = {k: (d, s, b) for k, (d, s, b) in tensors.items()}
    extra["hot"] = ("F32", [2], np.float32([1e6, 1]).tobytes())
    src = write_safetensors(tmp_path / "plan.safetensors", extra)
    dst = tmp_path / "out.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stcast.StcastWarning)
        info = stcast.inspect(src, dst, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stcast.StcastWarning)
        report = stcast.convert(src, dst, **options)
    n, items, _ = read_safetensors(dst)
    written = {name: dict(i) for name, i in items if name != "__metadata__"}
    assert info.output_bytes == dst.stat().st_size == report.bytes_out
    for t in info.tensors:
        w = written[t.name]
        assert (t.target_dtype, t.target_offsets) == (w["dtype"], w["data_offsets"]), t.name
        assert t.target_bytes == w["data_offsets"][1] - w["data_offsets"][0]
        assert (t.action == "convert") == (t.reason == "converted")
    kept = {k["name"]: (k["reason"], k["pattern"]) for k in report.kept}
    planned = {t.name: (t.reason, t.pattern) for t in info.tensors if t.reason.startswith("keep")}
    assert planned == kept
    assert (info.tensors_kept, info.bytes_kept) == (report.tensors_kept, report.bytes_kept)
    assert info.tensors_converted == report.tensors_converted
    assert info.destination is not None and info.destination["fits"]
    assert info.destination["need_bytes"] == info.output_bytes
    if options.get("on_overflow") == "keep":
        assert kept["hot"] == ("keep_overflow", None)


def test_inspect_scan_counts_and_reads_nothing_else(tmp_path, run_main):
    src = overflow_model(tmp_path)
    before = listing(tmp_path)
    plain = stcast.inspect(src, to="fp16")
    assert not plain.scanned and all(t.numerics is None for t in plain.tensors)
    calls = []
    info = stcast.inspect(src, to="fp16", scan=True, progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1][0] == calls[-1][1] > 0
    by_name = {t.name: t for t in info.tensors}
    assert by_name["brain"].reason == "bf16_source" and by_name["brain"].numerics is None
    assert by_name["big"].numerics["elements"] == 8
    assert by_name["big"].numerics["nan_in"] == 1
    assert listing(tmp_path) == before
    rc, out, err = run_main("inspect", src, "--to", "fp16", "--scan")
    assert rc == 0
    assert "OVERFLOW" in out and "UNDERFLOW" in out
    assert "values would overflow to inf in 4 tensors (worst: `big` 4, `bigger` 4" in out
    rc, out, err = run_main("inspect", src, "--to", "fp16", "--scan", "--json")
    doc = json.loads(out)
    assert doc["command"] == "inspect" and doc["result"]["scanned"] is True
    tensors = doc["result"]["tensors"]
    assert {t["name"]: t["numerics"] and t["numerics"]["overflow"] for t in tensors} == {
        "big": 4,
        "bigger": 4,
        "some": 1,
        "fine": 0,
        "brain": None,
        "huge": 2,
    }


def test_inspect_human_table_and_destination(tmp_path, rng, run_main):
    src, _ = mixed_model(tmp_path, rng)
    args = ("--keep", "*norm*", "--keep-min-size", "4")
    rc, out, err = run_main("inspect", src, tmp_path / "x.safetensors", *args)
    assert rc == 0, err
    assert "WHY" in out and "keep: --keep '*norm*'" in out and "keep: under --keep-min-size" in out
    assert "copy: not a float" in out and "convert" in out
    assert "4 kept in their dtype" in out
    assert f"space:    {tmp_path} has " in out and ": fits" in out
    rc, out, err = run_main("inspect", src, "--keep", "*nope*", "--json")
    doc = json.loads(out)["result"]
    assert doc["keep_unmatched"] == ["*nope*"] and "`*nope*` matches no tensor" in err


# --- folders: --keep judged over the whole folder -----------------------------------------


def two_shards(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    write_safetensors(
        src / "model-00001-of-00002.safetensors",
        {"a.weight": ("F32", [2], np.float32([1, 2])), "a.norm": ("F32", [2], np.float32([3, 4]))},
    )
    write_safetensors(
        src / "model-00002-of-00002.safetensors",
        {"b.weight": ("F32", [2], np.float32([5, 6])), "router": ("F32", [1], np.float32([7]))},
    )
    (src / "config.json").write_text('{"torch_dtype": "float32"}\n')
    return src


def test_folder_keep_pattern_judged_over_the_whole_folder(tmp_path):
    src = two_shards(tmp_path)
    dst = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("error", stcast.StcastWarning)  # each matches in one shard only
        report = stcast.convert(src, dst, keep=["*norm*", "router"])
    assert report.tensors_kept == 2
    one = tensor_bytes(dst / "model-00001-of-00002.safetensors")
    two = tensor_bytes(dst / "model-00002-of-00002.safetensors")
    assert one["a.norm"][0] == two["router"][0] == "F32"
    assert one["a.weight"][0] == two["b.weight"][0] == "BF16"
    with pytest.warns(stcast.StcastWarning) as record:
        report = stcast.convert(src, tmp_path / "out2", keep=["*norm*", "*typo*"])
    typo = [w for w in record if "*typo*" in str(w.message)]
    assert len(typo) == 1, [str(w.message) for w in record]
    assert sum("*typo*" in w for w in report.warnings) == 1


def test_folder_strict_refuses_before_any_work(tmp_path, run_main):
    src = two_shards(tmp_path)
    dst = tmp_path / "out"
    with pytest.raises(stcast.Refused, match=r"`\*typo\*` matches no tensor.*strict=True") as e:
        stcast.convert(src, dst, keep=["*typo*"], strict=True)
    assert e.value.kind == "refused"
    assert not dst.exists()
    rc, out, err = run_main("convert", src, dst, "--keep", "router", "--strict", "-q")
    assert (rc, out, err) == (0, "", "")


def test_folder_resume_and_finalize_follow_the_keep_options(tmp_path):
    src = two_shards(tmp_path)
    dst = tmp_path / "out"
    stcast.convert(src, dst, keep=["*norm*"])
    again = stcast.convert(src, dst, keep=["*norm*"], resume=True)
    assert {f.action for f in again.files if f.kind == "weights"} == {"skipped"}
    # Other options: the finished run's outputs are not what this plan writes; resume
    # refuses to replace them, force does.
    with pytest.raises(stcast.Refused, match="force=True replaces them"):
        stcast.convert(src, dst, keep=["router"], resume=True)
    changed = stcast.convert(src, dst, keep=["router"], force=True)
    assert {f.action for f in changed.files if f.kind == "weights"} == {"converted"}
    assert tensor_bytes(dst / "model-00001-of-00002.safetensors")["a.norm"][0] == "BF16"
    # Shards with --keep, then finalize (which reads the options from the manifests).
    dst2 = tmp_path / "sharded"
    for i in (1, 2):
        stcast.convert(src, dst2, keep=["router"], shard=(i, 2))
    final = stcast.finalize(src, dst2)
    assert final.complete
    assert tensor_bytes(dst2 / "model-00002-of-00002.safetensors")["router"][0] == "F32"


def test_folder_quantized_allowed_when_keep_keeps_the_scales(tmp_path):
    src = tmp_path / "q"
    src.mkdir()
    write_safetensors(
        src / "model.safetensors",
        {
            "w": ("F8_E4M3", [4], np.uint8([1, 2, 3, 4])),
            "w.weight_scale": ("F32", [1], np.float32([0.5])),
            "norm": ("F32", [2], np.float32([1, 2])),
        },
    )
    with pytest.raises(stcast.StcastError, match="quantized checkpoint"):
        stcast.convert(src, tmp_path / "o1")
    with pytest.raises(stcast.StcastError, match=r"quantized checkpoint .*\(`w.weight_scale`\)"):
        stcast.convert(src, tmp_path / "o2", keep=["norm"])
    report = stcast.convert(src, tmp_path / "o3", keep=["*scale*"])
    out = tensor_bytes(tmp_path / "o3" / "model.safetensors")
    assert out["w.weight_scale"][0] == "F32" and out["norm"][0] == "BF16"
    assert report.tensors_kept == 1


def test_folder_inspect_lists_each_file(tmp_path, run_main):
    src = two_shards(tmp_path)
    info = stcast.inspect(src, tmp_path / "dst", keep=["*norm*", "*typo*"])  # returns, no warning
    assert info.folder and len(info.tensors) == sum(len(f.tensors) for f in info.files)
    assert [f.path for f in info.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert info.keep_unmatched == ["*typo*"] and info.tensors_kept == 1
    assert info.other_bytes == (src / "config.json").stat().st_size
    assert info.destination["folder"] == str(tmp_path) and info.destination["fits"]
    dst = tmp_path / "real"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stcast.StcastWarning)
        stcast.convert(src, dst, keep=["*norm*", "*typo*"])
    weights = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    assert info.output_bytes - info.other_bytes == weights
    rc, out, err = run_main("inspect", src, "--keep", "*norm*", "--scan")
    assert rc == 0, err
    assert "model-00001-of-00002.safetensors:" in out and "model-00002-of-00002.safetensors:" in out
    assert "folder:   " in out and "2 weight files" in out
    rc, out, err = run_main("inspect", src, "--json")
    result = json.loads(out)["result"]
    assert result["folder"] is True and len(result["files"]) == 2
