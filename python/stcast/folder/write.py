"""Write a folder's outputs: the converted files, the copies, and last the configs and
indexes, so that an interrupted run never leaves what a loader takes for a checkpoint.

Every file goes through the engine's one atomic write path (`_core.write_file`,
`_core.copy_file`, `_core.convert`): a hidden, locked temp, fsync, then the name. A name
that exists is replaced only as `Run.replace_for` allows: a file a manifest records this
source's runs wrote (with its identity unchanged), or anything the plan writes under
`force`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import _core
from ..errors import Refused
from ..reports import FileReport
from .common import check_cancel, ensure_dir, failpoint, out_path
from .manifest import remove as remove_manifest
from .walk import File, Plan

if TYPE_CHECKING:
    from typing import Callable

    from .._engine import CancelFlag, Progress
    from .._options import Options
    from .._types import FileAction, Target
    from .manifest import Manifest
    from .work import Work

_esc = _core.escape


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
    """What every file of one folder run shares: where, how, and its bookkeeping."""

    dst: str
    to: Target
    given: Options  # the call's options (threads, precision, tuning)
    meter: Meter
    cancel: CancelFlag | None
    record: Manifest
    force: bool
    # Files that stcast wrote (recorded by a manifest, or adopted by `resume`): rel ->
    # (dev, ino) they must still have to be replaced.
    ours: dict[str, tuple[int, int]] = field(default_factory=dict)

    def replace_for(self, rel: str) -> tuple[int, int] | str | None:
        """How publishing `rel` may treat a file already there (see `_core.write_file`)."""
        if rel in self.ours:
            return self.ours[rel]
        return "any" if self.force else None

    def tag(self) -> str:
        shard = self.record.shard
        return "" if shard is None else f"s{shard[0]}of{shard[1]}"

    def claimer(self, rel: str) -> Callable[[int, int, int], None]:
        """What the engine calls once `rel`'s hidden file is sealed, before it has a name:
        this run's manifest claims it, so a run killed just after publishing it still
        proves it wrote it."""

        def sealed(dev: int, ino: int, size: int) -> None:
            self.record.claim(rel, (dev, ino, size))
            self.record.save_claims(self.cancel)

        return sealed

    def published(self, rel: str, kind: str, identity: tuple[int, int, int]) -> None:
        """Record a published file: in this run's manifest, and as ours from now on."""
        self.record.record(rel, kind, identity)
        self.ours[rel] = identity[:2]


def publish(run: Run, plan: Plan, work: Work) -> list[FileReport]:
    """Copy the other files, then write configs and indexes: a loader's cues come last."""
    reports = []
    dst, meter, cancel = run.dst, run.meter, run.cancel
    failpoint("folder-publish", cancel)
    for d in plan.dirs:
        ensure_dir(dst, d)
    for f in plan.copies:
        check_cancel(cancel)
        meter.step(f.rel, 0, f.size)
        _copy(run, f, "copy", meter)
        meter.finish(f.rel, f.size)
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    check_cancel(cancel)
    # Before a loader's cues appear: every file written is still the one written, and the
    # indexes agree with the shards (from the shards as written: what a loader will find).
    recheck(run)
    indexes = work.checked_indexes(dst)
    for f in plan.late_copies:
        _copy(run, f, "copy", None)
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    for f, content in plan.configs:
        check_cancel(cancel)
        if content is None:
            _copy(run, f, "config", None)
            reports.append(FileReport(f.rel, "config", "copied", f.size, f.size))
        else:
            _write(run, f.rel, "config", content)
            reports.append(FileReport(f.rel, "config", "rewritten", f.size, len(content)))
    for rel, content, size, source in indexes:
        check_cancel(cancel)
        _write(run, rel, "index", content)
        action: FileAction = "rewritten" if size is not None else "written"
        reports.append(FileReport(rel, "index", action, size or 0, len(content), source=source))
    return reports


