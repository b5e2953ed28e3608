"""Write a folder's outputs: the converted files, the copies, and last the configs and
indexes, so that an interrupted run never leaves what a loader takes for a checkpoint."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _core, _engine
from ..errors import Cancelled, Refused
from ..reports import FileReport
from . import jsonedit
from .walk import BOOKKEEPING_PREFIX, File, Plan

if TYPE_CHECKING:
    from typing import Any, Callable

    from .._engine import CancelFlag, Progress
    from .._types import Target
    from ..reports import ConvertReport
    from .manifest import Manifest


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

    def is_on(self) -> bool:
        return self.progress is not None or self.file_progress is not None

    def step(self, rel: str, done: int, total: int) -> None:
        if self.file_progress is not None:
            self.file_progress(rel, done, total)
        if self.progress is not None:
            self.progress(min(self.done + done, self.total), self.total)

    def finish(self, rel: str, size: int) -> None:
        self.step(rel, size, size)
        self.done += size


@dataclass
class Run:
    """What every file of one folder run shares: where, how, and its bookkeeping."""

    dst: str
    to: Target
    threads: int | None
    meter: Meter
    cancel: CancelFlag | None
    precision: dict[str, Any]
    manifest: Manifest
    tuning: dict[str, Any] | None = None


def convert_files(run: Run, plan: Plan, todo: list[File], force: bool) -> list[ConvertReport]:
    """Convert the files one after another (all cores on each), recording each when done."""
    reports = []
    for w in todo:
        check_cancel(run.cancel)
        out = out_path(run.dst, w.rel)
        size = plan.info[w.rel].data_bytes

        def step(done: int, total: int, rel: str = w.rel) -> None:
            run.meter.step(rel, done, total)

        run.meter.step(w.rel, 0, size)
        # Unmatched keep patterns were judged over the whole folder (in walk.plan).
        r = _engine.convert_file(
            w.path,
            out,
            to=run.to,
            threads=run.threads,
            force=force,
            progress=step if run.meter.is_on() else None,
            cancel=run.cancel,
            keep=run.precision.get("keep", []),
            keep_min_size=run.precision.get("keep_min_size", 0),
            from_bf16=run.precision.get("from_bf16", False),
            on_overflow=run.precision.get("on_overflow", "warn"),
            keep_unmatched="ignore",
            tuning=run.tuning,
            warn_path=w.rel,
            # The user's call: convert, convert_folder, convert_files, here.
            stacklevel=5,
        )
        run.meter.finish(w.rel, size)
        run.manifest.files[w.rel] = run.manifest.entry(w, plan.header_sha256[w.rel])
        run.manifest.save()
        reports.append(r)
    return reports


def file_report(rel: str, r: ConvertReport) -> FileReport:
    """A converted file's line in a folder report."""
    return FileReport(
        rel,
        "weights",
        "converted",
        r.bytes_in,
        r.bytes_out,
        r.tensors_converted,
        r.tensors_copied,
        r.seconds,
        list(r.warnings),
        r.tensors_kept,
        r.bytes_kept,
    )


def publish(plan: Plan, dst: str, meter: Meter, cancel: CancelFlag | None) -> list[FileReport]:
    """Copy the other files, then write configs and indexes: a loader's cues come last."""
    reports = []
    for d in plan.dirs:
        ensure_dir(dst, d)
    for f in plan.copies:
        check_cancel(cancel)
        meter.step(f.rel, 0, f.size)
        copy_atomic(f.path, out_path(dst, f.rel))
        meter.finish(f.rel, f.size)
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    check_cancel(cancel)
    for f in plan.late_copies:
        copy_atomic(f.path, out_path(dst, f.rel))
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    for f, content in plan.configs:
        if content is None:
            copy_atomic(f.path, out_path(dst, f.rel))
            reports.append(FileReport(f.rel, "config", "copied", f.size, f.size))
        else:
            write_atomic(out_path(dst, f.rel), content)
            reports.append(FileReport(f.rel, "config", "rewritten", f.size, len(content)))
    for f, text, weight_map in plan.indexes:
        total = 0
        for rel in sorted(set(weight_map.values())):
            result = _engine.inspect_file(
                os.path.join(dst, rel), to="bf16", keep_min_size=0, on_overflow="warn"
            )
            total += sum(t.bytes for t in result.tensors)
        content = jsonedit.set_total_size(text, total)
        write_atomic(out_path(dst, f.rel), content)
        reports.append(FileReport(f.rel, "index", "rewritten", f.size, len(content)))
    return reports


def unpublish(dst: str, plan: Plan) -> None:
    """Remove old indexes and configs from `dst` before anything in it changes.

    Together with writing them last, this means that a folder holding them is complete.
    """
    for f in [*(i[0] for i in plan.indexes), *(c[0] for c in plan.configs), *plan.late_copies]:
        path = os.path.join(dst, f.rel)
        try:
            if not os.path.isdir(path) or os.path.islink(path):
                os.unlink(path)
        except FileNotFoundError:
            pass


def out_path(dst: str, rel: str) -> str:
    """Where `rel` goes in `dst`, its folders created."""
    return os.path.join(ensure_dir(dst, os.path.dirname(rel)), os.path.basename(rel))


def ensure_dir(dst: str, rel_dir: str) -> str:
    """`dst/rel_dir`, created as needed; an existing link or file on the way is refused.

    So nothing is written outside `dst`, whatever a previous occupant of the folder left.
    """
    path = dst
    for part in rel_dir.split("/") if rel_dir else []:
        path = os.path.join(path, part)
        try:
            os.mkdir(path)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise Refused(
                    f"{_core.escape(path)}: exists and is not a folder (stcast does not write "
                    "through links)",
                    path=path,
                ) from None
    return path


def _temp_beside(path: str) -> tuple[str, int]:
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f"{BOOKKEEPING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.tmp")
    # Mode 0666 & ~umask, as for any new file.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    return tmp, os.open(tmp, flags, 0o666)


def write_atomic(path: str, content: bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it, fsync, rename, fsync."""
    tmp, fd = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def copy_atomic(src: str, path: str) -> None:
    """Copy `src` (through a symlink, if it is one) to `path` as a regular file, atomically."""
    tmp, fd = _temp_beside(path)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)  # sendfile on Linux: no file-sized buffer
        shutil.copymode(src, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_cancel(cancel: CancelFlag | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("conversion cancelled")
