"""Generate a file of fused MoE experts (BF16, as transformers >= 5 holds them) for the
memory check of `--to fp8` on fused experts (issue 32): FILE and FILE's config beside it
(`<stem>.config.json`, for `--config`).

Each layer holds `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`
[E, H, I]; with `--transposed`, [E, H, 2I] and [E, I, H] (Qwen3-VL-MoE, Llama 4) and a
`qwen3_vl_moe` config (sizes under `text_config`). Random values from a fixed seed, written
in chunks of at most 64 MiB: memory stays small. The default (2 layers, 64 experts, hidden
2048, intermediate 768) is 1.1 GiB.

usage: python benches/gen_fused.py FILE [--layers 2] [--experts 64] [--transposed]
then:  /usr/bin/time -v stcast convert FILE OUT --to fp8 --config <stem>.config.json
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

CHUNK = 64 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--transposed", action="store_true")
    ap.add_argument("--seed", type=int, default=32)
    a = ap.parse_args()
    e, h, i = a.experts, a.hidden, a.intermediate
    shapes = []
    for layer in range(a.layers):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = ([e, h, 2 * i], [e, i, h]) if a.transposed else ([e, 2 * i, h], [e, h, i])
        shapes += [(p + "gate_up_proj", gate_up), (p + "down_proj", down)]
    header, offset = {}, 0
    for name, shape in shapes:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(a.seed)
    with open(a.file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, shape in shapes:
            left = int(np.prod(shape))
            while left:
                k = min(left, CHUNK // 4)
                x = rng.standard_normal(k, dtype=np.float32) * 0.02
                f.write((x.view(np.uint32) >> 16).astype("<u2").tobytes())
                left -= k
    sizes = {"hidden_size": h, "moe_intermediate_size": i, "intermediate_size": 4 * h}
    config = (
        {"model_type": "qwen3_vl_moe", "text_config": sizes}
        if a.transposed
        else {"model_type": "qwen3_moe", **sizes}
    )
    a.file.with_name(a.file.stem + ".config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main()
