"""Re-sharding (`max_shard_size`): a checkpoint's tensors written as output shards of at most
a given size on disk, with new indexes, in the same streaming pass as the conversion.

A group is the set of weight files one index names; every other weight file is a group of
its own. The engine plans each group from the headers (`_core.ShardGroup.plan`), given
what was read first where a tensor's fate depends on its values (kept from overflow; FP8
weights holding NaN or inf, which stay BF16): tensors in input order, assigned greedily,
each shard an ordinary stcast output. Output
names follow the group's stem (`model` -> `model-00001-of-00003.safetensors` and
`model.safetensors.index.json`, or `model.safetensors` when one shard holds everything),
or the stem `name` gives for a checkpoint of one group (`ema.safetensors` with
`name="model"` -> `model-00001-of-00003.safetensors`: what `from_pretrained` looks for).
The old shards and the old index are never written.

A plain folder run is the same plan without a cut (`whole_files`): each weight file a group
of its own, whose one output unit is the file converted whole under its safetensors name.
Each output unit is a work item (`work.Item`): `resume` skips it once its manifest entry
shows it done (`find_entry`: the inputs it reads unchanged, the header recorded),
`shard=(i, n)` runs split the units, and `finalize` writes the indexes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import _core, _engine
from ..errors import Cancelled, InvalidInput, Refused, UsageError
from ..reports import Notice
from .common import (
    INDEX_SUFFIX,
    WEIGHTS_SUFFIX,
    File,
    check_index,
    header_sha256,
)
from .fp8 import SIDE_CONFIG_NAME, is_fp8
from .fp8 import nonfinite as fp8_nonfinite
from .walk import (
    CONFIG_NAME,
    UNMATCHED_PREFIX,
    Plan,
    check_fp8_config,
    common_prefix_notices,
    index_owners,
    read_json,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._engine import CancelFlag
    from .._types import Target

_esc = _core.escape
_WEIGHTS = WEIGHTS_SUFFIX
_INDEX = INDEX_SUFFIX


@dataclass(frozen=True)
class Group:
    """Input files that make one output: an index's shards, or a lone weight file."""

    dir: str  # the relative folder ("" at the top)
    stem: str  # of the index, or of the file
    inputs: list[File]  # input order
    index: File | None  # the index that names them
    renamed_from: str | None = None  # its own stem, when `name` gave `stem`


@dataclass(frozen=True)
class Unit:
    """One output file of the weights: an output shard of a re-sharding run, or a weight file
    converted whole (`whole`) in a plain folder run."""

    rel: str  # the output's relative path
    group: int  # in `Reshard.groups`
    number: int  # 0-based, in its group
    names: list[str]  # its tensors, input order (a whole file: all of them, read when converted)
    size: int  # the output file's bytes (also what `--shard` balances)
    data_bytes: int  # tensor bytes read from the input
    # Input bytes it stands for in reports: its tensor bytes, the first shard of a group also
    # the rest of the group's input files (headers, pickles), so that the shards of a group
    # add up to its input files' size.
    input_bytes: int
    target_bytes: int  # tensor bytes written
    # Of the planned output header; a whole file's plan does not know what a scan keeps
    # (`on_overflow="keep"`), so its manifest entry proves it by the header recorded.
    header_sha256: str
    inputs: list[File]  # the input files it reads
    tensors_converted: int
    tensors_kept: int
    # FP8 targets: the scales it writes beside its quantized weights (in its index too).
    scales: list[str] = field(default_factory=list)
    # FP8 input: the scales it reads to dequantize and does not write.
    dropped: list[str] = field(default_factory=list)
    # A plain folder run's unit: its one input converted whole, named after it (reports
    # name the input, a `finalize` that misses it names the input too).
    whole: bool = False


