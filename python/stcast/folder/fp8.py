"""FP8 targets in folders: the `quantization_config` a loader (vLLM, transformers with
compressed-tensors) reads, and the index entries of the scales.

Both come from the shards as written, not from the plan: a weight that held NaN or inf is
found only while converting, and stays BF16 (unquantized, without a scale), so the config's
`ignore` and the index must be read from what the run wrote.

The key set is compressed-tensors' own serialisation (0.20.1, `QuantizationConfig`), less
the keys that one version writes and an older one refuses (`QuantizationArgs` forbids
extra keys): `scale_dtype`, `zp_dtype` (0.19 writes them as null) and `moe_sparsity_config`
(new in 0.20). compressed-tensors 0.19.0 and 0.20.1 both validate it (docs/guide.md).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .. import _engine
from ..errors import StcastError
from .common import check_index

if TYPE_CHECKING:
    from ..reports import TensorInfo

# How FP8 checkpoints name a weight `X.weight`'s scale (compressed-tensors, DeepSeek), the
# tensors a dequantization reads beside it (those, and compressed-tensors' zero point) and
# its static activation scale (rust/quant.rs `SCALE_SUFFIXES`, `ZERO_POINT_SUFFIX`,
# `input_scale_name`).
WEIGHT_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
WEIGHT_COMPANION_SUFFIXES = (*WEIGHT_SCALE_SUFFIXES, ".weight_zero_point")
INPUT_SCALE_SUFFIX = ".input_scale"

# The preset names compressed-tensors gives the two schemes, used as the group's name.
_GROUP = {"fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK"}


def is_fp8(to: str) -> bool:
    """Is `to` an FP8 target?"""
    return to in _GROUP


def quantization_config(to: str, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` of an FP8 target's output, `ignore` the modules whose 2-D
    weight stays unquantized."""
    block = to == "fp8-block"
    weights: dict[str, Any] = {"dynamic": False, "group_size": None, "num_bits": 8}
    if block:
        weights = {"block_structure": [128, 128], **weights}
    weights.update(strategy="block" if block else "channel", symmetric=True, type="float")
    activations = {
        "dynamic": True,
        "group_size": 128 if block else None,
        "num_bits": 8,
        "strategy": "group" if block else "token",
        "symmetric": True,
        "type": "float",
    }
    return {
        "config_groups": {
            _GROUP[to]: {
                "format": "float-quantized",
                "input_activations": activations,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "transform_config": {},
        "version": "0.20.1",
    }


def unquantized_modules(shards: list[str]) -> list[str]:
    """The modules whose 2-D float weight the shards at `shards` (paths) hold unquantized:
    a weight `M.weight` that is 2-D and not F8_E4M3. Sorted, each once."""
    out: set[str] = set()
    for path in shards:
        for t in _layout(path):
            if t.name == "weight" or t.name.endswith(".weight"):
                # A bare `weight` is the root module's: an empty name in `ignore` would
                # name every module, so it is left out.
                if len(t.shape) == 2 and t.dtype in _FLOATS and t.name != "weight":
                    out.add(t.name[: -len(".weight")])
    return sorted(out)


def _layout(path: str) -> list[TensorInfo]:
    """The tensors of a safetensors file written (its header only)."""
    return _engine.inspect_file(path, to="keep").tensors


_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})


def config_text(text: str, to: str, ignore: list[str]) -> bytes:
    """A model config (its text, the dtype set already) with the FP8 `quantization_config`,
    written as compressed-tensors writes it (indent 2, keys sorted)."""
    doc = json.loads(text)
    doc["quantization_config"] = quantization_config(to, ignore)
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def dequantizes(doc: Any, to: str) -> bool:
    """Does a config say its checkpoint is FP8 (E4M3) that `to` (bf16, fp16) dequantizes:
    compressed-tensors' float-quantized 8-bit weights, or DeepSeek's `fp8` e4m3 blocks?"""
    if to not in ("bf16", "fp16") or not isinstance(doc, dict):
        return False
    q = doc.get("quantization_config")
    if not isinstance(q, dict):
        return False
    if q.get("quant_method") == "fp8":
        return q.get("fmt", "e4m3") == "e4m3"
    if q.get("quant_method") != "compressed-tensors":
        return False
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    for g in groups.values():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict) or (w.get("type"), w.get("num_bits")) != ("float", 8):
            return False
    return True


