"""What `convert`, `inspect` and `verify` return: one report type each, for files and folders.

Reports are frozen dataclasses built field by field from the engine's results (see
`_build`): a field the engine adds appears in the result dict and a test fails until it is
declared here, instead of a constructor call breaking at run time. `to_dict()` gives the
plain JSON-ready data that `--json` prints.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from . import _core
from .errors import render

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._types import (
        Action,
        CompanionInfo,
        DequantizedTensor,
        Destination,
        FileAction,
        FileKind,
        IndexInfo,
        InputFormat,
        KeptTensor,
        LeftOut,
        Numerics,
        NumericsTotal,
        OnOverflow,
        OtherFile,
        QuantFormat,
        QuantizedTensor,
        Reason,
        ShardInfo,
        Target,
    )

__all__ = [
    "ConvertReport",
    "FileReport",
    "InspectReport",
    "Mismatch",
    "Notice",
    "TensorInfo",
    "VerifyReport",
]

_R = TypeVar("_R")


# Each report class's field names, in order (looked up once: reports of 300,000 tensors).
_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS[cls] = tuple(f.name for f in fields(cls))
    return names


def _build(cls: type[_R], data: Mapping[str, Any], **overrides: Any) -> _R:
    """`cls` from the items of `data` that are its fields (and `overrides`); the engine's
    per-tensor numeric rows become a `TensorRows`."""
    names = _FIELDS.get(cls) or _field_names(cls)
    values = {k: v for k, v in data.items() if k in names}
    values.update(overrides)
    n = values.get("numerics")
    if n is not None and isinstance(n["tensors"], _core.TensorNumerics):
        values["numerics"] = {"tensors": TensorRows(n["tensors"]), "total": n["total"]}
    return cls(**values)


class TensorRows(Sequence[Any]):
    """The per-tensor numeric reports of one file (the engine's `_core.TensorNumerics`) as
    a read-only sequence of dicts, each built when read; equal to the list it stands for,
    and pickled as that list."""

    __slots__ = ("_rows",)

    def __init__(self, rows: _core.TensorNumerics) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._rows.row(i) for i in range(*index.indices(len(self._rows)))]
        index = operator.index(index)
        n = len(self._rows)
        if not -n <= index < n:
            raise IndexError("index out of range")
        return self._rows.row(index % n)

    def __iter__(self) -> Iterator[Any]:
        return map(self._rows.row, range(len(self._rows)))

    def tolist(self) -> list[dict[str, Any]]:
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorRows):
            return other._rows is self._rows or self.tolist() == other.tolist()
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} tensor reports>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self.tolist(),))


class Notice(str):
    """A warning in a report: the text in Python's words, plus what it is about.

    `kind` is one of `stcast._core.WARNING_KINDS`, `path` the file it concerns (folders),
    `template` the text with options written neutrally (the CLI renders it with flags).
    """

    kind: str
    template: str
    path: str | None

    def __new__(cls, kind: str, template: str, path: str | None = None) -> Notice:
        text = render(template, "api")
        if path is not None:
            text = f"{path}: {text}"
        self = super().__new__(cls, text)
        self.kind, self.template, self.path = kind, template, path
        return self

    def render(self, style: str) -> str:
        """The text in the API's words or the CLI's (`"cli"`)."""
        text = render(self.template, "cli" if style == "cli" else "api")
        return text if self.path is None else f"{self.path}: {text}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Notice, (self.kind, self.template, self.path))

    def __deepcopy__(self, memo: dict[int, Any]) -> Notice:
        return self


def notices(pairs: list[tuple[str, str]], path: str | None = None) -> list[Notice]:
    """The engine's `(kind, template)` warnings as `Notice`s."""
    return [Notice(kind, template, path) for kind, template in pairs]


@dataclass(frozen=True)
class FileReport:
    """One file of a folder conversion; `path` is relative to both folders, but for a
    PyTorch weight file or index, written under its safetensors name: then `source` is its
    own path in the source folder (`pytorch_model.bin` for `model.safetensors`)."""

    path: str
    kind: FileKind
    action: FileAction
    bytes_in: int
    bytes_out: int
    tensors_converted: int = 0
    tensors_copied: int = 0
    seconds: float = 0.0
    warnings: list[Notice] = field(default_factory=list)
    tensors_kept: int = 0  # of tensors_copied: float tensors kept by keep or on_overflow
    bytes_kept: int = 0
    source: str | None = None  # the source's relative path, when not `path`

    def to_dict(self) -> dict[str, Any]:
        """The entry as plain JSON-ready data."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, repr=False)
class ConvertReport:
    """What `convert` did, for a file or a folder.

    Sizes are whole-file bytes; `seconds` is the wall time. `threads` and `isa` are the
    engine's (None when nothing was converted). `kept` lists the float tensors kept in their
    source dtype; `numerics` what rounding did (README: numeric report). For a folder
    (`folder=True`) the totals count the weight files converted by this run and `files`
    lists every file written, skipped or checked; `shard` is `[i, n]` for a shard run and
    `complete` says whether the destination is now a finished checkpoint (if not,
    `finalize` gives the absolute SRC and DST that `finalize` completes it with).
    """

    src: str
    dst: str
    to: Target
    tensors_converted: int
    tensors_copied: int
    bytes_in: int
    bytes_out: int
    seconds: float
    threads: int | None
    isa: str | None
    warnings: list[Notice]
    tensors_kept: int = 0
    bytes_kept: int = 0
    kept: list[KeptTensor] = field(default_factory=list)
    on_overflow: OnOverflow = "warn"
    numerics: Numerics | None = None
    folder: bool = False
    files: list[FileReport] = field(default_factory=list)
    shard: list[int] | None = None
    complete: bool = True
    # A shard run's: SRC and DST as `finalize` takes them, absolute (None once complete).
    finalize: tuple[str, str] | None = None
    max_shard_size: int | None = None  # re-sharded: each output file at most this size
    # FP8 targets: the weights quantized (what it did to each), and the modules whose 2-D
    # weight stays unquantized (the config's `ignore`).
    tensors_quantized: int = 0
    quantized: list[QuantizedTensor] = field(default_factory=list)
    unquantized: list[str] = field(default_factory=list)
    # A quantized input: the values each dequantized weight came to (README: numeric report),
    # and the tensors only they used (scales, shapes, zero points), dropped.
    dequantized: list[DequantizedTensor] = field(default_factory=list)
    tensors_dropped: int = 0

    def __repr__(self) -> str:
        what = f"{len(self.files)} files, " if self.folder else ""
        return (
            f"ConvertReport({self.src!r} -> {self.dst!r}, to={self.to!r}, {what}"
            f"{self.tensors_converted} converted, {self.tensors_copied} copied, "
            f"{self.bytes_in} -> {self.bytes_out} bytes, {self.seconds:.2f} s, "
            f"{len(self.warnings)} warning{'' if len(self.warnings) == 1 else 's'})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast convert --json`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["files"] = [f.to_dict() for f in self.files]
        d["numerics"] = _plain_numerics(self.numerics)
        if self.max_shard_size is None:
            del d["max_shard_size"]
        if self.finalize is None:
            del d["finalize"]  # only a shard run's
        if not self.to.startswith("fp8"):
            # Only FP8 targets quantize: other reports keep their documented keys.
            for k in ("tensors_quantized", "quantized", "unquantized"):
                del d[k]
        if not self.dequantized and not self.tensors_dropped:
            del d["dequantized"], d["tensors_dropped"]  # only a quantized input's
        return d


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of an input file and what a conversion would do with it."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int
    data_offsets: list[int]
    target_dtype: str
    target_bytes: int
    action: Action
    # Where the tensor would be in the output's data section (after header and padding).
    target_offsets: list[int] = field(default_factory=list)
    # Why: "converted"; kept in its dtype: one of `_core.KEPT_REASONS` (for "keep_pattern",
    # `pattern` says which); copied: "already_target", "bf16_source" (fp16 without
    # from_bf16), "not_converted" (F8/F6/F4/complex), "not_float".
    reason: Reason = "converted"
    pattern: str | None = None
    # FP8 targets: why a float tensor that becomes BF16 is not quantized: "not_weight",
    # "not_2d", "experts", "norm", "embedding", "lm_head", "router", "vision", "dtype", "empty",
    # "nonfinite" (rust/vocab.rs `Fp8Skip`).
    not_quantized: str | None = None
    # With scan=True, for converted (and overflow-kept) tensors.
    numerics: NumericsTotal | None = None
    # A dequantized weight: its format and what it becomes; a dropped tensor: what it was for.
    quantization: QuantFormat | None = None
    companion: CompanionInfo | None = None
    file: str | None = None  # for folders: the file holding it, relative to the folder
    # FP8 targets: a piece of fused MoE experts split per expert, the fused tensor's name.
    split_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The tensor as plain JSON-ready data."""
        d = self.__dict__.copy()  # the fields, in order (fast: reports of 300k tensors)
        if d["file"] is None:
            del d["file"]
        if d["not_quantized"] is None:
            del d["not_quantized"]  # only FP8 targets say why a tensor is not quantized
        for k in ("quantization", "companion", "split_from"):
            if d[k] is None:
                del d[k]  # only a quantized input's weights and companions have them
        return d


@dataclass(frozen=True, repr=False)
class InspectReport:
    """The layout of a checkpoint and the output a conversion to `to` would produce.

    `tensors` are in data-offset order (for a folder: file by file, each with its `file`);
    `metadata` keeps the file's key order (None when it has no `__metadata__`, and for
    folders); `output_bytes` is the projected size of the output. `format` is the input's:
    for a PyTorch checkpoint (`"pytorch"`, `"pytorch-legacy"`), a DCP folder (`"dcp"`;
    `"dcp-safetensors"` for HuggingFaceStorageWriter's shards) or a DeepSpeed ZeRO folder
    (`"deepspeed"`), `key` is the dict converted
    (`""`: the top level), `skipped` its entries that are not tensors (left out),
    `globals` every global its pickle names and `unlisted` those outside the allow-list
    (inert: never imported or called); its
    `header_bytes` are the bytes that are not tensor data, and its `metadata` is the
    `{"format": "pt"}` the output gets. For a folder
    (`folder=True`), `files` holds one report per weight file (paths relative to the
    folder), `other_bytes` the files copied as they are, `other_files` those files by name
    (copied, or rewritten: configs, indexes) and `left_out` the files and folders the output
    leaves out, each with why (training state, PyTorch weights superseded, `exclude`).
    """

    path: str
    to: Target
    header_bytes: int  # the JSON header, without its 8-byte length prefix
    data_bytes: int
    file_bytes: int
    metadata: dict[str, str] | None
    tensors: list[TensorInfo]
    output_bytes: int
    warnings: list[Notice]
    tensors_converted: int = 0
    tensors_copied: int = 0
    tensors_kept: int = 0
    bytes_kept: int = 0
    keep_unmatched: list[str] = field(default_factory=list)  # keep patterns matching nothing
    # A quantized input: its weights dequantized, and the tensors only they used, dropped.
    tensors_dequantized: int = 0
    tensors_dropped: int = 0
    scanned: bool = False  # whether the data was read (`scan=True`): then `numerics` are set
    destination: Destination | None = None
    output_header_sha256: str = ""  # the fingerprint of the header the output would have
    folder: bool = False
    files: list[InspectReport] = field(default_factory=list)
    other_bytes: int = 0
    other_files: list[OtherFile] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    format: InputFormat = "safetensors"
    key: str | None = None  # PyTorch checkpoints: the dict converted ("": the top level)
    skipped: list[str] = field(default_factory=list)  # its entries that are not tensors
    globals: list[str] = field(default_factory=list)  # every global the pickle names
    unlisted: list[str] = field(default_factory=list)  # those outside the allow-list
    # With max_shard_size: the output shards planned (each `path`, `bytes`, `tensors`,
    # `inputs`, ...: see `ShardInfo`) and the indexes written (`IndexInfo`).
    max_shard_size: int | None = None
    shards: list[ShardInfo] = field(default_factory=list)
    indexes: list[IndexInfo] = field(default_factory=list)

    def __repr__(self) -> str:
        what = f"{len(self.files)} files, " if self.folder else ""
        return (
            f"InspectReport({self.path!r}, to={self.to!r}, {what}{len(self.tensors)} tensors, "
            f"{self.tensors_converted} to convert, {self.output_bytes} bytes out)"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast inspect --json`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.folder:
            del d["tensors"]  # each file lists its own
            d["files"] = [f.to_dict() for f in self.files]
            del d["format"], d["key"], d["skipped"], d["globals"], d["unlisted"]
        else:
            del d["files"], d["folder"], d["other_bytes"], d["other_files"], d["left_out"]
            if self.format == "safetensors":
                del d["key"], d["skipped"], d["globals"], d["unlisted"]
            d["tensors"] = [t.to_dict() for t in self.tensors]
        if self.max_shard_size is None:
            del d["max_shard_size"], d["shards"], d["indexes"]
        if not self.tensors_dequantized and not self.tensors_dropped:
            del d["tensors_dequantized"], d["tensors_dropped"]  # only a quantized input's
        return d


@dataclass(frozen=True)
class Mismatch:
    """The first difference `verify` found: in the data (tensor, element and bits) or the header.

    For a header difference only `message` (and `tensor`, where one is concerned) is set.
    Bits are hex strings of the element's width, e.g. "0x3F800001" and "0x3F80".
    """

    message: Notice
    tensor: str | None
    index: int | None  # element index in the tensor (a byte index for sub-byte dtypes)
    source_bits: str | None
    source_value: float | None  # for float source dtypes
    expected_bits: str | None
    found_bits: str | None
    file: str | None = None  # for folders: the file that differs (relative path)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; a non-finite `source_value` becomes "nan", "inf" or "-inf"."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        v = d["source_value"]
        if v is not None and not math.isfinite(v):
            d["source_value"] = repr(v)
        return d


@dataclass(frozen=True, repr=False)
class VerifyReport:
    """What `verify` found: `ok` is true when DST is exactly the conversion of SRC.

    `mismatch` is the first difference (None when `ok`); `bytes_compared` counts the data
    bytes of both files compared; `seconds` is the engine's wall time. The report is truthy
    exactly when `ok`.
    """

    src: str
    dst: str
    ok: bool
    loose: bool
    tensors_converted: int
    tensors_identical: int
    bytes_compared: int
    seconds: float
    threads: int
    isa: str
    mismatch: Mismatch | None
    # The target of the converted tensors ("bf16" or "fp16"; None if none or mixed), and
    # the numeric report `convert` gave for this pair (None after a mismatch).
    to: Target | None = None
    numerics: Numerics | None = None
    folder: bool = False
    files: int = 1  # the files compared (for a folder: every file, paired by path)
    # Verified, DST converts no tensor of SRC: convert writes such a file only as one of a
    # folder whose other files it converts.
    copy: bool = False

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        what = f"{self.files} files, " if self.folder else ""
        outcome = "ok" if self.ok else f"mismatch: {self.mismatch.message if self.mismatch else ''}"
        return (
            f"VerifyReport({self.src!r} -> {self.dst!r}, {what}{self.tensors_converted} "
            f"converted, {self.tensors_identical} identical, {outcome})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast verify --json`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["mismatch"] = None if self.mismatch is None else self.mismatch.to_dict()
        d["numerics"] = _plain_numerics(self.numerics)
        return d


class FileRows(Sequence[Any]):
    """The per-tensor numeric reports of several files as one read-only sequence, each row
    with its `file` (built when read, like a file's own rows)."""

    def __init__(self, parts: list[tuple[str, Sequence[Any]]]) -> None:
        self._parts = parts
        self._ends: list[int] = []
        n = 0
        for _, rows in parts:
            n += len(rows)
            self._ends.append(n)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _row(self, i: int) -> dict[str, Any]:
        import bisect

        k = bisect.bisect_right(self._ends, i)
        rel, rows = self._parts[k]
        return {"file": rel, **rows[i - (self._ends[k - 1] if k else 0)]}

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(len(self)))]
        if not isinstance(index, int):
            raise TypeError(f"indices must be integers or slices, not {type(index).__name__}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError("index out of range")
        return self._row(index % n)

    def tolist(self) -> list[dict[str, Any]]:
        return [{"file": rel, **row} for rel, rows in self._parts for row in rows]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} tensor reports of {len(self._parts)} files>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self.tolist(),))


