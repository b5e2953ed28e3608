"""Faults and signals, made deterministic: a full disk, a read-only folder, write errors and
Ctrl-C (with O_TMPFILE and with the named temp file), SIGKILL, temp files left behind, rival
runs, and an input modified while it is read. Whatever happens, nothing is left.

Runs stop at an exact point with `STCAST_FAILPOINT=POINT=stop` (the process raises SIGSTOP);
the test waits for the stop with `waitpid(WUNTRACED)`, acts, and resumes or kills it: no
sleeping. The failpoint `tmpfile=eopnotsupp` makes stcast use a named, flock-held temp file
instead of O_TMPFILE, as on a file system without it. A tmpfs is mounted in a private mount
namespace (helpers.MountNamespace), never on the host.

A run with a failpoint armed is a child (failpoints are read once per process); the runs
around it, without one, use the CLI in-process.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import signal

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, listing, tensor_bytes, write_safetensors
from helpers import run_python, stopped, with_points

# The CLI converts in 8 MiB windows: a 10 MiB first tensor spans two, so `mid-tensor` is
# reached with half of the input read.
BIG = (10 << 20) // 4
NAMED = {"STCAST_FAILPOINT": "tmpfile=eopnotsupp"}


TEMP = re.compile(r"^\.stcast-.*\.tmp$")


def write_big_model(path, seed=0):
    """10 MiB of F32 (two windows) and a small I8 tensor."""
    x = np.random.default_rng(seed).standard_normal(BIG).astype(np.float32)
    return write_safetensors(path, {"big": ("F32", [BIG], x), "small": ("I8", [3], b"\1\2\3")})


@pytest.fixture
def big_model(tmp_path):
    """`model.safetensors`, alone in its folder: 10 MiB of F32 and a small I8 tensor."""
    return write_big_model(tmp_path / "model.safetensors")


@pytest.fixture
def big_model_bf16(big_model, tmp_path_factory):
    """The bytes a clean conversion of `big_model` gives."""
    out = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    stcast.convert(big_model, out)
    return out.read_bytes()


def snapshot(folder):
    """Every entry of a folder with the bytes of the files (None for anything else)."""
    return {
        p: (folder / p).read_bytes() if (folder / p).is_file() else None for p in listing(folder)
    }


def temps(folder):
    return [p for p in listing(folder) if TEMP.match(p)]


# --- disk full and read-only folders (tmpfs) ---------------------------------------------------


@pytest.fixture
def cli_for(run_main, cli_process):
    """cli_for(env)(ARGS): the CLI in a child when `env` arms a failpoint (they are read once
    per process), else in-process."""

    def pick(env):
        if env.get("STCAST_FAILPOINT"):
            return functools.partial(cli_process, env=env)
        return run_main

    return pick


@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
def test_disk_full_fails_before_converting(big_model, tmpfs, cli_process, run_main, env):
    mnt = tmpfs("1M")
    dst = mnt / "out.safetensors"
    # mid-tensor=eio proves nothing was converted: reaching the first window would fail there.
    rc, out, err = cli_process("convert", big_model, dst, env=with_points(env, "mid-tensor=eio"))
    assert rc == 1, err
    line = assert_one_error_line(err)
    m = re.fullmatch(rf"stcast: {mnt}: not enough disk space: need (.+), have (.+)", line)
    assert m, line
    assert m.group(1) == "5.24 MB" and m.group(2) == "1.05 MB", line
    assert listing(mnt) == []
    rc, out, _ = run_main("convert", "--json", big_model, dst)
    assert rc == 1 and '"kind": "no_space"' in out
    with pytest.raises(stcast.StcastError) as info:
        stcast.convert(big_model, dst)
    assert info.value.kind == "no_space" and info.value.path == str(mnt)
    assert listing(mnt) == []


def test_disk_full_keeps_the_old_destination(big_model, tmpfs, run_main):
    mnt = tmpfs("1M")
    dst = mnt / "out.safetensors"
    dst.write_bytes(b"the old output")
    rc, _, err = run_main("convert", big_model, dst, "--force")
    assert rc == 1 and "not enough disk space" in assert_one_error_line(err)
    assert snapshot(mnt) == {"out.safetensors": b"the old output"}


def test_many_small_files_are_counted_in_the_blocks_they_take(tmp_path, tmpfs, run_main):
    """A folder of 700 one-byte files (and a small weight file) "fit" a 2 MiB tmpfs by their
    bytes, but each takes a 4 KiB block there: the space check counts whole blocks and
    refuses before writing anything. Before, the run passed the check and failed halfway."""
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", {"x": ("F32", [64], np.ones(64, "f4"))})
    for i in range(700):
        (src / f"note{i:03}.txt").write_bytes(b"x")
    mnt = tmpfs("2M")
    dst = mnt / "out"
    rc, _, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1 and "not enough disk space" in line, err
    assert listing(mnt) == []
    # Where it fits, in blocks too, the run goes on.
    rc, _, err = run_main("convert", src, tmpfs("4M", name="big") / "out", "-q")
    assert rc == 0, err


def test_small_output_fits_on_tmpfs(tmp_path, tmpfs, cli_process):
    mnt = tmpfs("1M")
    src = write_safetensors(tmp_path / "s.safetensors", {"x": ("F32", [1000], np.ones(1000, "f4"))})
    rc, _, err = cli_process("convert", "-q", src, mnt / "s.safetensors", env=NAMED)
    assert rc == 0, err
    assert listing(mnt) == ["s.safetensors"]


@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_read_only_folder(big_model, mount_ns, tmpfs, cli_for, env, force):
    mnt = tmpfs("1M")
    dst = mnt / "out.safetensors"
    if force:
        dst.write_bytes(b"old")
    mount_ns.remount_read_only(mnt)
    before = snapshot(mnt)
    args = ["convert", big_model, dst] + (["--force"] if force else [])
    rc, _, err = cli_for(env)(*args)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert line == f"stcast: {mnt}: cannot create the output: Read-only file system", line
    assert snapshot(mnt) == before
    with pytest.raises(OSError) as info:
        stcast.convert(big_model, dst, force=force)
    assert info.value.filename == str(mnt)


# --- Ctrl-C and write failures with O_TMPFILE (the named temp file: below) ---------------------


POINTS = ["create", "prealloc", "mid-tensor", "fsync", "publish"]


# How the CLI dies of each signal (the shell shows 128 + N: 130, 143, 129), and what it says.
SIGNALS = {
    "sigint": (signal.SIGINT, "interrupted"),
    "sigterm": (signal.SIGTERM, "terminated"),
    "sighup": (signal.SIGHUP, "hung up"),
}


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
@pytest.mark.parametrize("action", list(SIGNALS))
def test_signals_leave_nothing(big_model, cli_process, point, force, action):
    """SIGINT, SIGTERM and SIGHUP at every step before the commit point: nothing is left,
    an old destination stays, and the CLI dies of that signal so the shell and SLURM see
    it."""
    sig, word = SIGNALS[action]
    folder = big_model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    args = ["convert", big_model, dst] + (["--force"] if force else [])
    rc, out, err = cli_process(*args, env={"STCAST_FAILPOINT": f"{point}={action}"}, timeout=60)
    assert rc == -sig, err
    assert "Traceback" not in err
    assert assert_one_error_line(err) == f"stcast: {word}"
    assert snapshot(folder) == before


@pytest.mark.parametrize("point", POINTS)
def test_sigint_json(big_model, cli_process, point):
    rc, out, err = cli_process(
        "convert",
        "--json",
        big_model,
        big_model.parent / "out.safetensors",
        env={"STCAST_FAILPOINT": f"{point}=sigint"},
        timeout=60,
    )
    assert rc == -signal.SIGINT
    assert '"kind": "interrupted"' in out
    assert listing(big_model.parent) == ["model.safetensors"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("fsync=eio", ["fsync", "Input/output error"]),
        ("publish=enospc", ["No space left"]),
        ("mid-tensor=eio", ["Input/output error"]),
        ("create=eio", ["Input/output error"]),
        ("prealloc=eio", ["Input/output error"]),
        ("prealloc=enospc", ["not enough disk space"]),
    ],
)
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_write_failures(big_model, cli_process, spec, words, force):
    folder = big_model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    args = ["convert", big_model, dst] + (["--force"] if force else [])
    rc, out, err = cli_process(*args, env={"STCAST_FAILPOINT": spec}, timeout=60)
    assert rc == 1, err
    line = assert_one_error_line(err)
    for w in words:
        assert w in line, line
    assert "Errno" not in line
    assert snapshot(folder) == before


def test_no_space_json_kind(big_model, cli_process):
    rc, out, _ = cli_process(
        "convert",
        "--json",
        big_model,
        big_model.parent / "out.safetensors",
        env={"STCAST_FAILPOINT": "publish=enospc"},
    )
    assert rc == 1 and '"kind": "no_space"' in out


def test_unknown_failpoint_is_ignored(big_model, cli_process):
    rc, _, err = cli_process(
        "convert",
        "-q",
        big_model,
        big_model.parent / "out.safetensors",
        env={"STCAST_FAILPOINT": "nowhere=eio,mid-tensor=nothing"},
    )
    assert rc == 0, err


# --- write errors and Ctrl-C with the named temp file ---------------------------------------------

NAMED_FAULTS = [
    ("prealloc", "sigint"),
    ("prealloc", "eio"),
    ("mid-tensor", "sigint"),
    ("mid-tensor", "enospc"),
    ("fsync", "sigint"),
    ("fsync", "enospc"),
    ("fsync", "eio"),
    ("publish", "sigint"),
    ("publish", "eio"),
    ("publish", "enospc"),
]


@pytest.mark.parametrize("point, action", NAMED_FAULTS, ids=[f"{p}={a}" for p, a in NAMED_FAULTS])
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_named_temp_faults_leave_nothing(big_model, cli_process, point, action, force):
    folder = big_model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    args = ["convert", big_model, dst] + (["--force"] if force else [])
    rc, _, err = cli_process(*args, env=with_points(NAMED, f"{point}={action}"))
    line = assert_one_error_line(err)
    if action == "sigint":
        assert (rc, line) == (-signal.SIGINT, "stcast: interrupted"), err
    else:
        assert rc == 1, err
        assert str(dst) in line
        assert ("No space left" if action == "enospc" else "Input/output error") in line, line
    assert snapshot(folder) == before


# --- SIGKILL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_sigkill_with_tmpfile_leaves_nothing(big_model, force):
    folder = big_model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    run = stopped("convert", big_model, dst, *(["--force"] if force else []), at="mid-tensor")
    assert snapshot(folder) == before  # half-way through, nothing is visible
    rc, _ = run.kill()
    assert rc == -signal.SIGKILL
    assert snapshot(folder) == before


def test_sigkill_named_temp_is_removed_by_the_next_run(big_model, run_main, big_model_bf16):
    folder = big_model.parent
    run = stopped("convert", big_model, folder / "a.safetensors", at="mid-tensor", env=NAMED)
    (temp,) = temps(folder)
    assert run.kill()[0] == -signal.SIGKILL
    assert temps(folder) == [temp]  # a killed run cannot clean up: the next one does

    rc, _, err = run_main("convert", big_model, folder / "b.safetensors")  # -q would hide it
    assert rc == 0, err
    line = assert_one_error_line(err)
    assert line.startswith(f"stcast: warning: removed {folder / temp}, a temp file left by"), line
    assert listing(folder) == ["b.safetensors", "model.safetensors"]
    assert (folder / "b.safetensors").read_bytes() == big_model_bf16


def test_stale_temp_removal_through_the_api(big_model):
    folder = big_model.parent
    stopped("convert", big_model, folder / "a.safetensors", at="mid-tensor", env=NAMED).kill()
    (temp,) = temps(folder)
    with pytest.warns(stcast.StcastWarning, match=f"removed .*{re.escape(temp)}"):
        report = stcast.convert(big_model, folder / "b.safetensors")
    assert temps(folder) == [] and len(report.warnings) == 1


def test_temp_whose_lock_is_held_is_left_alone(big_model, cli_process, run_main):
    folder = big_model.parent
    held = folder / ".stcast-otherhost-4242-00000000deadbeef.tmp"
    held.write_bytes(b"being written on another host")
    with open(held, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        rc, _, err = cli_process("convert", "-q", big_model, folder / "a.safetensors", env=NAMED)
        assert (rc, err) == (0, "")
        assert held.read_bytes() == b"being written on another host"
    # Released (its writer died): the next run removes it, whatever its pid or host say.
    rc, _, err = run_main("convert", big_model, folder / "b.safetensors")
    assert rc == 0 and "warning: removed" in assert_one_error_line(err)
    assert not held.exists()


def test_live_run_keeps_its_temp_while_another_runs(big_model, cli_process, big_model_bf16):
    folder = big_model.parent
    first = stopped(
        "convert", "-q", big_model, folder / "a.safetensors", at="mid-tensor", env=NAMED
    )
    (temp,) = temps(folder)
    rc, _, err = cli_process("convert", "-q", big_model, folder / "b.safetensors", env=NAMED)
    assert (rc, err) == (0, "")
    assert temps(folder) == [temp]
    assert first.resume().finish() == (0, "")
    assert temps(folder) == []
    assert (folder / "a.safetensors").read_bytes() == big_model_bf16


def test_cleaner_touches_only_its_own_unlocked_temps(big_model, cli_process):
    folder = big_model.parent
    outside = folder / "sub"
    outside.mkdir()
    (outside / "keep.tmp").write_bytes(b"k")
    (folder / ".stcast-notes.txt").write_bytes(b"n")
    (folder / "stcast-x.tmp").write_bytes(b"n")
    (folder / ".stcast-link.tmp").symlink_to(outside / "keep.tmp")
    (folder / ".stcast-dir.tmp").mkdir()
    os.mkfifo(folder / ".stcast-fifo.tmp")
    before = listing(folder)
    # A FIFO among the temps: opening one would block, so a child with a timeout.
    rc, _, err = cli_process("convert", "-q", big_model, folder / "out.safetensors", timeout=30)
    assert (rc, err) == (0, "")
    assert listing(folder) == sorted(before + ["out.safetensors"])
    assert (outside / "keep.tmp").read_bytes() == b"k"


# --- two runs, one destination -----------------------------------------------------------------


@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_two_runs_one_destination(tmp_path, env, force):
    a = write_big_model(tmp_path / "a.safetensors", seed=1)
    b = write_big_model(tmp_path / "b.safetensors", seed=2)
    outs = {}
    for src in (a, b):
        stcast.convert(src, tmp_path / "ref.safetensors", force=True)
        outs[src.name] = (tmp_path / "ref.safetensors").read_bytes()
    os.remove(tmp_path / "ref.safetensors")
    dst = tmp_path / "out.safetensors"
    extra = ["--force"] if force else []
    # Both pass every check and stop just before publishing; then both go.
    runs = [stopped("convert", "-q", src, dst, *extra, at="publish", env=env) for src in (a, b)]
    for r in runs:
        r.resume()
    results = [r.finish() for r in runs]
    ok = [r for r in results if r[0] == 0]
    if force:
        assert results == [(0, ""), (0, "")]
    else:
        assert len(ok) == 1, results
        (rc, err) = next(r for r in results if r[0] != 0)
        assert rc == 1
        assert "destination exists" in assert_one_error_line(err)
    assert dst.read_bytes() in outs.values()  # one whole output, never a mix
    assert tensor_bytes(dst)["big"][0] == "BF16"
    assert listing(tmp_path) == ["a.safetensors", "b.safetensors", "out.safetensors"]


# --- the input modified while it is read ------------------------------------------------------


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def rewrite_in_place(path):
    with open(path, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(b"\xff" * 4096)


def append(path):
    with open(path, "ab") as f:
        f.write(b"\0" * 8)


CHANGES = {
    "truncate": (truncate, "its size went from"),
    "rewrite": (rewrite_in_place, "it was modified"),
    "append": (append, "its size went from"),
}


@pytest.mark.parametrize("at", ["prealloc", "mid-tensor"])
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
def test_input_changed_while_read_is_refused(big_model, change, at, env):
    folder = big_model.parent
    dst = folder / "out.safetensors"
    dst.write_bytes(b"the old output")
    run = stopped("convert", big_model, dst, "--force", at=at, env=env)
    modify, words = CHANGES[change]
    modify(big_model)
    rc, err = run.resume().finish()
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert line.startswith(f"stcast: {big_model}: input changed while being read ({words}"), line
    assert line.endswith("no output was written"), line
    assert "Traceback" not in err
    assert dst.read_bytes() == b"the old output"
    assert listing(folder) == ["model.safetensors", "out.safetensors"]


def test_input_changed_after_the_last_read_is_harmless(big_model, big_model_bf16):
    """At fsync every byte is read and checked: a later change cannot reach the output."""
    folder = big_model.parent
    run = stopped("convert", big_model, folder / "out.safetensors", at="fsync")
    rewrite_in_place(big_model)
    assert run.resume().finish()[0] == 0
    assert (folder / "out.safetensors").read_bytes() == big_model_bf16


def test_input_replaced_by_rename_keeps_converting_the_old_file(big_model, big_model_bf16):
    """Tools that save by writing a new file and renaming it over do not disturb a run."""
    folder = big_model.parent
    run = stopped("convert", big_model, folder / "out.safetensors", at="mid-tensor")
    write_big_model(folder / "new.safetensors", seed=9)
    os.replace(folder / "new.safetensors", big_model)
    assert run.resume().finish() == (0, "")
    assert (folder / "out.safetensors").read_bytes() == big_model_bf16


# --- Ctrl-C and write failures through the API -------------------------------------------------


SIGINT_CHILD = """
import os, signal, sys, stcast
calls = []
def progress(done, total):
    calls.append(done)
    if len(calls) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGINT)
