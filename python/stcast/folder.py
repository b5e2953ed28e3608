"""Convert a checkpoint folder: every shard, its indexes and configs; the rest is copied.

The per-file engine (`stcast.convert` on a file) converts each `.safetensors` file with bounded
memory and publishes it atomically. This module walks the folder and checks it before writing
anything (index names, index/shard agreement, quantized checkpoints), converts the files one
after another (each with all cores), copies everything else byte for byte, and writes the
indexes and configs last: an interrupted run never leaves a folder that a loader would take for
a complete checkpoint. A manifest in the destination records what is done, so that `resume`
skips finished files and `shard=(i, n)` jobs on several machines can split the work, with
`finalize` writing the rest once every shard is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
import warnings as _warnings
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import stcast

from . import _api, _core
from ._core import StcastError

if TYPE_CHECKING:
    from typing import Callable, Protocol

    class _CancelFlag(Protocol):
        def is_set(self) -> bool: ...


__all__ = ["FileReport", "FolderInspectReport", "FolderReport", "convert_folder", "finalize"]

MANIFEST = ".stcast-manifest.json"
_SHARD_MANIFEST = re.compile(r"\.stcast-manifest\.shard-(\d+)-of-(\d+)\.json")
MANIFEST_FORMAT = 1
# stcast's own files (manifests, temporary files) are never taken from a source folder.
_BOOKKEEPING_PREFIX = ".stcast-"
# A git clone keeps a second copy of every LFS file under .git/: never worth copying.
_SKIPPED_DIRS = frozenset({".git"})
_WEIGHTS_SUFFIX = ".safetensors"
_INDEX_SUFFIX = ".safetensors.index.json"
_CONFIG_NAME = "config.json"
# Files a loader reads first to decide that a folder is a checkpoint: written last.
_PUBLISH_LAST_NAMES = frozenset({_CONFIG_NAME, "model_index.json"})
_DTYPE_KEYS = frozenset({"torch_dtype", "dtype"})
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
# F8_E4M3, F8_E5M2, F8_E8M0, ..., F6_E2M3, F6_E3M2 and F4 (not F64).
_QUANTIZED_PREFIXES = ("F8_", "F6_", "F4")
# A sane bound for a header we read ourselves (the engine enforces the format's own limit).
_MAX_HEADER = 100 << 20
# Configs and indexes are a few levels deep; far deeper is an attack on the recursive walks.
_MAX_JSON_DEPTH = 100


@dataclass(frozen=True)
class FileReport:
    """One file of a folder conversion; `path` is relative to both folders."""

    path: str
    kind: str  # "weights", "index", "config" or "copy"
    action: str  # "converted", "skipped" (resume), "checked" (finalize), "rewritten", "copied"
    bytes_in: int
    bytes_out: int
    tensors_converted: int = 0
    tensors_copied: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    tensors_kept: int = 0  # of tensors_copied: float tensors kept by --keep or on_overflow
    bytes_kept: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The entry as plain JSON-ready data."""
        return asdict(self)


