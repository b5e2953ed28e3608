"""The Python API behind `stcast`: defaults, warnings and typed reports around `stcast._core`.

Import it through the package (`stcast.convert`, `stcast.ConvertReport`, ...); the package
loads this module on first use so that `stcast --version` does not pay for it.
"""

from __future__ import annotations

import math
import os
import warnings as _warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from . import _core
from ._core import StcastError

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Callable, Protocol

    from .folder import FolderInspectReport, FolderReport

    class _CancelFlag(Protocol):
        def is_set(self) -> bool: ...


# Spellings the engine accepts for each target, mapped to the name used in default file names.
_TARGET_NAMES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "f16": "fp16",
    "float16": "fp16",
    "half": "fp16",
}


class StcastWarning(UserWarning):
    """A conversion runs, but probably not as you meant (e.g. F32 scales in a quantized model)."""


@dataclass(frozen=True)
class ConvertReport:
    """What `convert` did. Sizes are whole-file bytes; `seconds` is the engine's wall time."""

    src: str
    dst: str
    to: str
    tensors_converted: int
    tensors_copied: int
    bytes_in: int
    bytes_out: int
    seconds: float
    threads: int
    isa: str
    warnings: list[str]
    # Float tensors kept in their source dtype (counted in tensors_copied too): each a dict
    # with name, dtype, bytes, reason ("keep_pattern", "keep_min_size", "keep_overflow") and
    # pattern (the --keep pattern, or None).
    tensors_kept: int = 0
    bytes_kept: int = 0
    kept: list[dict[str, Any]] = field(default_factory=list)
    on_overflow: str = "warn"
    # What rounding did, measured while converting (README "Numeric report"):
    # {"tensors": [{"name", "elements", "overflow", "underflow_to_zero", "subnormal", "nan_in",
    # "inf_in", "max_abs_error", "max_rel_error"}, ...] (converted tensors, output order),
    # "total": {the same without "name"}}.
    numerics: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast convert --json`)."""
        return asdict(self)


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
    action: str  # "convert" or "copy"
    # Where the tensor would be in the output's data section (after header and padding).
    target_offsets: list[int] = field(default_factory=list)
    # Why: "converted"; kept in its dtype: "keep_pattern" (`pattern` says which),
    # "keep_min_size", "keep_overflow"; copied: "already_target", "bf16_source" (fp16 without
    # from_bf16), "not_converted" (F8/F6/F4/complex), "not_float".
    reason: str = "converted"
    pattern: str | None = None
    # With scan=True, for converted (and overflow-kept) tensors: elements, overflow,
    # underflow_to_zero, subnormal, nan_in, inf_in, max_abs_error, max_rel_error.
    numerics: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The tensor as plain JSON-ready data."""
        return asdict(self)


@dataclass(frozen=True)
class InspectReport:
    """The layout of a safetensors file and the output a conversion to `to` would produce.

    `tensors` are in data-offset order; `metadata` keeps the file's key order (None when the
    file has no `__metadata__`); `output_bytes` is the projected size of the converted file.
    """

    path: str
    to: str
    header_bytes: int  # the JSON header, without its 8-byte length prefix
    data_bytes: int
    file_bytes: int
    metadata: dict[str, str] | None
    tensors: list[TensorInfo]
    output_bytes: int
    warnings: list[str]
    tensors_converted: int = 0
    tensors_copied: int = 0
    tensors_kept: int = 0
    bytes_kept: int = 0
    keep_unmatched: list[str] = field(default_factory=list)  # --keep patterns matching nothing
    scanned: bool = False  # whether the data was read (`scan=True`): then `numerics` are set
    # With `dst`: {"path", "folder" (where the space was measured), "free_bytes",
    # "need_bytes", "fits"}.
    destination: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast inspect --json`)."""
        return asdict(self)


@dataclass(frozen=True)
class Mismatch:
    """The first difference `verify` found: in the data (tensor, element and bits) or the header.

    For a header difference only `message` (and `tensor`, where one is concerned) is set.
    Bits are hex strings of the element's width, e.g. "0x3F800001" and "0x3F80".
    """

    message: str
    tensor: str | None
    index: int | None  # element index in the tensor (a byte index for sub-byte dtypes)
    source_bits: str | None
    source_value: float | None  # for float source dtypes
    expected_bits: str | None
    found_bits: str | None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; a non-finite `source_value` becomes "nan", "inf" or "-inf"."""
        d = asdict(self)
        v = d["source_value"]
        if v is not None and not math.isfinite(v):
            d["source_value"] = repr(v)
        return d


