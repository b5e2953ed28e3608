"""The units of work of a folder run, behind one protocol.

A run writes one output per work item: a weight file converted (`FileItem`), or, when
re-sharding, an output shard cut from a group of input files (`ShardItem`). Each item
knows what it reads and writes, how to convert itself, the manifest entry that lets
`resume` and `finalize` trust its output, and its line in the report. What depends on the
kind of the whole run rather than on one item (the checks before anything is written,
the options the manifest records, the indexes, adopting files without a manifest) is a
`Work`: `FileWork` or `ShardWork`, made by `of(plan)`. The folder's driver
(`folder/__init__.py`) handles one list of items and one `Work`, whatever their kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, Union

from .. import _core, _engine
from ..errors import DestinationExists, Refused, StcastError
from ..reports import ConvertReport, FileReport, Notice, _build, notices
from .common import (
    MAX_JSON_BYTES,
    File,
    check_cancel,
    check_index,
    failpoint,
    header_sha256,
    out_path,
)
from .common import read_bounded as _read_bounded
from .fp8 import index_text, is_fp8, written_only
from .manifest import find_entry as _find_file_entry
from .reshard import (
    GroupPlan,
    Reshard,
    Unit,
    adoptable,
    checked_indexes,
    entry,
    leftovers,
    output_stems,
    reshard_stems,
)
from .reshard import find_entry as _find_unit_entry
from .walk import Plan
from .write import rival

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._types import FileAction, OnOverflow, Target
    from ..reports import InspectReport
    from .manifest import Manifest
    from .write import Run

_esc = _core.escape


class Item(Protocol):
    """One unit of work: one output file of the run."""

    @property
    def rel(self) -> str:
        """The output's relative path (also what `--shard` assigns)."""

    @property
    def size(self) -> int:
        """What `--shard` balances (see `walk.assign_shards`)."""

    @property
    def data_bytes(self) -> int:
        """Tensor bytes it reads (its share of the progress)."""

    @property
    def output_bytes(self) -> int:
        """Bytes of its output (what the space check counts)."""

    def find_entry(
        self, entries: list[dict[str, Any]], options: dict[str, Any], out: str
    ) -> dict[str, Any] | None:
        """The manifest entry that shows `out` is this item written with `options`."""

    def manifest_entry(self, record: Manifest, out: str) -> dict[str, Any]:
        """What `resume` and `finalize` need to trust `out` without reading it."""

    def convert(
        self,
        run: Run,
        out: str,
        replaces: tuple[int, int] | str | None,
        step: Callable[[int, int], None] | None,
        sealed: Callable[[int, int, int, str | None], None] | None = None,
    ) -> ConvertReport:
        """Write the output at `out` (see `Run.replace_for` for `replaces`); `sealed` is
        called with the hidden output's (dev, ino, size, header hash) before it is
        published."""

    def report(self, status: FileAction, bytes_out: int) -> FileReport:
        """Its line in a folder report, for an output not converted by this run."""

    def converted(self, r: ConvertReport) -> FileReport:
        """Its line in a folder report, once converted by this run."""

    def missing(self, out: str) -> tuple[str, str]:
        """What `finalize` names (a path) and says when the output is not there as
        written."""


