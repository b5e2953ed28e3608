"""End-to-end benchmark: stcast against the torch path, a numpy converter and a bare mmap loop.

Every contender runs in its own child process on generated transformer-shaped F32
checkpoints, in ABBA order: each round runs the contenders forward, the next one in reverse
(A B B A A B ... for two), so that no contender always runs first or right after another;
every output is deleted right after its run. Per run: wall time, user and system CPU time
and peak RSS (wait4 rusage), plus RSS (and the cgroup's usage, when there is one) sampled
every 50 ms. The report gives the median and the spread [min-max] of every figure, the
ratios to the bare loop (and to an older stcast, --baseline) with their per-round spread,
and PASS/FAIL for each goal of the "Speed" issue (constants GOAL_* below). Results go to
--out as results.md, results.json (every run), throughput.png, cpu.png and rss.png.

Modes: tmpfs (files in RAM), hugetmpfs (files in a tmpfs mounted with huge=always for the
run: the speed comparison of the goals; needs root), hot (on disk, page cache warmed), cold
(on disk, caches dropped before each run; `dd` gives the disk's read rate), cgroup (on
disk, caches dropped, each child in a cgroup v1 memory group limited to --mem-limit).
--many-tensors adds a case of 300000 tensors of 1 KiB against 300 of 1000 KiB (the same
307.2 MB): convert, then `inspect --json` and `verify` of the 300000-tensor file.
--bin-sizes adds PyTorch checkpoints (`.bin`, torch's zip format, the same tensors as the
size case; made without torch by gen_bin.py): stcast against torch_load_mmap
(`torch.load(mmap=True)`, `.to(bfloat16)`, `save_file`) and torch_load (`torch.load`, the
same), peers/torch_bin.py.
--dcp-sizes adds torch.distributed.checkpoint (DCP) folders: a model of that many GiB of F32,
sharded FSDP-style over --dcp-ranks ranks, saved with Adam's state beside it (`{"model",
"optim"}`: the folder is 3x the model; made without torch by gen_dcp.py): stcast (`convert
SRC DST --key model`) against torch_dcp (`dcp_to_torch_save` to a temporary file,
`torch.load(...)["model"]`, `.to(bfloat16)`, `save_file`) and torch_dcp_inmem
(`_load_state_dict_from_keys({"model"})`, the same), peers/torch_dcp.py; each peer's first
output is compared with stcast's, tensor by tensor, bit for bit (same_tensors.py).
--zero-sizes adds DeepSpeed ZeRO checkpoint folders (`latest` + `global_step1/`): a model of
that many GiB of F32 trained over --zero-ranks ranks at --zero-stage (2: the whole module in
mp_rank_00_model_states.pt and the fp32 partitions with Adam's moments per rank, the folder
4x the model; 3: only the partitions, 3x; made without torch by gen_zero.py): stcast
(`convert SRC DST`) against torch_zero (`get_fp32_state_dict_from_zero_checkpoint(SRC)`,
`.to(bfloat16)`, `save_file`), peers/torch_zero.py, whose first output is compared with
stcast's the same way. A stcast that refuses ZeRO folders (exit 1, "does not read these
yet") is reported "not run" for the case; torch_zero is measured anyway.
--fp8 runs only the FP8 case: stcast's `--to fp8` / `--to fp8-block` against llm-compressor's
model_free_ptq (peers/model_free_ptq.py, FP8_DYNAMIC / FP8_BLOCK, run with --fp8-python) on a
1.08 GiB Llama-shaped F32 folder (gen_fp8.py), and stcast's FP8 -> bf16 of model_free_ptq's
FP8_BLOCK output, in ABBA rounds per --fp8-modes (hugetmpfs, hot); then every quantized
weight and weight_scale stcast wrote is compared byte for byte with model_free_ptq's, and
the dequantization with compressed-tensors' own (fp8_dequant_check.py). fp8.md, fp8.json.
--packed runs only the packed case (issue 32): stcast's INT4 -> bf16 (`convert SRC DST`) against
compressed-tensors' own dequantization (peers/ct_dequantize.py: `convert_checkpoint` with
`CompressedTensorsDequantizer`, run with --fp8-python) on a 1.0 GiB Llama-shaped W4A16 folder
(gen_w4a16.py), in ABBA rounds per --fp8-modes; then the two outputs are compared, every
tensor bit for bit. packed.md, packed.json.
--gptoss runs only the gpt-oss case (issue 32): stcast's MXFP4 -> bf16 (`convert SRC DST`)
against transformers' own (peers/tf_gptoss.py: `GptOssForCausalLM.from_pretrained` with
`Mxfp4Config(dequantize=True)`, then `save_pretrained`, run with --fp8-python) on a 0.28 GiB
gpt-oss-shaped MXFP4 folder (gen_gptoss.py), in ABBA rounds per --fp8-modes; then the two
outputs are compared, every tensor bit for bit. gptoss.md, gptoss.json.
--reshard SIZE adds contender stcast_reshard: `convert SRC DST --max-shard-size SIZE` (a
folder of shards and an index) beside stcast's plain conversion of the same input; the
"Re-sharding" issue's goal is its median wall <= 1.05x stcast's (4 GiB into 1 GB shards).

usage: python benches/compare.py [--sizes 1,4] [--repeats 3] [--modes hugetmpfs,tmpfs,...]
           [--many-tensors] [--bin-sizes 4] [--dcp-sizes 1] [--dcp-ranks 3]
           [--zero-sizes 1] [--zero-ranks 3] [--zero-stage 2]
           [--baseline PYTHON|CMD] [--tuning JSON]
           [--reshard SIZE] [--order abba|cyclic] [--mem-limit 256M] [--cap CONTENDER=SIZE]
           [--timeout S] [--out benches/out] [--quick]
       python benches/compare.py --fp8 [--repeats 3] [--fp8-modes hugetmpfs,hot]
           [--fp8-python /work/venv-llmc/bin/python] [--stcast CLI]
       python benches/compare.py --packed [the same options as --fp8]
       python benches/compare.py --gptoss [the same options as --fp8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("tmpfs", "hugetmpfs", "hot", "cold", "cgroup")
RAM_MODES = ("tmpfs", "hugetmpfs")
CONTENDERS = (
    "stcast",
    "torch_path",
    "np_convert",
    "limit_loop",
    "dd_read",
    "torch_load_mmap",
    "torch_load",
    "torch_dcp",
    "torch_dcp_inmem",
    "torch_zero",
)
EXTRA = ("stcast_base", "stcast_tuned", "stcast_reshard")  # --baseline, --tuning, --reshard
TORCH_PEERS = (
    "torch_path",
    "torch_load_mmap",
    "torch_load",
    "torch_dcp",
    "torch_dcp_inmem",
    "torch_zero",
)
PEERS = ("np_convert", *TORCH_PEERS)
# The case kinds each contender reads (the rest read all): safetensors readers skip `.bin`
# inputs, torch.load readers take nothing else; DCP folders are read by stcast's CLIs and the
# DCP peers only, ZeRO folders by stcast's CLIs and torch_zero.
KINDS = {
    "torch_path": ("size", "many", "few"),
    "np_convert": ("size", "many", "few"),
    "limit_loop": ("size", "many", "few"),
    "torch_load_mmap": ("bin",),
    "torch_load": ("bin",),
    "stcast_reshard": ("size", "bin"),
    "stcast_tuned": ("size", "many", "few", "bin"),
    "dd_read": ("size", "many", "few", "bin"),
    "torch_dcp": ("dcp",),
    "torch_dcp_inmem": ("dcp",),
    "torch_zero": ("zero",),
}
ALIASES = {
    "torch": "torch_path",
    "numpy": "np_convert",
    "np": "np_convert",
    "limit": "limit_loop",
    "dd": "dd_read",
}
WARM_MODES = ("tmpfs", "hugetmpfs", "hot")  # --warmup rounds (cold and cgroup drop caches)
SAMPLE_S = 0.05
TMPFS_MAX_GIB = 4.0  # input + output + the torch path's copy must all fit in RAM
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
CGROUP_PREFIX = "stcast-bench-"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
CLEAR_REFS = Path("/proc/self/clear_refs")
MiB = 1 << 20
GiB = 1 << 30

# ---- The goals of the "Speed" issue, checked on medians (results.md, "Goals").
GOAL_MODE = "hugetmpfs"  # the speed goals are stated on a huge-page tmpfs
GOAL_RUNS = 9  # runs per contender the goals ask for (fewer: the line says so)
GOAL_WALL_X_LOOP = 1.15  # stcast wall <= this x limit_loop's
GOAL_USER_X_LOOP = 1.15  # stcast user CPU <= this x limit_loop's ...
GOAL_USER_START_S = 0.05  # ... + this, for the interpreter's start
GOAL_MANY_X_FEW = 1.5  # 300000 x 1 KiB wall <= this x 300 x 1000 KiB wall
# Re-planned from the issue's evidence (a serde walk of the 33.8 MB header alone is 50 ms):
# (many wall - few wall) / many tensors <= this, the cost per tensor of the same data.
GOAL_PER_TENSOR_S = 1e-6
GOAL_MANY_RSS_BASE = 64 * MiB  # peak RSS <= this + GOAL_MANY_RSS_PER_HEADER_BYTE x header
GOAL_MANY_RSS_PER_HEADER_BYTE = 4
GOAL_MANY_RSS_ACTIONS = ("convert", "verify")  # the actions held to that RSS bound
GOAL_INSPECT_S = 5.0  # `stcast inspect --json` of the 300000-tensor file, wall
GOAL_VERIFY_S = 5.0  # `stcast verify` of it, wall
GOAL_COLD_X_DD = 0.9  # cold: stcast's input rate >= this x `dd`'s read rate
GOAL_COLD_RSS = 64 * MiB
GOAL_NOT_SLOWER_X = 1.05  # stcast wall <= this x stcast_base's (run-to-run noise allowed)
GOAL_RESHARD_X_PLAIN = 1.05  # stcast_reshard wall <= this x stcast's, same input and mode
# DCP folders (--dcp-sizes): stcast peak RSS <= BASE + this x the .metadata file's bytes (the
# parsed Metadata, which stcast holds for the whole run), and torch_dcp's wall >= this x stcast's.
GOAL_DCP_RSS_BASE = 64 * MiB
GOAL_DCP_RSS_PER_METADATA_BYTE = 4
GOAL_DCP_X_TORCH = 3.0
DCP_KEY = "model"  # the dict of the checkpoint that is converted (the rest is the optimizer's)
DCP_FILE_FACTOR = 3  # the folder's bytes over the model's: the model, exp_avg, exp_avg_sq
# ZeRO folders (--zero-sizes): stcast peak RSS <= BASE + this x the pickles' bytes (every .pt's
# data.pkl: what stcast parses), and torch_zero's wall >= this x stcast's.
GOAL_ZERO_RSS_BASE = 64 * MiB
GOAL_ZERO_RSS_PER_PICKLE_BYTE = 4
GOAL_ZERO_X_TORCH = 3.0
# the folder's bytes over the model's: ZeRO-2 the module, the fp32 partitions, exp_avg and
# exp_avg_sq; ZeRO-3 the last three (its module holds empty tensors)
ZERO_FILE_FACTOR = {2: 4, 3: 3}
# What a stcast without the ZeRO reader says of such a folder (exit 1): its runs are "not run".
ZERO_REFUSAL = "does not read these yet"
ZERO_NOT_RUN = "not run: stcast cannot read ZeRO yet"

# ---- The many-tensors case: the same bytes of data in many small or few large tensors.
MANY_COUNT = 300_000
MANY_BYTES = 1024
FEW_COUNT = 300

# Runs `stcast.convert` with --tuning's knobs (the API's `tuning=`; no environment variable).
TUNED_CHILD = (
    "import json, sys\n"
    "import stcast\n"
    "stcast.convert(sys.argv[1], sys.argv[2], force=True, tuning=json.loads(sys.argv[3]))\n"
)


@dataclass
class Contender:
    """A command line run per input; `{src}` and `{dst}` in argv are replaced.

    kind: "stcast" (a stcast CLI: cli runs it, and inspect / verify come from it), "api"
    (stcast through its Python API: --tuning), "reshard" (a stcast CLI re-sharding into a
    folder: --reshard; size and .bin cases), "peer", "loop" (the bare loop), "read" (dd).
    modes: the modes it runs in (None: all).
    """

    name: str
    argv: list[str]
    kind: str = "peer"
    cli: list[str] = field(default_factory=list)
    modes: list[str] | None = None

    @property
    def writes(self) -> bool:
        return any("{dst}" in a for a in self.argv)

    def command(
        self,
        src: Path,
        dst: Path | None = None,
        action: str = "convert",
        options: tuple[str, ...] = (),
    ) -> list[str]:
        """The argv of action; options (a case's, e.g. `--key model`) go to stcast's CLIs."""
        if action == "convert":
            template = self.argv
        elif action == "inspect":
            template = [*self.cli, "inspect", "--json", "{src}"]
        elif action == "verify":
            template = [*self.cli, "verify", "{src}", "{dst}", "-q"]
        else:
            raise ValueError(action)
        if self.kind in ("stcast", "reshard"):
            template = [*template, *options]
        return [a.replace("{src}", str(src)).replace("{dst}", str(dst)) for a in template]


@dataclass(frozen=True)
class Case:
    """One input: a Llama-shaped checkpoint of size_gib, or one of the many-tensors pair."""

    name: str  # "4 GiB", "300000 × 1 KiB", "4 GiB .bin", "1 GiB DCP ×3", "1 GiB ZeRO-2 ×3"
    spec: str  # what gen.py is given: "4", "300000x1024"
    kind: str = "size"  # "size" | "many" | "few" | "bin" | "dcp" | "zero"
    size_gib: float = 0.0  # the data's GiB (dcp, zero: the model's, the folder is 3-4x)
    ranks: int = 0  # dcp, zero: the ranks it is sharded over
    stage: int = 0  # zero: the ZeRO stage

    def filename(self, seed: int) -> str:
        if self.kind == "size":
            return checkpoint_path(Path(), self.size_gib, seed).name
        if self.kind == "bin":
            return checkpoint_path(Path(), self.size_gib, seed).with_suffix(".bin").name
        if self.kind == "dcp":
            return f"dcp-{self.size_gib:g}GiB-{self.ranks}ranks-optim-seed{seed}"
        if self.kind == "zero":
            return f"zero{self.stage}-{self.size_gib:g}GiB-{self.ranks}ranks-seed{seed}"
        return f"tensors-{self.spec}-seed{seed}.safetensors"

    @property
    def options(self) -> tuple[str, ...]:
        """What stcast's CLIs are given beside SRC and DST for this input."""
        return ("--key", DCP_KEY) if self.kind == "dcp" else ()


def size_case(size_gib: float) -> Case:
    return Case(f"{size_gib:g} GiB", f"{size_gib:g}", "size", size_gib)


def bin_case(size_gib: float) -> Case:
    """The size case's tensors as a PyTorch checkpoint (gen_bin.py)."""
    return Case(f"{size_gib:g} GiB .bin", f"{size_gib:g}", "bin", size_gib)


def dcp_case(size_gib: float, ranks: int) -> Case:
    """A DCP folder: a model of size_gib sharded over ranks, with Adam's state (gen_dcp.py)."""
    return Case(f"{size_gib:g} GiB DCP ×{ranks}", f"{size_gib:g}", "dcp", size_gib, ranks)


def zero_case(size_gib: float, ranks: int, stage: int) -> Case:
    """A DeepSpeed ZeRO folder: a model of size_gib over ranks at stage (gen_zero.py)."""
    name = f"{size_gib:g} GiB ZeRO-{stage} ×{ranks}"
    return Case(name, f"{size_gib:g}", "zero", size_gib, ranks, stage)


def file_factor(case: Case) -> int:
    """A folder's bytes over its model's (1 for a single file)."""
    if case.kind == "dcp":
        return DCP_FILE_FACTOR
    if case.kind == "zero":
        return ZERO_FILE_FACTOR[case.stage]
    return 1


def many_cases(count: int, tensor_bytes: int, few: int) -> tuple[Case, Case]:
    """The pair: count tensors of tensor_bytes, and few tensors holding the same data."""
    total = count * tensor_bytes
    if total % (4 * few):
        raise SystemExit(f"{count} x {tensor_bytes} bytes do not split into {few} F32 tensors")
    big = total // few
    return (
        Case(f"{count} × {fmt_size(tensor_bytes)}", f"{count}x{tensor_bytes}", "many", total / GiB),
        Case(f"{few} × {fmt_size(big)}", f"{few}x{big}", "few", total / GiB),
    )


@dataclass
class Job:
    """One contender's action on one input; target: the file `verify` checks."""

    contender: Contender
    case: Case
    src: Path
    action: str = "convert"
    target: Path | None = None

    @property
    def label(self) -> str:
        return label(self.contender.name, self.action)


@dataclass
class Run:
    """One timed child process."""

    mode: str
    size_gib: float
    contender: str
    repeat: int
    input_bytes: int
    case: str = ""
    kind: str = "size"
    action: str = "convert"
    position: int = 0  # its place in the round's order, from 0
    header_bytes: int = 0
    status: str = "ok"
    wall_s: float = 0.0
    user_s: float = 0.0
    sys_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss: int = 0
    peak_anon: int = 0
    floor_rss: int = 0  # the bench's own RSS at the spawn
    mem_limit: int | None = None
    cgroup_peak: int | None = None
    cgroup_failcnt: int | None = None
    samples: list[tuple[float, int, int, int | None]] = field(default_factory=list)
    report: dict | None = None
    stderr_tail: str = ""
    verified: bool | None = None  # stcast builds: `stcast verify SRC DST` of this output
    same_as_stcast: bool | None = None  # dcp, zero peers: their output's tensors are stcast's

    def __post_init__(self) -> None:
        if not self.case:  # a results.json from before cases
            self.case = size_case(self.size_gib).name

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.mode, self.case, self.contender, self.action)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def label(contender: str, action: str) -> str:
    return contender if action == "convert" else f"{contender} {action}"


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


