"""What the command line shows: one-line errors and warnings, progress, the JSON envelope.

- Human-readable output is escaped (`printable`): control characters and bytes that are not
  UTF-8 never reach a terminal raw. `--json` keeps exact strings (JSON escapes them).
- Progress on a terminal is one line redrawn in place, never wider than the terminal (a
  wrapped line cannot be redrawn), cleared before a warning and drawn again after it. In a
  log (`--progress` with stderr not a terminal) it is a line per 5% or 10 s, without
  carriage returns, and always the last one at 100%.
- A committing command's stdout is written once its work is done (`Console.finish`): a
  failure to write it then comes after the commit point, and says so.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time

from . import _core
from .errors import render

TYPE_CHECKING = False  # importing `typing` would add ~5 ms to every start
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, Callable, TextIO

SCHEMA = 1
PROG = "stcast"

# Control characters (C0 but newline, DEL, C1) and surrogates: the escaped bytes of names
# that are not UTF-8 (os.fsdecode gives them as U+DC80..U+DCFF), and lone ones.
_UNPRINTABLE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_UNPRINTABLE_ALL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape_char(m: re.Match[str]) -> str:
    o = ord(m.group())
    if 0xDC80 <= o <= 0xDCFF:  # a byte that was not UTF-8
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(text: str, keep: str = "\n") -> str:
    """`text` safe for a terminal: control characters and undecodable bytes as escapes
    (newlines kept unless `keep` is empty)."""
    pattern = _UNPRINTABLE if keep else _UNPRINTABLE_ALL
    return pattern.sub(_escape_char, text)


class EscapingStdout(io.TextIOBase):
    """sys.stdout for human-readable output: every write escaped (`printable`)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, s: str) -> int:
        self.stream.write(printable(s))
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def escape_streams() -> None:
    """Make stdout and stderr safe for any name: escapes, never an encoding error."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass
    if sys.stdout is not None and not isinstance(sys.stdout, EscapingStdout):
        sys.stdout = EscapingStdout(sys.stdout)


def size(n: float) -> str:
    """Bytes in decimal units, three significant digits: 950 B, 12.3 kB, 4.56 GB."""
    return _core.format_bytes(max(0, int(n)))


def _char_width(c: str) -> int:
    """Terminal columns of one character: 2 for East Asian wide and emoji, 0 for combining
    marks and zero-width characters (wcwidth's tables, loaded only for non-ASCII text)."""
    from wcwidth import wcwidth

    return max(0, wcwidth(c))


def display_width(text: str) -> int:
    """Terminal columns of `text` (ASCII fast)."""
    if text.isascii():
        return len(text)
    from wcwidth import wcswidth

    w = wcswidth(text)  # -1 if a control character is left (callers escape them first)
    return w if w >= 0 else sum(map(_char_width, text))


def ljust(text: str, columns: int) -> str:
    """`text` padded on the right to `columns` terminal columns (str.ljust counts code
    points: a CJK or emoji name would push the next column right)."""
    return text + " " * (columns - display_width(text))


def rjust(text: str, columns: int) -> str:
    """`text` padded on the left to `columns` terminal columns."""
    return " " * (columns - display_width(text)) + text


def _fit_left(text: str, columns: int) -> str:
    """`text` in at most `columns` terminal columns, its start cut to "..." if needed."""
    if display_width(text) <= columns:
        return text
    kept, used = [], 3
    for c in reversed(text):
        w = _char_width(c)
        if used + w > columns:
            break
        kept.append(c)
        used += w
    return "..." + "".join(reversed(kept))


def duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def print_err(line: str) -> None:
    try:
        print(printable(line, keep=""), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def is_tty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


def columns(stream: TextIO) -> int:
    """The width of the terminal behind `stream`; 80 when it does not say."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):
        return 80


def silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class Progress:
    """Progress of one command on stderr: a bar on a terminal, or lines in a log.

    Callable as `progress(done, total)` (bytes); `set_file` adds a folder's current file.
    `min_interval` bounds how often a terminal bar is redrawn and `clock` gives the time:
    tests pass 0 and a fake clock, so that what is drawn depends on the steps only.
    """

    WIDTH = 24

    def __init__(
        self,
        stream: TextIO,
        *,
        bar: bool,
        clock: Callable[[], float] = time.monotonic,
        min_interval: float = 0.1,
        started: float | None = None,
    ) -> None:
        self.stream = stream
        self.bar = bar
        self.clock = clock
        self.min_interval = min_interval
        self.start = clock() if started is None else started
        self.last_draw = -1e9
        self.drawn = 0  # length of the bar line on screen, 0 when none is
        self.broken = False
        self.label = ""  # the current file of a folder, and how far it is
        self.state = (0, 0)
        self.logged_pct = -1
        self.logged_at = self.start
        self.done_logged = False

    def set_file(self, path: str, done: int, total: int) -> None:
        """Per-file progress of a folder run, shown after the whole-folder figures."""
        pct = done * 100 // total if total > 0 else 100
        self.label = f"{printable(path, keep='')} {pct}%"

    def __call__(self, done: int, total: int) -> None:
        self.state = (done, total)
        now = self.clock()
        if self.bar:
            if done < total and now - self.last_draw < self.min_interval:
                return
            self.last_draw = now
            self._draw(now)
        else:
            self._log(now, final=False)

    def _parts(self, now: float) -> tuple[str, str, str]:
        """The sizes, the rate, and the ETA (or the time taken once done)."""
        done, total = self.state
        elapsed = now - self.start
        sizes = f"{size(done)} / {size(total)}"
        # A rate over less than 0.2 s says little, except at the end: the whole run's.
        if done <= 0 or elapsed <= 0 or (elapsed < 0.2 and done < total):
            return sizes, "", ""
        rate = done / elapsed
        if done < total:
            return sizes, f"{size(rate)}/s", f"ETA {duration((total - done) / rate)}"
        return sizes, f"{size(rate)}/s", f"in {elapsed:.2f} s"  # as the summary says

    def _figures(self, now: float) -> str:
        return "  ".join(p for p in self._parts(now) if p)

    def _draw(self, now: float) -> None:
        if self.broken:
            return
        done, total = self.state
        frac = done / total if total > 0 else 1.0
        pct = f"{frac * 100:3.0f}%"
        sizes, rate, eta = self._parts(now)
        room = columns(self.stream) - 1

        def bar(width: int) -> str:
            filled = int(frac * width)
            return f"[{'#' * filled}{'.' * (width - filled)}] "

        # Never wider than the terminal (a wrapped line cannot be redrawn with a \r): the
        # least useful parts go first, whole, and the bar narrows, before anything is cut.
        layouts = [
            [pct, sizes, rate, eta],
            [pct, sizes, eta],
            [pct, eta],
            [pct],
        ]
        line = ""
        for parts in layouts:
            text = "  ".join(p for p in parts if p)
            for width in (self.WIDTH, 16, 10):
                if len(bar(width)) + len(text) <= room:
                    line = bar(width) + text
                    break
            if line:
                break
        line = (line or pct)[:room]
        if self.label and room - len(line) - 2 > 8:
            line += "  " + _fit_left(self.label, room - len(line) - 2)
        # Pad over what is left of a longer previous line; no escape codes needed.
        width = display_width(line)
        padded = line + " " * max(0, self.drawn - width)
        self.drawn = width
        self._write("\r" + padded)

    def _log(self, now: float, final: bool) -> None:
        done, total = self.state
        pct = done * 100 // total if total > 0 else 100
        if pct >= 100 and not final:
            return  # the 100% line comes from `close`, with the time the summary gives
        if final:
            if self.done_logged or (total == 0 and done == 0):
                return
            self.done_logged = pct >= 100
        elif pct < self.logged_pct + 5 and now - self.logged_at < 10:
            return
        self.logged_pct, self.logged_at = pct, now
        label = f"  {self.label}" if self.label else ""
        self._write(f"{PROG}: {pct:3d}%  {self._figures(now)}{label}\n")

    def clear(self) -> None:
        """Take the bar off the screen (before a warning); `redraw` puts it back."""
        if self.bar and self.drawn:
            self._write("\r" + " " * self.drawn + "\r")
            self.drawn = 0

    def redraw(self) -> None:
        if self.bar and self.state != (0, 0):
            self._draw(self.clock())

    def close(self, now: float | None = None) -> None:
        """The final state once, then a new line: what follows starts on a fresh one."""
        now = self.clock() if now is None else now
        if self.bar:
            if self.drawn:
                self._draw(now)
                self.drawn = 0
                self._write("\n")
        else:
            done, total = self.state
            if total and done >= total:
                self._log(now, final=True)

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            # A broken terminal must not abort the conversion: stop drawing instead.
            self.broken = True


class Console:
    """stderr messages, the progress display and the JSON envelope of one command, as its
    terminal options (`--json`, `-q`, `--progress`: the table's role `terminal`) say."""

    def __init__(
        self, command: str, *, json: bool = False, quiet: bool = False, progress: bool = False
    ) -> None:
        self.json_mode = json
        self.command = command
        self.quiet = quiet
        # Text for people (a summary, notes): neither with -q nor with --json.
        self.says = not (quiet or json)
        # Progress: as that text, or lines in a log when asked (not with -q).
        self.logs_progress = progress and not quiet
        self.shows_progress = self.says or self.logs_progress
        self.display: Progress | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        # What a committing command prints, written at the end (`finish`).
        self.stdout = io.StringIO()
        # What the command published (for the message when stdout then fails).
        self.published: str | None = None

    def elapsed(self) -> float:
        """Seconds from the command's start to the end of its work (fixed once ended)."""
        return (self.finished or time.monotonic()) - self.started

    def start_progress(self) -> Progress | None:
        """The progress display of the work, if any: a bar on a terminal, lines in a log
        when asked."""
        tty = is_tty(sys.stderr)
        if not self.shows_progress or not (tty or self.logs_progress):
            return None
        self.display = Progress(sys.stderr, bar=tty, started=self.started)
        return self.display

    def end_progress(self) -> None:
        """The work is done: fix the time, and close the progress display on it."""
        if self.finished is None:
            self.finished = time.monotonic()
        if self.display is not None:
            self.display.close(self.finished)
            self.display = None

    def summarizes(self, report: Any) -> bool:
        """Whether the command prints its summary of `report`: not with -q; with --json, it
        prints `report`'s JSON instead."""
        if self.json_mode:
            self.emit_json(report.to_dict())
        return self.says

    def note(self, message: str) -> None:
        """A line on stderr about the run (not a warning), unless -q or --json."""
        if self.says:
            print_err(f"{PROG}: {message}")

    def error(self, message: str) -> None:
        self.end_progress()
        print_err(f"{PROG}: {message.strip()}")  # one line: print_err escapes a newline

    def warn(self, message: str) -> None:
        if self.quiet:
            return
        if self.display is not None:
            self.display.clear()
        print_err(f"{PROG}: warning: {message.strip()}")
        if self.display is not None:
            self.display.redraw()

    def show_warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        """Stand-in for `warnings.showwarning` while a command runs."""
        from .errors import StcastWarning

        if isinstance(message, StcastWarning):
            text = render(message.template, "cli")
            self.warn(text if message.path is None else f"{message.path}: {text}")
        else:
            self.warn(f"{category.__name__}: {message}")

    def emit_json(self, result: dict[str, Any], rows: tuple[str, Sequence[Any]] = ("", ())) -> None:
        """Print the JSON document of `result`; `rows` (a key of `result` and the objects with
        a `to_dict` its list holds) are written a chunk at a time: the text is the same as
        `json.dumps` of the whole, without 500,000 dicts and one 130 MB string at once."""
        doc = {"schema": SCHEMA, "command": self.command, "version": _core.__version__}
        doc["result"] = result = cli_words(result)
        key, items = rows
        if not key:
            print(json.dumps(doc))
            return
        mark = json.dumps(f"\0{os.urandom(16).hex()}")  # no other string can be it
        result[key] = json.loads(mark)
        head, _, tail = json.dumps(doc).partition(mark)
        write = sys.stdout.write
        write(head + "[")
        for i in range(0, len(items), 4096):
            chunk = json.dumps([t.to_dict() for t in items[i : i + 4096]])
            write((", " if i else "") + chunk[1:-1])
        write("]" + tail + "\n")

    def fail(self, kind: str, message: str, path: str | None, code: int = 1) -> int:
        """Report an error as one line on stderr (or as JSON with --json); return `code`."""
        if self.json_mode:
            self.end_progress()
            error = {"kind": kind, "message": message.strip(), "path": path}
            doc = {"schema": SCHEMA, "command": self.command, "version": _core.__version__}
            doc["error"] = error
            try:
                print(json.dumps(doc), flush=True)
            except OSError:
                pass
        else:
            self.error(message)
        return code

    def finish(self, code: int) -> int:
        """Write what the command printed; a failure here comes after the commit point."""
        text = self.stdout.getvalue()
        if not text or sys.stdout is None:
            return code  # nothing to say, or stdout was closed (`>&-`): nowhere to say it
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except (OSError, ValueError) as e:
            silence_stdout()
            if isinstance(e, BrokenPipeError):
                return code  # the reader went away (`| head`): nothing to say
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            what = f"writing to stdout failed: {reason}"
            if self.published is not None:
                what = f"{self.published} was published, but {what}"
            self.error(what)
            return 1
        return code


def cli_words(result: dict[str, Any]) -> dict[str, Any]:
    """A report's JSON with its texts (warnings, its files', a mismatch) in the CLI's words
    (`--force`, not `force=True`)."""

    def words(d: dict[str, Any]) -> dict[str, Any]:
        if "warnings" in d:
            d = {**d, "warnings": [notice_text(w) for w in d["warnings"]]}
        if isinstance(d.get("mismatch"), dict):
            d = {**d, "mismatch": {**d["mismatch"]}}
            d["mismatch"]["message"] = notice_text(d["mismatch"]["message"])
        return d

    result = words(result)
    if isinstance(result.get("files"), list):
        result["files"] = [words(f) if isinstance(f, dict) else f for f in result["files"]]
    return result


def notice_text(w: object) -> str:
    from .reports import Notice

    return w.render("cli") if isinstance(w, Notice) else str(w)
