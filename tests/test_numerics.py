"""The numeric report: `ConvertReport.numerics`, `convert --report`, `verify --report`.

Crafted tensors with known counts of each kind are checked exactly, and random data against a
plain numpy reference computed from the output bits (errors by f64 subtraction, which is exact
here: the output is within a factor of two of the input, or zero).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, tensor_bytes, write_safetensors
from stcast import _core

FIELDS = [
    "elements",
    "overflow",
    "underflow_to_zero",
    "subnormal",
    "nan_in",
    "inf_in",
    "max_abs_error",
    "max_rel_error",
]
ZERO = dict.fromkeys(FIELDS, 0) | {"max_abs_error": 0.0, "max_rel_error": 0.0}


def stats(**counts: float) -> dict:
    return ZERO | counts


def by_name(numerics: dict) -> dict[str, dict]:
    out = {}
    for t in numerics["tensors"]:
        t = dict(t)
        out[t.pop("name")] = t
    return out


def f32(*values: float) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.array(values, dtype=np.float64).astype(np.float32)


def crafted(path: Path) -> Path:
    """Tensors whose numbers are known by construction (for bf16)."""
    return write_safetensors(
        path,
        {
            # 3.4e38 is finite in f32 but above bf16's largest (0x7F7F, 3.39e38).
            "over": ("F32", [4], f32(3.4e38, -3.4e38, 1.0, 2.0)),
            # 1e-45 and -1e-44 round to ±0; 1e-40 to a bf16 subnormal.
            "under": ("F32", [3], f32(1e-45, -1e-44, 1e-40)),
            "specials": ("F32", [6], f32(np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0)),
            "nan_only": ("F32", [100], np.full(100, np.nan, np.float32)),
            "empty": ("F32", [0], b""),
            "ids": ("I64", [2], np.arange(2, dtype=np.int64)),
            # 1 + 2^-10 -> 1 (error 2^-10, the largest relative one); 65504 -> 65536 (error 32).
            "half": ("F16", [3], np.array([1 + 2**-10, 65504, -2], np.float16)),
            # Rounded once: 1 + 2^-8 + 2^-40 -> 1 + 2^-7, error 2^-8 - 2^-40.
            "double": ("F64", [1], np.array([1 + 2**-8 + 2**-40])),
        },
    )


CRAFTED_BF16 = {
    "over": stats(elements=4, overflow=2),
    "under": stats(
        elements=3,
        underflow_to_zero=2,
        subnormal=1,
        # 1e-40 (as f32) -> 2^-133; the underflows lose all of |x|, less than that.
        max_abs_error=float(np.float32(1e-40)) - 2.0**-133,
    ),
    "specials": stats(elements=6, nan_in=2, inf_in=2),
    "nan_only": stats(elements=100, nan_in=100),
    "empty": stats(),
    "half": stats(
        elements=3,
        max_abs_error=32.0,
        max_rel_error=float(np.float32(2**-10) / np.float32(1 + 2**-10)),
    ),
    "double": stats(
        elements=1,
        max_abs_error=2**-8 - 2**-40,
        max_rel_error=(2**-8 - 2**-40) / (1 + 2**-8 + 2**-40),
    ),
}


def total_of(tensors: dict[str, dict]) -> dict:
    total = dict(ZERO)
    for t in tensors.values():
        for k in FIELDS:
            total[k] = max(total[k], t[k]) if k.startswith("max_") else total[k] + t[k]
    return total


def test_crafted_counts_through_the_api(tmp_path):
    src = crafted(tmp_path / "src.safetensors")
    report = stcast.convert(src, tmp_path / "dst.safetensors")
    assert report.numerics is not None
    got = by_name(report.numerics)
    # Converted tensors only, in output order (the F64 one is narrower in the output: BF16).
    assert list(got) == ["over", "under", "specials", "nan_only", "empty", "half", "double"]
    for name, want in CRAFTED_BF16.items():
        assert got[name] == want, name
    assert report.numerics["total"] == total_of(CRAFTED_BF16)


def test_fp16_overflow_and_underflow(tmp_path):
    values = f32(65504, 65519, 65520, -1e5, 2**-25, 3e-8, 1e-5, 1e-30, np.nan, 1.0)
    src = write_safetensors(tmp_path / "src.safetensors", {"w": ("F32", [10], values)})
    report = stcast.convert(src, tmp_path / "dst.safetensors", to="fp16")
    (w,) = report.numerics["tensors"]
    # 65520 and -1e5 overflow; 2^-25 (a tie) and 1e-30 underflow; 3e-8, 1e-5 are subnormal.
    assert (w["overflow"], w["underflow_to_zero"], w["subnormal"], w["nan_in"]) == (2, 2, 2, 1)
    assert w["max_abs_error"] == 15.0  # 65519 -> 65504
    # Relative errors count only |x| >= 2^-14: 65519 -> 65504 is the largest.
    assert w["max_rel_error"] == float(np.float32(15) / np.float32(65519))


def test_numerics_can_be_turned_off(tmp_path):
    src = crafted(tmp_path / "src.safetensors")
    result = _core.convert(str(src), str(tmp_path / "dst.safetensors"), numerics=False)
    assert result["numerics"] is None
    result = _core.verify(str(src), str(tmp_path / "dst.safetensors"), numerics=False)
    assert result["ok"] and result["numerics"] is None


def reference(src_values: np.ndarray, out_bits: np.ndarray, to: str) -> dict:
    """The numbers of one tensor, from the source values and the output bits."""
    with np.errstate(invalid="ignore"):  # signalling NaNs among the random bits
        x = src_values.astype(np.float64)
    if to == "bf16":
        y = (out_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        tiny = 2.0**-126
    else:
        y = out_bits.view(np.float16).astype(np.float64)
        tiny = 2.0**-14
    finite = np.isfinite(x) & np.isfinite(y)
    err = np.abs(y[finite] - x[finite])
    ax = np.abs(x[finite])
    big = ax >= tiny
    if src_values.dtype == np.float64:
        rel = err[big] / ax[big]
    else:  # computed in f32 (exact operands, one rounding), as the engine does
        rel = (err[big].astype(np.float32) / ax[big].astype(np.float32)).astype(np.float64)
    return {
        "elements": int(x.size),
        "overflow": int(np.sum(np.isfinite(x) & np.isinf(y))),
        "underflow_to_zero": int(np.sum((x != 0) & (y == 0))),
        "subnormal": int(np.sum((y != 0) & (np.abs(y) < tiny))),
        "nan_in": int(np.sum(np.isnan(x))),
        "inf_in": int(np.sum(np.isinf(x))),
        "max_abs_error": float(err.max(initial=0.0)),
        "max_rel_error": float(rel.max(initial=0.0)),
    }


@pytest.mark.parametrize("to", ["bf16", "fp16"])
def test_random_data_matches_a_numpy_reference(tmp_path, rng, to):
    n = 200_000
    normal = (rng.standard_normal(n) * 0.02).astype(np.float32)
    bits = rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32)
    # Magnitudes from 2^-160 to 2^140, random signs: every rounding regime of both targets.
    wide = np.ldexp(rng.random(n) + 0.5, rng.integers(-160, 140, n)) * rng.choice([-1, 1], n)
    with np.errstate(over="ignore"):
        tensors = {
            "normal": normal,
            "bits": bits,
            "wide32": wide.astype(np.float32),
            "wide64": wide,
            "half": rng.integers(0, 2**16, n, dtype=np.uint16).view(np.float16),
        }
    dtypes = {np.float32: "F32", np.float64: "F64", np.float16: "F16"}
    src = write_safetensors(
        tmp_path / "src.safetensors",
        {k: (dtypes[v.dtype.type], [n], v) for k, v in tensors.items()},
    )
    dst = tmp_path / "dst.safetensors"
    report = stcast.convert(src, dst, to=to)
    got = by_name(report.numerics)
    out = tensor_bytes(dst)
    for name, values in tensors.items():
        if to == "fp16" and values.dtype == np.float16:
            assert name not in got  # copied, not converted
            continue
        want = reference(values, np.frombuffer(out[name][2], np.uint16), to)
        assert got[name] == want, name
    assert report.numerics["total"] == total_of(got)


def test_convert_report_file_and_warning(tmp_path, run_main):
    src = crafted(tmp_path / "src.safetensors")
    dst, path = tmp_path / "dst.safetensors", tmp_path / "report.json"
    rc, out, err = run_main("convert", src, dst, "--report", path, "--json")
    assert rc == 0, err
    # Overflow first (the --on-overflow guard), then underflow; both from the engine.
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith("stcast: warning: ") for line in lines)
    assert "`over` (2)" in lines[0] and "±inf" in lines[0]
    want = "stcast: warning: 2 values underflowed to zero in 1 tensor (worst: `under` 2)"
    assert lines[1] == want
    doc = json.loads(path.read_text())
    assert list(doc) == ["schema", "command", "version", "result"]
    assert (doc["schema"], doc["command"], doc["version"]) == (1, "report", stcast.__version__)
    result = doc["result"]
    assert list(result) == ["src", "dst", "to", "tensors", "total"]
    assert (result["src"], result["dst"], result["to"]) == (str(src), str(dst), "bf16")
    assert by_name(result) == CRAFTED_BF16
    assert result["total"] == total_of(CRAFTED_BF16)
    # --json carries the same numbers.
    numerics = json.loads(out)["result"]["numerics"]
    assert numerics == {"tensors": result["tensors"], "total": result["total"]}


def test_worst_tensors_are_named_first(tmp_path, run_main):
    tensors = {f"t{i}": ("F32", [4], f32(*([1e-45] * i + [1.0] * (4 - i)))) for i in [1, 4, 2, 3]}
    src = write_safetensors(tmp_path / "src.safetensors", tensors)
    rc, _, err = run_main("convert", src, tmp_path / "dst.safetensors")
    assert rc == 0
    assert assert_one_error_line(err) == (
        "stcast: warning: 10 values underflowed to zero in 4 tensors "
        "(worst: `t4` 4, `t3` 3, `t2` 2)"
    )


def test_no_warning_when_nothing_is_lost(tmp_path, run_main, rng):
    values = (rng.standard_normal(1000) * 0.02).astype(np.float32)
    src = write_safetensors(tmp_path / "src.safetensors", {"w": ("F32", [1000], values)})
    rc, _, err = run_main("convert", src, tmp_path / "dst.safetensors")
    assert (rc, err) == (0, "")


def test_verify_report_equals_convert_report(tmp_path, run_main):
    src = crafted(tmp_path / "src.safetensors")
    dst = tmp_path / "dst.safetensors"
    for to in ["bf16", "fp16"]:
        made, checked = tmp_path / f"convert-{to}.json", tmp_path / f"verify-{to}.json"
        rc, _, err = run_main("convert", src, dst, "--to", to, "--force", "--report", made)
        assert rc == 0, err
        rc, _, err = run_main("verify", src, dst, "--report", checked, "-q")
        assert (rc, err) == (0, "")
        assert json.loads(checked.read_text()) == json.loads(made.read_text())
        assert json.loads(made.read_text())["result"]["to"] == to
    report = stcast.verify(src, dst)
    assert (
        report.to == "fp16"
        and report.numerics
        == stcast.convert(src, tmp_path / "again.safetensors", to="fp16").numerics
    )


def test_verify_report_not_written_on_mismatch(tmp_path, run_main):
    src = crafted(tmp_path / "src.safetensors")
    dst = tmp_path / "dst.safetensors"
    stcast.convert(src, dst)
    data = bytearray(dst.read_bytes())
    data[-1] ^= 1  # the last byte of `double`
    dst.write_bytes(bytes(data))
    path = tmp_path / "report.json"
    rc, _, err = run_main("verify", src, dst, "--report", path)
    assert rc == 1 and "tensor `double`" in assert_one_error_line(err)
    assert not path.exists()
    assert stcast.verify(src, dst).numerics is None


def test_folder_report_names_each_tensors_file(tmp_path, run_main):
    (tmp_path / "model").mkdir()
    crafted(tmp_path / "model" / "model.safetensors")
    crafted(tmp_path / "model" / "second.safetensors")
    path = tmp_path / "r.json"
    rc, out, err = run_main("convert", tmp_path / "model", "--report", path)
    assert rc == 0, err
    result = json.loads(path.read_text())["result"]
    assert result["src"] == str(tmp_path / "model") and result["to"] == "bf16"
    files = {t["file"] for t in result["tensors"]}
    assert files == {"model.safetensors", "second.safetensors"}
    one = [{k: v for k, v in t.items() if k != "file"} for t in result["tensors"]]
    assert len(one) == 2 * len(CRAFTED_BF16)
    # The totals add up over both files.
    assert result["total"]["overflow"] == 2 * total_of(CRAFTED_BF16)["overflow"]
    # verify writes the same report for the folder.
    checked = tmp_path / "v.json"
    model = tmp_path / "model"
    rc, _, err = run_main("verify", model, tmp_path / "model-bf16", "--report", checked)
    assert rc == 0, err
    assert json.loads(checked.read_text())["result"]["tensors"] == result["tensors"]
