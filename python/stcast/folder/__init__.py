"""Convert a checkpoint folder: every shard, its indexes and configs; the rest is copied.

The engine plans the run before anything is written (`walk.plan`: `_core.FolderWork`, the
folder's files and checks, and the run's output units: each weight file, or a re-sharding's
output shards). This package converts the units one after another, each with all cores
(`write`), copies everything else byte for byte, and writes the indexes and configs last
(the engine edits them in their own text): an interrupted run never leaves a folder that a
loader would take for a complete checkpoint. A manifest in the
destination records what is done (the engine's, `_core.FolderRun`), so that `resume` skips
finished files and `shard=(i, n)` jobs on several machines can split the work, with
`finalize` writing the rest once every shard is done.
"""

from __future__ import annotations

import os
import time
import warnings as _warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from .. import _core, _engine
from .._options import Options
from ..errors import Refused, StcastWarning
from ..reports import ConvertReport, FileReport, InspectReport, Notice, merged_numerics
from . import common as _common
from . import fp8 as _fp8
from . import walk as _walk
from . import write as _write
from .fp8 import is_fp8
from .fp8 import nonfinite as fp8_nonfinite

if TYPE_CHECKING:
    from typing import Callable

    from .._engine import CancelFlag, Progress
    from .._types import OnOverflow, Target

__all__ = ["checked", "convert_folder", "inspect_resharded"]

_esc = _core.escape


@dataclass
class Prepared:
    """A folder run with every check made and nothing written yet (see `prepare`)."""

    src: str
    dst: str
    src_id: tuple[int, int]
    to: Target
    given: Options  # the call's options
    plan: _walk.Plan
    options: dict[str, Any]
    shard: tuple[int, int] | None
    weights: list[_walk.Unit]  # this run's units (all, or the shard's): files, or output shards
    mine: list[str]  # the files this run will write
    survey: _Survey
    todo: list[_walk.Unit]
    skipped: list[_walk.Unit]
    copies: list[_common.File]
    need: int  # bytes the run will write
    warnings: list[Notice]


