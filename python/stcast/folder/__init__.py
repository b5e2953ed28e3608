"""Convert a checkpoint folder: every shard, its indexes and configs; the rest is copied.

The per-file engine converts each `.safetensors` file with bounded memory and publishes it
atomically. This package walks the folder and checks it before writing anything (`walk`:
index names, index/shard agreement, quantized checkpoints), converts the files one after
another, each with all cores (`write`), copies everything else byte for byte, and writes
the indexes and configs last (`jsonedit` edits them in their own text): an interrupted run
never leaves a folder that a loader would take for a complete checkpoint. A manifest in the
destination records what is done (`manifest`), so that `resume` skips finished files and
`shard=(i, n)` jobs on several machines can split the work, with `finalize` writing the rest
once every shard is done.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from .. import _core, _engine
from ..errors import Refused
from ..reports import ConvertReport, FileReport, InspectReport, Notice
from . import manifest as _manifest
from . import walk as _walk
from . import write as _write

if TYPE_CHECKING:
    from typing import Callable

    from .._engine import CancelFlag, Progress
    from .._types import OnOverflow, Target

__all__ = ["assign_shards", "convert_folder", "default_dst", "finalize", "inspect_folder"]

assign_shards = _walk.assign_shards
_esc = _core.escape


def convert_folder(
    src: str,
    dst: str | None,
    *,
    to: Target,
    threads: int | None,
    force: bool,
    resume: bool,
    shard: tuple[int, int] | None,
    allow_quantized: bool,
    progress: Progress | None,
    file_progress: Callable[[str, int, int], object] | None,
    cancel: CancelFlag | None,
    keep: list[str],
    keep_min_size: int,
    strict: bool,
    from_bf16: bool,
    on_overflow: OnOverflow,
    tuning: dict[str, Any] | None = None,
) -> ConvertReport:
    """Convert the checkpoint folder `src` into `dst`; see `stcast.convert` for the options."""
    started = time.monotonic()
    dst = default_dst(src, to) if dst is None else dst
    if shard is not None:
        shard = _check_shard(shard)
    _check_folders(src, dst)
    precision = _precision_options(keep, keep_min_size, from_bf16, on_overflow)
    plan = _walk.plan(src, to, check_quantized=not allow_quantized, precision=precision)
    # A keep pattern is judged over the whole folder: one warning (or, strict, one error
    # before anything is written) for a pattern that matches no tensor of any file.
    folder_warnings = []
    if plan.keep_unmatched:
        template = _unmatched_template(plan.keep_unmatched)
        if strict:
            raise Refused(
                f"{_esc(src)}: {template}; nothing was written ({{strict}} makes this an error)",
                path=src,
            )
        folder_warnings.append(Notice("unmatched_pattern", template))
        _engine.issue("unmatched_pattern", template, None, stacklevel=3)

    # Options that change the output; the defaults are left out, so that manifests of
    # plain runs stay as they were.
    options: dict[str, Any] = {"to": to, **precision}
    own = _manifest.MANIFEST if shard is None else _manifest.shard_name(*shard)
    _prepare_dst(dst, own, force=force, resume=resume, whole=shard is None)
    previous = _manifest.load_entries(dst) if resume else {}
    if force and shard is None:
        _manifest.remove_all(dst)
    _write.unpublish(dst, plan)

    weights = plan.weights
    if shard is not None:
        owner = assign_shards(weights, shard[1])
        weights = [w for w in weights if owner[w.rel] == shard[0]]
    record = _manifest.new(src, dst, own, options, allow_quantized, shard)
    files: list[FileReport] = []
    todo = []
    for w in weights:
        out = os.path.join(dst, w.rel)
        entry = _manifest.find_entry(previous.get(w.rel, []), w, options, out)
        if entry is None:
            todo.append(w)
        else:
            record.files[w.rel] = entry
            files.append(FileReport(w.rel, "weights", "skipped", w.size, entry["output_size"]))
    record.save()

    copies = [] if shard is not None else plan.copies
    meter = _write.Meter(
        sum(plan.info[w.rel].data_bytes for w in todo) + sum(c.size for c in copies),
        progress,
        file_progress,
    )
    run = _write.Run(dst, to, threads, meter, cancel, precision, record, tuning)
    # Under resume, an output without a valid manifest entry is stale (the entry is written
    # after the output), so it is replaced.
    converted = _write.convert_files(run, plan, todo, force=force or resume)
    files += [_write.file_report(w.rel, r) for w, r in zip(todo, converted)]
    if shard is None:
        files += _write.publish(plan, dst, meter, cancel)
    record.complete = True
    record.save()
    if shard is None:
        _manifest.remove_all(dst, keep=_manifest.MANIFEST)
    report = _folder_report(src, dst, to, files, converted, started, shard, shard is None)
    return _with_warnings(report, folder_warnings)


def finalize(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    file_progress: Callable[[str, int, int], object] | None = None,
    cancel: CancelFlag | None = None,
) -> ConvertReport:
    """Complete `dst` once every shard ran: see `stcast.finalize`."""
    started = time.monotonic()
    src, dst = os.fsdecode(src), os.fsdecode(dst)
    _check_folders(src, dst)
    if not os.path.isdir(dst):
        raise Refused(
            f"{_esc(dst)}: no such folder; convert the shards into it first (with {{shard}})",
            path=dst,
        )
    previous = _manifest.load_entries(dst)
    if not previous:
        raise Refused(
            f"{_esc(dst)}: no stcast manifest; convert the shards into it first (with {{shard}})",
            path=dst,
        )
    options = _manifest.agreed_options(dst, previous)
    to = _engine.target_name(options["to"])
    # Quantized checkpoints were refused (or allowed) by the shard runs that converted them.
    plan = _walk.plan(src, to, check_quantized=False)
    # With one shard count in the manifests, a missing file can be traced to its shard.
    counts = {e.get("shards") for entries in previous.values() for e in entries} - {None}
    n = counts.pop() if len(counts) == 1 else None
    owner = assign_shards(plan.weights, n) if isinstance(n, int) and n > 0 else {}

    record = _manifest.new(src, dst, _manifest.MANIFEST, options, None, None)
    files = []
    for w in plan.weights:
        entry = _manifest.find_entry(previous.get(w.rel, []), w, options, os.path.join(dst, w.rel))
        if entry is None:
            hint = f"; convert it again with {{shard={owner[w.rel]}/{n}}}" if owner else ""
            raise Refused(f"{_esc(w.path)}: not converted, or changed since{hint}", path=w.path)
        record.files[w.rel] = entry
        files.append(FileReport(w.rel, "weights", "checked", w.size, entry["output_size"]))
    record.save()
    _write.unpublish(dst, plan)
    meter = _write.Meter(sum(c.size for c in plan.copies), progress, file_progress)
    files += _write.publish(plan, dst, meter, cancel)
    record.complete = True
    record.save()
    _manifest.remove_all(dst, keep=_manifest.MANIFEST)
    return _folder_report(src, dst, to, files, [], started, None, True)


def inspect_folder(
    src: str,
    dst: str | None,
    *,
    to: Target,
    keep: list[str],
    keep_min_size: int,
    from_bf16: bool,
    scan: bool,
    on_overflow: OnOverflow,
    threads: int | None,
    progress: Progress | None,
    tuning: dict[str, Any] | None = None,
) -> InspectReport:
    """A dry run of `convert_folder` with the same options: see `stcast.inspect`."""
    weights, indexes, configs, others, _ = _walk.walk(src)
    if not weights:
        raise Refused(
            f"{_esc(src)}: a directory without .safetensors files: nothing to convert", path=src
        )
    scanning = scan or on_overflow == "keep"
    sizes = {}
    if scanning:
        # One progress bar over every file's scan: each file's total is known from its header.
        for w in weights:
            sizes[w.rel] = _engine.inspect_file(
                w.path, to=to, keep_min_size=0, on_overflow="warn"
            ).data_bytes
    total = sum(sizes.values())
    files = []
    done = 0
    for w in weights:

        def step(d: int, t: int, base: int = done) -> None:
            if progress is not None:
                progress(base + d, total)

        files.append(
            _engine.inspect_file(
                w.path,
                file=w.rel,
                to=to,
                keep=keep,
                keep_min_size=keep_min_size,
                from_bf16=from_bf16,
                keep_unmatched="ignore",
                scan=scan,
                on_overflow=on_overflow,
                threads=threads,
                progress=step if progress is not None else None,
                tuning=tuning,
            )
        )
        done += sizes.get(w.rel, 0)
    unmatched = [p for p in keep if all(p in f.keep_unmatched for f in files)]
    warnings = [Notice("unmatched_pattern", _unmatched_template(unmatched))] if unmatched else []
    warnings += [w for f in files for w in f.warnings]
    other = sum(f.size for f in [*indexes, *configs, *others])
    output = sum(f.output_bytes for f in files) + other
    return InspectReport(
        path=src,
        to=to,
        header_bytes=sum(f.header_bytes for f in files),
        data_bytes=sum(f.data_bytes for f in files),
        file_bytes=sum(f.file_bytes for f in files),
        metadata=None,
        tensors=[t for f in files for t in f.tensors],
        output_bytes=output,
        warnings=warnings,
        tensors_converted=sum(f.tensors_converted for f in files),
        tensors_copied=sum(f.tensors_copied for f in files),
        tensors_kept=sum(f.tensors_kept for f in files),
        bytes_kept=sum(f.bytes_kept for f in files),
        keep_unmatched=unmatched,
        scanned=scanning,
        destination=None if dst is None else _engine.destination(dst, output),
        folder=True,
        files=files,
        other_bytes=other,
    )


def default_dst(src: str, to: Target) -> str:
    """The output folder used when none is given: `<src>-bf16` beside `src`."""
    base = os.path.normpath(src)
    if os.path.basename(base) in ("", ".", ".."):
        base = os.path.realpath(src)
    return f"{base}-{to}"


def _unmatched_template(patterns: list[str]) -> str:
    listed = ", ".join(f"`{_esc(p)}`" for p in patterns)
    if len(patterns) == 1:
        return f"{{keep}} pattern {listed} matches no tensor name (a typo?)"
    return f"{{keep}} patterns {listed} match no tensor name (typos?)"


def _with_warnings(report: ConvertReport, first: list[Notice]) -> ConvertReport:
    if not first:
        return report
    from dataclasses import replace

    return replace(report, warnings=first + report.warnings)


def _folder_report(
    src: str,
    dst: str,
    to: Target,
    files: list[FileReport],
    converted: list[ConvertReport],
    started: float,
    shard: tuple[int, int] | None,
    complete: bool,
) -> ConvertReport:
    last = converted[-1] if converted else None
    return ConvertReport(
        src=src,
        dst=dst,
        to=to,
        tensors_converted=sum(r.tensors_converted for r in converted),
        tensors_copied=sum(r.tensors_copied for r in converted),
        bytes_in=sum(r.bytes_in for r in converted),
        bytes_out=sum(r.bytes_out for r in converted),
        seconds=time.monotonic() - started,
        threads=None if last is None else last.threads,
        isa=None if last is None else last.isa,
        warnings=[w for r in converted for w in r.warnings],
        tensors_kept=sum(r.tensors_kept for r in converted),
        bytes_kept=sum(r.bytes_kept for r in converted),
        folder=True,
        files=files,
        shard=None if shard is None else list(shard),
        complete=complete,
    )


def _check_folders(src: str, dst: str) -> None:
    if not os.path.isdir(src):
        raise Refused(f"{_esc(src)}: not a folder", path=src)
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if os.path.commonpath([real_src, real_dst]) in (real_src, real_dst):
        raise Refused(
            f"{_esc(dst)}: the destination must be outside the source folder and not contain "
            f"it ({_esc(real_dst)} vs {_esc(real_src)})",
            path=dst,
        )
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise Refused(f"{_esc(dst)}: exists and is not a folder", path=dst)


def _prepare_dst(dst: str, own_manifest: str, *, force: bool, resume: bool, whole: bool) -> None:
    """Create `dst`, or accept an existing one only where the options say so.

    A whole-folder run needs an empty folder, `force` or `resume`. A shard run shares the
    folder with the other shards: only its own earlier manifest needs `force` or `resume`.
    """
    try:
        os.mkdir(dst)
        return
    except FileExistsError:
        pass
    if force or resume:
        return
    if whole and os.listdir(dst):
        raise Refused(
            f"{_esc(dst)}: destination folder is not empty (a previous run?); {{resume}} "
            "continues it, {force} converts everything again",
            path=dst,
        )
    if not whole and os.path.lexists(os.path.join(dst, own_manifest)):
        raise Refused(
            f"{_esc(dst)}: this shard already ran here ({_esc(own_manifest)}); {{resume}} "
            "continues it, {force} converts it again",
            path=dst,
        )


def _precision_options(
    keep: list[str], keep_min_size: int, from_bf16: bool, on_overflow: OnOverflow
) -> dict[str, Any]:
    """The options beside `to` that change the output, without the defaults."""
    options: dict[str, Any] = {}
    if keep:
        options["keep"] = list(keep)
    if keep_min_size:
        options["keep_min_size"] = keep_min_size
    if from_bf16:
        options["from_bf16"] = True
    if on_overflow != "warn":
        options["on_overflow"] = on_overflow
    return options


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    expected = "a pair (i, n) of whole numbers with 1 <= i <= n"
    try:
        i, n = (int(x) for x in shard)
    except (TypeError, ValueError):
        raise _core.option_error("shard", shard, expected) from None
    if not 1 <= i <= n:
        raise _core.option_error("shard", shard, expected)
    return i, n
