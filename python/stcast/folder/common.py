"""What the folder modules share: the source file record, fingerprints,
the destination's paths, the stop checks, and the index-against-shards check.

It imports no other module of `stcast.folder`, so that every one of them can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _core
from ..errors import Cancelled, InvalidInput

if TYPE_CHECKING:
    from .._engine import CancelFlag

_esc = _core.escape


@dataclass(frozen=True)
class File:
    """A regular file of the source folder (possibly reached through a symlink).

    `rel` is where it goes in the destination; a PyTorch weight file or index, renamed
    there (`pytorch_model.bin` -> `model.safetensors`), has its own path in `src_rel`.
    """

    rel: str  # relative path in the destination, "/"-separated
    path: str  # the file in the source folder
    size: int
    mtime_ns: int
    src_rel: str | None = None  # relative path in the source, when not `rel`

    @property
    def source_rel(self) -> str:
        """Its relative path in the source folder."""
        return self.src_rel if self.src_rel is not None else self.rel


def header_sha256(path: str) -> str:
    """SHA-256 of a safetensors file's length prefix and header; "" when it is not a valid
    safetensors file (the engine reads and validates it: `_core.read_header`)."""
    try:
        return _core.read_header(path)[1]
    except InvalidInput:
        return ""


def failpoint(name: str, cancel: CancelFlag | None) -> None:
    """A test hook (see rust/failpoint.rs); a stop request it caused wins over its error.

    The folder code's points, in a run's order: `folder-checked`, `folder-manifest`, then
    for each output `folder-sealed` (claimed in the manifest, no name yet) and
    `folder-published` (named, not yet recorded) and `folder-file` (recorded), then
    `folder-publish` and `folder-complete`.
    """
    try:
        _core.failpoint(name)
    except OSError:
        check_cancel(cancel)
        raise


def check_cancel(cancel: CancelFlag | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("conversion cancelled")
