"""The plan of a folder run as Python holds it, made before anything is written: the
engine's plan of the source's files and of the run's output units (`_core.FolderWork`,
rust/folder/work.rs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _core
from ..reports import Notice, notices
from .common import File

if TYPE_CHECKING:
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
    configs: list[File]  # written last but the indexes (the engine's text, or copied)
    copies: list[File]  # copied before the configs and indexes
    late_copies: list[File]  # copied with them (model_index.json)
    dirs: list[str]
    keep_unmatched: list[str] = field(default_factory=list)  # in no file
    skipped: list[tuple[File, str]] = field(default_factory=list)  # left out, and why
    # The notes that name the files left out, by reason: the engine's.
    left_out: list[Notice] = field(default_factory=list)
    # The prefixes to strip that no file's names start with: one warning each.
    unmatched_prefixes: list[Notice] = field(default_factory=list)
    # What the walk said.
    walk_warnings: list[Notice] = field(default_factory=list)
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
    return of(work)


def of(work: _core.FolderWork) -> Plan:
    """The plan `work` (the engine's), as Python holds it."""
    found = work.plan()
    configs, copies, late_copies, dirs, skipped = found["files"]
    return Plan(
        work=work,
        units=[
            Unit(k, rel, size, data, bytes_in, [File(*r) for r in inputs], whole)
            for k, (rel, size, data, bytes_in, inputs, whole) in enumerate(work.units())
        ],
        configs=[File(*r) for r in configs],
        copies=[File(*r) for r in copies],
        late_copies=[File(*r) for r in late_copies],
        dirs=dirs,
        keep_unmatched=found["keep_unmatched"],
        skipped=[(File(*r), why) for r, why in skipped],
        left_out=notices(found["left_out"]),
        unmatched_prefixes=notices(found["unmatched_prefixes"]),
        walk_warnings=notices(found["walk_warnings"]),
        warnings=[Notice(kind, text, path) for kind, text, path in work.warnings()],
    )


def read_json(f: File) -> str:
    """The text of a JSON file, refusing invalid or deep ones (the engine reads it, bounded,
    and checks it: `rust/folder.rs` `read_json`)."""
    return _core.read_json(f.path)