@dataclass
class GroupPlan:
    group: Group
    # _core.ShardGroup; None for a whole file, opened when converted (a folder of thousands
    # of files does not hold them all open).
    core: Any
    indexed: bool
    units: list[Unit]
    index: tuple[str, bytes, dict[str, str]] | None  # rel, content, weight_map (rel paths)
    # How a whole file is read when opened (`strip_prefix`).
    source: dict[str, Any] = field(default_factory=dict)
    # FP8 targets: the model config fused experts are split by (`walk.Plan.model_config`).
    model_config: str | None = None

    def opened(self, keep: Sequence[str] = ()) -> Any:
        """The group's files, opened (`_core.ShardGroup`); `keep`: the run's patterns."""
        if self.core is not None:
            return self.core
        # (`model_config` is an FP8 target's: opened as one, the group's fused experts are
        # split, but those a keep pattern names; the strategy is the conversion's.)
        paths = [w.path for w in self.group.inputs]
        experts = {}
        if self.model_config is not None:
            experts = {"to": "fp8", "keep": list(keep), **self.experts()}
        return _core.ShardGroup(paths, **self.source, **experts)

    def experts(self) -> dict[str, Any]:
        """The engine's options that split the group's fused experts (`model_config`)."""
        return {} if self.model_config is None else {"packed_config": self.model_config}


@dataclass
class Reshard:
    """A re-sharding plan: every group's output shards and indexes; or, without `max_size`,
    a plain folder run's: each weight file whole (`whole_files`), the source's indexes
    edited (`walk.Plan.indexes`), none written here."""

    max_size: int | None
    groups: list[GroupPlan]
    keep_names: dict[str, list[str]]  # input rel -> tensors kept to avoid overflow
    warnings: list[Notice] = field(default_factory=list)
    keep_unmatched: list[str] = field(default_factory=list)  # keep patterns matching nothing
    # FP8 targets: input rel -> its weights that hold NaN or inf, which stay BF16 (None:
    # another target). Read before the cut, which depends on them.
    unquantized: dict[str, list[str]] | None = None

    def group_unquantized(self, group: Group) -> list[str] | None:
        """A group's weights that hold NaN or inf (None: not an FP8 target)."""
        if self.unquantized is None:
            return None
        return [n for w in group.inputs for n in self.unquantized.get(w.rel, [])]

    def units(self) -> list[Unit]:
        return [u for g in self.groups for u in g.units]

    def unit(self, rel: str) -> Unit:
        return next(u for u in self.units() if u.rel == rel)

    def indexes(self) -> list[tuple[str, bytes, dict[str, str]]]:
        return [g.index for g in self.groups if g.index is not None]


def groups_of(weights: list[File], indexes: list[tuple[File, str, dict[str, str]]]) -> list[Group]:
    """The groups of a folder's weight files and (parsed) indexes: one per index, and one
    per weight file no index names; sorted by path. A file two indexes name is refused."""
    by_rel = {w.rel: w for w in weights}
    owner = index_owners(indexes)
    groups = []
    for f, _, weight_map in indexes:
        rels = sorted(set(weight_map.values()))
        if rels:
            name = os.path.basename(f.rel)
            stem = name[: -len(_INDEX)]
            groups.append(Group(os.path.dirname(f.rel), stem, [by_rel[r] for r in rels], f))
    for w in weights:
        if w.rel not in owner:
            stem = os.path.basename(w.rel)[: -len(_WEIGHTS)]
            groups.append(Group(os.path.dirname(w.rel), stem, [w], None))
    return sorted(groups, key=lambda g: g.inputs[0].rel)


def named(groups: list[Group], name: str | None) -> list[Group]:
    """The groups with the output stem `name` (the `name` option), when given: it names the
    output of one group only, so a folder of several is a usage error."""
    if name is None:
        return groups
    if len(groups) > 1:
        listed = ", ".join(
            f"`{_esc(g.index.rel if g.index is not None else g.inputs[0].rel)}`" for g in groups[:3]
        )
        more = f" and {len(groups) - 3} more" if len(groups) > 3 else ""
        raise UsageError(
            f"{{name}} names the output of one checkpoint, but SRC holds {len(groups)} "
            f"({listed}{more}); leave it out (each keeps its own stem), or convert them "
            "one at a time",
            option="name",
        )
    return [replace(g, stem=name, renamed_from=g.stem) for g in groups]


