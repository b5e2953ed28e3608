"""Manifests: what a folder run has planned and written into its destination.

Each run (a whole-folder run, or one `shard=(i, n)` run) keeps its own manifest in the
destination, written before its first output and after each file it publishes. It names
the source (by path and by device and inode), the options, the files the run plans to
write, and for each file written its device, inode and size and what `resume` needs to
trust it. Other runs read it to know which files are stcast's (so N shard runs can share a
destination, and a foreign folder is refused), and a run replaces or removes only files a
manifest records it wrote, with their identity unchanged. A finished run removes the
manifests, so the destination can be uploaded as it is.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _core, _engine
from ..errors import Refused, StcastError
from .common import header_sha256, read_bounded

if TYPE_CHECKING:
    from .._engine import CancelFlag

MANIFEST = ".stcast-manifest.json"
_SHARD_MANIFEST = re.compile(r"\.stcast-manifest\.shard-(\d+)-of-(\d+)\.json")
FORMAT = 2
# A manifest lists at most every file of a checkpoint: far below this.
_MAX_MANIFEST = 64 << 20
_esc = _core.escape


def shard_name(i: int, n: int) -> str:
    """The manifest file of shard `i` of `n`."""
    return f".stcast-manifest.shard-{i}-of-{n}.json"


def is_manifest(name: str) -> bool:
    return name == MANIFEST or _SHARD_MANIFEST.fullmatch(name) is not None


class TakenOver(Refused):
    """Another run took this run's folder over (see `Manifest.check_still_ours`): what this
    run wrote is that run's to keep or replace now, not this one's to roll back."""


@dataclass
class Manifest:
    """One run's record, saved as `dst/name`."""

    dst: str
    name: str
    src: str
    src_id: tuple[int, int]
    options: dict[str, Any]
    allow_quantized: bool | None
    shard: tuple[int, int] | None
    planned: list[str]
    complete: bool = False
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The identity this run last published the manifest with (None: not yet).
    published: tuple[int, int] | None = None
    # What the first save may replace at its name: nothing (another run's manifest there
    # makes it fail), or, told to (`force`), the file the survey found there (device and
    # inode: not another run's manifest written since).
    first_replace: tuple[int, int] | str | None = None
    # Written by `finalize` (which completes shard runs), not by a conversion.
    finalize: bool = False
    # This run's mark in what it saves: a device and inode can be another file's once the
    # file is gone (a rival's manifest replacing this one may take its inode number).
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    saved: bool = False  # has this run saved it (so that the file there holds `token`)
    # Files this run may have published, or that stcast wrote and this run has not yet
    # replaced or removed: rel -> claims, each dev, ino, size and (if known) the output
    # header's hash ("": none). A file there with a claimed identity is proven stcast's.
    # An output is claimed once sealed, before it has a name (a link or a rename keeps
    # its inode), so a run killed just after publishing it still proves it wrote it; the
    # file it replaces stays claimed until then.
    pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def claim(self, rel: str, identity: tuple[int, int, int], header: str = "") -> None:
        """Note that `rel` may be (or become) the file (dev, ino, size) stcast wrote."""
        dev, ino, size = identity
        claims = [c for c in self.pending.get(rel, []) if (c["dev"], c["ino"]) != (dev, ino)]
        claims.append({"dev": dev, "ino": ino, "size": size, "output_header_sha256": header})
        self.pending[rel] = claims

    def save_claims(self, cancel: CancelFlag | None = None) -> None:
        """`save`, once this manifest was saved, unless it is gone: another run completed
        the folder and removed it meanwhile (a finalize racing this one). The file about
        to be published then finds its name taken, as it would have without the claim."""
        if not os.path.lexists(os.path.join(self.dst, self.name)):
            return
        self.save(cancel)

    def record(self, rel: str, kind: str, published: tuple[int, int, int], **extra: Any) -> None:
        """Note that this run published `rel` as (dev, ino, size)."""
        dev, ino, size = published
        self.files[rel] = {"kind": kind, "dev": dev, "ino": ino, "size": size, **extra}
        self.pending.pop(rel, None)

    def save(self, cancel: CancelFlag | None = None) -> None:
        """Write the manifest atomically (the one write path; its temp is locked)."""
        doc = {
            "format": FORMAT,
            "version": _core.__version__,
            "src": self.src,
            "src_id": list(self.src_id),
            "options": self.options,
            "allow_quantized": self.allow_quantized,
            "shard": None if self.shard is None else list(self.shard),
            "planned": self.planned,
            "complete": self.complete,
            "files": self.files,
            "pending": self.pending,
            "finalize": self.finalize,
            "run": self.token,
        }
        # ASCII keeps any file name (even undecodable bytes, as surrogates) round-trippable.
        text = json.dumps(doc, indent=1, ensure_ascii=True) + "\n"
        if self.published is not None:
            self.check_still_ours()
        replace = self.first_replace if self.published is None else self.published
        dev, ino, _ = _core.write_file(
            os.path.join(self.dst, self.name),
            text.encode("ascii"),
            replace=replace,
            tag=_tag(self.shard),
            cancel=cancel,
        )
        self.published = (dev, ino)
        self.saved = True

    def check_still_ours(self) -> None:
        """Refuse to go on once another run took the folder over: this run's manifest was
        replaced (another run's `force` or `resume` took it for an interrupted run's) or
        removed (that run finished). Writing on would replace that run's files."""
        path = os.path.join(self.dst, self.name)
        try:
            st = os.lstat(path)
            same = (st.st_dev, st.st_ino) == self.published
            if same and self.saved:
                mark = json.dumps({"run": self.token})[1:-1].encode("ascii")
                same = mark in read_bounded(path, _MAX_MANIFEST)
        except FileNotFoundError:
            same = False
        except (OSError, StcastError):
            same = False  # not a file this run wrote (a FIFO, too large)
        if not same:
            raise TakenOver(
                f"{_esc(path)}: another stcast run took {_esc(self.dst)} over while this one "
                "ran (it replaced or removed this run's manifest, as {force}, {resume} and "
                "`finalize` do with a stopped run's); this run stopped there, leaving the "
                "folder to that run (run again once it is done, if need be)",
                path=path,
            )


