"""Faults made deterministic: a full disk, a read-only folder, write errors and Ctrl-C with the
named temp file, SIGKILL, rival runs, and an input modified while it is read.

Runs stop at an exact point with `STCAST_FAILPOINT=POINT=stop` (the process raises SIGSTOP);
the test waits for the stop with `waitpid(WUNTRACED)`, acts, and resumes or kills it: no
sleeping. The failpoint `tmpfile=eopnotsupp` makes stcast use a named, flock-held temp file
instead of O_TMPFILE, as on a file system without it. Tests that mount a tmpfs need root and
are skipped without it (CI runs as root).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, listing, tensor_bytes, write_safetensors
from helpers import stopped, with_points

# The CLI converts in 8 MiB windows: a 10 MiB first tensor spans two, so `mid-tensor` is
# reached with half of the input read.
BIG = (10 << 20) // 4
NAMED = {"STCAST_FAILPOINT": "tmpfile=eopnotsupp"}


TEMP = re.compile(r"^\.stcast-.*\.tmp$")


def make_model(path, seed=0):
    x = np.random.default_rng(seed).standard_normal(BIG).astype(np.float32)
    return write_safetensors(path, {"big": ("F32", [BIG], x), "small": ("I8", [3], b"\1\2\3")})


@pytest.fixture
def model(tmp_path):
    return make_model(tmp_path / "model.safetensors")


@pytest.fixture
def expected(model, tmp_path_factory):
    """The bytes a clean conversion of `model` gives."""
    out = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    stcast.convert(model, out)
    return out.read_bytes()


def snapshot(folder):
    return {p: (folder / p).read_bytes() for p in listing(folder) if (folder / p).is_file()}


def temps(folder):
    return [p for p in listing(folder) if TEMP.match(p)]


# --- disk full and read-only folders (tmpfs) ---------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs folder of that size; unmounted afterwards."""
    mounted = []

    def mount(size="1M", name="mnt"):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (CI runs as root)")
        d = tmp_path / name
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "stcast-test", d], check=True)
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        subprocess.run(["umount", d], check=True)


@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
def test_disk_full_fails_before_converting(model, tmpfs, cli, env):
    mnt = tmpfs("1M")
    dst = mnt / "out.safetensors"
    # mid-tensor=eio proves nothing was converted: reaching the first window would fail there.
    rc, out, err = cli("convert", model, dst, env=with_points(env, "mid-tensor=eio"))
    assert rc == 1, err
    line = assert_one_error_line(err)
    m = re.fullmatch(rf"stcast: {mnt}: not enough disk space: need (.+), have (.+)", line)
    assert m, line
    assert m.group(1) == "5.24 MB" and m.group(2) == "1.05 MB", line
    assert listing(mnt) == []
    rc, out, _ = cli("convert", "--json", model, dst)
    assert rc == 1 and '"kind": "no_space"' in out
    with pytest.raises(stcast.StcastError) as info:
        stcast.convert(model, dst)
    assert info.value.kind == "no_space" and info.value.path == str(mnt)
    assert listing(mnt) == []


def test_disk_full_keeps_the_old_destination(model, tmpfs, cli):
    mnt = tmpfs("1M")
    dst = mnt / "out.safetensors"
    dst.write_bytes(b"the old output")
    rc, _, err = cli("convert", model, dst, "--force")
    assert rc == 1 and "not enough disk space" in assert_one_error_line(err)
    assert snapshot(mnt) == {"out.safetensors": b"the old output"}


def test_small_output_fits_on_tmpfs(tmp_path, tmpfs, cli):
    mnt = tmpfs("1M")
    src = write_safetensors(tmp_path / "s.safetensors", {"x": ("F32", [1000], np.ones(1000, "f4"))})
    rc, _, err = cli("convert", "-q", src, mnt / "s.safetensors", env=NAMED)
    assert rc == 0, err
    assert listing(mnt) == ["s.safetensors"]


@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_read_only_folder(model, tmpfs, cli, env, force):
    mnt = tmpfs("1M")
    dst = mnt / "out.safetensors"
    if force:
        dst.write_bytes(b"old")
    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    before = snapshot(mnt)
    args = ["convert", model, dst] + (["--force"] if force else [])
    rc, _, err = cli(*args, env=env)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert line == f"stcast: {mnt}: cannot create the output: Read-only file system", line
    assert snapshot(mnt) == before
    with pytest.raises(OSError) as info:
        stcast.convert(model, dst, force=force)
    assert info.value.filename == str(mnt)


# --- write errors and Ctrl-C with the named temp file (test_interrupt.py covers O_TMPFILE) ------

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
def test_named_temp_faults_leave_nothing(model, cli, point, action, force):
    folder = model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    args = ["convert", model, dst] + (["--force"] if force else [])
    rc, _, err = cli(*args, env=with_points(NAMED, f"{point}={action}"))
    line = assert_one_error_line(err)
    if action == "sigint":
        assert (rc, line) == (130, "stcast: interrupted"), err
    else:
        assert rc == 1, err
        assert str(dst) in line
        assert ("No space left" if action == "enospc" else "Input/output error") in line, line
    assert snapshot(folder) == before