def final_recheck(run: Run, plan: Plan) -> None:
    """`recheck` once everything is written; on failure, the loader's cues this run
    published (indexes, configs, late copies) are withdrawn, so that the folder does not
    look complete. Only files still the ones this run wrote are removed."""
    try:
        recheck(run)
    except Refused:
        cues = [*plan.index_rels(), *(c[0].rel for c in plan.configs)]
        cues += [f.rel for f in plan.late_copies]
        for rel in cues:
            entry = run.record.files.get(rel)
            path = os.path.join(run.dst, rel)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if entry is not None and (st.st_dev, st.st_ino) == (entry["dev"], entry["ino"]):
                os.unlink(path)
        raise


def _copy(run: Run, f: File, kind: str, meter: Meter | None) -> None:
    def step(done: int, total: int) -> None:
        if meter is not None:
            meter.step(f.rel, done, total)

    identity = _core.copy_file(
        f.path,
        out_path(run.dst, f.rel),
        replace=run.replace_for(f.rel),
        tag=run.tag(),
        progress=step if meter is not None and meter.is_on() else None,
        cancel=run.cancel,
        sealed=run.claimer(f.rel),
    )
    run.published(f.rel, kind, identity)


def _write(run: Run, rel: str, kind: str, content: bytes) -> None:
    identity = _core.write_file(
        out_path(run.dst, rel),
        content,
        replace=run.replace_for(rel),
        tag=run.tag(),
        cancel=run.cancel,
        sealed=run.claimer(rel),
    )
    run.published(rel, kind, identity)


def recheck(run: Run) -> None:
    """Before declaring success: every file this run wrote is still the one it wrote."""
    for rel, entry in run.record.files.items():
        path = os.path.join(run.dst, rel)
        try:
            st = os.lstat(path)
            same = (st.st_dev, st.st_ino, st.st_size) == (
                entry.get("dev"),
                entry.get("ino"),
                entry.get("size"),
            )
        except FileNotFoundError:
            same = False
        if not same:
            raise Refused(
                f"{_esc(path)}: was replaced or removed during the run; run it again",
                path=path,
            )


def unpublish(run: Run, plan: Plan) -> None:
    """Remove the old indexes and configs before anything in the destination changes, so
    that a folder holding them is complete. Only files stcast may replace are removed."""
    cues = [*plan.index_rels(), *(c[0].rel for c in plan.configs)]
    for rel in cues + [f.rel for f in plan.late_copies]:
        replace = run.replace_for(rel)
        if replace is None:
            continue  # the survey refused what may not be replaced
        if _unlink_if(run, rel, None if isinstance(replace, str) else replace):
            run.ours.pop(rel, None)
            run.record.pending.pop(rel, None)


def remove_stale(run: Run, stale: dict[str, tuple[int, int]]) -> None:
    """Remove what an earlier run of this source wrote and this plan does not (the shards
    of another `max_shard_size`, under `resume` or `force`): left there, they would sit
    beside the new shards, named by no index. Only files still the ones a manifest
    recorded are removed."""
    for rel, identity in stale.items():
        if _unlink_if(run, rel, identity) is not None:
            run.ours.pop(rel, None)
            run.record.pending.pop(rel, None)


def _unlink_if(run: Run, rel: str, identity: tuple[int, int] | None) -> bool | None:
    """Unlink `rel` of DST if it is not a folder and, given `identity`, is still that file
    (device and inode). True if removed, False if left, None if there was nothing."""
    path = os.path.join(run.dst, rel)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode) or (identity is not None and (st.st_dev, st.st_ino) != identity):
        return False  # a folder stays; so does a file that is no longer the one proven
    os.unlink(path)
    return True


def remove_own(run: Run, manifests: list[Manifest]) -> None:
    """At completion: the manifests go, so that the folder holds no stcast files."""
    for m in manifests:
        remove_manifest(m)
