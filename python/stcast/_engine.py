"""One file (or a folder's dry run or verify) through the native engine: options in, a
typed report out, warnings issued.

Used by the public API (`stcast._api`). Option names and choices come from the engine
(`stcast._core`); invalid values are refused there, as `UsageError`s.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings as _warnings
from typing import TYPE_CHECKING, Any

from . import _core
from .errors import StcastWarning
from .reports import (
    ConvertReport,
    InspectReport,
    Mismatch,
    Notice,
    TensorInfo,
    TensorRows,
    VerifyReport,
    _build,
    merged_numerics,
)
from .reports import notices as _notices

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Callable, Protocol

    from ._types import Numerics

    class CancelFlag(Protocol):
        def is_set(self) -> bool: ...

    Progress = Callable[[int, int], object]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a report of many tensors is built: each
    allocation of the hundreds of thousands of containers would otherwise trigger a
    collection that walks all the others (most of the time of `inspect` on 300k tensors).
    Reports hold no cycles; the collector is back on afterwards, as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# This package's folder: its frames are never the line a warning points at.
_PACKAGE = os.path.dirname(__file__) + os.sep


def issue(kind: str, template: str, path: str | None) -> None:
    """Issue an engine warning as a `StcastWarning`, pointing at the caller's line: the first
    frame outside this package, however deep in it the warning was found (the CLI's own
    frames, all in it: the outermost)."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    _warnings.warn(StcastWarning(kind, template, path), stacklevel=level)


def file_report(data: dict[str, Any]) -> ConvertReport:
    """One file's conversion report, from the engine's (`_core.convert`)."""
    return _build(ConvertReport, data, warnings=_notices(data["warnings"]))


# A tensor's fields that take few values (one str for all the tensors that share one).
_WORDS = ("dtype", "target_dtype", "action", "reason")


def inspect(
    src: str, dst: str | None, *, progress: Progress | None, **options: Any
) -> InspectReport:
    """The engine's `inspect` (`_core.inspect`, with the options given: `Options.keywords`):
    one file's plan, or a folder's dry run (each weight file's inspection, the other files,
    the totals, and a re-sharding's plan); with `dst`, after every check the run makes."""
    with gc_paused():
        result = _core.inspect(src, dst, progress=progress, row=_row(), **options)
        if not result["folder"]:
            return _build(InspectReport, result, warnings=_notices(result["warnings"]))
        files = [
            _build(InspectReport, f, warnings=_notices(f["warnings"], f["path"]))
            for f in result["files"]
        ]
    others, left_out, said = result["named"]
    return _build(
        InspectReport,
        result,
        metadata=None,
        tensors=[t for f in files for t in f.tensors],
        warnings=[Notice(kind, template, path) for kind, template, path in said],
        files=files,
        other_files=[{"path": p, "bytes": n, "action": a} for p, n, a in others],
        left_out=[{"path": p, "bytes": n, "why": why} for p, n, why in left_out],
    )


def _row() -> Callable[[dict[str, Any]], TensorInfo]:
    """What makes each of the engine's tensor dicts (a folder's name their `file`) a
    `TensorInfo`."""
    # The engine's tensor dicts hold exactly TensorInfo's fields (a test checks it); each
    # becomes one as it is made, so that 500,000 tensors never cost 500,000 dicts at once.
    # Their words are shared, not one str per tensor.
    words: dict[str, str] = {}

    def row(t: dict[str, Any]) -> TensorInfo:
        for k in _WORDS:
            t[k] = words.setdefault(t[k], t[k])
        return TensorInfo(**t)

    return row


def verify(src: str, dst: str, *, progress: Progress | None, **options: Any) -> VerifyReport:
    """The engine's `verify` (`_core.verify`, with the options given: `Options.keywords`) of
    two files or two folders (or a file re-sharded into a folder), its warnings issued; see
    `stcast.verify`."""
    with gc_paused():
        r = _core.verify(src, dst, progress=progress, warn=issue, **options)
    m = r["mismatch"]
    if not r["folder"]:
        mismatch = m and _build(Mismatch, m, message=Notice("mismatch", m["message"]))
        return _build(VerifyReport, r, mismatch=mismatch)
    mismatch = m and _build(Mismatch, m, message=Notice("mismatch", m["message"], m["file"]))
    parts: list[tuple[str, Numerics | None]] = [
        (rel, None if n is None else {"tensors": TensorRows(n["tensors"]), "total": n["total"]})
        for rel, n in r["parts"]
    ]
    numerics = merged_numerics(parts) if r["ok"] else None
    return _build(VerifyReport, r, mismatch=mismatch, numerics=numerics, isa=r["isa"] or "")
