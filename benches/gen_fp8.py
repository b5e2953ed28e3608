"""Generate a Llama-shaped F32 Hugging Face folder for compare.py's FP8 case (--fp8).

FOLDER/model.safetensors (F32, N(0, 0.02) from a fixed seed, written in chunks of at most
64 MiB by gen.py), config.json (LlamaConfig's keys, as transformers 5.17 saves them) and
generation_config.json. The default shape: hidden 2048, intermediate 5632, 5 layers,
16 heads x 128 with 4 KV heads (k_proj and v_proj 512 x 2048), vocab 16000, untied: 1.08
GiB, every dim a multiple of 128 (so FP8_BLOCK has no partial tile), 35 weights to quantize.

usage: python benches/gen_fp8.py FOLDER [--layers 5] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from gen import write_checkpoint

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 2048, 5632, 16000, 16, 4, 128


def plan(layers: int) -> list[tuple[str, list[int]]]:
    d, ff, kv = HIDDEN, INTERMEDIATE, KV_HEADS * HEAD_DIM
    tensors: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [VOCAB, d])]
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", [d]),
            (p + "mlp.down_proj.weight", [d, ff]),
            (p + "mlp.gate_proj.weight", [ff, d]),
            (p + "mlp.up_proj.weight", [ff, d]),
            (p + "post_attention_layernorm.weight", [d]),
            (p + "self_attn.k_proj.weight", [kv, d]),
            (p + "self_attn.o_proj.weight", [d, HEADS * HEAD_DIM]),
            (p + "self_attn.q_proj.weight", [HEADS * HEAD_DIM, d]),
            (p + "self_attn.v_proj.weight", [kv, d]),
        ]
    return tensors + [("model.norm.weight", [d]), ("lm_head.weight", [VOCAB, d])]


def config(layers: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "float32",
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": layers,
        "num_key_value_heads": KV_HEADS,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "transformers_version": "5.17.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tmp = args.folder.with_name(args.folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_checkpoint(tmp / "model.safetensors", 0.0, args.seed, plan(args.layers))
    (tmp / "config.json").write_text(json.dumps(config(args.layers), indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "5.17.0"}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    os.replace(tmp, args.folder)  # a cut-off run leaves no input


if __name__ == "__main__":
    main()
