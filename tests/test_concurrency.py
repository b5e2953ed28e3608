"""Concurrent runs into one destination: N `--shard i/N` runs started together all succeed,
then `finalize` completes the folder, equal byte for byte to a plain conversion; and no run
deletes or replaces what another wrote.

Two kinds of tests:
- a stress loop (4 and 16 CLI runs at once, ten times each, tiny files): it asserts only
  outcomes, never timings, so it cannot flake once the product is right;
- deterministic interleavings: one run stopped at a folder failpoint (folder-checked,
  folder-manifest, folder-file, folder-complete; finalize at folder-publish) while another
  run and finalize go, then resumed. And the survey race the stress loop finds, made exact
  by running a rival between two steps of the survey (in-process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import stcast
from conftest import assert_one_error_line, listing, tree, write_checkpoint_folder
from helpers import Run, cli_env, run_cli, stopped, with_points

NAMED = {"STCAST_FAILPOINT": "tmpfile=eopnotsupp"}


def plain_tree(src):
    with tempfile.TemporaryDirectory() as d:
        stcast.convert(src, os.path.join(d, "out"))
        return tree(os.path.join(d, "out"))


def stcast_files(folder):
    return [n for n in listing(folder) if n.startswith(".stcast-")]


def identities(folder, names):
    return {n: (os.lstat(folder / n).st_dev, os.lstat(folder / n).st_ino) for n in names}


# --- the stress loop ---------------------------------------------------------------------------


def run_shards_at_once(src, dst, n, env):
    """Start `--shard i/n` for every i at once; return [(i, exit code, stderr)]."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "stcast", "convert", str(src), str(dst), "--shard", f"{i}/{n}"]
            + ["-q"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=cli_env(env),
        )
        for i in range(1, n + 1)
    ]
    return [(i, p.wait(120), p.stderr.read().decode()) for i, p in enumerate(procs, 1)]


@pytest.mark.parametrize("n", [4, 16])
def test_shard_runs_started_together_all_succeed(tmp_path, n):
    """Four runs failed 18 times in 32 (a run's manifest temp deleted by another as stale).
    Ten times: n runs at once (named temps every other time), then finalize; each time every
    run succeeds, silently, and the folder equals a plain conversion byte for byte."""
    src = write_checkpoint_folder(tmp_path / "src", files=16)
    expected = plain_tree(src)
    failures = []
    for it in range(10):
        dst = tmp_path / f"out{it}"
        env = NAMED if it % 2 else {}
        results = run_shards_at_once(src, dst, n, env)
        failures += [(it, i, rc, err) for i, rc, err in results if (rc, err) != (0, "")]
        rc, _, err = run_cli("finalize", src, dst, "-q", env=env)
        failures += [(it, "finalize", rc, err)] if (rc, err) != (0, "") else []
        if rc == 0:
            assert tree(dst) == expected, it
    assert failures == [], f"{len(failures)} of {10 * (n + 1)} runs failed: {failures[:3]}"


def test_survey_race_with_a_rival_shard(tmp_path):
    """Shard 2/2 runs whole between the two steps of shard 1/2's survey: the folder listed,
    the manifests not yet read (the engine's `folder-listed` point)."""
    src = write_checkpoint_folder(tmp_path / "src", files=2)
    dst = tmp_path / "out"
    dst.mkdir()
    first = stopped("convert", src, dst, "--shard", "1/2", "-q", at="folder-listed")
    assert run_cli("convert", src, dst, "--shard", "2/2", "-q") == (0, "", "")
    assert first.run_through() == (0, "")


def test_a_live_runs_named_temp_is_not_taken_for_stale(tmp_path, run_main):
    """The finding behind 18 failures in 32: a run's manifest temp (named, flock-held) was
    removed by another run as stale. Shard 1 stops with its manifest temp written, shard 2
    runs whole (its cleaner passes by), then shard 1 goes on."""
    src = write_checkpoint_folder(tmp_path / "src", files=2)
    dst = tmp_path / "out"
    first = stopped("convert", src, dst, "--shard", "1/2", "-q", at="write-temp", env=NAMED)
    (temp,) = [n for n in listing(dst) if n.endswith(".tmp")]
    rc, _, err = run_cli("convert", src, dst, "--shard", "2/2", "-q", env=NAMED)
    assert (rc, err) == (0, "")
    assert temp in listing(dst)
    assert first.run_through() == (0, "")
    assert run_main("finalize", src, dst, "-q") == (0, "", "")
    assert tree(dst) == plain_tree(src)


# --- deterministic interleavings ---------------------------------------------------------------

# Shard 1 of 2 (two weight files of four) stopped at each folder step; at folder-file it
# has converted one file of its two.
STEPS = ["folder-checked", "folder-manifest", "folder-file", "folder-complete"]


@pytest.mark.parametrize(
    "step",
    STEPS,
)
@pytest.mark.parametrize("env", [{}, NAMED], ids=["tmpfile", "named"])
def test_a_shard_run_stopped_at_each_step(tmp_path, run_main, step, env):
    src = write_checkpoint_folder(tmp_path / "src", files=4)
    expected = plain_tree(src)
    dst = tmp_path / "out"
    first = stopped("convert", src, dst, "--shard", "1/2", "-q", at=step, env=env)
    rc, _, err = run_cli("convert", src, dst, "--shard", "2/2", "-q", env=env)
    assert (rc, err) == (0, "")
    theirs = [n for n in listing(dst) if n.endswith(".safetensors")]
    written = identities(dst, theirs)
    rc, _, err = run_main("finalize", src, dst)
    if step != "folder-complete":
        # Shard 1 has files left to convert: finalize refuses, naming the shard (and the
        # file, before shard 1 wrote its manifest).
        assert rc == 1, err
        line = assert_one_error_line(err)
        said = "not converted" if step == "folder-checked" else "has not finished"
        assert said in line and "--shard 1/2" in line, line
    assert first.run_through() == (0, "")
    assert identities(dst, theirs) == written  # nothing of shard 2 was replaced
    assert run_main("finalize", src, dst, "-q") == (0, "", "")
    assert identities(dst, theirs) == written
    assert tree(dst) == expected