def _numerics(n: Mapping[str, Any]) -> Numerics:
    """The engine's numeric report of one file (its rows `_core.TensorNumerics`)."""
    return {"tensors": TensorRows(n["tensors"]), "total": n["total"]}  # type: ignore[typeddict-item]


def folder_report(data: Mapping[str, Any]) -> ConvertReport:
    """A folder run's report from the engine's (`folder::finish::FolderReport`): its
    `numerics` each converted unit's (file, numerics), merged here (None: none converted)."""
    files = [
        _build(FileReport, f, warnings=[Notice(*w) for w in f["warnings"]]) for f in data["files"]
    ]
    warnings = [Notice(*w) for w in data["warnings"]]
    parts: list[tuple[str, Numerics | None]] = [
        (rel, None if n is None else _numerics(n)) for rel, n in data["numerics"] or []
    ]
    numerics = merged_numerics(parts)
    return _build(ConvertReport, data, files=files, warnings=warnings, numerics=numerics)


def merged_numerics(parts: list[tuple[str, Numerics | None]]) -> Numerics | None:
    """The numeric reports of a folder's files as one: the rows of each with its `file`,
    and the totals (counts added, largest errors the largest). None if a file has none."""
    if not parts or any(n is None for _, n in parts):
        return None
    total: dict[str, Any] = {}
    for _, n in parts:
        assert n is not None
        for k, v in n["total"].items():
            total[k] = max(total.get(k, 0), v) if k.startswith("max_") else total.get(k, 0) + v
    rows = FileRows([(rel, n["tensors"]) for rel, n in parts if n is not None])
    merged: Numerics = {"tensors": rows, "total": total}  # type: ignore[typeddict-item]
    return merged


def _plain_numerics(n: Numerics | None) -> dict[str, Any] | None:
    """A numeric report with its per-tensor rows as a list (JSON-ready)."""
    if n is None:
        return None
    rows = n["tensors"]
    tolist = getattr(rows, "tolist", None)
    return {"tensors": tolist() if tolist is not None else list(rows), "total": n["total"]}