# --- SIGKILL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_sigkill_with_tmpfile_leaves_nothing(model, force):
    folder = model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    run = stopped("convert", model, dst, *(["--force"] if force else []), at="mid-tensor")
    assert snapshot(folder) == before  # half-way through, nothing is visible
    rc, _ = run.kill()
    assert rc == -signal.SIGKILL
    assert snapshot(folder) == before


def test_sigkill_named_temp_is_removed_by_the_next_run(model, cli, expected):
    folder = model.parent
    run = stopped("convert", model, folder / "a.safetensors", at="mid-tensor", env=NAMED)
    (temp,) = temps(folder)
    assert run.kill()[0] == -signal.SIGKILL
    assert temps(folder) == [temp]  # a killed run cannot clean up: the next one does

    rc, _, err = cli("convert", "-q", model, folder / "b.safetensors")
    assert rc == 0, err
    line = assert_one_error_line(err)
    assert line.startswith(f"stcast: warning: removed {folder / temp}, a temp file left by"), line
    assert listing(folder) == ["b.safetensors", "model.safetensors"]
    assert (folder / "b.safetensors").read_bytes() == expected


def test_stale_temp_removal_through_the_api(model):
    folder = model.parent
    stopped("convert", model, folder / "a.safetensors", at="mid-tensor", env=NAMED).kill()
    (temp,) = temps(folder)
    with pytest.warns(stcast.StcastWarning, match=f"removed .*{re.escape(temp)}"):
        report = stcast.convert(model, folder / "b.safetensors")
    assert temps(folder) == [] and len(report.warnings) == 1


def test_temp_whose_lock_is_held_is_left_alone(model, cli):
    folder = model.parent
    held = folder / ".stcast-otherhost-4242-00000000deadbeef.tmp"
    held.write_bytes(b"being written on another host")
    with open(held, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        rc, _, err = cli("convert", "-q", model, folder / "a.safetensors", env=NAMED)
        assert (rc, err) == (0, "")
        assert held.read_bytes() == b"being written on another host"
    # Released (its writer died): the next run removes it, whatever its pid or host say.
    rc, _, err = cli("convert", "-q", model, folder / "b.safetensors")
    assert rc == 0 and "warning: removed" in assert_one_error_line(err)
    assert not held.exists()


def test_live_run_keeps_its_temp_while_another_runs(model, cli, expected):
    folder = model.parent
    first = stopped("convert", "-q", model, folder / "a.safetensors", at="mid-tensor", env=NAMED)
    (temp,) = temps(folder)
    rc, _, err = cli("convert", "-q", model, folder / "b.safetensors", env=NAMED)
    assert (rc, err) == (0, "")
    assert temps(folder) == [temp]
    assert first.resume().finish() == (0, "")
    assert temps(folder) == []
    assert (folder / "a.safetensors").read_bytes() == expected


def test_cleaner_touches_only_its_own_unlocked_temps(model, cli):
    folder = model.parent
    outside = folder / "sub"
    outside.mkdir()
    (outside / "keep.tmp").write_bytes(b"k")
    (folder / ".stcast-notes.txt").write_bytes(b"n")
    (folder / "stcast-x.tmp").write_bytes(b"n")
    (folder / ".stcast-link.tmp").symlink_to(outside / "keep.tmp")
    (folder / ".stcast-dir.tmp").mkdir()
    os.mkfifo(folder / ".stcast-fifo.tmp")
    before = listing(folder)
    rc, _, err = cli("convert", "-q", model, folder / "out.safetensors", timeout=30)
    assert (rc, err) == (0, "")
    assert listing(folder) == sorted(before + ["out.safetensors"])
    assert (outside / "keep.tmp").read_bytes() == b"k"


# --- two runs, one destination -----------------------------------------------------------------


@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_two_runs_one_destination(tmp_path, env, force):
    a = make_model(tmp_path / "a.safetensors", seed=1)
    b = make_model(tmp_path / "b.safetensors", seed=2)
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
def test_input_changed_while_read_is_refused(model, change, at, env):
    folder = model.parent
    dst = folder / "out.safetensors"
    dst.write_bytes(b"the old output")
    run = stopped("convert", model, dst, "--force", at=at, env=env)
    modify, words = CHANGES[change]
    modify(model)
    rc, err = run.resume().finish()
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert line.startswith(f"stcast: {model}: input changed while being read ({words}"), line
    assert line.endswith("no output was written"), line
    assert "Traceback" not in err
    assert dst.read_bytes() == b"the old output"
    assert listing(folder) == ["model.safetensors", "out.safetensors"]


def test_input_changed_after_the_last_read_is_harmless(model, expected):
    """At fsync every byte is read and checked: a later change cannot reach the output."""
    folder = model.parent
    run = stopped("convert", model, folder / "out.safetensors", at="fsync")
    rewrite_in_place(model)
    assert run.resume().finish()[0] == 0
    assert (folder / "out.safetensors").read_bytes() == expected


def test_input_replaced_by_rename_keeps_converting_the_old_file(model, expected):
    """Tools that save by writing a new file and renaming it over do not disturb a run."""
    folder = model.parent
    run = stopped("convert", model, folder / "out.safetensors", at="mid-tensor")
    make_model(folder / "new.safetensors", seed=9)
    os.replace(folder / "new.safetensors", model)
    assert run.resume().finish() == (0, "")
    assert (folder / "out.safetensors").read_bytes() == expected