@dataclass(frozen=True)
class FileItem:
    """A weight file, converted into one output file."""

    file: File
    info: InspectReport  # its plan
    source_header_sha256: str
    # FP8 targets: its weights that hold NaN or inf (read while planning: see walk.Plan).
    unquantized: list[str] | None = None

    @property
    def rel(self) -> str:
        return self.file.rel

    @property
    def size(self) -> int:
        return self.file.size

    @property
    def data_bytes(self) -> int:
        return self.info.data_bytes

    @property
    def output_bytes(self) -> int:
        return self.info.output_bytes

    def find_entry(
        self, entries: list[dict[str, Any]], options: dict[str, Any], out: str
    ) -> dict[str, Any] | None:
        return _find_file_entry(entries, self.file, options, out)

    def manifest_entry(self, record: Manifest, out: str) -> dict[str, Any]:
        return record.weights_entry(self.file, self.source_header_sha256)

    def convert(
        self,
        run: Run,
        out: str,
        replaces: tuple[int, int] | str | None,
        step: Callable[[int, int], None] | None,
        sealed: Callable[[int, int, int, str | None], None] | None = None,
    ) -> ConvertReport:
        # Unmatched keep patterns were judged over the whole folder (in walk.plan).
        return _engine.convert_file(
            self.file.path,
            out,
            to=run.to,
            threads=run.given.threads,
            force=replaces is not None,
            replaces=None if replaces in (None, "any") else replaces,
            # A folder partly converted already is fine: its files pass as they are.
            allow_copy=True,
            progress=step,
            cancel=run.cancel,
            sealed=sealed,
            # As the manifest records them (the folder's checks ran with these).
            **run.given.precision,
            keep_unmatched="ignore",
            # walk.plan judged the whole folder's quantization (its config included).
            allow_quantized=True,
            # What each weight becomes was decided by reading them in walk.plan.
            unquantized=self.unquantized,
            tuning=run.given.tuning,
            warn_path=self.file.source_rel,
            # The user's call: convert, convert_folder, convert_items, here.
            stacklevel=6,
        )

    def report(self, status: FileAction, bytes_out: int) -> FileReport:
        f = self.file
        return FileReport(f.rel, "weights", status, f.size, bytes_out, source=f.src_rel)

    def converted(self, r: ConvertReport) -> FileReport:
        return FileReport(
            self.file.rel,
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
            source=self.file.src_rel,
        )

    def missing(self, out: str) -> tuple[str, str]:
        # A file is named by its source.
        return self.file.path, "not converted"


@dataclass(frozen=True)
class ShardItem:
    """An output shard of a re-sharding run, cut from its group's input files."""

    unit: Unit
    group: GroupPlan
    keep_names: list[str]  # the group's tensors kept to avoid overflow
    hashes: dict[str, str]  # input rel -> the hash of its header
    # FP8 targets: the group's weights that hold NaN or inf (the cut was planned with them).
    unquantized: list[str] | None = None

    @property
    def rel(self) -> str:
        return self.unit.rel

    @property
    def size(self) -> int:
        return self.unit.size

    @property
    def data_bytes(self) -> int:
        return self.unit.data_bytes

    @property
    def output_bytes(self) -> int:
        return self.unit.size

    def find_entry(
        self, entries: list[dict[str, Any]], options: dict[str, Any], out: str
    ) -> dict[str, Any] | None:
        return _find_unit_entry(entries, self.unit, options, out)

    def manifest_entry(self, record: Manifest, out: str) -> dict[str, Any]:
        shards = None if record.shard is None else record.shard[1]
        return entry(self.unit, record.options, shards, self.hashes, out)

    def convert(
        self,
        run: Run,
        out: str,
        replaces: tuple[int, int] | str | None,
        step: Callable[[int, int], None] | None,
        sealed: Callable[[int, int, int, str | None], None] | None = None,
    ) -> ConvertReport:
        u, g = self.unit, self.group
        # Kept-for-overflow tensors are planned already: the shards need no scan of their own.
        on_overflow = run.given.on_overflow
        precision = {
            **run.given.precision,
            "on_overflow": "warn" if on_overflow == "keep" else on_overflow,
        }

        def warn(kind: str, template: str, rel: str = u.rel) -> None:
            # A shard of integer or BF16 tensors only is no surprise here.
            if kind != "nothing_to_convert":
                _engine.issue(kind, template, rel, stacklevel=6)

        with _engine.gc_paused():
            result = _core.convert_shard(
                g.core,
                u.names,
                g.indexed,
                out,
                to=run.to,
                **precision,
                keep_names=self.keep_names,
                unquantized=self.unquantized,
                # The re-sharding plan judged the group's quantization (reshard.plan).
                allow_quantized=True,
                threads=run.given.threads,
                force=replaces is not None,
                replaces=replaces if isinstance(replaces, tuple) else None,
                progress=step,
                cancel=run.cancel,
                warn=warn,
                sealed=sealed,
                tuning=run.given.tuning,
            )
        warnings = [w for w in result["warnings"] if w[0] != "nothing_to_convert"]
        return _build(
            ConvertReport, result, warnings=notices(warnings, u.rel), bytes_in=u.input_bytes
        )

    def report(self, status: FileAction, bytes_out: int) -> FileReport:
        return FileReport(self.unit.rel, "weights", status, self.unit.input_bytes, bytes_out)

    def converted(self, r: ConvertReport) -> FileReport:
        return FileReport(
            self.unit.rel,
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
        )

    def missing(self, out: str) -> tuple[str, str]:
        # An output shard is named by itself.
        return out, "not written"