def prepare(
    src: str,
    dst: str | None,
    given: Options,
    *,
    cancel: CancelFlag | None = None,
) -> Prepared:
    """Make every check a folder run makes before writing anything, in order: folder
    identities, the source (`walk.plan`), the shard range, the keep patterns, what the
    destination holds (`_survey`), that something changes, free space. `inspect SRC DST`
    runs exactly this; `convert` runs it, then writes.

    With `max_shard_size`, the output is re-sharded (the engine's `folder::work`) and `src`
    may also be a single file; `name` is then the output stem of its one group."""
    to, shard, max_shard_size, name = _target(given), given.shard, given.max_shard_size, given.name
    force, resume = given.force, given.resume
    if shard is not None:
        shard = _check_shard(shard)
    # The default DST is named after what was given: beside a cache repo root, never
    # inside the cache's snapshots/.
    src, dst, src_id = _core.run_place(src, dst, to=to, resharding=max_shard_size is not None)
    precision, source = given.precision, given.source
    # A checkpoint folder (DCP, ZeRO) re-sharded: its links, as for one output.
    plan = _source_plan(
        src, to, given, not given.allow_quantized, given.follow_links, cancel=cancel
    )
    units = plan.units
    if shard is not None and shard[1] > len(units):
        n = len(units)
        raise _core.option_error(
            "shard",
            f"{shard[0]}/{shard[1]}",
            f"I/N with N at most {n}, the number of {plan.work.noun}",
        )
    # A keep pattern is judged over the whole folder: one warning (or, strict, one error
    # before anything is written) for a pattern that matches no tensor of any file.
    warnings = []
    if plan.keep_unmatched:
        template = _unmatched_template(plan.keep_unmatched)
        if given.strict:
            raise Refused(
                f"{_esc(src)}: {template}; nothing was written ({{strict}} makes this an error)",
                path=src,
            )
        warnings.append(Notice("unmatched_pattern", template))
        _engine.issue("unmatched_pattern", template, None)
    # So is a prefix to strip (a re-sharding's plan judged it over its groups: `_check`).
    for notice in [] if plan.resharding else plan.unmatched_prefixes:
        warnings.append(notice)
        _engine.issue(notice.kind, notice.template, None)
    side = [f for f in plan.configs if f.rel.rpartition("/")[2] == _fp8.SIDE_CONFIG_NAME]
    if side and shard is None:  # (written by finalize, which says so)
        template = _fp8.side_config_notice(os.path.join(dst, side[0].rel))
        warnings.append(Notice("no_model_config", template))
        _engine.issue("no_model_config", template, None)
    for notice in plan.left_out:
        warnings.append(notice)
        _engine.issue(notice.kind, notice.template, None)
    for notice in plan.walk_warnings:
        warnings.append(notice)
        _engine.issue(notice.kind, notice.template, None)
    # That something changes (a plain run that writes a copy of the folder is refused: the
    # engine's answer), and what a re-sharding's plan said.
    plan.work.check(src)
    for notice in plan.warnings:
        warnings.append(notice)
        _engine.issue(notice.kind, notice.template, notice.path)

    # Options that change the output; the defaults are left out, so that manifests of
    # plain runs stay as they were.
    options: dict[str, Any] = {"to": to, **precision, **source, **_run_options(plan, name)}
    weights = units
    if shard is not None:
        owner = plan.work.assign_shards(shard[1])
        weights = [w for w, k in zip(weights, owner) if k == shard[0]]
    outputs = [rel for rel, _, _ in plan.work.outputs()]
    mine = sorted(w.rel for w in weights) if shard is not None else sorted(outputs)
    # No output is a file of the source, what the destination holds, what this run may
    # replace, which of its weights are done (skipped under resume), room for the rest, and
    # no leftover a loader would take for the output: the engine's answer.
    survey = _survey(
        dst, src_id, options, plan, shard, force=force, resume=resume, mine=weights, src=src
    )
    todo = [w for w in weights if w.rel not in survey.skipped]
    skipped = [w for w in weights if w.rel in survey.skipped]
    # Files this run leaves out that DST holds (an earlier run's copies): they stay, as
    # everything it does not write, but make DST more than this run's output.
    there = [f.source_rel for f, _ in plan.skipped if f.source_rel in survey.present]
    if there:
        more = f" and {len(there) - 8} more" if len(there) > 8 else ""
        template = (
            f"DST holds {', '.join(f'`{_esc(r)}`' for r in there[:8])}{more}, which this run "
            "leaves out and does not delete: verify fails the output while it is there "
            "(remove it, or {include} it)"
        )
        warnings.append(Notice("skipped_files", template))
        _engine.issue("skipped_files", template, None)
    if survey.ours or (force and survey.found):
        # Overflow refused while converting a later file would come after this run replaced
        # earlier ones: over an earlier output it is read for first, and refused here.
        _refuse_overflow_first(todo, to, given, resharded=plan.resharding, cancel=cancel)
    copies = [] if shard is not None else plan.copies
    return Prepared(
        src,
        dst,
        src_id,
        to,
        given,
        plan,
        options,
        shard,
        weights,
        mine,
        survey,
        todo,
        skipped,
        copies,
        survey.need,
        warnings,
    )