@dataclass(frozen=True)
class FolderReport:
    """What a folder conversion did.

    The totals (`tensors_*`, `bytes_*`) count the weight files converted by this run;
    `seconds` is the wall time of the whole run; `threads` and `isa` are the engine's (None
    when nothing was converted). `files` lists every file written, skipped or checked.
    `shard` is `[i, n]` for a `shard=(i, n)` run, and `complete` says whether the destination
    is now a finished checkpoint (False after a shard run: `finalize` completes it).
    """

    src: str
    dst: str
    to: str
    tensors_converted: int
    tensors_copied: int
    bytes_in: int
    bytes_out: int
    seconds: float
    threads: int | None
    isa: str | None
    warnings: list[str]
    files: list[FileReport]
    shard: list[int] | None
    complete: bool
    tensors_kept: int = 0
    bytes_kept: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast convert --json`)."""
        return asdict(self)


@dataclass(frozen=True)
class FolderInspectReport:
    """What converting the checkpoint folder `path` would do: one `InspectReport` per weight
    file (`files`, relative paths in `path` of each), then the totals.

    `output_bytes` adds up the converted weight files and the files copied as they are
    (`other_bytes`); `keep_unmatched` lists the --keep patterns that match no tensor of any
    file; `destination` is as for a file.
    """

    path: str
    to: str
    files: list[Any]  # stcast.InspectReport, with `path` relative to the folder
    data_bytes: int
    output_bytes: int
    other_bytes: int
    tensors_converted: int
    tensors_copied: int
    tensors_kept: int
    bytes_kept: int
    keep_unmatched: list[str]
    scanned: bool
    warnings: list[str]
    destination: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast inspect --json`)."""
        d = asdict(self)
        d["folder"] = True
        return d


# --- public entry points --------------------------------------------------------------------


def convert_folder(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    to: str = "bf16",
    threads: int | None = None,
    force: bool = False,
    resume: bool = False,
    shard: tuple[int, int] | None = None,
    allow_quantized: bool = False,
    progress: Callable[[int, int], object] | None = None,
    file_progress: Callable[[str, int, int], object] | None = None,
    cancel: _CancelFlag | None = None,
    keep: list[str] | None = None,
    keep_min_size: int = 0,
    strict: bool = False,
    from_bf16: bool = False,
    on_overflow: str = "warn",
) -> FolderReport:
    """Convert the checkpoint folder `src` into `dst`; see `stcast.convert` for the options."""
    started = _now()
    to = _target_name(to)
    src = os.fsdecode(src)
    dst = default_dst(src, to) if dst is None else os.fsdecode(dst)
    if shard is not None:
        shard = _check_shard(shard)
    _check_folders(src, dst)
    precision = _precision_options(keep, keep_min_size, from_bf16, on_overflow)
    plan = _plan(src, to, check_quantized=not allow_quantized, precision=precision)
    # A --keep pattern is judged over the whole folder: one warning (or, strict, one error
    # before anything is written) for a pattern that matches no tensor of any file.
    folder_warnings = []
    if plan.keep_unmatched:
        message = _core_unmatched_message(plan.keep_unmatched)
        if strict:
            raise _error(f"{src}: {message} (--strict); nothing was written", src, "refused")
        folder_warnings.append(message)
        _warnings.warn(message, stcast.StcastWarning, stacklevel=3)

    # Options that change the output; the defaults are left out, so that manifests of
    # plain runs stay as they were.
    options: dict[str, Any] = {"to": to, **precision}
    own_manifest = MANIFEST if shard is None else _shard_manifest_name(*shard)
    _prepare_dst(dst, own_manifest, force=force, resume=resume, whole=shard is None)
    previous = _load_manifests(dst) if resume else {}
    if force and shard is None:
        _remove_manifests(dst)
    _unpublish(dst, plan)

    weights = plan.weights
    if shard is not None:
        owner = assign_shards(weights, shard[1])
        weights = [w for w in weights if owner[w.rel] == shard[0]]
    manifest = _new_manifest(src, dst, options, allow_quantized, shard)
    reports: list[FileReport] = []
    todo = []
    for w in weights:
        entry = _find_entry(previous.get(w.rel, []), w, options, os.path.join(dst, w.rel))
        if entry is None:
            todo.append(w)
        else:
            manifest["files"][w.rel] = entry
            reports.append(FileReport(w.rel, "weights", "skipped", w.size, entry["output_size"]))
    _write_manifest(dst, own_manifest, manifest)

    copies = [] if shard is not None else plan.copies
    meter = _Meter(
        sum(plan.info[w.rel]["data_bytes"] for w in todo) + sum(c.size for c in copies),
        progress,
        file_progress,
    )
    engine: dict[str, Any] = {}
    converted = _convert_files(
        todo,
        dst,
        to,
        threads=threads,
        # Under resume, an output without a valid manifest entry is stale (the entry is
        # written after the output), so it is replaced.
        force=force or resume,
        meter=meter,
        cancel=cancel,
        info=plan.info,
        manifest=manifest,
        manifest_name=own_manifest,
        engine=engine,
        precision=precision,
    )
    reports += converted
    if shard is None:
        reports += _publish(plan, dst, to, meter, cancel)
    manifest["complete"] = True
    _write_manifest(dst, own_manifest, manifest)
    if shard is None:
        _remove_manifests(dst, keep=MANIFEST)
    report = _folder_report(src, dst, to, reports, converted, started, shard, shard is None, engine)
    if folder_warnings:
        report = replace(report, warnings=folder_warnings + report.warnings)
    return report


def finalize(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: Callable[[int, int], object] | None = None,
    file_progress: Callable[[str, int, int], object] | None = None,
    cancel: _CancelFlag | None = None,
) -> FolderReport:
    """Complete `dst` after `convert(src, dst, shard=(i, n))` ran for every i in 1..n.

    Every weight file of `src` must have been converted, per the manifests in `dst`, with the
    same options, and its output must be intact. Then the other files are copied and the
    configs and indexes written (last), as a plain `convert` of the folder would.

    Raises:
        StcastError: a file is missing or stale (the message names the shard to rerun), or the
            folder is inconsistent.
    """
    started = _now()
    src, dst = os.fsdecode(src), os.fsdecode(dst)
    _check_folders(src, dst)
    if not os.path.isdir(dst):
        raise _error(f"{dst}: no such folder; run `stcast convert --shard I/N` first", dst)
    previous = _load_manifests(dst)
    if not previous:
        raise _error(f"{dst}: no stcast manifest; run `stcast convert --shard I/N` first", dst)
    options = _manifest_options(dst, previous)
    to = _target_name(options["to"])
    # Quantized checkpoints were refused (or allowed) by the shard runs that converted them.
    plan = _plan(src, to, check_quantized=False)
    # With one shard count in the manifests, a missing file can be traced to its shard.
    counts = {e.get("shards") for entries in previous.values() for e in entries} - {None}
    n = counts.pop() if len(counts) == 1 else None
    owner = assign_shards(plan.weights, n) if isinstance(n, int) and n > 0 else {}

    manifest = _new_manifest(src, dst, options, None, None)
    reports = []
    for w in plan.weights:
        entry = _find_entry(previous.get(w.rel, []), w, options, os.path.join(dst, w.rel))
        if entry is None:
            hint = f"; run `stcast convert --shard {owner[w.rel]}/{n}` (again)" if owner else ""
            raise _error(f"{w.path}: not converted, or changed since{hint}", w.path, "refused")
        manifest["files"][w.rel] = entry
        reports.append(FileReport(w.rel, "weights", "checked", w.size, entry["output_size"]))
    _write_manifest(dst, MANIFEST, manifest)
    _unpublish(dst, plan)
    meter = _Meter(sum(c.size for c in plan.copies), progress, file_progress)
    reports += _publish(plan, dst, to, meter, cancel)
    manifest["complete"] = True
    _write_manifest(dst, MANIFEST, manifest)
    _remove_manifests(dst, keep=MANIFEST)
    return _folder_report(src, dst, to, reports, [], started, None, True)


def inspect_folder(
    src: str,
    dst: str | None,
    *,
    to: str,
    keep: list[str],
    keep_min_size: int,
    from_bf16: bool,
    scan: bool,
    on_overflow: str,
    threads: int | None,
    progress: Callable[[int, int], object] | None,
) -> FolderInspectReport:
    """A dry run of `convert_folder` with the same options: see `stcast.inspect`."""
    to = _target_name(to)
    weights, indexes, configs, others, _ = _walk(src)
    if not weights:
        raise _error(
            f"{src}: a directory without .safetensors files: nothing to convert", src, "refused"
        )
    total = 0
    headers = {}
    if scan or on_overflow == "keep":
        # One progress bar over every file's scan: each file's total is known from its header.
        for w in weights:
            headers[w.rel] = _core.inspect(w.path, to)["data_bytes"]
        total = sum(headers.values())
    files = []
    done = 0
    for w in weights:

        def step(d: int, t: int, base: int = done) -> None:
            if progress is not None:
                progress(base + d, total)

        result = _core.inspect(
            w.path,
            to,
            keep=keep,
            keep_min_size=keep_min_size,
            from_bf16=from_bf16,
            keep_unmatched="ignore",
            scan=scan,
            on_overflow=on_overflow,
            threads=threads,
            progress=step if progress is not None else None,
        )
        done += headers.get(w.rel, 0)
        result["path"] = w.rel
        result["tensors"] = [stcast.TensorInfo(**t) for t in result["tensors"]]
        files.append(stcast.InspectReport(**result))
    unmatched = [p for p in keep if all(p in f.keep_unmatched for f in files)]
    warnings = [_core_unmatched_message(unmatched)] if unmatched else []
    warnings += [f"{f.path}: {m}" for f in files for m in f.warnings]
    other = sum(f.size for f in [*indexes, *configs, *others])
    output = sum(f.output_bytes for f in files) + other
    return FolderInspectReport(
        path=src,
        to=to,
        files=files,
        data_bytes=sum(f.data_bytes for f in files),
        output_bytes=output,
        other_bytes=other,
        tensors_converted=sum(f.tensors_converted for f in files),
        tensors_copied=sum(f.tensors_copied for f in files),
        tensors_kept=sum(f.tensors_kept for f in files),
        bytes_kept=sum(f.bytes_kept for f in files),
        keep_unmatched=unmatched,
        scanned=scan or on_overflow == "keep",
        warnings=warnings,
        destination=None if dst is None else _api._destination(dst, output),
    )


def default_dst(src: str, to: str = "bf16") -> str:
    """The output folder used when none is given: `<src>-bf16` beside `src`."""
    base = os.path.normpath(src)
    if os.path.basename(base) in ("", ".", ".."):
        base = os.path.realpath(src)
    return f"{base}-{_target_name(to)}"


def assign_shards(weights: list[_File], n: int) -> dict[str, int]:
    """Split the weight files into `n` shards of similar size: rel path -> shard (1-based).

    Largest files first, each to the lightest shard so far (ties: the lowest number). It
    depends only on the names and sizes, so every machine computes the same split.
    """
    loads = [0] * n
    owner = {}
    for w in sorted(weights, key=lambda w: (-w.size, w.rel)):
        k = min(range(n), key=lambda i: (loads[i], i))
        loads[k] += w.size
        owner[w.rel] = k + 1
    return owner


# --- planning: walk and check the source, before anything is written ------------------------


@dataclass(frozen=True)
class _File:
    """A regular file of the source folder (possibly reached through a symlink)."""

    rel: str  # relative path, "/"-separated
    path: str  # src joined with rel
    size: int
    mtime_ns: int


@dataclass
class _Plan:
    """What a run will do, from a source folder that passed every check."""

    weights: list[_File]
    indexes: list[tuple[_File, str, dict[str, str]]]  # file, text, weight_map as rel paths
    configs: list[tuple[_File, bytes | None]]  # file, new content (None: copy unchanged)
    copies: list[_File]  # copied before the configs and indexes
    late_copies: list[_File]  # copied with them (model_index.json)
    dirs: list[str]
    info: dict[str, dict[str, Any]]  # weights rel -> _core.inspect result (+ "header_sha256")
    keep_unmatched: list[str] = field(default_factory=list)  # in no file


def _plan(
    src: str, to: str, check_quantized: bool, precision: dict[str, Any] | None = None
) -> _Plan:
    precision = precision or {}
    weights, indexes, configs, others, dirs = _walk(src)
    if not weights:
        raise _error(
            f"{src}: a directory without .safetensors files: nothing to convert", src, "refused"
        )
    found = {w.rel for w in weights}

    # Index names are checked before anything else is opened.
    parsed_indexes = [(f, *_read_index(f, found)) for f in indexes]

    keep = precision.get("keep", [])
    new_configs = []
    for f in configs:
        text, doc = _read_json(f)
        # With --keep the user chose what stays: the shards are checked below instead.
        if check_quantized and not keep and _has_quantization_config(doc):
            raise _quantized_error(f.path, "its config has a quantization_config")
        new_configs.append((f, _set_dtypes(text, _DTYPE_NAMES[to])))

    info = {}
    unmatched = list(keep)
    for w in weights:
        result = _core.inspect(
            w.path,
            to,
            keep=keep,
            keep_min_size=precision.get("keep_min_size", 0),
            from_bf16=precision.get("from_bf16", False),
            keep_unmatched="ignore",
        )
        unmatched = [p for p in unmatched if p in result["keep_unmatched"]]
        if check_quantized:
            odd = sorted(_quantized_dtypes(result))
            if odd and not keep:
                raise _quantized_error(w.path, f"it holds {', '.join(odd)} tensors")
            if keep:
                scales = [
                    t["name"]
                    for t in result["tensors"]
                    if t["reason"] == "converted" and "scale" in t["name"].lower()
                ]
                if scales:
                    raise _quantized_error(
                        w.path, f"tensor `{scales[0]}` looks like a scale and no --keep keeps it"
                    )
        result["header_sha256"] = _header_sha256(w.path)
        info[w.rel] = result

    for f, _, weight_map in parsed_indexes:
        _check_index(f, weight_map, info)

    return _Plan(
        weights=weights,
        indexes=parsed_indexes,
        configs=new_configs,
        copies=[f for f in others if os.path.basename(f.rel) not in _PUBLISH_LAST_NAMES],
        late_copies=[f for f in others if os.path.basename(f.rel) in _PUBLISH_LAST_NAMES],
        dirs=dirs,
        info=info,
        keep_unmatched=unmatched,
    )


def _walk(src: str) -> tuple[list[_File], list[_File], list[_File], list[_File], list[str]]:
    """Every file under `src`, sorted and classified: weights, indexes, configs, others, dirs.

    Symlinks to regular files are read through (the Hugging Face cache is made of them);
    symlinks to folders are refused rather than followed, as are special files.
    """
    weights, indexes, configs, others, dirs = [], [], [], [], []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(os.path.join(src, rel_dir) if rel_dir else src) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if e.name.startswith(_BOOKKEEPING_PREFIX):
                continue
            if e.is_dir(follow_symlinks=False):
                if e.name not in _SKIPPED_DIRS:
                    dirs.append(rel)
                    pending.append(rel)
                continue
            try:
                st = os.stat(e.path)
            except FileNotFoundError:
                raise _error(f"{e.path}: broken symlink", e.path) from None
            if stat.S_ISDIR(st.st_mode):
                raise _error(
                    f"{e.path}: symlink to a folder; stcast does not follow folder links "
                    "(copy or link its files instead)",
                    e.path,
                    "refused",
                )
            if not stat.S_ISREG(st.st_mode):
                raise _error(f"{e.path}: not a regular file", e.path, "refused")
            f = _File(rel, e.path, st.st_size, st.st_mtime_ns)
            if e.name.endswith(_INDEX_SUFFIX):
                indexes.append(f)
            elif e.name.endswith(_WEIGHTS_SUFFIX):
                weights.append(f)
            elif e.name == _CONFIG_NAME:
                configs.append(f)
            else:
                others.append(f)
    dirs.sort()
    return (
        sorted(weights, key=_by_rel),
        sorted(indexes, key=_by_rel),
        sorted(configs, key=_by_rel),
        sorted(others, key=_by_rel),
        dirs,
    )


def _by_rel(f: _File) -> str:
    return f.rel


def _read_json(f: _File) -> tuple[str, Any]:
    with open(f.path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _error(f"{f.path}: not valid JSON: {reason}", f.path) from None
    # The walks over it below recurse: bound the depth once, here.
    if _depth(doc) > _MAX_JSON_DEPTH:
        raise _error(f"{f.path}: JSON nested deeper than {_MAX_JSON_DEPTH} levels", f.path)
    return text, doc


def _depth(doc: Any) -> int:
    deepest, pending = 0, [(doc, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend(
                (v, depth + 1) for v in (node.values() if isinstance(node, dict) else node)
            )
    return deepest


def _read_index(f: _File, found: set[str]) -> tuple[str, dict[str, str]]:
    """The index's text and its weight_map with shard names made relative to the top folder.

    Shard names must be plain relative names inside the index's folder; anything else is
    refused here, before any shard is opened.
    """
    text, doc = _read_json(f)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise _error(f"{f.path}: not a safetensors index (no weight_map object)", f.path)
    metadata = doc.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _error(f"{f.path}: `metadata` is not an object", f.path)
    folder = os.path.dirname(f.rel)
    out = {}
    for tensor, name in weight_map.items():
        if not _is_plain_name(name):
            raise _error(
                f"{f.path}: weight_map entry `{tensor}` names {name!r}: shard names must be "
                "plain relative names inside the index's folder (no '..', no absolute path, "
                "no NUL)",
                f.path,
                "refused",
            )
        rel = f"{folder}/{name}" if folder else name
        if rel not in found:
            raise _error(f"{f.path}: names shard `{name}`, which is missing", f.path)
        out[tensor] = rel
    return text, out


def _is_plain_name(name: object) -> bool:
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return False
    if name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _check_index(f: _File, weight_map: dict[str, str], info: dict[str, dict[str, Any]]) -> None:
    """The index and the shards it names must list the same tensors."""
    tensors_of = {}
    for rel in sorted(set(weight_map.values())):
        tensors_of[rel] = {t["name"] for t in info[rel]["tensors"]}
    for tensor, rel in weight_map.items():
        if tensor not in tensors_of[rel]:
            raise _error(
                f"{f.path}: tensor `{tensor}` is listed for `{os.path.basename(rel)}` "
                "but that shard does not hold it",
                f.path,
            )
    for rel, names in tensors_of.items():
        for tensor in sorted(names):
            if weight_map.get(tensor) != rel:
                where = weight_map.get(tensor)
                said = "is absent from the index" if where is None else f"is listed for `{where}`"
                raise _error(
                    f"{f.path}: tensor `{tensor}` of shard `{os.path.basename(rel)}` {said}",
                    f.path,
                )


def _precision_options(
    keep: list[str] | None, keep_min_size: int, from_bf16: bool, on_overflow: str
) -> dict[str, Any]:
    """The options beside `to` that change the output, without the defaults."""
    options: dict[str, Any] = {}
    if keep:
        options["keep"] = list(keep)
    if keep_min_size:
        options["keep_min_size"] = keep_min_size
    if from_bf16:
        options["from_bf16"] = True
    if on_overflow != "warn":
        if on_overflow not in ("error", "keep"):
            raise ValueError(f'on_overflow must be "warn", "error" or "keep", not {on_overflow!r}')
        options["on_overflow"] = on_overflow
    return options


def _core_unmatched_message(patterns: list[str]) -> str:
    """The engine's words for --keep patterns that match nothing (rust/header.rs)."""
    listed = ", ".join(f"`{p}`" for p in patterns)
    if len(patterns) == 1:
        return f"--keep pattern {listed} matches no tensor name (a typo?)"
    return f"--keep patterns {listed} match no tensor name (typos?)"


