"""The `stcast` command line: `convert`, `inspect`, `verify`, `finalize`, `demo`.

Exit codes: 0 ok, 1 failure, 2 usage; a run stopped by SIGINT, SIGTERM or SIGHUP dies of
that signal once it has cleaned up (status 130, 143, 129). Errors are one line on stderr,
prefixed `stcast: `; `--json` prints one object on stdout for scripts. Names and paths in
human-readable output are escaped (control characters, bytes that are not UTF-8); only
`--json` keeps the exact strings. Imports stay light (no numpy) so that `stcast --version`
and `--help` are instant.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
import warnings

import stcast
from stcast import _core
from stcast.errors import render

TYPE_CHECKING = False  # importing `typing` would add ~5 ms to every start
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any, TextIO

SCHEMA = 1
PROG = "stcast"
# Commands that publish something (the commit point) before they print their summary.
_COMMITTING = frozenset({"convert", "finalize", "verify"})


class _Stop:
    """The cancel flag the CLI hands to the work: set once a signal was received."""

    def __init__(self, received: list[int]) -> None:
        self.received = received

    def is_set(self) -> bool:
        return bool(self.received)

    @property
    def signal(self) -> int | None:
        return self.received[0] if self.received else None


_SIGNAL_WORDS = {2: "interrupted", 15: "terminated", 1: "hung up"}


def run_cli(argv: list[str] | None, received: list[int]) -> int:
    """The entry point's work (see `stcast.__main__`): run, and die of a signal that stopped
    the run, so that the shell or the scheduler sees it."""
    import signal

    stop = _Stop(received)
    code = main(argv, stop)
    sig = stop.signal
    if sig is not None and code == 128 + sig:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    # The outcome is decided: a signal from now on changes nothing. (The interpreter puts
    # the default handlers back while it shuts down; ignoring them keeps a late Ctrl-C from
    # killing it then.)
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    return code


def main(argv: list[str] | None = None, stop: _Stop | None = None) -> int:
    """Run the command line with `argv` (default `sys.argv[1:]`); return the exit code.

    In-process callers (tests) leave `stop` out: Ctrl-C is then a KeyboardInterrupt.
    """
    _escape_streams()
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:
        # Same text as argparse's version action, without building the parser (~8 ms).
        print(f"{PROG} {stcast.__version__}")
        return 0
    stop = stop or _Stop([])
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors
        return _exit_code(e.code)
    except KeyboardInterrupt:
        _print_err(f"{PROG}: interrupted")
        return 130
    console = _Console(json_mode=getattr(args, "json", False), command=args.command)
    try:
        if stop.is_set():
            raise stcast.Cancelled("stopped before starting")
        args.stop = stop
        if args.command in _COMMITTING:
            # Its stdout is written once the work is done: a failure to write it (a full
            # disk, a closed pipe) is then reported as what it is, after the commit point.
            with contextlib.redirect_stdout(console.stdout):
                code = int(args.run(args, console))
        else:
            code = int(args.run(args, console))
    except KeyboardInterrupt:
        return console.fail("interrupted", "interrupted", None, code=130)
    except stcast.Cancelled:
        sig = stop.signal
        if sig is not None:
            word = _SIGNAL_WORDS.get(sig, f"stopped by signal {sig}")
            return console.fail("interrupted", word, None, code=128 + sig)
        return console.fail("cancelled", "cancelled", None)
    except stcast.StcastError as e:
        # Before OSError: DestinationExists and NoSpace are both.
        path = None if e.path is None else _fspath(e.path)
        code = 2 if e.kind == "usage" else 1
        return console.fail(e.kind, e.render("cli"), path, code=code)
    except OSError as e:
        if isinstance(e, BrokenPipeError) and e.filename is None:
            # Our reader went away (`stcast inspect big.safetensors | head`): stop quietly, and
            # keep the interpreter's final flush from complaining about the closed pipe.
            _silence_stdout()
            return 0
        return console.fail(_os_error_kind(e), _describe_os_error(e), _os_error_path(e))
    except Exception as e:  # never a traceback: one line, exit 1
        return console.fail("internal", f"internal error: {type(e).__name__}: {e}", None)
    return console.finish(code)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert safetensors checkpoints to bf16, exactly, in bounded memory.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {stcast.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "convert",
        help="convert a checkpoint to bf16 (or fp16)",
        description=(
            "Convert SRC to bf16 (or fp16); other tensors and the metadata are kept. SRC may be "
            "a checkpoint folder: every .safetensors file in it is converted, its indexes and "
            "config.json files are updated and everything else is copied into the folder DST."
        ),
    )
    p.add_argument("src", metavar="SRC", help="input .safetensors file or checkpoint folder")
    p.add_argument(
        "dst",
        metavar="DST",
        nargs="?",
        help="output file (default: SRC's stem + -bf16.safetensors; for a folder, SRC-bf16)",
    )
    p.add_argument("--to", choices=["bf16", "fp16"], default="bf16", help="target (default bf16)")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="worker threads")
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    p.add_argument(
        "--resume",
        action="store_true",
        help="folders: continue an interrupted run, skipping the files already done",
    )
    p.add_argument(
        "--shard",
        type=_shard,
        metavar="I/N",
        help="folders: convert only the I-th of N subsets of the files (then `stcast finalize`)",
    )
    p.add_argument(
        "--follow-links",
        action="store_true",
        help="folders: follow symlinks that lead outside SRC (else only links within it and "
        "into a Hugging Face cache's blobs/ are followed)",
    )
    p.add_argument(
        "--allow-quantized",
        action="store_true",
        help="folders: convert a quantized checkpoint anyway (its F32 scales become bf16 too)",
    )
    _add_precision_arguments(p)
    p.add_argument(
        "--strict",
        action="store_true",
        help="make a --keep pattern that matches no tensor an error (nothing is written)",
    )
    p.add_argument(
        "--on-overflow",
        choices=["warn", "error", "keep"],
        default="warn",
        help="finite values that would become inf (|x| >= 65520 in fp16): warn (default), "
        "error (exit 1, nothing written), or keep those tensors in their dtype (reads the "
        "float tensors once more first)",
    )
    p.add_argument(
        "--report",
        metavar="FILE",
        help="write the numeric report (per tensor: overflow, underflow, errors) to FILE as JSON",
    )
    _add_output_arguments(p)
    p.set_defaults(run=_run_convert)

    p = commands.add_parser(
        "finalize",
        help="complete a folder converted with --shard",
        description=(
            "Once `stcast convert SRC DST --shard I/N` has run for every I, check that every "
            "file is done, then copy the other files and write the configs and indexes."
        ),
    )
    p.add_argument("src", metavar="SRC", help="the checkpoint folder")
    p.add_argument("dst", metavar="DST", help="the folder the shards were converted into")
    _add_output_arguments(p)
    p.set_defaults(run=_run_finalize)

    p = commands.add_parser(
        "inspect",
        help="show what convert would do with each tensor (a dry run)",
        description=(
            "A dry run of `stcast convert` with the same options: each tensor of SRC (a file, "
            "or every file of a checkpoint folder) with its dtype, the dtype it would get and "
            "why, and its bytes before and after; then the totals and, with DST, whether the "
            "output fits there. Only the header is read, unless --scan."
        ),
    )
    p.add_argument("src", metavar="SRC", help="input .safetensors file or checkpoint folder")
    p.add_argument(
        "dst", metavar="DST", nargs="?", help="where the output would go: report the free space"
    )
    p.add_argument("--to", choices=["bf16", "fp16"], default="bf16", help="target (default bf16)")
    _add_precision_arguments(p)
    p.add_argument(
        "--scan",
        action="store_true",
        help="read the data: per tensor, how many values would overflow or underflow",
    )
    p.add_argument(
        "--on-overflow",
        choices=["warn", "error", "keep"],
        default="warn",
        help="with keep, scan and plan the tensors that would overflow as kept",
    )
    p.add_argument("--threads", type=_positive_int, metavar="N", help="worker threads (--scan)")
    _add_output_arguments(p, quiet=False)
    p.set_defaults(run=_run_inspect)

    p = commands.add_parser(
        "verify",
        help="check that DST is exactly the conversion of SRC",
        description=(
            "Check, streaming both files, that DST is exactly what `stcast convert` makes of "
            "SRC: every converted value bit for bit, every other tensor byte for byte, and the "
            "header. Exit 0 when it is, 1 on the first difference (named on stderr)."
        ),
    )
    p.add_argument("src", metavar="SRC", help="the original .safetensors file")
    p.add_argument("dst", metavar="DST", help="the converted file")
    p.add_argument(
        "--loose",
        action="store_true",
        help="for files from other tools: ignore tensor order, header layout and NaN encodings",
    )
    p.add_argument("--threads", type=_positive_int, metavar="N", help="worker threads")
    p.add_argument(
        "--report",
        metavar="FILE",
        help="once verified, write the numeric report `convert --report` gives to FILE",
    )
    p.add_argument("--force", action="store_true", help="replace an existing report FILE")
    _add_output_arguments(p)
    p.set_defaults(run=_run_verify)

    p = commands.add_parser(
        "demo",
        help="convert a synthetic checkpoint and verify it bit for bit",
        description=(
            "Write a synthetic fp32 transformer checkpoint, convert it in a child process "
            "(reporting time and peak memory) and verify every tensor against numpy + ml_dtypes."
        ),
    )
    p.add_argument(
        "--size-gib", type=_positive_float, default=1.0, metavar="X", help="input size (1.0)"
    )
    p.add_argument("--dir", metavar="D", help="make the temporary folder under D")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.set_defaults(run=_run_demo)
    return parser


def _add_output_arguments(p: argparse.ArgumentParser, quiet: bool = True) -> None:
    """--json, and -q/--quiet unless `quiet` is False."""
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    if quiet:
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")


def _add_precision_arguments(p: argparse.ArgumentParser) -> None:
    """--keep, --keep-min-size and --from-bf16, shared by convert and inspect."""
    p.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="GLOB",
        help="keep float tensors whose name matches GLOB (fnmatch: * ? [seq]) in their dtype; "
        "repeatable, e.g. --keep '*norm*'",
    )
    p.add_argument(
        "--keep-min-size",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="keep float tensors with fewer than N elements in their dtype (norms, biases)",
    )
    p.add_argument(
        "--from-bf16",
        action="store_true",
        help="with --to fp16, convert BF16 tensors too (else they are copied as BF16)",
    )


def _run_convert(args: argparse.Namespace, console: _Console) -> int:
    bar = None
    if not args.quiet and not args.json and _is_tty(sys.stderr):
        bar = _ProgressBar(sys.stderr)
        console.bar = bar
    if args.on_overflow == "keep" and not args.quiet and not args.json:
        _print_err(
            f"{PROG}: --on-overflow keep: reading the float tensors once first (an extra read "
            "of the input) to keep those that would overflow"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("always", stcast.StcastWarning)
        warnings.showwarning = console.show_warning
        report = stcast.convert(
            args.src,
            args.dst,
            to=args.to,
            threads=args.threads,
            force=args.force,
            progress=bar,
            resume=args.resume,
            shard=args.shard,
            allow_quantized=args.allow_quantized,
            file_progress=None if bar is None else bar.set_file,
            keep=args.keep,
            keep_min_size=args.keep_min_size,
            strict=args.strict,
            from_bf16=args.from_bf16,
            on_overflow=args.on_overflow,
            report=args.report,
            follow_links=args.follow_links,
            cancel=args.stop,
        )
    console.published = report.dst
    console.end_bar()
    if not report.folder and report.numerics is not None:
        _warn_numerics(console, report.numerics)
    if args.json:
        console.emit_json(report.to_dict())
    elif report.folder:
        if not args.quiet:
            _print_folder_summary(report)
    elif not args.quiet:
        rate = report.bytes_in / report.seconds if report.seconds > 0 else 0.0
        print(f"converted {report.src} -> {report.dst}")
        print(f"  size     {_size(report.bytes_in)} -> {_size(report.bytes_out)}")
        print(f"  tensors  {report.tensors_converted} converted, {report.tensors_copied} copied")
        _print_kept(report.tensors_kept, report.bytes_kept, report.kept)
        print(
            f"  time     {report.seconds:.2f} s ({_size(rate)}/s of input, "
            f"{report.threads} thread{'s' if report.threads != 1 else ''}, {report.isa})"
        )
    return 0


def _print_kept(count: int, size: int, kept: Sequence[Mapping[str, Any]] | None = None) -> None:
    """The summary line of the tensors kept in their dtype (nothing when none was)."""
    if not count:
        return
    line = f"  kept     {count} tensor{'s' if count != 1 else ''} ({_size(size)}) in their dtype"
    if kept:
        why = {"keep_pattern": "--keep", "keep_min_size": "min size", "keep_overflow": "overflow"}
        counts: dict[str, int] = {}
        for k in kept:
            counts[why[k["reason"]]] = counts.get(why[k["reason"]], 0) + 1
        line += " (" + ", ".join(f"{n} by {w}" for w, n in counts.items()) + ")"
        overflow = [f"`{k['name']}`" for k in kept if k["reason"] == "keep_overflow"]
        if overflow:
            shown = ", ".join(overflow[:5])
            if len(overflow) > 5:
                shown += f" and {len(overflow) - 5} more"
            line += f"; to avoid overflow: {shown}"
    print(line)


def _run_finalize(args: argparse.Namespace, console: _Console) -> int:
    bar = None
    if not args.quiet and not args.json and _is_tty(sys.stderr):
        bar = _ProgressBar(sys.stderr)
        console.bar = bar
    report = stcast.finalize(
        args.src,
        args.dst,
        progress=bar,
        file_progress=None if bar is None else bar.set_file,
        cancel=args.stop,
    )
    console.published = report.dst
    console.end_bar()
    if args.json:
        console.emit_json(report.to_dict())
    elif not args.quiet:
        _print_folder_summary(report)
    return 0


def _print_folder_summary(report: stcast.ConvertReport) -> None:
    count: dict[str, int] = {}
    for f in report.files:
        count[f.action] = count.get(f.action, 0) + 1
    if report.shard is not None:
        verb = f"converted shard {report.shard[0]}/{report.shard[1]} of"
    else:
        verb = "finalized" if count.get("checked") else "converted"
    print(f"{verb} {report.src} -> {report.dst}")
    actions = ("converted", "skipped", "checked", "rewritten", "copied")
    print("  files    " + ", ".join(f"{count[a]} {a}" for a in actions if count.get(a)))
    print(f"  size     {_size(report.bytes_in)} -> {_size(report.bytes_out)} converted")
    print(f"  tensors  {report.tensors_converted} converted, {report.tensors_copied} copied")
    _print_kept(report.tensors_kept, report.bytes_kept)
    rate = report.bytes_in / report.seconds if report.seconds > 0 else 0.0
    engine = ""
    if report.threads is not None:
        plural = "s" if report.threads != 1 else ""
        engine = f", {report.threads} thread{plural}, {report.isa}"
    print(f"  time     {report.seconds:.2f} s ({_size(rate)}/s of input{engine})")
    if not report.complete:
        print("  then, once every shard is done:  stcast finalize SRC DST")


def _run_inspect(args: argparse.Namespace, console: _Console) -> int:
    bar = None
    scanning = args.scan or args.on_overflow == "keep"
    if scanning and not args.json and _is_tty(sys.stderr):
        bar = _ProgressBar(sys.stderr)
        console.bar = bar
    report = stcast.inspect(
        args.src,
        args.dst,
        to=args.to,
        keep=args.keep,
        keep_min_size=args.keep_min_size,
        from_bf16=args.from_bf16,
        scan=args.scan,
        on_overflow=args.on_overflow,
        threads=args.threads,
        progress=bar,
    )
    console.end_bar()
    for message in report.warnings:
        console.warn(message)
    if args.json:
        console.emit_json(report.to_dict())
        return 0

    if report.folder:
        for f in report.files:
            print(f"{f.path}:")
            _print_tensor_table(f, indent="  ")
            print()
        files = len(report.files)
        print(f"folder:   {report.path}, {files} weight file{'s' if files != 1 else ''}")
        _print_inspect_totals(report.files)
        print(
            f"output:   {_size(report.output_bytes)} projected as {report.to} "
            f"(weights {_size(report.output_bytes - report.other_bytes)}, "
            f"other files {_size(report.other_bytes)})"
        )
    else:
        _print_tensor_table(report)
        print()
        if report.metadata is None:
            print("metadata: none")
        else:
            print(f"metadata: {', '.join(report.metadata) or '(empty)'}")
        _print_inspect_totals([report])
        print(
            f"file:     {_size(report.file_bytes)} "
            f"(header {_size(report.file_bytes - report.data_bytes)}, "
            f"data {_size(report.data_bytes)})"
        )
        print(f"output:   {_size(report.output_bytes)} projected as {report.to}")
    d = report.destination
    if d is not None:
        verdict = "fits" if d["fits"] else "does NOT fit"
        print(
            f"space:    {d['folder']} has {_size(d['free_bytes'])} free, the output needs "
            f"{_size(d['need_bytes'])}: {verdict}"
        )
    return 0


# What the inspect table says of each reason (see stcast.TensorInfo.reason).
_REASONS = {
    "converted": "convert",
    "keep_overflow": "keep: would overflow",
    "already_target": "copy: already the target",
    "bf16_source": "copy: BF16 (convert with --from-bf16)",
    "not_converted": "copy: not converted",
    "not_float": "copy: not a float",
}


def _reason(t: stcast.TensorInfo) -> str:
    if t.reason == "keep_pattern":
        return f"keep: --keep '{_printable(t.pattern or '')}'"
    if t.reason == "keep_min_size":
        return "keep: under --keep-min-size"
    return _REASONS.get(t.reason, t.reason)


def _print_tensor_table(report: stcast.InspectReport, indent: str = "") -> None:
    head = ["NAME", "DTYPE", "SHAPE", "BYTES", "TARGET", "OUT", "WHY"]
    rows = [
        [
            t.name,
            t.dtype,
            _shape(t.shape),
            _size(t.bytes),
            t.target_dtype,
            _size(t.target_bytes),
            _reason(t),
        ]
        for t in report.tensors
    ]
    if report.scanned:
        head[6:6] = ["OVERFLOW", "UNDERFLOW"]
        for t, row in zip(report.tensors, rows):
            n = t.numerics
            cells = ["-", "-"] if n is None else [str(n["overflow"]), str(n["underflow_to_zero"])]
            row[6:6] = cells
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    right = {3, 5, 6, 7} if report.scanned else {3, 5}  # numbers line up on the right
    for row in [head, *rows]:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        print(indent + "  ".join(cells).rstrip())


def _print_inspect_totals(reports: list[stcast.InspectReport]) -> None:
    tensors = [t for r in reports for t in r.tensors]
    converted = [t for t in tensors if t.reason == "converted"]
    kept = [t for t in tensors if t.reason in _core.KEPT_REASONS]
    copied = [t for t in tensors if t.reason != "converted" and t.reason not in _core.KEPT_REASONS]
    parts = [
        f"{len(converted)} to convert ({_size(sum(t.bytes for t in converted))} -> "
        f"{_size(sum(t.target_bytes for t in converted))})"
    ]
    if kept:
        parts.append(f"{len(kept)} kept in their dtype ({_size(sum(t.bytes for t in kept))})")
    parts.append(f"{len(copied)} to copy ({_size(sum(t.bytes for t in copied))})")
    print(f"tensors:  {len(tensors)}: {', '.join(parts)}")
    if not any(r.scanned for r in reports):
        return
    measured: list[tuple[str, Mapping[str, Any]]] = [
        (t.name, t.numerics) for t in tensors if t.numerics is not None
    ]
    lines = []
    for key, what in (("overflow", "overflow to inf"), ("underflow_to_zero", "underflow to 0")):
        hit = sorted(((name, n[key]) for name, n in measured if n[key]), key=lambda h: -h[1])
        total = sum(count for _, count in hit)
        if not hit:
            lines.append(f"no value would {what}")
            continue
        worst = ", ".join(f"`{name}` {count}" for name, count in hit[:3])
        plural = "s" if len(hit) != 1 else ""
        lines.append(f"{total} values would {what} in {len(hit)} tensor{plural} (worst: {worst})")
    print(f"scan:     {'; '.join(lines)}")


def _run_verify(args: argparse.Namespace, console: _Console) -> int:
    bar = None
    if not args.quiet and not args.json and _is_tty(sys.stderr):
        bar = _ProgressBar(sys.stderr)
        console.bar = bar
    report = stcast.verify(
        args.src,
        args.dst,
        loose=args.loose,
        threads=args.threads,
        progress=bar,
        report=args.report,
        force=args.force,
    )
    if args.report is not None and report.ok:
        console.published = args.report
    console.end_bar()
    if args.json:
        console.emit_json(report.to_dict())
    elif report.mismatch is not None:
        console.error(f"{report.dst}: {report.mismatch.message}")
    elif not args.quiet:
        mode = " (loose)" if report.loose else ""
        print(f"verified {report.dst}: exactly the conversion of {report.src}{mode}")
        print(
            f"  tensors  {report.tensors_converted} converted, {report.tensors_identical} identical"
        )
        rate = report.bytes_compared / report.seconds if report.seconds > 0 else 0.0
        print(
            f"  time     {report.seconds:.2f} s ({_size(report.bytes_compared)} compared, "
            f"{_size(rate)}/s, {report.threads} thread{'s' if report.threads != 1 else ''}, "
            f"{report.isa})"
        )
    return 0 if report.ok else 1


def _warn_numerics(console: _Console, numerics: Mapping[str, Any]) -> None:
    """One warning line when values underflowed to zero, naming the worst tensors."""
    parts = []
    # Overflow has its own warning from the engine (the --on-overflow guard, also a
    # StcastWarning from the API), which names the worst tensors: not repeated here.
    kinds = (("underflow_to_zero", "underflowed to zero"),)
    for key, what in kinds:
        hit = [t for t in numerics["tensors"] if t[key] > 0]
        if not hit:
            continue
        total = numerics["total"][key]
        worst = sorted(hit, key=lambda t: -t[key])[:3]
        names = ", ".join(f"`{t['name']}` {t[key]}" for t in worst)
        values = "value" if total == 1 else "values"
        tensors = "tensor" if len(hit) == 1 else "tensors"
        parts.append(f"{total} {values} {what} in {len(hit)} {tensors} (worst: {names})")
    if parts:
        console.warn("; ".join(parts))


def _run_demo(args: argparse.Namespace, console: _Console) -> int:
    from . import demo  # numpy and ml_dtypes load only here

    return demo.run(size_gib=args.size_gib, dir=args.dir, keep=args.keep)


class _Console:
    """stderr messages, the progress bar and the JSON envelope of one command."""

    def __init__(self, json_mode: bool, command: str) -> None:
        self.json_mode = json_mode
        self.command = command
        self.bar: _ProgressBar | None = None
        # What a committing command prints, written at the end (`finish`).
        self.stdout = io.StringIO()
        # What the command published (for the message when stdout then fails).
        self.published: str | None = None

    def finish(self, code: int) -> int:
        """Write what the command printed; a failure here comes after the commit point."""
        text = self.stdout.getvalue()
        if not text:
            return code
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except (OSError, ValueError) as e:
            _silence_stdout()
            if isinstance(e, BrokenPipeError):
                return code  # the reader went away (`| head`): nothing to say
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            what = f"writing to stdout failed: {reason}"
            if self.published is not None:
                what = f"{self.published} was published, but {what}"
            self.error(what)
            return 1
        return code

    def end_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def error(self, message: str) -> None:
        self.end_bar()
        _print_err(f"{PROG}: {_one_line(message)}")

    def warn(self, message: str) -> None:
        self.end_bar()
        _print_err(f"{PROG}: warning: {_one_line(message)}")

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
        if isinstance(message, stcast.StcastWarning):
            text = render(message.template, "cli")
            self.warn(text if message.path is None else f"{message.path}: {text}")
        else:
            self.warn(f"{category.__name__}: {message}")

    def emit_json(self, result: dict[str, Any]) -> None:
        doc = {"schema": SCHEMA, "command": self.command, "version": stcast.__version__}
        doc["result"] = _cli_warnings(result)
        print(json.dumps(doc))

    def fail(self, kind: str, message: str, path: str | None, code: int = 1) -> int:
        """Report an error as one line on stderr (or as JSON with --json); return `code`."""
        if self.json_mode:
            self.end_bar()
            error = {"kind": kind, "message": _one_line(message), "path": path}
            doc = {"schema": SCHEMA, "command": self.command, "version": stcast.__version__}
            doc["error"] = error
            try:
                print(json.dumps(doc), flush=True)
            except OSError:
                pass
        else:
            self.error(message)
        return code


class _ProgressBar:
    """A one-line progress bar on a terminal, redrawn at most ten times a second."""

    WIDTH = 24

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.drawn = 0  # length of the last line drawn, 0 when none is on screen
        self.broken = False
        self.label = ""  # the current file of a folder, and how far it is

    def set_file(self, path: str, done: int, total: int) -> None:
        """Per-file progress of a folder conversion, shown after the whole-folder bar."""
        self.label = f"{path} {done * 100 // total if total > 0 else 100}%"

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.broken or (now - self.last_draw < 0.1 and done < total):
            return
        self.last_draw = now
        elapsed = now - self.start
        frac = done / total if total > 0 else 1.0
        filled = int(frac * self.WIDTH)
        line = (
            f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {frac * 100:3.0f}%  "
            f"{_size(done)} / {_size(total)}"
        )
        if elapsed >= 0.2 and done > 0:
            rate = done / elapsed
            if done < total:
                line += f"  {_size(rate)}/s  ETA {_duration((total - done) / rate)}"
            else:
                line += f"  {_size(rate)}/s  in {elapsed:.1f} s"
        if self.label:
            # Clipped to the terminal: a wrapped line could not be redrawn with a bare \r.
            room = _columns(self.stream) - 1 - len(line) - 2
            if room > 8:
                label = self.label if len(self.label) <= room else "..." + self.label[3 - room :]
                line += "  " + label
        # Pad over what is left of a longer previous line; no escape codes needed.
        padded = line.ljust(self.drawn)
        self.drawn = len(line)
        self._write("\r" + padded)

    def close(self) -> None:
        """End the bar's line so that what follows starts on a fresh one."""
        if self.drawn:
            self.drawn = 0
            self._write("\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            # A broken terminal must not abort the conversion: stop drawing instead.
            self.broken = True


def _columns(stream: TextIO) -> int:
    """The width of the terminal behind `stream`; 80 when it does not say."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):
        return 80


def _size(n: float) -> str:
    """Bytes in decimal units, three significant digits: 950 B, 12.3 kB, 4.56 GB."""
    return _core.format_bytes(max(0, int(n)))


def _cli_warnings(result: dict[str, Any]) -> dict[str, Any]:
    """A report's JSON with its warnings (and its files') in the CLI's words (`--force`)."""

    def words(d: dict[str, Any]) -> dict[str, Any]:
        if "warnings" in d:
            d = {**d, "warnings": [_notice_text(w) for w in d["warnings"]]}
        return d

    result = words(result)
    if isinstance(result.get("files"), list):
        result["files"] = [words(f) for f in result["files"]]
    return result


