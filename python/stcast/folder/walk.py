"""Walk a checkpoint folder and check it, before anything is written: what to convert,
copy and rewrite, and whether the indexes agree with their shards."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .. import _core
from ..errors import InvalidInput, Refused
from ..reports import InspectReport, Notice, _build, notices
from .common import File
from .fp8 import is_fp8, is_model_config

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._engine import CancelFlag
    from .._types import Target

# The model config, whose dtype a conversion rewrites (the engine classifies it:
# rust/run/walk.rs).
CONFIG_NAME = "config.json"
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
    # Why the run is refused when no file converts a tensor or changes format (its output a
    # copy of the folder), or None: the engine's.
    nothing_to_convert: str | None = None
    skipped: list[tuple[File, str]] = field(default_factory=list)  # left out, and why
    # The notes that name the files left out, by reason: the engine's.
    left_out: list[Notice] = field(default_factory=list)
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
    """Walk `src` and plan every file, refusing what cannot be converted safely: the
    engine's answer (`rust/run/plan.rs`), stepped one weight file at a time (`cancel`
    checked between them).

    With `check_quantized`, a quantized checkpoint is refused (by the engine, as a single
    file is: `quantization_config` is the config that makes every file quantized).
    `strip_prefix` renames the tensors of every file and index (the engine's rule).
    """
    found = _core.plan_folder(
        src,
        check_quantized=check_quantized,
        cancel=cancel,
        to=to,
        follow_links=follow_links,
        strip_prefix=list(strip_prefix),
        **(precision or {}),
    )
    weights, indexes, configs, copies, late_copies, dirs, skipped, model_config = found["files"]
    files = [File(*r) for r in weights]
    planned = {w.rel: p for w, p in zip(files, found["planned"])}
    return Plan(
        weights=files,
        indexes=[(File(*r), text, dict(weight_map)) for r, text, weight_map in indexes],
        configs=[(File(*r), None if c is None else c.encode()) for r, c in configs],
        copies=[File(*r) for r in copies],
        late_copies=[File(*r) for r in late_copies],
        dirs=dirs,
        info={
            w.rel: _build(
                InspectReport, p["info"], path=w.path, warnings=notices(p["info"]["warnings"])
            )
            for w, p in zip(files, found["planned"])
        },
        out_data={rel: p["out_data"] for rel, p in planned.items()},
        header_sha256={rel: p["header_sha256"] for rel, p in planned.items()},
        keep_unmatched=found["keep_unmatched"],
        nothing_to_convert=found["nothing_to_convert"],
        skipped=[(File(*r), why) for r, why in skipped],
        left_out=notices(found["left_out"]),
        dequantize=found["dequantize"],
        unquantized={
            rel: p["unquantized"] for rel, p in planned.items() if p["unquantized"] is not None
        },
        unmatched_prefixes=notices(found["unmatched_prefixes"]),
        strip_prefix=found["strip_prefix"],
        walk_warnings=notices(found["walk_warnings"]),
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
    """The text and the parsed document of a JSON file, refusing invalid or deep ones (the
    engine reads it, bounded, and checks it: `rust/folder.rs` `read_json`)."""
    text = _core.read_json(f.path)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidInput(f"{_esc(f.path)}: not valid JSON: {_esc(reason)}", path=f.path) from None
    return text, doc


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
