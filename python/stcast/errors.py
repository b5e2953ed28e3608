"""stcast's exceptions and warnings: one class per kind of failure.

Every class has the engine's `kind` name (`stcast._core.ERROR_KINDS`), and instances carry
`path` (the file concerned, or None), `tensor`, `option` (for usage errors) and `template`,
the message with options written neutrally (`{force}`, `{on_overflow=keep}`). `str(e)`
renders it in Python's words (`force=True`); the command line renders it with its flags.

- `StcastError` (a `ValueError`): the base of everything below, so that one `except`
  catches every way a call of stcast can end without a result.
- `InvalidInput`: the input is not a valid checkpoint; `InputChanged`: it changed while
  being read.
- `Refused`: stcast refuses what was asked (it would lose data or change the model unasked).
- `UsageError`: an argument is out of range or malformed (exit status 2 in the CLI).
- `DestinationExists`: also a `FileExistsError` (errno EEXIST).
- `NoSpace`: also an `OSError` with errno ENOSPC, whichever step ran out of space.
- `Cancelled`: the `cancel` flag was set (or, in the CLI, a signal arrived): no output
  was left behind, except a folder run's manifest and finished files, which `resume`
  continues from.

Other I/O failures raise the matching `OSError` subclass (`FileNotFoundError`, ...) with
the path as `filename`.
"""

from __future__ import annotations

import errno as _errno

from . import _core

TYPE_CHECKING = False  # `typing` costs a few ms to import; type checkers treat this as True
if TYPE_CHECKING:
    from typing import ClassVar, Literal

    Style = Literal["api", "cli"]

__all__ = [
    "Cancelled",
    "DestinationExists",
    "InputChanged",
    "InvalidInput",
    "NoSpace",
    "Refused",
    "StcastError",
    "StcastWarning",
    "UsageError",
    "render",
]

# The kind of each option's value, by the engine's table of options: a switch (`{force}`
# reads `force=True` in Python), a list (`{keep=*norm*}` reads `keep=["*norm*"]`), a part
# (`{shard=2/8}` reads `shard=(2, 8)`), ...
_KINDS = {r["name"]: r["kind"] for r in _core.OPTIONS}


def _api_option(option: str, value: str | None) -> str:
    kind = _KINDS.get(option)
    if value is None:
        return f"{option}=True" if kind == "flag" else option
    if kind == "texts":
        return f'{option}=["{value}"]'
    if kind == "part":  # "i/n"
        return f"{option}=({value.replace('/', ', ')})"
    return f'{option}="{value}"'


def _cli_option(option: str, value: str | None) -> str:
    flag = "--" + option.replace("_", "-")
    if value is None:
        return flag
    from shlex import quote

    return f"{flag} {quote(value)}"


def render(template: str, style: Style = "api") -> str:
    """A message template in the words of the Python API (`force=True`) or the CLI
    (`--force`)."""
    return _core.render(template, _cli_option if style == "cli" else _api_option)


class StcastError(ValueError):
    """Bad input or a refused operation: `kind` and `path` say which and where."""

    kind: ClassVar[str] = "invalid_input"
    template: str
    path: str | None
    tensor: str | None
    option: str | None

    def __init__(
        self,
        template: str,
        *,
        path: str | None = None,
        tensor: str | None = None,
        option: str | None = None,
        message: str | None = None,  # the engine's full message: unused but by OSErrors
        errno: int | None = None,
    ) -> None:
        super().__init__(template)
        self._engine_fields(template, path, tensor, option)

    def _engine_fields(
        self, template: str, path: str | None, tensor: str | None, option: str | None
    ) -> None:
        self.template = template
        self.path = path
        self.tensor = tensor
        self.option = option

    def __str__(self) -> str:
        return render(self.template, "api")

    def render(self, style: Style) -> str:
        """The message in the API's words or the CLI's."""
        return render(self.template, style)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls: type[StcastError], state: dict[str, object]) -> StcastError:
    e = cls.__new__(cls)
    e.__dict__.update(state)
    e.args = (state.get("template", ""),)
    return e


class InvalidInput(StcastError):
    """The input is not a valid checkpoint, or not one stcast reads."""

    kind = "invalid_input"


class InputChanged(InvalidInput):
    """The input was written to while being read; nothing was written."""

    kind = "input_changed"


class Refused(StcastError):
    """stcast refuses what was asked: it would lose data or change the model unasked."""

    kind = "refused"


class UsageError(StcastError):
    """An argument is out of range or malformed."""

    kind = "usage"


class DestinationExists(FileExistsError, StcastError):
    """The destination exists and `force` was not given; `errno` is EEXIST."""

    kind = "destination_exists"

    def __init__(self, template: str, *, message: str, path: str | None, **_: object) -> None:
        FileExistsError.__init__(self, _errno.EEXIST, render(message, "api"), path)
        self._engine_fields(template, path, None, None)

    __str__ = StcastError.__str__
    __reduce__ = StcastError.__reduce__


class NoSpace(OSError, StcastError):
    """The destination's file system is full; `errno` is ENOSPC (or EDQUOT)."""

    kind = "no_space"

    def __init__(
        self,
        template: str,
        *,
        message: str,
        path: str | None,
        errno: int | None = _errno.ENOSPC,
        **_: object,
    ) -> None:
        OSError.__init__(self, errno or _errno.ENOSPC, render(message, "api"), path)
        self._engine_fields(template, path, None, None)

    __str__ = StcastError.__str__
    __reduce__ = StcastError.__reduce__


class Cancelled(StcastError):
    """The conversion was cancelled through its `cancel` object. A file conversion leaves
    nothing behind; a folder run keeps its manifest and the files it finished, so that
    `resume=True` goes on from there (or `force=True` starts again)."""

    kind = "cancelled"

    def __init__(self, template: str = "conversion cancelled", *, path: str | None = None) -> None:
        super().__init__(template, path=path)


class StcastWarning(UserWarning):
    """A conversion runs, but probably not as you meant (e.g. F32 scales in a quantized model).

    `kind` names what it is about (`stcast._core.WARNING_KINDS`); `path` is the file, for
    folders; `template` is the message with options written neutrally.
    """

    def __init__(self, kind: str, template: str, path: str | None = None) -> None:
        super().__init__(render(template, "api"))
        self.kind = kind
        self.template = template
        self.path = path


def _os_error(
    template: str, *, message: str, path: str | None, errno: int | None, **_: object
) -> OSError:
    # OSError(errno, ...) instantiates the matching subclass (FileNotFoundError, ...).
    return OSError(errno or _errno.EIO, render(message, "api"), path)


def _cancelled(template: str, **_: object) -> Cancelled:
    return Cancelled("conversion cancelled")


# The engine raises these, one per error kind (rust/python.rs `to_py`).
_core._set_exceptions(
    {
        "invalid_input": InvalidInput,
        "input_changed": InputChanged,
        "refused": Refused,
        "usage": UsageError,
        "destination_exists": DestinationExists,
        "no_space": NoSpace,
        "io": _os_error,
        "cancelled": _cancelled,
    }
)
