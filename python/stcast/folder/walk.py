"""The plan of a folder run as Python holds it, made before anything is written: the
engine's plan of the source's files and of the run's output units (`_core.FolderWork`,
rust/folder/work.rs), and `--shard`'s split of the units."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import _core
from ..reports import Notice, notices
from .common import File

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._engine import CancelFlag
    from .._types import Target

# The engine's warning kind for a prefix to strip that no tensor name starts with.
UNMATCHED_PREFIX = "unmatched_prefix"


@dataclass(frozen=True)
class Unit:
    """One output file of the weights (the engine's `folder::work::Unit`): an output shard of
    a re-sharding, or a weight file converted whole (`whole`) in a plain run."""

    index: int  # in `Plan.units`, as the engine numbers it
    rel: str  # the output's relative path (also what `--shard` assigns)
    size: int  # the output's bytes (what `--shard` balances and the space check counts)
    data_bytes: int  # tensor bytes it reads (its share of the progress)
    # Input bytes it stands for in reports (a group's shards add up to its input files).
    input_bytes: int
    inputs: list[File]  # the input files it reads
    whole: bool


@dataclass
class Plan:
    """What a run will do, from a source that passed every check: its files, and the
    engine's plan of its output units (`work`)."""

    work: _core.FolderWork
    units: list[Unit]
    weights: list[File]
    # file, text (shard names already renamed), weight_map as destination rel paths
    indexes: list[tuple[File, str, dict[str, str]]]
    configs: list[tuple[File, bytes | None]]  # file, new content (None: copy unchanged)
    copies: list[File]  # copied before the configs and indexes
    late_copies: list[File]  # copied with them (model_index.json)
    dirs: list[str]
    keep_unmatched: list[str] = field(default_factory=list)  # in no file
    # Why the run is refused when no file converts a tensor or changes format (its output a
    # copy of the folder), or None: the engine's.
    nothing_to_convert: str | None = None
    skipped: list[tuple[File, str]] = field(default_factory=list)  # left out, and why
    # The notes that name the files left out, by reason: the engine's.
    left_out: list[Notice] = field(default_factory=list)
    # An FP8 checkpoint dequantized: its indexes lose the scales the shards no longer hold.
    dequantize: bool = False
    # The prefixes to strip that no file's names start with: one warning each.
    unmatched_prefixes: list[Notice] = field(default_factory=list)
    # What the walk said.
    walk_warnings: list[Notice] = field(default_factory=list)
    # FP8 targets: the top folder's model config, by whose sizes fused MoE experts are
    # split (rust/experts.rs). None otherwise.
    model_config: str | None = None
    # What a re-sharding's plan said, each naming the file it is about.
    warnings: list[Notice] = field(default_factory=list)

    @property
    def resharding(self) -> bool:
        return self.work.max_shard_size is not None


def plan(
    src: str,
    to: Target,
    check_quantized: bool,
    options: dict[str, Any] | None = None,
    cancel: CancelFlag | None = None,
    **cut: Any,
) -> Plan:
    """Walk `src` and plan every file and output unit, refusing what cannot be converted
    safely: the engine's answer (`rust/folder/work.rs`), stepped one weight file and one
    group at a time (`cancel` checked between them).

    With `check_quantized`, a quantized checkpoint is refused (by the engine, as a single
    file is: `quantization_config` is the config that makes every file quantized). `options`
    are the engine's (`follow_links`, `strip_prefix`, the precision options, ...); `cut`
    re-shards (`max_shard_size`, `single`: `src` is one checkpoint, `shard_links`,
    `keep_names`, `unquantized`).
    """
    work = _core.FolderWork(
        src, check_quantized=check_quantized, cancel=cancel, to=to, **(options or {}), **cut
    )
    found = work.plan()
    weights, indexes, configs, copies, late_copies, dirs, skipped, model_config = found["files"]
    return Plan(
        work=work,
        units=[
            Unit(k, rel, size, data, bytes_in, [File(*r) for r in inputs], whole)
            for k, (rel, size, data, bytes_in, inputs, whole) in enumerate(work.units())
        ],
        weights=[File(*r) for r in weights],
        indexes=[(File(*r), text, dict(weight_map)) for r, text, weight_map in indexes],
        configs=[(File(*r), None if c is None else c.encode()) for r, c in configs],
        copies=[File(*r) for r in copies],
        late_copies=[File(*r) for r in late_copies],
        dirs=dirs,
        keep_unmatched=found["keep_unmatched"],
        nothing_to_convert=found["nothing_to_convert"],
        skipped=[(File(*r), why) for r, why in skipped],
        left_out=notices(found["left_out"]),
        dequantize=found["dequantize"],
        unmatched_prefixes=notices(found["unmatched_prefixes"]),
        walk_warnings=notices(found["walk_warnings"]),
        model_config=model_config,
        warnings=[Notice(kind, text, path) for kind, text, path in work.warnings()],
    )


def read_json(f: File) -> str:
    """The text of a JSON file, refusing invalid or deep ones (the engine reads it, bounded,
    and checks it: `rust/folder.rs` `read_json`)."""
    return _core.read_json(f.path)


class _Sized(Protocol):
    """What `assign_shards` balances: an output unit, or a file."""

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
