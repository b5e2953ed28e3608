"""Child processes, for the tests where the process itself is under test.

Most tests run the command line in-process (the `run_main` fixture of conftest.py). A child is
used where that cannot show the behaviour: failpoints (`STCAST_FAILPOINT` is read once per
process), signals and SIGKILL, exit codes of `python -m stcast`, import costs, a terminal or a
closed pipe, memory, privileges and mounts.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Sequence
from pathlib import Path


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: no failpoint unless `extra` arms one."""
    env = dict(os.environ)
    env.pop("STCAST_FAILPOINT", None)
    env["NO_COLOR"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if extra:
        env.update(extra)
    return env


def with_points(env: dict[str, str] | None, *points: str) -> dict[str, str]:
    """`env` with more failpoints armed (joined to those it has)."""
    env = dict(env or {})
    env["STCAST_FAILPOINT"] = ",".join([*points, *filter(None, [env.get("STCAST_FAILPOINT")])])
    return env


def run_cli(
    *args: object,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: os.PathLike | str | None = None,
    wrap: Sequence[str] = (),
) -> tuple[int, str, str]:
    """Run `python -m stcast ARGS` in a child (under the command `wrap`, if any); return (exit
    code, stdout, stderr)."""
    proc = subprocess.run(
        [*wrap, sys.executable, "-m", "stcast", *map(str, args)],
        capture_output=True,
        env=cli_env(env),
        timeout=timeout,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def run_python(
    *args: object, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `python ARGS` (e.g. "-c", code) in a fresh interpreter with the CLI's environment."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(env),
        timeout=timeout,
    )


# --- privileges --------------------------------------------------------------------------------

# The capabilities that let root ignore file modes.
FILE_MODE_OVERRIDES = "-dac_override,-dac_read_search,-fowner"


def without_file_mode_overrides() -> list[str]:
    """A command prefix under which file modes apply, as root too (CI runs as root).

    As root: `setpriv` (util-linux) drops CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER
    from the inheritable and bounding sets, so the command it execs lacks them; the uid stays 0,
    so the interpreter is still reachable (it may live under /root, mode 0700, which an
    unprivileged uid such as nobody could not even enter). Not root: nothing to drop.
    """
    if os.geteuid() != 0:
        return []
    caps = FILE_MODE_OVERRIDES
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--"]


# --- mounts ------------------------------------------------------------------------------------


class MountNamespaceUnavailable(Exception):
    pass


class MountNamespace:
    """A child that holds a private mount namespace, for tests that mount file systems.

    The host never sees those mounts: when the child ends (the test closes it, or dies and its
    stdin closes), the namespace and its mounts go with it, so a failed test leaks no mount.
    The child is `unshare --mount` as root, else `unshare --user --map-root-user --mount`; it
    runs the commands the test sends (`run`), one line each. The test and the CLI reach the
    mounts through the child's root, `/proc/PID/root` (`view`).
    """

    LOOP = (
        'echo ready; while read -r line; do if sh -c "$line"; then echo ok; else echo failed; fi;'
        " done"
    )

    def __init__(self) -> None:
        unshare = ["unshare", "--mount", "--propagation", "private"]
        if os.geteuid() != 0:
            unshare[1:1] = ["--user", "--map-root-user"]
        self.err = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [*unshare, "sh", "-c", self.LOOP],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.err,
                text=True,
            )
        except FileNotFoundError as e:  # no unshare(1)
            raise MountNamespaceUnavailable(str(e)) from None
        if self.proc.stdout.readline() != "ready\n":
            self.close()
            raise MountNamespaceUnavailable(self.stderr())
        self.root = f"/proc/{self.proc.pid}/root"

    def run(self, *argv: object) -> None:
        """Run a command in the namespace; it must succeed."""
        self.proc.stdin.write(shlex.join(map(str, argv)) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply == "ok\n", f"{argv} failed in the mount namespace: {self.stderr()}"

    def view(self, path: os.PathLike | str) -> Path:
        """`path` (absolute) as seen in the namespace, from outside it."""
        return Path(self.root + os.fspath(path))

    def real(self, view: os.PathLike | str) -> str:
        """The path in the namespace of a `view` path."""
        text = os.fspath(view)
        assert text.startswith(self.root + "/"), text
        return text[len(self.root) :]

    def bind(self, source: os.PathLike | str, target: os.PathLike | str) -> None:
        """Bind-mount the folder `source` on the folder `target` (both absolute host paths,
        seen alike in the namespace): the same folder, reached by a second path."""
        self.run("mount", "--bind", source, target)

    def wrap(self) -> list[str]:
        """A command prefix that runs a command inside the namespace (`run_cli(wrap=...)`,
        `Run(wrap=...)`), so that it sees the mounts under their real paths."""
        enter = ["nsenter", f"--target={self.proc.pid}", "--mount"]
        if os.geteuid() != 0:
            enter += ["--user", "--preserve-credentials"]
        return [*enter, "--"]

    def tmpfs(self, folder: Path, size: str) -> Path:
        """Mount a tmpfs of `size` on the empty `folder`; return its view."""
        self.run("mount", "-t", "tmpfs", "-o", f"size={size}", "stcast-test", folder)
        return self.view(folder)

    def remount_read_only(self, view: Path) -> None:
        self.run("mount", "-o", "remount,ro", self.real(view))

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def close(self) -> None:
        """End the child: its namespace and every mount in it go."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()
        self.err.close()


# --- runs stopped at a failpoint ---------------------------------------------------------------


class Run:
    """`python -m stcast ARGS` in the background, for runs that stop at a failpoint."""

    def __init__(
        self, *args: object, env: dict[str, str] | None = None, wrap: Sequence[str] = ()
    ) -> None:
        self.out = tempfile.TemporaryFile()
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "stcast", *map(str, args)],
            stdout=self.out,
            stderr=self.err,
            stdin=subprocess.DEVNULL,
            env=cli_env(env),
        )
        # A watchdog instead of a timeout on waitpid: a run that never stops fails the test.
        self.watchdog = threading.Timer(60, self.proc.kill)
        self.watchdog.start()

    def wait_stopped(self) -> Run:
        if not self.stops():
            raise AssertionError(f"run ended instead of stopping: {self.finish()}")
        return self

    def stops(self) -> bool:
        """Wait until the run stops (True) or ends (False)."""
        _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
        if os.WIFSTOPPED(status):
            return True
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return False

    def run_through(self) -> tuple[int, str]:
        """Resume it at every stop until it ends; return (exit code, stderr)."""
        while True:
            self.resume()
            if not self.stops():
                return self.finish()

    def stdout(self) -> str:
        self.out.seek(0)
        return self.out.read().decode()

    def resume(self) -> Run:
        os.kill(self.proc.pid, signal.SIGCONT)
        return self

    def kill(self) -> tuple[int, str]:
        os.kill(self.proc.pid, signal.SIGKILL)
        return self.finish()

    def finish(self) -> tuple[int, str]:
        """Wait for the end; return (exit code, stderr)."""
        if self.proc.returncode is None:
            self.proc.wait(60)
        self.watchdog.cancel()
        self.err.seek(0)
        return self.proc.returncode, self.err.read().decode()


def stopped(
    *args: object, at: str, env: dict[str, str] | None = None, wrap: Sequence[str] = ()
) -> Run:
    """A run of `python -m stcast ARGS` stopped (SIGSTOP) at failpoint `at`."""
    return Run(*args, env=with_points(env, f"{at}=stop"), wrap=wrap).wait_stopped()


# --- a terminal --------------------------------------------------------------------------------


# Run before the CLI in `run_on_pty(deterministic=True)`: what the bar draws depends on
# the steps only. The clock advances half a second per reading, every progress call draws,
# and windows and steps are 1 MiB, so a file of a few MiB is several steps.
DETERMINISTIC_PROGRESS = """
import functools, itertools, sys, time
ticks = itertools.count()
time.monotonic = lambda: next(ticks) * 0.5
import stcast, stcast._console as console
init = console.Progress.__init__
def every_step(self, *a, **k):
    k["min_interval"] = 0
    init(self, *a, **k)
console.Progress.__init__ = every_step
stcast.convert = functools.partial(stcast.convert, tuning={"window_mib": 1, "step_mib": 1})
from stcast.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def run_on_pty(
    args: list[object],
    timeout: float = 60,
    columns: int = 80,
    deterministic: bool = False,
    terminal: str = "stderr",
) -> tuple[int, str, bytes]:
    """Run the CLI with `terminal` (stderr, or stdout) on a pseudo-terminal `columns` wide;
    return (rc, the other stream's text, the terminal's bytes)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    entry = ["-c", DETERMINISTIC_PROGRESS] if deterministic else ["-m", "stcast"]
    on_pty = terminal == "stdout"
    proc = subprocess.Popen(
        [sys.executable, *entry, *map(str, args)],
        stdout=slave if on_pty else subprocess.PIPE,
        stderr=subprocess.PIPE if on_pty else slave,
        stdin=subprocess.DEVNULL,
        env=cli_env(),
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
        assert time.monotonic() < deadline, "the CLI hung"
    os.close(master)
    other = proc.stderr if on_pty else proc.stdout
    assert other is not None
    out = other.read().decode()
    other.close()
    return proc.wait(timeout), out, b"".join(chunks)