def plan(
    walked: Plan,
    max_size: int,
    to: Target,
    precision: dict[str, Any],
    keep_names: dict[str, list[str]] | None = None,
    cancel: CancelFlag | None = None,
    *,
    source: dict[str, Any] | None = None,
    name: str | None = None,
    allow_quantized: bool = True,
    unquantized: dict[str, list[str]] | None = None,
) -> Reshard:
    """Plan every group of `walked` into output shards of at most `max_size` bytes.
    `allow_quantized=False` has the engine refuse a quantized group (a lone file's only
    check: a folder's files were judged by `walk.plan`).

    What a tensor becomes decides the sizes, so it is known before the shards are cut:
    with `on_overflow="keep"`, the tensors that would overflow (a read of the float
    tensors, as `convert` makes), unless `keep_names` gives them; with an FP8 target, the
    weights that hold NaN or inf and stay BF16 (a read of the weights), unless
    `unquantized` or `walked` (whose `walk.plan` read them) gives them.
    `source` (`key`, `strip_prefix`) says how a single PyTorch checkpoint is read; `name`
    is the output stem of a checkpoint of one group (see `named`).
    """
    source = source or {}
    groups = named(groups_of(walked.weights, walked.indexes), name)
    experts: dict[str, Any] = {}
    if walked.model_config is not None:
        experts["packed_config"] = walked.model_config
    keep_names, unquantized = _read_first(
        walked, to, precision, keep_names, unquantized, cancel, {**source, **experts}
    )
    reshard = Reshard(max_size, [], keep_names, [], list(precision.get("keep", [])), unquantized)
    # What the shards record of convert's options, their indexes record too.
    record = _core.record_text(to=to, **precision, **source, name=name, **experts)
    taken: dict[str, str] = {}  # output rel -> what writes it
    prefix_notices: list[list[Notice]] = []
    for f, _ in walked.configs:
        taken[f.rel] = "a config"
    for f in [*walked.copies, *walked.late_copies]:
        taken[f.rel] = "a copied file"
    for k, g in enumerate(groups):
        if cancel is not None and cancel.is_set():
            raise Cancelled("conversion cancelled")
        keep = list(precision.get("keep", []))  # (a fused tensor one names is not split)
        core = _core.ShardGroup([w.path for w in g.inputs], to=to, keep=keep, **source, **experts)
        names = [n for w in g.inputs for n in keep_names.get(w.rel, [])]
        planned = core.plan(
            max_size,
            to=to,
            **precision,
            keep_names=names,
            unquantized=reshard.group_unquantized(g),
            # For the record of convert's options in each shard (`record`), as written.
            **source,
            name=name,
            allow_quantized=allow_quantized,
            **experts,
        )
        first = g.inputs[0].source_rel
        warned = [Notice(kind, text, first) for kind, text in planned["warnings"]]
        reshard.warnings += [n for n in warned if n.kind != UNMATCHED_PREFIX]
        # A prefix to strip is judged over every group: said once, below.
        prefix_notices.append(warned)
        unmatched = planned["keep_unmatched"]
        reshard.keep_unmatched = [p for p in reshard.keep_unmatched if p in unmatched]
        shards = planned["shards"]
        overhead = max(0, sum(w.size for w in g.inputs) - sum(s["data_bytes"] for s in shards))
        units = []
        for i, s in enumerate(shards):
            file_name = _core.shard_file_name(g.stem, i + 1, len(shards))
            units.append(
                Unit(
                    rel=_join(g.dir, file_name),
                    group=k,
                    number=i,
                    names=s["tensors"],
                    size=s["file_bytes"],
                    data_bytes=s["data_bytes"],
                    input_bytes=s["data_bytes"] + (overhead if i == 0 else 0),
                    target_bytes=s["target_bytes"],
                    header_sha256=s["header_sha256"],
                    inputs=[g.inputs[j] for j in s["inputs"]],
                    tensors_converted=s["tensors_converted"],
                    tensors_kept=s["tensors_kept"],
                    scales=s["scales"],
                    dropped=s["dropped"],
                )
            )
        index = _index(g, units, record) if planned["indexed"] else None
        outputs = [u.rel for u in units] + ([index[0]] if index is not None else [])
        what = f"the output of {g.index.source_rel if g.index is not None else first}"
        for rel in outputs:
            if rel in taken:
                raise Refused(
                    f"{_esc(rel)}: both {_esc(taken[rel])} and {_esc(what)} would be written "
                    "there; re-sharding names outputs after their input's stem, and these "
                    "two share one (convert them into separate folders)",
                    path=rel,
                )
            taken[rel] = what
        reshard.groups.append(
            GroupPlan(g, core, planned["indexed"], units, index, model_config=walked.model_config)
        )
    reshard.warnings += common_prefix_notices(prefix_notices)
    return reshard