def convert_items(run: Run, todo: Sequence[Item]) -> list[ConvertReport]:
    """Write the items one after another (all cores on each), recording each when done."""
    reports = []
    for w in todo:
        check_cancel(run.cancel)
        # Not into a folder another run took over since (it would replace its files).
        run.record.check_still_ours()
        out = out_path(run.dst, w.rel)
        # The engine replaces only as this run may: see Run.replace_for.
        replaces = run.replace_for(w.rel)

        def step(done: int, total: int, rel: str = w.rel) -> None:
            run.meter.step(rel, done, total)

        def sealed(dev: int, ino: int, size: int, header: str | None, w: Item = w) -> None:
            # Before the output has its name, the manifest claims it: a run killed once
            # it is published, before it is recorded, still proves it wrote it. The
            # claim names the header written (the engine read it back), not a plan's.
            run.record.claim(w.rel, (dev, ino, size), header or "")
            run.record.save_claims(run.cancel)
            failpoint("folder-sealed", run.cancel)

        run.meter.step(w.rel, 0, w.data_bytes)
        try:
            r = w.convert(run, out, replaces, step if run.meter.is_on() else None, sealed)
        except (DestinationExists, Refused) as e:
            # A rival's file where this run replaces none, or not the file found.
            rival(run, e)
            raise
        run.meter.finish(w.rel, w.data_bytes)
        # The output has its name; the manifest does not say so yet.
        failpoint("folder-published", run.cancel)
        st = os.lstat(out)
        run.published(w.rel, "weights", (st.st_dev, st.st_ino, st.st_size))
        run.record.files[w.rel].update(w.manifest_entry(run.record, out))
        run.record.save(run.cancel)
        failpoint("folder-file", run.cancel)
        reports.append(r)
    return reports


class FileWork:
    """A run that converts each weight file into one output file."""

    noun = "weight files"

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.items: list[Item] = [
            FileItem(w, plan.info[w.rel], plan.header_sha256[w.rel], plan.unquantized.get(w.rel))
            for w in plan.weights
        ]

    def check(self, src: str, to: Target, on_overflow: OnOverflow) -> list[Notice]:
        """Refuse a run that would write a copy of the folder; its notices."""
        plan = self.plan
        # PyTorch weight files change format: worth writing even with every dtype kept.
        changes_format = any(i.format != "safetensors" for i in plan.info.values())
        if (
            not any(i.tensors_converted for i in plan.info.values())
            and on_overflow != "keep"
            and not changes_format
        ):
            if to == "keep":
                why = (
                    "the folder's weights are safetensors files already and {to=keep} keeps "
                    "every dtype"
                )
            else:
                why = (
                    f"no tensor of any file becomes {_core.TARGET_DTYPES[to]} (each float "
                    "tensor already is, or is kept)"
                )
            raise Refused(
                f"{_esc(src)}: nothing to convert: {why}; the output would be a copy of the folder",
                path=src,
            )
        return []

    def options(self, name: str | None) -> dict[str, Any]:
        """The options of this kind of run that change the output (for the manifest)."""
        return {}

    def leftover(self, dst: str, written: set[str]) -> list[str]:
        """What the destination holds that a loader would take for this run's output: files
        named as its weights or indexes that the run does not write (`written`)."""
        return leftovers(dst, output_stems(self.plan.outputs()), self.plan.weights, written)

    def adoptable(self, dst: str, rel: str, kind: str, options: dict[str, Any]) -> bool:
        """Under resume, without a manifest: is the regular file at `rel` (weights or an
        index) exactly what this plan writes?"""
        plan, path = self.plan, os.path.join(dst, rel)
        if kind == "weights":
            info = plan.info[rel]
            source = next(w for w in plan.weights if w.rel == rel)
            st = os.lstat(path)
            if not (
                st.st_size == info.output_bytes and header_sha256(path) == info.output_header_sha256
            ):
                return False
            precision = {k: v for k, v in options.items() if k != "to"}
            report = _engine.verify_file(
                source.path, path, to=options["to"], numerics=False, **precision
            )
            return report.ok
        # An index: the source's with the total size of the planned shards' tensors (FP8:
        # what the shards there, checked before it, make it).
        f, text, weight_map = next(i for i in plan.indexes if i[0].rel == rel)
        try:
            if is_fp8(options["to"]):
                want = index_text(dst, rel, text, weight_map)
            elif plan.dequantize:
                want = written_only(dst, rel, text, weight_map)
            else:
                total = sum(plan.out_data[shard] for shard in set(weight_map.values()))
                want = _core.index_text(text, total=total)
        except (OSError, StcastError):
            return False
        return _read_bounded(path, MAX_JSON_BYTES) == want

    def index_bytes(self) -> int:
        """The space the indexes take (an index may grow by its total size's digits)."""
        return sum(f.size + 64 for f, _, _ in self.plan.indexes)

    def checked_indexes(
        self, dst: str, to: Target
    ) -> list[tuple[str, bytes, int | None, str | None]]:
        """The indexes to write once the weights are, each checked against the shards as
        written: its path, content, source size (None: new) and source path (if renamed).
        An FP8 target's also list the scales the shards hold."""

        def content(rel: str, text: str, weight_map: dict[str, str]) -> bytes:
            if is_fp8(to):
                return index_text(dst, rel, text, weight_map)
            if self.plan.dequantize:
                return written_only(dst, rel, text, weight_map)
            return _core.index_text(text, total=check_index(dst, rel, weight_map))

        return [
            (f.rel, content(f.rel, text, weight_map), f.size, f.src_rel)
            for f, text, weight_map in self.plan.indexes
        ]

    def finish(self, report: ConvertReport) -> ConvertReport:
        """The run's report, with what this kind of run adds."""
        return report


