"""FP8 targets in folders: what the `quantization_config` a loader (vLLM, transformers with
compressed-tensors) reads must say; the index entries of the scales are the engine's
(rust/run/check.rs `written_index`). The engine writes both texts (rust/run/json.rs) and
judges them in an output (rust/run/fp8config.rs, rust/run/check.rs).

Both come from the shards as written, not from the plan: a weight that held NaN or inf is
found only while converting, and stays BF16 (unquantized, without a scale), so the config's
`ignore` and the index must be read from what the run wrote.
"""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING

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
