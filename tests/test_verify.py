"""`stcast verify` and `stcast.verify`: accepts what convert wrote, rejects every change."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import (
    assert_json_error_stderr,
    assert_one_error_line,
    read_safetensors,
    write_raw,
    write_safetensors,
)
from stcast import _core

TORCH_PATH = Path(__file__).resolve().parents[1].parent / "shared" / "peers" / "torch_path.py"


def convert(src: Path, dst: Path, **kw) -> Path:
    """Convert with the engine directly: no plan warnings to catch, and private options.
    The sources hold every dtype, F8 and F4 beside F32 too: allowed as quantized."""
    _core.convert(str(src), str(dst), **{"allow_quantized": True, **kw})
    return dst


def special_f32() -> np.ndarray:
    bits = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001]
    bits += [0xFFFFFFFF, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000]
    return np.array(bits, np.uint32).view(np.float32)


def make_source(path: Path, rng: np.random.Generator, n: int = 3000) -> Path:
    """A checkpoint with every kind of tensor: floats to convert, others to copy."""
    f32 = np.concatenate([special_f32(), rng.standard_normal(n).astype(np.float32)])
    f16 = np.concatenate(
        [np.array([0x7C01, 0xFC00, 0x0001, 0x8000], np.uint16).view(np.float16)]
        + [rng.standard_normal(300).astype(np.float16)]
    )
    f64 = np.concatenate([[np.nan, -np.inf, 1 + 2**-8 + 2**-40], rng.standard_normal(12)])
    tensors = {
        "w.f32": ("F32", [len(f32)], f32),
        "x.f16": ("F16", [len(f16)], f16),
        "y.f64": ("F64", [3, 5], f64),
        "z.bf16": ("BF16", [4], np.array([1, 2, 0x7FC1, 0xFFFF], np.uint16)),
        "ids": ("I64", [7], np.arange(7, dtype=np.int64) * 1_000_003),
        "mask": ("BOOL", [5], np.array([1, 0, 1, 1, 0], np.uint8)),
        "q": ("F8_E4M3", [6], np.arange(6, dtype=np.uint8)),
        "packed": ("F4", [8], np.array([0x12, 0x34, 0x56, 0x78], np.uint8)),
        "empty": ("F32", [0, 4], b""),
        "scalar": ("F32", [], np.float32(3.25)),
    }
    return write_safetensors(path, tensors, metadata={"format": "pt", "z": "1", "a": "2"})


def layout(path: Path) -> tuple[dict[str, str] | None, dict[str, tuple[str, list[int], bytes]]]:
    """Metadata and tensors of a file, both in file order."""
    _, items, data = read_safetensors(path)
    metadata = None
    tensors = {}
    for key, info in items:
        if key == "__metadata__":
            metadata = dict(info)
            continue
        info = dict(info)
        a, b = info["data_offsets"]
        tensors[key] = (info["dtype"], info["shape"], data[a:b])
    return metadata, tensors


def flip_bit(path: Path, tensor: str, byte: int, bit: int = 0) -> None:
    """Flip one bit of a tensor's data, in place."""
    n, items, _ = read_safetensors(path)
    start = dict(dict(items)[tensor])["data_offsets"][0]
    raw = bytearray(path.read_bytes())
    raw[8 + n + start + byte] ^= 1 << bit
    path.write_bytes(bytes(raw))


def set_elem16(path: Path, tensor: str, index: int, value: int) -> None:
    n, items, _ = read_safetensors(path)
    start = dict(dict(items)[tensor])["data_offsets"][0]
    raw = bytearray(path.read_bytes())
    at = 8 + n + start + 2 * index
    raw[at : at + 2] = value.to_bytes(2, "little")
    path.write_bytes(bytes(raw))


def shortest(v: np.float32) -> str:
    """A float32 as Rust's `{:e}` prints it: shortest digits, e.g. -2.1042306e0, 1e-40."""
    mantissa, exponent = np.format_float_scientific(v, unique=True, trim="-").split("e")
    return f"{mantissa}e{int(exponent)}"


