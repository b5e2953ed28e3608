"""The `stcast` command line: `convert`, `inspect`, `verify`, `finalize`, `demo`,
`completion`, `manpage`.

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
import dataclasses
import os
import sys
import warnings

import stcast
from stcast import _console as out
from stcast import _core
from stcast.errors import render

TYPE_CHECKING = False  # importing `typing` would add ~5 ms to every start
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, NoReturn

PROG = out.PROG
# Commands that publish something (the commit point) before they print their summary.
_COMMITTING = frozenset({"convert", "finalize", "verify"})
_SIGNAL_WORDS = {2: "interrupted", 15: "terminated", 1: "hung up"}


class _Stop:
    """The cancel flag the CLI hands to the work: set once a signal was received."""

    def __init__(self, received: list[int]) -> None:
        self.received = received

    def is_set(self) -> bool:
        return bool(self.received)

    @property
    def signal(self) -> int | None:
        return self.received[0] if self.received else None


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
    out.escape_streams()
    # A one-shot process whose reports hold no reference cycles: the cyclic collector only
    # costs time (seconds for the hundreds of thousands of objects of a 300k-tensor report).
    if stop is not None:
        import gc

        gc.disable()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["--version"], ["-V"]):
        # Same text as argparse's version action, without building the parser (~8 ms).
        print(f"{PROG} {stcast.__version__}")
        return 0
    stop = stop or _Stop([])
    parser = build_parser()
    if not argv:
        print(_command_list(parser), file=sys.stderr)  # a usage error: stderr, exit 2
        return 2
    if argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-V", "--version"):
        out.print_err(f"{PROG}: error: unrecognized option {argv[0]} (see `{PROG} --help`)")
        return 2
    try:
        args, extra = parser.parse_known_args(argv)
        # An optional DST after options (`convert SRC --to fp16 DST`): argparse leaves it.
        if len(extra) == 1 and not extra[0].startswith("-") and getattr(args, "dst", 0) is None:
            args.dst, extra = extra[0], []
        sub = getattr(parser, "commands", {}).get(getattr(args, "command", None), parser)
        console = out.Console(args.command, **_options(args, lambda r: r["role"] == "terminal"))
        _check_max_shard_size(args, sub, extra, console)
        if extra:  # said by the command's own parser: its --help is the one to read
            sub.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help, --version and usage errors
        if isinstance(e, _UsageExit) and "--json" in argv:
            # With --json, a usage error is JSON on stdout too, as every other error.
            command = argv[0] if argv[0] in _HELP else None
            out.Console(command or PROG, json=True).fail("usage", e.message, None, 2)
        return _exit_code(e.code)
    except KeyboardInterrupt:
        out.print_err(f"{PROG}: interrupted")
        return 130
    if getattr(args, "dry_run", False):
        args.command, args.run = "inspect", _run_inspect
        if args.dst is None:
            # The destination convert would write: the dry run checks it as convert would.
            from ._api import default_destination

            try:
                args.dst = default_destination(args.src, args.to)
            except stcast.StcastError:
                pass  # (the run reports it)
    console.command = args.command
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
            out.silence_stdout()
            return 0
        return console.fail(_os_error_kind(e), _describe_os_error(e), _os_error_path(e))
    except Exception as e:  # never a traceback: one line, exit 1
        return console.fail("internal", f"internal error: {type(e).__name__}: {e}", None)
    return console.finish(code)


# --- the parser -------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line and a pointer to --help (exit 2)."""

    def error(self, message: str) -> NoReturn:
        out.print_err(f"{PROG}: error: {message} (see `{self.prog} --help`)")
        raise _UsageExit(f"{message} (see `{self.prog} --help`)")


class _UsageExit(SystemExit):
    """A usage error (exit 2), with its message for `--json`."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


_EXAMPLES = {
    "convert": """\
examples:
  stcast convert ema.safetensors                    # -> ema-bf16.safetensors beside it
  stcast convert ema.safetensors out.safetensors --to fp16 --on-overflow keep
  stcast convert model/ model-bf16/ --keep '*norm*' --keep-min-size 4096
  stcast convert model/ model-bf16/ --resume        # continue an interrupted run
  stcast convert model/ model-bf16/ --shard 2/8     # then: stcast finalize model/ model-bf16/
  stcast convert ema.safetensors ema-bf16/ --max-shard-size 5GB   # 5 GB shards + index
  stcast convert ema.safetensors --report report.json --json
  stcast convert pytorch_model.bin                  # -> pytorch_model-bf16.safetensors
  stcast convert model.pt --to keep                 # -> model.safetensors, dtypes kept
  stcast convert last.ckpt out.safetensors --key state_dict --strip-prefix model.
""",
    "inspect": """\
examples:
  stcast inspect ema.safetensors                    # each tensor's fate, and the totals
  stcast inspect ema.safetensors out/ --to fp16 --scan   # would it fit, and overflow?
  stcast inspect model/ model-bf16/ --resume        # every check convert --resume makes
  stcast inspect last.ckpt                          # its dicts of tensors, globals, plan
  stcast inspect model/ --max-shard-size 2GB        # the shard plan: files, sizes, tensors
""",
    "verify": """\
