"""Generate a Llama-shaped W4A16 folder (compressed-tensors `pack-quantized`, INT4, group
128, symmetric, as llm-compressor's `model_free_ptq` lays it out) for the packed-input
bench (issue 32): FOLDER/model.safetensors and config.json.

Each Linear weight `X.weight` [O, I] is `X.weight_packed` I32 [O, I/8] (random codes from a
fixed seed), `X.weight_scale` BF16 [O, I/128] (random in [1e-3, 2e-2)) and `X.weight_shape`
I64 [2]; embeddings, lm_head and norms are BF16. The default shape (hidden 4096,
intermediate 14336, 8 KV heads x 128, vocab 32000, 5 layers) is 1.0 GiB on disk.
Written tensor by tensor, each in chunks of at most 64 MiB: memory stays small.

usage: python benches/gen_w4a16.py FOLDER [--layers 5] [--seed N]
then:  /usr/bin/time -v stcast convert FOLDER OUT; /usr/bin/time -v stcast verify FOLDER OUT
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, VOCAB, KV, GROUP = 4096, 14336, 32000, 1024, 128
CHUNK = 64 << 20


def plan(layers: int) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) in file order."""
    d, ff = HIDDEN, INTERMEDIATE
    out: list[tuple[str, str, list[int]]] = [("model.embed_tokens.weight", "BF16", [VOCAB, d])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", "BF16", [d])]
        out += [(p + "post_attention_layernorm.weight", "BF16", [d])]
        for name, (o, k) in {
            "self_attn.q_proj": (d, d),
            "self_attn.k_proj": (KV, d),
            "self_attn.v_proj": (KV, d),
            "self_attn.o_proj": (d, d),
            "mlp.gate_proj": (ff, d),
            "mlp.up_proj": (ff, d),
            "mlp.down_proj": (d, ff),
        }.items():
            out += [
                (p + name + ".weight_packed", "I32", [o, k // 8]),
                (p + name + ".weight_scale", "BF16", [o, k // GROUP]),
                (p + name + ".weight_shape", "I64", [2]),
            ]
    out += [("model.norm.weight", "BF16", [d]), ("lm_head.weight", "BF16", [VOCAB, d])]
    return out


SIZE = {"BF16": 2, "I32": 4, "I64": 8}


def chunks(rng: np.random.Generator, name: str, dtype: str, shape: list[int]):
    """The tensor's bytes, at most CHUNK at a time."""
    n = int(np.prod(shape)) * SIZE[dtype]
    if dtype == "I64":
        yield np.array(shape_of[name], np.int64).tobytes()  # the weight's [O, I]
        return
    left = n
    while left:
        k = min(left, CHUNK)
        if dtype == "I32":
            yield rng.integers(0, 1 << 32, k // 4, dtype=np.uint32).tobytes()
        elif name.endswith("weight_scale"):
            s = rng.uniform(1e-3, 2e-2, k // 2).astype(np.float32)
            yield (s.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            s = rng.normal(0, 0.02, k // 2).astype(np.float32)
            yield (s.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        left -= k


shape_of: dict[str, list[int]] = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.folder.mkdir(parents=True, exist_ok=True)
    tensors = plan(a.layers)
    for name, _, shape in tensors:
        if name.endswith(".weight_packed"):
            o, w = shape
            shape_of[name.removesuffix("_packed") + "_shape"] = [o, w * 8]
    header, at = {}, 0
    for name, dtype, shape in tensors:
        n = int(np.prod(shape)) * SIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(a.seed)
    with open(a.folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, dtype, shape in tensors:
            for b in chunks(rng, name, dtype, shape):
                f.write(b)
    weights = {
        "type": "int",
        "num_bits": 4,
        "strategy": "group",
        "group_size": GROUP,
        "symmetric": True,
        "dynamic": False,
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": a.layers,
        "num_attention_heads": HIDDEN // 128,
        "num_key_value_heads": KV // 128,
        "vocab_size": VOCAB,
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}
            },
            "ignore": ["lm_head"],
        },
    }
    (a.folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{a.folder}: {at / 2**30:.2f} GiB of tensors, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
