"""Data safety of single-file runs and of the command line: the regression tests of the
data-safety review (docs/guarantees.md, "Guarantees").

- a `--report` path is checked before any work: never the input or the output, never a
  folder, a FIFO or a device, never in a missing folder, an existing one only with --force;
- after the commit point (the output's link) the output stays: a failure then is exit 1 with
  "X was published, but ...", and a late signal does not change the exit status;
- Ctrl-C from the entry point's first line on: no traceback, nothing written;
- `verify X X` is refused; usage errors are exit 2, never an internal error;
- reads are bounded (files of /proc and /sys whose size lies);
- names and paths with terminal control codes are escaped in every human-readable line.

Where a process boundary is under test (failpoints, signals, stdout on /dev/full, the
interpreter's encoding) the CLI runs in a child; elsewhere in-process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import stcast
from conftest import (
    assert_one_error_line,
    listing,
    tensor_bytes,
    tree,
    write_checkpoint_folder,
    write_safetensors,
)
from helpers import Run, cli_env, run_python

SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sighup": signal.SIGHUP}
WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


def write_model(path, n=64):
    x = np.linspace(-3, 3, n, dtype=np.float32)
    return write_safetensors(path, {"w": ("F32", [n], x), "ids": ("I64", [3], np.arange(3))})


@pytest.fixture
def model(tmp_path):
    return write_model(tmp_path / "m.safetensors")


# --- the report path is checked before any work --------------------------------------------


def _report_cases(tmp_path, model):
    """name -> (args, the words of the refusal); every refusal names the report path."""
    out = tmp_path / "o.safetensors"
    (tmp_path / "a-folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "old.json").write_text("an old report")
    os.link(model, tmp_path / "hard.json")
    (tmp_path / "sym.json").symlink_to(model)
    return {
        "input": (["--report", model], "the report path is the input file"),
        "input-hard-link": (["--report", tmp_path / "hard.json"], "is the input file"),
        "input-symlink": (["--report", tmp_path / "sym.json"], "is the input file"),
        "input-dotdot": (
            ["--report", tmp_path / "a-folder" / ".." / model.name],
            "is the input file",
        ),
        "output-new": (["--report", out], "the report path is the output file"),
        "output-dotdot": (["--report", tmp_path / "a-folder" / ".." / out.name], "output file"),
        "missing-folder": (["--report", tmp_path / "nope" / "r.json"], "folder does not exist"),
        "empty": (["--report", ""], "names no file"),
        "dot": (["--report", "."], "names no file"),
        "folder": (["--report", tmp_path / "a-folder"], "the report path is a folder"),
        "fifo": (["--report", tmp_path / "fifo"], "not a regular file"),
        "dev-null": (["--report", "/dev/null"], "not a regular file"),
        "dev-full": (["--report", "/dev/full"], "not a regular file"),
        "exists": (["--report", tmp_path / "old.json"], "destination exists"),
    }


REPORT_CASES = [
    "input",
    "input-hard-link",
    "input-symlink",
    "input-dotdot",
    "output-new",
    "output-dotdot",
    "missing-folder",
    "empty",
    "dot",
    "folder",
    "fifo",
    "dev-null",
    "dev-full",
    "exists",
]


@pytest.mark.parametrize("case", REPORT_CASES)
def test_convert_report_path_is_refused_before_any_work(tmp_path, model, cli_process, case):
    """`convert m o --report m` once replaced the input with JSON; `--report` into a missing
    folder, a folder, a FIFO (which hung) failed only after the output was published."""
    args, words = _report_cases(tmp_path, model)[case]
    before = tree(tmp_path)
    # A child with a timeout: a FIFO must not hang.
    rc, out, err = cli_process("convert", model, tmp_path / "o.safetensors", *args, timeout=30)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert words in line, line
    assert "was published" not in line
    assert tree(tmp_path) == before


def test_convert_report_on_the_output_with_force_is_refused(tmp_path, model, run_main):
    """`--report DST --force` replaced the fresh output with the report."""
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"the old output")
    before = tree(tmp_path)
    rc, _, err = run_main("convert", model, out, "--force", "--report", out)
    assert rc == 1 and "the report path is the output file" in assert_one_error_line(err)
    assert tree(tmp_path) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_report_path_that_cannot_be_created_is_refused_before_any_work(tmp_path, model, run_main):
    """A report in a folder where no file can be created (/proc/self, even for root): a
    folder run published DST (under --force, replacing an earlier one), then failed; its
    --dry-run said it would run (attack z10 r8). Refused up front as for a file."""
    report = "/proc/self/x"
    folder = tmp_path / "H"
    folder.mkdir()
    write_model(folder / "model.safetensors")
    stcast.convert(folder, tmp_path / "O")
    before = tree(tmp_path)
    for args in (
        [model, tmp_path / "o.safetensors"],
        [folder, tmp_path / "O2"],
        [folder, tmp_path / "O", "--force"],
        [folder, tmp_path / "O2", "--dry-run"],
    ):
        rc, out, err = run_main("convert", *args, "--report", report)
        assert rc == 1, (args, out, err)
        line = assert_one_error_line(err)
        assert "cannot create the output" in line and "was published" not in line, line
        assert tree(tmp_path) == before


@pytest.mark.parametrize("which", ["src", "dst", "src-hard-link", "dst-symlink"])
def test_verify_report_on_an_input_is_refused(tmp_path, model, run_main, which):
    """`verify SRC DST --report SRC` replaced the source with JSON."""
    dst = tmp_path / "o.safetensors"
    stcast.convert(model, dst)
    target = {
        "src": model,
        "dst": dst,
        "src-hard-link": tmp_path / "h.json",
        "dst-symlink": tmp_path / "s.json",
    }[which]
    if which == "src-hard-link":
        os.link(model, target)
    if which == "dst-symlink":
        target.symlink_to(dst)
    before = tree(tmp_path)
    for force in ([], ["--force"]):
        rc, _, err = run_main("verify", model, dst, "--report", target, *force)
        assert rc == 1, err
        assert "the report path is" in assert_one_error_line(err)
        assert tree(tmp_path) == before


@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_report_path_that_is_a_dangling_symlink(tmp_path, model, run_main, force):
    (tmp_path / "r.json").symlink_to(tmp_path / "nowhere")
    out = tmp_path / "o.safetensors"
    rc, _, err = run_main(
        "convert", model, out, "--report", tmp_path / "r.json", *(["--force"] * force)
    )
    if force:
        # --force replaces the name (never what a link points to), like the output's.
        assert (rc, err) == (0, ""), err
        assert not (tmp_path / "r.json").is_symlink() and out.exists()
    else:
        # Exists without --force: refused before any work, as a regular file would be.
        assert rc == 1 and "destination exists" in assert_one_error_line(err)
        assert "was published" not in err and not out.exists()


def test_report_on_a_full_disk_fails_before_the_commit(tmp_path, model, tmpfs, cli_process):
    """A report on a full disk was published as 0 bytes after the output: it is written and
    fsynced before the output's link, so a full disk leaves nothing."""
    mnt = tmpfs("64k", "full")
    (mnt / "filler").write_bytes(b"\0" * (64 << 10))
    while True:  # fill whatever the size rounding left
        try:
            with open(mnt / "filler", "ab") as f:
                f.write(b"\0" * 4096)
        except OSError:
            break
    before = tree(tmp_path / "full")
    out = tmp_path / "o.safetensors"
    rc, _, err = cli_process("convert", model, out, "--report", mnt / "r.json")
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "No space left" in line or "not enough disk space" in line, line
    assert "was published" not in line
    assert not out.exists()
    assert tree(tmp_path / "full") == before