examples:
  stcast verify ema.safetensors ema-bf16.safetensors
  stcast verify model/ model-bf16/ --keep '*norm*'  # with the options convert was given
  stcast verify ema.safetensors torch-bf16.safetensors --loose   # written by another tool
""",
    "finalize": """\
examples:
  stcast finalize /data/Llama-405B /data/Llama-405B-bf16
""",
    "demo": """\
examples:
  stcast demo --size-gib 0.1
""",
    "completion": """\
examples:
  stcast completion bash > /etc/bash_completion.d/stcast
  stcast completion zsh > "${fpath[1]}/_stcast"
  stcast completion fish > ~/.config/fish/completions/stcast.fish
""",
    "manpage": """\
examples:
  stcast manpage > /usr/local/share/man/man1/stcast.1
  stcast manpage | man -l -
""",
}

_HELP = {
    "convert": "convert a checkpoint (file or folder) to bf16, fp16 or FP8",
    "inspect": "show what convert would do, and run its checks (a dry run)",
    "verify": "check that DST is exactly the conversion of SRC",
    "finalize": "complete a folder converted with --shard",
    "demo": "convert a synthetic checkpoint and verify it bit for bit",
    "completion": "print a shell completion script (bash, zsh, fish)",
    "manpage": "print the manual page (roff)",
}


class _Formatter(argparse.HelpFormatter):
    """Wraps the description to the terminal, keeps the examples (the epilog) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Convert checkpoints (safetensors, PyTorch, DCP, DeepSpeed ZeRO, FP8) to bf16, "
            "fp16 or FP8, exactly, in bounded memory."
        ),
        epilog="`stcast COMMAND --help` shows each command's options, defaults and examples.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"{PROG} {stcast.__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )

    def command(name: str, description: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=_HELP[name],
            description=description,
            epilog=_EXAMPLES.get(name),
            formatter_class=_Formatter,
        )

    p = command(
        "convert",
        "Convert SRC to bf16 (the default), fp16, or FP8 weights for vLLM (--to fp8, "
        "fp8-block); an FP8 checkpoint is dequantized to bf16. Other tensors and the metadata "
        "are kept. SRC may be a safetensors file, a PyTorch checkpoint (torch.save: .bin, .pt, "
        ".pth), read without torch and without running its pickle (an allow-list; anything "
        "else is refused), a DCP or DeepSpeed ZeRO checkpoint folder, or a Hugging Face "
        "folder: every .safetensors file (and pytorch_model*.bin file) in it is converted, its "
        "indexes and config.json files are updated and its other files are copied into the "
        "folder DST.",
    )
    p.add_argument(
        "src",
        metavar="SRC",
        help="input .safetensors file, PyTorch checkpoint (.bin, .pt, .pth) or checkpoint folder",
    )
    p.add_argument(
        "dst",
        metavar="DST",
        nargs="?",
        help="output (default: beside SRC, its stem + -bf16.safetensors, or -fp16 with "
        "--to fp16, or .safetensors for a PyTorch checkpoint with --to keep; for a folder, "
        "SRC-bf16 or SRC-fp16); a folder (existing, or ending in /) gets that name inside "
        "it; missing folders are made",
    )
    _add_options(p, "convert")
    p.set_defaults(run=_run_convert)

    p = command(
        "inspect",
        "A dry run of `stcast convert` with the same options: each tensor of SRC (a file, or "
        "every file of a checkpoint folder) with its dtype, the dtype it would get and why, "
        "and its bytes before and after; then the totals. With DST, every check convert "
        "makes runs too (it fails as convert would) and the free space there is shown. Only "
        "the headers are read, unless --scan.",
    )
    p.add_argument(
        "src",
        metavar="SRC",
        help="input .safetensors file, PyTorch checkpoint (.bin, .pt, .pth) or checkpoint folder",
    )
    p.add_argument(
        "dst", metavar="DST", nargs="?", help="where the output would go: run convert's checks"
    )
    _add_options(p, "inspect")
    p.set_defaults(run=_run_inspect)

    p = command(
        "verify",
        "Check, streaming both, that DST is exactly what `stcast convert` makes of SRC with "
        "the same options: every converted value bit for bit, every other tensor byte for "
        "byte, and the header. For folders, files are paired by relative path. Exit 0 when "
        "it is, 1 on the first difference (named on stderr).",
    )
    p.add_argument(
        "src",
        metavar="SRC",
        help="the original .safetensors file, PyTorch checkpoint or folder",
    )
    p.add_argument("dst", metavar="DST", help="the converted file or folder")
    _add_options(p, "verify")
    p.set_defaults(run=_run_verify)

    p = command(
        "finalize",
        "Once `stcast convert SRC DST --shard I/N` has run for every I, check that every file "
        "is done, then copy the other files and write the configs and indexes.",
    )
    p.add_argument("src", metavar="SRC", help="the checkpoint folder")
    p.add_argument("dst", metavar="DST", help="the folder the shards were converted into")
    _add_options(p, "finalize")
    p.set_defaults(run=_run_finalize)

    p = command(
        "demo",
        "Write a synthetic fp32 transformer checkpoint, convert it in a child process "
        "(reporting time and peak memory) and verify every tensor against numpy + ml_dtypes.",
    )
    p.add_argument(
        "--size-gib",
        type=_size_gib,
        default=1.0,
        metavar="X",
        help="input size in GiB (default 1.0)",
    )
    a = p.add_argument("--dir", metavar="D", help="make the temporary folder under D")
    a.completes = "files"  # type: ignore[attr-defined]
    p.add_argument("--keep-files", action="store_true", help="keep the files afterwards")
    p.set_defaults(run=_run_demo)

    p = command("completion", "Print a completion script for SHELL on stdout.")
    p.add_argument(
        "shell", metavar="SHELL", choices=["bash", "zsh", "fish"], help="bash, zsh, fish"
    )
    p.set_defaults(run=_run_completion)

    p = command("manpage", "Print stcast's manual page, generated from its options (roff).")
    p.set_defaults(run=_run_manpage)
    parser.commands = dict(commands.choices)  # type: ignore[attr-defined]
    return parser


