"""What the folder modules share: the source file record, bounded reads, fingerprints,
the destination's paths, the stop checks, and the index-against-shards check.

It imports no other module of `stcast.folder`, so that every one of them can use it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _core
from ..errors import Cancelled, InvalidInput, Refused

if TYPE_CHECKING:
    from .._engine import CancelFlag

# The names of weight files and indexes, as the engine names its outputs (`rust/shard.rs`).
WEIGHTS_SUFFIX = _core.shard_file_name("", 1, 1)  # ".safetensors"
INDEX_SUFFIX = _core.index_file_name("")  # ".safetensors.index.json"
# Configs and indexes above this size are not what they claim to be.
MAX_JSON_BYTES = 256 << 20

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


def read_bounded(path: str, limit: int) -> bytes:
    """The whole content of the regular file `path`, refusing one over `limit` bytes.

    Exactly the size `fstat` gives is read: a file that yields more (a pseudo-file of
    /proc reports 0 bytes) or fewer (truncated meanwhile) is refused, naming it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{_esc(path)}: not a regular file", path=path)
        if st.st_size > limit:
            raise Refused(
                f"{_esc(path)}: {_core.format_bytes(st.st_size)}, more than the "
                f"{_core.format_bytes(limit)} a file of this kind may have",
                path=path,
            )
        chunks, left = [], st.st_size + 1  # one byte more reveals a file that grew
        while left > 0:
            try:
                # At least a page: some /proc files refuse reads of odd sizes (EINVAL).
                chunk = os.read(fd, max(min(left, 1 << 20), 4096))
            except OSError as e:  # named: /proc/self/pagemap refuses odd sizes (EINVAL)
                raise OSError(e.errno, e.strerror, path) from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) != st.st_size:
        raise InvalidInput(
            f"{_esc(path)}: its size says {st.st_size} bytes, reading it gave "
            f"{'more' if len(data) > st.st_size else len(data)}",
            path=path,
        )
    return data


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


def check_index(dst: str, rel: str, weight_map: dict[str, str]) -> int:
    """The index at `rel` against the shards written: every tensor where it says, every
    shard tensor listed; returns the total size of the tensors (the index's total_size).
    The engine's check (rust/run/check.rs `index_total`)."""
    return _core.index_total(dst, rel, [*weight_map.items()])
