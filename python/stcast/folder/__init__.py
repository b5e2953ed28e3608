"""Convert a checkpoint folder: every shard, its indexes and configs; the rest is copied.

The engine plans and checks the run before anything is written (`_core.prepare`: the
folder's files, the run's output units, each weight file or a re-sharding's output shards,
and what the destination holds). This package converts the units one after another, each
with all cores (`write`), copies everything else byte for byte, and writes the indexes and
configs last (the engine edits them in their own text): an interrupted run never leaves a
folder that a loader would take for a complete checkpoint. A manifest in the destination
records what is done (the engine's, `_core.FolderRun`), so that `resume` skips
finished files and `shard=(i, n)` jobs on several machines can split the work, with
`finalize` writing the rest once every shard is done.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from .. import _core, _engine
from .._options import Options
from ..reports import ConvertReport, FileReport, InspectReport, Notice, merged_numerics
from . import common as _common
from . import walk as _walk
from . import write as _write
from .fp8 import is_fp8
from .fp8 import nonfinite as fp8_nonfinite

if TYPE_CHECKING:
    from typing import Callable

    from .._engine import CancelFlag, Progress
    from .._types import OnOverflow, Target

__all__ = ["checked", "convert_folder", "inspect_resharded"]



@dataclass
class Prepared:
    """A folder run with every check made and nothing written yet: the engine's
    (`_core.prepare`, rust/folder/prepare.rs), as the writing reads it."""

    run: _core.Prepared
    given: Options  # the call's options
    plan: _walk.Plan
    todo: list[_walk.Unit]  # this run's units to write: files, or output shards
    skipped: list[_walk.Unit]
    copies: list[_common.File]
    warnings: list[Notice]

    @property
    def src(self) -> str:
        return os.fsdecode(self.run.src)

    @property
    def dst(self) -> str:
        return os.fsdecode(self.run.dst)


def prepare(
    src: str,
    dst: str | None,
    given: Options,
    *,
    cancel: CancelFlag | None = None,
    warn: Callable[[str, str, str | None], object] = _engine.issue,
) -> Prepared:
    """Make every check a folder run makes before writing anything, in order (the engine's
    `folder::prepare`), each warning told to `warn` as it is said. `inspect SRC DST` runs
    exactly this; `convert` runs it, then writes.

    With `max_shard_size`, the output is re-sharded and `src` may also be a single file;
    `name` is then the output stem of its one group."""
    run = _core.prepare(
        src,
        dst,
        shard=given.shard,
        max_shard_size=given.max_shard_size,
        resume=given.resume,
        strict=given.strict,
        cancel=cancel,
        warn=warn,
        to=given.to,
        **given.precision,
        **given.source,
        force=given.force,
        allow_quantized=given.allow_quantized,
        follow_links=given.follow_links,
        name=given.name,
        config=given.config,
    )
    plan = _walk.of(run.work)
    todo, skipped = ([plan.units[k] for k in ks] for ks in run.units)
    return Prepared(
        run,
        given,
        plan,
        todo,
        skipped,
        [_common.File(*r) for r in run.copies],
        [Notice(*w) for w in run.warnings],
    )


def convert_folder(
    prepared: Prepared,
    *,
    progress: Progress | None,
    file_progress: Callable[[str, int, int], object] | None,
    cancel: CancelFlag | None,
) -> ConvertReport:
    """Convert a prepared folder run (see `prepare`) with the options it was prepared with;
    see `stcast.convert` for them."""
    started = time.monotonic()
    p = prepared
    force = p.given.force
    src, dst, shard, options, to = p.src, p.dst, p.run.shard, p.run.options, _target(p.given)
    present, at_own_name, own, siblings, ours, stale, found, withdraw = p.run.survey
    # Every refusal is behind us: from here on, files are written.
    _common.failpoint("folder-checked", cancel)

    # The manifest at this run's name that the survey read (resume, force) is the one to
    # replace, still that file; with none there, another run's appearing meanwhile is not.
    # Under force: what the survey found at this name (an unreadable manifest, another
    # source's), and nothing else: a manifest that appeared since is a rival run's.
    record = _core.FolderRun(
        src,
        p.run.src_id,
        dst,
        options,
        p.given.allow_quantized,
        shard,
        p.run.mine,
        published=own,
        first_replace=at_own_name if force and own is None else None,
        force=force,
        ours=ours,
        found=found,
    )
    files: list[FileReport] = []
    shards = None if shard is None else shard[1]
    for w in p.skipped:
        entry = p.plan.work.entry(w.index, options, shards, os.path.join(dst, w.rel))
        files.append(_write.report(w, "skipped", record.record(w.rel, "weights", entry)[2]))
    # Before any output: DST and the folders it writes into made, and the manifest saved,
    # so that the other runs sharing this folder know it is ours (refused if another run
    # started meanwhile). What DST holds now (files, folders) is what a failed run keeps.
    rels = [*(rel for rel, _, _ in p.plan.work.outputs()), *(f"{d}/x" for d in p.plan.dirs)]
    record.begin(rels, set(present), at_own_name is not None, cancel)
    _common.failpoint("folder-manifest", cancel)

    meter = _write.Meter(
        sum(w.data_bytes for w in p.todo) + sum(c.size for c in p.copies),
        progress,
        file_progress,
    )
    run = _write.Run(dst, to, p.given, meter, cancel, record, shard, options)
    if shard is None:
        _write.unpublish(run, p.plan, {w.rel for w in p.todo}, withdraw)
    # A failure converting the weights rolls back what the run added, unless `resume`
    # can go on from it (`publish::Writer::failed`).
    converted = _write.convert_units(run, p.plan, p.todo)
    files += [_write.converted(w, r) for w, r in zip(p.todo, converted)]
    if shard is None:
        files += _write.publish(run, p.plan)
        _write.final_recheck(run, p.plan)
        # The new indexes name none of them: only now may the shards of another cut go.
        record.remove_stale(stale)
    else:
        record.recheck()
    _common.failpoint("folder-complete", cancel)
    meter.close()
    if shard is None:
        # Done: no stcast file stays behind (this source's shard manifests neither).
        record.remove_own(siblings)
    else:
        record.save(cancel, complete=True)
    report = _folder_report(
        src, dst, to, files, converted, started, shard, shard is None, p.given.on_overflow
    )
    return _with_warnings(_finish(p.plan, report), p.warnings)


def _source_plan(
    src: str,
    to: Target,
    o: Options,
    check_quantized: bool,
    follow_links: bool,
    *,
    shard_links: bool | None = None,
    cancel: CancelFlag | None = None,
    **cut: Any,
) -> _walk.Plan:
    """The source's plan and its output units, its checks made (`walk.plan`): a folder, or
    with `o.max_shard_size` re-sharded, also a single file (into a folder, beside it the
    model's `config`), its groups reading a checkpoint folder's links as `shard_links` says
    (by default as the walk does: `follow_links`)."""
    options: dict[str, Any] = {**o.precision, **o.source, "follow_links": follow_links}
    if o.max_shard_size is not None:
        single = not _engine.is_tree(src)
        cut.update(max_shard_size=o.max_shard_size, single=single)
        cut["shard_links"] = follow_links if shard_links is None else shard_links
        options.update(name=o.name, config=o.config if single else None)
    return _walk.plan(src, to, check_quantized, options, cancel, **cut)


def _finish(plan: _walk.Plan, report: ConvertReport) -> ConvertReport:
    """The run's report, with what this kind of run adds."""
    if not plan.resharding:
        return report
    return replace(report, max_shard_size=plan.work.max_shard_size)


def checked(src: str, dst: str, given: Options) -> tuple[Prepared, list[Notice]]:
    """Every check a folder run into `dst` makes before writing (`prepare`), failing as the
    run would, and what they said (not issued: a dry run returns its warnings)."""
    said: list[Notice] = []

    def warn(kind: str, template: str, path: str | None) -> None:
        # (A keep pattern's is judged again over the files inspected; a glob's not.)
        if kind != "unmatched_pattern":
            said.append(Notice(kind, template, path))

    prepared = prepare(src, dst, given, warn=warn)
    if given.report is not None:  # as `convert` checks it
        _core.check_side_output(
            given.report,
            "report",
            given.force,
            [(prepared.src, "input"), (prepared.dst, "output")],
        )
    return prepared, said


def inspect_resharded(
    src: str,
    dst: str | None,
    given: Options,
    *,
    progress: Progress | None,
) -> InspectReport:
    """A dry run of a re-sharding (`max_shard_size`) with the same options: see
    `stcast.inspect`. With `dst`, every check the conversion would make runs first
    (`prepare`), and fails as the conversion would; `src` may be a file. The files are the
    engine's dry run (`_engine.inspect_folder`); the report adds the shard plan.
    """
    to, max_shard_size = _target(given), cast("int", given.max_shard_size)
    # (A cache repo root: its snapshot.)
    src = _core.run_place(src, dst, to=to, resharding=True, check=False)[0]
    said: list[Notice] | None = None
    if dst is not None:
        prepared, said = checked(src, dst, given)
    report = _engine.inspect_folder(
        src, given, dst=dst, checked=said, resharding=True, progress=progress
    )
    if dst is not None:
        source_plan = prepared.plan
    else:
        # Without DST nothing is checked: the plan of what is there, as convert cuts it;
        # each file's inspection read the tensors kept from overflow and, for an FP8
        # target, the weights holding NaN or inf, as convert does.
        found = [[t.name for t in f.tensors if t.reason == "keep_overflow"] for f in report.files]
        nonfinite = [fp8_nonfinite(f.tensors) for f in report.files] if is_fp8(to) else None
        source_plan = _source_plan(
            src, to, given, False, given.follow_links, keep_names=found, unquantized=nonfinite
        )
    warnings = report.warnings
    if dst is None:
        warnings = warnings + [n for n in source_plan.warnings if n not in warnings]
    # What a re-sharding run writes besides the shards, to the byte.
    written = source_plan.work.outputs()
    other = sum(size for _, kind, size in written if kind != "weights")
    output = sum(size for _, kind, size in written if kind == "weights") + other
    infos: tuple[list[Any], list[Any]] = source_plan.work.infos()
    shards, indexes = infos
    return replace(
        report,
        output_bytes=output,
        warnings=warnings,
        destination=None if dst is None else _engine.destination(dst, output),
        other_bytes=other,
        max_shard_size=max_shard_size,
        shards=shards,
        indexes=indexes,
    )


def _with_warnings(report: ConvertReport, first: list[Notice]) -> ConvertReport:
    if not first:
        return report
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
    on_overflow: OnOverflow = "warn",
) -> ConvertReport:
    """A folder's report: the totals of the files converted by this run, their kept
    tensors and numeric reports (each entry naming its file), and every file's line."""
    last = converted[-1] if converted else None
    rels = [f.path for f in files if f.action == "converted"]
    kept: list[Any] = [{"file": rel, **k} for rel, r in zip(rels, converted) for k in r.kept]
    numerics = merged_numerics([(rel, r.numerics) for rel, r in zip(rels, converted)])
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
        kept=kept,
        on_overflow=on_overflow,
        numerics=numerics,
        folder=True,
        files=files,
        shard=None if shard is None else list(shard),
        complete=complete,
        tensors_quantized=sum(r.tensors_quantized for r in converted),
        quantized=[{"file": rel, **q} for rel, r in zip(rels, converted) for q in r.quantized],
        unquantized=sorted({m for r in converted for m in r.unquantized}),
        dequantized=[{"file": rel, **q} for rel, r in zip(rels, converted) for q in r.dequantized],
        tensors_dropped=sum(r.tensors_dropped for r in converted),
    )


def _target(given: Options) -> Target:
    """The target of a conversion (`stcast._api` resolved it: never None here)."""
    return cast("Target", given.to)
