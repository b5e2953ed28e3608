"""FP8 targets in folders: what the `quantization_config` a loader (vLLM, transformers with
compressed-tensors) reads must say; the index entries of the scales are the engine's
(rust/run/check.rs `written_index`). The engine writes both texts (rust/run/json.rs) and
judges them in an output (rust/run/fp8config.rs, rust/run/check.rs).

Both come from the shards as written, not from the plan: a weight that held NaN or inf is
found only while converting, and stays BF16 (unquantized, without a scale), so the config's
`ignore` and the index must be read from what the run wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
