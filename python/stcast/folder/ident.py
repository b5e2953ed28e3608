"""Which folder is which, by device and inode: path strings never decide.

A destination reached through a bind mount, a symlink or `..` is the same folder as the
source when their (st_dev, st_ino) agree, and it is inside the source when the source is
one of its ancestors, found by walking `..` from the folder itself (the kernel's parent
chain, not the path's).
"""

from __future__ import annotations

import os
import stat

from .. import _core
from ..errors import Refused

Ident = tuple[int, int]

_esc = _core.escape
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
# Deeper than any real tree: a bound on the walk up.
_MAX_DEPTH = 4096


def ident(st: os.stat_result) -> Ident:
    return (st.st_dev, st.st_ino)


def nearest_existing(path: str) -> str:
    """`path` itself if it exists, else its nearest existing ancestor (by the path's words:
    the folders to be created below it do not exist yet)."""
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def chain(path: str) -> list[Ident]:
    """The identities of the folder `path` (or its nearest existing ancestor) and of every
    folder above it, up to the root, by the kernel's `..`."""
    start = nearest_existing(path)
    if not os.path.isdir(start):
        start = os.path.dirname(start) or "."
    out: list[Ident] = []
    fd = os.open(start, _DIR_FLAGS)
    try:
        for _ in range(_MAX_DEPTH):
            here = ident(os.fstat(fd))
            out.append(here)
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            if ident(os.fstat(fd)) == here:  # the root is its own parent
                break
    finally:
        os.close(fd)
    return out


def check_folders(src: str, dst: str) -> tuple[Ident, Ident | None]:
    """Refuse a source that is not a folder, and a destination that is the source, lies
    inside it or contains it; return their identities (the destination's if it exists)."""
    try:
        st = os.stat(src)
    except FileNotFoundError:
        raise Refused(f"{_esc(src)}: no such folder", path=src) from None
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{_esc(src)}: not a folder", path=src)
    src_id = ident(st)
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise Refused(f"{_esc(dst)}: exists and is not a folder", path=dst)
    # By identity, not by name: `..` from DST may leave a bind mount of a folder inside SRC
    # at its mount point, so DST's chain is compared with every folder of SRC's tree.
    if set(chain(dst)) & folder_ids(src):
        raise Refused(
            f"{_esc(dst)}: the destination is the source folder or lies inside it",
            path=dst,
        )
    dst_id = ident(os.stat(dst)) if os.path.isdir(dst) else None
    if dst_id is not None and set(chain(src)) & folder_ids(dst):
        raise Refused(f"{_esc(dst)}: the destination contains the source folder", path=dst)
    return src_id, dst_id


def folder_ids(root: str) -> set[Ident]:
    """The identities of `root` and of every folder below it (symlinks not followed)."""
    ids = {ident(os.stat(root))}
    for top, dirs, _ in os.walk(root, followlinks=False):
        for d in dirs:
            try:
                st = os.lstat(os.path.join(top, d))
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                ids.add(ident(st))
    return ids


def outside_checkpoint(src: str, dst: str) -> None:
    """Refuse a DST inside the checkpoint folder `src` (DCP, ZeRO: one checkpoint, read as
    one source) or inside a folder one of its entries links to (a ZeRO tag folder): what is
    written there would become part of the checkpoint (a safetensors file beside
    HuggingFaceStorageWriter's shards changes what the folder is). As the engine's
    `output::Territory` checks each file written."""
    folders = {ident(os.stat(src))}
    with os.scandir(src) as it:
        for e in it:
            if e.is_symlink() and e.is_dir():
                folders.add(ident(e.stat()))
    if set(chain(dst)) & folders:
        raise Refused(
            f"{_esc(dst)}: the destination lies inside the checkpoint folder {_esc(src)}, whose "
            "files are the input: write it elsewhere (DST left out goes beside the folder)",
            path=dst,
        )


HUB_KINDS = ("models--", "datasets--", "spaces--")


def resolve_hub_repo(src: str) -> str:
    """The folder to convert when `src` is a Hugging Face cache repo root
    (`.../models--org--name/`, holding `blobs/`, `refs/` and `snapshots/`): the snapshot
    `refs/main` names, or the only snapshot there is. Several snapshots and no `refs/main`
    is refused, listing them; `blobs/` is never walked. Any other folder is itself."""
    name = os.path.basename(os.path.normpath(src))
    snapshots = os.path.join(src, "snapshots")
    if not name.startswith(HUB_KINDS) or not os.path.isdir(snapshots):
        return src
    ref = os.path.join(src, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, "rb") as fh:
            commit = fh.read(256).decode("ascii", "replace").strip()
        chosen = os.path.join(snapshots, commit)
        # A name of snapshots/ itself: never "..", a path or an empty ref.
        if commit not in ("", ".", "..") and "/" not in commit and os.path.isdir(chosen):
            return chosen
        raise Refused(
            f"{_esc(ref)}: names snapshot {_esc(commit)!s}, which is not in {_esc(snapshots)}",
            path=ref,
        )
    found = sorted(e.name for e in os.scandir(snapshots) if e.is_dir())
    if len(found) == 1:
        return os.path.join(snapshots, found[0])
    listed = ", ".join(_esc(f) for f in found) or "none"
    raise Refused(
        f"{_esc(src)}: a Hugging Face cache repo without refs/main and with "
        f"{len(found)} snapshots ({listed}); convert one of {_esc(snapshots)}/<snapshot>",
        path=src,
    )


def check_outputs(
    dst: str, rels: list[str], inputs: list[tuple[str, Ident]], folders: set[Ident]
) -> None:
    """Refuse, before anything is written, a planned output of `dst` that is an input file
    (`inputs`: its path and identity; a hard link, or a symlink to it), or that is, or lies
    in, a folder of the source (`folders`: a bind mount of one under `dst`). Every output
    is checked here, so that a refusal never comes after a file was replaced."""
    by_id: dict[Ident, str] = {}
    for path, i in inputs:
        by_id.setdefault(i, path)
    seen: set[str] = set()
    for rel in rels:
        path = os.path.join(dst, rel)
        try:
            st = os.stat(path)
        except OSError:
            st = None  # nothing there (or a dangling link, which is replaced as a link)
        if st is not None and ident(st) in by_id:
            raise Refused(
                f"{_esc(path)}: destination is the input file {_esc(by_id[ident(st)])} (the "
                "same file by device and inode: a hard link or a symlink); nothing was "
                "written (convert into a folder that holds no links to the source's files)",
                path=path,
            )
        # The folders the output goes into, below DST.
        parts = rel.split("/")
        for k in range(1, len(parts) + (0 if st is None or not stat.S_ISDIR(st.st_mode) else 1)):
            sub = os.path.join(dst, *parts[:k])
            if sub in seen:
                continue
            seen.add(sub)
            try:
                sst = os.stat(sub)
            except OSError:
                break
            if ident(sst) in folders:
                raise Refused(
                    f"{_esc(sub)}: is a folder of the source (by device and inode: a bind "
                    "mount or a link); nothing was written",
                    path=sub,
                )
