"""The native engine (rust/python.rs). Private: use the `stcast` package instead."""

from typing import Any, Callable, Literal, Protocol, TypedDict, final

from stcast._types import TensorNumerics as _Row

__all__ = [
    "__version__",
    "TensorNumerics",
    "TARGETS",
    "TARGET_ALIASES",
    "REASONS",
    "KEPT_REASONS",
    "ERROR_KINDS",
    "WARNING_KINDS",
    "OPTIONS",
    "INPUT_FORMATS",
    "ON_OVERFLOW",
    "READ_ADVICE",
    "_set_exceptions",
    "convert",
    "inspect",
    "verify",
    "render",
    "format_bytes",
    "check_option",
    "source_kind",
    "split_shard_name",
    "default_dst",
    "finalize",
]

__version__: str

# The names the engine defines (rust/vocab.rs); stcast._types spells them as Literals.
TARGETS: tuple[str, ...]
TARGET_ALIASES: dict[str, str]
REASONS: tuple[str, ...]
KEPT_REASONS: tuple[str, ...]
ERROR_KINDS: tuple[str, ...]
WARNING_KINDS: tuple[str, ...]
OPTIONS: list[_Option]  # every option of every command (rust/options.rs)
INPUT_FORMATS: tuple[str, ...]
ON_OVERFLOW: tuple[str, ...]
READ_ADVICE: tuple[str, ...]

class _Option(TypedDict):
    command: str
    name: str
    kind: str
    front: str
    default: Any
    choices: list[str]
    max: int | None
    metavar: str | None
    short: str | None
    help: str | None
    role: str  # "precision", "source" or "other"

class _CancelFlag(Protocol):
    def is_set(self) -> bool: ...

# Reports cross as plain dicts of the engine's serde form (rust/python.rs `crossed`): the
# fields of stcast.reports' dataclasses (a test checks both ways); warnings are
# (kind, template) pairs, `numerics` {"tensors": TensorNumerics, "total": NumericsTotal}.
_Report = dict[str, Any]

_Progress = Callable[[int, int], object] | None
_FileProgress = Callable[[str, int, int], object] | None
_Warn = Callable[[str, str, str | None], object] | None  # (kind, template, path)

# One call per command (rust/command.rs): the engine routes one file, a folder run or a
# re-sharding; the report has `folder`. A folder's: its files as dicts, its `numerics` each
# converted unit's (file, numerics); an inspection's: under "named" its other files (path,
# bytes, action), files left out (path, bytes, why) and warnings (kind, template, file),
# under "files" each weight file's report, and a re-sharding's plan (`max_shard_size`,
# `shards`, `indexes`); with `dst`, its `destination`; a verification's: its mismatch with
# `file`, each file's (rel, numerics) as `parts`.
def convert(
    src: str,
    dst: str | None = None,
    *,
    progress: _Progress = None,
    file_progress: _FileProgress = None,
    cancel: _CancelFlag | None = None,
    warn: _Warn = None,
    **options: Any,
) -> _Report: ...
def inspect(
    src: str,
    dst: str | None = None,
    *,
    progress: _Progress = None,
    row: Callable[[dict[str, Any]], object] | None = None,  # what each tensor's dict becomes
    **options: Any,
) -> _Report: ...
def verify(
    src: str,
    dst: str,
    *,
    progress: _Progress = None,
    warn: _Warn = None,
    **options: Any,
) -> _Report: ...
def _set_exceptions(classes: dict[str, Callable[..., BaseException]]) -> None: ...
def render(template: str, option: Callable[[str, str | None], str]) -> str: ...
def format_bytes(n: int) -> str: ...
def check_option(name: str, value: object) -> Any: ...
def source_kind(src: str) -> Literal["file", "checkpoint", "tree"] | None: ...
def default_dst(src: str, to: str, *, folder: bool = False) -> str: ...
def split_shard_name(name: str) -> tuple[str, str, str] | None: ...

@final
class TensorNumerics:
    """Per-tensor numeric reports (`stcast.reports.TensorRows` is their sequence)."""

    def __len__(self) -> int: ...
    def row(self, i: int) -> _Row: ...

def finalize(
    src: str,
    dst: str,
    *,
    progress: _Progress = None,
    file_progress: _FileProgress = None,
    cancel: _CancelFlag | None = None,
    warn: _Warn = None,
) -> _Report: ...