def _command_list(parser: argparse.ArgumentParser) -> str:
    lines = [f"usage: {PROG} COMMAND [options]", "", "commands:"]
    width = max(len(n) for n in _HELP)
    lines += [f"  {n.ljust(width)}  {h}" for n, h in _HELP.items()]
    lines += ["", f"`{PROG} COMMAND --help` for a command's options; `{PROG} --version`."]
    return "\n".join(lines)


def _add_options(p: argparse.ArgumentParser, command: str) -> None:
    """The options of `command`, in the order of its help, from the engine's table
    (`_core.OPTIONS`, rust/options.rs); each is an API keyword of the same name."""
    for row in _core.OPTIONS:
        if row["command"] != command or row["front"] == "api":
            continue
        flags = [f"--{row['name'].replace('_', '-')}"]
        if row["short"] is not None:
            flags.insert(0, f"-{row['short']}")
        help_ = (
            argparse.SUPPRESS
            if row["help"] is None
            # The engine names other options as `{to=fp16}`: the CLI spells them as flags.
            else render(row["help"], "cli").replace("%", "%%")
        )
        kind, default = row["kind"], row["default"]
        spelled: dict[str, Any] = {"metavar": row["metavar"], "default": default}
        if kind == "flag":
            spelled = {"action": "store_true"}
        elif kind == "texts":
            spelled.update(action="append", default=[])
        elif kind == "choice":
            spelled.update(choices=row["choices"], metavar=None)
        elif kind in _VALUE_TYPES:
            spelled["type"] = _value_type(_VALUE_TYPES[kind], row)
        a = p.add_argument(*flags, help=help_, **spelled)
        # What shell completion offers for a value (`_completion`): paths, or the names.
        if kind == "path":
            a.completes = "files"  # type: ignore[attr-defined]
        elif kind == "target":
            a.completes = row["choices"]  # type: ignore[attr-defined]


def _value_type(
    read: Callable[[Mapping[str, Any], str], object], row: Mapping[str, Any]
) -> Callable[[str], object]:
    """argparse's `type` of an option: `read` with the option's row."""

    def typed(text: str) -> object:
        return read(row, text)

    return typed


def _options(
    args: argparse.Namespace, which: Callable[[Mapping[str, Any]], bool]
) -> dict[str, Any]:
    """The options of the command parsed into `args` whose row in the engine's table is
    `which` one."""
    rows = _core.OPTIONS
    return {
        r["name"]: getattr(args, r["name"])
        for r in rows
        if r["command"] == args.command and which(r)
    }


