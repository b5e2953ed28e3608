"""Bounded memory: the CLI's peak RSS does not grow with the input size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import encode_header
from helpers import cli_env

MIB = 1 << 20
CHUNK = 8 * MIB


def write_big_f32(path: Path, size: int) -> Path:
    """An F32 file of `size` data bytes in two tensors, written 8 MiB at a time."""
    half = size // 2
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [half // 4], "data_offsets": [0, half]},
        "b": {"dtype": "F32", "shape": [(size - half) // 4], "data_offsets": [half, size]},
    }
    chunk = np.linspace(-3.0, 3.0, CHUNK // 4, dtype=np.float32).tobytes()
    with open(path, "wb") as f:
        f.write(encode_header(header))
        left = size
        while left:
            n = min(left, CHUNK)
            f.write(chunk[:n])
            left -= n
    return path


# A fork or exec keeps the parent's peak RSS as the child's starting maxrss (and
# subprocess may vfork), so a big pytest process would hide the figure. A small
# launcher starts the CLI instead and reports the CLI's own ru_maxrss, from wait4.
LAUNCHER = """
import json, os, subprocess, sys
with open(sys.argv[1], "wb") as out, open(sys.argv[2], "wb") as err:
    proc = subprocess.Popen(sys.argv[3:], stdout=out, stderr=err, stdin=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
proc.returncode = os.waitstatus_to_exitcode(status)
print(json.dumps({"rc": proc.returncode, "maxrss_kib": usage.ru_maxrss}))
"""


def peak_rss_of(cmd: list[str], out_path: Path, err_path: Path) -> tuple[int, int]:
    """Run `cmd` through LAUNCHER, its stdout and stderr into the two paths; return its exit
    code and its own peak RSS in bytes."""
    launcher = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(out_path), str(err_path), *cmd],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert launcher.returncode == 0, launcher.stderr
    child = json.loads(launcher.stdout)
    return child["rc"], child["maxrss_kib"] * 1024


def peak_rss_of_convert(src: Path, dst: Path, *options: str) -> int:
    """Run `python -m stcast convert SRC DST -q --json [OPTIONS]`; return its peak RSS in
    bytes."""
    out_path, err_path = dst.with_suffix(".out"), dst.with_suffix(".err")
    cmd = [sys.executable, "-m", "stcast", "convert", str(src), str(dst), "-q", "--json"]
    rc, peak = peak_rss_of([*cmd, *options], out_path, err_path)
    assert rc == 0, err_path.read_text()
    assert json.loads(out_path.read_text())["result"]["bytes_out"] == dst.stat().st_size
    return peak


def test_peak_rss_is_bounded(tmp_path):
    peaks = {}
    for size_mib in (128, 512):
        src = write_big_f32(tmp_path / f"in{size_mib}.safetensors", size_mib * MIB)
        dst = tmp_path / f"out{size_mib}.safetensors"
        peaks[size_mib] = peak_rss_of_convert(src, dst)
        assert dst.stat().st_size < src.stat().st_size // 2 + 4096
        src.unlink()
        dst.unlink()
    print({k: f"{v / MIB:.1f} MiB" for k, v in peaks.items()})
    for size_mib, peak in peaks.items():
        assert peak < 150 * MIB, f"{size_mib} MiB input: peak RSS {peak / MIB:.1f} MiB"
    assert peaks[512] <= 1.25 * peaks[128] + 16 * MIB, peaks


def write_big_bin(path: Path, size: int) -> Path:
    """A PyTorch checkpoint (zip) of `size` data bytes of F32 in two storages, written 8 MiB
    at a time, with a tensor tied to the first (as tied embeddings are), a view of the
    first half of each of its rows, a transposed view of the second and a view of every
    1024th element of the second (each gathered, window by window: the transposed one reads
    a page of every row of its storage for each row it writes, the strided one a page per
    element)."""
    import torchfile as tf

    chunk = np.linspace(-3.0, 3.0, CHUNK // 4, dtype=np.float32).tobytes()

    def storage(n: int) -> tuple[int, object]:
        def write(f) -> None:
            left = n
            while left:
                k = min(left, CHUNK)
                f.write(chunk[:k])
                left -= k

        return (n, write)

    half = size // 2
    obj = {
        "a": tf.tensor("0", "float32", (half // 4,)),
        "tied": tf.tensor("0", "float32", (half // 4,)),
        "half_rows": tf.tensor(
            "0",
            "float32",
            (1024, half // 4 // 2048),
            stride=(half // 4 // 1024, 1),
            numel=half // 4,
        ),
        "b": tf.tensor("1", "float32", ((size - half) // 4,)),
        "transposed": tf.tensor(
            "1",
            "float32",
            ((size - half) // 4 // 1024, 1024),
            stride=(1, (size - half) // 4 // 1024),
        ),
        # x[::1024]: one element per 4 KiB page of the whole storage, in one small window.
        "every_1024th": tf.tensor(
            "1", "float32", ((size - half) // 4 // 1024,), stride=(1024,), numel=(size - half) // 4
        ),
    }
    tf.write_zip(path, obj, {"0": storage(half), "1": storage(size - half)})
    return path


def test_peak_rss_is_bounded_for_a_pytorch_checkpoint(tmp_path):
    """The same bound for a .bin (its storages mapped in place, the pickle read once)."""
    peaks = {}
    for size_mib in (64, 320):
        src = write_big_bin(tmp_path / f"in{size_mib}.bin", size_mib * MIB)
        dst = tmp_path / f"out{size_mib}.safetensors"
        peaks[size_mib] = peak_rss_of_convert(src, dst)
        # a, tied, half_rows, b and transposed: 2.25 times the data, halved; every_1024th:
        # 1/2048 of it, halved.
        assert dst.stat().st_size < size_mib * MIB * 9 // 8 + size_mib * MIB // 4096 + 4096
        src.unlink()
        dst.unlink()
    print({k: f"{v / MIB:.1f} MiB" for k, v in peaks.items()})
    for size_mib, peak in peaks.items():
        assert peak < 150 * MIB, f"{size_mib} MiB input: peak RSS {peak / MIB:.1f} MiB"
    assert peaks[320] <= 1.25 * peaks[64] + 16 * MIB, peaks


def test_dcp_entries_outside_the_key_are_dropped_as_parsed(tmp_path):
    """Issue 30, finding 9: 18 small model tensors beside an optimizer of 1000 tensors cut
    over 64 ranks (64,000 chunks, a 12 MB `.metadata` pickled as `dcp.save` pickles it):
    `--key model` keeps none of the optimizer's entries (the whole tree was built, then
    filtered: 140 MB), so the peak stays within 64 MiB beside the `.metadata` it maps."""
    src = tmp_path / "dcp"
    gen = Path(__file__).resolve().parent.parent / "benches" / "gen_dcp_meta.py"
    subprocess.run(
        [sys.executable, str(gen), "moe", str(src), "--ranks", "64"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    meta = (src / ".metadata").stat().st_size
    assert meta > 8_000_000
    peak = peak_rss_of_convert(src, tmp_path / "out.safetensors", "--key", "model")
    assert peak <= 64 * MIB + meta, f"peak RSS {peak / MIB:.1f} MiB, .metadata {meta / MIB:.1f} MiB"


def sparse_fp8_group(path: Path, rows: int, cols: int, group: int) -> Path:
    """A sparse (zero-filled, no disk used) file: F8_E4M3 `w.weight` [rows, cols] and its F32
    group scale `w.weight_scale` [rows, cols / group]."""
    w = rows * cols
    s = rows * (cols // group) * 4
    header = {
        "w.weight": {"dtype": "F8_E4M3", "shape": [rows, cols], "data_offsets": [0, w]},
        "w.weight_scale": {
            "dtype": "F32",
            "shape": [rows, cols // group],
            "data_offsets": [w, w + s],
        },
    }
    with open(path, "wb") as f:
        f.write(encode_header(header))
        f.truncate(f.tell() + w + s)
    return path


def test_fp8_dequant_group_scale_memory_bounded(tmp_path):
    """Dequantizing F8 weights with F32 group-4 scales: 16 MiB and 64 MiB of scales. Was:
    the scale's pages stayed resident whole (peak RSS 49.7 and 95.7 MiB; channel scales
    33.7 and 34.8 MiB). Now the scale rows a window read are dropped after it, as the
    weight's are: peak RSS does not grow with the input."""
    peaks = {}
    for rows in (4096, 16384):
        src = sparse_fp8_group(tmp_path / f"in{rows}.safetensors", rows, 4096, 4)
        dst = tmp_path / f"out{rows}.safetensors"
        peaks[rows] = peak_rss_of_convert(src, dst)
        dst.unlink()
    print({k: f"{v / MIB:.1f} MiB" for k, v in peaks.items()})
    assert peaks[16384] <= 1.25 * peaks[4096] + 16 * MIB, peaks