@dataclass(frozen=True)
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
    to: str | None = None
    numerics: dict[str, Any] | None = None

    def __bool__(self) -> bool:
        return self.ok

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (the `result` of `stcast verify --json`)."""
        d = asdict(self)
        d["mismatch"] = None if self.mismatch is None else self.mismatch.to_dict()
        return d


def _default_dst(src: str | os.PathLike[str], to: str = "bf16") -> str:
    """The output path `convert` uses when none is given: `<stem>-bf16.safetensors` beside `src`."""
    src = os.fsdecode(src)
    stem = os.path.splitext(src)[0]
    suffix = _TARGET_NAMES.get(to.lower(), to)
    return f"{stem}-{suffix}.safetensors"


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    to: str = "bf16",
    threads: int | None = None,
    force: bool = False,
    progress: Callable[[int, int], object] | None = None,
    cancel: _CancelFlag | None = None,
    resume: bool = False,
    shard: tuple[int, int] | None = None,
    allow_quantized: bool = False,
    file_progress: Callable[[str, int, int], object] | None = None,
    keep: Iterable[str] = (),
    keep_min_size: int = 0,
    strict: bool = False,
    from_bf16: bool = False,
    on_overflow: str = "warn",
) -> ConvertReport | FolderReport:
    """Convert the safetensors file `src` to `to` ("bf16" or "fp16"), writing `dst`.

    When `src` is a folder (a Hugging Face checkpoint), every `.safetensors` file in it, at any
    depth, is converted to the same relative path under the folder `dst` (default
    `<src>-bf16`), `*.safetensors.index.json` and `config.json` files are rewritten (new
    `total_size`; `torch_dtype`/`dtype` set to "bfloat16" or "float16"), the rest is copied,
    and a `FolderReport` is returned; see README "Folders". Indexes and configs are written
    last, so an interrupted run never looks complete. There `dst` must be empty unless
    `force=True` (convert everything again) or `resume=True` (skip the files the manifest
    in `dst` shows done with the same options); `shard=(i, n)` converts only the i-th of n
    subsets of the files (1-based) and `finalize(src, dst)` completes the folder once all
    n ran; quantized checkpoints are refused unless `allow_quantized=True`.
    `progress(done, total)` then counts the whole folder and `file_progress(path, done,
    total)` each file.

    F32, F64 (and, for bf16, F16) tensors are rounded to nearest, ties to even, subnormals
    included; NaN keeps its sign and becomes the quiet NaN (`sign | 0x7FC0` in bf16). Every
    other tensor is copied byte for byte, and `__metadata__` is kept. stcast rounds F64 once,
    correctly; torch and ml_dtypes round it twice, via F32, and can differ in the last bit.

    Memory stays bounded whatever the file size: the input is mapped and converted in small
    windows that are released once written.

    Args:
        src: the input file.
        dst: the output file; default `<stem>-bf16.safetensors` (`-fp16` for fp16) beside `src`.
            The output appears only once complete; an existing `dst` is replaced only with
            `force=True`.
        to: the target dtype, "bf16" or "fp16".
        threads: worker threads; default: all CPUs.
        force: overwrite `dst` if it exists.
        progress: called as `progress(done, total)` (bytes of tensor data) at least every
            64 MiB. An exception it raises stops the conversion cleanly (no output is left)
            and propagates.
        cancel: any object with `is_set()`, e.g. a `threading.Event`, checked at least every
            64 MiB; once set, `Cancelled` is raised and no output is left behind.
        keep: fnmatch patterns (`*`, `?`, `[seq]`, `[!seq]`; case-sensitive) on tensor names:
            a float tensor that one matches keeps its dtype and bytes, e.g. `["*norm*"]`.
            A pattern that matches no tensor (in the file, or anywhere in the folder) is
            probably a typo: a `StcastWarning`, or with `strict=True` a `StcastError`
            raised before anything is written.
        keep_min_size: float tensors with fewer elements than this keep their dtype too
            (norms and biases: e.g. 4096).
        strict: make a `keep` pattern that matches nothing an error.
        from_bf16: with `to="fp16"`, convert BF16 tensors to F16 too (exact widening, then
            the F32 rule); otherwise they are copied and the output mixes BF16 and F16.
        on_overflow: finite values that become ±inf (|x| >= 65520 for fp16): "warn" (count
            them per tensor; a `StcastWarning` names the worst tensors), "error" (raise
            `StcastError` and leave nothing behind) or "keep" (first read the float tensors
            once more to find their largest |x|, and keep those that would overflow in their
            source dtype).

    Ctrl-C raises KeyboardInterrupt within a second and leaves nothing behind. The GIL is
    released while converting, but Python checks for signals (`check_signals`) only on the
    main thread: when `convert` runs in another thread, pass `cancel=threading.Event()` and
    set it to stop (raises `Cancelled`, nothing is left behind).

    Warnings about the plan (e.g. F32 scales in a quantized checkpoint) are issued as
    `StcastWarning` before any data is written; turn them into errors with
    `warnings.simplefilter("error", stcast.StcastWarning)` to refuse such conversions.

    Raises:
        StcastError: the input is invalid or the operation is refused (`.kind`, `.path`).
        OSError: reading or writing failed (FileNotFoundError, PermissionError, ...).
        ValueError: `to` is not a known target.
        Cancelled: `cancel.is_set()` became true.
        KeyboardInterrupt: Ctrl-C.
    """
    src = os.fsdecode(src)
    if os.path.isdir(src):
        from .folder import convert_folder

        return convert_folder(
            src,
            dst,
            to=to,
            threads=threads,
            force=force,
            resume=resume,
            shard=shard,
            allow_quantized=allow_quantized,
            progress=progress,
            file_progress=file_progress,
            cancel=cancel,
            keep=_patterns(keep),
            keep_min_size=keep_min_size,
            strict=strict,
            from_bf16=from_bf16,
            on_overflow=on_overflow,
        )
    if resume or shard is not None:
        e = StcastError(f"{src}: resume and shard apply to folders; this is not one")
        e.kind, e.path = "invalid_input", src
        raise e
    dst = _default_dst(src, to) if dst is None else os.fsdecode(dst)
    return _convert_file(
        src,
        dst,
        to=to,
        threads=threads,
        force=force,
        progress=progress,
        cancel=cancel,
        keep=_patterns(keep),
        keep_min_size=keep_min_size,
        keep_unmatched="error" if strict else "warn",
        from_bf16=from_bf16,
        on_overflow=on_overflow,
        stacklevel=4,
    )


def _convert_file(
    src: str,
    dst: str,
    *,
    stacklevel: int,
    **options: Any,
) -> ConvertReport:
    """One file through the engine; `options` are `_core.convert`'s. Warnings point at the
    frame `stacklevel` levels up from here (the user's call)."""

    def warn(message: str) -> None:
        # No Python frame lies between this callback and here (the engine is native).
        _warnings.warn(message, StcastWarning, stacklevel=stacklevel)

    result = _core.convert(src, dst, warn=warn, **options)
    return ConvertReport(**result)


def _patterns(keep: Iterable[str]) -> list[str]:
    """`keep` as a list; a lone string is one pattern, not a sequence of characters."""
    if isinstance(keep, str):
        return [keep]
    patterns = list(keep)
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"keep patterns must be strings, not {type(p).__name__}")
    return patterns


