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
    """The options `convert`, `inspect` and `verify` share, as `convert` reads them.

    threads: worker threads; default (None or 0): all CPUs.
    force: replace an existing `dst` (a folder: convert everything again); verify: an
        existing `report`.
    keep: fnmatch patterns (`*`, `?`, `[seq]`, `[!seq]`; case-sensitive) on tensor names:
        a float tensor that one matches keeps its dtype and bytes, e.g. `["*norm*"]`.
        A pattern that matches no tensor (in the file, or anywhere in the folder) is
        probably a typo: a `StcastWarning`, or with `strict=True` a `Refused` error
        raised before anything is written.
    from_bf16: with `to="fp16"`, convert BF16 tensors to F16 too (exact widening, then
        the F32 rule); otherwise they are copied and the output mixes BF16 and F16.
    report: write the numeric report (per converted tensor: overflow, underflow,
        largest errors; see docs/reference.md) to this JSON file. It is complete before
        the output is published and published right after it; its path is checked
        before any work (not the input, not the output, its folder exists; an existing
        file needs `force`). Verify writes a verified pair's report there.
    key: PyTorch checkpoints: the dict of tensors to convert, dotted for deeper levels
        (`"ema"`, `"state.model"`). Without it: the top level if it holds tensors, else
        the only dict that does; with several, `Refused` lists them with their counts.
    strip_prefix: PyTorch checkpoints: prefixes dropped from tensor names, e.g.
        `["module.", "_orig_mod."]` (DDP, torch.compile): each in turn, from what the one
        before left.
    include: folders of files: fnmatch globs on paths in SRC of what the output leaves
        out as training state (optimizer, scheduler and RNG states, DeepSpeed's
        `global_stepN/`, ...) to copy anyway (a folder whole).
    exclude: folders of files: fnmatch globs on paths in SRC (or a folder above them) of
        files the output would copy or rewrite to leave out (never weights or indexes);
        they win over `include`. Both are recorded with the output for `verify`.
    name: re-sharding: the stem of the output of a checkpoint of one group (a lone
        file, or a folder whose shards one index names): `<name>-00001-of-0000N
        .safetensors` and `<name>.safetensors.index.json`, or `<name>.safetensors`.
        `name="model"` gives the names transformers' `from_pretrained` looks for (a
        re-sharded `ema.safetensors` is otherwise `ema-...` and
        `ema.safetensors.index.json`). Not empty, `.` or `..`, without `/` or NUL; a
        folder of several checkpoints is a `UsageError`. Verify: DST's files of that
        stem are SRC's re-sharding.
    tuning: knobs for benchmarks (window size, kernels, read advice, write-behind
        depth); they change speed and memory, never the bytes written.
    """

    threads: int | None
    force: bool
    keep: Iterable[str]
    from_bf16: bool
    report: StrPath | None
    key: str | None
    strip_prefix: Iterable[str]
    include: Iterable[str]
    exclude: Iterable[str]
    name: str | None
    tuning: Tuning | None


class ConvertOptions(_Options, total=False):
    """The options of `convert`, besides those all three share.

    to: the target dtype, "bf16" or "fp16" (or "bfloat16", "float16", "half"); or
        "keep": every tensor keeps its dtype, only the format changes (PyTorch input);
        or "fp8" / "fp8-block": 2-D weights become FP8 E4M3 with a scale per output
        channel / per 128x128 block (compressed-tensors, for vLLM), the rest bf16.
    keep_min_size: float tensors with fewer elements than this keep their dtype too
        (norms and biases: e.g. 4096).
    on_overflow: finite values that become ±inf (|x| >= 65520 for fp16): "warn" (count
        them per tensor; a `StcastWarning` names the worst tensors), "error" (raise
        `Refused` and leave nothing behind) or "keep" (first read the float tensors
        once more to find their largest |x|, and keep those that would overflow in their
        source dtype).
    strict: make a `keep` pattern that matches nothing an error.
    resume: folders: continue an interrupted run, skipping the files its manifest shows
        done with the same options.
    shard: folders: `(i, n)` converts only the i-th of n subsets of the weight files
        (1-based, the same split on every machine); `finalize(src, dst)` completes the
        folder once all n ran.
    allow_quantized: convert a quantized checkpoint anyway (its F32 scales
        become bf16 too).
    follow_links: folders (DCP and ZeRO folders too): follow symlinks that lead outside
        the source folder (by default only links within it, and into a Hugging Face
        cache's blobs/, are followed; any other is refused, naming it).
    max_shard_size: re-shard: write the tensors as shards of at most this many bytes
        on disk, header included (an int, or a string with a unit: "5GB" = 5*10^9,
        "4.5GiB" = 4.5*2^30; KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024,
        any case), greedily in input order; a tensor larger than that gets a shard of
        its own. `src` may then be a file too; `dst` is a folder (default
        `<stem>-bf16` beside a file). Each index's shards (or a lone file) become
        `<stem>-00001-of-0000N.safetensors` and `<stem>.safetensors.index.json`, or
        one `<stem>.safetensors` when all fit in one; `resume`, `shard` and
        `finalize` work per output shard.
    no_record: record nothing in the output's `__metadata__` (by default the options
        are recorded there, under "stcast", for `verify`).
    config: a lone checkpoint (a file, a DCP or ZeRO folder, written as one file): the
        model's config.json, written beside the output as `config.json` with its dtype
        set and, under an FP8 target, the `quantization_config` that describes the
        output (without it, an FP8 output's `quantization_config` alone goes to
        `<stem>.quantization_config.json`). Checked before any work: a JSON object, not
        the input, an existing `config.json` there needs `force`.
    """

    to: Target | TargetAlias
    keep_min_size: int
    on_overflow: OnOverflow
    strict: bool
    resume: bool
    shard: tuple[int, int] | None
    allow_quantized: bool
    follow_links: bool
    max_shard_size: int | str | None
    no_record: bool
    config: StrPath | None


class InspectOptions(ConvertOptions, total=False):
    """The options of `inspect`: those of `convert` (with `dst`, those that change the checks
    `convert` makes before writing change them; a re-sharding's shard plan is reported
    (`shards`, `indexes`: each output file, its size, tensors and the input files it
    reads), and what a folder's output copies and leaves out (`other_files`, `left_out`);
    the threads are the scan's), and:

        scan: read the tensors to convert and measure what converting them would lose.
    """

    scan: bool


class VerifyOptions(_Options, total=False):
    """The options of `verify`, besides those all three share: the precision
    and source options `convert` had (default: those DST's record of them holds); strict
    mode expects exactly the tensors they keep to be kept.

        to: the target DST was converted to (default: DST's record's, else any target).
        keep_min_size: as for `convert` (default: DST's record's, else 0).
        on_overflow: as for `convert` (default: DST's record's, else "warn").
        loose: accept what other tools write (see `verify`).
    """

    to: Target | TargetAlias | None
    keep_min_size: int | None
    on_overflow: OnOverflow | None
    loose: bool
