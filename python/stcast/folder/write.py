"""Write a folder's outputs: the output units (`convert_units`, each the engine's
`FolderWork.convert`), the copies, and last the configs and indexes, so that an interrupted
run never leaves what a loader takes for a checkpoint.

The engine's folder run (`_core.FolderRun`, rust/run/publish.rs) writes every file through
the one atomic write path, claims it in the run's manifest before it has a name, replaces
only what the run may, and says what happened when another run got there first; it also
withdraws old indexes and configs first, rolls a failed run back, and removes stale
shards and the manifests at the end. This module steps it and tells progress.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _core, _engine
from ..reports import ConvertReport, FileReport, _build, notices
from .common import check_cancel, failpoint
from .walk import UNMATCHED_PREFIX, File, Plan, Unit

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Callable

    from .._engine import CancelFlag, Progress
    from .._options import Options
    from .._types import FileAction, Target


class Meter:
    """Whole-folder progress (bytes) and per-file progress, fed to the callers' callbacks."""

    def __init__(
        self,
        total: int,
        progress: Progress | None,
        file_progress: Callable[[str, int, int], object] | None,
    ) -> None:
        self.total = total
        self.done = 0
        self.progress = progress
        self.file_progress = file_progress
        # What each callback was last told: a file's end, told by the engine and again by
        # `finish`, reaches the caller once.
        self.told: tuple[int, int] | None = None
        self.file_told: tuple[str, int, int] | None = None

    def is_on(self) -> bool:
        return self.progress is not None or self.file_progress is not None

    def step(self, rel: str, done: int, total: int) -> None:
        if self.file_progress is not None and self.file_told != (rel, done, total):
            self.file_told = (rel, done, total)
            self.file_progress(rel, done, total)
        told = (min(self.done + done, self.total), self.total)
        if self.progress is not None and self.told != told:
            self.told = told
            self.progress(*told)

    def finish(self, rel: str, size: int) -> None:
        self.step(rel, size, size)
        self.done += size

    def close(self) -> None:
        """The run's end: `(total, total)` once, also when nothing was left to do."""
        told = (self.total, self.total)
        if self.progress is not None and self.told != told:
            self.told = told
            self.progress(*told)


@dataclass
class Run:
    """What every file of one folder run shares: where, how, and the engine's run."""

    dst: str
    to: Target
    given: Options  # the call's options (threads, precision, tuning)
    meter: Meter
    cancel: CancelFlag | None
    record: _core.FolderRun
    shard: tuple[int, int] | None  # this run's (i, n), if a shard run
    options: dict[str, Any]  # the options that change the output, as the manifest says


def convert_units(run: Run, plan: Plan, todo: Sequence[Unit]) -> list[ConvertReport]:
    """Write the units one after another (all cores on each), recording each when done."""
    reports = []
    for w in todo:
        check_cancel(run.cancel)
        # Not into a folder another run took over since (it would replace its files).
        run.record.check_still_ours()

        def step(done: int, total: int, rel: str = w.rel) -> None:
            run.meter.step(rel, done, total)

        run.meter.step(w.rel, 0, w.data_bytes)
        # The engine replaces only as this run may, and claims the output in the manifest
        # before it has a name.
        progress = step if run.meter.is_on() else None
        r = _convert(w, plan, run, progress)
        run.meter.finish(w.rel, w.data_bytes)
        # The output has its name; the manifest does not say so yet.
        failpoint("folder-published", run.cancel)
        shards = None if run.shard is None else run.shard[1]
        entry = plan.work.entry(w.index, run.options, shards, os.path.join(run.dst, w.rel))
        run.record.record(w.rel, "weights", entry, ours=True)
        run.record.save(run.cancel)
        failpoint("folder-file", run.cancel)
        reports.append(r)
    return reports


