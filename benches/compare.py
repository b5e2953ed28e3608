"""End-to-end benchmark: stcast against the torch path, a numpy converter and a bare mmap loop.

Every contender runs in its own child process, interleaved (A B C A B C ...), on generated
transformer-shaped F32 checkpoints. Per run: wall time, CPU time and peak RSS (wait4 rusage),
plus RSS (and the cgroup's usage, when there is one) sampled every 50 ms. Results go to
--out as results.md, results.json, throughput.png and rss.png.

Modes: tmpfs (files in RAM: the speed comparison), hot (on disk, page cache warmed), cold (on
disk, caches dropped before each run), cgroup (on disk, caches dropped, each child in a cgroup
v1 memory group limited to --mem-limit, page cache included).

usage: python benches/compare.py [--sizes 1,4] [--repeats 3] [--modes tmpfs,hot,cold,cgroup]
           [--mem-limit 256M] [--cap CONTENDER=SIZE] [--timeout S] [--out benches/out] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("tmpfs", "hot", "cold", "cgroup")
CONTENDERS = ("stcast", "torch_path", "np_convert", "limit_loop")
PEERS = ("torch_path", "np_convert")
ALIASES = {"torch": "torch_path", "numpy": "np_convert", "np": "np_convert", "limit": "limit_loop"}
SAMPLE_S = 0.05
TMPFS_MAX_GIB = 4.0  # input + output + the torch path's copy must all fit in RAM
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
CGROUP_PREFIX = "stcast-bench-"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
CLEAR_REFS = Path("/proc/self/clear_refs")
MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Contender:
    """A converter run as `head... SRC DST tail...`."""

    name: str
    head: list[str]
    tail: list[str] = field(default_factory=list)

    def command(self, src: Path, dst: Path) -> list[str]:
        return [*self.head, str(src), str(dst), *self.tail]


@dataclass
class Run:
    """One timed child process."""

    mode: str
    size_gib: float
    contender: str
    repeat: int
    input_bytes: int
    status: str = "ok"
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss: int = 0
    peak_anon: int = 0
    mem_limit: int | None = None
    cgroup_peak: int | None = None
    cgroup_failcnt: int | None = None
    samples: list[tuple[float, int, int, int | None]] = field(default_factory=list)
    report: dict | None = None
    stderr_tail: str = ""
    verified: bool | None = None  # stcast only: `stcast verify SRC DST` of this run's output


# ---------------------------------------------------------------- memory cgroups (v1)


def own_memory_cgroup() -> Path:
    """Return our own memory cgroup directory: new groups nest inside it, under its limits."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / path.lstrip("/")
    raise OSError("no cgroup v1 memory controller in /proc/self/cgroup")


