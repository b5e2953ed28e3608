"""The native engine (rust/python.rs). Private: use the `stcast` package instead."""

from typing import Any, Callable

__all__ = ["__version__", "StcastError", "Cancelled", "convert", "inspect", "verify"]

__version__: str

class StcastError(ValueError):
    """Bad input or a refused operation; `str()` is one line naming the file."""

    kind: str  # "invalid_input", "refused" or "no_space"
    path: str | None

class Cancelled(Exception):
    """The `cancel` object's `is_set()` returned true."""

def convert(
    src: str,
    dst: str,
    *,
    to: str = "bf16",
    threads: int | None = None,
    force: bool = False,
    progress: Callable[[int, int], object] | None = None,
    cancel: object | None = None,
    warn: Callable[[str], object] | None = None,
    window_mib: int | None = None,
    isa: str | None = None,
    keep: list[str] = ...,
    keep_min_size: int = 0,
    keep_unmatched: str = "warn",  # "warn", "error" or "ignore"
    from_bf16: bool = False,
    on_overflow: str = "warn",  # "warn", "error" or "keep"
    numerics: bool = True,
) -> dict[str, Any]: ...
def inspect(
    path: str,
    to: str = "bf16",
    *,
    keep: list[str] = ...,
    keep_min_size: int = 0,
    keep_unmatched: str = "warn",
    from_bf16: bool = False,
    scan: bool = False,
    on_overflow: str = "warn",
    threads: int | None = None,
    progress: Callable[[int, int], object] | None = None,
    window_mib: int | None = None,
) -> dict[str, Any]: ...
def verify(
    src: str,
    dst: str,
    *,
    loose: bool = False,
    threads: int | None = None,
    progress: Callable[[int, int], object] | None = None,
    window_mib: int | None = None,
    numerics: bool = True,
) -> dict[str, Any]: ...