def _refuse_overflow_first(
    todo: list[_walk.Unit],
    to: Target,
    given: Options,
    *,
    resharded: bool,
    cancel: CancelFlag | None,
) -> None:
    """Read each input of `todo` as `inspect --dry-run` does, refusing what converting it
    would refuse: under `on_overflow="error"` any overflow, under "keep" a dequantized
    weight's (a re-sharding's plan read for those already)."""
    on_overflow = given.on_overflow
    if on_overflow == "warn" or (on_overflow == "keep" and resharded):
        return
    seen: set[str] = set()
    for f in [f for w in todo for f in w.inputs]:
        if f.path in seen:
            continue
        seen.add(f.path)
        _common.check_cancel(cancel)
        _engine.inspect_file(
            f.path,
            to=to,
            **given.precision,
            keep_unmatched="ignore",
            allow_quantized=True,
            scan=on_overflow == "error",
            **given.source,
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
    src, dst, shard, survey = p.src, p.dst, p.shard, p.survey
    # Every refusal is behind us: from here on, files are written.
    _common.failpoint("folder-checked", cancel)

    # The manifest at this run's name that the survey read (resume, force) is the one to
    # replace, still that file; with none there, another run's appearing meanwhile is not.
    # Under force: what the survey found at this name (an unreadable manifest, another
    # source's), and nothing else: a manifest that appeared since is a rival run's.
    record = _core.FolderRun(
        src,
        p.src_id,
        dst,
        p.options,
        p.given.allow_quantized,
        shard,
        p.mine,
        published=survey.own,
        first_replace=survey.at_own_name if force and survey.own is None else None,
        force=force,
        ours=list(survey.ours.items()),
        found=list(survey.found.items()),
    )
    files: list[FileReport] = []
    shards = None if shard is None else shard[1]
    for w in p.skipped:
        entry = p.plan.work.entry(w.index, p.options, shards, os.path.join(dst, w.rel))
        files.append(_write.report(w, "skipped", record.record(w.rel, "weights", entry)[2]))
    # Before any output: DST and the folders it writes into made, and the manifest saved,
    # so that the other runs sharing this folder know it is ours (refused if another run
    # started meanwhile). What DST holds now (files, folders) is what a failed run keeps.
    rels = [*(rel for rel, _, _ in p.plan.work.outputs()), *(f"{d}/x" for d in p.plan.dirs)]
    record.begin(rels, survey.present, survey.at_own_name is not None, cancel)
    _common.failpoint("folder-manifest", cancel)

    meter = _write.Meter(
        sum(w.data_bytes for w in p.todo) + sum(c.size for c in p.copies),
        progress,
        file_progress,
    )
    run = _write.Run(dst, p.to, p.given, meter, cancel, record, shard, p.options)
    if shard is None:
        _write.unpublish(run, p.plan, {w.rel for w in p.todo}, survey.withdraw)
    # A failure converting the weights rolls back what the run added, unless `resume`
    # can go on from it (`publish::Writer::failed`).
    converted = _write.convert_units(run, p.plan, p.todo)
    files += [_write.converted(w, r) for w, r in zip(p.todo, converted)]
    if shard is None:
        files += _write.publish(run, p.plan)
        _write.final_recheck(run, p.plan)
        # The new indexes name none of them: only now may the shards of another cut go.
        record.remove_stale(list(survey.stale.items()))
    else:
        record.recheck()
    _common.failpoint("folder-complete", cancel)
    meter.close()
    if shard is None:
        # Done: no stcast file stays behind (this source's shard manifests neither).
        record.remove_own(survey.siblings)
    else:
        record.save(cancel, complete=True)
    report = _folder_report(
        src, dst, p.to, files, converted, started, shard, shard is None, p.given.on_overflow
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


def _run_options(plan: _walk.Plan, name: str | None) -> dict[str, Any]:
    """The options of this kind of run that change the output (for the manifest)."""
    if not plan.resharding:
        return {}
    options: dict[str, Any] = {"max_shard_size": plan.work.max_shard_size}
    if name is not None:
        # Another name is another output, as another size is: under resume, the files
        # a manifest proves this source's that the plan no longer writes are stale.
        options["name"] = name
    return options


def _finish(plan: _walk.Plan, report: ConvertReport) -> ConvertReport:
    """The run's report, with what this kind of run adds."""
    if not plan.resharding:
        return report
    return replace(report, max_shard_size=plan.work.max_shard_size)


class _Survey:
    """What the destination holds, as far as this run is concerned (`_core.survey`)."""

    def __init__(self, answer: tuple[Any, ...]) -> None:
        present, self.at_own_name, self.own, self.siblings, ours, rest = answer
        adopted, self.entries, stale, found, skipped, self.need, withdraw = rest
        # The files there (not stcast's bookkeeping); those stcast wrote (rel -> identity).
        self.present: set[str] = set(present)
        self.ours: dict[str, tuple[int, int]] = dict(ours)
        self.adopted: set[str] = set(adopted)  # outputs resume recognised without a manifest
        # Files an earlier run of this source wrote (a manifest says so, and they are still
        # those files) that this plan does not write: shards cut at another size.
        self.stale: dict[str, tuple[int, int]] = dict(stale)
        # Under force: every file there, as the survey found it (rel -> identity). `force`
        # replaces those, not a file a rival run wrote there since.
        self.found: dict[str, tuple[int, int]] = dict(found)
        self.skipped: set[str] = set(skipped)  # this run's weights done already
        # The configs this run replaces that describe its weights wrongly: withdrawn first.
        self.withdraw: list[str] = list(withdraw)


def _survey(
    dst: str,
    src_id: tuple[int, int],
    options: dict[str, Any],
    plan: _walk.Plan,
    shard: tuple[int, int] | None,
    *,
    force: bool,
    resume: bool,
    mine: list[_walk.Unit] | None = None,
    src: str = "",
) -> _Survey:
    """Check what `dst` holds before anything is written, and what this run may replace
    (the engine's `run::survey`). Without `force` or `resume`, a destination that holds
    anything but stcast's own files for this source and plan is refused: an empty or new
    folder is fine, and so are the files of other shard runs of the same source (they share
    the folder), but not a folder of other files, another source's run, or a previous run
    of this one. `resume` continues a previous run: the files a manifest records are ours,
    an output exactly the planned one is adopted (the plan's proof: `folder::work::Judged`),
    and any other planned file that is there is refused rather than replaced. `force`
    replaces every file the plan writes and deletes nothing else. With `mine` (this run's
    weights), also which are done, that the rest fits, and that nothing a loader would take
    for the output stays beside it."""
    rels = None if mine is None else [w.rel for w in mine]
    work = plan.work
    answer = _core.survey(
        dst, src_id, shard, options, work, force=force, resume=resume, mine=rels, src=src
    )
    return _Survey(answer)


def checked(src: str, dst: str, given: Options) -> tuple[Prepared, list[Notice]]:
    """Every check a folder run into `dst` makes before writing (`prepare`), failing as the
    run would, and what they said (not issued: a dry run returns its warnings)."""
    said: list[Notice] = []
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        prepared = prepare(src, dst, given)
    if given.report is not None:  # as `convert` checks it
        _core.check_side_output(
            given.report,
            "report",
            given.force,
            [(prepared.src, "input"), (prepared.dst, "output")],
        )
    for record in caught:
        m = record.message
        if isinstance(m, StcastWarning) and m.kind != "unmatched_pattern":
            said.append(Notice(m.kind, m.template, m.path))
        elif not isinstance(m, StcastWarning):
            _warnings.warn_explicit(m, record.category, record.filename, record.lineno)
    # (A keep pattern's is judged again over the files inspected; a glob's not.)
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


def _unmatched_template(patterns: list[str]) -> str:
    listed = ", ".join(f"`{_esc(p)}`" for p in patterns)
    if len(patterns) == 1:
        return f"{{keep}} pattern {listed} matches no tensor name (a typo?)"
    return f"{{keep}} patterns {listed} match no tensor name (typos?)"


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


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    expected = "a pair (i, n) of whole numbers with 1 <= i <= n"
    try:
        i, n = (int(x) for x in shard)
    except (TypeError, ValueError):
        raise _core.option_error("shard", shard, expected) from None
    if not 1 <= i <= n:
        raise _core.option_error("shard", shard, expected)
    return i, n
