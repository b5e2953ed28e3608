"""The manifest: what a folder run has written into its destination, so that `resume` skips
finished files and `finalize` can trust the shards that other runs converted."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _core, _engine
from ..errors import Refused
from .walk import File

if TYPE_CHECKING:
    pass

MANIFEST = ".stcast-manifest.json"
_SHARD_MANIFEST = re.compile(r"\.stcast-manifest\.shard-(\d+)-of-(\d+)\.json")
FORMAT = 1
# A sane bound for a header we read ourselves (the engine enforces the format's own limit).
_MAX_HEADER = 100 << 20


def shard_name(i: int, n: int) -> str:
    """The manifest file of shard `i` of `n`."""
    return f".stcast-manifest.shard-{i}-of-{n}.json"


@dataclass
class Manifest:
    """One run's record, saved as `dst/name` after each file it converts."""

    dst: str
    name: str
    src: str
    options: dict[str, Any]
    allow_quantized: bool | None
    shard: tuple[int, int] | None
    complete: bool = False
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def entry(self, w: File, source_header_sha256: str) -> dict[str, Any]:
        """What `resume` and `finalize` need to trust the output of `w` without reading it."""
        out = os.path.join(self.dst, w.rel)
        return {
            "source_size": w.size,
            "source_mtime_ns": w.mtime_ns,
            "source_header_sha256": source_header_sha256,
            "options": self.options,
            "version": _core.__version__,
            "shards": None if self.shard is None else self.shard[1],
            "output_size": os.stat(out).st_size,
            "output_header_sha256": header_sha256(out),
        }

    def save(self) -> None:
        """Write the manifest atomically."""
        from .write import write_atomic

        doc = {
            "format": FORMAT,
            "version": _core.__version__,
            "src": self.src,
            "options": self.options,
            "allow_quantized": self.allow_quantized,
            "shard": None if self.shard is None else list(self.shard),
            "complete": self.complete,
            "files": self.files,
        }
        # ASCII keeps any file name (even undecodable bytes, as surrogates) round-trippable.
        text = json.dumps(doc, indent=1, ensure_ascii=True) + "\n"
        write_atomic(os.path.join(self.dst, self.name), text.encode("ascii"))


def new(
    src: str,
    dst: str,
    name: str,
    options: dict[str, Any],
    allow_quantized: bool | None,
    shard: tuple[int, int] | None,
) -> Manifest:
    return Manifest(dst, name, os.path.realpath(src), options, allow_quantized, shard)


def load_entries(dst: str) -> dict[str, list[dict[str, Any]]]:
    """Every entry of every manifest in `dst` (the whole-run one and the shards'), by file."""
    entries: dict[str, list[dict[str, Any]]] = {}
    try:
        names = sorted(os.listdir(dst))
    except FileNotFoundError:
        return entries
    for name in names:
        if name != MANIFEST and not _SHARD_MANIFEST.fullmatch(name):
            continue
        try:
            with open(os.path.join(dst, name), "rb") as fh:
                doc = json.loads(fh.read())
            files = doc["files"]
            for rel, entry in files.items():
                if isinstance(entry, dict):
                    entries.setdefault(rel, []).append(entry)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue  # unreadable: its files are simply converted again
    return entries


def remove_all(dst: str, keep: str | None = None) -> None:
    """Remove the manifests in `dst` but `keep`."""
    for name in os.listdir(dst):
        if name != keep and (name == MANIFEST or _SHARD_MANIFEST.fullmatch(name)):
            try:
                os.unlink(os.path.join(dst, name))
            except OSError:
                pass


def find_entry(
    entries: list[dict[str, Any]], w: File, options: dict[str, Any], out: str
) -> dict[str, Any] | None:
    """The manifest entry that shows `out` is `w` converted with `options`, if there is one."""
    if not entries:
        return None
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    source_hash = header_sha256(w.path)
    output_hash = None
    for e in entries:
        if (
            e.get("version") != _core.__version__
            or e.get("options") != options
            or e.get("source_size") != w.size
            or e.get("source_mtime_ns") != w.mtime_ns
            or e.get("source_header_sha256") != source_hash
            or e.get("output_size") != st.st_size
        ):
            continue
        if output_hash is None:
            output_hash = header_sha256(out)
        if output_hash and e.get("output_header_sha256") == output_hash:
            return e
    return None


def agreed_options(dst: str, previous: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The options every manifest entry was converted with (they must all agree)."""
    seen = {
        json.dumps(e["options"], sort_keys=True)
        for entries in previous.values()
        for e in entries
        if isinstance(e.get("options"), dict)
    }
    options = json.loads(next(iter(seen))) if len(seen) == 1 else None
    if not isinstance(options, dict) or not isinstance(options.get("to"), str):
        listed = _core.escape(", ".join(sorted(seen)))
        raise Refused(
            f"{_core.escape(dst)}: the manifests disagree on the options ({listed}); convert "
            "the shards again with the same options",
            path=dst,
        )
    _engine.target_name(options["to"])
    return dict(options)


def header_sha256(path: str) -> str:
    """SHA-256 of a safetensors file's length prefix and header; "" when it has none."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return ""
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER:
            return ""
        body = fh.read(n)
    if len(body) < n:
        return ""
    return hashlib.sha256(head + body).hexdigest()
