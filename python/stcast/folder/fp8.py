"""FP8 targets in folders: what the `quantization_config` a loader (vLLM, transformers with
compressed-tensors) reads must say; the index entries of the scales are the engine's
(rust/run/check.rs `written_index`). The engine writes both texts (rust/run/json.rs) and
judges them in an output (rust/run/fp8config.rs, rust/run/check.rs).

Both come from the shards as written, not from the plan: a weight that held NaN or inf is
found only while converting, and stays BF16 (unquantized, without a scale), so the config's
`ignore` and the index must be read from what the run wrote.
"""

from __future__ import annotations

import json
import os
import posixpath
from typing import TYPE_CHECKING, Any

from .. import _core

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..reports import TensorInfo


def is_fp8(to: str) -> bool:
    """Is `to` an FP8 target?"""
    return to in ("fp8", "fp8-block")


def nonfinite(tensors: Sequence[TensorInfo]) -> list[str]:
    """The weights of an FP8 plan (`inspect` of one file, which reads them) that hold NaN or
    inf: left unquantized, in BF16."""
    return [t.name for t in tensors if t.not_quantized == "nonfinite"]


# The keys under which a model config describes its quantization (the engine's,
# `run::json::QUANTIZATION_KEYS`): a dequantized checkpoint's config loses every one of them.
QUANTIZATION_KEYS = _core.QUANTIZATION_KEYS


def quantization_of(doc: Any) -> tuple[str, Any] | None:
    """The first quantization key a config sets (not null) and its value."""
    if not isinstance(doc, dict):
        return None
    return next(((k, doc[k]) for k in QUANTIZATION_KEYS if doc.get(k) is not None), None)


def dequantizes(doc: Any, to: str) -> bool:
    """Does a config say its checkpoint is FP8 (E4M3) that `to` (bf16, fp16) dequantizes:
    compressed-tensors' float-quantized 8-bit weights, or DeepSeek's `fp8` e4m3 blocks?"""
    if to not in ("bf16", "fp16") or not isinstance(doc, dict):
        return False
    found = quantization_of(doc)
    q = None if found is None else found[1]
    return isinstance(q, dict) and _unread(q) is None


def _unread(q: dict[str, Any]) -> str | None:
    """Why stcast does not dequantize the scheme of quantization config `q`, in words (empty
    when no detail helps), or None when it does."""
    if q.get("quant_method") == "fp8":
        return None if q.get("fmt", "e4m3") == "e4m3" else ""
    if q.get("quant_method") == "mxfp4":
        return None  # gpt-oss: `*_blocks` with `*_scales`, paired by the engine
    if q.get("quant_method") != "compressed-tensors":
        return ""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return ""
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            return f"config group `{_name(str(name))}` has no weights"
        fmt = g.get("format") or q.get("format")
        if _scheme_of(w, fmt) is None:
            return f"config group `{_name(str(name))}` {_weights_problem(w, fmt)}"
    return None


# compressed-tensors formats whose weights the engine unpacks (`quant::Packing`), and the
# weights each holds: (type, bits).
_PACKED_FORMATS = {
    "nvfp4-pack-quantized": {("float", 4)},
    "mxfp4-pack-quantized": {("float", 4)},
    "pack-quantized": {("int", b) for b in range(1, 9)},
    "int-quantized": {("int", 8)},
    "naive-quantized": {("int", 8), ("float", 8)},
}


def _scheme_of(w: dict[str, Any], fmt: Any) -> str | None:
    """The scheme of a config group's weights stcast dequantizes (`fmt`: its format), or
    None: FP8 (E4M3), or a packed format holding the weights it says."""
    kind = (w.get("type"), w.get("num_bits"))
    if kind == ("float", 8) and fmt not in _PACKED_FORMATS.keys() - {"naive-quantized"}:
        return "fp8"
    if isinstance(fmt, str) and kind in _PACKED_FORMATS.get(fmt, ()):
        return fmt
    return None


def _weights_problem(w: dict[str, Any], fmt: Any) -> str:
    """What of a config group's weights (format `fmt`) `_scheme_of` does not read."""
    kind, bits = w.get("type"), w.get("num_bits")
    if type(bits) is not int:
        return f"says `num_bits` {_show(bits)}, not a whole number"
    if kind not in ("int", "float"):
        return f"says `type` {_show(kind)}, neither int nor float"
    if fmt not in _PACKED_FORMATS:
        return f"says format {_show(fmt)} with {kind} {bits}-bit weights"
    held = " or ".join(sorted(f"{k} {b}-bit" for k, b in _PACKED_FORMATS[fmt]))
    return f"says format {_show(fmt)}, which holds {held} weights, with {kind} {bits}-bit ones"


def unread_quantization(doc: Any, to: str) -> str | None:
    """Why a config's quantization cannot be dequantized to `to` (bf16, fp16) by stcast: it
    sets a quantization key that is not a compressed-tensors float 8-bit or DeepSeek fp8
    scheme (ModelOpt's, one without config_groups, ...). Such a checkpoint's FP8 weights are
    not dequantized: the scheme may scale them otherwise, and the config would still call
    them quantized. None when there is no such key, or stcast reads it."""
    if to not in ("bf16", "fp16"):
        return None
    found = quantization_of(doc)
    if found is None or dequantizes(doc, to):
        return None
    key, q = found
    method = q.get("quant_method") if isinstance(q, dict) else None
    what = f"quant_method {_show(method)}" if method is not None else "no quant_method"
    detail = _unread(q) if isinstance(q, dict) else ""
    return (
        f"its {key} ({what}{': ' + detail if detail else ''}) is not a scheme stcast "
        "dequantizes (compressed-tensors float 8-bit or a packed format holding the weights "
        "it says, gpt-oss mxfp4, DeepSeek fp8), and the files hold quantized weights with "
        "scales: they are not dequantized under a config that would still call them quantized"
    )


def _name(name: str) -> str:
    """A name (module, pattern) for a message template (`escape` doubles its braces)."""
    return _core.escape(name)


def _show(value: Any) -> str:
    """A config value as JSON, for a message template."""
    return _core.escape(json.dumps(value, sort_keys=True))


# Where a re-sharded lone checkpoint's FP8 quantization_config goes without a model config
# (`reshard.file_plan`): `quantization_config.json` in the output folder.
SIDE_CONFIG_NAME = "quantization_config.json"


def side_configs(weights: Sequence[str], configs: Sequence[str]) -> list[str]:
    """Where an FP8 folder run writes the quantization_config of weights no model config
    describes: `quantization_config.json` in each folder of `weights` (rels) that holds no
    model config among `configs` (rels), as a lone file's run writes it beside its output."""
    described = {posixpath.dirname(r) for r in configs if is_model_config(r)}
    folders = {posixpath.dirname(r) for r in weights} - described
    return sorted(posixpath.join(d, SIDE_CONFIG_NAME) for d in folders)


def side_config_notice(path: str) -> str:
    """The one warning of an FP8 output whose quantization_config goes to `path`, no model
    config describing it (as a lone file's, rust/convert.rs)."""
    return (
        "no model config describes this FP8 output: its quantization_config is written to "
        f"{_core.escape(path)}; vLLM and transformers read it from the model's config.json "
        "only: merge it into that file (the guide shows how)"
    )


def is_model_config(rel: str) -> bool:
    """Is this the model's config (`config.json`), which gets the quantization_config?"""
    return os.path.basename(rel) == "config.json"