def _convert(
    u: Unit, plan: Plan, run: Run, step: Callable[[int, int], None] | None
) -> ConvertReport:
    """Write unit `u` as its file of the folder run: it replaces only what the run may, and
    the run's manifest claims it before it has a name."""
    # Warnings name the input of a whole file, the output shard otherwise.
    path = u.inputs[0].source_rel if u.whole else u.rel

    def said(kind: str) -> bool:
        # An output shard of integer or BF16 tensors only is no surprise; a prefix to
        # strip was judged over the whole input by the plan, and so were a re-sharded
        # group's transposed experts (its plan named them all).
        whole = kind not in ("nothing_to_convert", "transposed_experts")
        return (u.whole or whole) and kind != UNMATCHED_PREFIX

    def warn(kind: str, template: str) -> None:
        if said(kind):
            _engine.issue(kind, template, path)

    with _engine.gc_paused():
        result = plan.work.convert(
            u.index,
            run.record,
            threads=run.given.threads,
            tuning=run.given.tuning,
            progress=step,
            cancel=run.cancel,
            warn=warn,
        )
    warnings = [w for w in result["warnings"] if said(w[0])]
    return _build(ConvertReport, result, warnings=notices(warnings, path), bytes_in=u.input_bytes)


def report(u: Unit, status: FileAction, bytes_out: int) -> FileReport:
    """Its line in a folder report, for an output not converted by this run."""
    return FileReport(u.rel, "weights", status, u.input_bytes, bytes_out, source=_source(u))


def converted(u: Unit, r: ConvertReport) -> FileReport:
    """Its line in a folder report, once converted by this run."""
    return FileReport(
        u.rel,
        "weights",
        "converted",
        u.input_bytes,
        r.bytes_out,
        r.tensors_converted,
        r.tensors_copied,
        r.seconds,
        list(r.warnings),
        r.tensors_kept,
        r.bytes_kept,
        source=_source(u),
    )


def _source(u: Unit) -> str | None:
    """The input's own path, when a whole file is renamed (a PyTorch file)."""
    return u.inputs[0].src_rel if u.whole else None


def publish(run: Run, plan: Plan) -> list[FileReport]:
    """Copy the other files, then write configs and indexes: a loader's cues come last."""
    reports = []
    dst, meter, cancel = run.dst, run.meter, run.cancel
    failpoint("folder-publish", cancel)
    run.record.check_still_ours()
    run.record.folders(plan.dirs)
    for f in plan.copies:
        check_cancel(cancel)
        meter.step(f.rel, 0, f.size)
        _copy(run, f, "copy", meter)
        meter.finish(f.rel, f.size)
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    check_cancel(cancel)
    # Before a loader's cues appear: every file written is still the one written, and the
    # indexes agree with the shards (from the shards as written: what a loader will find).
    run.record.recheck()
    run.record.check_still_ours()
    indexes = plan.work.checked_indexes(dst)
    for f in plan.late_copies:
        _copy(run, f, "copy", None)
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    for f in plan.configs:
        check_cancel(cancel)
        # (An FP8 target's quantization_config lists what the shards written hold
        # unquantized.)
        content = plan.work.config_text(dst, f.rel)
        if content is None:
            _copy(run, f, "config", None)
            reports.append(FileReport(f.rel, "config", "copied", f.size, f.size))
        else:
            run.record.write(f.rel, "config", content, cancel=cancel)
            reports.append(FileReport(f.rel, "config", "rewritten", f.size, len(content)))
    for rel, content, size, source in indexes:
        check_cancel(cancel)
        run.record.write(rel, "index", content, cancel=cancel)
        action: FileAction = "rewritten" if size is not None else "written"
        reports.append(FileReport(rel, "index", action, size or 0, len(content), source=source))
    return reports


def final_recheck(run: Run, plan: Plan) -> None:
    """The engine's re-check once everything is written; on failure, the loader's cues this
    run published (indexes, configs, late copies) are withdrawn."""
    cues = [rel for rel, _ in plan.work.index_maps()] + [f.rel for f in plan.configs]
    run.record.recheck(cues + [f.rel for f in plan.late_copies])


def _copy(run: Run, f: File, kind: str, meter: Meter | None) -> None:
    def step(done: int, total: int) -> None:
        if meter is not None:
            meter.step(f.rel, done, total)

    progress = step if meter is not None and meter.is_on() else None
    run.record.copy(f.rel, kind, f.path, progress=progress, cancel=run.cancel)


def unpublish(run: Run, plan: Plan, writes: set[str], configs: Sequence[str] = ()) -> None:
    """Before anything in the destination changes, the engine withdraws the old indexes
    this run would make inconsistent and the old model configs `configs` that would describe
    its weights wrongly (`publish::Writer::unpublish`)."""
    run.record.unpublish(plan.work.index_maps(), writes, list(configs))
