"""Walk a checkpoint folder and check it, before anything is written: what to convert,
copy and rewrite, and whether the indexes agree with their shards."""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .. import _core, _engine
from ..errors import Cancelled, InvalidInput, Refused
from ..reports import Notice
from .common import MAX_JSON_BYTES, WEIGHTS_SUFFIX, File, read_bounded, source_sha256
from .fp8 import (
    WEIGHT_COMPANION_SUFFIXES,
    dequantizes,
    is_fp8,
    is_model_config,
    nonfinite,
    quantization_of,
    side_configs,
    unread_quantization,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._engine import CancelFlag
    from .._types import Target
    from ..reports import InspectReport

# The model config, whose dtype a conversion rewrites (the engine classifies it:
# rust/run/walk.rs).
CONFIG_NAME = "config.json"
# Files a loader reads first to decide that a folder is a checkpoint: written last.
_PUBLISH_LAST_NAMES = frozenset({CONFIG_NAME, "model_index.json"})
_esc = _core.escape
# The engine's warning kind for a prefix to strip that no tensor name starts with.
UNMATCHED_PREFIX = "unmatched_prefix"


class Walked(NamedTuple):
    """A source folder's files, classified (see `walk`)."""

    weights: list[File]
    indexes: list[File]
    configs: list[File]
    others: list[File]
    dirs: list[str]
    # Files left out, and why: "trainer" (trainer state), "superseded" (PyTorch weights
    # beside their safetensors version) or "excluded" (an `exclude` glob).
    skipped: list[tuple[File, str]]
    # The engine's warnings: an `include` or `exclude` glob that matches no file.
    warnings: list[Notice]


@dataclass
class Plan:
    """What a run will do, from a source folder that passed every check."""

    weights: list[File]
    # file, text (shard names already renamed), weight_map as destination rel paths
    indexes: list[tuple[File, str, dict[str, str]]]
    configs: list[tuple[File, bytes | None]]  # file, new content (None: copy unchanged)
    copies: list[File]  # copied before the configs and indexes
    late_copies: list[File]  # copied with them (model_index.json)
    dirs: list[str]
    info: dict[str, InspectReport]  # weights rel -> its plan, without the per-tensor list
    out_data: dict[str, int]  # weights rel -> bytes of its output's tensors
    header_sha256: dict[str, str]  # weights rel -> the hash of its header
    keep_unmatched: list[str] = field(default_factory=list)  # in no file
    skipped: list[tuple[File, str]] = field(default_factory=list)  # left out, and why
    # An FP8 checkpoint dequantized: its indexes lose the scales the shards no longer hold.
    dequantize: bool = False
    # FP8 targets: weights rel -> its weights that hold NaN or inf, found by reading them
    # while planning (they stay BF16: the plan above is the one written), handed to the
    # conversion so that it does not read them again.
    unquantized: dict[str, list[str]] = field(default_factory=dict)
    # The prefixes to strip that no file's names start with: one warning each.
    unmatched_prefixes: list[Notice] = field(default_factory=list)
    # The prefixes its tensor names lose (every file's and index's alike).
    strip_prefix: list[str] = field(default_factory=list)
    # What the walk said (`Walked.warnings`).
    walk_warnings: list[Notice] = field(default_factory=list)
    # FP8 targets: the top folder's model config, the engine's `packed_config` for every
    # file of the run: its sizes split fused MoE experts per expert, and every output
    # records them (rust/experts.rs). None otherwise.
    model_config: str | None = None


def plan(
    src: str,
    to: Target,
    check_quantized: bool,
    precision: dict[str, Any] | None = None,
    follow_links: bool = False,
    cancel: CancelFlag | None = None,
    strip_prefix: Sequence[str] = (),
) -> Plan:
    """Walk `src` and plan every file, refusing what cannot be converted safely.

    With `check_quantized`, a quantized checkpoint is refused (by the engine, as a single
    file is: `quantization_config` is the config that makes every file quantized).
    `strip_prefix` renames the tensors of every file and index (the engine's rule).
    """
    precision = precision or {}
    strip = list(strip_prefix)
    weights, indexes, configs, others, dirs, skipped, walk_warnings = walk(
        src, follow_links, precision.get("include", ()), precision.get("exclude", ())
    )
    if not weights:
        raise Refused(
            f"{_esc(src)}: a directory without .safetensors files or PyTorch weights "
            "(pytorch_model*.bin): nothing to convert",
            path=src,
        )
    found = {w.rel for w in weights}

    # Index names are checked before anything else is opened.
    parsed_indexes = [(f, *read_index(f, found, strip)) for f in indexes]
    index_owners(parsed_indexes)

    keep = precision.get("keep", [])
    new_configs = []
    quantization_config = None
    # FP8 configs (compressed-tensors float 8-bit, DeepSeek fp8): their checkpoint is
    # dequantized when its files hold FP8 weights with scales (the engine refuses any other
    # quantized tensor), and the config loses its quantization_config.
    fp8_configs: dict[str, bytes | None] = {}
    unread: tuple[File, str] | None = None
    # The configs that describe the quantized weights dequantized: the engine checks each
    # packed weight against the nearest one above it.
    described: list[File] = []
    for f in configs:
        text, doc = read_json(f)
        check_fp8_config(f, doc, to)
        why = unread_quantization(doc, to)
        unread = unread or (None if why is None else (f, why))
        # `keep` changes no dtype: the config is copied as it is.
        content = _core.config_text(text, to)
        if dequantizes(doc, to):
            fp8_configs[f.rel] = _core.config_text(text, to, dequantize=True)
            described.append(f)
        if quantization_config is None and _has_quantization_config(doc):
            quantization_config = f
        new_configs.append((f, content))
    dequantize = bool(fp8_configs) and dequantizes_any(weights, to, precision)
    if dequantize:
        quantization_config = None
        new_configs = [(f, fp8_configs.get(f.rel, c)) for f, c in new_configs]
    # A config decides before the first byte whether its checkpoint is dequantized: FP8
    # weights with scales under a scheme stcast does not read are refused here.
    if unread is not None and dequantizes_any(weights, to, precision):
        raise Refused(f"{_esc(unread[0].path)}: {unread[1]}", path=unread[0].path)

    model_config = experts_config(configs, to)
    info: dict[str, InspectReport] = {}
    said: list[list[Notice]] = []
    hashes = {}
    unmatched = list(keep)
    # What the checks below need of each file's tensors; the per-tensor plans themselves
    # are not kept (a file may hold hundreds of thousands of tensors).
    indexed = {rel for _, _, weight_map in parsed_indexes for rel in weight_map.values()}
    names: dict[str, set[str]] = {}
    out_data: dict[str, int] = {}
    unquantized: dict[str, list[str]] = {}
    quantizes: list[File] = []  # the files whose weights an FP8 target quantizes
    files_dequantize = False
    problem: Refused | None = None
    for w in weights:
        if cancel is not None and cancel.is_set():
            raise Cancelled("conversion cancelled")
        report = _engine.inspect_file(
            w.path,
            to=to,
            # The precision options as the manifest records them; overflow only measured.
            **{**precision, "on_overflow": "warn"},
            keep_unmatched="ignore",
            # The engine's quantized policy (one for files and folders): it refuses here,
            # before anything is written, unless allowed.
            allow_quantized=not check_quantized,
            quantization_config=None if quantization_config is None else quantization_config.path,
            packed_config=_nearest(w, described) or model_config,
            strip_prefix=strip,
        )
        # Without a quantization_config the files decide, as for a lone file: a folder
        # whose files hold FP8 weights with their scales is dequantized (its indexes then
        # lose the scales), and then whole.
        if dequantize or quantization_config is None:
            if any(t.reason == "dequantized" for t in report.tensors):
                files_dequantize = True
            problem = problem or _dequantize_problem(w, report)
        unmatched = [p for p in unmatched if p in report.keep_unmatched]
        hashes[w.rel] = source_sha256(w.path)
        if w.rel in indexed:
            # (The source's names: a fused tensor split per expert is one.)
            names[w.rel] = {t.split_from or t.name for t in report.tensors}
        out_data[w.rel] = sum(t.target_bytes for t in report.tensors)
        if is_fp8(to):
            unquantized[w.rel] = nonfinite(report.tensors)
            if any(t.reason == "quantized" for t in report.tensors):
                quantizes.append(w)
        info[w.rel] = dataclasses.replace(report, tensors=[])
        said.append(report.warnings)

    dequantize = dequantize or files_dequantize
    # FP8 weights no model config describes: their quantization_config goes beside them.
    taken = {f.rel for f in [*configs, *others]}
    rels = [r for r in side_configs([w.rel for w in quantizes], list(taken)) if r not in taken]
    first = {posixpath.dirname(w.rel): w for w in reversed(quantizes)}
    new_configs += [(File(r, first[posixpath.dirname(r)].path, 0, 0), b"{}") for r in rels]
    if dequantize and problem is not None:
        raise problem
    for f, _, weight_map in parsed_indexes:
        _check_index(f, weight_map, names)

    return Plan(
        weights=weights,
        indexes=parsed_indexes,
        configs=new_configs,
        copies=[f for f in others if os.path.basename(f.rel) not in _PUBLISH_LAST_NAMES],
        late_copies=[f for f in others if os.path.basename(f.rel) in _PUBLISH_LAST_NAMES],
        dirs=dirs,
        info=info,
        out_data=out_data,
        header_sha256=hashes,
        keep_unmatched=unmatched,
        skipped=skipped,
        dequantize=dequantize,
        unquantized=unquantized,
        unmatched_prefixes=common_prefix_notices(said),
        walk_warnings=walk_warnings,
        strip_prefix=strip,
        model_config=model_config,
    )


def common_prefix_notices(said: Sequence[Sequence[Notice]]) -> list[Notice]:
    """Of the warnings each file (or group) gave, those that a prefix to strip matches no
    tensor name (the engine's, one per prefix) that every one gave: a prefix is judged
    over the whole input, and said once."""
    sets = [{w.template for w in ws if w.kind == UNMATCHED_PREFIX} for ws in said]
    common = set.intersection(*sets) if sets else set()
    first = [w.template for w in said[0] if w.template in common] if said else []
    return [Notice(UNMATCHED_PREFIX, t) for t in first]


def experts_config(configs: Sequence[File], to: Target) -> str | None:
    """Under an FP8 target, the top folder's model config, as `model_free_ptq` reads it:
    fused MoE experts are split by its sizes (`Plan.model_config`)."""
    top = [f.path for f in configs if f.rel == CONFIG_NAME]
    return top[0] if is_fp8(to) and top else None


def walk(
    src: str,
    follow_links: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> Walked:
    """Every file under `src`, sorted and classified: weights, indexes, configs, others, dirs
    and the files left out (trainer state, PyTorch weights superseded by their safetensors
    version, files `exclude` matches; `include` brings back what matches it), its links and
    special files checked: the engine's walk (`rust/run/walk.rs`, whose comment says the
    policy)."""
    weights, indexes, configs, others, dirs, skipped, warnings = _core.walk_folder(
        src, follow_links=follow_links, include=list(include), exclude=list(exclude)
    )
    return Walked(
        [File(*r) for r in weights],
        [File(*r) for r in indexes],
        [File(*r) for r in configs],
        [File(*r) for r in others],
        dirs,
        [(File(*r), why) for r, why in skipped],
        [Notice(kind, template) for kind, template in warnings],
    )


def _torch_name(name: str) -> str | None:
    """The safetensors name of a PyTorch weight file or index of the Hugging Face layouts
    (`pytorch_model.bin` -> `model.safetensors`), or None if `name` is not one: the
    engine's rule, the walk's (`rust/run/walk.rs`)."""
    return _core.torch_name(name)


def safetensors_name(name: str) -> str:
    """The safetensors name of a weight file: a Hugging Face PyTorch name renamed as in a
    folder, any other its stem with `.safetensors`."""
    if name.endswith(WEIGHTS_SUFFIX):
        return name
    return _torch_name(name) or os.path.splitext(name)[0] + WEIGHTS_SUFFIX


def skipped_notice(skipped: list[tuple[File, str]]) -> list[tuple[str, str]]:
    """The notes (kind, template) that name the files left out, by reason, with their sizes
    (a folder of training state: its files' total, named with a `/`)."""
    notes = []
    for why, text in (
        ("trainer", "left out: training state, not weights (never read)"),
        (
            "superseded",
            "left out: PyTorch weights beside their safetensors version (the safetensors "
            "files are converted)",
        ),
        ("excluded", "left out by {exclude}"),
    ):
        files = [f for f, w in skipped if w == why]
        if files:
            sized = [f"`{_esc(f.source_rel)}` ({_core.format_bytes(f.size)})" for f in files]
            more = ""
            if len(files) > 8:
                rest = sum(f.size for f in files[8:])
                more = f" and {len(files) - 8} more ({_core.format_bytes(rest)})"
            notes.append(("skipped_files", f"{text}: {', '.join(sized[:8])}{more}"))
    return notes


def listing(dst: str) -> list[str]:
    """Every file under `dst` but stcast's bookkeeping (manifests, temps), as relative
    paths; links and special files count as files, folders are walked (never a link)."""
    return _core.list_folder(dst)


def check_fp8_config(f: File, doc: Any, to: Target) -> None:
    """An FP8 target writes its quantization_config into the model config `f` (`doc`, as
    parsed): one that is not a JSON object is refused, before anything is written."""
    if is_fp8(to) and is_model_config(f.rel) and not isinstance(doc, dict):
        raise InvalidInput(
            f"{_esc(f.path)}: not a JSON object, so an FP8 target cannot add its "
            "quantization_config to it",
            path=f.path,
        )


def read_json(f: File) -> tuple[str, Any]:
    """The text and the parsed document of a JSON file, refusing invalid or deep ones."""
    raw = read_bounded(f.path, MAX_JSON_BYTES)
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidInput(f"{_esc(f.path)}: not valid JSON: {_esc(reason)}", path=f.path) from None
    # The walks over it below recurse: bound the depth once, here.
    if _core.json_depth(text) > _core.JSON_MAX_DEPTH:
        raise InvalidInput(
            f"{_esc(f.path)}: JSON nested deeper than {_core.JSON_MAX_DEPTH} levels", path=f.path
        )
    return text, doc


def read_index(
    f: File, found: set[str], strip_prefix: Sequence[str] = ()
) -> tuple[str, dict[str, str]]:
    """The index's text (a PyTorch index's shards renamed) and its weight_map with shard
    names made relative to the top folder, checked by the engine (rust/run/check.rs
    `read_index`): plain names inside the index's folder, of files in `found`; its tensor
    names without `strip_prefix`, as the files' are."""
    text, weight_map = _core.read_index(
        f.path, f.rel, f.src_rel is not None, found, list(strip_prefix)
    )
    return text, dict(weight_map)


def index_owners(indexes: list[tuple[File, str, dict[str, str]]]) -> dict[str, str]:
    """Each shard named by an index: shard rel -> the index's rel. A shard that two indexes
    name is refused (by a folder conversion, a re-sharding and verify alike): which
    checkpoint it belongs to, and which index a loader should read, is anyone's guess."""
    owner: dict[str, str] = {}
    for f, _, weight_map in indexes:
        for rel in sorted(set(weight_map.values())):
            if rel in owner:
                raise Refused(
                    f"{_esc(f.path)}: names {_esc(rel)}, which {_esc(owner[rel])} names too; "
                    "stcast cannot tell which checkpoint it belongs to (remove one of the "
                    "two indexes)",
                    path=f.path,
                )
            owner[rel] = f.rel
    return owner


def _check_index(f: File, weight_map: dict[str, str], names: dict[str, set[str]]) -> None:
    """The index and the shards it names must list the same tensors."""
    tensors_of = {}
    for rel in sorted(set(weight_map.values())):
        tensors_of[rel] = names[rel]
    for tensor, rel in weight_map.items():
        if tensor not in tensors_of[rel]:
            raise InvalidInput(
                f"{_esc(f.path)}: tensor `{_esc(tensor)}` is listed for "
                f"`{_esc(os.path.basename(rel))}` but that shard does not hold it",
                path=f.path,
            )
    for rel, held in tensors_of.items():
        for tensor in sorted(held):
            if weight_map.get(tensor) != rel:
                where = weight_map.get(tensor)
                said = (
                    "is absent from the index"
                    if where is None
                    else f"is listed for `{_esc(where)}`"
                )
                raise InvalidInput(
                    f"{_esc(f.path)}: tensor `{_esc(tensor)}` of shard "
                    f"`{_esc(os.path.basename(rel))}` {said}",
                    path=f.path,
                )


def _dequantize_problem(w: File, report: InspectReport) -> Refused | None:
    """Why a dequantized folder's file cannot be dequantized whole, if it cannot: a
    quantized tensor left as it is (a weight whose scale another file holds, or none), a
    weight's scale, zero point, global scale or shape left without its weight."""
    for t in report.tensors:
        lowp = t.dtype in _core.QUANTIZED_DTYPES and t.reason not in ("dequantized", "dropped")
        of = [s for s in WEIGHT_COMPANION_SUFFIXES if t.name.endswith(s) and t.reason != "dropped"]
        if lowp or of:
            what = (
                f"is a {_core.COMPANION_ROLES[of[0]]} ({t.dtype}) whose weight is not in this file"
                if of
                else "is quantized without a scale beside it in this file"
            )
            return Refused(
                f"{_esc(w.path)}: tensor `{_esc(t.name)}` {what}: this quantized checkpoint cannot "
                "be dequantized whole; nothing was written",
                path=w.path,
            )
    return None


def _nearest(w: File, configs: list[File]) -> str | None:
    """The path of the config among `configs` in `w`'s folder or the nearest above it."""
    folder = w.rel.rpartition("/")[0]
    best: tuple[int, str] | None = None
    for f in configs:
        d = f.rel.rpartition("/")[0]
        inside = d == "" or folder == d or folder.startswith(d + "/")
        if inside and (best is None or len(d) > best[0]):
            best = (len(d), f.path)
    return None if best is None else best[1]


def dequantizes_any(weights: list[File], to: Target, precision: dict[str, Any]) -> bool:
    """Does any weight file hold an FP8 weight with its scale, which `to` dequantizes?"""
    for w in weights:
        report = _engine.inspect_file(
            w.path,
            to=to,
            **{**precision, "on_overflow": "warn"},
            keep_unmatched="ignore",
            allow_quantized=True,
        )
        if any(t.reason == "dequantized" for t in report.tensors):
            return True
    return False


def _has_quantization_config(doc: Any) -> bool:
    if isinstance(doc, dict):
        if quantization_of(doc) is not None:
            return True
        return any(_has_quantization_config(v) for v in doc.values())
    if isinstance(doc, list):
        return any(_has_quantization_config(v) for v in doc)
    return False


class _Sized(Protocol):
    """What `assign_shards` balances: a work item (see `work.Item`), or a file."""

    @property
    def rel(self) -> str: ...

    @property
    def size(self) -> int: ...


def assign_shards(weights: Sequence[_Sized], n: int) -> dict[str, int]:
    """Split the units (weight files, or output shards) into `n` shards of similar size:
    rel path -> shard (1-based).

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
