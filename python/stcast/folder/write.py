"""Write a folder's outputs: the converted files (`convert_items`), the copies, and last the
configs and indexes, so that an interrupted run never leaves what a loader takes for a
checkpoint.

Every file goes through the engine's one atomic write path (`_core.write_file`,
`_core.copy_file`, `_core.convert_shard`): a hidden, locked temp, fsync, then the name. A name
that exists is replaced only as `Run.replace_for` allows: a file a manifest records this
source's runs wrote (with its identity unchanged), or under `force` a file the plan
writes that the survey found there (also unchanged: not a rival run's written since).
Old configs and indexes are replaced, not removed first: a run that stops leaves an
earlier output loadable (`unpublish`). A run that fails while converting removes what it
added (`roll_back`).
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _core
from ..errors import DestinationExists, Refused, StcastError
from ..reports import FileReport
from .common import MAX_JSON_BYTES, check_cancel, ensure_dir, failpoint, out_path, read_bounded
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
    record: _core.Manifest
    shard: tuple[int, int] | None  # this run's (i, n), if a shard run
    options: dict[str, Any]  # the options that change the output, as the manifest says
    force: bool
    # Files that stcast wrote (recorded by a manifest, or adopted by `resume`): rel ->
    # (dev, ino) they must still have to be replaced.
    ours: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Under `force`: the files the survey found (rel -> identity), which it may replace.
    found: dict[str, tuple[int, int]] = field(default_factory=dict)

    def replace_for(self, rel: str) -> tuple[int, int] | str | None:
        """How publishing `rel` may treat a file already there (see `_core.write_file`):
        the file stcast wrote there, or under `force` the one the survey found (if none
        was there, none is replaced: a file that appeared since is a rival run's)."""
        if rel in self.ours:
            return self.ours[rel]
        if self.force and rel in self.found:
            return self.found[rel]
        return None

    def tag(self) -> str:
        shard = self.shard
        return "" if shard is None else f"s{shard[0]}of{shard[1]}"

    def claimer(self, rel: str) -> Callable[[int, int, int, str | None], None]:
        """What the engine calls once `rel`'s hidden file is sealed, before it has a name:
        this run's manifest claims it, so a run killed just after publishing it still
        proves it wrote it."""

        def sealed(dev: int, ino: int, size: int, header: str | None) -> None:
            self.record.claim(rel, (dev, ino, size), header or "")
            self.record.save(self.cancel, claims=True)

        return sealed

    def published(
        self,
        rel: str,
        kind: str,
        identity: tuple[int, int, int] | None,
        entry: dict[str, Any] | None = None,
    ) -> None:
        """Record a published file (`identity` None: the file there now) in this run's
        manifest, with `entry` (what resume needs to trust it), and as ours from now on."""
        dev, ino, _ = self.record.record(rel, kind, identity, entry)
        self.ours[rel] = (dev, ino)


def rival(run: Run, e: DestinationExists | Refused) -> None:
    """Say what happened when publishing found a file it may not replace: another run took
    this folder over (`Manifest.check_still_ours`), or wrote that file after this run's
    survey (where none was, or under `force` another than the survey found). Returns when
    the failure is none of these (it is then raised as it is)."""
    run.record.check_still_ours()
    if isinstance(e, DestinationExists) or (run.force and NOT_OURS in e.template):
        path = e.path or run.dst
        message = (
            "destination exists: another stcast run (or another program) wrote it after "
            f"this run checked {_esc(run.dst)}; this run replaced nothing of it and stopped "
            "(run again once that run is done)"
        )
        raise DestinationExists(f"{_esc(path)}: {message}", message=message, path=path) from None


# The engine's refusal of a file that is not the one a replace was allowed for.
NOT_OURS = "is not the file stcast wrote there"


def convert_items(run: Run, todo: Sequence[Item]) -> list[ConvertReport]:
    """Write the items one after another (all cores on each), recording each when done."""
    reports = []
    for w in todo:
        check_cancel(run.cancel)
        # Not into a folder another run took over since (it would replace its files).
        run.record.check_still_ours()
        out = out_path(run.dst, w.rel)

        def step(done: int, total: int, rel: str = w.rel) -> None:
            run.meter.step(rel, done, total)

        def sealed(dev: int, ino: int, size: int, header: str | None, w: Item = w) -> None:
            # Before the output has its name, the manifest claims it: a run killed once
            # it is published, before it is recorded, still proves it wrote it. The
            # claim names the header written (the engine read it back), not a plan's.
            run.record.claim(w.rel, (dev, ino, size), header or "")
            run.record.save(run.cancel, claims=True)
            failpoint("folder-sealed", run.cancel)

        run.meter.step(w.rel, 0, w.data_bytes)
        try:
            # The engine replaces only as this run may: see Run.replace_for.
            r = w.convert(
                run.given,
                run.to,
                out,
                run.replace_for(w.rel),
                step if run.meter.is_on() else None,
                run.cancel,
                sealed,
            )
        except (DestinationExists, Refused) as e:
            # A rival's file where this run replaces none, or not the file found.
            rival(run, e)
            raise
        run.meter.finish(w.rel, w.data_bytes)
        # The output has its name; the manifest does not say so yet.
        failpoint("folder-published", run.cancel)
        entry = w.manifest_entry(run.options, run.shard, out)
        run.published(w.rel, "weights", None, entry)
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
            _write(run, f.rel, "config", content)
            reports.append(FileReport(f.rel, "config", "rewritten", f.size, len(content)))
    for rel, content, size, source in indexes:
        check_cancel(cancel)
        _write(run, rel, "index", content)
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
    """`recheck` once everything is written; on failure, the loader's cues this run
    published (indexes, configs, late copies) are withdrawn, so that the folder does not
    look complete. Only files still the ones this run wrote are removed."""
    try:
        recheck(run)
    except Refused:
        plan = work.plan
        cues = [rel for rel, _, _ in work.index_maps()] + [c[0].rel for c in plan.configs]
        cues += [f.rel for f in plan.late_copies]
        run.record.unlink_written(cues)
        raise


def _copy(run: Run, f: File, kind: str, meter: Meter | None) -> None:
    def step(done: int, total: int) -> None:
        if meter is not None:
            meter.step(f.rel, done, total)

    try:
        identity = _core.copy_file(
            f.path,
            out_path(run.dst, f.rel),
            replace=run.replace_for(f.rel),
            tag=run.tag(),
            progress=step if meter is not None and meter.is_on() else None,
            cancel=run.cancel,
            sealed=run.claimer(f.rel),
        )
    except (DestinationExists, Refused) as e:
        rival(run, e)
        raise
    run.published(f.rel, kind, identity)


def _write(run: Run, rel: str, kind: str, content: bytes) -> None:
    try:
        identity = _core.write_file(
            out_path(run.dst, rel),
            content,
            replace=run.replace_for(rel),
            tag=run.tag(),
            cancel=run.cancel,
            sealed=run.claimer(rel),
        )
    except (DestinationExists, Refused) as e:
        rival(run, e)
        raise
    run.published(rel, kind, identity)


def recheck(run: Run) -> None:
    """Before declaring success: every file this run wrote is still the one it wrote."""
    run.record.recheck()


def unpublish(run: Run, work: Work, writes: set[str], configs: Sequence[str] = ()) -> None:
    """Before anything in the destination changes: withdraw the old indexes that this run
    would make inconsistent, and only those, and the old model configs `configs` that would
    describe its weights wrongly (the survey's `withdraw`: another target's).

    The old configs and indexes stay until the new ones replace them at publish (the
    atomic write path renames over them), so that a run that fails or is interrupted
    leaves an earlier output loadable: its index names shards that are still there, or
    that this run replaced by shards of the same names and tensors. An old index that
    maps a tensor to another file than the new one does, and names a file this run
    replaces (`writes`), would point a loader at the wrong shard: it goes first. Only
    files stcast may replace are removed."""
    new_maps = {rel: weight_map for rel, _, weight_map in work.index_maps()}
    for rel, new_map in new_maps.items():
        replace = run.replace_for(rel)
        if replace is None:
            continue  # the survey refused what may not be replaced
        old_map = _old_weight_map(run.dst, rel)
        if old_map is None or old_map == new_map or not set(old_map.values()) & writes:
            continue  # nothing a loader reads, or still consistent whenever the run stops
        if _unlink_if(run, rel, None if isinstance(replace, str) else replace):
            run.ours.pop(rel, None)
            run.record.forget(rel)
    for rel in configs:
        replace = run.replace_for(rel)
        if replace is not None and _unlink_if(
            run, rel, None if isinstance(replace, str) else replace
        ):
            run.ours.pop(rel, None)
            run.record.forget(rel)


def _old_weight_map(dst: str, rel: str) -> dict[str, str] | None:
    """The weight map of the index at `dst/rel` as destination rel paths; None if there is
    none a loader could read."""
    path = os.path.join(dst, rel)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        doc = json.loads(read_bounded(path, MAX_JSON_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError, StcastError):
        return None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        return None
    folder = os.path.dirname(rel)
    return {
        str(k): posixpath.normpath(posixpath.join(folder, v)) if isinstance(v, str) else ""
        for k, v in weight_map.items()
    }


def roll_back(run: Run, before: set[str], had_manifest: bool, made: list[str]) -> None:
    """Undo what a failed run added: the files it wrote where nothing was (each still the
    one it wrote: device and inode), its manifest if there was none, and the folders it
    made, once empty (`made`, deepest first). Nothing that was there before is removed;
    an older manifest of this run's name stays, saved without the files removed."""
    for rel in run.record.roll_back(before, had_manifest):
        run.ours.pop(rel, None)
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            pass  # not empty (or not there): not only this run's


def remove_stale(run: Run, stale: dict[str, tuple[int, int]]) -> None:
    """Remove what an earlier run of this source wrote and this plan does not (the shards
    of another `max_shard_size`, under `resume` or `force`): left there, they would sit
    beside the new shards, named by no index. Only files still the ones a manifest
    recorded are removed."""
    # The indexes first: whenever this stops, no index names a shard that is gone.
    for rel, identity in sorted(stale.items(), key=lambda kv: not kv[0].endswith(".json")):
        if _unlink_if(run, rel, identity) is not None:
            run.ours.pop(rel, None)
            run.record.forget(rel)


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


def remove_own(run: Run, manifests: list[_core.Manifest]) -> None:
    """At completion: the manifests go, so that the folder holds no stcast files."""
    for m in manifests:
        m.remove()