def whole_files(walked: Plan) -> Reshard:
    """A plain folder run's plan: each weight file a group of its own, converted whole under
    its safetensors name (`walk.Plan.info` has its plan), with no index of its own."""
    # (`walk.plan` read an FP8 target's weights; another target's have none to give.)
    reshard = Reshard(None, [], {}, unquantized=walked.unquantized or None)
    # Each file read as the plan read it.
    source = {"strip_prefix": walked.strip_prefix} if walked.strip_prefix else {}
    for k, w in enumerate(walked.weights):
        info = walked.info[w.rel]
        unit = Unit(
            rel=w.rel,
            group=k,
            number=0,
            names=[],
            size=info.output_bytes,
            data_bytes=info.data_bytes,
            input_bytes=w.size,
            target_bytes=walked.out_data[w.rel],
            header_sha256=info.output_header_sha256,
            inputs=[w],
            tensors_converted=info.tensors_converted,
            tensors_kept=info.tensors_kept,
            whole=True,
        )
        stem = os.path.basename(w.rel)[: -len(_WEIGHTS)]
        group = Group(os.path.dirname(w.rel), stem, [w], None)
        reshard.groups.append(
            GroupPlan(
                group, None, False, [unit], None, source=source, model_config=walked.model_config
            )
        )
    return reshard


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _index(g: Group, units: list[Unit], record: str | None) -> tuple[str, bytes, dict[str, str]]:
    """A group's index: its path, its bytes and its weight map (relative paths); `record`
    (convert's options) in its metadata."""
    names: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    for u in units:
        base = os.path.basename(u.rel)
        dropped = set(u.dropped)
        written = [n for n in u.names if n not in dropped] + u.scales
        names.update(dict.fromkeys(written, base))
        weight_map.update(dict.fromkeys(written, u.rel))
    try:
        g.stem.encode()
    except UnicodeEncodeError:
        first = g.inputs[0]
        raise Refused(
            f"{_esc(first.source_rel)}: its name is not UTF-8, so an index (JSON) cannot "
            "name the shards cut from it; rename it, or name the output with {name}",
            path=first.path,
        ) from None
    src_text = None if g.index is None else read_json(g.index)[0]
    total = sum(u.target_bytes for u in units)
    text = _core.index_text(
        src_text, total=total, weight_map=[*names.items()], sort_keys=True, record=record
    )
    return _join(g.dir, _core.index_file_name(g.stem)), text, weight_map


def _read_first(
    walked: Plan,
    to: Target,
    precision: dict[str, Any],
    keep_names: dict[str, list[str]] | None,
    unquantized: dict[str, list[str]] | None,
    cancel: CancelFlag | None,
    source: dict[str, Any],
) -> tuple[dict[str, list[str]], dict[str, list[str]] | None]:
    """Per input file, the tensors `on_overflow="keep"` keeps and, for an FP8 target, the
    weights that hold NaN or inf (None: another target): those given, else read (one
    inspection of each file whose are not known, as `convert` reads it)."""
    keep = precision.get("on_overflow") == "keep" and keep_names is None
    found = {} if keep_names is None else dict(keep_names)
    nonfinite = None
    if is_fp8(to):
        nonfinite = dict(walked.unquantized if unquantized is None else unquantized)
    for w in walked.weights:
        if not keep and (nonfinite is None or w.rel in nonfinite):
            continue
        if cancel is not None and cancel.is_set():
            raise Cancelled("conversion cancelled")
        report = _engine.inspect_file(
            w.path,
            to=to,
            **{**precision, "on_overflow": "keep" if keep else "warn"},
            keep_unmatched="ignore",
            allow_quantized=True,
            **source,
        )
        if keep:
            found[w.rel] = [t.name for t in report.tensors if t.reason == "keep_overflow"]
        if nonfinite is not None:
            nonfinite[w.rel] = fp8_nonfinite(report.tensors)
    return found, nonfinite