def inspect(
    path: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    to: str = "bf16",
    keep: Iterable[str] = (),
    keep_min_size: int = 0,
    from_bf16: bool = False,
    scan: bool = False,
    on_overflow: str = "warn",
    threads: int | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> InspectReport | FolderInspectReport:
    """Describe what `convert(path, dst, ...)` would do with the same options: a dry run.

    For each tensor: its dtype, the dtype it would get, why (`reason`), and its bytes
    before and after; then the totals. Only the header is read, so this is fast for any
    size, unless `scan=True`: then the tensors to convert are read (window by window,
    memory bounded, the GIL released) and each gets its `numerics`: the overflow and
    underflow counts and largest errors the conversion would give. `on_overflow="keep"`
    implies the scan and plans the tensors that would overflow as kept, as `convert` does.
    With `dst`, `.destination` says how much space its folder has and whether the output
    fits. A folder `path` gives a `FolderInspectReport` (one `InspectReport` per weight
    file). Plan warnings are returned in `.warnings`, not issued.

    Raises:
        StcastError: the file is not a valid safetensors file, or a `keep` pattern is invalid.
        OSError: it cannot be read.
    """
    path = os.fsdecode(path)
    options: dict[str, Any] = {
        "to": to,
        "keep": _patterns(keep),
        "keep_min_size": keep_min_size,
        "from_bf16": from_bf16,
        "scan": scan,
        "on_overflow": on_overflow,
        "threads": threads,
    }
    if os.path.isdir(path):
        from .folder import inspect_folder as _inspect_folder

        return _inspect_folder(
            path, None if dst is None else os.fsdecode(dst), progress=progress, **options
        )
    result = _core.inspect(path, progress=progress, **options)
    result["tensors"] = [TensorInfo(**t) for t in result["tensors"]]
    if dst is not None:
        result["destination"] = _destination(os.fsdecode(dst), result["output_bytes"])
    return InspectReport(**result)


def _destination(dst: str, need: int) -> dict[str, Any]:
    """Free space where `dst` would be written (a file, or a folder to create or fill)."""
    folder = dst if os.path.isdir(dst) else os.path.dirname(os.path.abspath(dst))
    # A folder that does not exist yet is created inside its nearest existing ancestor.
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    return {
        "path": dst,
        "folder": folder,
        "free_bytes": free,
        "need_bytes": need,
        "fits": free >= need,
    }


def verify(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    loose: bool = False,
    threads: int | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> VerifyReport:
    """Check that `dst` is exactly what `convert` makes of `src`, streaming both files.

    For each tensor of `dst` the expectation follows from its dtype: the same dtype as in
    `src` means identical bytes; BF16 or F16 from a float means the conversion, recomputed
    and compared bit for bit (NaN encodings included). So outputs of `to="bf16"` and
    `to="fp16"` both verify. The header must hold the same names, shapes and metadata, and,
    unless `loose`, the order, alignment and header bytes that `convert` writes.

    `loose=True` is for files written by other tools (e.g. torch): tensor order, metadata
    key order, alignment and header layout are not compared, and a NaN only has to stay a
    NaN (any encoding). Every other value must still be exact.

    A difference is not an exception: the report says `ok=False` and gives the first
    `mismatch`. Memory stays bounded; the GIL is released in steps of 64 MiB, between
    which Ctrl-C is honoured and `progress(done, total)` (source data bytes) is called.

    Raises:
        StcastError: a file is not a valid safetensors file.
        OSError: a file cannot be read.
        KeyboardInterrupt: Ctrl-C.
    """
    result = _core.verify(
        os.fsdecode(src), os.fsdecode(dst), loose=loose, threads=threads, progress=progress
    )
    m = result["mismatch"]
    result["mismatch"] = None if m is None else Mismatch(**m)
    return VerifyReport(**result)
