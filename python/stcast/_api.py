"""The Python API: `convert`, `inspect`, `verify` and `finalize`, for files and folders.

Import it through the package (`stcast.convert`, ...); the package loads this module on
first use so that `stcast --version` does not pay for it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import _core, _engine, _types
from ._options import Options
from .reports import ConvertReport, InspectReport, VerifyReport, folder_report

if TYPE_CHECKING:
    from typing import Callable

    from typing_extensions import Unpack

    from ._engine import CancelFlag
    from ._types import (
        ConvertOptions,
        InspectOptions,
        StrPath,
        Target,
        TargetAlias,
        VerifyOptions,
    )

__all__ = ["convert", "finalize", "inspect", "verify"]


def convert(
    src: StrPath,
    dst: StrPath | None = None,
    *,
    progress: Callable[[int, int], object] | None = None,
    cancel: CancelFlag | None = None,
    file_progress: Callable[[str, int, int], object] | None = None,
    **options: Unpack[ConvertOptions],
) -> ConvertReport:
    """Convert the checkpoint `src` (a safetensors file, a PyTorch checkpoint or a folder) to
    `to`, writing `dst` (safetensors).

    F32, F64 (and, for bf16, F16) tensors are rounded to nearest, ties to even, subnormals
    included; NaN keeps its sign and becomes the quiet NaN (`sign | 0x7FC0` in bf16). Every
    other tensor is copied byte for byte, and `__metadata__` is kept. stcast rounds F64 once,
    correctly, as ml_dtypes >= 0.7 does; torch (and ml_dtypes < 0.7) round it twice, via F32,
    and can differ in the last bit.
    Memory stays bounded whatever the size: the input is mapped and converted in small
    windows that are released once written. The output appears only once complete.

    A PyTorch checkpoint (`torch.save`: `.bin`, `.pt`, `.pth`, zip or legacy format) is read
    without torch and without running its pickle: only an allow-list of names (tensor
    rebuild functions, storage classes, dtypes, OrderedDict, plain containers) is
    understood, any other is an inert placeholder, and one that would build a selected
    tensor, or a dangerous one (`os.system`, `builtins.eval`, ...) anywhere, is refused.
    Its output gets the metadata `{"format": "pt"}`.

    Args:
        src: the input file (safetensors or PyTorch checkpoint), or a checkpoint folder
            (Hugging Face layout, diffusers pipeline, cache snapshot; `pytorch_model*.bin`
            become `model*.safetensors`).
        dst: the output; default `<stem>-bf16.safetensors` beside a file (`-fp16` for fp16;
            `<stem>.safetensors` for a PyTorch checkpoint with `to="keep"`), `<src>-bf16`
            beside a folder. For a file, a folder (one that exists, or a path ending in
            `/`) gets that default name inside it; missing folders are made once every
            check has passed.
        progress: called as `progress(done, total)` (bytes of tensor data, the whole folder
            for a folder) at least every 64 MiB. An exception it raises stops the conversion
            cleanly (no output is left) and propagates.
        cancel: any object with `is_set()`, e.g. a `threading.Event`, checked at least every
            64 MiB; once set, `Cancelled` is raised and no output is left behind.
        file_progress: folders: called as `file_progress(path, done, total)` per file.
        options: keywords, typed by `ConvertOptions` (`stcast._types`), each documented
            below.

    Ctrl-C raises KeyboardInterrupt within a second and leaves no temp or partial file: a
    file `dst` is as it was. A folder run (also one a raising `progress` callback stops)
    keeps the files it finished and its manifest `dst/.stcast-manifest.json`:
    `resume=True` continues it, `force=True` converts everything again, and without
    either the next run into `dst` is refused; remove `dst` to discard it. A folder run
    that fails while converting (an overflow under `on_overflow="error"`) removes what it
    added, and keeps what was there. The GIL is
    released while converting, but Python checks for signals only on the main thread: when
    `convert` runs in another thread, pass `cancel=threading.Event()` and set it to stop.

    Warnings about the plan (e.g. F32 scales in a quantized checkpoint) are issued as
    `StcastWarning` before any data is written; turn them into errors with
    `warnings.simplefilter("error", stcast.StcastWarning)` to refuse such conversions.

    Raises:
        InvalidInput: the input is not a valid checkpoint (`.kind`, `.path`).
        Refused: the operation is refused (destination inside the source, strict, a pickle
            that calls a global outside the allow-list, several dicts of tensors and no
            `key`, ...).
        DestinationExists: `dst` exists and `force` is false (also a FileExistsError).
        NoSpace: the destination is full (also an OSError with errno ENOSPC).
        UsageError: an option is out of range.
        OSError: reading or writing failed (FileNotFoundError, PermissionError, ...).
        Cancelled: `cancel.is_set()` became true.
        KeyboardInterrupt: Ctrl-C.
    """
    o = Options.of("convert", options).checked("convert")
    # One engine call: the route (one file, a folder run, a re-sharding), every check, the
    # writing, the numeric report (rust/command.rs).
    with _engine.gc_paused():
        data = _core.convert(
            os.fsdecode(src),
            _path(dst),
            progress=progress,
            file_progress=file_progress,
            cancel=cancel,
            warn=_engine.issue,
            **_report(o).keywords("convert"),
        )
        if data["folder"]:
            return folder_report(data)
        return _engine.file_report(data)


def inspect(
    path: StrPath,
    dst: StrPath | None = None,
    *,
    progress: Callable[[int, int], object] | None = None,
    **options: Unpack[InspectOptions],
) -> InspectReport:
    """Describe what `convert(path, dst, ...)` would do with the same options: a dry run.

    For each tensor: its dtype, the dtype it would get, why (`reason`), and its bytes
    before and after; then the totals. Only the header is read, so this is fast for any
    size, unless `scan=True`: then the tensors to convert are read (window by window,
    memory bounded, the GIL released) and each gets its `numerics`: the overflow and
    underflow counts and largest errors the conversion would give. `on_overflow="keep"`
    implies the scan and plans the tensors that would overflow as kept, as `convert` does.
    With `dst`, every check `convert(path, dst, ...)` makes before writing runs too, with
    the options that change them, and fails exactly as the conversion would; then
    `.destination` says how much space its folder has and whether the output fits. A folder
    `path` gives a report with `folder=True` and one report per weight file in `files`.
    Plan warnings are returned in `.warnings`, not issued. For a PyTorch checkpoint the
    report also gives its `format`, the `key` of the dict converted, the entries `skipped`
    and the `globals` its pickle names (`unlisted`: those outside the allow-list).

    Args:
        path: a .safetensors file or a checkpoint folder.
        dst: the output `convert` would write; given, its checks run too.
        progress: called as `progress(done, total)` (bytes scanned).
        options: keywords, typed by `InspectOptions` (`stcast._types`), each documented
            below.

    Raises:
        InvalidInput: the file is not a valid safetensors file or PyTorch checkpoint.
        UsageError: a `keep` pattern or another option is invalid.
        OSError: it cannot be read.
    """
    o = Options.of("inspect", options).checked("inspect")
    # One engine call: the route, the plan (and scan), with `dst` after every check the run
    # makes, failing as it would (a plain inspect only warns of a quantized checkpoint; a dry
    # run refuses it as convert does), and a re-sharding's plan (rust/command.rs).
    keywords = _report(o).keywords("inspect")
    return _engine.inspect(os.fsdecode(path), _path(dst), progress=progress, **keywords)


def verify(
    src: StrPath,
    dst: StrPath,
    *,
    progress: Callable[[int, int], object] | None = None,
    **options: Unpack[VerifyOptions],
) -> VerifyReport:
    """Check that `dst` is exactly what `convert` makes of `src`, streaming both.

    Files: DST must be exactly SRC converted (SRC may be a PyTorch checkpoint, read with
    `key` and `strip_prefix` as `convert` read it; a DST whose every tensor kept its dtype is
    checked as `to="keep"`). Every tensor must be there with its shape and
    the metadata kept; in strict mode (the default) DST must be what `convert` writes with
    these options: each float tensor converted to the target (`to`; default the target DST
    was converted to) unless `keep`, `keep_min_size` or `on_overflow="keep"` keep it (a
    kept tensor for overflow must indeed overflow), in convert's order with its header
    byte for byte; converted values are recomputed and compared bit for bit (NaN encodings
    included), every other tensor byte for byte.

    `loose=True` is for files written by other tools (e.g. torch): any float tensor may be
    kept or converted, and tensor order, metadata key order, alignment and header layout
    are not compared; a NaN only has to stay a NaN. Every other value must still be exact.

    Folders: files are paired by relative path; each weight file is verified as above, copies
    must hold the source's bytes, configs the source's text with only the dtype changed,
    indexes the source's weight map with the total size of DST's shards. The mismatch names
    the file. When DST is sharded differently (`max_shard_size`), tensors are paired by
    name through the indexes: each index's shards (or a lone file) of SRC with the DST
    files of the same stem, every tensor in exactly one of them, each DST shard exactly
    what `convert` writes for the tensors it holds, its index listing them. SRC may then
    be a file, and DST the folder it was re-sharded into.

    A difference is not an exception: the report says `ok=False` and gives the first
    `mismatch`. Memory stays bounded; the GIL is released in steps of 64 MiB, between
    which Ctrl-C is honoured and `progress` is called.
    With `report`, a verified pair's numeric report is written there (as `convert` writes
    it); an existing file needs `force`.

    Args:
        src, dst: the original and the converted file (or folder). For a file `src`, a
            folder `dst` holding the file `convert` names by default (for `to`; without
            it, for any target) means that file, as `convert(src, dst)` writes it.
        progress: called as `progress(done, total)`: data bytes of both files compared, the
            total being `bytes_compared` of a verification that finds no difference.
        options: keywords, typed by `VerifyOptions` (`stcast._types`), each documented
            below.

    Raises:
        InvalidInput: a file is not a valid safetensors file (or, for SRC, PyTorch
            checkpoint).
        Refused: SRC and DST are the same file, or `report` names one of them.
        UsageError: an option is out of range.
        OSError: a file cannot be read.
        KeyboardInterrupt: Ctrl-C.
    """
    keywords = _report(Options.of("verify", options).checked("verify")).keywords("verify")
    # One engine call: the route (a DST folder that is a checkpoint to convert is refused;
    # a folder DST of a file SRC is the file convert writes there; a re-sharded stem names
    # a DST folder's files), then the verification (rust/command.rs).
    return _engine.verify(os.fsdecode(src), os.fsdecode(dst), progress=progress, **keywords)


def finalize(
    src: StrPath,
    dst: StrPath,
    *,
    progress: Callable[[int, int], object] | None = None,
    file_progress: Callable[[str, int, int], object] | None = None,
    cancel: CancelFlag | None = None,
) -> ConvertReport:
    """Complete the folder `dst` once `convert(src, dst, shard=(i, n))` ran for every i.

    Every weight file of `src` must have been converted, per the manifests in `dst`, with the
    same options, and its output must be intact. Then the other files are copied and the
    configs and indexes written (last), as a plain `convert` of the folder would.

    Args:
        src, dst: the folder given to each shard run, and their output folder.
        progress: called as `progress(done, total)` (bytes of the files checked and copied).
        file_progress: called as `file_progress(path, done, total)` per file.
        cancel: an object with `is_set()` (a `threading.Event`): stop soon, leaving `dst`
            as the shard runs left it.

    Raises:
        Refused: a file is missing or stale (the message names the shard to run again), or
            the folder is inconsistent.
    """
    report = _core.finalize(
        os.fsdecode(src),
        os.fsdecode(dst),
        progress=progress,
        file_progress=file_progress,
        cancel=cancel,
        warn=_engine.issue,
    )
    return folder_report(report)


def default_destination(src: StrPath, to: Target | TargetAlias = "bf16") -> str:
    """The output `convert(src)` writes when no `dst` is given: `<stem>-bf16.safetensors`
    beside a file, `<folder>-bf16` beside a folder (`-fp16` for fp16)."""
    return _core.default_dst(os.fsdecode(src), to)


def _path(path: StrPath | None) -> str | None:
    """An optional path as a `str`."""
    return None if path is None else os.fsdecode(path)


def _report(o: Options) -> Options:
    """`report` as a `str`."""
    return o.replace(report=None if o.report is None else os.fsdecode(o.report))


def _document(fn: Callable[..., object], *typed: type) -> None:
    """Append to `fn`'s docstring the documentation of its options, each written once, in
    the `TypedDict` that types it (`stcast._types`), so that `help(stcast.convert)` shows
    them."""
    if fn.__doc__:  # (none under `python -OO`)
        fn.__doc__ += "".join(f"\n    {t.__doc__}" for t in typed)


_document(convert, _types._Options, _types.ConvertOptions)
_document(inspect, _types._Options, _types.ConvertOptions, _types.InspectOptions)
_document(verify, _types._Options, _types.VerifyOptions)
