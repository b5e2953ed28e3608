"""Ctrl-C and write failures, made deterministic with STCAST_FAILPOINT: nothing is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, listing, write_safetensors
from helpers import cli_env

# The CLI converts in 8 MiB windows; a first tensor of 10 MiB spans two, so the
# `mid-tensor` point is reached between them.
BIG = (10 << 20) // 4


@pytest.fixture
def model(tmp_path):
    x = np.arange(BIG, dtype=np.float32)
    return write_safetensors(
        tmp_path / "model.safetensors",
        {"big": ("F32", [BIG], x), "small": ("I8", [3], b"\x01\x02\x03")},
    )


def snapshot(folder):
    return {p: (folder / p).read_bytes() for p in listing(folder)}


POINTS = ["create", "prealloc", "mid-tensor", "fsync", "publish"]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_sigint_leaves_nothing(model, cli, point, force):
    folder = model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    args = ["convert", model, dst] + (["--force"] if force else [])
    rc, out, err = cli(*args, env={"STCAST_FAILPOINT": f"{point}=sigint"}, timeout=60)
    assert rc == 130, err
    assert "Traceback" not in err
    assert assert_one_error_line(err) == "stcast: interrupted"
    assert snapshot(folder) == before


@pytest.mark.parametrize("point", POINTS)
def test_sigint_json(model, cli, point):
    rc, out, err = cli(
        "convert",
        "--json",
        model,
        model.parent / "out.safetensors",
        env={"STCAST_FAILPOINT": f"{point}=sigint"},
        timeout=60,
    )
    assert rc == 130
    assert '"kind": "interrupted"' in out
    assert listing(model.parent) == ["model.safetensors"]


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
def test_write_failures(model, cli, spec, words, force):
    folder = model.parent
    dst = folder / "out.safetensors"
    if force:
        dst.write_bytes(b"the old output")
    before = snapshot(folder)
    args = ["convert", model, dst] + (["--force"] if force else [])
    rc, out, err = cli(*args, env={"STCAST_FAILPOINT": spec}, timeout=60)
    assert rc == 1, err
    line = assert_one_error_line(err)
    for w in words:
        assert w in line, line
    assert "Errno" not in line
    assert snapshot(folder) == before


def test_no_space_json_kind(model, cli):
    rc, out, _ = cli(
        "convert",
        "--json",
        model,
        model.parent / "out.safetensors",
        env={"STCAST_FAILPOINT": "publish=enospc"},
    )
    assert rc == 1 and '"kind": "no_space"' in out


def test_unknown_failpoint_is_ignored(model, cli):
    rc, _, err = cli(
        "convert",
        "-q",
        model,
        model.parent / "out.safetensors",
        env={"STCAST_FAILPOINT": "nowhere=eio,mid-tensor=nothing"},
    )
    assert rc == 0, err


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
    proc = subprocess.run(
        [sys.executable, "-c", SIGINT_CHILD, str(src), str(dst), str(at_call)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
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
    proc = subprocess.run(
        [sys.executable, "-c", code, str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env({"STCAST_FAILPOINT": "fsync=eio"}),
    )
    kind, errno_, filename, *_ = proc.stdout.split()
    assert (kind, int(errno_), filename) == ("OSError", 5, str(dst)), proc.stdout + proc.stderr
    assert "fsync" in proc.stdout
    assert listing(tmp_path) == ["in.safetensors"]
