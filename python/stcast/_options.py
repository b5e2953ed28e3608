"""The options of one `convert`, `inspect` or `verify` call, as one value.

Every option is defined once, in the engine's table (`_core.OPTIONS`, rust/options.rs):
its name, kind, default, help, and which commands take it. The public functions
(`stcast._api`) take their options as keywords (typed by `_types.ConvertOptions`, ...); each
builds one `Options` from them, once (`Options.of`: unknown keywords are refused, the
values checked by the engine, `checked`), and hands them to the engine's one call of the
command as the keywords given (`Options.keywords`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _core


def _value(default: object) -> Any:
    """A default as a call's value (a fresh list for a repeated option's)."""
    return list(default) if isinstance(default, (list, tuple)) else default


# Each command's API options and their defaults, in the table's order.
_COMMANDS: dict[str, dict[str, Any]] = {}
for _row in _core.OPTIONS:
    if _row["front"] != "cli":
        _COMMANDS.setdefault(_row["command"], {})[_row["name"]] = _row["default"]
# Every API option, with the default of the first command that takes it (convert's `to`).
_DEFAULTS: dict[str, Any] = {}
for _options in _COMMANDS.values():
    for _name, _default in _options.items():
        _DEFAULTS.setdefault(_name, _default)
_DEFINITIONS = {row["name"]: row for row in _core.OPTIONS}


class Options:
    """Every option a call was given (the defaults for those it was not), as attributes
    named as the public keywords (and as the engine's keywords, where the engine takes
    them)."""

    def __init__(self, **given: Any) -> None:
        unknown = [name for name in given if name not in _DEFAULTS]
        if unknown:
            raise TypeError(f"Options() got an unexpected keyword argument {unknown[0]!r}")
        self.__dict__.update({n: _value(d) for n, d in _DEFAULTS.items()}, **given)

    def __getattr__(self, name: str) -> Any:  # (only for names that are not options)
        raise AttributeError(f"no option {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"Options({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    @classmethod
    def of(cls, command: str, given: Mapping[str, Any]) -> Options:
        """The options of a call of `command` ("convert", ...) with the keywords `given`:
        one it does not take is a TypeError, as Python words it."""
        defaults = _COMMANDS[command]
        for name in given:
            if name not in defaults:
                raise TypeError(f"{command}() got an unexpected keyword argument {name!r}")
        return cls(**{**{n: _value(d) for n, d in defaults.items()}, **given})

    def replace(self, **changes: Any) -> Options:
        """These options, with `changes`."""
        return Options(**{**vars(self), **changes})

    def checked(self, command: str) -> Options:
        """These options of `command` with every value the engine checks checked
        (`_core.check_option`) and made what it stands for: a target's canonical name, a
        size in bytes, a lone string of a repeated option a list of one, knobs a dict of
        their own. None stays None where it is the default (not given)."""
        changes: dict[str, Any] = {}
        for name, default in _COMMANDS[command].items():
            value = getattr(self, name)
            if value is None and default is None:
                continue
            kind = _DEFINITIONS[name]["kind"]
            if kind == "texts" and value is not None:  # (None: the engine's refusal)
                values = [value] if isinstance(value, str) else list(value)
                changes[name] = [_checked(name, v) for v in values]
            elif kind == "tuning":
                changes[name] = dict(value)
            else:
                changes[name] = _checked(name, value)
        return self.replace(**changes)

    def keywords(self, command: str) -> dict[str, Any]:
        """The options of `command` given (not at its default), as the keywords of its engine
        call (`_core.convert`, `inspect`, `verify`): the engine reads each
        by its name, takes its defaults from its table, and decides which apply to the
        run."""
        defaults = _COMMANDS[command].items()
        return {n: getattr(self, n) for n, d in defaults if getattr(self, n) != _value(d)}


def _checked(name: str, value: Any) -> Any:
    checked = _core.check_option(name, value)
    return value if checked is None else checked
