"""Issue 33's Done-when checks against transformers (not in CI: it needs torch, transformers
and compressed-tensors, e.g. /work/venv-llmc):

1. `--strip-prefix module. --strip-prefix _orig_mod.` of a DDP + torch.compile state dict
   (`module._orig_mod.x`) gives HF names: transformers loads the result, every weight equal
   to the model's in bf16.
2. `--to fp8` of a DCP folder with `--config` (as one file, and re-sharded with
   `--max-shard-size`) loads in transformers (compressed-tensors) with cosine > 0.99 of its
   logits to the fp32 model's; without `--config`, `quantization_config.json` is written and
   named in the warning.

Run: /work/venv-llmc/bin/python scripts/check-transformers-loads.py [STCAST]
(STCAST: the stcast command to test, default `stcast` on PATH). Prints one line per check
and exits 1 on the first that fails. Its run on branch incl (torch 2.14 CPU, transformers
5.17, compressed-tensors 0.19; a 2-layer Llama, hidden 256, random weights):

    ok  strip-prefix module. _orig_mod.: loads, weights exact in bf16, cosine 0.99999
    ok  fp8 of DCP with --config, one file (1 shards): cosine 0.99745
    ok  fp8 of DCP with --config, re-sharded (5 shards): cosine 0.99745
    ok  fp8 of DCP without --config: quantization_config.json written and named (float-quantized)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

STCAST = sys.argv[1] if len(sys.argv) > 1 else "stcast"


def stcast(*args: object) -> str:
    r = subprocess.run([STCAST, *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL: stcast {' '.join(map(str, args))}: {r.stderr.strip()}")
    return r.stderr


def model() -> tuple[LlamaForCausalLM, LlamaConfig]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config).eval(), config


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(
        a.flatten().double(), b.flatten().double(), dim=0
    ).item()


def logits(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(ids).logits.float()


def main() -> None:
    ref, config = model()
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    want = logits(ref, ids)
    tmp = Path(tempfile.mkdtemp(prefix="stcast-tf-"))
    try:
        config_path = tmp / "config.json"
        config.save_pretrained(tmp / "cfg")
        shutil.copy(tmp / "cfg" / "config.json", config_path)

        # 1. DDP + torch.compile names, two prefixes stripped in order.
        state = {f"module._orig_mod.{k}": v for k, v in ref.state_dict().items()}
        torch.save(state, tmp / "ckpt.pt")
        out = tmp / "stripped"
        stcast(
            "convert",
            tmp / "ckpt.pt",
            out / "model.safetensors",
            "--strip-prefix",
            "module.",
            "--strip-prefix",
            "_orig_mod.",
            "--config",
            config_path,
        )
        loaded = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
        sd = loaded.state_dict()
        bad = [k for k, v in ref.state_dict().items() if not torch.equal(sd[k], v.bfloat16())]
        if bad:
            sys.exit(f"FAIL strip-prefix: {bad[0]} differs")
        c = cosine(logits(loaded.float(), ids), want)
        print(f"ok  strip-prefix module. _orig_mod.: loads, weights exact in bf16, cosine {c:.5f}")

        # 2. A DCP folder to FP8, with and without --config.
        ck = tmp / "dcp"
        dcp.save({"model": ref.state_dict()}, checkpoint_id=str(ck))
        for label, extra, folder in (
            ("one file", [], tmp / "fp8"),
            ("re-sharded", ["--max-shard-size", "400KB", "--name", "model"], tmp / "fp8-sharded"),
        ):
            dst = folder / "model.safetensors" if not extra else folder
            stcast(
                "convert", ck, dst, "--to", "fp8", "--key", "model", "--config", config_path, *extra
            )
            q = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16)
            c = cosine(logits(q, ids), want)
            shards = len(list(folder.glob("*.safetensors")))
            if c <= 0.99:
                sys.exit(f"FAIL fp8 {label}: cosine {c:.5f}")
            print(f"ok  fp8 of DCP with --config, {label} ({shards} shards): cosine {c:.5f}")
        bare = tmp / "fp8-bare"
        err = stcast(
            "convert", ck, bare, "--to", "fp8", "--key", "model", "--max-shard-size", "400KB"
        )
        side = bare / "quantization_config.json"
        if not side.exists() or str(side) not in err:
            sys.exit(f"FAIL fp8 without --config: {side} not written or not named: {err}")
        q = json.loads(side.read_text())["quantization_config"]
        print(f"ok  fp8 of DCP without --config: {side.name} written and named ({q['format']})")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