def bf16_bits(path: Path, tensor: str) -> np.ndarray:
    return np.frombuffer(layout(path)[1][tensor][2], np.uint16)


@pytest.fixture
def converted_pair(tmp_path, rng):
    """A source and its bf16 conversion."""
    src = make_source(tmp_path / "src.safetensors", rng)
    return src, convert(src, tmp_path / "dst.safetensors")


def mismatch_of(src: Path, dst: Path, **kw) -> stcast.Mismatch:
    report = stcast.verify(src, dst, **kw)
    assert not report.ok and report.mismatch is not None
    return report.mismatch


# --- accepts ------------------------------------------------------------------------------


@pytest.mark.parametrize("to", ["bf16", "fp16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_accepts_what_convert_wrote(tmp_path, rng, to, threads):
    src = make_source(tmp_path / "src.safetensors", rng)
    dst = convert(src, tmp_path / "dst.safetensors", to=to)
    report = stcast.verify(src, dst, threads=threads)
    assert report.ok and report and report.mismatch is None, report
    converted = 5 if to == "bf16" else 4  # F16 is kept as it is under fp16
    assert (report.tensors_converted, report.tensors_identical) == (converted, 10 - converted)
    assert report.bytes_compared == (src.stat().st_size - 8 - read_safetensors(src)[0]) + (
        dst.stat().st_size - 8 - read_safetensors(dst)[0]
    )
    assert report.threads == threads and report.isa in ("scalar", "avx2", "avx512")
    assert stcast.verify(src, dst, loose=True).ok


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_accepts_multi_window_tensors(tmp_path, rng, isa):
    """Tensors of several windows, converted by each kernel family, verified in other windows."""
    n = 1_500_000 + 13  # 6 MB of F32: six 1 MiB windows and a tail
    src = write_safetensors(
        tmp_path / "big.safetensors",
        {
            "a": ("F32", [n], rng.standard_normal(n).astype(np.float32) * 1e3),
            "b": ("F64", [200_001], rng.standard_normal(200_001)),
        },
    )
    try:
        dst = convert(src, tmp_path / "big-bf16.safetensors", tuning={"window_mib": 1, "isa": isa})
    except ValueError as e:
        if "not available" not in str(e):
            raise
        pytest.skip(f"{isa} is not available on this CPU")
    for threads, window in [(1, 1), (2, 1), (2, 2), (None, None)]:
        r = _core.verify(str(src), str(dst), threads=threads, tuning={"window_mib": window})
        assert r["ok"], r
    # A change in the last window of `a`, and in its first, is found at the right place.
    for index in [n - 1, 262_144 * 5 + 7, 0]:
        flip_bit(dst, "a", 2 * index, 3)
        for threads in [1, 2]:
            r = _core.verify(str(src), str(dst), threads=threads, tuning={"window_mib": 1})
            assert r["mismatch"]["tensor"] == "a" and r["mismatch"]["index"] == index, r
    assert bf16_bits(dst, "a").size == n


def test_rewritten_output_is_byte_identical(converted_pair, tmp_path):
    """The helpers below rebuild files exactly, so each test changes one thing only."""
    _, dst = converted_pair
    metadata, tensors = layout(dst)
    copy = write_safetensors(tmp_path / "copy.safetensors", tensors, metadata=metadata)
    assert copy.read_bytes() == dst.read_bytes()


def test_progress_is_reported(converted_pair):
    src, dst = converted_pair
    calls = []
    report = _core.verify(str(src), str(dst), progress=lambda d, t: calls.append((d, t)))
    assert report["ok"]
    total = calls[-1][1]
    assert calls[0] == (0, total) and calls[-1] == (total, total) and total > 0


def test_progress_exception_propagates(converted_pair):
    src, dst = converted_pair

    def boom(done, total):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        _core.verify(str(src), str(dst), progress=boom)


# --- rejects data changes -----------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_flipped_bit_in_converted_tensor(converted_pair, threads):
    src, dst = converted_pair
    index = 1234
    want = int(bf16_bits(dst, "w.f32")[index])
    flip_bit(dst, "w.f32", 2 * index + 1, 6)  # a bit of the exponent
    m = mismatch_of(src, dst, threads=threads)
    raw = layout(src)[1]["w.f32"][2][4 * index : 4 * index + 4]
    src_bits = int.from_bytes(raw, "little")
    value = np.frombuffer(raw, np.float32)[0]
    assert (m.tensor, m.index) == ("w.f32", index)
    assert m.source_bits == f"0x{src_bits:08X}"
    assert m.source_value == float(value)
    assert m.expected_bits == f"0x{want:04X}"
    assert m.found_bits == f"0x{want ^ 0x4000:04X}"
    assert m.message == (
        f"tensor `w.f32` element {index}: source 0x{src_bits:08X} ({shortest(value)}) "
        f"should give 0x{want:04X}, found 0x{want ^ 0x4000:04X}"
    )
    assert not stcast.verify(src, dst, loose=True).ok


def test_flipped_bit_in_f64_and_f16_tensors(converted_pair):
    src, dst = converted_pair
    flip_bit(dst, "y.f64", 2 * 2)  # element 2: 1+2^-8+2^-40 -> 0x3F81
    m = mismatch_of(src, dst)
    assert (m.tensor, m.index, m.expected_bits, m.found_bits) == ("y.f64", 2, "0x3F81", "0x3F80")
    assert m.source_bits == f"0x{np.float64(1 + 2**-8 + 2**-40).view(np.uint64):016X}"
    assert m.source_value == 1 + 2**-8 + 2**-40
    flip_bit(dst, "y.f64", 2 * 2)
    assert stcast.verify(src, dst).ok
    flip_bit(dst, "x.f16", 2 * 7 + 1, 7)  # the sign of element 7
    m = mismatch_of(src, dst)
    assert (m.tensor, m.index) == ("x.f16", 7) and len(m.source_bits) == 6


def test_flipped_bit_in_copied_tensor(converted_pair):
    src, dst = converted_pair
    flip_bit(dst, "ids", 8 * 5 + 2, 1)  # element 5 of the I64 tensor
    m = mismatch_of(src, dst)
    src_bits = 5 * 1_000_003
    assert (m.tensor, m.index, m.source_value) == ("ids", 5, None)
    assert m.source_bits == m.expected_bits == f"0x{src_bits:016X}"
    assert m.found_bits == f"0x{src_bits ^ (1 << 17):016X}"
    assert m.message == (
        f"tensor `ids` element 5: source 0x{src_bits:016X} should give 0x{src_bits:016X}, "
        f"found 0x{src_bits ^ (1 << 17):016X}"
    )
    assert not stcast.verify(src, dst, loose=True).ok


def test_flipped_bit_in_sub_byte_tensor_names_the_byte(converted_pair):
    src, dst = converted_pair
    flip_bit(dst, "packed", 2)
    m = mismatch_of(src, dst)
    assert (m.tensor, m.index, m.expected_bits, m.found_bits) == ("packed", 2, "0x56", "0x57")
    assert m.message.startswith("tensor `packed` byte 2: ")


def test_copied_bf16_nan_encoding_is_loose_only(converted_pair):
    src, dst = converted_pair
    set_elem16(dst, "z.bf16", 2, 0x7FC0)  # source 0x7FC1: still a NaN
    assert mismatch_of(src, dst).index == 2
    assert stcast.verify(src, dst, loose=True).ok


def test_loose_accepts_other_nan_encodings_only(converted_pair):
    src, dst = converted_pair
    bits = bf16_bits(dst, "w.f32")
    nans = [i for i in range(bits.size) if bits[i] & 0x7F80 == 0x7F80 and bits[i] & 0x7F]
    assert len(nans) >= 4
    for i in nans:
        set_elem16(dst, "w.f32", i, 0xFFFF)  # torch's NaN on some paths
    m = mismatch_of(src, dst)
    assert (m.index, m.found_bits) == (nans[0], "0xFFFF")
    assert m.source_value != m.source_value  # NaN
    assert stcast.verify(src, dst, loose=True).ok
    set_elem16(dst, "w.f32", nans[-1], 0x7F80)  # NaN -> inf
    m = mismatch_of(src, dst, loose=True)
    assert (m.index, m.expected_bits, m.found_bits) == (nans[-1], "0xFFC0", "0x7F80")
    set_elem16(dst, "w.f32", nans[-1], 0x7FC0)
    set_elem16(dst, "w.f32", 20, 0x7FC0)  # a number -> NaN
    assert mismatch_of(src, dst, loose=True).index == 20


# --- rejects header changes ---------------------------------------------------------------


def test_changed_dtype_in_header(converted_pair, tmp_path):
    src, dst = converted_pair
    metadata, tensors = layout(dst)
    dtype, shape, data = tensors["w.f32"]
    tensors["w.f32"] = ("I16", shape, data)
    bad = write_safetensors(tmp_path / "bad.safetensors", tensors, metadata=metadata)
    m = mismatch_of(src, bad)
    assert m.message == "tensor `w.f32`: F32 in SRC cannot become I16 in DST"
    assert m.tensor == "w.f32" and m.index is None
    # BF16 relabelled F16 is a conversion the data then contradicts.
    tensors["w.f32"] = ("F16", shape, data)
    bad = write_safetensors(tmp_path / "bad2.safetensors", tensors, metadata=metadata)
    m = mismatch_of(src, bad)
    assert m.message == (
        "tensor `w.f32` is F16 in DST, but these options convert it to BF16 (to as convert had it?)"
    ), m.message
    # Loose too: the other converted tensors are BF16, and one output has one target.
    m = mismatch_of(src, bad, loose=True)
    assert (m.tensor, m.index) == ("w.f32", None)
    want = 'tensor `w.f32` is converted to F16 in DST, but to="bf16" converts to BF16'
    assert m.message.startswith(want), m.message


def test_changed_shape(converted_pair, tmp_path):
    src, dst = converted_pair
    metadata, tensors = layout(dst)
    tensors["y.f64"] = ("BF16", [5, 3], tensors["y.f64"][2])
    bad = write_safetensors(tmp_path / "bad.safetensors", tensors, metadata=metadata)
    assert mismatch_of(src, bad).message == "tensor `y.f64`: shape [3, 5] in SRC, [5, 3] in DST"


@pytest.mark.parametrize(
    ("metadata", "strict", "loose"),
    [
        ({"format": "pt", "z": "1", "a": "3"}, 'key "a" is "2" in SRC, "3" in DST', '"a"'),
        ({"format": "pt", "z": "1"}, 'key "a" is missing in DST', '"a"'),
        ({"format": "pt", "z": "1", "a": "2", "b": ""}, 'key "b" is in DST but not in SRC', '"b"'),
        (
            {"format": "pt", "a": "2", "z": "1"},
            'key order differs at position 1: expected "z", found "a" '
            "(loose=True accepts any key order)",
            None,
        ),
        (None, "SRC has a __metadata__ entry, DST has none", '"z"'),
    ],
)
def test_changed_metadata(converted_pair, tmp_path, metadata, strict, loose):
    src, dst = converted_pair
    _, tensors = layout(dst)
    bad = write_safetensors(tmp_path / "bad.safetensors", tensors, metadata=metadata)
    m = mismatch_of(src, bad)
    assert m.message == f"__metadata__ differs: {strict}" and m.tensor is None
    report = stcast.verify(src, bad, loose=True)
    if loose is None:
        assert report.ok
    else:
        assert loose in report.mismatch.message


def test_swapped_tensor_order(converted_pair, tmp_path):
    src, dst = converted_pair
    metadata, tensors = layout(dst)
    names = list(tensors)
    i, j = names.index("w.f32"), names.index("y.f64")  # both BF16 now, adjacent in the plan
    names[i], names[j] = names[j], names[i]
    swapped = {k: tensors[k] for k in names}
    bad = write_safetensors(tmp_path / "swapped.safetensors", swapped, metadata=metadata)
    m = mismatch_of(src, bad)
    assert m.message == (
        f"tensor order differs at position {i}: expected `w.f32`, found `y.f64` "
        "(loose=True accepts any order, as for files other tools wrote)"
    ), m.message
    assert stcast.verify(src, bad, loose=True).ok
    # Reordered and with a wrong value: loose still compares the data.
    flip_bit(bad, "w.f32", 2 * 20)
    assert mismatch_of(src, bad, loose=True).index == 20


def test_header_layout_is_strict(converted_pair, tmp_path):
    """Same tensors and offsets, but JSON keys reordered, or the header not padded to 8."""
    src, dst = converted_pair
    metadata, tensors = layout(dst)
    keys = list(tensors)
    order = [keys[1], "__metadata__", keys[0], *keys[2:]]
    moved = write_safetensors(
        tmp_path / "keys.safetensors", tensors, metadata=metadata, key_order=order
    )
    m = mismatch_of(src, moved)
    assert m.message.startswith("DST header is not the one stcast writes: its JSON differs at byte")
    assert stcast.verify(src, moved, loose=True).ok

    # The same header without its padding (or with one space more where it needs none).
    _, items, data = read_safetensors(dst)
    header = json.dumps({k: dict(v) for k, v in items}, separators=(",", ":"), ensure_ascii=False)
    if len(header) % 8 == 0:
        header += " "
    unpadded = write_raw(tmp_path / "unpadded.safetensors", header, data, pad=False)
    assert mismatch_of(src, unpadded).message.startswith(
        "DST header is not the one stcast writes: its JSON differs at byte"
    )
    assert stcast.verify(src, unpadded, loose=True).ok


def test_missing_and_extra_tensor(converted_pair, tmp_path):
    src, dst = converted_pair
    metadata, tensors = layout(dst)
    fewer = dict(tensors)
    del fewer["ids"]
    bad = write_safetensors(tmp_path / "fewer.safetensors", fewer, metadata=metadata)
    for loose in (False, True):
        m = mismatch_of(src, bad, loose=loose)
        assert (m.message, m.tensor) == ("tensor `ids` is in SRC but not in DST", "ids")
    more = dict(tensors, extra=("U8", [3], b"abc"))
    bad = write_safetensors(tmp_path / "more.safetensors", more, metadata=metadata)
    for loose in (False, True):
        m = mismatch_of(src, bad, loose=loose)
        assert (m.message, m.tensor) == ("tensor `extra` is in DST but not in SRC", "extra")


def test_unrelated_file_is_not_a_conversion(converted_pair, tmp_path, run_main):
    src, dst = converted_pair
    other = write_safetensors(
        tmp_path / "other.safetensors",
        {"layer.0": ("BF16", [2], b"abcd"), "layer.1": ("I8", [1], b"x")},
    )
    m = mismatch_of(src, other, loose=True)
    assert m.message == "DST is not a conversion of SRC: none of its 2 tensors is in SRC"
    rc, out, err = run_main("verify", src, other)
    assert rc == 1 and out == ""
    line = assert_one_error_line(err)
    assert (
        line == f"stcast: {other}: DST is not a conversion of SRC: none of its 2 tensors is in SRC"
    )
    # The reverse direction: BF16 is not a source of F32.
    assert mismatch_of(dst, src).message == (
        "tensor `w.f32`: BF16 in SRC cannot become F32 in DST "
        "(are SRC and DST swapped? verify takes the original first)"
    )


# --- the command line ---------------------------------------------------------------------


def test_cli_exit_codes_and_lines(converted_pair, run_main):
    src, dst = converted_pair
    rc, out, err = run_main("verify", src, dst)
    assert (rc, err) == (0, "")
    assert out.startswith(f"verified {dst}: exactly the conversion of {src}\n")
    rc, out, err = run_main("verify", src, dst, "-q", "--threads", "1")
    assert (rc, out, err) == (0, "", "")

    index = 100
    want = int(bf16_bits(dst, "w.f32")[index])
    flip_bit(dst, "w.f32", 2 * index)
    raw = layout(src)[1]["w.f32"][2][4 * index : 4 * index + 4]
    value = np.frombuffer(raw, np.float32)[0]
    rc, out, err = run_main("verify", src, dst)
    assert (rc, out) == (1, "")
    line = assert_one_error_line(err)
    assert line.startswith(
        f"stcast: {dst}: tensor `w.f32` element {index}: "
        f"source 0x{int.from_bytes(raw, 'little'):08X} ("
    )
    assert line.endswith(f") should give 0x{want:04X}, found 0x{want ^ 1:04X}")
    assert f"({shortest(value)}) should give" in line


def test_cli_json(converted_pair, run_main):
    src, dst = converted_pair
    rc, out, err = run_main("verify", src, dst, "--json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert list(doc) == ["schema", "command", "version", "result"]
    assert (doc["schema"], doc["command"], doc["version"]) == (1, "verify", stcast.__version__)
    result = doc["result"]
    assert result["ok"] is True and result["mismatch"] is None
    assert list(result) == [
        "src",
        "dst",
        "ok",
        "loose",
        "tensors_converted",
        "tensors_identical",
        "bytes_compared",
        "seconds",
        "threads",
        "isa",
        "mismatch",
        "to",
        "numerics",
        "folder",
        "files",
        "copy",
    ]
    assert (result["folder"], result["files"], result["copy"]) == (False, 1, False)
    assert result["to"] == "bf16" and set(result["numerics"]) == {"tensors", "total"}

    # A NaN source value is written as a string, so the output stays strict JSON.
    set_elem16(dst, "w.f32", 4, 0xFFFF)  # source 0x7FC00000
    rc, out, err = run_main("verify", src, dst, "--json")
    assert (rc, err) == (1, "")
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert doc["result"]["ok"] is False
    assert doc["result"]["mismatch"] == {
        "message": "tensor `w.f32` element 4: source 0x7FC00000 (NaN) should give 0x7FC0, "
        "found 0xFFFF",
        "tensor": "w.f32",
        "index": 4,
        "source_bits": "0x7FC00000",
        "source_value": "nan",
        "expected_bits": "0x7FC0",
        "found_bits": "0xFFFF",
        "file": None,
    }
    rc, out, err = run_main("verify", src, dst, "--json", "--loose")
    assert rc == 0 and json.loads(out)["result"]["loose"] is True


def test_cli_bad_input(converted_pair, tmp_path, run_main):
    src, _ = converted_pair
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    rc, out, err = run_main("verify", src, junk)
    assert (rc, out) == (1, "")
    assert assert_one_error_line(err).startswith(f"stcast: {junk}: invalid safetensors file")
    rc, out, err = run_main("verify", src, junk, "--json")
    assert rc == 1
    assert_json_error_stderr(err)
    error = json.loads(out)["error"]
    assert (error["kind"], error["path"]) == ("invalid_input", str(junk))
    rc, out, err = run_main("verify", src, tmp_path / "missing.safetensors", "--json")
    assert rc == 1 and json.loads(out)["error"]["kind"] == "io"
    rc, out, err = run_main("verify", src)
    assert rc == 2 and assert_one_error_line(err).endswith("(see `stcast verify --help`)")


def test_api_to_dict(converted_pair):
    src, dst = converted_pair
    report = stcast.verify(str(src), dst)
    d = report.to_dict()
    assert d["ok"] is True and d["mismatch"] is None and d["src"] == str(src)
    flip_bit(dst, "w.f32", 0, 7)
    report = stcast.verify(src, dst)
    assert not report and report.to_dict()["mismatch"]["index"] == 0
    json.dumps(report.to_dict(), allow_nan=False)


# --- other tools --------------------------------------------------------------------------


def torch_convert(src: Path, dst: Path) -> None:
    """The torch path: the peer script when this checkout has it, else the same steps inline."""
    if TORCH_PATH.exists():
        # In this process: torch is imported already, and a second import costs seconds.
        runpy.run_path(str(TORCH_PATH), run_name="torch_path")["main"](str(src), str(dst))
        return
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    floats = (torch.float32, torch.float16, torch.float64, torch.bfloat16)
    out = {}
    with safe_open(str(src), framework="pt", device="cpu") as f:
        meta = f.metadata()
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = t.to(torch.bfloat16) if t.dtype in floats else t
    save_file(out, str(dst), metadata=meta)


def test_loose_accepts_the_torch_path(tmp_path, rng):
    pytest.importorskip("torch")
    f32 = np.concatenate([special_f32(), rng.standard_normal(100_000).astype(np.float32)])
    f16 = rng.standard_normal(5000).astype(np.float16)
    f16[:3] = [np.nan, -np.inf, 6e-8]
    src = write_safetensors(
        tmp_path / "src.safetensors",
        {
            "model.w": ("F32", [len(f32)], f32),
            "model.h": ("F16", [len(f16)], f16),
            "model.b": ("BF16", [3], np.array([1, 0x7FC0, 3], np.uint16)),
            "model.ids": ("I64", [4], np.arange(4, dtype=np.int64)),
        },
        metadata={"format": "pt"},
    )
    theirs = tmp_path / "torch.safetensors"
    torch_convert(src, theirs)
    report = stcast.verify(src, theirs, loose=True)
    assert report.ok, report.mismatch
    assert report.tensors_converted == 2
    ours = convert(src, tmp_path / "ours.safetensors")
    assert stcast.verify(src, ours).ok

    # F64: stcast rounds once (1 + 2^-8 + 2^-40 -> 0x3F81). torch up to 2.15 at least rounds
    # twice, via F32 (-> 0x3F80), and verify names the value where that shows; a torch that
    # rounds once would be accepted. Which rounding this torch does is checked, not assumed.
    import torch

    w = 1 + 2**-8 + 2**-40
    torch_bits = int(torch.tensor([w], dtype=torch.float64).to(torch.bfloat16).view(torch.int16))
    print(
        f"torch {torch.__version__} rounds F64 -> BF16", "once" if torch_bits == 0x3F81 else "twice"
    )
    assert torch_bits in (0x3F80, 0x3F81)
    witness = write_safetensors(
        tmp_path / "f64.safetensors", {"x": ("F64", [2], np.array([0.5, w]))}
    )
    torch_convert(witness, tmp_path / "f64-torch.safetensors")
    if torch_bits == 0x3F81:
        assert stcast.verify(witness, tmp_path / "f64-torch.safetensors", loose=True).ok
    else:
        m = mismatch_of(witness, tmp_path / "f64-torch.safetensors", loose=True)
        assert (m.tensor, m.index, m.expected_bits, m.found_bits) == ("x", 1, "0x3F81", "0x3F80")


def test_loose_accepts_a_pickle_converted_without_the_format_metadata(tmp_path, rng):
    """`safetensors.torch.save_file` of a `.pt` writes no `__metadata__`; stcast adds
    `format: pt` to its own outputs of pickles, and what it adds itself must not count
    against another tool's file (issue 23, point 7). Strict verify still wants it."""
    import torchfile as tf
    from reference import bf16_bits_ml_dtypes

    x = rng.standard_normal(64).astype(np.float32)
    src = tmp_path / "model.pt"
    tf.write_zip(src, {"x": tf.tensor("0", "float32", (64,))}, {"0": x.tobytes()})
    theirs = write_safetensors(
        tmp_path / "theirs.safetensors", {"x": ("BF16", [64], bf16_bits_ml_dtypes(x))}
    )
    report = stcast.verify(src, theirs, loose=True)
    assert report.ok, report.mismatch
    strict = stcast.verify(src, theirs)
    assert not strict.ok and "__metadata__" in strict.mismatch.message
    # A key of the source's own is still compared, loose or not.
    other = write_safetensors(
        tmp_path / "other.safetensors",
        {"x": ("BF16", [64], bf16_bits_ml_dtypes(x))},
        metadata={"format": "np"},
    )
    assert not stcast.verify(src, other, loose=True).ok


def test_loose_ignores_stale_index(tmp_path, run_main):
    """`convert --to fp8 --max-shard-size 2KB`, then the shards' index left beside a plain
    conversion's model.safetensors (as `--force` once left it): `verify --loose` passed
    (extra files ignored), while the index routes a loader to the FP8 shards. Every index
    in DST is checked against the verified output: one that places a tensor of it in
    another file fails, in loose mode too."""
    from test_folder_safety import hf_folder

    src = hf_folder(tmp_path / "src")
    out = tmp_path / "out"
    assert run_main("convert", src, out, "--to", "fp8", "--max-shard-size", "2KB")[0] == 0
    index = (out / "model.safetensors.index.json").read_bytes()
    shards = {p.name: p.read_bytes() for p in out.glob("model-*.safetensors")}
    assert run_main("convert", src, tmp_path / "plain", "-q")[0] == 0
    for name, data in {"model.safetensors.index.json": index, **shards}.items():
        (tmp_path / "plain" / name).write_bytes(data)
    rc, _, err = run_main("verify", src, tmp_path / "plain", "--loose")
    assert rc == 1, err
    assert "model.safetensors.index.json" in err and "l0.weight" in err, err
    rc, _, err = run_main("verify", src, tmp_path / "plain")
    assert rc == 1, err
    # An extra index that names the output's tensors where they are passes loose mode.
    for name in shards:
        (tmp_path / "plain" / name).unlink()
    wm = {f"l{i}.weight": "model.safetensors" for i in range(4)}
    (tmp_path / "plain" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 8192}, "weight_map": wm})
    )
    rc, _, err = run_main("verify", src, tmp_path / "plain", "--loose")
    assert rc == 0, err
    # One that names a file DST lacks fails.
    wm["l0.weight"] = "gone.safetensors"
    (tmp_path / "plain" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 8192}, "weight_map": wm})
    )
    rc, _, err = run_main("verify", src, tmp_path / "plain", "--loose")
    assert rc == 1 and "gone.safetensors" in err, err