# --- a single file as the source ------------------------------------------------------------


def source_options(key: str | None, strip_prefix: Sequence[str]) -> dict[str, Any]:
    """How a single PyTorch checkpoint re-sharded is read (`key`, `strip_prefix`), without
    the defaults: keywords for the engine, and options of the manifest."""
    options: dict[str, Any] = {}
    if key is not None:
        options["key"] = key
    if strip_prefix:
        options["strip_prefix"] = list(strip_prefix)
    return options


def file_plan(src: str, to: Target, precision: dict[str, Any], config: str | None = None) -> Plan:
    """The plan of a folder holding only the file `src`: its name kept, but a PyTorch
    checkpoint's made a safetensors name (`pytorch_model.bin` -> `model.safetensors`, as in
    a folder; `ema.pt` -> `ema.safetensors`). The model's `config` (a path) goes beside it
    as `config.json`, its dtype set; without one, an FP8 target's quantization_config goes
    to `quantization_config.json` (`write.publish` adds it to either)."""
    # Its name kept, a PyTorch checkpoint's made a safetensors name (the engine's
    # `run::place::single_file`).
    w = File(*_core.walk_folder(src, single=True)[0][0])
    configs: list[tuple[File, bytes | None]] = []
    if config is not None:
        f = File(CONFIG_NAME, config, 0, 0)
        text, doc = read_json(f)
        check_fp8_config(f, doc, to)
        content = _core.config_text(text, to)
        configs.append((f, text.encode("utf-8") if content is None else content))
    elif is_fp8(to):
        # Its only input is the checkpoint: the file names the path of no other.
        configs.append((File(SIDE_CONFIG_NAME, w.path, 0, 0), b"{}"))
    # No per-file plan (`info`): the re-sharding plan decides everything, and says which
    # keep patterns match nothing.
    return Plan(
        weights=[w],
        indexes=[],
        configs=configs,
        copies=[],
        late_copies=[],
        dirs=[],
        info={},
        out_data={},
        header_sha256={w.rel: _core.source_fingerprint(w.path)},
        # (FP8 targets: the model config splits fused experts, as a folder's.)
        model_config=config if is_fp8(to) else None,
    )


# --- the runs: entries, resume, indexes (the conversion: work.Item) ------------------------


def entry(
    unit: Unit,
    options: dict[str, Any],
    shards: int | None,
    hashes: dict[str, str],
    out: str,
) -> dict[str, Any]:
    """What `resume` and `finalize` need to trust an output unit without reading it: the
    inputs it reads as they were (`_inputs`), the options, and its header."""
    return {
        **_inputs(unit, [hashes[w.rel] for w in unit.inputs]),
        "options": options,
        "version": _core.__version__,
        "shards": shards,
        "output_header_sha256": header_sha256(out),
    }


def _inputs(unit: Unit, hashes: list[str]) -> dict[str, Any]:
    """How an entry names the inputs a unit reads (each one's size, mtime and header hash):
    its one input flat (`source_*`), several as a list (with their paths)."""
    if len(unit.inputs) == 1:
        (w,) = unit.inputs
        return {
            "source_size": w.size,
            "source_mtime_ns": w.mtime_ns,
            "source_header_sha256": hashes[0],
        }
    return {"inputs": [[w.rel, w.size, w.mtime_ns, h] for w, h in zip(unit.inputs, hashes)]}


