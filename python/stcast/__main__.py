"""The entry point of the `stcast` command (and of `python -m stcast`).

It stays tiny and its first lines install the signal handlers, before anything else is
imported: Ctrl-C (or SIGTERM, SIGHUP) at any moment then stops the run cleanly, without a
traceback. The handlers only record the signal; the work polls for it (the engine between
windows, the folder code between files), rolls back what is unfinished, and the command
then dies of that same signal, as shells and batch schedulers (SLURM) expect: exit status
130, 143 or 129. A signal that arrives after the output was published (the commit point)
does not change the outcome.
"""

from __future__ import annotations

# `_signal`, the C module under `signal`: `signal` imports `enum`, some 25 ms during which
# Ctrl-C would still print a traceback. (Before this module runs, Python's own start-up and
# the launcher pip writes are beyond reach: the first ~20 ms.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal
else:
    try:
        import _signal as signal
    except ImportError:  # not CPython
        import signal

# The signals received, in order (the first decides).
received: list[int] = []


def _record(signum: int, frame: object) -> None:
    received.append(signum)


def _install() -> None:
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, _record)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (or die of the signal received)."""
    _install()
    from .cli import run_cli

    return run_cli(argv, received)


if __name__ == "__main__":
    import sys

    sys.exit(main())