def _tag(shard: tuple[int, int] | None) -> str:
    return "manifest" if shard is None else f"s{shard[0]}of{shard[1]}"


def new(
    src: str,
    src_id: tuple[int, int],
    dst: str,
    options: dict[str, Any],
    allow_quantized: bool | None,
    shard: tuple[int, int] | None,
    planned: list[str],
) -> Manifest:
    name = MANIFEST if shard is None else shard_name(*shard)
    return Manifest(
        dst, name, os.path.realpath(src), src_id, options, allow_quantized, shard, planned
    )


class Unreadable(Exception):
    """A manifest in the destination that cannot be read (`path`, `reason`)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


# The most shards a run may be split into (as the CLI's --shard allows).
MAX_SHARDS = 2**32 - 1


def _is_shard(shard: object) -> bool:
    """A manifest's `shard`: [i, n] with 1 <= i <= n <= MAX_SHARDS (ints, not bools)."""
    if not isinstance(shard, list) or len(shard) != 2:
        return False
    i, n = shard
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
    return ints and 1 <= i <= n <= MAX_SHARDS


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load(dst: str, name: str) -> Manifest:
    """The manifest `dst/name`, checked field by field; `Unreadable` if it is not one."""
    path = os.path.join(dst, name)
    try:
        raw = read_bounded(path, _MAX_MANIFEST)
        text = raw.decode("ascii")
        doc = json.loads(text)
    except (OSError, ValueError, RecursionError) as e:
        raise Unreadable(path, f"cannot be read ({type(e).__name__})") from None
    except Exception as e:  # bounded read refusals (a FIFO, too large)
        raise Unreadable(path, str(e)) from None
    if not isinstance(doc, dict) or _core.json_depth(text) > 8:
        raise Unreadable(path, "not a stcast manifest")
    try:
        if doc["format"] != FORMAT:
            found = doc["format"]
            raise Unreadable(path, f"manifest format {found!r}; this stcast writes {FORMAT}")
        shard = doc["shard"]
        files = doc["files"]
        planned = doc["planned"]
        src_id = doc["src_id"]
        pending = doc.get("pending", {})
        ok = (
            isinstance(doc["src"], str)
            and isinstance(doc["options"], dict)
            and isinstance(files, dict)
            and all(isinstance(k, str) and isinstance(v, dict) for k, v in files.items())
            and all(
                isinstance(v.get("dev"), int) and isinstance(v.get("ino"), int)
                for v in files.values()
            )
            and isinstance(pending, dict)
            and all(
                isinstance(k, str)
                and isinstance(claims, list)
                and all(
                    isinstance(v, dict)
                    and all(_is_int(v.get(f)) for f in ("dev", "ino", "size"))
                    and isinstance(v.get("output_header_sha256"), str)
                    for v in claims
                )
                for k, claims in pending.items()
            )
            and isinstance(planned, list)
            and all(isinstance(p, str) for p in planned)
            and isinstance(src_id, list)
            and len(src_id) == 2
            and all(isinstance(x, int) for x in src_id)
            and (shard is None or _is_shard(shard))
            and isinstance(doc["options"].get("to"), str)
            and doc["options"]["to"] in _core.TARGETS
        )
    except (KeyError, TypeError) as e:
        raise Unreadable(path, f"not a stcast manifest (no {e})") from None
    if not ok:
        raise Unreadable(path, "not a stcast manifest (a field has the wrong type)")
    st = os.stat(path)
    return Manifest(
        dst=dst,
        name=name,
        src=doc["src"],
        src_id=(src_id[0], src_id[1]),
        options=doc["options"],
        allow_quantized=doc.get("allow_quantized"),
        shard=None if shard is None else (int(shard[0]), int(shard[1])),
        planned=list(planned),
        complete=doc.get("complete") is True,
        finalize=doc.get("finalize") is True,
        files=dict(files),
        published=(st.st_dev, st.st_ino),
        pending={k: list(v) for k, v in pending.items()},
    )