def test_two_finalize_runs_at_once(tmp_path, run_main):
    """Finalize stopped before its copies while another finalize completes the folder: the
    first then succeeds or fails cleanly; the folder is complete, with no stcast file."""
    src = write_checkpoint_folder(tmp_path / "src", files=4)
    dst = tmp_path / "out"
    for i in (1, 2):
        assert run_main("convert", src, dst, "--shard", f"{i}/2", "-q") == (0, "", "")
    first = stopped("finalize", src, dst, "-q", at="folder-publish")
    assert run_cli("finalize", src, dst, "-q") == (0, "", "")
    rc, err = first.run_through()
    if rc != 0:
        line = assert_one_error_line(err)
        assert rc == 1 and ("destination exists" in line or "another stcast run took" in line)
    assert tree(dst) == plain_tree(src)


@pytest.mark.parametrize("step", ["folder-checked", "folder-manifest", "folder-file"])
def test_a_whole_run_and_a_shard_run_at_once(tmp_path, run_main, step):
    """A whole-folder run stopped at a step while a shard run of the same source writes into
    the same folder: neither replaces the other's files; the whole run then fails cleanly
    (`destination exists`) or succeeds, and --resume completes the folder."""
    src = write_checkpoint_folder(tmp_path / "src", files=4)
    dst = tmp_path / "out"
    whole = stopped("convert", src, dst, "-q", at=step)
    rc, _, err = run_cli("convert", src, dst, "--shard", "2/2", "-q")
    assert (rc, err) == (0, "")
    theirs = [n for n in listing(dst) if n.endswith(".safetensors")]
    written = identities(dst, theirs)
    rc, err = whole.run_through()
    if rc != 0:
        assert rc == 1 and "destination exists" in assert_one_error_line(err), err
    assert identities(dst, theirs) == written
    assert run_main("convert", src, dst, "--resume", "-q") == (0, "", "")
    assert tree(dst) == plain_tree(src)


@pytest.mark.parametrize("other", ["same-source", "another-source"])
def test_two_whole_runs_past_their_checks(tmp_path, run_main, other):
    src = write_checkpoint_folder(tmp_path / "src", files=2)
    rival = src if other == "same-source" else write_checkpoint_folder(tmp_path / "src2", 2)
    dst = tmp_path / "out"
    env = with_points({}, "folder-checked=stop", "folder-manifest=stop")
    a = Run("convert", src, dst, "-q", env=env).wait_stopped()  # checked, nothing written
    b = Run("convert", rival, dst, "-q", env=env).wait_stopped()
    a.resume().wait_stopped()  # a's manifest written
    b.resume()
    if b.stops():  # b's manifest written too (over a's): a goes first, then b
        ra, rb = a.run_through(), b.run_through()
    else:
        ra, rb = a.run_through(), b.finish()
    results = sorted([ra[0], rb[0]])
    assert results == [0, 1], (ra, rb)
    winner = src if ra[0] == 0 else rival
    assert tree(dst) == plain_tree(winner)


POINTS = ["folder-checked", "folder-manifest", "folder-file", "folder-publish"]


@pytest.mark.parametrize("second", POINTS)
@pytest.mark.parametrize("first", POINTS)
@pytest.mark.parametrize("earlier", [False, True], ids=["new", "over-an-earlier-output"])
def test_two_force_runs_at_once(tmp_path, run_main, first, second, earlier):
    """Two `--force` runs into one folder, A stopped at one point, B at another, then A
    run through, then B. The loser was told `... (--force does)`, though it had used
    --force, and both could fail (A replaced a shard B had written, B then failed its
    re-check), leaving a manifest. Now a run whose manifest another run replaced or removed
    stops before writing on, saying so; at least one run succeeds, with a plain output."""
    src = write_checkpoint_folder(tmp_path / "src", files=3)
    dst = tmp_path / "out"
    if earlier:
        assert run_main("convert", src, dst, "-q") == (0, "", "")
    a = stopped("convert", src, dst, "--force", "-q", at=first)
    b = stopped("convert", src, dst, "--force", "-q", at=second)
    ra, rb = a.run_through(), b.run_through()
    assert 0 in (ra[0], rb[0]), (ra, rb)
    for rc, err in (ra, rb):
        if rc != 0:
            line = assert_one_error_line(err)
            assert rc == 1 and "another stcast run" in line and "--force does" not in line, err
    assert tree(dst) == plain_tree(src)


def test_the_same_shard_twice_is_refused(tmp_path, run_main):
    src = write_checkpoint_folder(tmp_path / "src", files=2)
    dst = tmp_path / "out"
    first = stopped("convert", src, dst, "--shard", "1/2", "-q", at="folder-manifest")
    before = tree(dst)
    rc, _, err = run_cli("convert", src, dst, "--shard", "1/2", "-q")
    assert rc == 1 and "this shard already ran here" in assert_one_error_line(err)
    assert tree(dst) == before
    assert first.run_through() == (0, "")
    env = with_points({}, "folder-checked=eio")  # refusals come before that point
    rc, _, err = run_cli("convert", src, dst, "--shard", "1/2", "-q", env=env)
    assert rc == 1 and "this shard already ran here" in assert_one_error_line(err)