def find_entry(
    entries: list[dict[str, Any]],
    unit: Unit,
    options: dict[str, Any],
    out: str,
) -> dict[str, Any] | None:
    """The manifest entry that shows `out` is `unit` written with `options`, if one does:
    its inputs unchanged, the header recorded, and (where the plan knows it exactly: not a
    whole file's) the planned header. `entries` record the file `out` is now (the engine
    keeps only those: `run::manifest` `recording`)."""
    if not entries:
        return None
    hashes = [_core.source_fingerprint(w.path) for w in unit.inputs]
    inputs = _inputs(unit, hashes)
    # An entry may list one input too (as stcast wrote an output shard's before plain runs
    # were one-file groups): trusted the same.
    listed = [[w.rel, w.size, w.mtime_ns, h] for w, h in zip(unit.inputs, hashes)]
    output_hash = None
    for e in entries:
        recorded = e.get("output_header_sha256")
        if "inputs" in e:
            same_inputs = e["inputs"] == listed
        else:
            same_inputs = all(e.get(k) == v for k, v in inputs.items())
        if (
            e.get("version") != _core.__version__
            or e.get("options") != options
            or not same_inputs
            or (not unit.whole and recorded != unit.header_sha256)
        ):
            continue
        if output_hash is None:
            output_hash = header_sha256(out)
        if output_hash and output_hash == recorded:
            return e
    return None


def adoptable(dst: str, rel: str, reshard: Reshard, options: dict[str, Any]) -> bool:
    """Under resume, without a manifest: is the regular file of weights at `rel` exactly
    what this plan writes? Its planned header (the engine's survey saw its planned size),
    then every value verified against the inputs."""
    path = os.path.join(dst, rel)
    unit = reshard.unit(rel)
    if header_sha256(path) != unit.header_sha256:
        return False
    g = reshard.groups[unit.group]
    precision = {k: v for k, v in options.items() if k not in ("to", "max_shard_size", "name")}
    report = _core.verify_shard(
        g.opened(precision.get("keep", [])),
        path,
        g.indexed,
        to=options["to"],
        numerics=False,
        **precision,
    )
    return report["mismatch"] is None


def checked_indexes(dst: str, reshard: Reshard) -> list[tuple[str, bytes]]:
    """The indexes to write, each checked against the shards as written (every tensor where
    it says, every shard tensor listed, the planned total size)."""
    out = []
    for rel, content, weight_map in reshard.indexes():
        total = check_index(dst, rel, weight_map)
        planned = json.loads(content)["metadata"]["total_size"]
        if total != planned:
            path = os.path.join(dst, rel)
            raise InvalidInput(
                f"{_esc(path)}: the shards written hold {total} tensor bytes, the plan "
                f"{planned} (was the source changed during the run?)",
                path=path,
            )
        out.append((rel, content))
    return out


def shard_infos(reshard: Reshard) -> list[dict[str, Any]]:
    """The shard plan as plain data (`inspect`): each output shard, and each index."""
    out = []
    for g in reshard.groups:
        index = None if g.index is None else g.index[0]
        for u in g.units:
            out.append(
                {
                    "path": u.rel,
                    "bytes": u.size,
                    "tensors": len(u.names),
                    "tensors_converted": u.tensors_converted,
                    "tensors_kept": u.tensors_kept,
                    "data_bytes": u.data_bytes,
                    "target_bytes": u.target_bytes,
                    "inputs": [w.src_rel or w.rel for w in u.inputs],
                    "index": index,
                }
            )
    return out


def index_infos(reshard: Reshard) -> list[dict[str, Any]]:
    """Each index the plan writes: its path, total size and shard count."""
    return [
        {
            "path": g.index[0],
            "bytes": len(g.index[1]),
            "total_size": sum(u.target_bytes for u in g.units),
            "shards": len(g.units),
        }
        for g in reshard.groups
        if g.index is not None
    ]


__all__ = ["Group", "Reshard", "Unit", "groups_of", "plan"]