# ---------------------------------------------------------------- huge-page tmpfs


class HugeTmpfs:
    """`mount -t tmpfs -o size=SIZE,huge=always tmpfs PATH` for the length of a with-block.

    The mount point is created (and removed afterwards, if we created it); the tmpfs is
    unmounted on the way out whatever happens, Ctrl-C and SIGTERM included. A mount left
    by a bench that was killed outright (SIGKILL) is refused, with the command to remove it.
    """

    def __init__(self, path: Path, size: str):
        self.path, self.size = path, size
        self.created = False
        self.mounted = False

    def __enter__(self) -> Path:
        if os.path.ismount(self.path):
            raise OSError(
                f"{self.path} is already a mount point (a killed bench? umount {self.path})"
            )
        if not self.path.exists():
            self.path.mkdir(parents=True)
            self.created = True
        options = f"size={self.size},huge=always"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            self._rmdir()
            raise OSError(f"mount -t tmpfs -o {options} failed: {done.stderr.strip()}")
        self.mounted = True
        return self.path

    def options(self) -> str | None:
        """The mount's options as /proc/mounts shows them (huge=always when it took)."""
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[1] == str(self.path):
                return parts[3]
        return None

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.mounted:
            for _ in range(50):  # a child that was just killed can hold it a moment
                done = subprocess.run(["umount", str(self.path)], capture_output=True, text=True)
                if done.returncode == 0 or not os.path.ismount(self.path):
                    self.mounted = False
                    break
                time.sleep(0.1)
            else:
                print(f"warning: could not unmount {self.path}: {done.stderr.strip()}")
        self._rmdir()

    def _rmdir(self) -> None:
        if self.created and not self.mounted:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.created = False


def meminfo(name: str) -> int | None:
    """Return a /proc/meminfo figure in bytes (e.g. ShmemHugePages)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return kib(value.strip())
    return None


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
    argv: list[str],
    dst: Path | None,
    logs: Path,
    run: Run,
    limit: int | None,
    timeout: float,
    *,
    stdout_null: bool = False,
) -> None:
    """Run argv to completion (or OOM, or timeout) and fill in run.

    dst: the file the run must leave (None: it writes none). logs: a folder for its
    stdout and stderr; with stdout_null its stdout goes to /dev/null (`inspect --json`).
    """
    cgroup = MemoryCgroup(limit) if limit else None
    if cgroup:
        argv = cgroup.wrap(argv)
    reset_peak_rss()
    run.floor_rss = own_rss()  # the child's ru_maxrss cannot read below this
    timed_out = threading.Event()
    cg_stats: dict[str, int] = {}
    out_log, err_log = logs / "stdout.log", logs / "stderr.log"
    try:
        with open(os.devnull if stdout_null else out_log, "wb") as out, open(err_log, "wb") as err:
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

    run.user_s, run.sys_s = usage.ru_utime, usage.ru_stime
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
    elif dst is not None and not dst.exists():
        run.status = "no output"
    if run.status != "ok":
        run.stderr_tail = err_log.read_text(errors="replace")[-2000:]


REPORT_MAX = 4 * MiB


def read_report(path: Path) -> dict[str, Any] | None:
    """The scalar fields (isa, threads, seconds, ...) of a stcast `--json` report.

    The per-tensor numerics of 300000 tensors make it ~70 MB: such a report is not parsed
    (only isa and threads are picked from its head), so that the bench's RSS, which every
    child's ru_maxrss starts from, stays small, and results.json too."""
    try:
        if path.stat().st_size <= REPORT_MAX:
            result = json.loads(path.read_text(errors="replace"))["result"]
            return {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
        with open(path, "rb") as f:
            head = f.read(64 * 1024).decode(errors="replace")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    found = {}
    for key, pattern in (("isa", r'"isa":\s*"([^"]*)"'), ("threads", r'"threads":\s*(\d+)')):
        m = re.search(pattern, head)
        if m:
            found[key] = int(m[1]) if key == "threads" else m[1]
    return found or None


def verify_output(
    contender: Contender, src: Path, dst: Path, logs: Path, options: tuple[str, ...] = ()
) -> tuple[bool, dict[str, Any] | None]:
    """Check, untimed and unlimited, that a stcast build's output is exactly src converted;
    return that and the scalars of verify's report (isa, threads: the timed runs print none).
    """
    argv = [*contender.cli, "verify", str(src), str(dst), "--json", *options]
    report = logs / "verify.json"
    with open(report, "wb") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(f"    verify failed: {done.stderr.strip()[-500:]}")
    return done.returncode == 0, read_report(report)


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two safetensors files hold the same tensors (names, dtypes, shapes, and every
    value bit for bit, NaN payloads aside), whatever their order and header layout: checked
    in a child (same_tensors.py: numpy, which the bench itself never imports)."""
    done = subprocess.run(
        [sys.executable, str(HERE / "same_tensors.py"), str(a), str(b)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(f"    same_tensors: {(done.stdout + done.stderr).strip()[-500:]}")
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


def folder_files(path: Path) -> list[Path]:
    """A folder's files, those of its subfolders too (a ZeRO checkpoint's tag folder)."""
    return sorted(p for p in path.rglob("*") if p.is_file())


def warm(path: Path) -> None:
    """Read the whole file (every file of a folder) so that it sits in the page cache."""
    buf = bytearray(64 * MiB)
    for p in folder_files(path) if path.is_dir() else [path]:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def path_bytes(path: Path) -> int:
    """A file's bytes, or the sum of a folder's files' (a DCP or ZeRO checkpoint)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in folder_files(path))
    return path.stat().st_size


def prepare(mode: str, src: Path) -> None:
    """Put the page cache in the state the mode measures (on tmpfs it is the file itself)."""
    if mode == "hot":
        warm(src)
    elif mode in ("cold", "cgroup"):
        drop_caches()


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def stcast_contender(name: str, cli: list[str]) -> Contender:
    # The numeric counts stay on (the CLI's default). No --json: its per-tensor report is
    # ~70 MB at 300000 tensors and costs seconds to print; `verify --json` of the first
    # output (untimed) gives the ISA and threads instead.
    argv = [*cli, "convert", "{src}", "{dst}", "--force", "-q"]
    return Contender(name, argv, "stcast", cli)


def find_contenders(
    stcast: str,
    peers: Path,
    out: Path,
    wanted: list[str],
    baseline: str | None = None,
    tuning: dict[str, object] | None = None,
    reshard: str | None = None,
) -> list[Contender]:
    """Return the contenders that can run here, in the order asked; say why others cannot.

    stcast_base (--baseline), stcast_tuned (--tuning) and stcast_reshard (--reshard) come
    right after stcast.
    """
    found: list[Contender] = []
    for name in wanted:
        if name == "stcast":
            cli = stcast_cli(stcast)
            if cli:
                found.append(stcast_contender(name, cli))
            else:
                print(f"stcast CLI not found ({stcast}): stcast skipped")
            if baseline:
                base = stcast_cli(baseline)
                if not base or not runs_ok([*base, "--version"]):
                    raise SystemExit(f"--baseline {baseline!r}: no working stcast CLI there")
                found.append(stcast_contender("stcast_base", base))
            if tuning is not None and cli:
                argv = [sys.executable, "-c", TUNED_CHILD, "{src}", "{dst}", json.dumps(tuning)]
                found.append(Contender("stcast_tuned", argv, "api", cli))
            if reshard is not None and cli:
                # DST is a folder (of shards and an index); each run gets a fresh one.
                argv = [*cli, "convert", "{src}", "{dst}", "--max-shard-size", reshard, "-q"]
                found.append(Contender("stcast_reshard", argv, "reshard", cli))
        elif name == "torch_path":
            probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
            if probe.returncode == 0:
                argv = [sys.executable, str(peers / "torch_path.py"), "{src}", "{dst}"]
                found.append(Contender(name, argv))
            else:
                print("torch not installed: torch_path skipped")
        elif name == "np_convert":
            argv = [sys.executable, str(peers / "np_convert.py"), "{src}", "{dst}"]
            found.append(Contender(name, argv))
        elif name == "limit_loop":
            exe = build_limit_loop(peers / "limit_loop.rs", out / "limit_loop")
            if exe:
                found.append(
                    Contender(name, [str(exe), "{src}", "{dst}", "16", "drop", "2"], "loop")
                )
        elif name in ("torch_load_mmap", "torch_load"):
            probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
            if probe.returncode == 0:
                mmap = ["--mmap"] if name == "torch_load_mmap" else []
                argv = [sys.executable, str(peers / "torch_bin.py"), *mmap, "{src}", "{dst}"]
                found.append(Contender(name, argv))
            else:
                print(f"torch not installed: {name} skipped")
        elif name in ("torch_dcp", "torch_dcp_inmem"):
            probe = [sys.executable, "-c", "import torch.distributed.checkpoint, safetensors"]
            if subprocess.run(probe, capture_output=True).returncode == 0:
                inmem = ["--inmem"] if name == "torch_dcp_inmem" else []
                argv = [sys.executable, str(peers / "torch_dcp.py"), *inmem, "{src}", "{dst}"]
                found.append(Contender(name, argv))
            else:
                print(f"torch.distributed.checkpoint or safetensors not importable: {name} skipped")
        elif name == "torch_zero":
            probe = [sys.executable, "-c", "import deepspeed.utils.zero_to_fp32, safetensors"]
            env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
            if subprocess.run(probe, capture_output=True, env=env).returncode == 0:
                argv = [sys.executable, str(peers / "torch_zero.py"), "{src}", "{dst}"]
                found.append(Contender(name, argv))
            else:
                print(f"deepspeed or safetensors not importable: {name} skipped")
        elif name == "dd_read":
            if shutil.which("dd"):
                argv = ["dd", "if={src}", "of=/dev/null", "bs=16M", "status=none"]
                found.append(Contender(name, argv, "read", modes=["cold"]))
            else:
                print("dd not found: dd_read skipped")
    return found


def runs_ok(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True).returncode == 0
    except OSError:
        return False


def stcast_cli(spec: str) -> list[str] | None:
    """Return the argv prefix that runs the stcast CLI given as spec.

    spec: a name or path of the CLI (`stcast`, `/work/venv-base/bin/stcast`), a Python
    interpreter (`/work/venv-base/bin/python`: the `stcast` script beside it, else
    `python -m stcast`), or a whole command (`"/work/venv-base/bin/python -m stcast"`).
    """
    words = shlex.split(spec)
    if len(words) != 1:
        return words or None
    word = words[0]
    if Path(word).name.startswith("python"):
        python = shutil.which(word) if os.sep not in word else word
        if not python:
            return None
        beside = Path(python).parent / "stcast"
        if beside.is_file() and os.access(beside, os.X_OK):
            return [str(beside)]
        return [python, "-m", "stcast"]
    exe = resolve_cli(word)
    return [exe] if exe else None


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


# ---------------------------------------------------------------- inputs


def checkpoint_path(directory: Path, size_gib: float, seed: int) -> Path:
    return directory / f"input-{size_gib:g}GiB-seed{seed}.safetensors"


def cached_checkpoint(directory: Path, size_gib: float, seed: int) -> Path:
    """Return the input for (size, seed) in directory, generating it (in a child) on first use."""
    return cached_input(directory, size_case(size_gib), seed)


def cached_input(directory: Path, case: Case, seed: int) -> Path:
    """Return case's input in directory, generating it (in a child: gen.py) on first use."""
    path = directory / case.filename(seed)
    if case.kind == "dcp" and not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        print(f"generating {path} ...", flush=True)
        gen = [sys.executable, str(HERE / "gen_dcp.py"), case.spec, str(path), "--optim"]
        subprocess.run([*gen, "--ranks", str(case.ranks), "--seed", str(seed)], check=True)
        return path
    if case.kind == "zero" and not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        print(f"generating {path} ...", flush=True)
        gen = [sys.executable, str(HERE / "gen_zero.py"), case.spec, str(path)]
        gen += ["--ranks", str(case.ranks), "--stage", str(case.stage), "--seed", str(seed)]
        subprocess.run(gen, check=True)
        return path
    if case.kind == "bin" and not path.exists():
        st = cached_input(directory, size_case(case.size_gib), seed)
        print(f"generating {path} ...", flush=True)
        subprocess.run([sys.executable, str(HERE / "gen_bin.py"), str(st), str(path)], check=True)
        return path
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        print(f"generating {path} ...", flush=True)
        gen = [sys.executable, str(HERE / "gen.py"), case.spec, str(path)]
        subprocess.run([*gen, "--seed", str(seed)], check=True)
    return path


