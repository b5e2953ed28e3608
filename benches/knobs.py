#!/usr/bin/env python3
"""A/B the engine's tuning knobs, interleaved, on the 4 GiB input of compare.py.

Each configuration converts the same input in a child process (A B C ... A B C ...); the
table gives the median wall, the ratio to the default configuration in the same mode and the
maximum peak RSS. It backs the defaults in rust/convert.rs: window size, threads, per-thread
MADV_POPULATE, read advice (MADV_SEQUENTIAL / MADV_WILLNEED), write-behind depth, the fused
numeric measurement; and, with the bare loop, an output mmap against pwrite from a buffer.

    python benches/knobs.py                       # tmpfs and hot, 3 repeats (~6 minutes)
    python benches/knobs.py --modes tmpfs --repeats 5 --only default,window=4,window=16

The knobs reach the engine through the API (`stcast.convert(..., tuning={...})`): the
engine reads no environment variable for them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import (  # noqa: E402  (benches/ is not a package)
    build_limit_loop,
    cached_checkpoint,
    fmt_bytes,
    reset_peak_rss,
    warm,
)

CHILD = """
import json, sys
import stcast._core as core
threads, numerics, tuning = int(sys.argv[3]), sys.argv[4] == "1", json.loads(sys.argv[5])
core.convert(sys.argv[1], sys.argv[2], force=True, threads=threads or None,
             numerics=numerics, tuning=tuning)
"""


@dataclass
class Config:
    name: str
    window_mib: int = 8
    threads: int = 0
    numerics: bool = True
    tuning: dict[str, object] = field(default_factory=dict)  # stcast.convert(tuning=...)
    env: dict[str, str] = field(default_factory=dict)
    limit_loop: list[str] | None = None  # argv tail for the bare loop instead of stcast

    def argv(self, src: Path, dst: Path, loop: Path | None) -> list[str]:
        if self.limit_loop is not None:
            assert loop is not None
            return [str(loop), str(src), str(dst), *self.limit_loop]
        tuning = json.dumps({"window_mib": self.window_mib, **self.tuning})
        flags = [str(self.threads), "1" if self.numerics else "0", tuning]
        return [sys.executable, "-c", CHILD, str(src), str(dst), *flags]


CONFIGS = [
    Config("default"),
    Config("window=2", window_mib=2),
    Config("window=4", window_mib=4),
    Config("window=16", window_mib=16),
    Config("window=32", window_mib=32),
    Config("threads=1", threads=1),
    Config("threads=1,window=32", threads=1, window_mib=32),
    Config("no populate", tuning={"populate": False}),
    Config("advise=none", tuning={"advise": "normal"}),
    Config("advise=willneed", tuning={"advise": "willneed"}),
    Config("write-behind=2", tuning={"write_behind": 2}),
    Config("write-behind=4", tuning={"write_behind": 4}),
    Config("window=4,write-behind=2", window_mib=4, tuning={"write_behind": 2}),
    Config("no numerics", numerics=False),
    # The bare loop: its floor, and an output map against pwrite from a buffer. Its `pwrite`
    # mode neither populates nor drops pages (and `pwrite-drop` still maps the output: the
    # mode test is `mode != "pwrite"`), so the pair to compare is `plain` against `pwrite`.
    Config("limit_loop popdrop", limit_loop=["8", "popdrop", "2"]),
    # compare.py's bare loop (16 MiB windows, drop, no populate) and the same at stcast's
    # 8 MiB window: what the window size alone is worth to the loop.
    Config("limit_loop drop 16", limit_loop=["16", "drop", "2"]),
    Config("limit_loop drop 8", limit_loop=["8", "drop", "2"]),
    Config("limit_loop plain (mmap out)", limit_loop=["8", "plain", "2"]),
    Config("limit_loop pwrite", limit_loop=["8", "pwrite", "2"]),
]


@dataclass
class Result:
    walls: list[float] = field(default_factory=list)
    rss: int = 0
    failed: str = ""


def run_one(argv: list[str], env: dict[str, str]) -> tuple[float, int, int]:
    """Run argv; return (wall seconds, peak RSS bytes, exit code)."""
    reset_peak_rss()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss * 1024, proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=4.0, help="input GiB (default 4)")
    ap.add_argument("--modes", default="tmpfs,hot", help="tmpfs and/or hot")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", help="comma-separated config names (default: all)")
    ap.add_argument("--peers", type=Path, default=HERE.parent.parent / "shared" / "peers")
    ap.add_argument("--tmpfs-dir", type=Path, default=Path("/dev/shm/stcast-bench"))
    ap.add_argument("--disk-dir", type=Path, default=Path("/var/tmp/stcast-bench"))
    ap.add_argument("--out", type=Path, default=HERE / "out" / "knobs")
    args = ap.parse_args(argv)
    configs = CONFIGS
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        configs = [c for c in CONFIGS if c.name in wanted or c.name == "default"]
    args.out.mkdir(parents=True, exist_ok=True)
    loop = build_limit_loop(args.peers / "limit_loop.rs", args.out / "limit_loop")
    if loop is None:
        configs = [c for c in configs if c.limit_loop is None]

    results: dict[tuple[str, str], Result] = {}
    modes = [m.strip() for m in args.modes.split(",")]
    for mode in modes:
        directory = args.tmpfs_dir if mode == "tmpfs" else args.disk_dir
        directory.mkdir(parents=True, exist_ok=True)
        src = cached_checkpoint(directory, args.size, 0)
        dst = directory / f"knobs-{os.getpid()}.safetensors"
        for rep in range(args.repeats):
            for c in configs:
                dst.unlink(missing_ok=True)
                if mode == "hot":
                    warm(src)
                wall, rss, rc = run_one(c.argv(src, dst, loop), c.env)
                dst.unlink(missing_ok=True)
                r = results.setdefault((mode, c.name), Result())
                if rc == 0:
                    r.walls.append(wall)
                    r.rss = max(r.rss, rss)
                else:
                    r.failed = f"exit {rc}"
                print(
                    f"[{mode} #{rep + 1}] {c.name:<26} {wall:6.2f} s  {fmt_bytes(rss)}", flush=True
                )

    command = "python benches/knobs.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# stcast tuning knobs",
        "",
        f"- command: `{command}`; {args.size:g} GiB F32 input, {args.repeats} interleaved "
        f"repeats; wall = median, × default = wall / wall of `default` in the same mode, "
        "peak RSS = max ru_maxrss. stcast configs run `stcast._core.convert` in a child "
        "(no CLI); `limit_loop` rows are the bare loop at 8 MiB windows and 2 threads: `popdrop` "
        "(populate, write-behind, drop pages) and, without either, `plain` (output map) "
        "against `pwrite` (from a buffer).",
        f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        "",
        "| mode | config | wall s | × default | peak RSS |",
        "|---|---|--:|--:|--:|",
    ]
    for mode in modes:
        base = results.get((mode, "default"))
        base_wall = statistics.median(base.walls) if base and base.walls else None
        for c in configs:
            r = results[(mode, c.name)]
            if not r.walls:
                lines.append(f"| {mode} | {c.name} | {r.failed} | – | – |")
                continue
            wall = statistics.median(r.walls)
            ratio = f"{wall / base_wall:.2f}" if base_wall else "–"
            lines.append(f"| {mode} | {c.name} | {wall:.2f} | {ratio} | {fmt_bytes(r.rss)} |")
    text = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(text)
    print()
    print(text)
    print(f"wrote {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
