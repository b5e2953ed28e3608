"""The units of work of a folder run, one code path for plain runs and re-shardings.

A run writes one output per work item (`Item`): an output unit of its plan
(`reshard.Unit`), cut from a group of input files when re-sharding, or a weight file
converted whole in a plain run (`reshard.whole_files`). Each item is converted and checked
through the one engine entry of a group (`_core.convert_shard`, `_core.verify_shard`) and
proven done by one manifest entry (`reshard.entry`, `reshard.find_entry`). What depends
on the kind of the whole run rather than on one item is the `Work`: the checks before
anything is written, the options the manifest records, and the indexes (a plain run edits
the source's in their own text, a re-sharding writes new ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import _core, _engine
from ..errors import InvalidInput, Refused, StcastError
from ..reports import ConvertReport, FileReport, Notice, _build, notices
from .fp8 import is_fp8
from .reshard import (
    GroupPlan,
    Reshard,
    Unit,
    adoptable,
    checked_indexes,
    entry,
    find_entry,
    whole_files,
)
from .walk import UNMATCHED_PREFIX, Plan

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._engine import CancelFlag
    from .._options import Options
    from .._types import FileAction, OnOverflow, Target

_esc = _core.escape


@dataclass(frozen=True)
class Item:
    """One output file of the weights: an output unit with its group and what was read of
    the group's data before (see `reshard.plan`)."""

    unit: Unit
    group: GroupPlan
    # The group's tensors kept to avoid overflow; None: not read before (a whole file's
    # conversion scans for them itself).
    keep_names: list[str] | None
    hashes: dict[str, str]  # input rel -> the hash of its header
    # FP8 targets: the group's weights that hold NaN or inf (the plan was made with them).
    unquantized: list[str] | None = None

    @property
    def rel(self) -> str:
        """The output's relative path (also what `--shard` assigns)."""
        return self.unit.rel

    @property
    def size(self) -> int:
        """What `--shard` balances (see `walk.assign_shards`): the output's bytes."""
        return self.unit.size

    @property
    def data_bytes(self) -> int:
        """Tensor bytes it reads (its share of the progress)."""
        return self.unit.data_bytes

    @property
    def output_bytes(self) -> int:
        """Bytes of its output (what the space check counts)."""
        return self.unit.size

    def find_entry(
        self, entries: list[dict[str, Any]], options: dict[str, Any], out: str
    ) -> dict[str, Any] | None:
        """The manifest entry that shows `out` is this item written with `options`."""
        return find_entry(entries, self.unit, options, out)

    def manifest_entry(
        self, options: dict[str, Any], shard: tuple[int, int] | None, out: str
    ) -> dict[str, Any]:
        """What `resume` and `finalize` need to trust `out` (written by a run with `options`,
        as shard `shard`) without reading it."""
        return entry(self.unit, options, None if shard is None else shard[1], self.hashes, out)

    def convert(
        self,
        given: Options,
        to: Target,
        run: _core.FolderRun,
        step: Callable[[int, int], None] | None,
        cancel: CancelFlag | None,
    ) -> ConvertReport:
        """Write the output as the file `rel` of the folder run `run`: it replaces only what
        the run may, and the run's manifest claims it before it has a name."""
        u, g = self.unit, self.group
        precision = dict(given.precision)
        # Warnings name the input of a whole file, the output shard otherwise.
        path = u.inputs[0].source_rel if u.whole else u.rel

        def said(kind: str) -> bool:
            # An output shard of integer or BF16 tensors only is no surprise; a prefix to
            # strip was judged over the whole input by the plan, and so were a re-sharded
            # group's transposed experts (its plan named them all).
            whole = kind not in ("nothing_to_convert", "transposed_experts")
            return (u.whole or whole) and kind != UNMATCHED_PREFIX

        def warn(kind: str, template: str) -> None:
            if said(kind):
                _engine.issue(kind, template, path)

        with _engine.gc_paused():
            try:
                core = g.opened(precision.get("keep", []))
            except (InvalidInput, Refused):
                # Its files are not what the plan read: as a failure converting them, the
                # run is rolled back (`publish::Writer::failed_input`).
                run.failed_input()
                raise
            result = _core.convert_shard(
                core,
                core.names() if u.whole else u.names,
                g.indexed,
                run,
                self.rel,
                to=to,
                **precision,
                # Kept-for-overflow tensors planned already (None: the engine reads for them).
                keep_names=self.keep_names,
                # For the record of convert's options in each output (`key`, `name` too).
                **given.source,
                name=given.name,
                unquantized=self.unquantized,
                # The plan judged the quantization of the folder or group (walk.plan,
                # reshard.plan); unmatched keep patterns too.
                allow_quantized=True,
                threads=given.threads,
                progress=step,
                cancel=cancel,
                warn=warn,
                tuning=given.tuning,
                **g.experts(),
            )
        warnings = [w for w in result["warnings"] if said(w[0])]
        return _build(
            ConvertReport, result, warnings=notices(warnings, path), bytes_in=u.input_bytes
        )

    def report(self, status: FileAction, bytes_out: int) -> FileReport:
        """Its line in a folder report, for an output not converted by this run."""
        return FileReport(
            self.rel, "weights", status, self.unit.input_bytes, bytes_out, source=self._source
        )

    def converted(self, r: ConvertReport) -> FileReport:
        """Its line in a folder report, once converted by this run."""
        return FileReport(
            self.rel,
            "weights",
            "converted",
            self.unit.input_bytes,
            r.bytes_out,
            r.tensors_converted,
            r.tensors_copied,
            r.seconds,
            list(r.warnings),
            r.tensors_kept,
            r.bytes_kept,
            source=self._source,
        )

    @property
    def _source(self) -> str | None:
        """The input's own path, when a whole file is renamed (a PyTorch file)."""
        return self.unit.inputs[0].src_rel if self.unit.whole else None

    def missing(self, out: str) -> tuple[str, str]:
        """What `finalize` names (a path) and says when the output is not there as
        written: a whole file by its source, an output shard by itself."""
        if self.unit.whole:
            return self.unit.inputs[0].path, "not converted"
        return out, "not written"