def header_bytes(path: Path) -> int:
    """The safetensors header's length (the JSON, padding included), from its 8-byte prefix;
    a DCP folder's `.metadata` bytes; a ZeRO folder's pickles' (every .pt's data.pkl); 0 for
    a PyTorch checkpoint."""
    if path.is_dir():
        meta = path / ".metadata"
        if meta.exists():
            return meta.stat().st_size
        return sum(pickle_bytes(p) for p in folder_files(path) if p.suffix == ".pt")
    if path.suffix != ".safetensors":
        return 0
    with open(path, "rb") as f:
        return int(struct.unpack("<Q", f.read(8))[0])


def pickle_bytes(path: Path) -> int:
    """The bytes of a torch.save zip's data.pkl (its central directory: zipfile reads only
    that; 0 when it is no zip)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return sum(i.file_size for i in z.infolist() if i.filename.endswith("/data.pkl"))
    except (OSError, zipfile.BadZipFile):
        return 0


def refused(run: Run) -> bool:
    """Whether a stcast run failed saying it does not read the ZeRO folder (a build without
    the ZeRO reader: exit 1 and `... does not read these yet ...`)."""
    return run.status == "failed (exit 1)" and ZERO_REFUSAL in run.stderr_tail


def mode_usable(mode: str) -> str | None:
    """Return why mode cannot run here at all, or None."""
    if mode in ("cold", "cgroup") and not can_drop_caches():
        return f"cannot write {DROP_CACHES} (needs root)"
    if mode == "hugetmpfs" and (os.geteuid() != 0 or not shutil.which("mount")):
        return "mounting a tmpfs needs root and mount(8)"
    return None


def usable(mode: str, case: Case, directory: Path, cache: Path, seed: int, ram: int) -> str | None:
    """Return why case cannot run in mode here, or None.

    directory: where the runs read and write; cache: where the input is generated (the
    same folder, but for hugetmpfs); ram: the hugetmpfs mount's size."""
    folder = case.size_gib * file_factor(case)
    big = case.kind in ("size", "bin", "dcp", "zero")
    if mode in RAM_MODES and big and folder > TMPFS_MAX_GIB:
        return f"input above {TMPFS_MAX_GIB:g} GiB would not fit in RAM beside the peers"
    # the pair, and a .bin with the safetensors it is made from: 2 inputs; a DCP folder is 3x
    # its model and torch_dcp writes a copy of it (dcp_to_torch_save) beside the output; a
    # ZeRO folder is 3-4x its model, and an output (bf16: half the model) sits beside it
    factor = {"size": 1, "dcp": 2 * DCP_FILE_FACTOR, "zero": file_factor(case) + 1}
    data = int(case.size_gib * GiB) * factor.get(case.kind, 2)
    if mode == "hugetmpfs" and data * 1.6 > ram:
        return f"input and output would not fit in the {fmt_bytes(ram)} huge-page tmpfs"
    cache.mkdir(parents=True, exist_ok=True)
    cached = (cache / case.filename(seed)).exists()
    need = int(data * ((0.6 if cached else 1.6) if cache == directory else (0 if cached else 1)))
    if shutil.disk_usage(cache).free < need:
        return f"not enough free space in {cache} ({fmt_bytes(need)} needed)"
    return None


# ---------------------------------------------------------------- statistics


def spread(values: list[float]) -> dict[str, float] | None:
    """Median, min, max, quartiles and count of values (None when there are none)."""
    if not values:
        return None
    s = sorted(values)
    q1, q3 = s[0], s[-1]
    if len(s) >= 2:
        q = statistics.quantiles(s, n=4, method="inclusive")
        q1, q3 = q[0], q[2]
    return {
        "median": statistics.median(s),
        "min": s[0],
        "max": s[-1],
        "q1": q1,
        "q3": q3,
        "n": len(s),
    }


TIMES = ("wall_s", "user_s", "sys_s", "cpu_s")  # over the runs that succeeded
MEMORY = ("peak_rss", "peak_anon", "cgroup_peak")  # over every run that has the figure


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per (mode, case, contender, action): median and spread of every figure."""
    groups: dict[tuple[str, str, str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault(r.key, []).append(r)
    rows = []
    for (mode, case, name, action), rs in groups.items():
        ok = [r for r in rs if r.status == "ok"]
        counts: dict[str, int] = {}
        for r in rs:
            counts[r.status] = counts.get(r.status, 0) + 1
        status = (
            "ok"
            if len(ok) == len(rs)
            else ", ".join(f"{s} {n}/{len(rs)}" for s, n in counts.items())
        )
        row: dict[str, Any] = {
            "mode": mode,
            "case": case,
            "kind": rs[0].kind,
            "size_gib": rs[0].size_gib,
            "contender": name,
            "action": action,
            "runs": len(rs),
            "ok_runs": len(ok),
            "status": status,
            "input_bytes": rs[0].input_bytes,
            "header_bytes": rs[0].header_bytes,
            "mem_limit": rs[0].mem_limit,
            "verified": [r.verified for r in rs if r.verified is not None],
            "same_as_stcast": [r.same_as_stcast for r in rs if r.same_as_stcast is not None],
        }
        for metric in TIMES:
            row[metric] = spread([getattr(r, metric) for r in ok])
        for metric in MEMORY:
            row[metric] = spread([getattr(r, metric) for r in rs if getattr(r, metric)])
        wall = row["wall_s"]
        if wall and wall["min"] > 0:
            size = rs[0].input_bytes / 1e9
            row["gb_per_s"] = {
                "median": size / wall["median"],
                "min": size / wall["max"],
                "max": size / wall["min"],
                "n": wall["n"],
            }
        else:
            row["gb_per_s"] = None
        rows.append(row)
    return rows


def median(row: dict[str, Any] | None, metric: str) -> float | None:
    stat = row.get(metric) if row else None
    return stat["median"] if stat else None


def ratio(
    runs: list[Run],
    rows: dict[tuple[str, str, str, str], dict[str, Any]],
    num: tuple[str, str, str, str],
    den: tuple[str, str, str, str],
    metric: str,
) -> dict[str, Any] | None:
    """num's metric over den's: the ratio of their medians, and the spread of the per-round
    ratios (the runs of one round, paired by their repeat number)."""
    a, b = median(rows.get(num), metric), median(rows.get(den), metric)
    if a is None or not b:
        return None
    by: dict[tuple[tuple[str, str, str, str], int], float] = {}
    for r in runs:
        if r.status == "ok" and r.key in (num, den):
            by[(r.key, r.repeat)] = getattr(r, metric)
    pairs = [
        by[(num, rep)] / by[(den, rep)] for (key, rep) in by if key == num and by.get((den, rep))
    ]
    return {
        "num": list(num),
        "den": list(den),
        "metric": metric,
        "ratio": a / b,
        "rounds": spread(pairs),
    }


def all_ratios(runs: list[Run], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ratios the report states: each contender against the bare loop and stcast, stcast
    against its baseline, many tensors against few, stcast against dd's read."""
    at = {row_key(r): r for r in rows}
    out: list[dict[str, Any]] = []

    def add(num: tuple[str, str, str, str], den: tuple[str, str, str, str], *metrics: str) -> None:
        for metric in metrics:
            r = ratio(runs, at, num, den, metric)
            if r and not find_ratio(out, num, den, metric):
                out.append(r)

    for row in rows:
        mode, case, name, action = row_key(row)
        if action == "convert" and name not in ("limit_loop", "dd_read"):
            metrics = ("wall_s", "user_s") if name.startswith("stcast") else ("wall_s",)
            add((mode, case, name, action), (mode, case, "limit_loop", action), *metrics)
        if action == "convert" and name != "stcast":
            metrics = ("wall_s",)
            if row["kind"] in ("dcp", "zero"):  # the report states CPU and memory against stcast
                metrics = ("wall_s", "user_s", "sys_s", "cpu_s", "peak_rss")
            add((mode, case, name, action), (mode, case, "stcast", action), *metrics)
        if name in ("stcast", "stcast_tuned"):
            add(
                (mode, case, name, action),
                (mode, case, "stcast_base", action),
                *TIMES[:3],
                "peak_rss",
            )
        if row["kind"] == "many" and action == "convert":
            few = next((r["case"] for r in rows if r["mode"] == mode and r["kind"] == "few"), None)
            if few:
                add(
                    (mode, case, name, action),
                    (mode, few, name, action),
                    "wall_s",
                    "user_s",
                    "sys_s",
                )
    return out


METRIC_NAMES = {"peak_rss": "peak RSS", "cpu_s": "CPU"}


def headline(r: dict[str, Any]) -> bool:
    """Whether the Ratios section lists r (the others are the tables' × columns)."""
    (_, case, a, _), (_, case_b, b, _) = r["num"], r["den"]
    return (
        case != case_b
        or ((" DCP " in case or " ZeRO-" in case) and b == "stcast")
        or a == "dd_read"
        or (a.startswith("stcast") and b == "limit_loop")
        or (a in ("stcast", "stcast_tuned") and b == "stcast_base")
        or (a == "stcast_reshard" and b == "stcast")
    )


def row_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return (row["mode"], row["case"], row["contender"], row["action"])


def find_ratio(
    ratios: list[dict[str, Any]],
    num: tuple[str, str, str, str],
    den: tuple[str, str, str, str],
    metric: str,
) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in ratios
            if (tuple(r["num"]), tuple(r["den"]), r["metric"]) == (num, den, metric)
        ),
        None,
    )


# ---------------------------------------------------------------- goals


