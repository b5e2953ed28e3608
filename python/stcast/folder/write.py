"""Write a folder's outputs: the converted files (`convert_items`), the copies, and last the
configs and indexes, so that an interrupted run never leaves what a loader takes for a
checkpoint.

The engine's folder run (`_core.FolderRun`, rust/run/publish.rs) writes every file through
the one atomic write path, claims it in the run's manifest before it has a name, replaces
only what the run may, and says what happened when another run got there first; it also
withdraws old indexes and configs first, rolls a failed run back, and removes stale
shards and the manifests at the end. This module steps it and tells progress.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _core
from ..reports import FileReport
from .common import check_cancel, failpoint
from .fp8 import SIDE_CONFIG_NAME, is_fp8, is_model_config
from .walk import File, read_json
from .work import Item, Work

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Callable

    from .._engine import CancelFlag, Progress
    from .._options import Options
    from .._types import FileAction, Target
    from ..reports import ConvertReport


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


def convert_items(run: Run, todo: Sequence[Item]) -> list[ConvertReport]:
    """Write the items one after another (all cores on each), recording each when done."""
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
        r = w.convert(run.given, run.to, run.record, progress, run.cancel)
        run.meter.finish(w.rel, w.data_bytes)
        # The output has its name; the manifest does not say so yet.
        failpoint("folder-published", run.cancel)
        entry = w.manifest_entry(run.options, run.shard, os.path.join(run.dst, w.rel))
        run.record.record(w.rel, "weights", entry, ours=True)
        run.record.save(run.cancel)
        failpoint("folder-file", run.cancel)
        reports.append(r)
    return reports


def publish(run: Run, work: Work) -> list[FileReport]:
    """Copy the other files, then write configs and indexes: a loader's cues come last."""
    reports = []
    dst, meter, cancel, plan = run.dst, run.meter, run.cancel, work.plan
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
    indexes = work.checked_indexes(dst, run.to)
    for f in plan.late_copies:
        _copy(run, f, "copy", None)
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    for f, content in plan.configs:
        check_cancel(cancel)
        if is_fp8(run.to) and (is_model_config(f.rel) or _is_side_config(f.rel)):
            content = fp8_config(dst, run.to, work, f, content)
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


def _is_side_config(rel: str) -> bool:
    """Is `rel` an FP8 quantization_config written beside weights no model config
    describes (`fp8.side_configs`)?"""
    return posixpath.basename(rel) == SIDE_CONFIG_NAME


def fp8_config(dst: str, to: Target, work: Work, f: File, content: bytes | None) -> bytes:
    """The model config `f` of an FP8 output: its dtype set (`content`, None: unchanged)
    and the quantization_config, whose `ignore` lists what the shards beside it, as
    written, hold unquantized."""
    text = content.decode("utf-8") if content is not None else read_json(f)[0]
    here = posixpath.dirname(f.rel)
    shards = [os.path.join(dst, w.rel) for w in work.items if posixpath.dirname(w.rel) == here]
    written = _core.config_text(text, to, shards=shards)
    assert written is not None, "an FP8 target writes a quantization_config"
    return written


def final_recheck(run: Run, work: Work) -> None:
    """The engine's re-check once everything is written; on failure, the loader's cues this
    run published (indexes, configs, late copies) are withdrawn."""
    plan = work.plan
    cues = [rel for rel, _, _ in work.index_maps()] + [c[0].rel for c in plan.configs]
    run.record.recheck(cues + [f.rel for f in plan.late_copies])


def _copy(run: Run, f: File, kind: str, meter: Meter | None) -> None:
    def step(done: int, total: int) -> None:
        if meter is not None:
            meter.step(f.rel, done, total)

    progress = step if meter is not None and meter.is_on() else None
    run.record.copy(f.rel, kind, f.path, progress=progress, cancel=run.cancel)


def unpublish(run: Run, work: Work, writes: set[str], configs: Sequence[str] = ()) -> None:
    """Before anything in the destination changes, the engine withdraws the old indexes
    this run would make inconsistent and the old model configs `configs` that would describe
    its weights wrongly (`publish::Writer::unpublish`)."""
    indexes = [(rel, weight_map) for rel, _, weight_map in work.index_maps()]
    run.record.unpublish(indexes, writes, list(configs))