try:
    stcast.convert(sys.argv[1], sys.argv[2], progress=progress, force=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", calls)
"""


@pytest.mark.parametrize("at_call", [1, 2])
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_api_sigint_from_progress(tmp_path, at_call, force):
    # 80 MiB: more than one 64 MiB step, so the second call is mid-way.
    n = (80 << 20) // 4
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [n], np.ones(n, np.float32))}
    )
    dst = tmp_path / "out.safetensors"
    if force:
        dst.write_bytes(b"old")
    before = snapshot(tmp_path)
    proc = run_python("-c", SIGINT_CHILD, src, dst, at_call)
    assert proc.stdout.startswith("KeyboardInterrupt"), proc.stderr
    assert snapshot(tmp_path) == before


def test_api_sigint_in_process(tmp_path):
    """The same inside the test process: KeyboardInterrupt reaches the caller."""
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [4], np.ones(4, np.float32))}
    )

    def progress(done, total):
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        stcast.convert(src, tmp_path / "out.safetensors", progress=progress)
    assert listing(tmp_path) == ["in.safetensors"]


def test_api_failpoint_eio(tmp_path):
    """Through the API, a write failure is an OSError naming the destination."""
    src = write_safetensors(
        tmp_path / "in.safetensors", {"x": ("F32", [4], np.ones(4, np.float32))}
    )
    code = (
        "import sys, stcast\n"
        "try:\n"
        "    stcast.convert(sys.argv[1], sys.argv[2])\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e.errno, e.filename, '|', e)\n"
    )
    dst = tmp_path / "out.safetensors"
    proc = run_python("-c", code, src, dst, env={"STCAST_FAILPOINT": "fsync=eio"})
    kind, errno_, filename, *_ = proc.stdout.split()
    assert (kind, int(errno_), filename) == ("OSError", 5, str(dst)), proc.stdout + proc.stderr
    assert "fsync" in proc.stdout
    assert listing(tmp_path) == ["in.safetensors"]