def without_quantization(content: bytes) -> bytes:
    """A config (dtype set already) without its quantization_config, the rest as it was
    laid out (re-dumped with the source's indentation)."""
    text = content.decode("utf-8")
    doc = json.loads(text)
    doc.pop("quantization_config", None)
    indent = 2 if "\n" in text else None
    return (json.dumps(doc, indent=indent) + ("\n" if text.endswith("\n") else "")).encode()


def written_only(dst: str, rel: str, text: str, weight_map: dict[str, str]) -> bytes:
    """The index at `rel` of a dequantized checkpoint: its weight map without the tensors
    the shards written no longer hold (the scales), and their total size."""
    kept = {}
    for shard in sorted(set(weight_map.values())):
        names = {t.name for t in _layout(os.path.join(dst, shard))}
        kept.update({k: v for k, v in weight_map.items() if v == shard and k in names})
    total = check_index(dst, rel, kept)
    doc = json.loads(text)
    metadata = {**(doc.get("metadata") or {}), "total_size": total}
    doc = {**doc, "metadata": metadata, "weight_map": kept}
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def dequantized(dst: str, weight_map: dict[str, str]) -> bool:
    """Does DST hold a dequantization of the checkpoint `weight_map` indexes: scales it
    lists are not in the shards written?"""
    scales = [k for k in weight_map if k.endswith(WEIGHT_SCALE_SUFFIXES)]
    if not scales:
        return False
    shard = weight_map[scales[0]]
    try:
        names = {t.name for t in _layout(os.path.join(dst, shard))}
    except (OSError, StcastError):
        return False
    return scales[0] not in names


def same_fp8_config(got: bytes, src_text: str, to: str) -> bool:
    """Loose verify: is `got` (another tool's output config) SRC's config, but for its dtype
    keys, with a compressed-tensors FP8 quantization_config of `to`'s strategy?"""
    try:
        doc, src = json.loads(got), json.loads(src_text)
    except ValueError:
        return False
    if not isinstance(doc, dict) or not isinstance(src, dict):
        return False
    q = doc.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return False
    groups = q.get("config_groups")
    strategy = "block" if to == "fp8-block" else "channel"
    if not isinstance(groups, dict) or not groups:
        return False
    for g in groups.values():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            return False
        if (w.get("type"), w.get("num_bits"), w.get("strategy")) != ("float", 8, strategy):
            return False
    plain = {"quantization_config", "torch_dtype", "dtype"}
    return {k: v for k, v in doc.items() if k not in plain} == {
        k: v for k, v in src.items() if k not in plain
    }


def is_model_config(rel: str) -> bool:
    """Is this the model's config (`config.json`), which gets the quantization_config?"""
    return os.path.basename(rel) == "config.json"


def with_scales(dst: str, weight_map: dict[str, str]) -> dict[str, str]:
    """`weight_map` with each quantized weight's scale (`X.weight_scale`, in X's shard)
    added, as the shards written hold them."""
    out = dict(weight_map)
    for shard in sorted(set(weight_map.values())):
        for t in _layout(os.path.join(dst, shard)):
            name = t.name
            base = name.removesuffix("_scale")
            if name.endswith("_scale") and weight_map.get(base) == shard and name not in out:
                out[name] = shard
    return dict(sorted(out.items()))


def index_text(dst: str, rel: str, text: str, weight_map: dict[str, str]) -> bytes:
    """The index at `rel` (source text, shards renamed) for an FP8 output: the scales in its
    weight map and the total size of the shards written, as model_free_ptq writes it."""
    full = with_scales(dst, weight_map)
    total = check_index(dst, rel, full)
    doc = json.loads(text)
    metadata = {**(doc.get("metadata") or {}), "total_size": total}
    doc = {**doc, "metadata": metadata, "weight_map": full}
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")
