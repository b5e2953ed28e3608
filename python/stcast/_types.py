"""The types of stcast's options and report parts, for type checkers and readers.

The `Literal` lists spell the names the engine exports (`stcast._core.TARGETS`, ...); a test
checks that they are equal, so a name added in the engine fails the tests until it is added
here. The `TypedDict`s describe the plain data inside reports (and their `to_dict()`), and
the keywords of `convert`, `inspect` and `verify` (`ConvertOptions`, ...: their names and
types are the engine's table of options, `_core.OPTIONS`, as a test checks both ways; their
defaults and meaning are there and in the functions' docstrings).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Literal, TypedDict, Union

# Names from the engine (see rust/vocab.rs).
Target = Literal["bf16", "fp16", "keep", "fp8", "fp8-block"]
TargetAlias = Literal[
    "bfloat16", "f16", "float16", "half", "fp8-dynamic", "fp8_dynamic", "fp8_block"
]
Reason = Literal[
    "converted",
    "quantized",
    "dequantized",
    "dropped",
    "keep_pattern",
    "keep_min_size",
    "keep_overflow",
    "already_target",
    "bf16_source",
    "not_converted",
    "not_float",
]
OnOverflow = Literal["warn", "error", "keep"]
ErrorKind = Literal[
    "invalid_input",
    "input_changed",
    "refused",
    "destination_exists",
    "no_space",
    "usage",
    "io",
    "cancelled",
]
WarningKind = Literal[
    "unmatched_pattern",
    "bf16_copied",
    "quantized",
    "nothing_to_convert",
    "overflow",
    "underflow",
    "stale_temp",
    "skipped_entries",
    "unlisted_globals",
    "skipped_files",
    "format_added",
    "metadata_differs",
    "unindexed_shards",
    "not_quantized",
    "block_shape",
    "no_model_config",
    "unmatched_prefix",
    "transposed_experts",
]
ReadAdvice = Literal["normal", "sequential", "willneed"]
Action = Literal["convert", "copy", "quantize", "dequantize", "drop"]
FileKind = Literal["weights", "index", "config", "copy"]
# The formats `inspect` reports (`InspectReport.format`).
InputFormat = Literal[
    "safetensors", "pytorch", "pytorch-legacy", "dcp", "dcp-safetensors", "deepspeed"
]
FileAction = Literal["converted", "skipped", "checked", "rewritten", "written", "copied"]


Strategy = Literal["channel", "block"]


class NumericsTotal(TypedDict):
    """What rounding did to a set of values (README: numeric report)."""

    elements: int
    overflow: int
    underflow_to_zero: int
    subnormal: int
    nan_in: int
    inf_in: int
    max_abs_error: float
    max_rel_error: float


class _InFile(TypedDict, total=False):
    file: str  # for folders: the file, relative to the folder


class QuantizedTensor(_InFile):
    """One weight an FP8 target quantized, and what that did to its values."""

    name: str
    strategy: Strategy
    scale_dtype: str
    elements: int
    groups: int
    zero_groups: int  # all-zero groups (their scale is the dtype's eps)
    flushed: int  # non-zero values that became zero
    max_abs_error: float
    rel_error: float  # the error's norm over the source's


class QuantFormat(TypedDict):
    """A dequantized weight's format (`TensorInfo.quantization`): the checkpoint's name for
    it (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`, `pack-quantized`, `int-quantized`,
    `float-quantized`, gpt-oss's `mxfp4`), its codes (`E2M1`, `INT4`, `INT8`, `E4M3`), its
    scale's dtype (`E8M0` for MX scales) and grouping, and all that in words with what it
    becomes (`text`: "NVFP4 (E2M1 ×E4M3 per 16 ×F32) → BF16")."""

    format: str
    codes: str
    scale_dtype: str
    strategy: str  # "tensor", "channel", "group", "block"
    group_size: int | None
    symmetric: bool
    text: str


class CompanionInfo(TypedDict):
    """What a tensor a dequantization drops was for (`TensorInfo.companion`): its `role`
    ("scale", "global_scale", "zero_point", "shape", "input_scale") for the output weight
    `weight`."""

    role: str
    weight: str


class DequantizedTensor(_InFile):
    """One dequantized weight's values, as written (`ConvertReport.dequantized`): its output
    name, its format (`QuantFormat.text`), the elements, the smallest and largest finite
    value (None when none is finite), and how many are NaN and ±inf."""

    name: str
    format: str
    elements: int
    min: float | None
    max: float | None
    nan: int
    inf: int


class TensorNumerics(NumericsTotal, _InFile):
    """`NumericsTotal` of one tensor, named."""

    name: str


class Numerics(TypedDict):
    """Per converted tensor (output order), and the total. `tensors` is a read-only
    sequence whose dicts are built when read (a list in `to_dict()`)."""

    tensors: Sequence[TensorNumerics]
    total: NumericsTotal


class KeptTensor(_InFile):
    """A float tensor kept in its source dtype, and why."""

    name: str
    dtype: str
    bytes: int
    reason: Reason
    pattern: str | None


class Destination(TypedDict):
    """Where a dry run's output would go and whether it fits."""

    path: str
    folder: str
    free_bytes: int
    need_bytes: int
    fits: bool


class ShardInfo(TypedDict):
    """One output shard of a re-sharding plan (`inspect` with `max_shard_size`)."""

    path: str  # relative to the destination folder
    bytes: int  # the file, header included
    tensors: int
    tensors_converted: int
    tensors_kept: int
    data_bytes: int  # its tensors' bytes in the input
    target_bytes: int  # and in the output
    inputs: list[str]  # the input files it reads, relative to the source
    index: str | None  # the index that names it (None: a single file)


class IndexInfo(TypedDict):
    """An index a re-sharding writes."""

    path: str
    bytes: int
    total_size: int  # `metadata.total_size`: the bytes of every tensor of its shards
    shards: int


class OtherFile(TypedDict):
    """A file of a folder's output besides its weights (`inspect`): copied as it is, or
    rewritten (a config's dtype, an index)."""

    path: str  # relative to the source folder
    bytes: int
    action: Literal["copied", "rewritten"]


class LeftOut(TypedDict):
    """A file (or folder: its path ends with `/`) of a source folder its output leaves out."""

    path: str  # relative to the source folder
    bytes: int  # a folder's: its files'
    why: Literal["trainer", "superseded", "excluded"]


class Tuning(TypedDict, total=False):
    """Knobs that change speed and memory, never the bytes written (for benchmarks and
    tests): input MiB per window, the kernel family, how input is faulted in and read
    ahead, output ranges in flight, and MiB converted between two progress calls (and
    checks for Ctrl-C and `cancel`)."""

    window_mib: int
    isa: str
    populate: bool
    advise: ReadAdvice
    write_behind: int
    step_mib: int


StrPath = Union[str, "os.PathLike[str]"]  # (`|` at run time needs Python 3.10)


class _Options(TypedDict, total=False):
    """The options `convert`, `inspect` and `verify` share."""

    keep: Iterable[str]
    from_bf16: bool
    threads: int | None
    force: bool
    report: StrPath | None
    key: str | None
    strip_prefix: Iterable[str]
    include: Iterable[str]
    exclude: Iterable[str]
    name: str | None
    tuning: Tuning | None


class ConvertOptions(_Options, total=False):
    """The options of `convert` (see its docstring)."""

    to: Target | TargetAlias
    keep_min_size: int
    on_overflow: OnOverflow
    no_record: bool
    strict: bool
    resume: bool
    shard: tuple[int, int] | None
    allow_quantized: bool
    follow_links: bool
    max_shard_size: int | str | None
    config: StrPath | None


class InspectOptions(ConvertOptions, total=False):
    """The options of `inspect`: those of `convert`, and `scan`."""

    scan: bool


class VerifyOptions(_Options, total=False):
    """The options of `verify` (see its docstring)."""

    to: Target | TargetAlias | None
    keep_min_size: int | None  # None: DST's record's
    on_overflow: OnOverflow | None
    loose: bool
