"""Generate a gpt-oss-shaped MXFP4 folder (as the released gpt-oss checkpoints lay it out)
for the gpt-oss bench (issue 32): FOLDER/model.safetensors and config.json.

Each layer's experts are `mlp.experts.{gate_up_proj,down_proj}_blocks` U8
`[E, rows, cols / 32, 16]` (random code bytes from a fixed seed) with `_scales` U8 E8M0
`[E, rows, cols / 32]` (random bytes 118..127, values 2^-9..2^0) and BF16 `_bias`; attention
(q/k/v/o with biases, sinks), the router (weight, bias), norms, embeddings and lm_head are
BF16. The default shape (hidden 1024, intermediate 1024, 32 experts, 4 layers, 16 heads of
64, 4 KV heads, vocab 16384) is 0.28 GiB on disk and 0.83 GiB as bf16. Written tensor by
tensor, in chunks of at most 64 MiB: memory stays small. No torch needed.

usage: python benches/gen_gptoss.py FOLDER [--layers 4] [--seed N]
then:  /usr/bin/time -v stcast convert FOLDER OUT
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, EXPERTS, HEADS, KV, HEAD_DIM, VOCAB = 1024, 1024, 32, 16, 4, 64, 16384
CHUNK = 64 << 20
SIZE = {"BF16": 2, "U8": 1}


def plan(layers: int) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) in file order."""
    d, ff, e = HIDDEN, INTERMEDIATE, EXPERTS
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    out: list[tuple[str, str, list[int]]] = [("model.embed_tokens.weight", "BF16", [VOCAB, d])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", "BF16", [d])]
        out += [(p + "post_attention_layernorm.weight", "BF16", [d])]
        for name, (o, k) in {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d)}.items():
            out += [(p + f"self_attn.{name}.weight", "BF16", [o, k])]
            out += [(p + f"self_attn.{name}.bias", "BF16", [o])]
        out += [(p + "self_attn.o_proj.weight", "BF16", [d, q])]
        out += [(p + "self_attn.o_proj.bias", "BF16", [d])]
        out += [(p + "self_attn.sinks", "BF16", [HEADS])]
        out += [(p + "mlp.router.weight", "BF16", [e, d]), (p + "mlp.router.bias", "BF16", [e])]
        # On disk the experts are transposed: rows are the output dim.
        for name, (rows, cols) in {"gate_up_proj": (2 * ff, d), "down_proj": (d, ff)}.items():
            x = p + f"mlp.experts.{name}"
            out += [
                (x + "_blocks", "U8", [e, rows, cols // 32, 16]),
                (x + "_scales", "U8", [e, rows, cols // 32]),
                (x + "_bias", "BF16", [e, rows]),
            ]
    out += [("model.norm.weight", "BF16", [d]), ("lm_head.weight", "BF16", [VOCAB, d])]
    return out


def chunks(rng: np.random.Generator, name: str, dtype: str, shape: list[int]):
    """The tensor's bytes, at most CHUNK at a time."""
    left = int(np.prod(shape)) * SIZE[dtype]
    while left:
        k = min(left, CHUNK)
        if name.endswith("_blocks"):
            yield rng.integers(0, 256, k, dtype=np.uint8).tobytes()
        elif name.endswith("_scales"):
            yield rng.integers(118, 128, k, dtype=np.uint8).tobytes()
        else:
            s = rng.normal(0, 0.02, k // 2).astype(np.float32)
            yield (s.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        left -= k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.folder.mkdir(parents=True, exist_ok=True)
    tensors = plan(a.layers)
    header, at = {}, 0
    for name, dtype, shape in tensors:
        n = int(np.prod(shape)) * SIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(a.seed)
    with open(a.folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, dtype, shape in tensors:
            for b in chunks(rng, name, dtype, shape):
                f.write(b)
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": 4,
        "num_hidden_layers": a.layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (a.layers // 2)
        + ["sliding_attention"] * (a.layers % 2),
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
    }
    (a.folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{a.folder}: {at / 2**30:.2f} GiB of tensors, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