class MemoryCgroup:
    """A cgroup v1 memory group with a limit, for one child process; remove() when done."""

    _count = 0

    def __init__(self, limit: int):
        MemoryCgroup._count += 1
        self.path = own_memory_cgroup() / f"{CGROUP_PREFIX}{os.getpid()}-{MemoryCgroup._count}"
        self.path.mkdir()
        self._write("memory.limit_in_bytes", limit)

    def _write(self, name: str, value: int) -> None:
        (self.path / name).write_text(f"{value}\n")

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def wrap(self, argv: list[str]) -> list[str]:
        """Return argv prefixed by a shell that joins this group, then execs argv (same pid)."""
        procs = shlex.quote(str(self.path / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def usage(self) -> int | None:
        try:
            return int(self._read("memory.usage_in_bytes"))
        except (OSError, ValueError):
            return None

    def stats(self) -> dict[str, int]:
        oom = dict(line.split() for line in self._read("memory.oom_control").splitlines())
        return {
            "max_usage": int(self._read("memory.max_usage_in_bytes")),
            "failcnt": int(self._read("memory.failcnt")),
            "oom_kill": int(oom.get("oom_kill", 0)),
            "under_oom": int(oom.get("under_oom", 0)),
        }

    def remove(self) -> None:
        # The last task can take a moment to leave after it is reaped.
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove cgroup {self.path}", file=sys.stderr)


def remove_stale_cgroups() -> None:
    """Remove empty groups left by a bench that was killed outright."""
    try:
        base = own_memory_cgroup()
    except OSError:
        return
    for path in base.glob(CGROUP_PREFIX + "*"):
        try:
            if not (path / "cgroup.procs").read_text().strip():
                path.rmdir()
        except OSError:
            pass


# ---------------------------------------------------------------- one run


class Sampler(threading.Thread):
    """Samples the child's RSS (and its cgroup's usage) every SAMPLE_S seconds."""

    def __init__(self, pid: int, cgroup: MemoryCgroup | None):
        super().__init__(daemon=True)
        self.pid, self.cgroup = pid, cgroup
        self.samples: list[tuple[float, int, int, int | None]] = []  # t, rss, anon, cgroup
        self.done = threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        while True:
            rss = read_rss(self.pid)
            if rss is not None:
                cg = self.cgroup.usage() if self.cgroup else None
                self.samples.append((round(time.perf_counter() - t0, 3), *rss, cg))
            if self.done.wait(SAMPLE_S):
                return


def read_rss(pid: int) -> tuple[int, int] | None:
    """Return (VmRSS, RssAnon) in bytes, or None once the process has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie has no memory lines
        return None
    return kib(fields["VmRSS"]), kib(fields.get("RssAnon", "0 kB"))


def kib(value: str) -> int:
    return int(value.split()[0]) * 1024


def run_once(
    contender: Contender, src: Path, dst: Path, run: Run, limit: int | None, timeout: float
) -> None:
    """Run one contender to completion (or OOM, or timeout) and fill in run."""
    cgroup = MemoryCgroup(limit) if limit else None
    argv = cgroup.wrap(contender.command(src, dst)) if cgroup else contender.command(src, dst)
    reset_peak_rss()
    timed_out = threading.Event()
    cg_stats: dict[str, int] = {}
    out_log, err_log = dst.parent / "stdout.log", dst.parent / "stderr.log"
    try:
        with open(out_log, "wb") as out, open(err_log, "wb") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
        sampler = Sampler(proc.pid, cgroup)
        sampler.start()

        def give_up() -> None:
            timed_out.set()
            kill_group(proc.pid)

        timer = threading.Timer(timeout, give_up)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            run.wall_s = time.perf_counter() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            timer.cancel()
            sampler.done.set()
            sampler.join()
            if proc.returncode is None:  # interrupted: take the child down with us
                kill_group(proc.pid)
                proc.wait()
        if cgroup:
            cg_stats = cgroup.stats()
    finally:
        if cgroup:
            cgroup.remove()

    run.cpu_s = usage.ru_utime + usage.ru_stime
    run.peak_rss = usage.ru_maxrss * 1024
    run.samples = sampler.samples
    run.peak_anon = max((s[2] for s in run.samples), default=0)
    run.mem_limit = limit
    run.cgroup_peak = cg_stats.get("max_usage")
    run.cgroup_failcnt = cg_stats.get("failcnt")
    code = proc.returncode
    oom_in_group = cg_stats.get("oom_kill", 0) or cg_stats.get("under_oom", 0)
    if timed_out.is_set():
        run.status = "timeout"
    elif code == -signal.SIGKILL and (cgroup is None or oom_in_group):
        run.status = "OOM"  # without a cgroup, only the kernel's OOM killer sends SIGKILL here
    elif code < 0:
        run.status = f"killed ({signal.Signals(-code).name})"
    elif code != 0:
        run.status = f"failed (exit {code})"
    elif not dst.exists():
        run.status = "no output"
    if run.status != "ok":
        run.stderr_tail = err_log.read_text(errors="replace")[-2000:]
    if contender.name == "stcast":
        try:
            run.report = json.loads(out_log.read_text(errors="replace"))["result"]
        except (ValueError, KeyError, TypeError):
            pass


def verify_output(contender: Contender, src: Path, dst: Path) -> bool:
    """Check, untimed and unlimited, that stcast's output is exactly the conversion of src."""
    cli = contender.head[0]
    done = subprocess.run([cli, "verify", str(src), str(dst), "-q"], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"    verify failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.returncode == 0


def reset_peak_rss() -> None:
    """Reset our own RSS high-water mark before a spawn.

    A child forked (or vforked) from us carries our high-water mark into its ru_maxrss
    across exec, so ru_maxrss cannot read below our own RSS at that moment. Resetting the
    mark (and never importing numpy here) keeps that floor at the bench's ~16 MiB.
    """
    try:
        CLEAR_REFS.write_text("5\n")
    except OSError:
        pass


def own_rss() -> int:
    return read_rss(os.getpid())[0]  # type: ignore[index]


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- modes and contenders


def drop_caches() -> None:
    os.sync()
    DROP_CACHES.write_text("3\n")


def warm(path: Path) -> None:
    """Read the whole file so that it sits in the page cache."""
    buf = bytearray(64 * MiB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def prepare(mode: str, src: Path) -> None:
    """Put the page cache in the state the mode measures."""
    if mode == "hot":
        warm(src)
    elif mode in ("cold", "cgroup"):
        drop_caches()


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def find_contenders(stcast: str, peers: Path, out: Path, wanted: list[str]) -> list[Contender]:
    """Return the contenders that can run here, in the order asked; say why others cannot."""
    found: list[Contender] = []
    for name in wanted:
        if name == "stcast":
            exe = resolve_cli(stcast)
            if exe:
                # --json wins over -q: no summary, one report object (isa, threads) on stdout.
                found.append(Contender(name, [exe, "convert"], ["--force", "-q", "--json"]))
            else:
                print(f"stcast CLI not found ({stcast}): stcast skipped")
        elif name == "torch_path":
            probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
            if probe.returncode == 0:
                found.append(Contender(name, [sys.executable, str(peers / "torch_path.py")]))
            else:
                print("torch not installed: torch_path skipped")
        elif name == "np_convert":
            found.append(Contender(name, [sys.executable, str(peers / "np_convert.py")]))
        elif name == "limit_loop":
            exe = build_limit_loop(peers / "limit_loop.rs", out / "limit_loop")
            if exe:
                found.append(Contender(name, [str(exe)], ["16", "drop", "2"]))
    return found


def resolve_cli(name: str) -> str | None:
    """Find the stcast CLI, preferring the script installed beside this interpreter.

    A bare name found on PATH may be a version-manager shim (pyenv's is a bash script that
    runs `pyenv exec`, about 100 ms per start here), which the peers, started with
    `sys.executable`, do not pay. The script in the interpreter's own bin/ is the same CLI.
    """
    if os.sep not in name:
        beside = Path(sys.executable).parent / name
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    return shutil.which(name)


def build_limit_loop(source: Path, exe: Path) -> Path | None:
    """Compile the bare loop as the peers' README does (`rustc -O -C target-cpu=native`),
    unless an up-to-date binary exists."""
    if exe.exists() and exe.stat().st_mtime >= source.stat().st_mtime:
        return exe
    if not shutil.which("rustc"):
        print("rustc not found: limit_loop skipped")
        return None
    done = subprocess.run(
        ["rustc", "-O", "-C", "target-cpu=native", "-o", str(exe), str(source)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(f"rustc failed, limit_loop skipped:\n{done.stderr}")
        return None
    return exe


# ---------------------------------------------------------------- reporting


def machine_facts(stcast: str) -> dict[str, object]:
    meminfo = Path("/proc/meminfo").read_text().split()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    facts: dict[str, object] = {
        "nproc": len(os.sched_getaffinity(0)),
        "ram_gib": round(int(meminfo[meminfo.index("MemTotal:") + 1]) / GiB * 1024, 1),
        "kernel": platform.release(),
        "cpu": cpu,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }
    try:
        version = subprocess.run([stcast, "--version"], capture_output=True, text=True)
        facts["stcast"] = version.stdout.strip() or version.stderr.strip()
    except OSError:
        facts["stcast"] = None
    return facts


def summarize(runs: list[Run]) -> list[dict[str, object]]:
    """One row per (mode, size, contender): medians of wall and CPU, maxima of memory."""
    groups: dict[tuple[str, float, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.mode, r.size_gib, r.contender), []).append(r)
    rows = []
    for (mode, size, name), rs in groups.items():
        ok = [r for r in rs if r.status == "ok"]
        counts: dict[str, int] = {}
        for r in rs:
            counts[r.status] = counts.get(r.status, 0) + 1
        status = (
            "ok"
            if len(ok) == len(rs)
            else ", ".join(f"{s} {n}/{len(rs)}" for s, n in counts.items())
        )
        row: dict[str, object] = {
            "mode": mode,
            "size_gib": size,
            "contender": name,
            "runs": len(rs),
            "status": status,
            "input_bytes": rs[0].input_bytes,
            "mem_limit": rs[0].mem_limit,
            "peak_rss": max(r.peak_rss for r in rs),
            "peak_anon": max(r.peak_anon for r in rs),
            "cgroup_peak": max((r.cgroup_peak or 0 for r in rs), default=0) or None,
            "verified": [r.verified for r in rs if r.verified is not None],
        }
        if ok:
            wall = statistics.median(r.wall_s for r in ok)
            row.update(
                wall_s=wall,
                cpu_s=statistics.median(r.cpu_s for r in ok),
                gb_per_s=rs[0].input_bytes / wall / 1e9,
            )
        rows.append(row)
    walls = {(r["mode"], r["size_gib"], r["contender"]): r.get("wall_s") for r in rows}
    for row in rows:
        for ref in ("limit_loop", "stcast"):
            base = walls.get((row["mode"], row["size_gib"], ref))
            if base and "wall_s" in row:
                row["x_" + ref] = row["wall_s"] / base  # type: ignore[operator]
    return rows


def fmt_bytes(n: object) -> str:
    if not n:
        return "–"
    n = int(n)  # type: ignore[call-overload]
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def fmt(value: object, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def load(avg: object) -> str:
    return " ".join(f"{x:.2f}" for x in avg)  # type: ignore[attr-defined]


def markdown(facts: dict[str, object], config: dict[str, object], rows: list[dict]) -> str:
    isa = facts.get("stcast_isa")
    lines = [
        "# stcast benchmark",
        "",
        f"- machine: {facts['nproc']} CPUs ({facts['cpu']}), {facts['ram_gib']} GiB RAM, "
        f"Linux {facts['kernel']}, load average {load(facts['loadavg_start'])} at start, "
        f"{load(facts['loadavg_end'])} at end",
        f"- python {facts['python']}, {facts['stcast'] or 'stcast not installed'}"
        + (f" ({isa}, {facts.get('stcast_threads')} threads)" if isa else "")
        + f", torch {facts.get('torch') or 'not installed'}",
        f"- command: `{config['command']}`",
        f"- {config['repeats']} interleaved repeat(s)"
        + (f" ({config['tmpfs_repeats']} on tmpfs)" if config.get("tmpfs_repeats") else "")
        + "; wall and CPU are medians of the runs "
        "that succeeded, memory figures the maxima; GB/s = input bytes / median wall / 1e9; "
        "× columns = wall / wall of limit_loop or stcast in the same mode and size. "
        f"Peak RSS is ru_maxrss, which cannot read below the bench's own RSS "
        f"({fmt_bytes(facts['rss_floor'])}); peak anon is sampled every {SAMPLE_S * 1000:.0f} ms.",
        "",
        "| mode | size | contender | status | wall s | CPU s | GB/s | peak RSS | peak anon "
        "| mem limit | cgroup peak | × limit_loop | × stcast |",
        "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        verified = r.get("verified") or []
        status = r["status"] + (
            (", verified" if all(verified) else ", VERIFY FAILED") if verified else ""
        )
        lines.append(
            f"| {r['mode']} | {r['size_gib']:g} GiB | {r['contender']} | {status} "
            f"| {fmt(r.get('wall_s'), '.2f')} | {fmt(r.get('cpu_s'), '.2f')} "
            f"| {fmt(r.get('gb_per_s'), '.2f')} | {fmt_bytes(r['peak_rss'])} "
            f"| {fmt_bytes(r['peak_anon'])} | {fmt_bytes(r['mem_limit'])} "
            f"| {fmt_bytes(r['cgroup_peak'])} "
            f"| {fmt(r.get('x_limit_loop'), '.2f')} | {fmt(r.get('x_stcast'), '.2f')} |"
        )
    if config.get("skipped"):
        lines += ["", "Not run (`--peers-up-to`, `--peer-modes`): " + ", ".join(config["skipped"])]
    checks = targets(rows)
    if checks:
        lines += ["", "## Targets (issue 3)", ""]
        lines += [f"- {'PASS' if ok else 'MISS'}: {text}" for ok, text in checks]
    return "\n".join(lines) + "\n"


RSS_TARGET = 64 * MiB


def targets(rows: list[dict]) -> list[tuple[bool, str]]:
    """Check the targets of issue 3 that this run's rows can decide: (holds, what)."""
    at = {(r["mode"], r["size_gib"], r["contender"]): r for r in rows}
    out: list[tuple[bool, str]] = []

    def wall(mode: str, size: float, name: str) -> float | None:
        row = at.get((mode, size, name))
        return row.get("wall_s") if row and row["status"] == "ok" else None  # type: ignore[return-value]

    me = wall("tmpfs", 4.0, "stcast")
    if me:
        for name, goal, text in (
            ("limit_loop", 1.1, "stcast wall <= 1.1x limit_loop"),
            ("np_convert", 1.8, "stcast >= 1.8x faster than np_convert"),
            ("torch_path", 5.0, "stcast >= 5x faster than torch_path"),
        ):
            other = wall("tmpfs", 4.0, name)
            if other is None:
                continue
            ratio = me / other if name == "limit_loop" else other / me
            ok = ratio <= goal if name == "limit_loop" else ratio >= goal
            line = f"tmpfs 4 GiB: {text}: {ratio:.2f}x ({me:.2f} s vs {other:.2f} s)"
            floor = wall("tmpfs", 4.0, "limit_loop")
            if name != "limit_loop" and floor:
                # What no converter here could beat: the bare loop's own ratio.
                line += f"; limit_loop itself: {other / floor:.2f}x"
            out.append((ok, line))
    for r in rows:
        if r["contender"] == "stcast" and r["mode"] in ("hot", "cold") and r["status"] == "ok":
            ok = r["peak_rss"] <= RSS_TARGET
            out.append(
                (
                    ok,
                    f"{r['mode']} {r['size_gib']:g} GiB: stcast peak RSS "
                    f"{fmt_bytes(r['peak_rss'])} <= 64 MiB",
                )
            )
    for r in rows:
        if r["contender"] != "stcast" or r["mode"] != "cgroup":
            continue
        limited, cold = r.get("wall_s"), wall("cold", r["size_gib"], "stcast")
        verified = r.get("verified") or []
        what = f"cgroup {r['size_gib']:g} GiB under {fmt_bytes(r['mem_limit'])}: stcast"
        out.append((r["status"] == "ok", f"{what} succeeds ({r['status']})"))
        if verified:
            out.append((all(verified), f"{what} output verified bit-exact"))
        if limited and cold:
            ratio = limited / cold
            out.append(
                (
                    ratio <= 1.5,
                    f"{what} wall <= 1.5x unlimited cold: {ratio:.2f}x "
                    f"({limited:.2f} s vs {cold:.2f} s)",
                )
            )
    return out


def plot(runs: list[Run], rows: list[dict], out: Path) -> list[Path]:
    """Write throughput.png (GB/s per contender per mode/size) and rss.png (RSS over time)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): no plots")
        return []
    names = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]
    groups = list(dict.fromkeys((r["mode"], r["size_gib"]) for r in rows))
    width = 0.8 / max(1, len(names))

    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups) + 3), 4.5))
    for i, name in enumerate(names):
        for j, group in enumerate(groups):
            row = next(
                (r for r in rows if (r["mode"], r["size_gib"], r["contender"]) == (*group, name)),
                None,
            )
            if row is None:
                continue
            x = j + (i - (len(names) - 1) / 2) * width
            value = row.get("gb_per_s", 0.0)
            ax.bar(x, value, width, color=f"C{i}", label=name if j == 0 else None)
            text = f"{value:.2f}" if "gb_per_s" in row else row["status"].split(" ")[0]
            ax.annotate(text, (x, value), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{m} {s:g} GiB" for m, s in groups])
    ax.set_ylabel("input GB/s (higher is better)")
    ax.set_title("F32 -> BF16 throughput")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)

    mode, size = rows[0]["mode"], max(s for m, s in groups if m == rows[0]["mode"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(names):
        rs = [r for r in runs if (r.mode, r.size_gib, r.contender) == (mode, size, name)]
        if not rs:
            continue
        ok = sorted((r for r in rs if r.status == "ok"), key=lambda r: r.wall_s)
        run = ok[len(ok) // 2] if ok else rs[0]  # the median run
        t = [s[0] for s in run.samples]
        ax.plot(t, [s[1] / MiB for s in run.samples], color=f"C{i}", label=f"{name} RSS")
        if any(s[3] is not None for s in run.samples):
            ax.plot(
                t,
                [(s[3] or 0) / MiB for s in run.samples],
                color=f"C{i}",
                linestyle="--",
                label=f"{name} cgroup",
            )
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB (log scale)")
    ax.set_yscale("log")
    ax.set_title(f"memory over time, {mode}, {size:g} GiB input (median run)")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=120)
    plt.close(fig)
    return [out / "throughput.png", out / "rss.png"]


# ---------------------------------------------------------------- driver


def parse_bytes(text: str) -> int:
    """Parse 256M, 6G, 1.5G, 1048576 (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_caps(items: list[str]) -> dict[str, int]:
    caps = {}
    for item in items:
        name, _, size = item.partition("=")
        name = ALIASES.get(name, name)
        if name not in CONTENDERS or not size:
            raise SystemExit(f"--cap {item!r}: expected CONTENDER=SIZE, CONTENDER in {CONTENDERS}")
        caps[name] = parse_bytes(size)
    return caps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4", help="input sizes in GiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--tmpfs-repeats",
        type=int,
        default=None,
        metavar="N",
        help="repeats in tmpfs mode (default --repeats): the speed comparison, and the "
        "cheapest mode to repeat",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="any of " + ",".join(MODES))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--mem-limit", default="256M", help="cgroup mode's memory limit")
    ap.add_argument(
        "--cap",
        action="append",
        default=[],
        metavar="CONTENDER=SIZE",
        help="memory cap for one contender in every mode (e.g. torch=6G)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="kill a run that has not finished after this many seconds",
    )
    ap.add_argument(
        "--peers-up-to",
        type=float,
        default=None,
        metavar="GIB",
        help="run torch_path and np_convert only at sizes up to this (they hold the whole "
        "checkpoint in RAM: at 16 GiB on 24 GiB they OOM or thrash for the whole --timeout)",
    )
    ap.add_argument(
        "--peer-modes",
        default=None,
        metavar="MODES",
        help="modes in which torch_path and np_convert run (default: all). Under a 256 MiB "
        "cgroup the torch path is OOM-killed after ~100 s of thrashing, at every size",
    )
    ap.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip `stcast verify` of stcast's first output per mode and size",
    )
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only rewrite results.md and the plots in --out from this results.json",
    )
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--stcast", default="stcast", help="the stcast CLI to measure")
    # The peers live in benches/peers (the same contenders as the team's shared copies).
    ap.add_argument("--peers", type=Path, default=HERE / "peers")
    ap.add_argument("--tmpfs-dir", type=Path, default=Path("/dev/shm/stcast-bench"))
    ap.add_argument("--disk-dir", type=Path, default=Path("/var/tmp/stcast-bench"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clean", action="store_true", help="delete the generated inputs at the end")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 0.25 GiB, 1 repeat, tmpfs only"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.modes = "0.25", 1, "tmpfs"
    args.sizes = [float(s) for s in args.sizes.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    if args.peer_modes is not None:
        args.peer_modes = [m.strip() for m in args.peer_modes.split(",")]
    args.contenders = [ALIASES.get(c.strip(), c.strip()) for c in args.contenders.split(",")]
    for m in args.modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {','.join(MODES)}")
    for c in args.contenders:
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; choose from {','.join(CONTENDERS)}")
    args.mem_limit = parse_bytes(args.mem_limit)
    args.caps = parse_caps(args.cap)
    return args


def checkpoint_path(directory: Path, size_gib: float, seed: int) -> Path:
    return directory / f"input-{size_gib:g}GiB-seed{seed}.safetensors"


def cached_checkpoint(directory: Path, size_gib: float, seed: int) -> Path:
    """Return the input for (size, seed) in directory, generating it (in a child) on first use."""
    path = checkpoint_path(directory, size_gib, seed)
    if not path.exists():
        print(f"generating {path} ...", flush=True)
        gen = [sys.executable, str(HERE / "gen.py"), f"{size_gib:g}", str(path)]
        subprocess.run([*gen, "--seed", str(seed)], check=True)
    return path


def usable(mode: str, size: float, directory: Path, seed: int) -> str | None:
    """Return why (mode, size) cannot run here, or None."""
    if mode == "tmpfs" and size > TMPFS_MAX_GIB:
        return f"input above {TMPFS_MAX_GIB:g} GiB would not fit in RAM beside the peers"
    if mode in ("cold", "cgroup") and not can_drop_caches():
        return f"cannot write {DROP_CACHES} (needs root)"
    directory.mkdir(parents=True, exist_ok=True)
    cached = checkpoint_path(directory, size, seed).exists()
    need = int(size * GiB * (0.6 if cached else 1.6))  # output is half the input
    if shutil.disk_usage(directory).free < need:
        return f"not enough free space in {directory} ({fmt_bytes(need)} needed)"
    return None


def render(path: Path, out: Path) -> int:
    """Rewrite results.md and the plots from a results.json (e.g. after a report change)."""
    data = json.loads(path.read_text())
    runs = [Run(**r) for r in data["runs"]]
    table = markdown(data["machine"], data["config"], data["summary"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table)
    written = [out / "results.md", *plot(runs, data["summary"], out)]
    print(table)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benches/compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    remove_stale_cgroups()
    needs_cgroup = "cgroup" in args.modes or args.caps
    if needs_cgroup:
        try:
            own_memory_cgroup()
        except OSError as e:
            raise SystemExit(f"cgroup mode and --cap need cgroup v1 memory: {e}") from e

    contenders = find_contenders(args.stcast, args.peers, args.out, args.contenders)
    facts = machine_facts(args.stcast)
    if any(c.name == "torch_path" for c in contenders):
        probe = [sys.executable, "-c", "import torch; print(torch.__version__)"]
        facts["torch"] = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    reset_peak_rss()
    facts["rss_floor"] = own_rss()

    runs: list[Run] = []
    skipped: list[str] = []
    inputs: list[Path] = []
    interrupted = False
    try:
        for mode in args.modes:
            directory = args.tmpfs_dir if mode == "tmpfs" else args.disk_dir
            for size in args.sizes:
                why = usable(mode, size, directory, args.seed)
                if why:
                    print(f"{mode} {size:g} GiB skipped: {why}")
                    continue
                src = cached_checkpoint(directory, size, args.seed)
                inputs.append(src)
                scratch = directory / f"out-{os.getpid()}"
                repeats = args.repeats
                if mode == "tmpfs" and args.tmpfs_repeats:
                    repeats = args.tmpfs_repeats
                for rep in range(repeats):
                    for c in contenders:
                        if c.name in PEERS:
                            why = None
                            if args.peers_up_to is not None and size > args.peers_up_to:
                                why = "--peers-up-to"
                            if args.peer_modes is not None and mode not in args.peer_modes:
                                why = "--peer-modes"
                            if why:
                                if rep == 0:
                                    print(f"{mode} {size:g} GiB: {c.name} skipped ({why})")
                                    skipped.append(f"{c.name} at {mode} {size:g} GiB")
                                continue
                        limit = args.caps.get(c.name) or (
                            args.mem_limit if mode == "cgroup" else None
                        )
                        run = Run(mode, size, c.name, rep, src.stat().st_size)
                        shutil.rmtree(scratch, ignore_errors=True)
                        scratch.mkdir()
                        prepare(mode, src)
                        try:
                            dst = scratch / f"{c.name}.safetensors"
                            run_once(c, src, dst, run, limit, args.timeout)
                            check = args.verify and c.name == "stcast" and rep == 0
                            if check and run.status == "ok":
                                run.verified = verify_output(c, src, dst)
                        finally:
                            shutil.rmtree(scratch, ignore_errors=True)
                        runs.append(run)
                        print(
                            f"[{mode} {size:g} GiB #{rep + 1}] {c.name:<10} {run.status:<8} "
                            f"wall {run.wall_s:6.2f} s  cpu {run.cpu_s:6.2f} s  "
                            f"peak RSS {fmt_bytes(run.peak_rss)}"
                            + (f"  cgroup {fmt_bytes(run.cgroup_peak)}" if limit else "")
                            + ("" if run.verified is None else f"  verified {run.verified}"),
                            flush=True,
                        )
                        if run.status.startswith("failed"):
                            last = run.stderr_tail.strip().splitlines() or ["(no stderr)"]
                            print(f"    {last[-1]}")
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: writing the results so far")
    finally:
        if args.clean:
            for path in inputs:
                path.unlink(missing_ok=True)

    facts["loadavg_end"] = os.getloadavg()
    report = next((r.report for r in runs if r.report), None)
    if report:
        facts["stcast_isa"], facts["stcast_threads"] = report.get("isa"), report.get("threads")
    config = {
        "command": command,
        "sizes_gib": args.sizes,
        "repeats": args.repeats,
        "tmpfs_repeats": args.tmpfs_repeats,
        "modes": args.modes,
        "mem_limit": args.mem_limit,
        "caps": args.caps,
        "timeout_s": args.timeout,
        "seed": args.seed,
        "contenders": [asdict(c) for c in contenders],
        "peers_up_to_gib": args.peers_up_to,
        "skipped": skipped,
    }
    rows = summarize(runs)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "machine": facts,
                "config": config,
                "summary": rows,
                "runs": [asdict(r) for r in runs],
            },
            indent=1,
        )
    )
    table = markdown(facts, config, rows)
    (args.out / "results.md").write_text(table)
    written = [args.out / "results.md", args.out / "results.json"]
    if rows:
        written += plot(runs, rows, args.out)
    print()
    print(table)
    print("wrote " + ", ".join(str(p) for p in written))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
