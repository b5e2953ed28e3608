"""Generate transformer-shaped F32 safetensors checkpoints for the benchmarks.

The data is written in chunks of at most 64 MiB, so generating a 16 GiB checkpoint needs
no more memory than one chunk. Values are N(0, 0.02) float32 from a fixed
seed: every mantissa bit is random, so the rounding path of a converter is exercised.

With COUNTxBYTES instead of a size, the checkpoint holds COUNT F32 tensors of BYTES each
(a multiple of 4), named like the experts of a mixture-of-experts model
(`model.layers.{l}.mlp.experts.{e}.w{1,2,3}.weight`): compare.py's many-tensors case,
300000x1024 against 300x1024000 (the same 307.2 MB of data).

usage: python benches/gen.py SIZE_GIB PATH [--seed N]
       python benches/gen.py COUNTxBYTES PATH [--seed N]
compare.py runs this in a child process, so that the bench itself stays small (see
README-bench.md on peak RSS).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

CHUNK_BYTES = 64 << 20
VOCAB_STEP = 64


def plan_tensors(size_gib: float) -> list[tuple[str, list[int]]]:
    """Return (name, shape) pairs of a Llama-like model whose F32 data is about size_gib.

    The hidden size grows with the square root of the size (0.25 GiB -> 512, 1 -> 1024,
    4 -> 2048, 16 -> 4096), which gives 13-15 layers at every size; the vocabulary takes up
    the remainder so the data comes within a few hundred KiB of the target.
    """
    target = int(size_gib * (1 << 30))
    d = min(8192, max(256, int(1024 * 2.0 ** round(math.log2(size_gib) / 2))))
    ff = -(-8 * d // 3 // 256) * 256  # SwiGLU width, rounded up to 256 (4096 -> 11008)
    layer_params = 4 * d * d + 3 * d * ff + 2 * d
    layers = max(1, int(0.75 * target / (4 * layer_params)))
    vocab = (target - 4 * (layers * layer_params + d)) // (2 * 4 * d)
    vocab = max(VOCAB_STEP, vocab // VOCAB_STEP * VOCAB_STEP)

    tensors: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, d])]
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", [d]),
            (p + "self_attn.q_proj.weight", [d, d]),
            (p + "self_attn.k_proj.weight", [d, d]),
            (p + "self_attn.v_proj.weight", [d, d]),
            (p + "self_attn.o_proj.weight", [d, d]),
            (p + "post_attention_layernorm.weight", [d]),
            (p + "mlp.gate_proj.weight", [ff, d]),
            (p + "mlp.up_proj.weight", [ff, d]),
            (p + "mlp.down_proj.weight", [d, ff]),
        ]
    tensors += [("model.norm.weight", [d]), ("lm_head.weight", [vocab, d])]
    return tensors


def plan_many(count: int, tensor_bytes: int) -> list[tuple[str, list[int]]]:
    """Return count (name, shape) pairs of F32 tensors of tensor_bytes each, named like the
    expert weights of a mixture-of-experts model: w1, w2, w3 of about sqrt(count / 3)
    experts per layer (300000 -> 317 layers of 316 experts)."""
    if count < 1 or tensor_bytes < 4 or tensor_bytes % 4:
        raise ValueError(
            f"need COUNT >= 1 and BYTES a positive multiple of 4: {count}x{tensor_bytes}"
        )
    n = tensor_bytes // 4
    rows = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
    shape = [rows, n // rows] if rows > 1 else [n]
    experts = max(1, math.isqrt(count // 3))
    return [
        (
            f"model.layers.{i // (3 * experts)}.mlp.experts.{i // 3 % experts}.w{i % 3 + 1}.weight",
            shape,
        )
        for i in range(count)
    ]


def parse_spec(spec: str) -> list[tuple[str, list[int]]]:
    """Return the plan for SIZE_GIB ("4", "0.25") or COUNTxBYTES ("300000x1024")."""
    count, sep, nbytes = spec.lower().partition("x")
    if sep:
        return plan_many(int(count), int(nbytes))
    return plan_tensors(float(spec))


def encode_header(tensors: list[tuple[str, list[int]]]) -> bytes:
    """Return the 8-byte length prefix plus the JSON header, padded to 8 bytes with spaces."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_checkpoint(
    path: Path, size_gib: float, seed: int = 0, tensors: list[tuple[str, list[int]]] | None = None
) -> None:
    """Write the checkpoint to path (via a temporary name, so a cut-off run leaves no input).

    The data goes out in chunks of at most 64 MiB whatever the tensor sizes, so 300000
    tensors of 1 KiB are written as fast as a few large ones."""
    if tensors is None:
        tensors = plan_tensors(size_gib)
    total = sum(math.prod(shape) for _, shape in tensors)
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(encode_header(tensors))
        left = total  # the data offsets are contiguous: one stream of values
        while left:
            n = min(left, CHUNK_BYTES // 4)
            chunk = rng.standard_normal(n, dtype=np.float32)
            chunk *= 0.02
            f.write(chunk.data)
            left -= n
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", metavar="SIZE_GIB|COUNTxBYTES")
    ap.add_argument("path", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        tensors = parse_spec(args.spec)
    except ValueError as e:
        ap.error(str(e))
    write_checkpoint(args.path, 0.0, args.seed, tensors)


if __name__ == "__main__":
    main()
