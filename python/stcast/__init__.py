"""Stream-convert safetensors checkpoints to bf16, exactly, in bounded memory.

    import stcast
    report = stcast.convert("model.safetensors")  # writes model-bf16.safetensors
    print(report.tensors_converted, report.bytes_out)

The work is done by the native engine `stcast._core`; `stcast._api` adds defaults, warnings
and typed reports, and `stcast.folder` handles Hugging Face folders. Both load on first use of
one of their names, so that `import stcast` and `stcast --version` stay in the low
milliseconds (the dataclasses alone cost ~20 ms to import and build). The command line lives
in `stcast.cli`.
"""

from __future__ import annotations

from ._core import Cancelled, StcastError, __version__

TYPE_CHECKING = False  # `typing` costs a few ms to import; type checkers treat this as True
if TYPE_CHECKING:
    from ._api import (
        ConvertReport,
        InspectReport,
        Mismatch,
        StcastWarning,
        TensorInfo,
        VerifyReport,
        convert,
        inspect,
        verify,
    )
    from .folder import FileReport, FolderInspectReport, FolderReport, finalize

__all__ = [
    "Cancelled",
    "ConvertReport",
    "FileReport",
    "FolderInspectReport",
    "FolderReport",
    "InspectReport",
    "Mismatch",
    "StcastError",
    "StcastWarning",
    "TensorInfo",
    "VerifyReport",
    "__version__",
    "convert",
    "finalize",
    "inspect",
    "verify",
]

# Where each lazily loaded public name is defined.
_LAZY = {
    "ConvertReport": "_api",
    "InspectReport": "_api",
    "Mismatch": "_api",
    "StcastWarning": "_api",
    "TensorInfo": "_api",
    "VerifyReport": "_api",
    "convert": "_api",
    "inspect": "_api",
    "verify": "_api",
    "FileReport": "folder",
    "FolderInspectReport": "folder",
    "FolderReport": "folder",
    "finalize": "folder",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stcast' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
