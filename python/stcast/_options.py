"""The options of one `convert`, `inspect` or `verify` call, as one value.

The public functions (`stcast._api`) take their options as keywords; each builds one
`Options` from them, once, and hands it on whole: to the folder code (`stcast.folder`) and
to the per-file engine calls (`stcast._engine`), which make the engine's keywords of it.
The fields are named as the public keywords (and as the engine's keywords, where the
engine takes them). Values are checked by the engine, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._types import OnOverflow, Target

# Field metadata: the options beside `to` that decide what each tensor becomes (they change
# the output, so a manifest records them).
_PRECISION = {"precision": True}


@dataclass(frozen=True)
class Options:
    """Every option a call was given (the defaults for those it was not)."""

    to: Target | None = "bf16"
    keep: list[str] = field(default_factory=list, metadata=_PRECISION)
    keep_min_size: int = field(default=0, metadata=_PRECISION)
    from_bf16: bool = field(default=False, metadata=_PRECISION)
    on_overflow: OnOverflow = field(default="warn", metadata=_PRECISION)
    threads: int | None = None
    tuning: dict[str, Any] | None = None
    key: str | None = None
    strip_prefix: list[str] = field(default_factory=list)
    strict: bool = False
    scan: bool = False
    loose: bool = False
    force: bool = False
    resume: bool = False
    shard: tuple[int, int] | None = None
    allow_quantized: bool = False
    follow_links: bool = False
    max_shard_size: int | None = None
    name: str | None = None
    report: str | None = None

    @classmethod
    def given(cls, arguments: Mapping[str, Any]) -> Options:
        """The options among a public function's arguments (its `locals()` on entry)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in arguments.items() if k in names})

    @property
    def precision(self) -> dict[str, Any]:
        """The options beside `to` that change the output, without the defaults: engine
        keywords, and the options a manifest records (so that plain runs' stay as they
        were)."""
        options: dict[str, Any] = {}
        for f in fields(self):
            if not f.metadata.get("precision"):
                continue
            value = getattr(self, f.name)
            if f.type == "bool":
                if value:  # a flag: recorded as True when set
                    options[f.name] = True
                continue
            default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc,operator]
            if value != default:
                options[f.name] = list(value) if isinstance(value, list) else value
        return options

    @property
    def source(self) -> dict[str, Any]:
        """How a PyTorch checkpoint is read (`key`, `strip_prefix`), without the defaults:
        engine keywords, and options of a re-sharding's manifest."""
        options: dict[str, Any] = {}
        if self.key is not None:
            options["key"] = self.key
        if self.strip_prefix:
            options["strip_prefix"] = list(self.strip_prefix)
        return options

    def engine(self) -> dict[str, Any]:
        """The keywords the engine calls of this call share (`_core.convert`, `inspect`,
        `verify`: each reads those it needs): `to`, the precision options as given (the
        engine checks them), `threads`, `tuning`."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("precision")}
        return {"to": self.to, **given, "threads": self.threads, "tuning": self.tuning}