def _quantized_dtypes(result: dict[str, Any]) -> set[str]:
    dtypes = {t["dtype"] for t in result["tensors"]}
    return {d for d in dtypes if d.startswith(_QUANTIZED_PREFIXES) and d != "F64"}


def _has_quantization_config(doc: Any) -> bool:
    if isinstance(doc, dict):
        if doc.get("quantization_config") is not None:
            return True
        return any(_has_quantization_config(v) for v in doc.values())
    if isinstance(doc, list):
        return any(_has_quantization_config(v) for v in doc)
    return False


def _quantized_error(path: str, why: str) -> StcastError:
    return _error(
        f"{path}: quantized checkpoint ({why}): converting it would silently round its F32 "
        "scale tensors to bf16 too; keep them with --keep '*scale*', or convert anyway with "
        "--allow-quantized",
        path,
        "refused",
    )


# --- JSON rewriting that keeps the original text ---------------------------------------------

_WS = re.compile(r"[ \t\n\r]*")


def _member_spans(text: str, wanted: Callable[[tuple[Any, ...]], bool]) -> list[tuple[int, int]]:
    """(start, end) of the value of every object member whose key path `wanted` accepts.

    `text` must already have passed `json.loads`. Only those spans are replaced afterwards,
    so every other byte (order, indentation, number spelling) stays as it was.
    """
    decoder = json.JSONDecoder()
    spans = []

    def skip(i: int) -> int:
        m = _WS.match(text, i)
        return m.end() if m else i

    def value(i: int, path: tuple[Any, ...]) -> int:
        c = text[i]
        if c == "{":
            i = skip(i + 1)
            if text[i] == "}":
                return i + 1
            while True:
                key, i = decoder.raw_decode(text, i)
                start = skip(skip(i) + 1)  # past the colon
                end = value(start, (*path, key))
                if wanted((*path, key)):
                    spans.append((start, end))
                i = skip(end)
                if text[i] == "}":
                    return i + 1
                i = skip(i + 1)  # past the comma
        if c == "[":
            i = skip(i + 1)
            if text[i] == "]":
                return i + 1
            k = 0
            while True:
                i = skip(value(i, (*path, k)))
                k += 1
                if text[i] == "]":
                    return i + 1
                i = skip(i + 1)
        return decoder.raw_decode(text, i)[1]

    value(skip(0), ())
    return spans