def _notice_text(w: object) -> str:
    return w.render("cli") if isinstance(w, stcast.Notice) else str(w)


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _one_line(message: str) -> str:
    return " ".join(message.split("\n")).strip()


def _print_err(line: str) -> None:
    try:
        print(_printable(line, keep=""), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


# Control characters (C0 but newline, DEL, C1) and surrogates: the escaped bytes of names
# that are not UTF-8 (os.fsdecode gives them as U+DC80..U+DCFF), and lone ones.
_UNPRINTABLE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_UNPRINTABLE_ALL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape_char(m: re.Match[str]) -> str:
    o = ord(m.group())
    if 0xDC80 <= o <= 0xDCFF:  # a byte that was not UTF-8
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def _printable(text: str, keep: str = "\n") -> str:
    """`text` safe for a terminal: control characters and undecodable bytes as escapes."""
    pattern = _UNPRINTABLE if keep else _UNPRINTABLE_ALL
    return pattern.sub(_escape_char, text)


class _EscapingStdout(io.TextIOBase):
    """sys.stdout for human-readable output: every write escaped (`_printable`)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, s: str) -> int:
        self.stream.write(_printable(s))
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def _escape_streams() -> None:
    """Make stdout and stderr safe for any name: escapes, never an encoding error."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass
    if not isinstance(sys.stdout, _EscapingStdout) and sys.stdout is not None:
        sys.stdout = _EscapingStdout(sys.stdout)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _describe_os_error(e: OSError) -> str:
    """`path: what failed: reason` on one line, without Python's `[Errno N]` decoration."""
    if e.strerror is None:
        return str(e)
    path = _os_error_path(e)
    if path is None:
        return e.strerror
    if e.filename2 is not None:
        path = f"{path} -> {_fspath(e.filename2)}"
    return f"{path}: {e.strerror}"


def _os_error_path(e: OSError) -> str | None:
    return None if e.filename is None else _fspath(e.filename)


def _os_error_kind(e: OSError) -> str:
    import errno

    return "no_space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io"


def _fspath(name: object) -> str:
    if isinstance(name, (str, bytes, os.PathLike)):
        return os.fsdecode(name)
    return str(name)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _shard(text: str) -> tuple[int, int]:
    i, slash, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = (0, 0)
    if not slash or not 1 <= shard[0] <= shard[1]:
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N, e.g. 2/8: {text!r}")
    return shard


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0: {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text}")
    return value
