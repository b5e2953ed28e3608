"""The guide's SLURM recipe, submitted to a real cluster.

The batch script and the lines that submit it are read from docs/guide.md (the two ```sh
blocks after "With SLURM:"), and the DCP consolidation line from its DCP section, then only
their paths, array size and resources are set for this host (each replacement must apply,
so a changed guide fails here instead of running something else). `sbatch` submits the
array, a second `sbatch --dependency=afterok:$jobid --wait` runs `stcast finalize` once every
task is done; the jobs run this venv's `stcast` (its bin first on the PATH they inherit).
Then `verify` passes and the output is byte for byte what one plain run writes.

It needs a cluster: `apt-get install slurm-wlm munge` and `scripts/slurm-local.sh` (as root;
CI does both). Without one, every test here is skipped with one reason, never failed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import main_in_process, tree, write_checkpoint_folder
from dcpfile import Tensor, rows, write_dcp
from helpers import cli_env

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide.md"
# Tasks of an array: 2 run at once on this 2-core host (--cpus-per-task=1).
TASKS = 3
JOB_TIMEOUT_S = 240


def guide_recipe() -> tuple[str, str]:
    """The guide's batch script and the lines that submit it."""
    text = GUIDE.read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```$", text, re.M | re.S)
    at = next(i for i, b in enumerate(blocks) if "#SBATCH --array" in b)
    script, submit = blocks[at], blocks[at + 1]
    assert "sbatch --dependency=afterok" in submit, submit
    return script, submit


def guide_dcp_line() -> str:
    """The guide's SLURM line for a DCP or ZeRO folder (prose, in backquotes)."""
    line = r"`(stcast convert [^`]*--shard \$SLURM_ARRAY_TASK_ID/N)`"
    found = re.findall(line, GUIDE.read_text())
    assert len(found) == 1, found
    return found[0]


def replace(text: str, old: str, new: str) -> str:
    assert old in text, f"the guide changed: no {old!r} in {text!r}"
    return text.replace(old, new)


def _why_no_cluster() -> str | None:
    missing = [c for c in ("sbatch", "sinfo", "scancel", "scontrol") if shutil.which(c) is None]
    if missing:
        return (
            f"slurm is not installed (no {', '.join(missing)} on PATH): apt-get install "
            "slurm-wlm munge, then scripts/slurm-local.sh as root"
        )
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return "no SLURM controller answers sinfo within 20 s: start scripts/slurm-local.sh"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return f"no SLURM cluster answers (sinfo: {why}): start scripts/slurm-local.sh"
    states = proc.stdout.split()
    if not {"idle", "mixed"} & set(states):
        return f"no SLURM node takes jobs (sinfo: {' '.join(states) or 'no nodes'})"
    return None


# One skip line for the module, naming why (the suite runs with -rs: pyproject.toml).
_no_cluster = _why_no_cluster()
if _no_cluster is not None:
    pytest.skip(_no_cluster, allow_module_level=True)


def submit(folder: Path, script: str, submit_lines: str) -> None:
    """Write `script` as the guide names it, run `submit_lines` in `folder` (the finalize job
    waits: `--wait`, and is cancelled if the array fails), and fail with the jobs' logs if
    any job failed."""
    (folder / "convert.sbatch").write_text(script)
    bin_dir = os.path.dirname(sys.executable)
    env = cli_env()
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    assert shutil.which("stcast", path=env["PATH"]) == os.path.join(bin_dir, "stcast")
    name = f"stcast-test-{uuid.uuid4().hex[:8]}"
    env["SBATCH_JOB_NAME"] = name  # every job of this test, to cancel them on a failure
    submit_lines = replace(
        submit_lines,
        "sbatch --dependency=afterok:",
        "sbatch --wait --kill-on-invalid-dep=yes --dependency=afterok:",
    )
    try:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", submit_lines],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as timeout:
        subprocess.run(["scancel", f"--name={name}"], check=False)
        raise AssertionError(
            f"the jobs did not end in {JOB_TIMEOUT_S} s\n{_logs(folder)}"
        ) from timeout
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{_logs(folder)}"
    assert re.search(r"^Submitted batch job \d+$", proc.stdout, re.M), proc.stdout
    # `sbatch --wait` exits 0 for a job cancelled before it ran (an array task failed, so
    # afterok can never be met): every job's own state says whether it did its work.
    states = _job_states(name)
    assert len(states) == TASKS + 1, states
    assert set(states.values()) == {("COMPLETED", "0:0")}, f"{states}\n{_logs(folder)}"


def _job_states(name: str) -> dict[str, tuple[str, str]]:
    """Job id -> (state, exit code) of every job named `name` (slurmctld keeps ended jobs
    MinJobAge seconds, 300 by default, with no accounting database)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "job"], capture_output=True, text=True, check=True
    ).stdout
    states = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("JobName") == name:
            states[fields["JobId"]] = (fields["JobState"], fields["ExitCode"])
    return states


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(folder.glob("slurm-*.out")))


def for_this_host(script: str, src: str, dst: str, line: str | None = None) -> str:
    """The guide's batch script for `TASKS` tasks of 1 CPU on SRC and DST (or, with `line`,
    running that stcast line in place of the guide's)."""
    script = replace(script, "--array=1-8", f"--array=1-{TASKS}")
    script = replace(script, "--cpus-per-task=16", "--cpus-per-task=1")
    script = replace(script, "--mem=8G", "--mem=400M")
    if line is not None:
        convert = next(ln for ln in script.splitlines() if ln.startswith("stcast convert"))
        script = replace(script, convert, line)
    script = replace(script, "/data/Llama-405B-bf16", dst)
    script = replace(script, "/data/Llama-405B", src)
    return replace(script, "_ID/8", f"_ID/{TASKS}")


def finalize_for(submit_lines: str, src: str, dst: str) -> str:
    submit_lines = replace(submit_lines, "/data/Llama-405B-bf16", dst)
    return replace(submit_lines, "/data/Llama-405B", src)


def plain_run(folder: Path, *args: object) -> dict:
    rc, _, err = main_in_process("convert", *args, "-q")
    assert rc == 0, err
    return tree(folder)


def verify(*args: object) -> None:
    rc, out, err = main_in_process("verify", *args)
    assert rc == 0, f"verify {args}: {out}{err}"


def test_the_guide_recipe_converts_a_hugging_face_folder(tmp_path):
    script, submit_lines = guide_recipe()
    src = write_checkpoint_folder(tmp_path / "src", files=2 * TASKS)
    dst = tmp_path / "dst"
    submit(
        tmp_path,
        for_this_host(script, str(src), str(dst)),
        finalize_for(submit_lines, str(src), str(dst)),
    )
    verify(src, dst)
    assert tree(dst) == plain_run(tmp_path / "plain", src, tmp_path / "plain")
    assert not list(dst.glob(".stcast-*"))


def test_the_guide_recipe_reshards(tmp_path):
    """The same recipe with `--max-shard-size`: each task writes its share of the new
    shards, finalize the index."""
    script, submit_lines = guide_recipe()
    src = write_checkpoint_folder(tmp_path / "src", files=2 * TASKS)
    dst = tmp_path / "dst"
    resharding = for_this_host(script, str(src), str(dst)).replace(
        "--resume", "--resume --max-shard-size 300B"
    )
    submit(tmp_path, resharding, finalize_for(submit_lines, str(src), str(dst)))
    verify(src, dst)
    plain = plain_run(tmp_path / "plain", src, tmp_path / "plain", "--max-shard-size", "300B")
    assert tree(dst) == plain
    assert "model.safetensors.index.json" in plain


def test_the_guide_dcp_line_consolidates_a_dcp_folder(tmp_path):
    """The DCP section's line, `stcast convert ckpt/ hf/ --key model --max-shard-size 5GB
    --shard $SLURM_ARRAY_TASK_ID/N`, as the array's task, then `stcast finalize ckpt/ hf/`."""
    script, submit_lines = guide_recipe()
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    tensors = {}
    for k in range(4):
        x = np.linspace(-k, k + 1, 48 * 8, dtype=np.float32).reshape(48, 8)
        fqn = f"model.layers.{k}.weight"
        tensors[fqn] = Tensor(x, rows(x, [0, 16, 30]), ("model", f"layers.{k}.weight"))
    write_dcp(ckpt, tensors, ranks=3)
    line = replace(guide_dcp_line(), "5GB", "900B")
    line = replace(line, "ckpt/ hf/", "/data/Llama-405B /data/Llama-405B-bf16")
    line = replace(line, "_ID/N", "_ID/8")
    submit(
        tmp_path,
        for_this_host(script, str(ckpt), str(hf), line),
        finalize_for(submit_lines, str(ckpt), str(hf)),
    )
    verify(ckpt, hf, "--key", "model")
    plain = plain_run(
        tmp_path / "plain", ckpt, tmp_path / "plain", "--key", "model", "--max-shard-size", "900B"
    )
    assert tree(hf) == plain
    assert len([n for n in plain if n.endswith(".safetensors")]) > TASKS