def _api_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the command parsed into `args` that its API function takes."""
    return _options(args, lambda row: row["front"] == "both")


# --- commands -----------------------------------------------------------------------------


def _run_convert(args: argparse.Namespace, console: out.Console) -> int:
    progress = console.start_progress()
    if args.on_overflow == "keep":
        console.note(
            "--on-overflow keep: reading the float tensors once first (an extra read of the "
            "input) to keep those that would overflow"
        )
    with _showing_warnings(console):
        report = stcast.convert(
            args.src,
            args.dst,
            progress=progress,
            file_progress=None if progress is None else progress.set_file,
            cancel=args.stop,
            **_api_options(args),
        )
    console.published = report.dst
    console.end_progress()
    if not console.summarizes(report):
        pass
    elif report.folder:
        _print_folder_summary(report, console, named=args.name is not None)
    else:
        seconds = console.elapsed()
        rate = report.bytes_in / seconds if seconds > 0 else 0.0
        _say(f"converted {report.src} -> {report.dst}")
        _say(f"  size     {out.size(report.bytes_in)} -> {out.size(report.bytes_out)}")
        _say(f"  tensors  {report.tensors_converted} converted, {report.tensors_copied} copied")
        _print_kept(report.tensors_kept, report.bytes_kept, report.kept)
        _print_fp8(report.quantized)
        _print_dequant(report)
        _say(
            f"  time     {seconds:.2f} s ({out.size(rate)}/s of input, "
            f"{_threads_text(report.threads)}, {report.isa})"
        )
    return 0


def _print_dequant(report: stcast.ConvertReport) -> None:
    """A quantized input's weights dequantized (by format), the tensors dropped, and the
    values written that are not finite (the numeric report has each weight's range)."""
    if not report.dequantized and not report.tensors_dropped:
        return
    formats: dict[str, int] = {}
    for d in report.dequantized:
        formats[d["format"]] = formats.get(d["format"], 0) + 1
    each = ", ".join(f"{k} {text}" for text, k in formats.items())
    n = len(report.dequantized)
    line = f"  dequant  {n} weight{'s' if n != 1 else ''}: {each}; {report.tensors_dropped} dropped"
    _say(line + " (scales, shapes, zero points)")
    nan = sum(d["nan"] for d in report.dequantized)
    inf = sum(d["inf"] for d in report.dequantized)
    if nan or inf:
        _say(f"           {nan} NaN and {inf} ±inf written (their scales made them)")


def _say(line: str) -> None:
    """Print a summary line; on a terminal narrower than it, wrapped at spaces (the terminal
    would cut a word in two), the rest indented under the value (`  time     ...`)."""
    line = out.printable(line, keep="")  # a name's newline must not break the line
    # Committing commands buffer their stdout (Console.stdout): ask the real one.
    real = sys.__stdout__
    width = out.columns(real) if real is not None and out.is_tty(real) else 0
    if width <= 0 or out.display_width(line) <= width:
        print(line)
        return
    import textwrap

    stripped = line.lstrip(" ")
    lead = len(line) - len(stripped)
    label = stripped.split("  ", 1)[0] if lead else ""
    hang = lead + len(label) + len(stripped[len(label) :]) - len(stripped[len(label) :].lstrip())
    indent = " " * (hang if lead and hang < width // 2 else lead + 2)
    wrapped = textwrap.wrap(
        line,
        width,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
        drop_whitespace=True,
    )
    print("\n".join(wrapped) if wrapped else line)


@contextlib.contextmanager
def _showing_warnings(console: out.Console) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("always", stcast.StcastWarning)
        warnings.showwarning = console.show_warning
        yield


def _print_fp8(quantized: Sequence[Mapping[str, Any]]) -> None:
    """The summary line of what FP8 did: weights, the worst relative error, values that
    became zero, all-zero groups (each weight's figures: --json, or the API's report)."""
    if not quantized:
        return
    worst = max(quantized, key=lambda q: q["rel_error"])
    flushed = sum(q["flushed"] for q in quantized)
    elements = sum(q["elements"] for q in quantized)
    zero = sum(q["zero_groups"] for q in quantized)
    n = len(quantized)
    name = out.printable(worst["name"], keep="")
    line = (
        f"  fp8      {n} weight{'s' if n != 1 else ''} quantized ({worst['strategy']} scales); "
        f"worst relative error {worst['rel_error']:.2%} in `{name}`; "
        f"{flushed} of {elements} values became 0"
    )
    if zero:
        line += f"; {zero} all-zero group{'s' if zero != 1 else ''}"
    _say(line)


def _threads_text(n: int | None) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def _print_kept(count: int, size: int, kept: Sequence[Mapping[str, Any]] | None = None) -> None:
    """The summary line of the tensors kept in their dtype (nothing when none was)."""
    if not count:
        return
    line = f"  kept     {count} tensor{'s' if count != 1 else ''} ({out.size(size)}) in their dtype"
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
    _say(line)


def _run_finalize(args: argparse.Namespace, console: out.Console) -> int:
    progress = console.start_progress()
    with _showing_warnings(console):
        report = stcast.finalize(
            args.src,
            args.dst,
            progress=progress,
            file_progress=None if progress is None else progress.set_file,
            cancel=args.stop,
        )
    console.published = report.dst
    console.end_progress()
    if console.summarizes(report):
        _print_folder_summary(report, console)
    return 0


def _print_folder_summary(
    report: stcast.ConvertReport, console: out.Console, named: bool = False
) -> None:
    count: dict[str, int] = {}
    for f in report.files:
        count[f.action] = count.get(f.action, 0) + 1
    actions = ("converted", "skipped", "checked", "rewritten", "copied")
    files = ", ".join(f"{count[a]} {a}" for a in actions if count.get(a))
    if count.get("checked"):
        _say(f"finalized {report.src} -> {report.dst}")
        _say(f"  files    {files}")
        _say("  the shard runs' outputs are intact; configs and indexes written last")
        return
    if not count.get("converted"):
        what = "the shard's files are" if report.shard is not None else "every file is"
        _say(f"nothing to do: {what} already converted in {report.dst}")
        _say(f"  files    {files}")
        return
    if report.shard is not None:
        _say(f"converted shard {report.shard[0]}/{report.shard[1]} of {report.src} -> {report.dst}")
    else:
        _say(f"converted {report.src} -> {report.dst}")
    _say(f"  files    {files}")
    _say(f"  size     {out.size(report.bytes_in)} -> {out.size(report.bytes_out)} converted")
    _say(f"  tensors  {report.tensors_converted} converted, {report.tensors_copied} copied")
    _print_kept(report.tensors_kept, report.bytes_kept, report.kept)
    _print_fp8(report.quantized)
    _print_dequant(report)
    if report.max_shard_size is not None:
        shards = sum(1 for f in report.files if f.kind == "weights")
        _say(f"  shards   {shards} of at most {out.size(report.max_shard_size)}")
        if not named:
            _print_name_hint(report)
    seconds = console.elapsed()
    rate = report.bytes_in / seconds if seconds > 0 else 0.0
    engine = ""
    if report.threads is not None:
        engine = f", {_threads_text(report.threads)}, {report.isa}"
    _say(f"  time     {seconds:.2f} s ({out.size(rate)}/s of input{engine})")
    if report.finalize is not None:
        src, dst = report.finalize
        _say(f"  then, once every shard is done:  stcast finalize {_quote(src)} {_quote(dst)}")


def _print_name_hint(report: stcast.ConvertReport) -> None:
    """After a lone file re-sharded under its own stem (not `model`): how to get the names
    transformers' `from_pretrained` loads."""
    if _core.source_kind(report.src) in ("tree", "checkpoint"):
        return
    weights = [os.path.basename(f.path) for f in report.files if f.kind == "weights"]
    if not weights or any(_stem_of(w) == "model" for w in weights):
        return
    _say(
        "  hint     transformers' from_pretrained loads model.safetensors[.index.json]: "
        "add --name model"
    )


def _stem_of(name: str) -> str | None:
    """The stem of a weights file name (`model` for `model-00001-of-00002.safetensors`), as
    the engine reads shard names; None for another name."""
    if not name.endswith(".safetensors"):
        return None
    base = name.removesuffix(".safetensors")
    parts = _core.split_shard_name(base)
    return parts[0] if parts is not None else base


def _quote(path: str) -> str:
    from shlex import quote

    return quote(path)


def _run_inspect(args: argparse.Namespace, console: out.Console) -> int:
    scanning = args.scan or args.on_overflow == "keep"
    progress = console.start_progress() if scanning else None
    report = stcast.inspect(args.src, args.dst, progress=progress, **_api_options(args))
    console.end_progress()
    for message in report.warnings:
        console.warn(out.notice_text(message))
    if console.json_mode and not report.folder:
        # The tensors are written as they are rendered (500,000 make 130 MB of text).
        head = dataclasses.replace(report, tensors=[]).to_dict()
        console.emit_json(head, rows=("tensors", report.tensors))
        return 0
    if not console.summarizes(report):
        return 0  # (`convert --dry-run -q`: the exit status says it all)

    if report.folder:
        for f in report.files:
            print(f"{out.printable(f.path, keep='')}:")
            _print_tensor_table(f, indent="  ")
            print()
        files = len(report.files)
        lone = _core.source_kind(report.path) not in ("tree", "checkpoint")
        what = "file:  " if lone else "folder:"
        path = out.printable(report.path, keep="")
        print(f"{what}   {path}, {files} weight file{'s' if files != 1 else ''}")
        _print_inspect_totals(report.files)
        print(
            f"output:   {out.size(report.output_bytes)} projected as {report.to} "
            f"(weights {out.size(report.output_bytes - report.other_bytes)}, "
            f"other files {out.size(report.other_bytes)})"
        )
        _print_other_files(report)
        if report.max_shard_size is not None:
            _print_shard_plan(report)
    else:
        _print_tensor_table(report)
        print()
        if report.format != "safetensors":
            _print_checkpoint(report)
        elif report.metadata is None:
            print("metadata: none")
        else:
            keys = ", ".join(out.printable(k, keep="") for k in report.metadata)
            print(f"metadata: {keys or '(empty)'}")
        _print_inspect_totals([report])
        if report.format in ("dcp", "dcp-safetensors"):
            # Only the selected tensors' bytes are read: the rest is never touched.
            print(
                f"folder:   {out.size(report.file_bytes)} in its files; reads "
                f"{out.size(report.data_bytes)} of tensor data, leaves "
                f"{out.size(report.file_bytes - report.data_bytes)} unread (other dicts, "
                "optimizer states, archive records)"
            )
        elif report.format != "safetensors":
            print(
                f"file:     {out.size(report.file_bytes)} "
                f"(pickle and archive {out.size(report.header_bytes)})"
            )
        else:
            print(
                f"file:     {out.size(report.file_bytes)} "
                f"(header {out.size(report.file_bytes - report.data_bytes)}, "
                f"data {out.size(report.data_bytes)})"
            )
        print(f"output:   {out.size(report.output_bytes)} projected as {report.to}")
    d = report.destination
    if d is not None:
        verdict = "fits" if d["fits"] else "does NOT fit"
        print(
            f"space:    {d['folder']} has {out.size(d['free_bytes'])} free, the output needs "
            f"{out.size(d['need_bytes'])}: {verdict}"
        )
        print("checks:   every check convert makes passed: it would run")
    return 0


# Why a folder's file is left out, as the table of `inspect` says it.
_LEFT_OUT = {
    "trainer": "training state ({include} copies it)",
    "superseded": "PyTorch weights beside their safetensors version",
    "excluded": "matched by {exclude}",
}


def _print_other_files(report: stcast.InspectReport, most: int = 20) -> None:
    """A folder's files besides its weights, by name with sizes: copied or rewritten, then
    left out and why (`most` of each, then how many more)."""
    listed: list[tuple[str, str, int, str]] = [
        (f["action"], f["path"], f["bytes"], "") for f in report.other_files
    ]
    left = [("left out", f["path"], f["bytes"], _LEFT_OUT[f["why"]]) for f in report.left_out]
    rows: list[tuple[str, str, str, str]] = []
    for items in (listed, left):
        for action, path, n, why in items[:most]:
            rows.append((action, out.printable(path, keep=""), out.size(n), render(why, "cli")))
        if len(items) > most:
            rest = out.size(sum(n for _, _, n, _ in items[most:]))
            rows.append(("", f"... and {len(items) - most} more", rest, ""))
    if not rows:
        return
    width = max(len(r[1]) for r in rows)
    print("other files:")
    for action, path, size, why in rows:
        print(f"  {action:<9}  {path:<{width}}  {size:>9}  {why}".rstrip())


def _print_checkpoint(report: stcast.InspectReport) -> None:
    """What a PyTorch checkpoint's inspection adds: its format, the dict, the globals."""
    what = {
        "pytorch": "PyTorch checkpoint (zip)",
        "dcp": "torch.distributed.checkpoint (DCP) folder",
        "dcp-safetensors": "torch.distributed.checkpoint folder of safetensors shards",
        "deepspeed": "DeepSpeed ZeRO checkpoint folder",
    }.get(report.format, "legacy PyTorch checkpoint")
    where = "the top level" if not report.key else f"`{out.printable(report.key, keep='')}`"
    if report.format == "deepspeed":
        where = "the state dict zero_to_fp32 rebuilds (the fp32 masters, buffers, frozen)"
    print(f"format:   {what}; tensors from {where}")
    if report.skipped:
        shown = ", ".join(f"`{out.printable(n, keep='')}`" for n in report.skipped[:8])
        more = f" and {len(report.skipped) - 8} more" if len(report.skipped) > 8 else ""
        print(f"skipped:  {len(report.skipped)} entries that are not tensors: {shown}{more}")
    unlisted = set(report.unlisted)
    allowed = [out.printable(g, keep="") for g in report.globals if g not in unlisted]
    print(f"globals:  allow-listed: {', '.join(allowed) or 'none'}")
    if report.unlisted:
        names = ", ".join(out.printable(g, keep="") for g in report.unlisted)
        print(f"          not on the allow-list (inert, never called): {names}")
    print('metadata: none in a pickle; the output gets {"format": "pt"}')


def _print_shard_plan(report: stcast.InspectReport) -> None:
    """The output shards (file, size, tensors, the input files each reads) and indexes."""
    assert report.max_shard_size is not None
    n = len(report.shards)
    print(
        f"shards:   {n} file{'s' if n != 1 else ''} of at most "
        f"{out.size(report.max_shard_size)} ({report.max_shard_size} bytes)"
    )
    head = ["  FILE", "SIZE", "TENSORS", "FROM"]
    rows = []
    for s in report.shards:
        inputs = s["inputs"] or ["-"]  # an empty checkpoint's one file reads none
        source = out.printable(inputs[0], keep="")
        if len(inputs) > 1:
            source += f" .. {out.printable(inputs[-1], keep='')} ({len(inputs)} files)"
        rows.append(
            [
                "  " + out.printable(s["path"], keep=""),
                out.size(s["bytes"]),
                str(s["tensors"]),
                source,
            ]
        )
    width, left, right = _justifiers(rows)
    widths = [max(map(width, column)) for column in zip(head, *rows)]
    just = [left, right, right, left]
    for row in [head, *rows]:
        print("  ".join(j(c, w) for j, c, w in zip(just, row, widths)).rstrip())
    for i in report.indexes:
        print(
            f"index:    {out.printable(i['path'], keep='')}: {i['shards']} shards, total_size "
            f"{i['total_size']}"
        )


def _justifiers(
    rows: list[list[str]],
) -> tuple[Callable[[str], int], Callable[[str, int], str], Callable[[str, int], str]]:
    """How to measure and pad a table's cells: by terminal columns, not code points (a CJK
    or emoji name takes two per character), with str's own methods when all are ASCII."""
    if all(c.isascii() for row in rows for c in row):
        return len, str.ljust, str.rjust
    return out.display_width, out.ljust, out.rjust


# What the inspect table says of each reason (see stcast.TensorInfo.reason).
_REASONS = {
    "converted": "convert",
    "keep_overflow": "keep: would overflow",
    "already_target": "copy: already the target",
    "bf16_source": "copy: BF16 (convert with --from-bf16)",
    "not_converted": "copy: not converted",
    "not_float": "copy: not a float",
    "quantized": "quantize: FP8 + scale",
    "dequantized": "dequantize: codes x scale",
    "dropped": "drop: used to dequantize (a scale, zero point or shape)",
}

# Why an FP8 target does not quantize a float tensor it converts to BF16.
_NOT_QUANTIZED = {
    "not_weight": "not a weight",
    "not_2d": "not 2-D",
    "experts": "3-D experts",
    "norm": "a norm",
    "embedding": "an embedding",
    "lm_head": "the output head",
    "router": "a router gate",
    "vision": "the vision tower",
    "dtype": "F64",
    "empty": "empty",
    "nonfinite": "NaN or inf",
}


def _reason(t: stcast.TensorInfo) -> str:
    if t.reason == "keep_pattern":
        return f"keep: --keep '{t.pattern or ''}'"
    if t.reason == "keep_min_size":
        return "keep: under --keep-min-size"
    if t.reason == "converted" and t.not_quantized is not None:
        return f"convert: {_NOT_QUANTIZED.get(t.not_quantized, t.not_quantized)}, not FP8"
    if t.quantization is not None:
        return f"dequantize: {t.quantization['text']}"
    if t.companion is not None:
        role = _COMPANIONS.get(t.companion["role"], t.companion["role"])
        return f"drop: its {role}, used to dequantize"
    return _REASONS.get(t.reason, t.reason)


# What a tensor a dequantization drops was for (`TensorInfo.companion`), in words.
_COMPANIONS = {
    "scale": "scale",
    "global_scale": "global scale",
    "zero_point": "zero point",
    "shape": "shape",
    "input_scale": "activation scale",
}


def _print_dequantized(tensors: list[stcast.TensorInfo]) -> None:
    """The summary of a quantized input: its weights dequantized, by format, and the tensors
    dropped, by what they were for."""
    formats: dict[str, int] = {}
    for t in tensors:
        if t.quantization is not None:
            text = t.quantization["text"]
            formats[text] = formats.get(text, 0) + 1
    roles: dict[str, int] = {}
    dropped = [t for t in tensors if t.reason == "dropped"]
    for t in dropped:
        role = t.companion["role"] if t.companion is not None else "other"
        roles[role] = roles.get(role, 0) + 1
    if formats:
        n = sum(formats.values())
        each = ", ".join(f"{k} {text}" for text, k in formats.items())
        _say(f"dequant:  {n} weight{'s' if n != 1 else ''}: {each}")
    if dropped:
        each = ", ".join(
            f"{k} {_COMPANIONS[r]}{'s' if k != 1 else ''}"
            for r, k in roles.items()
            if r in _COMPANIONS
        )
        other = roles.get("other", 0)
        if other:
            each += f"{', ' if each else ''}{other} other"
        n = len(dropped)
        _say(f"dropped:  {n} tensor{'s' if n != 1 else ''} used to dequantize: {each}")


def _print_tensor_table(report: stcast.InspectReport, indent: str = "") -> None:
    head = ["NAME", "DTYPE", "SHAPE", "BYTES", "TARGET", "OUT", "WHY"]
    rows = [
        [
            out.printable(t.name, keep=""),
            t.dtype,
            _shape(t.shape),
            out.size(t.bytes),
            t.target_dtype,
            out.size(t.target_bytes),
            out.printable(_reason(t), keep=""),
        ]
        for t in report.tensors
    ]
    if report.scanned:
        head[6:6] = ["OVERFLOW", "UNDERFLOW"]
        for t, row in zip(report.tensors, rows):
            n = t.numerics
            cells = ["-", "-"] if n is None else [str(n["overflow"]), str(n["underflow_to_zero"])]
            row[6:6] = cells
    # Padded by terminal columns, not code points: CJK and emoji names take two each.
    width, left, right = _justifiers(rows)
    widths = [max(map(width, column)) for column in zip(head, *rows)]
    on_right = {3, 5, 6, 7} if report.scanned else {3, 5}  # numbers line up on the right
    just = [right if i in on_right else left for i in range(len(head))]
    lines = [
        indent + "  ".join([j(c, w) for j, c, w in zip(just, row, widths)]).rstrip()
        for row in [head, *rows]
    ]
    # One write per many lines (the cells are escaped already): 300k tensors print fast.
    for i in range(0, len(lines), 4096):
        sys.stdout.write("\n".join(lines[i : i + 4096]) + "\n")


def _print_inspect_totals(reports: list[stcast.InspectReport]) -> None:
    tensors = [t for r in reports for t in r.tensors]
    changed = ("converted", "quantized", "dequantized")
    converted = [t for t in tensors if t.reason in changed]
    kept = [t for t in tensors if t.reason in _core.KEPT_REASONS]
    copied = [
        t
        for t in tensors
        if t.reason not in changed and t.reason not in _core.KEPT_REASONS and t.reason != "dropped"
    ]
    parts = [
        f"{len(converted)} to convert ({out.size(sum(t.bytes for t in converted))} -> "
        f"{out.size(sum(t.target_bytes for t in converted))})"
    ]
    if kept:
        parts.append(f"{len(kept)} kept in their dtype ({out.size(sum(t.bytes for t in kept))})")
    parts.append(f"{len(copied)} to copy ({out.size(sum(t.bytes for t in copied))})")
    _say(f"tensors:  {len(tensors)}: {', '.join(parts)}")
    _print_dequantized(tensors)
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
    _say(f"scan:     {'; '.join(lines)}")


def _run_verify(args: argparse.Namespace, console: out.Console) -> int:
    progress = console.start_progress()
    with _showing_warnings(console):  # a prefix given to strip that matches no name
        report = stcast.verify(args.src, args.dst, progress=progress, **_api_options(args))
    if args.report is not None and report.ok:
        console.published = args.report
    console.end_progress()
    if report.mismatch is not None and not console.json_mode:
        m = report.mismatch
        where = report.dst if m.file is None else os.path.join(report.dst, m.file)
        text = out.notice_text(m.message)
        if m.file is not None and text.startswith(f"{m.file}: "):
            text = text[len(m.file) + 2 :]
        console.error(f"{where}: {text}")
    elif console.summarizes(report):
        mode = " (loose)" if report.loose else ""
        _say(f"verified {report.dst}: exactly the conversion of {report.src}{mode}")
        if report.folder:
            _say(f"  files    {report.files} compared")
        _say(
            f"  tensors  {report.tensors_converted} converted, {report.tensors_identical} identical"
        )
        seconds = console.elapsed()
        rate = report.bytes_compared / seconds if seconds > 0 else 0.0
        _say(
            f"  time     {seconds:.2f} s ({out.size(report.bytes_compared)} compared, "
            f"{out.size(rate)}/s, {_threads_text(report.threads)}, {report.isa})"
        )
    return 0 if report.ok else 1


def _run_demo(args: argparse.Namespace, console: out.Console) -> int:
    from . import demo  # numpy and ml_dtypes load only here

    return demo.run(size_gib=args.size_gib, dir=args.dir, keep=args.keep_files)


def _run_completion(args: argparse.Namespace, console: out.Console) -> int:
    from . import _completion

    print(_completion.script(build_parser(), args.shell), end="")
    return 0


def _run_manpage(args: argparse.Namespace, console: out.Console) -> int:
    from . import _completion

    print(_completion.manpage(build_parser(), stcast.__version__), end="")
    return 0


# --- small helpers ----------------------------------------------------------------------------


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


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


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 2


def _check(row: Mapping[str, Any], value: object) -> Any:
    """`value` of the option of `row`, as the engine checks it (`_core.check_option`)."""
    return _core.check_option(row["name"], value)


def _target(row: Mapping[str, Any], text: str) -> str:
    try:
        name: str = _check(row, text)  # the engine resolves aliases
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown target {text!r}: {', '.join(_core.TARGETS[:-1])} or {_core.TARGETS[-1]}"
        ) from None
    return name


def _whole(row: Mapping[str, Any], text: str) -> int:
    """A whole number, as typed: the engine checks its range; the words are argparse's."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    try:
        checked: int = _check(row, value)
    except stcast.StcastError:
        raise argparse.ArgumentTypeError(f"{text} is not from 0 to {row['max'] or 0}") from None
    return checked


def _shard(row: Mapping[str, Any], text: str) -> tuple[int, int]:
    i, slash, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = (0, 0)
    if not slash or not 1 <= shard[0] <= shard[1] or shard[1] >= 2**32:
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N, e.g. 2/8: {text!r}")
    return shard


def _checked(row: Mapping[str, Any], text: str) -> Any:
    """A value as the engine checks it (a stem, a size), in the engine's words without the
    option's flag: argparse names it already ("argument --name: ...")."""
    try:
        return _check(row, text)
    except stcast.StcastError as e:
        flag = render(f"{{{e.option}}}", "cli")
        raise argparse.ArgumentTypeError(e.render("cli").removeprefix(f"{flag}: ")) from None


class _Size(int):
    """A size in bytes that remembers how it was typed."""

    text: str


def _size(row: Mapping[str, Any], text: str) -> int:
    size = _Size(_checked(row, text))
    size.text = text
    return size


# How the command line reads a value of each kind of option (`_add_options`), given the
# option's row of the engine's table.
_VALUE_TYPES: dict[str, Callable[[Mapping[str, Any], str], object]] = {
    "int": _whole,
    "target": _target,
    "size": _size,
    "part": _shard,
    "stem": _checked,
}


# A size unit alone: what `--max-shard-size 5 GB` leaves as DST (or SRC).
_UNIT = r"(?:[kmgt]i?)?b"


def _check_max_shard_size(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    extra: list[str],
    console: out.Console,
) -> None:
    """`--max-shard-size 5 GB` (a space) makes `GB` the DST: 5-byte shards in a folder `GB`.
    Refused (exit 2, nothing written), showing the fix; a bare number of bytes under 1 MB
    (`--max-shard-size 5`) is probably such a slip too, and warned about."""
    import re

    size = getattr(args, "max_shard_size", None)
    if size is None:
        return
    text = getattr(size, "text", str(size))
    # Only a size without a unit can have lost its unit to the next argument: with
    # `--max-shard-size 3kB b`, `b` is a folder.
    bare = re.fullmatch(r"\s*[0-9]+(\.[0-9]*)?\s*", text) is not None
    typed = [("DST", getattr(args, "dst", None)), ("SRC", getattr(args, "src", None))]
    for what, value in [*typed, *(("argument", e) for e in extra)] if bare else []:
        if value is None or not re.fullmatch(_UNIT, os.path.basename(value.rstrip("/")), re.I):
            continue
        if what == "SRC" and _core.source_kind(value) is not None:
            continue
        unit = os.path.basename(value.rstrip("/"))
        parser.error(
            f"{what} {value!r} is a size unit: write the size as one word, "
            f"--max-shard-size {text.strip()}{unit}"
        )
    if bare and size < 1_000_000:
        t = text.strip()
        # `5` was surely meant as 5GB; `300000` maybe as bytes, maybe not.
        fix = f"for gigabytes write {t}GB" if size < 1000 else "give a unit, or B to mean bytes"
        console.warn(f"--max-shard-size {t} is {int(size)} bytes per shard; {fix}")


def _size_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    # More than this machine's disk could hold is a typo (1e300), not a request.
    if not 0 < value <= 1 << 16:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 65536: {text}")
    return value