def _replace_spans(text: str, spans: list[tuple[int, int]], new: str) -> str:
    for start, end in sorted(spans, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _set_dtypes(text: str, dtype_name: str) -> bytes | None:
    """The config with every `torch_dtype`/`dtype` string set to `dtype_name`, or None if none.

    Nested sub-configs (`text_config`, ...) count; `quantization_config` is left alone.
    """

    def wanted(path: tuple[Any, ...]) -> bool:
        return path[-1] in _DTYPE_KEYS and "quantization_config" not in path

    spans = [
        (a, b)
        for a, b in _member_spans(text, wanted)
        if text[a] == '"' or text[a:b] == "null"  # only names, never a nested object
    ]
    if not spans:
        return None
    return _replace_spans(text, spans, json.dumps(dtype_name)).encode("utf-8")


def _set_total_size(text: str, total: int) -> bytes:
    """The index text with `metadata.total_size` set to `total`, all else unchanged."""
    spans = _member_spans(text, lambda path: path == ("metadata", "total_size"))
    if spans:
        return _replace_spans(text, spans, str(total)).encode("utf-8")
    # No total_size to replace: rebuild the document, in the original's style.
    doc = json.loads(text)
    metadata = {"total_size": total, **(doc.get("metadata") or {})}
    if "metadata" in doc:
        doc["metadata"] = metadata  # keeps its place
    else:
        doc = {"metadata": metadata, **doc}
    m = re.search(r"\n([ \t]+)\S", text)
    indent = m.group(1) if m else None
    separators = None if indent is not None or '": ' in text else (",", ":")
    out = json.dumps(
        doc,
        indent=indent,
        separators=separators,
        ensure_ascii=text.isascii() and "\\u" in text,
    )
    return (out + ("\n" if text.endswith("\n") else "")).encode("utf-8")


# --- writing ----------------------------------------------------------------------------------


class _Meter:
    """Whole-folder progress (bytes) and per-file progress, fed to the callers' callbacks."""

    def __init__(
        self,
        total: int,
        progress: Callable[[int, int], object] | None,
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


def _convert_files(
    todo: list[_File],
    dst: str,
    to: str,
    *,
    threads: int | None,
    force: bool,
    meter: _Meter,
    cancel: _CancelFlag | None,
    info: dict[str, dict[str, Any]],
    manifest: dict[str, Any],
    manifest_name: str,
    engine: dict[str, Any],
    precision: dict[str, Any],
) -> list[FileReport]:
    """Convert the files one after another (all cores on each), recording each when done.

    `engine` receives the engine's `threads` and `isa`.
    """
    reports = []
    for w in todo:
        _check_cancel(cancel)
        out = _out_path(dst, w.rel)
        size = int(info[w.rel]["data_bytes"])

        def step(done: int, total: int, rel: str = w.rel) -> None:
            meter.step(rel, done, total)

        meter.step(w.rel, 0, size)
        # Unmatched --keep patterns were judged over the whole folder (in _plan).
        r = _api._convert_file(
            w.path,
            out,
            to=to,
            threads=threads,
            force=force,
            progress=step if meter.is_on() else None,
            cancel=cancel,
            keep=precision.get("keep", []),
            keep_min_size=precision.get("keep_min_size", 0),
            from_bf16=precision.get("from_bf16", False),
            on_overflow=precision.get("on_overflow", "warn"),
            keep_unmatched="ignore",
            # The user's call, four frames up: convert, convert_folder, _convert_files, here.
            stacklevel=6,
        )
        meter.finish(w.rel, size)
        manifest["files"][w.rel] = _manifest_entry(w, info[w.rel], manifest)
        engine["threads"], engine["isa"] = r.threads, r.isa
        _write_manifest(dst, manifest_name, manifest)
        reports.append(
            FileReport(
                w.rel,
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
        )
    return reports


def _publish(
    plan: _Plan, dst: str, to: str, meter: _Meter, cancel: _CancelFlag | None
) -> list[FileReport]:
    """Copy the other files, then write configs and indexes: a loader's cues come last."""
    reports = []
    for d in plan.dirs:
        _ensure_dir(dst, d)
    for f in plan.copies:
        _check_cancel(cancel)
        meter.step(f.rel, 0, f.size)
        _copy_atomic(f.path, _out_path(dst, f.rel))
        meter.finish(f.rel, f.size)
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    _check_cancel(cancel)
    for f in plan.late_copies:
        _copy_atomic(f.path, _out_path(dst, f.rel))
        reports.append(FileReport(f.rel, "copy", "copied", f.size, f.size))
    for f, content in plan.configs:
        if content is None:
            _copy_atomic(f.path, _out_path(dst, f.rel))
            reports.append(FileReport(f.rel, "config", "copied", f.size, f.size))
        else:
            _write_atomic(_out_path(dst, f.rel), content)
            reports.append(FileReport(f.rel, "config", "rewritten", f.size, len(content)))
    for f, text, weight_map in plan.indexes:
        total = 0
        for rel in sorted(set(weight_map.values())):
            result = _core.inspect(os.path.join(dst, rel), to)
            total += sum(t["bytes"] for t in result["tensors"])
        content = _set_total_size(text, total)
        _write_atomic(_out_path(dst, f.rel), content)
        reports.append(FileReport(f.rel, "index", "rewritten", f.size, len(content)))
    return reports


def _unpublish(dst: str, plan: _Plan) -> None:
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


def _out_path(dst: str, rel: str) -> str:
    return os.path.join(_ensure_dir(dst, os.path.dirname(rel)), os.path.basename(rel))


def _ensure_dir(dst: str, rel_dir: str) -> str:
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
                raise _error(
                    f"{path}: exists and is not a folder (stcast does not write through links)",
                    path,
                    "refused",
                ) from None
    return path


def _temp_beside(path: str) -> tuple[str, int]:
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f"{_BOOKKEEPING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.tmp")
    # Mode 0666 & ~umask, as for any new file.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    return tmp, os.open(tmp, flags, 0o666)


def _write_atomic(path: str, content: bytes) -> None:
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


def _copy_atomic(src: str, path: str) -> None:
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


# --- destination, manifest and resume --------------------------------------------------------


def _check_folders(src: str, dst: str) -> None:
    if not os.path.isdir(src):
        raise _error(f"{src}: not a folder", src)
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if os.path.commonpath([real_src, real_dst]) in (real_src, real_dst):
        raise _error(
            f"{dst}: the destination must be outside the source folder and not contain it "
            f"({real_dst} vs {real_src})",
            dst,
            "refused",
        )
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise _error(f"{dst}: exists and is not a folder", dst, "refused")


def _prepare_dst(dst: str, own_manifest: str, *, force: bool, resume: bool, whole: bool) -> None:
    """Create `dst`, or accept an existing one only where the options say so.

    A whole-folder run needs an empty folder, `force` or `resume`. A shard run shares the
    folder with the other shards: only its own earlier manifest needs `force` or `resume`.
    """
    try:
        os.mkdir(dst)
        return
    except FileExistsError:
        pass
    if force or resume:
        return
    if whole and os.listdir(dst):
        raise _error(
            f"{dst}: destination folder is not empty (a previous run?); use --resume to "
            "continue it or --force to convert everything again",
            dst,
            "refused",
        )
    if not whole and os.path.lexists(os.path.join(dst, own_manifest)):
        raise _error(
            f"{dst}: this shard already ran here ({own_manifest}); use --resume to continue it "
            "or --force to convert it again",
            dst,
            "refused",
        )


def _shard_manifest_name(i: int, n: int) -> str:
    return f".stcast-manifest.shard-{i}-of-{n}.json"


def _new_manifest(
    src: str,
    dst: str,
    options: dict[str, Any],
    allow_quantized: bool | None,
    shard: tuple[int, int] | None,
) -> dict[str, Any]:
    return {
        "_dst": dst,
        "format": MANIFEST_FORMAT,
        "version": stcast.__version__,
        "src": os.path.realpath(src),
        "options": options,
        "allow_quantized": allow_quantized,
        "shard": None if shard is None else list(shard),
        "complete": False,
        "files": {},
    }


def _manifest_entry(w: _File, info: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """What `resume` and `finalize` need to trust the output of `w` without reading it."""
    shard = manifest["shard"]
    out = os.path.join(manifest["_dst"], w.rel)
    return {
        "source_size": w.size,
        "source_mtime_ns": w.mtime_ns,
        "source_header_sha256": info["header_sha256"],
        "options": manifest["options"],
        "version": stcast.__version__,
        "shards": None if shard is None else shard[1],
        "output_size": os.stat(out).st_size,
        "output_header_sha256": _header_sha256(out),
    }


def _write_manifest(dst: str, name: str, manifest: dict[str, Any]) -> None:
    doc = {k: v for k, v in manifest.items() if not k.startswith("_")}  # "_dst" stays here
    # ASCII keeps any file name (even undecodable bytes, as surrogates) round-trippable.
    text = json.dumps(doc, indent=1, ensure_ascii=True) + "\n"
    _write_atomic(os.path.join(dst, name), text.encode("ascii"))


def _load_manifests(dst: str) -> dict[str, list[dict[str, Any]]]:
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
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # unreadable: its files are simply converted again
    return entries


def _remove_manifests(dst: str, keep: str | None = None) -> None:
    for name in os.listdir(dst):
        if name != keep and (name == MANIFEST or _SHARD_MANIFEST.fullmatch(name)):
            _unlink_quietly(os.path.join(dst, name))


def _find_entry(
    entries: list[dict[str, Any]], w: _File, options: dict[str, Any], out: str
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
    source_hash = _header_sha256(w.path)
    output_hash = None
    for e in entries:
        if (
            e.get("version") != stcast.__version__
            or e.get("options") != options
            or e.get("source_size") != w.size
            or e.get("source_mtime_ns") != w.mtime_ns
            or e.get("source_header_sha256") != source_hash
            or e.get("output_size") != st.st_size
        ):
            continue
        if output_hash is None:
            output_hash = _header_sha256(out)
        if output_hash and e.get("output_header_sha256") == output_hash:
            return e
    return None


def _manifest_options(dst: str, previous: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The options every manifest entry was converted with (they must all agree)."""
    seen = {
        json.dumps(e["options"], sort_keys=True)
        for entries in previous.values()
        for e in entries
        if isinstance(e.get("options"), dict)
    }
    options = json.loads(next(iter(seen))) if len(seen) == 1 else None
    if options is None or not isinstance(options.get("to"), str):
        targets = sorted(seen)
        raise _error(
            f"{dst}: the manifests disagree on the options ({', '.join(targets)}); "
            "convert the shards again with the same options",
            dst,
            "refused",
        )
    _target_name(options["to"])
    return dict(options)


def _header_sha256(path: str) -> str:
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


# --- small helpers ----------------------------------------------------------------------------


def _folder_report(
    src: str,
    dst: str,
    to: str,
    files: list[FileReport],
    converted: list[FileReport],
    started: float,
    shard: tuple[int, int] | None,
    complete: bool,
    engine: dict[str, Any] | None = None,
) -> FolderReport:
    engine = engine or {}
    return FolderReport(
        src=src,
        dst=dst,
        to=to,
        tensors_converted=sum(r.tensors_converted for r in converted),
        tensors_copied=sum(r.tensors_copied for r in converted),
        bytes_in=sum(r.bytes_in for r in converted),
        bytes_out=sum(r.bytes_out for r in converted),
        seconds=_now() - started,
        threads=engine.get("threads"),
        isa=engine.get("isa"),
        warnings=[w for r in converted for w in r.warnings],
        files=files,
        shard=None if shard is None else list(shard),
        complete=complete,
        tensors_kept=sum(r.tensors_kept for r in converted),
        bytes_kept=sum(r.bytes_kept for r in converted),
    )


def _target_name(to: str) -> str:
    name = _api._TARGET_NAMES.get(to.lower()) if isinstance(to, str) else None
    if name is None:
        raise ValueError(f"unknown target {to!r}: use 'bf16' or 'fp16'")
    return name


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in shard)
    except (TypeError, ValueError):
        raise ValueError(f"shard must be a pair (i, n), got {shard!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"shard ({i}, {n}): need 1 <= i <= n")
    return i, n


def _check_cancel(cancel: _CancelFlag | None) -> None:
    if cancel is not None and cancel.is_set():
        raise stcast.Cancelled("conversion cancelled")


def _error(message: str, path: str | None, kind: str = "invalid_input") -> StcastError:
    e = StcastError(message)
    e.kind = kind
    e.path = path
    return e


def _now() -> float:
    return time.monotonic()