def goals(
    rows: list[dict[str, Any]], ratios: list[dict[str, Any]], config: dict[str, Any]
) -> list[tuple[str, str]]:
    """Check the goals of the "Speed" issue that this run can decide: (PASS|FAIL|NOT RUN, what)."""
    at = {row_key(r): r for r in rows}
    out: list[tuple[str, str]] = []
    abba = config.get("order", "abba") == "abba"

    def ok_row(mode: str, case: str, name: str, action: str = "convert") -> dict[str, Any] | None:
        row = at.get((mode, case, name, action))
        return row if row and row.get("wall_s") else None

    def note(*rs: dict[str, Any]) -> str:
        n = min(r["wall_s"]["n"] for r in rs)
        text = f"{n} runs each" if n == max(r["wall_s"]["n"] for r in rs) else f"at least {n} runs"
        if n < GOAL_RUNS:
            text += f", the goal asks for {GOAL_RUNS}"
        if not abba:
            text += ", NOT in ABBA order"
        return text

    def per_round(r: dict[str, Any] | None) -> str:
        rounds = r and r.get("rounds")
        return (
            f"per round {rounds['min']:.3f}–{rounds['max']:.3f}×" if rounds else "no paired rounds"
        )

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    # 1. stcast against the bare loop, on the huge-page tmpfs.
    cases = [
        r["case"]
        for r in rows
        if r["mode"] == GOAL_MODE and r["kind"] == "size" and r["contender"] == "stcast"
    ]
    checked = False
    for case in cases:
        me, loop = ok_row(GOAL_MODE, case, "stcast"), ok_row(GOAL_MODE, case, "limit_loop")
        where = f"{GOAL_MODE} {case}"
        if loop and not me:
            checked = True
            status = at[(GOAL_MODE, case, "stcast", "convert")]["status"]
            out.append(("FAIL", f"{where}: stcast against limit_loop: stcast {status}"))
        if not me or not loop:
            continue
        checked = True
        num, den = row_key(me), row_key(loop)
        mw, lw = median(me, "wall_s"), median(loop, "wall_s")
        assert mw is not None and lw is not None
        out.append(
            (
                verdict(mw <= GOAL_WALL_X_LOOP * lw),
                f"{where}: stcast wall ≤ {GOAL_WALL_X_LOOP:g}× limit_loop's: {mw / lw:.3f}× "
                f"({mw:.3f} s vs {lw:.3f} s; {per_round(find_ratio(ratios, num, den, 'wall_s'))}; "
                f"{note(me, loop)}; numeric counts on)",
            )
        )
        mu, lu = median(me, "user_s"), median(loop, "user_s")
        assert mu is not None and lu is not None
        bound = GOAL_USER_X_LOOP * lu + GOAL_USER_START_S
        out.append(
            (
                verdict(mu <= bound),
                f"{where}: stcast user CPU ≤ {GOAL_USER_X_LOOP:g}× limit_loop's + "
                f"{GOAL_USER_START_S:g} s: {mu:.3f} s vs {bound:.3f} s (limit_loop {lu:.3f} s; "
                f"{mu / lu if lu else float('inf'):.3f}×, "
                f"{per_round(find_ratio(ratios, num, den, 'user_s'))}; {note(me, loop)})",
            )
        )
    if not checked:
        out.append(
            (
                "NOT RUN",
                f"stcast wall and user CPU against limit_loop's: no {GOAL_MODE} run of both "
                f"(--modes {GOAL_MODE} --contenders stcast,limit_loop)",
            )
        )

    # 2. Many small tensors against few large ones (and inspect, verify).
    many_modes = list(dict.fromkeys(r["mode"] for r in rows if r["kind"] == "many"))
    mode = GOAL_MODE if GOAL_MODE in many_modes else (many_modes[0] if many_modes else None)
    if mode is None:
        out.append(("NOT RUN", "many tensors against few: --many-tensors not given"))
    else:
        where = mode + ("" if mode == GOAL_MODE else f" (not {GOAL_MODE})")
        mk = next(r["case"] for r in rows if r["mode"] == mode and r["kind"] == "many")
        fk = next((r["case"] for r in rows if r["mode"] == mode and r["kind"] == "few"), "")
        conv, conv_few = ok_row(mode, mk, "stcast"), ok_row(mode, fk, "stcast")
        if conv and conv_few:
            mw, fw = median(conv, "wall_s"), median(conv_few, "wall_s")
            assert mw is not None and fw is not None
            r = find_ratio(ratios, row_key(conv), row_key(conv_few), "wall_s")
            out.append(
                (
                    verdict(mw <= GOAL_MANY_X_FEW * fw),
                    f"{where}: convert {mk} wall ≤ {GOAL_MANY_X_FEW:g}× {fk}'s: {mw / fw:.3f}× "
                    f"({mw:.3f} s vs {fw:.3f} s; {per_round(r)}; {note(conv, conv_few)})",
                )
            )
            count = int(mk.split(" ×")[0])  # the case is named "COUNT × SIZE" (many_cases)
            per = (mw - fw) / count
            out.append(
                (
                    verdict(per <= GOAL_PER_TENSOR_S),
                    f"{where}: convert {mk}: the cost per tensor over {fk}'s wall ≤ "
                    f"{GOAL_PER_TENSOR_S * 1e6:g} µs: {per * 1e6:.2f} µs "
                    f"(({mw:.3f} s − {fw:.3f} s) / {count:,})",
                )
            )
        else:
            out.append(("FAIL", f"{where}: convert {mk} against {fk}: a side did not succeed"))
        head = next(
            r["header_bytes"]
            for r in rows
            if r["mode"] == mode and r["case"] == mk and r["action"] == "convert"
        )
        for action, limit in (("inspect", GOAL_INSPECT_S), ("verify", GOAL_VERIFY_S)):
            row = ok_row(mode, mk, "stcast", action)
            if row is None:
                status = at.get((mode, mk, "stcast", action), {}).get("status", "not run")
                out.append(("FAIL", f"{where}: stcast {action} {mk}: {status}"))
                continue
            wall = median(row, "wall_s")
            assert wall is not None
            out.append(
                (
                    verdict(wall <= limit),
                    f"{where}: stcast {action}{' --json' if action == 'inspect' else ''} {mk} "
                    f"wall ≤ {limit:g} s: {wall:.3f} s ({fmt_spread(row['wall_s'], '.3f')}; "
                    f"{note(row)})",
                )
            )
        for action in GOAL_MANY_RSS_ACTIONS:
            row = at.get((mode, mk, "stcast", action))
            rss = median(row, "peak_rss")
            if row is None or rss is None:
                continue
            # 4× the bytes of every header the action reads: verify reads SRC's and DST's.
            read = row.get("header_bytes") or head
            bound = GOAL_MANY_RSS_BASE + GOAL_MANY_RSS_PER_HEADER_BYTE * read
            whose = "SRC's and DST's headers'" if read != head else "header's"
            out.append(
                (
                    verdict(rss <= bound),
                    f"{where}: stcast {action} {mk} peak RSS ≤ {fmt_bytes(GOAL_MANY_RSS_BASE)} + "
                    f"{GOAL_MANY_RSS_PER_HEADER_BYTE}× the {whose} {read:,} bytes = "
                    f"{fmt_bytes(bound)}: {fmt_mem(row['peak_rss'])}",
                )
            )

    # 3. On disk, cold: stcast against dd's read rate, and its RSS.
    cold = [
        r
        for r in rows
        if r["mode"] == "cold" and r["contender"] == "stcast" and r["action"] == "convert"
    ]
    if not cold:
        out.append(("NOT RUN", f"cold: stcast ≥ {GOAL_COLD_X_DD:g}× dd's read rate: no cold run"))
    for me in cold:
        where = f"cold {me['case']}"
        dd = ok_row("cold", me["case"], "dd_read")
        if me.get("wall_s") and dd:
            mw, dw = median(me, "wall_s"), median(dd, "wall_s")
            assert mw is not None and dw is not None
            r = find_ratio(ratios, row_key(dd), row_key(me), "wall_s")
            out.append(
                (
                    verdict(dw / mw >= GOAL_COLD_X_DD),
                    f"{where}: stcast's input rate ≥ {GOAL_COLD_X_DD:g}× dd's read rate: "
                    f"{dw / mw:.3f}× ({me['input_bytes'] / mw / 1e6:.0f} MB/s vs "
                    f"{dd['input_bytes'] / dw / 1e6:.0f} MB/s; {per_round(r)}; {note(me, dd)})",
                )
            )
        elif dd:
            out.append(("FAIL", f"{where}: stcast against dd: stcast {me['status']}"))
        else:
            out.append(("NOT RUN", f"{where}: stcast against dd: no successful dd_read run"))
        rss = median(me, "peak_rss")
        if rss:
            out.append(
                (
                    verdict(rss <= GOAL_COLD_RSS),
                    f"{where}: stcast peak RSS ≤ {fmt_bytes(GOAL_COLD_RSS)}: "
                    f"{fmt_mem(me['peak_rss'])}",
                )
            )

    # 4. Nothing slower than the baseline build.
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for me in rows:
        base = ok_row(me["mode"], me["case"], "stcast_base", me["action"])
        if me["contender"] == "stcast" and me.get("wall_s") and base:
            pairs.append((me, base))
    if not pairs:
        out.append(("NOT RUN", "nothing slower than before: no --baseline runs"))

    # 5. Re-sharding costs no more than a plain conversion of the same input.
    resharded = [
        (me, plain)
        for me in rows
        if me["contender"] == "stcast_reshard" and me["action"] == "convert"
        for plain in [ok_row(me["mode"], me["case"], "stcast")]
        if plain
    ]
    if not resharded:
        out.append(("NOT RUN", "re-sharding against a plain conversion: no --reshard runs"))
    for me, plain in resharded:
        where = f"{me['mode']} {me['case']}"
        if not me.get("wall_s"):
            out.append(("FAIL", f"{where}: stcast_reshard {me['status']}"))
            continue
        mw, pw = median(me, "wall_s"), median(plain, "wall_s")
        assert mw is not None and pw is not None
        r = find_ratio(ratios, row_key(me), row_key(plain), "wall_s")
        out.append(
            (
                verdict(mw <= GOAL_RESHARD_X_PLAIN * pw),
                f"{where}: re-sharding (stcast_reshard) wall ≤ {GOAL_RESHARD_X_PLAIN:g}× a plain "
                f"conversion's: {mw / pw:.3f}× ({mw:.3f} s vs {pw:.3f} s; {per_round(r)}; "
                f"peak RSS {fmt_mem(me['peak_rss'])} vs {fmt_mem(plain['peak_rss'])}; "
                f"{note(me, plain)})",
            )
        )
    # 6. DCP folders: stcast's memory, its speed against the torch path, the same tensors.
    dcp = [r for r in rows if r["kind"] == "dcp" and r["contender"] == "stcast"]
    if not dcp:
        out.append(("NOT RUN", "DCP folders against the torch path: no --dcp-sizes runs"))
    for me in dcp:
        where = f"{me['mode']} {me['case']}"
        if me["action"] != "convert":
            continue
        meta = me.get("header_bytes") or 0
        rss = median(me, "peak_rss")
        if not me.get("wall_s") or rss is None:
            out.append(("FAIL", f"{where}: stcast {me['status']}"))
            continue
        bound = GOAL_DCP_RSS_BASE + GOAL_DCP_RSS_PER_METADATA_BYTE * meta
        out.append(
            (
                verdict(me["peak_rss"]["max"] <= bound),
                f"{where}: stcast peak RSS ≤ {fmt_bytes(GOAL_DCP_RSS_BASE)} + "
                f"{GOAL_DCP_RSS_PER_METADATA_BYTE}× the .metadata's {meta:,} bytes = "
                f"{fmt_bytes(bound)} (every run): {fmt_mem(me['peak_rss'])}",
            )
        )
        for peer in ("torch_dcp", "torch_dcp_inmem"):
            row = at.get((me["mode"], me["case"], peer, "convert"))
            if row is None:
                continue
            if not row.get("wall_s"):
                out.append(("NOT RUN", f"{where}: stcast against {peer}: {peer} {row['status']}"))
                continue
            mw, pw = median(me, "wall_s"), median(row, "wall_s")
            assert mw is not None and pw is not None
            r = find_ratio(ratios, row_key(row), row_key(me), "wall_s")
            rc = find_ratio(ratios, row_key(row), row_key(me), "cpu_s")
            goal = peer == "torch_dcp"  # the path users are told to take; inmem is shown
            out.append(
                (
                    verdict(pw >= GOAL_DCP_X_TORCH * mw) if goal else "INFO",
                    f"{where}: stcast ≥ {GOAL_DCP_X_TORCH:g}× faster than {peer} (wall): "
                    f"{pw / mw:.2f}× ({mw:.3f} s vs {pw:.3f} s; {per_round(r)}"
                    + (f"; CPU {rc['ratio']:.2f}×" if rc else "")
                    + f"; peak RSS {fmt_mem(me['peak_rss'])} vs {fmt_mem(row['peak_rss'])}; "
                    f"{note(me, row)})",
                )
            )
            same = row.get("same_as_stcast") or []
            if same:
                out.append(
                    (
                        verdict(all(same)),
                        f"{where}: {peer}'s output holds stcast's tensors bit for bit (NaN "
                        "payloads aside; round 1)",
                    )
                )
        verified = me.get("verified") or []
        if verified:
            out.append((verdict(all(verified)), f"{where}: `stcast verify --key model` passes"))
    # 7. ZeRO folders: the same, against DeepSpeed's own consolidation.
    zero = [r for r in rows if r["kind"] == "zero" and r["contender"] == "stcast"]
    if not zero:
        out.append(("NOT RUN", "ZeRO folders against the torch path: no --zero-sizes runs"))
    for me in zero:
        where = f"{me['mode']} {me['case']}"
        if me["action"] != "convert":
            continue
        pickles = me.get("header_bytes") or 0
        rss = median(me, "peak_rss")
        peer = at.get((me["mode"], me["case"], "torch_zero", "convert"))
        if me["status"].startswith(ZERO_NOT_RUN):
            theirs = ""
            if peer and peer.get("wall_s"):
                theirs = (
                    f" (torch_zero: wall {fmt_spread(peer['wall_s'], '.2f')} s, "
                    f"CPU {fmt_spread(peer['cpu_s'], '.2f')} s, "
                    f"peak RSS {fmt_mem(peer['peak_rss'])})"
                )
            out.append(("NOT RUN", f"{where}: {ZERO_NOT_RUN}{theirs}"))
            continue
        if not me.get("wall_s") or rss is None:
            out.append(("FAIL", f"{where}: stcast {me['status']}"))
            continue
        bound = GOAL_ZERO_RSS_BASE + GOAL_ZERO_RSS_PER_PICKLE_BYTE * pickles
        out.append(
            (
                verdict(me["peak_rss"]["max"] <= bound),
                f"{where}: stcast peak RSS ≤ {fmt_bytes(GOAL_ZERO_RSS_BASE)} + "
                f"{GOAL_ZERO_RSS_PER_PICKLE_BYTE}× the pickles' {pickles:,} bytes = "
                f"{fmt_bytes(bound)} (every run): {fmt_mem(me['peak_rss'])}",
            )
        )
        if peer is None:
            continue
        if not peer.get("wall_s"):
            out.append(("NOT RUN", f"{where}: stcast against torch_zero: {peer['status']}"))
            continue
        mw, pw = median(me, "wall_s"), median(peer, "wall_s")
        assert mw is not None and pw is not None
        r = find_ratio(ratios, row_key(peer), row_key(me), "wall_s")
        rc = find_ratio(ratios, row_key(peer), row_key(me), "cpu_s")
        out.append(
            (
                verdict(pw >= GOAL_ZERO_X_TORCH * mw),
                f"{where}: stcast ≥ {GOAL_ZERO_X_TORCH:g}× faster than torch_zero (wall): "
                f"{pw / mw:.2f}× ({mw:.3f} s vs {pw:.3f} s; {per_round(r)}"
                + (f"; CPU {rc['ratio']:.2f}×" if rc else "")
                + f"; peak RSS {fmt_mem(me['peak_rss'])} vs {fmt_mem(peer['peak_rss'])}; "
                f"{note(me, peer)})",
            )
        )
        same = peer.get("same_as_stcast") or []
        if same:
            out.append(
                (
                    verdict(all(same)),
                    f"{where}: torch_zero's output holds stcast's tensors bit for bit (NaN "
                    "payloads aside; round 1)",
                )
            )
        verified = me.get("verified") or []
        if verified:
            out.append((verdict(all(verified)), f"{where}: `stcast verify` passes"))
    for me, base in pairs:
        mw, bw = median(me, "wall_s"), median(base, "wall_s")
        assert mw is not None and bw is not None
        r = find_ratio(ratios, row_key(me), row_key(base), "wall_s")
        ru = find_ratio(ratios, row_key(me), row_key(base), "user_s")
        user = f"; user CPU {ru['ratio']:.3f}×" if ru else ""
        out.append(
            (
                verdict(mw <= GOAL_NOT_SLOWER_X * bw),
                f"{me['mode']} {me['case']}: {label('stcast', me['action'])} wall ≤ "
                f"{GOAL_NOT_SLOWER_X:g}× stcast_base's: {mw / bw:.3f}× ({mw:.3f} s vs {bw:.3f} s; "
                f"{per_round(r)}{user}; {note(me, base)})",
            )
        )
    return out


RSS_TARGET = 64 * MiB