def load_all(dst: str) -> tuple[list[Manifest], list[Unreadable]]:
    """Every manifest in `dst` (the whole-run one and the shards'), and those unreadable."""
    manifests: list[Manifest] = []
    bad: list[Unreadable] = []
    try:
        names = sorted(n for n in os.listdir(dst) if is_manifest(n))
    except FileNotFoundError:
        return manifests, bad
    for name in names:
        try:
            manifests.append(load(dst, name))
        except Unreadable as e:
            bad.append(e)
    return manifests, bad


def recorded(manifests: list[Manifest], dst: str, rel: str) -> dict[str, Any] | None:
    """The entry of a manifest that wrote `dst/rel`, if the file there is still that one;
    else a manifest's claim on it (`Manifest.pending`), if the file there is the one
    claimed: the same device, inode and size, and the header claimed."""
    path = os.path.join(dst, rel)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    for m in manifests:
        e = m.files.get(rel)
        if e is not None and (e.get("dev"), e.get("ino")) == (st.st_dev, st.st_ino):
            return e
    if not stat.S_ISREG(st.st_mode):
        return None
    for m in manifests:
        for e in m.pending.get(rel, []):
            if (e["dev"], e["ino"], e["size"]) != (st.st_dev, st.st_ino, st.st_size):
                continue
            header = e["output_header_sha256"]
            if not header or header_sha256(path) == header:
                return e
    return None


def carry(record: Manifest, ours: dict[str, tuple[int, int]]) -> None:
    """Claim in the new `record` each file stcast wrote here (`ours`: rel -> dev, ino) that
    it does not record as done: the earlier manifest that proves it is replaced by this
    one, and a run killed before it replaces or removes such a file must still prove it."""
    for rel, (dev, ino) in ours.items():
        if rel in record.files:
            continue
        try:
            st = os.lstat(os.path.join(record.dst, rel))
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) == (dev, ino):
            record.claim(rel, (dev, ino, st.st_size))


def remove(m: Manifest) -> None:
    """Remove a manifest, if it is still the one that was read or written."""
    path = os.path.join(m.dst, m.name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if m.published is None or (st.st_dev, st.st_ino) == m.published:
        os.unlink(path)


def agreed_options(dst: str, manifests: list[Manifest]) -> dict[str, Any]:
    """The options every manifest was made with (they must all agree)."""
    seen = {json.dumps(m.options, sort_keys=True) for m in manifests}
    options = json.loads(next(iter(seen))) if len(seen) == 1 else None
    if not isinstance(options, dict) or not isinstance(options.get("to"), str):
        listed = _esc(", ".join(sorted(seen)))
        raise Refused(
            f"{_esc(dst)}: the manifests disagree on the options ({listed}); convert the "
            "shards again with the same options",
            path=dst,
        )
    _engine.target_name(options["to"])
    size = options.get("max_shard_size")
    if "max_shard_size" in options and (
        not isinstance(size, int) or isinstance(size, bool) or not 0 < size < 2**64
    ):
        raise Refused(
            f"{_esc(dst)}: the manifests give max_shard_size {_esc(repr(size))}, not a size; "
            "convert the shards again",
            path=dst,
        )
    if "name" in options:
        try:
            _core.check_option("name", options["name"])
        except StcastError:
            raise Refused(
                f"{_esc(dst)}: the manifests give name {_esc(repr(options['name']))}, not a "
                "file name stem; convert the shards again",
                path=dst,
            ) from None
    return dict(options)