@pytest.mark.parametrize("kind", ["char-device", "fifo", "socket"])
def test_force_never_replaces_a_special_file(tmp_path, model, run_main, kind):
    dst = tmp_path / "special"
    if kind == "char-device":
        if os.geteuid() != 0:
            pytest.skip("mknod needs root")
        os.mknod(dst, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a second /dev/null
    elif kind == "fifo":
        os.mkfifo(dst)
    else:
        import socket

        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(dst))
    mode = os.lstat(dst).st_mode
    rc, _, err = run_main("convert", model, dst, "--force")
    assert os.lstat(dst).st_mode == mode, "the special file was replaced"
    assert rc == 1 and "not a regular file" in assert_one_error_line(err), err


# --- after the commit point ------------------------------------------------------------------


def _stdout_to(path, *args, env=None, timeout=60):
    with open(path, "w") as stdout:
        proc = subprocess.run(
            [sys.executable, "-m", "stcast", *map(str, args)],
            stdout=stdout,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=cli_env(env),
            timeout=timeout,
        )
    return proc.returncode, proc.stderr.decode()


@pytest.mark.parametrize("command", ["convert", "convert-folder", "finalize", "verify-report"])
def test_stdout_on_a_full_disk_after_the_commit(tmp_path, model, command):
    """stdout on /dev/full: exit 1, one line saying what was published, and it stays."""
    if command == "convert":
        published = tmp_path / "o.safetensors"
        args = ["convert", model, published]
    elif command == "convert-folder":
        src = write_checkpoint_folder(tmp_path / "src")
        published = tmp_path / "out"
        args = ["convert", src, published]
    elif command == "finalize":
        src = write_checkpoint_folder(tmp_path / "src")
        published = tmp_path / "out"
        for i in (1, 2):
            stcast.convert(src, published, shard=(i, 2))
        args = ["finalize", src, published]
    else:
        dst = tmp_path / "o.safetensors"
        stcast.convert(model, dst)
        published = tmp_path / "r.json"
        args = ["verify", model, dst, "--report", published]
    rc, err = _stdout_to("/dev/full", *args)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert line == (
        f"stcast: {published} was published, but writing to stdout failed: No space left on device"
    ), line
    assert published.exists()
    if command in ("convert-folder", "finalize"):
        assert (published / "model.safetensors.index.json").exists()
        assert not [n for n in listing(published) if n.startswith(".stcast-")]


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_stdout_closed_after_the_commit(tmp_path, model, cli_process, command):
    out = tmp_path / "o.safetensors"
    if command == "verify":
        stcast.convert(model, out)
    closed = ["sh", "-c", 'exec "$@" >&-', "sh"]
    rc, _, err = cli_process(command, model, out, wrap=closed)
    assert out.exists()
    assert "Traceback" not in err and "internal error" not in err, err
    if rc != 0:  # nothing to say it on: an exit 0 or the post-commit line
        assert rc == 1 and "was published, but" in assert_one_error_line(err)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_names_the_stdout_encoding_cannot_print(tmp_path, encoding):
    """A file name the stdout encoding cannot print was an internal error (UnicodeEncodeError)
    after the output was published: it is printed with escapes, exit 0."""
    src = write_model(tmp_path / "módel-✓-\udcff.safetensors")  # \udcff: the byte 0xff
    dst = tmp_path / "out-✓.safetensors"
    env = {"PYTHONIOENCODING": encoding}
    for args in (["convert", src, dst], ["verify", src, dst], ["inspect", src]):
        proc = subprocess.run(
            [sys.executable, "-m", "stcast", *map(os.fsdecode, args)],
            capture_output=True,
            env=cli_env(env),
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == b""
        assert b"Traceback" not in proc.stdout
        if args[0] != "inspect":  # inspect does not print the path
            assert b"\\u2713-\\xff.safetensors" in proc.stdout, proc.stdout
    assert tensor_bytes(dst)["w"][0] == "BF16"


def _stop_after_the_commit(tmp_path, model, env=None):
    """A convert run with a report, stopped at its second `publish` failpoint: the output is
    linked (the commit point), the report not yet."""
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    run = Run("convert", model, out, "--report", rep, env={"STCAST_FAILPOINT": "publish=stop"})
    run.wait_stopped()
    assert not out.exists()
    run.resume().wait_stopped()
    assert out.exists() and not rep.exists()
    return run, out, rep


@pytest.mark.parametrize("sig", list(SIGNALS.values()), ids=list(SIGNALS))
def test_a_late_signal_does_not_change_the_outcome(tmp_path, model, sig):
    """A signal after the output's link changes nothing: exit 0, the output and the report
    are both there (Ctrl-C during the final publish once exited 130 with the output
    published)."""
    run, out, rep = _stop_after_the_commit(tmp_path, model)
    os.kill(run.proc.pid, sig)
    assert run.resume().finish() == (0, "")
    assert tensor_bytes(out)["w"][0] == "BF16"
    assert json.loads(rep.read_text())


def test_a_failure_after_the_commit_says_what_was_published(tmp_path, model):
    run, out, rep = _stop_after_the_commit(tmp_path, model)
    rep.write_text("someone else's")
    rc, err = run.resume().finish()
    assert rc == 1, err
    assert assert_one_error_line(err) == (
        f"stcast: {out} was published, but then {rep}: destination exists (--force replaces it)"
    )
    assert tensor_bytes(out)["w"][0] == "BF16"
    assert rep.read_text() == "someone else's"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_late_signal_and_a_failure_after_the_commit(tmp_path, model, sig):
    run, out, rep = _stop_after_the_commit(tmp_path, model)
    rep.write_text("someone else's")
    os.kill(run.proc.pid, sig)
    rc, err = run.resume().finish()
    assert out.exists()
    assert rc == 1, err
    assert "was published, but" in assert_one_error_line(err)


# --- Ctrl-C from the entry point's first line on ---------------------------------------------

# Raises SIGNAL the moment MODULE starts to be imported, then runs `python -m stcast ARGS`:
# a signal at an exact point of the start-up, without any timing.
EARLY_SIGNAL = """
import importlib.abc, os, runpy, signal, sys
module, sig = sys.argv[1], int(sys.argv[2])
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), sig)
        return None
sys.meta_path.insert(0, Hook())
sys.argv = ["stcast", *sys.argv[3:]]
runpy.run_module("stcast", run_name="__main__", alter_sys=True)
"""

# What the CLI imports after the entry point installed its handlers (none of them is
# imported before: see python/stcast/__main__.py).
STARTUP_MODULES = ["stcast.cli", "argparse", "json", "stcast._core", "stcast.errors"]
CONVERT_MODULES = ["stcast._api", "stcast._engine", "stcast.reports"]


# Every module with SIGINT; SIGTERM and SIGHUP at two of them.
EARLY = [(m, signal.SIGINT) for m in STARTUP_MODULES + CONVERT_MODULES] + [
    (m, s) for m in ("stcast.cli", "stcast._api") for s in (signal.SIGTERM, signal.SIGHUP)
]


@pytest.mark.parametrize("module, sig", EARLY, ids=[f"{m}-{s.name}" for m, s in EARLY])
def test_a_signal_during_start_up(tmp_path, model, module, sig):
    """Ctrl-C in the first ~50 ms printed a KeyboardInterrupt traceback: now the run stops
    with one line, writes nothing and dies of the signal."""
    before = tree(tmp_path)
    out = tmp_path / "o.safetensors"
    proc = run_python("-c", EARLY_SIGNAL, module, int(sig), "convert", model, out)
    assert proc.returncode == -sig, proc.stderr
    assert "Traceback" not in proc.stderr
    assert assert_one_error_line(proc.stderr) == f"stcast: {WORDS[sig]}"
    assert tree(tmp_path) == before


# --- verify X X ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["same", "dotdot", "hard-link", "symlink"])
def test_verify_a_file_against_itself_is_refused(tmp_path, model, run_main, how):
    """`stcast verify X X` exited 0."""
    other = {
        "same": model,
        "dotdot": tmp_path / "sub" / ".." / model.name,
        "hard-link": tmp_path / "h.safetensors",
        "symlink": tmp_path / "s.safetensors",
    }[how]
    (tmp_path / "sub").mkdir()
    if how == "hard-link":
        os.link(model, other)
    if how == "symlink":
        other.symlink_to(model)
    for args in ([model, other], [other, model], [model, other, "--loose"]):
        rc, out, err = run_main("verify", *args)
        assert rc == 1, err
        assert "SRC and DST are the same file" in assert_one_error_line(err)
        rc, out, err = run_main("verify", *args, "--json")
        assert rc == 1 and json.loads(out)["error"]["kind"] == "refused"
    with pytest.raises(stcast.Refused):
        stcast.verify(model, other)


def test_verify_the_same_file_through_a_bind_mount(tmp_path, model, mount_ns, cli_process):
    (tmp_path / "b").mkdir()
    mount_ns.bind(tmp_path, tmp_path / "b")
    rc, _, err = cli_process("verify", model, tmp_path / "b" / model.name, wrap=mount_ns.wrap())
    assert rc == 1 and "SRC and DST are the same file" in assert_one_error_line(err)


# --- usage errors are exit 2, never an internal error ----------------------------------------

USAGE = [
    ["convert", "M", "O", "--threads", "99999"],
    ["convert", "M", "O", "--threads", "1025"],
    ["convert", "M", "O", "--threads", "1" + "0" * 30],
    ["inspect", "M", "--scan", "--threads", "99999"],
    ["verify", "M", "M", "--threads", "99999"],
    ["convert", "M", "O", "--keep-min-size", "9" * 20],
    ["convert", "M", "O", "--keep-min-size", str(2**64)],
    ["convert", "M", "O", "--keep-min-size", "-1"],
    ["inspect", "M", "--keep-min-size", "9" * 20],
    ["convert", "F", "O", "--shard", "1/1000000000000"],
    ["convert", "F", "O", "--shard", "1/10000000"],
    ["convert", "F", "O", "--shard", "1/" + "9" * 40],
    ["convert", "F", "O", "--shard", "3/3"],
    ["convert", "F", "O", "--shard", "0/2"],
    ["convert", "F", "O", "--shard", "2/1"],
    ["convert", "F", "O", "--shard", "1/-2"],
    ["convert", "F", "O", "--shard", "x"],
    ["convert", "M", "O", "--shard", "1/2"],
    ["convert", "M", "O", "--resume"],
    ["demo", "--size-gib", "0"],
    ["demo", "--size-gib", "-1"],
    ["demo", "--size-gib", "inf"],
    ["demo", "--size-gib", "nan"],
    ["demo", "--size-gib", "x"],
]


@pytest.mark.parametrize("argv", USAGE, ids=[" ".join(a)[:40] for a in USAGE])
def test_usage_errors_exit_2(tmp_path, model, run_main, argv):
    folder = write_checkpoint_folder(tmp_path / "f")
    before = tree(tmp_path)
    names = {"M": str(model), "F": str(folder), "O": str(tmp_path / "o")}
    started = time.monotonic()
    rc, out, err = run_main(*[names.get(a, a) for a in argv], cwd=tmp_path)
    assert rc == 2, err
    assert "internal error" not in err and "Traceback" not in err
    assert time.monotonic() - started < 2, "a usage error must come at once"
    assert tree(tmp_path) == before


@pytest.mark.parametrize("size", ["1e300", "1e308"])
def test_demo_with_an_absurd_size_is_a_usage_error(tmp_path, run_main, size):
    rc, out, err = run_main("demo", "--size-gib", size, "--dir", tmp_path)
    assert rc == 2, err
    assert "internal error" not in err
    assert listing(tmp_path) == []


DEMO_MEMORY_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (200 << 20, 200 << 20))
from stcast.__main__ import main
sys.exit(main(["demo", "--size-gib", sys.argv[1], "--dir", sys.argv[2]]))
"""


def test_demo_larger_than_the_disk_fails_at_once(tmp_path):
    # Under a 200 MiB data limit, so that the bug shows as a MemoryError, not a full host.
    # 60,000 GiB: within --size-gib's range, far beyond this disk.
    proc = run_python("-c", DEMO_MEMORY_CHILD, "60000", tmp_path, env={"OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    line = assert_one_error_line(proc.stderr)
    assert "internal error" not in line and "disk" in line, line


# --- bounded reads -----------------------------------------------------------------------------

# Regular files whose size lies: /proc files say 0 bytes (pagemap would give gigabytes),
# /sys files say 4096 and give a few.
LIARS = ["/proc/self/pagemap", "/proc/self/status", "/sys/kernel/mm/transparent_hugepage/enabled"]


@pytest.mark.parametrize("liar", LIARS)
def test_files_whose_size_lies_are_read_within_their_size(tmp_path, cli_process, liar):
    """/proc/self/pagemap (a regular file of 0 bytes) was read unboundedly."""
    if not os.path.exists(liar):
        pytest.skip(f"no {liar} here")
    (tmp_path / "l.safetensors").symlink_to(liar)
    good = write_model(tmp_path / "g.safetensors")
    runs = [
        ["convert", liar, tmp_path / "o.safetensors"],
        ["convert", tmp_path / "l.safetensors", tmp_path / "o.safetensors"],
        ["inspect", liar],
        ["inspect", liar, "--scan"],
        ["verify", liar, good],
        ["verify", good, liar],
    ]
    for args in runs:
        rc, out, err = cli_process(*args, timeout=30)
        assert rc == 1, (args, err)
        line = assert_one_error_line(err)
        # pagemap and status say 0 bytes: "an empty file"; a /sys file cannot even be mapped.
        assert any(
            words in line
            for words in [
                "invalid safetensors file",
                "an empty file (0 bytes)",
                "cannot map the input",
            ]
        ), line
    assert sorted(listing(tmp_path)) == ["g.safetensors", "l.safetensors"]


# --- printing ------------------------------------------------------------------------------------

# Escape sequences a hostile checkpoint could carry: set the window title, clear the screen,
# move the cursor (CSI and its C1 form), ring the bell, return to the line start.
EVIL = "\x1b]0;pwned\x07\x1b[2J\x1b[1;1H\r\x9b31m\x7f\x08"
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def test_control_characters_are_escaped_in_every_line(tmp_path, run_main):
    """Tensor names and paths holding terminal escape codes were printed raw."""
    folder = tmp_path / f"dir{EVIL}"
    folder.mkdir()
    src = folder / f"m{EVIL}.safetensors"
    tiny = np.array([1e-45, 1.0, 7e4], np.float32)  # underflows in bf16; 7e4 overflows fp16
    write_safetensors(
        src,
        {f"t{EVIL}": ("F32", [3], tiny), f"k{EVIL}": ("F32", [2], np.ones(2, np.float32))},
        metadata={f"meta{EVIL}": f"value{EVIL}"},
    )
    dst = folder / f"o{EVIL}.safetensors"
    bad = folder / f"bad{EVIL}.safetensors"
    runs = [
        ["inspect", src],
        ["inspect", src, "--scan", "--to", "fp16"],
        ["inspect", src, dst, "--keep", f"nothing{EVIL}"],
        ["convert", src, dst, "--keep", f"k{EVIL}", "--keep", f"nothing{EVIL}"],
        ["convert", src, dst],  # destination exists: an error naming it
        ["convert", src, folder / f"o2{EVIL}.safetensors", "--to", "fp16"],
        ["verify", src, dst],
        ["verify", src, src],
        ["convert", folder / f"missing{EVIL}", dst],
        ["convert", folder, tmp_path / f"out{EVIL}"],
        ["inspect", folder],
    ]
    outputs = []
    for args in runs:
        rc, out, err = run_main(*args)
        assert "internal error" not in err, (args, err)
        outputs.append((args, rc, out + err))
    # A verify that fails names a tensor: flip one converted value.
    raw = bytearray(dst.read_bytes())
    raw[-1] ^= 0x40
    bad.write_bytes(raw)
    rc, out, err = run_main("verify", src, bad)
    assert rc == 1
    outputs.append((["verify", src, bad], rc, out + err))
    for args, _, text in outputs:
        assert not RAW.search(text), (args, [c for c in text if RAW.match(c)])
        assert "\\x1b" in text, (args, text)  # the name is there, escaped
    # --json keeps the exact strings.
    rc, out, _ = run_main("inspect", src, "--json")
    names = {t["name"] for t in json.loads(out)["result"]["tensors"]}
    assert names == {f"t{EVIL}", f"k{EVIL}"}
    assert json.loads(out)["result"]["path"] == str(src)


def test_a_newline_in_a_name_is_escaped_in_every_line(tmp_path, run_main):
    """A newline in a file or folder name was printed raw in summary lines (`converted
    n<newline>x -> ...`), in inspect's folder lines, and turned into a space in errors: each
    name now stays on its line, escaped as `\\x0a` (issue 33, point 6)."""
    folder = tmp_path / "dir\nTAIL"
    folder.mkdir()
    src = folder / "m\nTAIL.safetensors"
    write_safetensors(
        src, {"w\nTAIL": ("F32", [2], np.ones(2, np.float32))}, metadata={"k\nTAIL": "v"}
    )
    dst = tmp_path / "o\nTAIL.safetensors"
    runs = [
        ["convert", src, dst],
        ["inspect", src],
        ["verify", src, dst],
        ["convert", folder, tmp_path / "out\nTAIL"],
        ["inspect", folder],
        ["verify", folder, tmp_path / "out\nTAIL"],
        ["convert", tmp_path / "missing\nTAIL", tmp_path / "x.safetensors"],
        ["convert", src, dst],  # destination exists
    ]
    for args in runs:
        _, out, err = run_main(*args)
        text = out + err
        assert "\\x0a" in text, (args, text)
        assert not any(line.startswith("TAIL") for line in text.splitlines()), (args, text)


# --- the table of docs/guarantees.md ------------------------------------------------------------


def test_the_guarantees_table_names_tests_that_exist():
    """Every `file::test` of the table in docs/guarantees.md names a test of that file (a
    renamed test must not leave a promise without proof), and every row names one."""
    from pathlib import Path

    tests = Path(__file__).parent
    doc = (tests.parent / "docs" / "guarantees.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| **")]
    assert len(rows) >= 16
    for row in rows:
        proof = row.rstrip(" |").rsplit("|", 1)[1]
        assert "::" in proof, row
        for group in proof.split(";"):
            group = group.strip()
            if "::" not in group:
                continue  # tests/props.rs, fuzz/
            file, names = group.split("::", 1)
            source = (tests / f"{file.strip()}.py").read_text()
            for name in re.findall(r"\btest_\w+", names):
                assert f"def {name}(" in source, f"{file}::{name} in: {row[:60]}"