class Work:
    """A folder run's items and what depends on the kind of run: a plain one (`reshard`
    without `max_size`: each weight file whole, the source's indexes edited) or a
    re-sharding."""

    def __init__(self, plan: Plan, reshard: Reshard | None, record: str | None = None) -> None:
        self.plan = plan
        # What the weights record of convert's options (`_core.record_text`): a plain run's
        # indexes record it too (a re-sharding's planned theirs).
        self.record = record
        self.reshard = reshard if reshard is not None else whole_files(plan)
        self.resharding = reshard is not None
        self.noun = "output shards" if self.resharding else "weight files"
        self.items: list[Item] = []
        for g in self.reshard.groups:
            kept = None
            if self.resharding:
                kept = [n for w in g.group.inputs for n in self.reshard.keep_names.get(w.rel, [])]
            nonfinite = self.reshard.group_unquantized(g.group)
            self.items += [Item(u, g, kept, plan.header_sha256, nonfinite) for u in g.units]

    def outputs(self) -> dict[str, str]:
        """Every file a whole run writes (relative path -> kind)."""
        plan = self.plan
        out = {item.rel: "weights" for item in self.items}
        out.update({f.rel: "copy" for f in [*plan.copies, *plan.late_copies]})
        out.update({f.rel: "config" for f, _ in plan.configs})
        out.update({rel: "index" for rel, _, _ in self.index_maps()})
        return out

    def index_maps(self) -> list[tuple[str, bytes | str, dict[str, str]]]:
        """The indexes a whole run writes: path, source text or content, weight map."""
        if self.resharding:
            return list(self.reshard.indexes())
        return [(f.rel, text, weight_map) for f, text, weight_map in self.plan.indexes]

    def check(self, src: str, on_overflow: OnOverflow) -> list[Notice]:
        """Refuse a run that would write a copy of the folder; its notices."""
        if self.resharding:
            # A re-sharding changes the files whatever the dtypes: never "nothing to do".
            return list(self.reshard.warnings)
        # (No file converts a tensor or changes format: the engine's answer.)
        why = self.plan.nothing_to_convert
        if why is not None and on_overflow != "keep":
            raise Refused(f"{_esc(src)}: {why}", path=src)
        return []

    def options(self, name: str | None) -> dict[str, Any]:
        """The options of this kind of run that change the output (for the manifest)."""
        if not self.resharding:
            return {}
        options: dict[str, Any] = {"max_shard_size": self.reshard.max_size}
        if name is not None:
            # Another name is another output, as another size is: under resume, the files
            # a manifest proves this source's that the plan no longer writes are stale.
            options["name"] = name
        return options

    def planned(self) -> list[tuple[str, str, int]]:
        """Every file a whole run writes: relative path, kind (as `outputs`) and its bytes
        (an edited index may grow by its total size's digits)."""
        plan, sizes = self.plan, {item.rel: item.output_bytes for item in self.items}
        sizes.update({f.rel: f.size for f in [*plan.copies, *plan.late_copies]})
        sizes.update({f.rel: f.size if c is None else len(c) for f, c in plan.configs})
        if self.resharding:
            sizes.update({rel: len(content) for rel, content, _ in self.reshard.indexes()})
        else:
            sizes.update({f.rel: f.size + 64 for f, _, _ in plan.indexes})
        return [(rel, kind, sizes[rel]) for rel, kind in self.outputs().items()]

    def renamed(self) -> list[tuple[str, str]]:
        """Each group's own stem where `name` renamed its output: (folder, stem)."""
        groups = [g.group for g in self.reshard.groups]
        return [(g.dir, g.renamed_from) for g in groups if g.renamed_from is not None]

    def expected(self, dst: str, rel: str, kind: str, options: dict[str, Any]) -> bytes | bool:
        """Under resume, without a manifest: what the regular file at `rel` (weights or an
        index) must hold to be exactly what this plan writes: the weights' own answer, an
        index's bytes (False: none can be told)."""
        if kind == "weights":
            return adoptable(dst, rel, self.reshard, options)
        if self.resharding:
            return next(c for r, c, _ in self.reshard.indexes() if r == rel)
        # The source's index with the total size of the planned shards' tensors (FP8: what
        # the shards there, checked before it, make it).
        plan = self.plan
        _, text, weight_map = next(i for i in plan.indexes if i[0].rel == rel)
        try:
            if is_fp8(options["to"]) or plan.dequantize:
                return _core.written_index(
                    dst,
                    rel,
                    text,
                    [*weight_map.items()],
                    is_fp8(options["to"]),
                    plan.dequantize,
                    self.record,
                )
            total = sum(plan.out_data[shard] for shard in set(weight_map.values()))
            return _core.index_text(text, total=total, record=self.record)
        except (OSError, StcastError):
            return False

    def checked_indexes(
        self, dst: str, to: Target
    ) -> list[tuple[str, bytes, int | None, str | None]]:
        """The indexes to write once the weights are, each checked against the shards as
        written: its path, content, source size (None: new) and source path (if renamed).
        An FP8 target's also list the scales the shards hold."""
        if self.resharding:
            return [(rel, text, None, None) for rel, text in checked_indexes(dst, self.reshard)]

        def content(rel: str, text: str, weight_map: dict[str, str]) -> bytes:
            items = [*weight_map.items()]
            return _core.written_index(
                dst, rel, text, items, is_fp8(to), self.plan.dequantize, self.record
            )

        return [
            (f.rel, content(f.rel, text, weight_map), f.size, f.src_rel)
            for f, text, weight_map in self.plan.indexes
        ]

    def finish(self, report: ConvertReport) -> ConvertReport:
        """The run's report, with what this kind of run adds."""
        if not self.resharding:
            return report
        return replace(report, max_shard_size=self.reshard.max_size)