def test_folder_files_whose_names_are_not_utf8_are_verified(tmp_path):
    """A copy whose name is not UTF-8 (a surrogate-escaped str) is checked like
    any other: passed as convert wrote it, its change named. (Was, while verify's checks
    moved into the engine: UnicodeEncodeError on the way in.)"""
    src, dst = bytes(tmp_path / "src"), bytes(tmp_path / "dst")
    os.mkdir(src)
    for i, name in enumerate("ab"):
        tensors = {name: ("F32", [2], np.ones(2, np.float32))}
        write_safetensors(os.fsdecode(src + b"/m-0000%d-of-00002.safetensors" % (i + 1)), tensors)
    index = {"a": "m-00001-of-00002.safetensors", "b": "m-00002-of-00002.safetensors"}
    with open(src + b"/m.safetensors.index.json", "w") as f:
        json.dump({"weight_map": index}, f)
    with open(src + b"/tok\xff.json", "w") as f:
        f.write("{}")
    stcast.convert(os.fsdecode(src), os.fsdecode(dst))
    assert stcast.verify(os.fsdecode(src), os.fsdecode(dst)).ok
    with open(dst + b"/tok\xff.json", "w") as f:
        f.write("{ }")
    report = stcast.verify(os.fsdecode(src), os.fsdecode(dst))
    assert report.mismatch is not None and report.mismatch.file == "tok\udcff.json"
