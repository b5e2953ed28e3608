"""Stream-convert checkpoints to bf16, fp16 or FP8, exactly, in bounded memory.

    import stcast
    report = stcast.convert("model.safetensors")  # writes model-bf16.safetensors
    print(report.tensors_converted, report.bytes_out)

The work is done by the native engine `stcast._core` (a folder run too, whole: prepared,
written, finalized). `stcast._api` holds the entry points, `stcast.reports` the report
types, `stcast.errors` the exceptions. Every name loads on first use, so that
`import stcast` costs nothing and `stcast --version` stays in the low milliseconds (the
dataclasses alone cost ~20 ms to import and build). The command line lives in
`stcast.cli`, its entry point in `stcast.__main__`.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs a few ms to import; type checkers treat this as True
if TYPE_CHECKING:
    from ._api import convert, finalize, inspect, verify
    from ._core import __version__
    from .errors import (
        Cancelled,
        DestinationExists,
        InputChanged,
        InvalidInput,
        NoSpace,
        Refused,
        StcastError,
        StcastWarning,
        UsageError,
    )
    from .reports import (
        ConvertReport,
        FileReport,
        InspectReport,
        Mismatch,
        Notice,
        TensorInfo,
        VerifyReport,
    )

__all__ = [
    "Cancelled",
    "ConvertReport",
    "DestinationExists",
    "FileReport",
    "InputChanged",
    "InspectReport",
    "InvalidInput",
    "Mismatch",
    "NoSpace",
    "Notice",
    "Refused",
    "StcastError",
    "StcastWarning",
    "TensorInfo",
    "UsageError",
    "VerifyReport",
    "__version__",
    "convert",
    "finalize",
    "inspect",
    "verify",
]

# Where each public name is defined: all load on first use, so that the command's entry
# point can install its signal handlers before anything else is imported.
_LAZY = {
    "__version__": "_core",
    "Cancelled": "errors",
    "DestinationExists": "errors",
    "InputChanged": "errors",
    "InvalidInput": "errors",
    "NoSpace": "errors",
    "Refused": "errors",
    "StcastError": "errors",
    "StcastWarning": "errors",
    "UsageError": "errors",
    "convert": "_api",
    "finalize": "_api",
    "inspect": "_api",
    "verify": "_api",
    "ConvertReport": "reports",
    "FileReport": "reports",
    "InspectReport": "reports",
    "Mismatch": "reports",
    "Notice": "reports",
    "TensorInfo": "reports",
    "VerifyReport": "reports",
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
    # The public names and the module's dunders: not the helpers of this file
    # (`TYPE_CHECKING`, the `annotations` future, `_LAZY`) nor submodules loaded so far.
    return sorted({*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})