def targets(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    """Check the targets of issue 3 that this run's rows can decide: (holds, what)."""
    at = {row_key(r): r for r in rows}
    out: list[tuple[bool, str]] = []

    def wall(mode: str, case: str, name: str) -> float | None:
        row = at.get((mode, case, name, "convert"))
        return median(row, "wall_s") if row and row["status"] == "ok" else None

    me = wall("tmpfs", "4 GiB", "stcast")
    if me:
        for name, goal, text in (
            ("limit_loop", 1.1, "stcast wall <= 1.1x limit_loop"),
            ("np_convert", 1.8, "stcast >= 1.8x faster than np_convert"),
            ("torch_path", 5.0, "stcast >= 5x faster than torch_path"),
        ):
            other = wall("tmpfs", "4 GiB", name)
            if other is None:
                continue
            x = me / other if name == "limit_loop" else other / me
            ok = x <= goal if name == "limit_loop" else x >= goal
            line = f"tmpfs 4 GiB: {text}: {x:.2f}x ({me:.2f} s vs {other:.2f} s)"
            floor = wall("tmpfs", "4 GiB", "limit_loop")
            if name != "limit_loop" and floor:
                # What no converter here could beat: the bare loop's own ratio.
                line += f"; limit_loop itself: {other / floor:.2f}x"
            out.append((ok, line))
    for r in rows:
        if (r["contender"], r["action"]) != ("stcast", "convert") or r["status"] != "ok":
            continue
        if r["mode"] in ("hot", "cold") and r["kind"] == "size":
            rss = r["peak_rss"]["max"]
            text = f"{r['mode']} {r['case']}: stcast peak RSS (max) {fmt_bytes(rss)} <= 64 MiB"
            out.append((rss <= RSS_TARGET, text))
    for r in rows:
        if (r["contender"], r["action"], r["mode"]) != ("stcast", "convert", "cgroup"):
            continue
        limited, cold = median(r, "wall_s"), wall("cold", r["case"], "stcast")
        verified = r.get("verified") or []
        what = f"cgroup {r['case']} under {fmt_bytes(r['mem_limit'])}: stcast"
        out.append((r["status"] == "ok", f"{what} succeeds ({r['status']})"))
        if verified:
            out.append((all(verified), f"{what} output verified bit-exact"))
        if limited and cold:
            x = limited / cold
            text = f"{what} wall <= 1.5x unlimited cold: {x:.2f}x ({limited:.2f} s vs {cold:.2f} s)"
            out.append((x <= 1.5, text))
    return out


# ---------------------------------------------------------------- reporting


def machine_facts(cli: list[str] | None) -> dict[str, Any]:
    meminfo_words = Path("/proc/meminfo").read_text().split()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    facts: dict[str, Any] = {
        "nproc": len(os.sched_getaffinity(0)),
        "ram_gib": round(int(meminfo_words[meminfo_words.index("MemTotal:") + 1]) / GiB * 1024, 1),
        "kernel": platform.release(),
        "cpu": cpu,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "stcast": version(cli),
    }
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    for name in ("enabled", "shmem_enabled"):
        with contextlib.suppress(OSError):
            facts[f"thp_{name}"] = (thp / name).read_text().strip()
    return facts


def version(cli: list[str] | None) -> str | None:
    if not cli:
        return None
    try:
        done = subprocess.run([*cli, "--version"], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() or done.stderr.strip()


def start_up(argv: list[str], times: int = 5) -> dict[str, float]:
    """Median wall and user CPU of starting argv (e.g. `stcast --version`): what a CLI pays
    before any work."""
    walls, users = [], []
    for _ in range(times):
        reset_peak_rss()
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, _, usage = os.wait4(proc.pid, 0)
        walls.append(time.perf_counter() - t0)
        users.append(usage.ru_utime)
    return {"wall_s": statistics.median(walls), "user_s": statistics.median(users)}


def fmt_bytes(n: float | None) -> str:
    if not n:
        return "–"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def fmt_size(n: int) -> str:
    """Tensor sizes: 1 KiB, 1000 KiB, 1 MiB."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (1024, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def fmt(value: object, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def fmt_spread(stat: dict[str, float] | None, spec: str, scale: float = 1.0) -> str:
    """`median [min–max]`, or the median alone when all runs gave the same figure."""
    if not stat:
        return "–"
    m, lo, hi = (stat[k] / scale for k in ("median", "min", "max"))
    text = format(m, spec)
    if format(lo, spec) != format(hi, spec):
        text += f" [{lo:{spec}}–{hi:{spec}}]"
    return text


def fmt_mem(stat: dict[str, float] | None) -> str:
    if not stat:
        return "–"
    if stat["median"] >= GiB:
        return fmt_spread(stat, ".2f", GiB) + " GiB"
    return fmt_spread(stat, ".0f", MiB) + " MiB"


def fmt_ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "–"
    text = f"{r['ratio']:.3f}"
    rounds = r.get("rounds")
    if rounds and rounds["n"] > 1:
        text += f" [{rounds['min']:.3f}–{rounds['max']:.3f}]"
    return text


def load(avg: object) -> str:
    return " ".join(f"{x:.2f}" for x in avg)  # type: ignore[attr-defined]


def table(header: list[str], aligns: str, lines: list[list[str]]) -> list[str]:
    """A markdown table; columns that are "–" on every line are left out."""
    keep = [i for i in range(len(header)) if i < 4 or any(line[i] != "–" for line in lines)]
    out = ["| " + " | ".join(header[i] for i in keep) + " |"]
    out.append("|" + "|".join("---" if aligns[i] == "l" else "--:" for i in keep) + "|")
    out += ["| " + " | ".join(line[i] for i in keep) + " |" for line in lines]
    return out


def status_text(row: dict[str, Any]) -> str:
    text = str(row["status"])
    verified = row.get("verified") or []
    if verified:
        text += ", verified" if all(verified) else ", VERIFY FAILED"
    same = row.get("same_as_stcast") or []
    if same:
        text += ", = stcast's tensors" if all(same) else ", DIFFERS FROM STCAST"
    return text


def markdown(
    facts: dict[str, Any],
    config: dict[str, Any],
    rows: list[dict[str, Any]],
    ratios: list[dict[str, Any]] | None = None,
    checks: list[tuple[str, str]] | None = None,
) -> str:
    ratios = ratios if ratios is not None else all_ratios([], rows)
    checks = checks if checks is not None else goals(rows, ratios, config)
    isa = facts.get("stcast_isa")
    order = config.get("order", "cyclic")
    order_text = (
        "ABBA order (each round runs the contenders forward, the next one reversed)"
        if order == "abba"
        else "cyclic order (A B C A B C ...)"
    )
    lines = [
        "# stcast benchmark",
        "",
        f"- machine: {facts['nproc']} CPUs ({facts['cpu']}), {facts['ram_gib']} GiB RAM, "
        f"Linux {facts['kernel']}, load average {load(facts['loadavg_start'])} at start, "
        f"{load(facts.get('loadavg_end', facts['loadavg_start']))} at end",
        f"- python {facts['python']}, {facts['stcast'] or 'stcast not installed'}"
        + (f" ({isa}, {facts.get('stcast_threads')} threads)" if isa else "")
        + f", torch {facts.get('torch') or 'not installed'}",
        f"- command: `{config['command']}`",
    ]
    for c in config.get("contenders", []):
        if c["name"] == "stcast_base":
            lines.append(f"- stcast_base: `{shlex.join(c['cli'])}` ({facts.get('stcast_base')})")
        elif c["name"] == "stcast_tuned":
            lines.append(f"- stcast_tuned: `stcast.convert(..., tuning={c['argv'][-1]})`")
        elif c["name"] == "stcast_reshard":
            lines.append(
                f"- stcast_reshard: `stcast convert SRC DST {shlex.join(c['argv'][-3:-1])}`"
            )
    starts = facts.get("start_up") or {}
    if starts:
        lines.append(
            "- start-up (median of 5): "
            + ", ".join(
                f"`{k}` {v['wall_s']:.3f} s wall, {v['user_s']:.3f} s user"
                for k, v in starts.items()
            )
        )
    huge = facts.get("hugetmpfs")
    if huge:
        lines.append(
            f"- hugetmpfs: `{huge.get('options')}`; ShmemHugePages after staging the inputs: "
            + ", ".join(
                f"{fmt_bytes(x['shmem_huge_pages'])} with {x['inputs']} ({fmt_bytes(x['bytes'])})"
                for x in huge.get("staged", [])
            )
            + f" (THP {facts.get('thp_enabled')}, shmem {facts.get('thp_shmem_enabled')})"
        )
    lines += [
        f"- {config['repeats']} round(s)"
        + (
            f" ({config['tmpfs_repeats']} on tmpfs and hugetmpfs)"
            if config.get("tmpfs_repeats")
            else ""
        )
        + f", in {order_text}"
        + (
            f", after {config['warmup']} uncounted warm-up round(s) in " + ", ".join(WARM_MODES)
            if config.get("warmup")
            else ""
        )
        + "; each output deleted right after its run. Figures: median "
        "[min–max] over the runs that succeeded (memory: over all runs); GB/s = input bytes / "
        "wall / 1e9; × columns: ratio of the medians of wall [min–max of the per-round "
        "ratios]. Peak RSS is ru_maxrss, which cannot read below the bench's own RSS "
        f"({fmt_bytes(facts['rss_floor'])} at start, at most "
        f"{fmt_bytes(facts.get('rss_floor_max') or facts['rss_floor'])} at a spawn); peak anon "
        f"is sampled every {SAMPLE_S * 1000:.0f} ms.",
        "",
        "## Goals",
        "",
    ]
    lines += [f"- {state}: {text}" for state, text in checks] or ["- (none decided by this run)"]

    at = {(tuple(r["num"]), tuple(r["den"]), r["metric"]): r for r in ratios}
    names = {r["contender"] for r in rows}
    refs = [n for n in ("limit_loop", "stcast", "stcast_base") if n in names]

    group_size: dict[tuple[str, str, str], int] = {}
    for r in rows:
        group = (r["mode"], r["case"], r["action"])
        group_size[group] = group_size.get(group, 0) + 1

    def x(row: dict[str, Any], ref: str) -> str:
        key = row_key(row)
        if ref == row["contender"]:
            alone = group_size[(key[0], key[1], key[3])] == 1
            return "1" if row.get("wall_s") and not alone else "–"
        return fmt_ratio(at.get((key, (key[0], key[1], ref, key[3]), "wall_s")))

    header = [
        "mode",
        "case",
        "contender",
        "status",
        "wall s",
        "user s",
        "sys s",
        "GB/s",
        "peak RSS",
        "peak anon",
        "mem limit",
        "cgroup peak",
    ] + [f"× {ref}" for ref in refs]

    def line(r: dict[str, Any]) -> list[str]:
        return [
            r["mode"],
            r["case"],
            label(r["contender"], r["action"]),
            status_text(r),
            fmt_spread(r["wall_s"], ".3f"),
            fmt_spread(r["user_s"], ".3f"),
            fmt_spread(r["sys_s"], ".3f"),
            fmt_spread(r.get("gb_per_s"), ".2f"),
            fmt_mem(r["peak_rss"]),
            fmt_mem(r["peak_anon"]),
            fmt_bytes(r["mem_limit"]),
            fmt_mem(r["cgroup_peak"]),
        ] + [x(r, ref) for ref in refs]

    sized = [r for r in rows if r["kind"] == "size"]
    if sized:
        lines += ["", "## Conversions", ""]
        lines += table(header, "llll" + "r" * (len(header) - 4), [line(r) for r in sized])
    bins = [r for r in rows if r["kind"] == "bin"]
    if bins:
        lines += [
            "",
            "## PyTorch checkpoints",
            "",
            "The size case's tensors as a `.bin` (torch's zip format, made by gen_bin.py) to bf16 "
            "safetensors: stcast against `torch.load(mmap=True)` + `.to(bfloat16)` + `save_file` "
            "(torch_load_mmap) and `torch.load` + the same (torch_load), peers/torch_bin.py.",
            "",
        ]
        lines += table(header, "llll" + "r" * (len(header) - 4), [line(r) for r in bins])
    dcps = [r for r in rows if r["kind"] == "dcp"]
    if dcps:
        meta = next((r["header_bytes"] for r in dcps if r["contender"] == "stcast"), 0)
        lines += [
            "",
            "## DCP checkpoints",
            "",
            "torch.distributed.checkpoint folders made by gen_dcp.py: the size case's model "
            f"(F32) in FSDP row bands over {config.get('dcp_ranks', '?')} ranks, saved with "
            "Adam's exp_avg and exp_avg_sq (`{'model': ..., 'optim': ...}`: the folder is "
            f"{DCP_FILE_FACTOR}× the model; `.metadata` {meta:,} bytes; GB/s counts the whole "
            "folder). stcast: `convert SRC DST --key model`; torch_dcp: `dcp_to_torch_save(SRC, "
            "TMP)` + `torch.load(TMP)['model']` + `.to(bfloat16)` + `save_file` (what users are "
            "told to do; TMP beside DST); torch_dcp_inmem: `_load_state_dict_from_keys({'model'}, "
            "checkpoint_id=SRC)` + the same, no temporary file (peers/torch_dcp.py). Each peer's "
            "round-1 output is compared with stcast's round-1 output (same_tensors.py).",
            "",
        ]
        lines += table(header, "llll" + "r" * (len(header) - 4), [line(r) for r in dcps])
    zeros = [r for r in rows if r["kind"] == "zero"]
    if zeros:
        pickles = next((r["header_bytes"] for r in zeros if r["header_bytes"]), 0)
        stage = config.get("zero_stage", "?")
        factor = ZERO_FILE_FACTOR.get(stage, "?") if isinstance(stage, int) else "?"
        lines += [
            "",
            "## ZeRO checkpoints",
            "",
            f"DeepSpeed ZeRO-{stage} folders made by gen_zero.py (`latest` + `global_step1/`, "
            "laid out as DeepSpeed 0.19.8 writes them): the size case's model (F32) trained "
            f"over {config.get('zero_ranks', '?')} data-parallel ranks, the fp32 partitions "
            "with Adam's exp_avg and exp_avg_sq beside them"
            + (", the whole module in mp_rank_00_model_states.pt" if stage == 2 else "")
            + f" (the folder is {factor}× the model; the pickles {pickles:,} bytes; GB/s counts "
            "the whole folder). stcast: `convert SRC DST`; torch_zero: "
            "`get_fp32_state_dict_from_zero_checkpoint(SRC)` + `.to(bfloat16)` + `save_file` "
            "(what users are told to do; peers/torch_zero.py). torch_zero's round-1 output is "
            "compared with stcast's round-1 output (same_tensors.py). A stcast without the "
            f'ZeRO reader is shown as "{ZERO_NOT_RUN}".',
            "",
        ]
        lines += table(header, "llll" + "r" * (len(header) - 4), [line(r) for r in zeros])
    many = [r for r in rows if r["kind"] in ("many", "few")]
    if many:
        head = next(
            (r["header_bytes"] for r in many if r["kind"] == "many" and r["action"] == "convert"), 0
        )
        bound = GOAL_MANY_RSS_BASE + GOAL_MANY_RSS_PER_HEADER_BYTE * head
        lines += [
            "",
            "## Many tensors",
            "",
            "The same data in many small or few large F32 tensors; header bytes: "
            + ", ".join(
                f"{r['case']} {r['header_bytes']:,}"
                for r in {r["case"]: r for r in many if r["action"] == "convert"}.values()
            )
            + f"; the RSS bound {fmt_bytes(GOAL_MANY_RSS_BASE)} + {GOAL_MANY_RSS_PER_HEADER_BYTE}× "
            f"the header is {fmt_bytes(bound)} (verify's: 4× SRC's and DST's headers). "
            "`inspect --json` writes to /dev/null; `verify` "
            "checks the output of a convert made (untimed) before its rounds.",
            "",
        ]
        lines += table(header, "llll" + "r" * (len(header) - 4), [line(r) for r in many])
    listed = [r for r in ratios if headline(r)]
    if listed:
        lines += [
            "",
            "## Ratios",
            "",
            "Ratio of the medians [min–max of the per-round ratios, runs paired by round].",
            "",
        ]
        body = []
        for r in listed:
            (mode, case, a, action), (_, case_b, b, _) = r["num"], r["den"]
            what = label(a, action) + (f" {case}" if case != case_b else "")
            other = label(b, action) + (f" {case_b}" if case != case_b else "")
            body.append(
                [
                    mode,
                    case if case == case_b else "–",
                    f"{what} / {other}",
                    METRIC_NAMES.get(r["metric"], r["metric"].removesuffix("_s")),
                    fmt_ratio(r),
                    str((r.get("rounds") or {}).get("n", 0)),
                ]
            )
        lines += table(["mode", "case", "ratio", "figure", "×", "rounds"], "llllrr", body)
    if config.get("skipped"):
        lines += ["", "Not run (`--peers-up-to`, `--peer-modes`): " + ", ".join(config["skipped"])]
    old = targets(rows)
    if old:
        lines += ["", "## Targets (issue 3)", ""]
        lines += [f"- {'PASS' if ok else 'MISS'}: {text}" for ok, text in old]
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write throughput.png (GB/s, median and min–max, per contender per mode and case),
    cpu.png (user and sys CPU) and rss.png (RSS over time of the median run)."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): no plots")
        return []
    conv = [r for r in rows if r["action"] == "convert" and r["contender"] != "dd_read"]
    if not conv:
        return []
    names = list(dict.fromkeys(r["contender"] for r in conv))
    groups = list(dict.fromkeys((r["mode"], r["case"]) for r in conv))
    at = {(r["mode"], r["case"], r["contender"]): r for r in conv}
    width = 0.8 / max(1, len(names))
    written = []

    def bars(metric: str, ylabel: str, title: str, filename: str) -> None:
        fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups) + 3), 4.5))
        for i, name in enumerate(names):
            for j, group in enumerate(groups):
                row = at.get((*group, name))
                if row is None:
                    continue
                xpos = j + (i - (len(names) - 1) / 2) * width
                if metric == "cpu":
                    user, sys_ = row.get("user_s"), row.get("sys_s")
                    u = user["median"] if user else 0.0
                    s = sys_["median"] if sys_ else 0.0
                    ax.bar(xpos, u, width, color=f"C{i}", label=name if j == 0 else None)
                    ax.bar(xpos, s, width, bottom=u, color=f"C{i}", alpha=0.45, hatch="//")
                    continue
                stat = row.get(metric)
                value = stat["median"] if stat else 0.0
                err = [[value - stat["min"]], [stat["max"] - value]] if stat else None
                ax.bar(
                    xpos,
                    value,
                    width,
                    yerr=err,
                    capsize=2,
                    color=f"C{i}",
                    label=name if j == 0 else None,
                )
                text = f"{value:.2f}" if stat else row["status"].split(" ")[0]
                ax.annotate(text, (xpos, value), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), [f"{m}\n{c}" for m, c in groups], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)
        written.append(out / filename)

    bars(
        "gb_per_s",
        "input GB/s (higher is better)",
        "F32 -> BF16 throughput (median, min–max)",
        "throughput.png",
    )
    bars(
        "cpu", "CPU seconds (user solid, sys hatched)", "F32 -> BF16 CPU time (medians)", "cpu.png"
    )

    sized = [
        g for g in groups if any(r["kind"] == "size" for r in conv if (r["mode"], r["case"]) == g)
    ]
    mode, case = max(sized or groups, key=lambda g: (g[0] == groups[0][0], at_size(rows, g)))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(names):
        rs = [r for r in runs if r.key == (mode, case, name, "convert")]
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
    ax.set_title(f"memory over time, {mode}, {case} input (median run)")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=120)
    plt.close(fig)
    written.append(out / "rss.png")
    return written


def at_size(rows: list[dict[str, Any]], group: tuple[str, str]) -> float:
    return max((r["size_gib"] for r in rows if (r["mode"], r["case"]) == group), default=0.0)


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
        if name not in CONTENDERS + EXTRA or not size:
            raise SystemExit(
                f"--cap {item!r}: expected CONTENDER=SIZE, CONTENDER in {CONTENDERS + EXTRA}"
            )
        caps[name] = parse_bytes(size)
    return caps


def split(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python benches/compare.py --quick\n"
        "  python benches/compare.py --modes hugetmpfs --sizes 4 --repeats 9 "
        "--contenders stcast,limit_loop\n"
        "  python benches/compare.py --modes hugetmpfs --sizes '' --many-tensors --repeats 9\n"
        "  python benches/compare.py --modes cold --sizes 4 --contenders stcast,dd_read\n"
        "  python benches/compare.py --modes hot --sizes '' --bin-sizes 4 "
        "--contenders stcast,torch_load_mmap,torch_load\n"
        "  python benches/compare.py --modes hugetmpfs --sizes 4 --contenders stcast "
        "--baseline /work/venv-base/bin/python\n"
        "  /work/venv-torch/bin/python benches/compare.py --modes hugetmpfs --sizes '' "
        "--dcp-sizes 1 --repeats 5 --contenders stcast,torch_dcp,torch_dcp_inmem "
        "--stcast /work/venv-bench/bin/stcast\n"
        "  /work/venv-ds/bin/python benches/compare.py --modes hugetmpfs --sizes '' "
        "--zero-sizes 1 --repeats 3 --contenders stcast,torch_zero "
        "--stcast /work/venv-zero/bin/stcast\n"
        "  python benches/compare.py --modes hugetmpfs --sizes 4 --repeats 9 --contenders "
        "stcast --reshard 1GB\n",
    )
    ap.add_argument(
        "--sizes", default="1,4", help="input sizes in GiB, comma-separated ('' for none)"
    )
    ap.add_argument(
        "--bin-sizes",
        default="",
        help="PyTorch checkpoint (.bin) sizes in GiB, comma-separated: stcast against "
        "torch_load_mmap and torch_load (default none; the issue's figure: 4)",
    )
    ap.add_argument(
        "--dcp-sizes",
        default="",
        help="DCP folder model sizes in GiB, comma-separated: the model sharded over "
        "--dcp-ranks ranks with Adam's state (3x the model); stcast --key model against "
        "torch_dcp and torch_dcp_inmem (default none)",
    )
    ap.add_argument(
        "--dcp-ranks", type=int, default=3, help="FSDP ranks of --dcp-sizes (default 3: uneven)"
    )
    ap.add_argument(
        "--zero-sizes",
        default="",
        help="DeepSpeed ZeRO folder model sizes in GiB, comma-separated: the model over "
        "--zero-ranks ranks at --zero-stage, with Adam's state; stcast against torch_zero "
        "(default none)",
    )
    ap.add_argument(
        "--zero-ranks", type=int, default=3, help="data-parallel ranks of --zero-sizes (default 3)"
    )
    ap.add_argument(
        "--zero-stage", type=int, default=2, choices=(2, 3), help="ZeRO stage (default 2)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="rounds per mode and case")
    ap.add_argument(
        "--tmpfs-repeats",
        type=int,
        default=None,
        metavar="N",
        help="rounds in tmpfs and hugetmpfs modes (default --repeats): the speed comparison, "
        f"and the cheapest modes to repeat (the goals ask for {GOAL_RUNS})",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="any of " + ",".join(MODES))
    ap.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="any of " + ",".join(CONTENDERS) + " (dd_read runs in cold mode only)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="untimed rounds before the counted ones in " + ", ".join(WARM_MODES) + " modes "
        "(default 1: the first runs in a fresh mount or after generating are outliers)",
    )
    ap.add_argument(
        "--order",
        choices=("abba", "cyclic"),
        default="abba",
        help="abba (default): each round forward, the next reversed (A B B A A B ...); "
        "cyclic: A B C A B C ...",
    )
    ap.add_argument(
        "--baseline",
        metavar="PYTHON|CMD",
        help="run a second stcast build as contender stcast_base, interleaved with stcast: a "
        "Python interpreter (its venv's stcast script), a CLI path, or a command such as "
        "'/work/venv-base/bin/python -m stcast'",
    )
    ap.add_argument(
        "--tuning",
        metavar="JSON",
        help="add contender stcast_tuned: stcast.convert(..., tuning=JSON) in a child, e.g. "
        '\'{"window_mib": 16, "write_behind": 2}\' (keys: window_mib, isa, populate, advise, '
        "write_behind, step_mib)",
    )
    ap.add_argument(
        "--reshard",
        metavar="SIZE",
        help="add contender stcast_reshard: convert with --max-shard-size SIZE into a folder, "
        "interleaved with stcast's plain conversion (the goal: 4 GiB into 1GB shards)",
    )
    ap.add_argument(
        "--many-tensors",
        action="store_true",
        help=f"add the many-tensors case: {MANY_COUNT} tensors of {fmt_size(MANY_BYTES)} against "
        f"{FEW_COUNT} holding the same data (convert; inspect --json and verify of the first), "
        "run by the stcast builds in the RAM modes of --modes (else the first mode)",
    )
    ap.add_argument("--many-modes", default=None, metavar="MODES", help="modes of --many-tensors")
    ap.add_argument("--many-count", type=int, default=MANY_COUNT, metavar="N")
    ap.add_argument("--many-bytes", type=int, default=MANY_BYTES, metavar="BYTES")
    ap.add_argument("--few-count", type=int, default=FEW_COUNT, metavar="N")
    ap.add_argument(
        "--many-repeats", type=int, default=None, metavar="N", help="default: the mode's rounds"
    )
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
        help="skip `stcast verify` of each stcast build's first output per mode and case",
    )
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only rewrite results.md and the plots in --out from this results.json",
    )
    ap.add_argument("--out", type=Path, default=HERE / "out")
    ap.add_argument("--stcast", default="stcast", help="the stcast CLI to measure (as --baseline)")
    # The peers live in benches/peers (the same contenders as the team's shared copies).
    ap.add_argument("--peers", type=Path, default=HERE / "peers")
    ap.add_argument("--tmpfs-dir", type=Path, default=Path("/dev/shm/stcast-bench"))
    ap.add_argument(
        "--hugetmpfs-dir",
        type=Path,
        default=Path("/var/tmp/stcast-bench-huge"),
        help="mount point of the huge-page tmpfs (mounted for the mode, unmounted after)",
    )
    ap.add_argument("--hugetmpfs-size", default="12g", help="its size= option")
    ap.add_argument(
        "--disk-dir",
        type=Path,
        default=Path("/var/tmp/stcast-bench"),
        help="disk modes' folder, and the cache of hugetmpfs inputs",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clean", action="store_true", help="delete the generated inputs at the end")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.25 GiB, 1 round, tmpfs only")
    ap.add_argument(
        "--pickle-memory",
        action="store_true",
        help="only the pickle-memory cases (gen_pickle_memory.py): medians of --repeats runs",
    )
    ap.add_argument("--pickle-dir", type=Path, default=Path("/var/tmp/stcast-bench/pickle"))
    ap.add_argument("--pickle-scale", type=float, default=1.0)
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="only the FP8 case: stcast --to fp8 / fp8-block and FP8 -> bf16 against "
        "model_free_ptq (gen_fp8.py, peers/model_free_ptq.py)",
    )
    ap.add_argument(
        "--packed",
        action="store_true",
        help="only the packed case: stcast's INT4 (W4A16) -> bf16 against compressed-tensors' "
        "dequantization (gen_w4a16.py, peers/ct_dequantize.py)",
    )
    ap.add_argument(
        "--gptoss",
        action="store_true",
        help="only the gpt-oss case: stcast's MXFP4 -> bf16 against transformers' dequantized "
        "load + save_pretrained (gen_gptoss.py, peers/tf_gptoss.py)",
    )
    ap.add_argument(
        "--fp8-python",
        default="/work/venv-llmc/bin/python",
        help="a Python with llmcompressor (the peers of --fp8 and --packed, and the checks)",
    )
    ap.add_argument(
        "--fp8-modes",
        default="hugetmpfs,hot",
        help="hugetmpfs and/or hot (--fp8, --packed, --gptoss)",
    )
    ap.add_argument("--fp8-tmpfs-dir", type=Path, default=Path("/mnt/fp8b"))
    ap.add_argument("--fp8-tmpfs-size", default="6g")
    args = ap.parse_args(argv)
    if args.pickle_memory:
        return args
    if args.fp8 or args.packed or args.gptoss:
        args.fp8_modes = split(args.fp8_modes)
        for m in args.fp8_modes:
            if m not in ("hugetmpfs", "hot"):
                ap.error(f"--fp8-modes: {m!r} is not hugetmpfs or hot")
        return args
    if args.quick:
        args.sizes, args.repeats, args.modes = "0.25", 1, "tmpfs"
    try:
        args.sizes = [float(s) for s in split(args.sizes)]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: expected GiB, comma-separated")
    try:
        args.bin_sizes = [float(s) for s in split(args.bin_sizes)]
    except ValueError:
        ap.error(f"--bin-sizes {args.bin_sizes!r}: expected GiB, comma-separated")
    try:
        args.dcp_sizes = [float(s) for s in split(args.dcp_sizes)]
    except ValueError:
        ap.error(f"--dcp-sizes {args.dcp_sizes!r}: expected GiB, comma-separated")
    if args.dcp_ranks < 1:
        ap.error("--dcp-ranks must be at least 1")
    try:
        args.zero_sizes = [float(s) for s in split(args.zero_sizes)]
    except ValueError:
        ap.error(f"--zero-sizes {args.zero_sizes!r}: expected GiB, comma-separated")
    if args.zero_ranks < 1:
        ap.error("--zero-ranks must be at least 1")
    args.modes = split(args.modes)
    if args.peer_modes is not None:
        args.peer_modes = split(args.peer_modes)
    args.contenders = [ALIASES.get(c, c) for c in split(args.contenders)]
    for m in args.modes + (args.peer_modes or []):
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {','.join(MODES)}")
    for c in args.contenders:
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; choose from {','.join(CONTENDERS)}")
    if (args.baseline or args.tuning or args.reshard) and "stcast" not in args.contenders:
        ap.error("--baseline, --tuning and --reshard need the contender stcast")
    if args.tuning is not None:
        try:
            args.tuning = json.loads(args.tuning)
        except ValueError as e:
            ap.error(f"--tuning: not JSON: {e}")
        if not isinstance(args.tuning, dict):
            ap.error("--tuning: expected a JSON object")
    if args.many_tensors:
        if args.many_modes is not None:
            args.many_modes = split(args.many_modes)
        else:
            ram = [m for m in args.modes if m in RAM_MODES]
            args.many_modes = ram or args.modes[:1]
        for m in args.many_modes:
            if m not in args.modes:
                ap.error(f"--many-modes: {m!r} is not in --modes")
    else:
        args.many_modes = []
    nothing = not (
        args.sizes or args.many_tensors or args.bin_sizes or args.dcp_sizes or args.zero_sizes
    )
    if nothing and not args.render:
        ap.error(
            "nothing to run: no --sizes, --bin-sizes, --dcp-sizes, --zero-sizes or --many-tensors"
        )
    args.mem_limit = parse_bytes(args.mem_limit)
    args.caps = parse_caps(args.cap)
    return args


def render(path: Path, out: Path) -> int:
    """Rewrite results.md and the plots from a results.json (e.g. after a report change)."""
    data = json.loads(path.read_text())
    runs = [Run.from_json(r) for r in data["runs"]]
    rows = summarize(runs)
    ratios = all_ratios(runs, rows)
    text = markdown(data["machine"], data["config"], rows, ratios)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    written = [out / "results.md", *plot(runs, rows, out)]
    print(text)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


class Bench:
    """One invocation: the contenders, the runs so far, and how to run a round."""

    def __init__(
        self, args: argparse.Namespace, contenders: list[Contender], facts: dict[str, Any]
    ):
        self.args, self.contenders, self.facts = args, contenders, facts
        self.runs: list[Run] = []
        self.skipped: list[str] = []
        self.inputs: list[Path] = []
        # (mode, case, contender): a stcast that refused the case's ZeRO folder; its later
        # runs of that case are recorded as not run, without starting it again
        self.refused: set[tuple[str, str, str]] = set()

    # -- where the inputs live

    def directory(self, mode: str) -> Path:
        if mode == "tmpfs":
            return self.args.tmpfs_dir
        if mode == "hugetmpfs":
            return self.args.hugetmpfs_dir
        return self.args.disk_dir

    def cache(self, mode: str, case: Case) -> Path:
        """Where case's input is generated for mode: hugetmpfs copies it from a cache that
        outlives its mount (the tmpfs one when it has the file, else the disk one)."""
        if mode != "hugetmpfs":
            return self.directory(mode)
        if (self.args.tmpfs_dir / case.filename(self.args.seed)).exists():
            return self.args.tmpfs_dir
        return self.args.disk_dir

    @contextlib.contextmanager
    def staged(self, mode: str, cases: list[Case]) -> Iterator[list[Path] | None]:
        """Yield the inputs of cases in mode's folder (None, said why, when they cannot
        run); in hugetmpfs they are copied in, and removed again afterwards."""
        directory = self.directory(mode)
        ram = parse_bytes(self.args.hugetmpfs_size) if mode == "hugetmpfs" else 0
        for case in cases:
            why = usable(mode, case, directory, self.cache(mode, case), self.args.seed, ram)
            if why:
                print(f"{mode} {case.name} skipped: {why}")
                yield None
                return
        srcs: list[Path] = []
        copies: list[Path] = []
        try:
            for case in cases:
                cached = cached_input(self.cache(mode, case), case, self.args.seed)
                self.inputs.append(cached)
                if mode == "hugetmpfs":
                    src = directory / cached.name
                    print(f"copying {cached} to {directory} ...", flush=True)
                    copies.append(src)
                    if cached.is_dir():  # a DCP folder
                        shutil.rmtree(src, ignore_errors=True)
                        shutil.copytree(cached, src)
                    else:
                        shutil.copyfile(cached, src)
                else:
                    src = cached
                srcs.append(src)
            if mode == "hugetmpfs":  # whether the mount gave the inputs huge pages
                huge = self.facts.setdefault("hugetmpfs", {})
                huge.setdefault("staged", []).append(
                    {
                        "inputs": " + ".join(c.name for c in cases),
                        "bytes": sum(path_bytes(src) for src in srcs),
                        "shmem_huge_pages": meminfo("ShmemHugePages"),
                    }
                )
            yield srcs
        finally:
            for src in copies:
                if src.is_dir():
                    shutil.rmtree(src, ignore_errors=True)
                else:
                    src.unlink(missing_ok=True)

    # -- who runs what

    def allowed(self, c: Contender, mode: str, case: Case) -> bool:
        if c.modes is not None and mode not in c.modes:
            return False
        if case.kind not in KINDS.get(c.name, (case.kind,)):
            return False
        if c.name in PEERS:
            why = None
            if self.args.peers_up_to is not None and case.size_gib > self.args.peers_up_to:
                why = "--peers-up-to"
            if self.args.peer_modes is not None and mode not in self.args.peer_modes:
                why = "--peer-modes"
            if why:
                print(f"{mode} {case.name}: {c.name} skipped ({why})")
                self.skipped.append(f"{c.name} at {mode} {case.name}")
                return False
        return True

    def repeats(self, mode: str) -> int:
        if mode in RAM_MODES and self.args.tmpfs_repeats:
            return int(self.args.tmpfs_repeats)
        return int(self.args.repeats)

    # -- the runs

    def size_case(self, mode: str, case: Case) -> None:
        with self.staged(mode, [case]) as srcs:
            if srcs is None:
                return
            jobs = [Job(c, case, srcs[0]) for c in self.contenders if self.allowed(c, mode, case)]
            try:
                self.rounds(mode, jobs, self.repeats(mode))
            finally:
                self.reference(srcs[0]).unlink(missing_ok=True)

    def reference(self, src: Path) -> Path:
        """Where stcast's first counted output of a DCP or ZeRO case is kept, for the peers'
        check."""
        return src.parent / f"reference-{os.getpid()}-stcast.safetensors"

    def many_tensors(self, mode: str) -> None:
        """Convert many small against few large tensors (ABBA), then inspect, then verify the
        many-tensors file; by every stcast build."""
        many, few = many_cases(self.args.many_count, self.args.many_bytes, self.args.few_count)
        builds = [c for c in self.contenders if c.kind in ("stcast", "api")]
        clis = [c for c in builds if c.kind == "stcast"]
        repeats = self.args.many_repeats or self.repeats(mode)
        if not builds:
            print(f"{mode} many tensors skipped: no stcast build among the contenders")
            return
        with self.staged(mode, [many, few]) as srcs:
            if srcs is None:
                return
            src, src_few = srcs
            jobs = [Job(c, case, s) for c in builds for case, s in ((many, src), (few, src_few))]
            self.rounds(mode, jobs, repeats)
            self.rounds(mode, [Job(c, many, src, "inspect") for c in clis], repeats)
            outputs: list[Path] = []
            try:
                verify_jobs = []
                for c in clis:
                    dst = self.directory(mode) / f"verify-{os.getpid()}-{c.name}.safetensors"
                    outputs.append(dst)
                    print(
                        f"[{mode} {many.name}] {c.name}: converting once for verify ...", flush=True
                    )
                    done = subprocess.run(  # its --json report (~70 MB) is not kept
                        c.command(src, dst), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
                    )
                    if done.returncode != 0 or not dst.exists():
                        print(f"    failed: {done.stderr.decode(errors='replace')[-500:]}")
                        continue
                    verify_jobs.append(Job(c, many, src, "verify", dst))
                self.rounds(mode, verify_jobs, repeats)
            finally:
                for dst in outputs:
                    dst.unlink(missing_ok=True)

    def rounds(self, mode: str, jobs: list[Job], repeats: int) -> None:
        """repeats rounds of jobs in ABBA (or cyclic) order, after the warm-up rounds."""
        if mode in WARM_MODES:
            for _ in range(self.args.warmup):
                for pos, job in enumerate(jobs):
                    self.execute(mode, job, -1, pos)  # not counted
        for rep in range(repeats):
            order = jobs if self.args.order == "cyclic" or rep % 2 == 0 else jobs[::-1]
            for pos, job in enumerate(order):
                self.runs.append(self.execute(mode, job, rep, pos))

    def execute(self, mode: str, job: Job, rep: int, pos: int) -> Run:
        c, case, args = job.contender, job.case, self.args
        if (mode, case.name, c.name) in self.refused:
            run = Run(mode, case.size_gib, c.name, rep, path_bytes(job.src), case.name, case.kind)
            run.action, run.position, run.status = job.action, pos, ZERO_NOT_RUN
            print(f"[{mode} {case.name} #{rep + 1}.{pos + 1}] {job.label:<18} {ZERO_NOT_RUN}")
            return run
        limit = args.caps.get(c.name) or (args.mem_limit if mode == "cgroup" else None)
        run = Run(
            mode=mode,
            size_gib=case.size_gib,
            contender=c.name,
            repeat=rep,
            input_bytes=path_bytes(job.src),
            case=case.name,
            kind=case.kind,
            action=job.action,
            position=pos,
            # The headers the run reads: verify reads DST's too (and holds both).
            header_bytes=header_bytes(job.src)
            + (header_bytes(job.target) if job.action == "verify" and job.target else 0),
        )
        scratch = job.src.parent / f"out-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        prepare(mode, job.src)
        try:
            dst = job.target if job.action == "verify" else scratch / f"{c.name}.safetensors"
            writes = job.action == "convert" and c.writes
            run_once(
                c.command(job.src, dst, job.action, case.options),
                dst if writes else None,
                scratch,
                run,
                limit,
                args.timeout,
                stdout_null=job.action == "inspect",
            )
            check = args.verify and c.cli and rep == 0 and writes
            if check and run.status == "ok" and dst is not None:
                run.verified, run.report = verify_output(c, job.src, dst, scratch, case.options)
            ref = self.reference(job.src)
            if c.kind == "stcast" and case.kind == "zero" and refused(run):
                run.status = ZERO_NOT_RUN  # its figures are a refusal's: none shown
                run.peak_rss = run.peak_anon = 0
                run.cgroup_peak, run.samples = None, []
                self.refused.add((mode, case.name, c.name))
            compared = case.kind in ("dcp", "zero")
            if compared and rep == 0 and run.status == "ok" and dst is not None:
                if c.name == "stcast":  # kept for the peers of this round (they run after it)
                    os.replace(dst, ref)
                elif c.name in PEERS and args.verify:
                    if ref.exists():
                        run.same_as_stcast = same_tensors(ref, dst)
                    else:
                        print(f"    {c.name}: no stcast output of round 1 before it to compare")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # no output left between runs
        round_ = f"#{rep + 1}.{pos + 1}" if rep >= 0 else f"warm-up {pos + 1}"
        print(
            f"[{mode} {case.name} {round_}] {job.label:<18} {run.status:<8} "
            f"wall {run.wall_s:7.3f} s  user {run.user_s:6.3f} s  sys {run.sys_s:6.3f} s  "
            f"peak RSS {fmt_bytes(run.peak_rss)}"
            + (f"  cgroup {fmt_bytes(run.cgroup_peak)}" if limit else "")
            + ("" if run.verified is None else f"  verified {run.verified}")
            + ("" if run.same_as_stcast is None else f"  same as stcast {run.same_as_stcast}"),
            flush=True,
        )
        if run.status.startswith("failed"):
            last = run.stderr_tail.strip().splitlines() or ["(no stderr)"]
            print(f"    {last[-1]}")
        return run

    def mode(self, mode: str) -> None:
        why = mode_usable(mode)
        if why:
            print(f"{mode} skipped: {why}")
            return
        cases = [size_case(s) for s in self.args.sizes]
        cases += [bin_case(s) for s in self.args.bin_sizes]
        cases += [dcp_case(s, self.args.dcp_ranks) for s in self.args.dcp_sizes]
        z = self.args.zero_ranks, self.args.zero_stage
        cases += [zero_case(s, *z) for s in self.args.zero_sizes]
        with contextlib.ExitStack() as stack:
            if mode == "hugetmpfs":
                mount = HugeTmpfs(self.args.hugetmpfs_dir, self.args.hugetmpfs_size)
                try:
                    stack.enter_context(mount)
                except OSError as e:
                    print(f"hugetmpfs skipped: {e}")
                    return
                self.facts.setdefault("hugetmpfs", {})["options"] = mount.options()
            for case in cases:
                self.size_case(mode, case)
            if mode in self.args.many_modes:
                self.many_tensors(mode)


# Issue 23, point 6: the unpickler's cost when the pickle, not the data, is large.
# (case, command, goal wall s, goal peak RSS MB); the inputs come from gen_pickle_memory.py.
PICKLE_CASES = (
    ("views.pt", "convert", 5.0, 400),
    ("storages.pt", "convert", 5.0, 400),
    ("views.pt", "inspect --json", 10.0, 600),
    ("ints.pt", "convert", None, 150),
    ("string.pt", "convert", None, 100),
)


def pickle_memory(stcast: str, directory: Path, repeats: int, scale: float) -> int:
    """Run each PICKLE_CASES case `repeats` times; print the medians (wall, user+sys CPU,
    peak RSS from wait4) against the goals, as a markdown table."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "views.pt").exists():
        gen = [sys.executable, str(HERE / "gen_pickle_memory.py"), str(directory)]
        subprocess.run([*gen, "--scale", str(scale)], check=True)
    cli = shlex.split(stcast)
    lines = ["| case | goal | wall s | CPU s | peak RSS MB |", "|---|---|---|---|---|"]
    failed = 0
    for name, action, goal_s, goal_mb in PICKLE_CASES:
        walls, cpus, rss = [], [], []
        for _ in range(repeats):
            out = directory / "out.safetensors"
            out.unlink(missing_ok=True)
            argv = [*cli, *action.split(), str(directory / name)]
            if action == "convert":
                argv.append(str(out))
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, status, usage = os.wait4(proc.pid, 0)
            walls.append(time.monotonic() - t0)
            assert proc.stderr is not None
            err = proc.stderr.read().decode(errors="replace")
            proc.stderr.close()
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                raise SystemExit(f"{shlex.join(argv)}: exit {proc.returncode}: {err.strip()}")
            cpus.append(usage.ru_utime + usage.ru_stime)
            rss.append(usage.ru_maxrss / 1024)
            out.unlink(missing_ok=True)
        wall, cpu, mb = (statistics.median(v) for v in (walls, cpus, rss))
        ok = (goal_s is None or wall <= goal_s) and mb <= goal_mb
        failed += not ok
        goal = " and ".join(g for g in (goal_s and f"<= {goal_s:g} s", f"<= {goal_mb} MB") if g)
        state = "PASS" if ok else "FAIL"
        lines.append(f"| {name} {action} | {goal} ({state}) | {wall:.2f} | {cpu:.2f} | {mb:.0f} |")
        print(lines[-1], flush=True)
    print(f"\nmedians of {repeats} runs, {shlex.join(cli)}, scale {scale:g}\n")
    print("\n".join(lines))
    return 1 if failed else 0


# ------------------------------------------- the quantized cases (--fp8, --packed)

# The "FP8" and "Quantized releases" issues' goals: stcast's peak RSS, and the peer's wall
# over stcast's (same work, medians).
GOAL_QUANT_RSS = 64 * MiB
GOAL_QUANT_X_PEER = 3.0


@dataclass(frozen=True)
class QuantCase:
    """A case run against the llm-compressor venv's tools (--fp8-python), in ABBA rounds.
    Commands name `{src}` (the generated folder), `{dst}` and `{ref}` (the untimed output of
    `ref`, when there is one); a first word `stcast` is the stcast CLI, any other a peer
    script run by --fp8-python."""

    key: str  # the option, and the stem of its .md and .json
    title: str
    gen: str  # the generator script (gen_fp8.py FOLDER --seed N)
    contenders: tuple[tuple[str, str], ...]
    ratios: tuple[tuple[str, str], ...]  # (stcast's contender, the peer's doing the same)
    ref: str | None = None
    model: str = "llama"  # the generated folder's shape, in its name


FP8_CASE = QuantCase(
    "fp8",
    "FP8: stcast against model_free_ptq",
    "gen_fp8.py",
    (
        ("stcast fp8", "stcast convert {src} {dst} --to fp8"),
        ("stcast fp8-block", "stcast convert {src} {dst} --to fp8-block"),
        ("model_free_ptq FP8_DYNAMIC", "peers/model_free_ptq.py {src} {dst} FP8_DYNAMIC"),
        ("model_free_ptq FP8_BLOCK", "peers/model_free_ptq.py {src} {dst} FP8_BLOCK"),
        ("stcast dequant", "stcast convert {ref} {dst} --to bf16"),
    ),
    (
        ("stcast fp8", "model_free_ptq FP8_DYNAMIC"),
        ("stcast fp8-block", "model_free_ptq FP8_BLOCK"),
    ),
    ref="peers/model_free_ptq.py {src} {dst} FP8_BLOCK",
)
PACKED_CASE = QuantCase(
    "packed",
    "Packed INT4 (W4A16) to bf16: stcast against compressed-tensors",
    "gen_w4a16.py",
    (
        ("stcast dequant", "stcast convert {src} {dst}"),
        ("ct dequantize", "peers/ct_dequantize.py {src} {dst} bf16"),
    ),
    (("stcast dequant", "ct dequantize"),),
)
GPTOSS_CASE = QuantCase(
    "gptoss",
    "gpt-oss MXFP4 to bf16: stcast against transformers",
    "gen_gptoss.py",
    (
        ("stcast dequant", "stcast convert {src} {dst}"),
        ("transformers dequantize", "peers/tf_gptoss.py {src} {dst} bf16"),
    ),
    (("stcast dequant", "transformers dequantize"),),
    # Untimed: transformers' loaded state itself (its save_pretrained loses experts).
    ref="peers/tf_gptoss.py {src} {dst} bf16 state_dict",
    model="gptoss",
)


def st_entries(folder: Path) -> dict[str, tuple[Path, str, list[int], int, int]]:
    """Every tensor of a folder's safetensors files: name -> (file, dtype, shape, start, end),
    start and end absolute offsets in the file (read from the headers only)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, e in header.items():
            if name != "__metadata__":
                a, b = e["data_offsets"]
                out[name] = (f, e["dtype"], e["shape"], 8 + n + a, 8 + n + b)
    return out


def tensor_bytes(entry: tuple[Path, str, list[int], int, int]) -> bytes:
    f, _, _, a, b = entry
    with open(f, "rb") as fh:
        fh.seek(a)
        return fh.read(b - a)


def fp8_identity(ours: Path, theirs: Path) -> tuple[int, int, list[str]]:
    """stcast's FP8 folder against model_free_ptq's: every F8_E4M3 weight model_free_ptq
    wrote and its weight_scale must be in stcast's with the same dtype, shape and bytes, and
    stcast must quantize no other weight. Returns (weights, scales, differences)."""
    a, b = st_entries(ours), st_entries(theirs)
    fp8 = sorted(k for k, e in b.items() if e[1] == "F8_E4M3")
    ours_fp8 = sorted(k for k, e in a.items() if e[1] == "F8_E4M3")
    bad = [] if ours_fp8 == fp8 else [f"F8_E4M3 names differ: {set(ours_fp8) ^ set(fp8)}"]
    weights = scales = 0
    for w in fp8:
        for name in (w, w.removesuffix(".weight") + ".weight_scale"):
            if name not in b or name not in a:
                bad.append(f"{name}: missing")
            elif a[name][1:3] != b[name][1:3]:
                bad.append(f"{name}: {a[name][1:3]} vs {b[name][1:3]}")
            elif tensor_bytes(a[name]) != tensor_bytes(b[name]):
                bad.append(f"{name}: bytes differ")
            elif name == w:
                weights += 1
            else:
                scales += 1
    return weights, scales, bad


def same_folder_tensors(ours: Path, theirs: Path) -> tuple[int, list[str]]:
    """Two folders' safetensors files hold the same tensors (names, dtypes, shapes, bytes),
    in any files and order. Returns (tensors, differences)."""
    a, b = st_entries(ours), st_entries(theirs)
    bad = [] if set(a) == set(b) else [f"names differ: {sorted(set(a) ^ set(b))[:5]}"]
    same = 0
    for name in sorted(set(a) & set(b)):
        if a[name][1:3] != b[name][1:3]:
            bad.append(f"{name}: {a[name][1:3]} vs {b[name][1:3]}")
        elif tensor_bytes(a[name]) != tensor_bytes(b[name]):
            bad.append(f"{name}: bytes differ")
        else:
            same += 1
    return same, bad


def quant_checks(
    case: QuantCase, mode: str, first: dict[str, Path], ref: Path | None, llmc: list[str]
) -> list[tuple[str, str]]:
    """The case's checks of one mode's first outputs: FP8, the byte identity of stcast's
    quantized weights and scales with model_free_ptq's, and compressed-tensors'
    dequantization of {ref} against stcast's (fp8_dequant_check.py); packed, stcast's output
    against compressed-tensors' own, every tensor bit for bit."""
    checks = []
    if case is GPTOSS_CASE:
        a, b = first.get("stcast dequant"), first.get("transformers dequantize")
        if a and ref is not None:
            n, bad = same_folder_tensors(a, ref)
            what = f"{mode}: stcast = transformers' dequantized state, {n} tensors bit for bit"
            checks.append(
                ("PASS" if n and not bad else "FAIL", what + (f"; {bad[:3]}" if bad else ""))
            )
        if a and b:
            n, bad = same_folder_tensors(a, b)
            what = f"{mode}: transformers' save_pretrained output: {n} of stcast's tensors equal"
            checks.append(("NOTE", what + (f"; {len(bad)} differ: {bad[:2]}" if bad else "")))
        return checks
    if case is PACKED_CASE:
        a, b = first.get("stcast dequant"), first.get("ct dequantize")
        if a and b:
            n, bad = same_folder_tensors(a, b)
            what = f"{mode}: stcast = compressed-tensors' dequantization, {n} tensors bit for bit"
            checks.append(
                ("PASS" if n and not bad else "FAIL", what + (f"; {bad[:3]}" if bad else ""))
            )
        return checks
    for ours, theirs in case.ratios:
        a, b = first.get(ours), first.get(theirs)
        if a and b:
            w, s, bad = fp8_identity(a, b)
            what = (
                f"{mode}: {ours} = {theirs}: {w} weights and {s} weight_scales byte-identical"
                + (f"; {len(bad)} differ: {bad[:3]}" if bad else "")
            )
            checks.append(("PASS" if not bad and w else "FAIL", what))
    if "stcast dequant" in first and ref is not None:
        check = [*llmc, str(HERE / "fp8_dequant_check.py"), str(ref)]
        done = subprocess.run(
            [*check, str(first["stcast dequant"])], capture_output=True, text=True
        )
        lines = (done.stdout + done.stderr).strip().splitlines()[-5:]
        checks.append(("PASS" if done.returncode == 0 else "FAIL", f"{mode}: " + " / ".join(lines)))
    return checks


def quant_bench(args: argparse.Namespace, case: QuantCase) -> int:
    """--fp8 / --packed: the case's contenders on its generated Llama-shaped folder, per
    mode ABBA rounds, then its checks (`quant_checks`). Prints and writes KEY.md and
    KEY.json to --out."""
    stcast, llmc = shlex.split(args.stcast), shlex.split(args.fp8_python)
    cache = args.disk_dir / f"{case.key}-{case.model}-{args.seed}"
    if not cache.exists():
        gen = [sys.executable, str(HERE / case.gen), str(cache), "--seed", str(args.seed)]
        subprocess.run(gen, check=True)

    def argv(text: str) -> list[str]:
        words = text.split()
        if words[0] == "stcast":
            return [*stcast, *words[1:]]
        return [*llmc, str(args.peers / Path(words[0]).name), *words[1:]]

    argv_of = {name: argv(text) for name, text in case.contenders}
    names = [n for n, _ in case.contenders]
    facts = {
        "stcast": version(stcast),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "peer": subprocess.run(
            [
                *llmc,
                "-c",
                "import llmcompressor, compressed_tensors, torch, transformers; "
                "print(llmcompressor.__version__, compressed_tensors.__version__, "
                "torch.__version__, transformers.__version__)",
            ],
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1:],  # its last line: llmcompressor logs a warning first
    }
    runs: list[Run] = []
    checks: list[tuple[str, str]] = []
    for mode in args.fp8_modes:
        with contextlib.ExitStack() as stack:
            if mode == "hugetmpfs":
                root = stack.enter_context(HugeTmpfs(args.fp8_tmpfs_dir, args.fp8_tmpfs_size))
            else:
                root = args.disk_dir / f"{case.key}-run"
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True)
                stack.callback(shutil.rmtree, root, True)
            src = cache
            if mode == "hugetmpfs":
                src = root / cache.name
                shutil.copytree(cache, src)
            logs, kept = root / "logs", root / "kept"
            logs.mkdir()
            kept.mkdir()
            ref = None
            if case.ref is not None:  # untimed: the input of the contenders naming {ref}
                ref = kept / "ref"
                words = [a.format(src=src, dst=ref) for a in argv(case.ref)]
                done = subprocess.run(words, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{case.ref} failed: {done.stderr[-2000:]}")
            first: dict[str, Path] = {}
            for r in range(args.repeats):
                order = names if r % 2 == 0 else names[::-1]
                for pos, name in enumerate(order):
                    dst = root / "out"
                    shutil.rmtree(dst, ignore_errors=True)
                    words = [
                        a.format(src=src, dst=dst, ref=ref) if "{" in a else a
                        for a in argv_of[name]
                    ]
                    reads = (
                        ref if ref is not None and "{ref}" in dict(case.contenders)[name] else src
                    )
                    if mode == "hot":
                        warm(reads)
                    run = Run(mode, 0.0, name, r, path_bytes(reads), case=case.key, kind=case.key)
                    run.position = pos
                    run_once(words, dst, logs, run, None, args.timeout)
                    runs.append(run)
                    print(
                        f"{mode} round {r} {name}: {run.status}, {run.wall_s:.2f} s wall, "
                        f"{run.cpu_s:.2f} s CPU, {run.peak_rss / MiB:.0f} MiB",
                        flush=True,
                    )
                    if run.status != "ok":
                        print(run.stderr_tail)
                    elif name not in first:
                        first[name] = kept / name.replace(" ", "_")
                        dst.rename(first[name])
                    shutil.rmtree(dst, ignore_errors=True)
            found = quant_checks(case, mode, first, ref, llmc)
            for state, what in found:
                print(f"{state}: {what}")
            checks += found
    facts["loadavg_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{case.key}.json").write_text(
        json.dumps(
            {
                "machine": facts,
                "checks": [{"state": s, "what": w} for s, w in checks],
                "runs": [asdict(r) for r in runs],
            },
            indent=1,
        )
    )
    text = quant_markdown(case, runs, checks, facts, args)
    (args.out / f"{case.key}.md").write_text(text)
    print()
    print(text)
    return 0 if all(s != "FAIL" for s, _ in checks) else 1


def quant_markdown(
    case: QuantCase,
    runs: list[Run],
    checks: list[tuple[str, str]],
    facts: dict[str, Any],
    args: argparse.Namespace,
) -> str:
    """The table (medians [min–max]), the ratios (per round [min–max]) and the goals."""
    lines = [
        f"# {case.title}",
        "",
        f"{facts['stcast']}; llmcompressor, compressed-tensors, torch, transformers "
        f"{' '.join(facts['peer'])}; {facts['cpus']} CPUs, load "
        f"{load(facts['loadavg_start'])} at the start, {load(facts['loadavg_end'])} at the "
        f"end; {args.repeats} ABBA rounds.",
        "",
    ]
    head = ["mode", "contender", "runs", "wall s", "user+sys CPU s", "peak RSS"]
    body = []
    stats: dict[tuple[str, str], dict[str, Any]] = {}
    for mode in args.fp8_modes:
        for name, _ in case.contenders:
            ok = [r for r in runs if r.mode == mode and r.contender == name and r.status == "ok"]
            if not ok:
                continue
            st = {m: spread([getattr(r, m) for r in ok]) for m in ("wall_s", "cpu_s", "peak_rss")}
            stats[mode, name] = st
            body.append(
                [
                    mode,
                    name,
                    str(len(ok)),
                    fmt_spread(st["wall_s"], ".2f"),
                    fmt_spread(st["cpu_s"], ".2f"),
                    fmt_mem(st["peak_rss"]),
                ]
            )
    lines += table(head, "lllrrr", body)
    lines += ["", "The peer over stcast, same work (median; [min–max] per round):", ""]
    rbody = []
    states = []
    for mode in args.fp8_modes:
        for a, b in case.ratios:
            if (mode, a) not in stats or (mode, b) not in stats:
                continue
            cells = [mode, f"{b} / {a}"]
            for m in ("wall_s", "cpu_s", "peak_rss"):
                per = [
                    rb.__getattribute__(m) / ra.__getattribute__(m)
                    for ra in runs
                    for rb in runs
                    if ra.mode == rb.mode == mode
                    and ra.repeat == rb.repeat
                    and (ra.contender, rb.contender) == (a, b)
                    and ra.status == rb.status == "ok"
                ]
                med = stats[mode, b][m]["median"] / stats[mode, a][m]["median"]
                cells.append(f"{med:.1f}x" + (f" [{min(per):.1f}–{max(per):.1f}]" if per else ""))
            rbody.append(cells)
            x = stats[mode, b]["wall_s"]["median"] / stats[mode, a]["wall_s"]["median"]
            states.append(
                (
                    "PASS" if x >= GOAL_QUANT_X_PEER else "FAIL",
                    f"{mode}: {b} wall {x:.1f}x {a}'s (goal >= {GOAL_QUANT_X_PEER:g}x)",
                )
            )
        for name, text in case.contenders:
            if text.startswith("stcast ") and (mode, name) in stats:
                peak = stats[mode, name]["peak_rss"]["max"]
                states.append(
                    (
                        "PASS" if peak <= GOAL_QUANT_RSS else "FAIL",
                        f"{mode}: {name} peak RSS {peak / MiB:.1f} MiB, largest of its runs "
                        f"(goal <= {GOAL_QUANT_RSS // MiB} MiB)",
                    )
                )
    lines += table(["mode", "ratio", "wall", "CPU", "peak RSS"], "llrrr", rbody)
    lines += ["", "## Goals and checks", ""]
    lines += [f"- {s}: {w}" for s, w in states + checks]
    where = "`{src}`: the generated folder" + (f", `{{ref}}`: `{case.ref}`" if case.ref else "")
    lines += ["", f"Commands ({where}):", ""]
    lines += [f"- {n}: `{t}`" for n, t in case.contenders]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pickle_memory:
        return pickle_memory(args.stcast, args.pickle_dir, args.repeats, args.pickle_scale)
    if args.fp8 or args.packed:
        return quant_bench(args, FP8_CASE if args.fp8 else PACKED_CASE)
    if args.gptoss:
        return quant_bench(args, GPTOSS_CASE)
    if args.render:
        return render(args.render, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benches/compare.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    remove_stale_cgroups()
    needs_cgroup = "cgroup" in args.modes or args.caps
    if needs_cgroup:
        try:
            own_memory_cgroup()
        except OSError as e:
            raise SystemExit(f"cgroup mode and --cap need cgroup v1 memory: {e}") from e

    contenders = find_contenders(
        args.stcast, args.peers, args.out, args.contenders, args.baseline, args.tuning, args.reshard
    )
    if not contenders:
        raise SystemExit("no contender can run here")
    by_name = {c.name: c for c in contenders}
    facts = machine_facts(by_name["stcast"].cli if "stcast" in by_name else None)
    if "stcast_base" in by_name:
        facts["stcast_base"] = version(by_name["stcast_base"].cli)
    starts = {"python -c pass": [sys.executable, "-c", "pass"]}
    for c in contenders:
        if c.kind == "stcast":
            starts[f"{c.name} --version"] = [*c.cli, "--version"]
    facts["start_up"] = {k: start_up(v) for k, v in starts.items()}
    if set(TORCH_PEERS) & set(by_name):
        probe = [sys.executable, "-c", "import torch; print(torch.__version__)"]
        facts["torch"] = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    reset_peak_rss()
    facts["rss_floor"] = own_rss()

    bench = Bench(args, contenders, facts)
    interrupted = False
    try:
        for mode in args.modes:
            bench.mode(mode)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: writing the results so far")
    finally:
        if args.clean:
            for path in bench.inputs:
                if path.is_dir():  # a DCP folder
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    runs = bench.runs
    facts["loadavg_end"] = os.getloadavg()
    facts["rss_floor_max"] = max((r.floor_rss for r in runs), default=facts["rss_floor"])
    report = next((r.report for r in runs if r.report and r.contender == "stcast"), None)
    if report:
        facts["stcast_isa"], facts["stcast_threads"] = report.get("isa"), report.get("threads")
    config = {
        "command": command,
        "sizes_gib": args.sizes,
        "bin_sizes_gib": args.bin_sizes,
        "dcp_sizes_gib": args.dcp_sizes,
        "dcp_ranks": args.dcp_ranks,
        "zero_sizes_gib": args.zero_sizes,
        "zero_ranks": args.zero_ranks,
        "zero_stage": args.zero_stage,
        "repeats": args.repeats,
        "tmpfs_repeats": args.tmpfs_repeats,
        "modes": args.modes,
        "order": args.order,
        "warmup": args.warmup,
        "many_tensors": {
            "modes": args.many_modes,
            "count": args.many_count,
            "bytes": args.many_bytes,
            "few_count": args.few_count,
            "repeats": args.many_repeats,
        }
        if args.many_tensors
        else None,
        "hugetmpfs": {"dir": str(args.hugetmpfs_dir), "size": args.hugetmpfs_size},
        "mem_limit": args.mem_limit,
        "caps": args.caps,
        "timeout_s": args.timeout,
        "seed": args.seed,
        "contenders": [asdict(c) for c in contenders],
        "peers_up_to_gib": args.peers_up_to,
        "skipped": bench.skipped,
        "goals": {k: v for k, v in globals().items() if k.startswith("GOAL_")},
    }
    rows = summarize(runs)
    ratios = all_ratios(runs, rows)
    checks = goals(rows, ratios, config)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "machine": facts,
                "config": config,
                "summary": rows,
                "ratios": ratios,
                "goals": [{"state": s, "what": w} for s, w in checks],
                "runs": [asdict(r) for r in runs],
            },
            indent=1,
        )
    )
    text = markdown(facts, config, rows, ratios, checks)
    (args.out / "results.md").write_text(text)
    written = [args.out / "results.md", args.out / "results.json"]
    if rows:
        written += plot(runs, rows, args.out)
    print()
    print(text)
    print("wrote " + ", ".join(str(p) for p in written))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
