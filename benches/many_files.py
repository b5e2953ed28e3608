#!/usr/bin/env python3
"""A folder run over many small companion files: its wall time against another build's.

One tiny weight file and N small files (a checkpoint folder with logs, samples or a
tokenizer split into many files). Each stcast given converts it in a child process, the
builds interleaved (A B B A ...), each run into a fresh folder; the table gives the median,
min and max wall time and the median user and system CPU of each, and the ratio of medians
to the first. Before batched claims, the manifest was saved once per copy: quadratic.

    python benches/many_files.py                          # this venv's stcast, 3,000 files
    python benches/many_files.py --files 10000 --repeats 5 \\
        --python /work/venv-old/bin/python --python /work/venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_source(root: Path, files: int) -> Path:
    src = root / "src"
    (src / "many").mkdir(parents=True)
    from safetensors.numpy import save_file

    save_file({"w": np.ones((64, 64), np.float32)}, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"torch_dtype": "float32"}\n')
    for k in range(files):
        (src / "many" / f"f{k:06d}.txt").write_text(f"{k}\n")
    return src


def one_run(python: str, src: Path, dst: Path) -> tuple[float, float, float]:
    """(wall, user, sys) seconds of one `python -m stcast convert src dst -q` child."""
    shutil.rmtree(dst, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([python, "-m", "stcast", "convert", str(src), str(dst), "-q"], check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--python", action="append", help="an interpreter with stcast")
    parser.add_argument("--dir", help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    pythons = args.python or [sys.executable]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        src = make_source(root, args.files)
        runs: dict[str, list[tuple[float, float, float]]] = {p: [] for p in pythons}
        for r in range(args.repeats):
            order = pythons if r % 2 == 0 else pythons[::-1]  # ABBA
            for p in order:
                runs[p].append(one_run(p, src, root / "dst"))
        base = statistics.median(w for w, _, _ in runs[pythons[0]])
        print(f"{args.files} small files, {args.repeats} runs each ({os.uname().nodename})")
        heads = ("median", "min", "max")
        print(f"{'python':40} {' '.join(f'{h:>8}' for h in heads)} {'user':>7} {'sys':>7} ratio")
        for p, rs in runs.items():
            walls = [w for w, _, _ in rs]
            med = statistics.median(walls)
            user = statistics.median(u for _, u, _ in rs)
            system = statistics.median(s for _, _, s in rs)
            print(
                f"{p[-40:]:40} {med:8.2f} {min(walls):8.2f} {max(walls):8.2f} "
                f"{user:7.2f} {system:7.2f} {med / base:6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