class ShardWork:
    """A re-sharding run: each output shard is cut from its group's input files."""

    noun = "output shards"

    def __init__(self, plan: Plan, reshard: Reshard) -> None:
        self.plan = plan
        self.reshard = reshard
        self.items: list[Item] = []
        for g in reshard.groups:
            kept = [n for w in g.group.inputs for n in reshard.keep_names.get(w.rel, [])]
            nonfinite = reshard.group_unquantized(g.group)
            self.items += [ShardItem(u, g, kept, plan.header_sha256, nonfinite) for u in g.units]

    def check(self, src: str, to: Target, on_overflow: OnOverflow) -> list[Notice]:
        # A re-sharding changes the files whatever the dtypes: never "nothing to do".
        return list(self.reshard.warnings)

    def options(self, name: str | None) -> dict[str, Any]:
        options: dict[str, Any] = {"max_shard_size": self.reshard.max_size}
        if name is not None:
            # Another name is another output, as another size is: under resume, the files
            # a manifest proves this source's that the plan no longer writes are stale.
            options["name"] = name
        return options

    def leftover(self, dst: str, written: set[str]) -> list[str]:
        # Shards of another cut (or under the input's own stem) and their index too.
        stems = reshard_stems(self.reshard, self.plan.outputs())
        return leftovers(dst, stems, self.plan.weights, written)

    def adoptable(self, dst: str, rel: str, kind: str, options: dict[str, Any]) -> bool:
        return adoptable(dst, rel, kind, self.reshard, options)

    def index_bytes(self) -> int:
        return sum(len(content) for _, content, _ in self.reshard.indexes())

    def checked_indexes(
        self, dst: str, to: Target
    ) -> list[tuple[str, bytes, int | None, str | None]]:
        return [(rel, text, None, None) for rel, text in checked_indexes(dst, self.reshard)]

    def finish(self, report: ConvertReport) -> ConvertReport:
        return replace(report, max_shard_size=self.reshard.max_size)


Work = Union[FileWork, ShardWork]


def of(plan: Plan) -> Work:
    """The work of a run of `plan`: its files, or its output shards."""
    return FileWork(plan) if plan.reshard is None else ShardWork(plan, plan.reshard)
