#!/usr/bin/env python3
"""Peer for benchmarks: transformers' own dequantization of a gpt-oss MXFP4 checkpoint back
to bf16 or fp16, the reference stcast's gpt-oss inputs match bit for bit (docs/rounding.md).

`GptOssForCausalLM.from_pretrained(SRC, quantization_config=Mxfp4Config(dequantize=True),
dtype=T, device_map="cpu")` then `save_pretrained(DST)` (the whole model in memory, as
transformers loads it; its safetensors shards and config), with CUDA hidden. Its output files
are then fsynced, so that it does the same work as stcast. Run with the Python of the
llm-compressor venv (/work/venv-llmc: transformers 5.17, torch 2.14). A peer for benchmarks,
not part of stcast.

transformers 5.17's `save_pretrained` of such a model writes each layer's dequantized experts
under one name (`gate_up_proj$`, `down_proj$`: the reverse of its MXFP4 key mapping), so
that all but one layer's are lost. `state_dict` instead writes `model.state_dict()` with
`save_file` (and the config): the loaded state itself, what the bench compares stcast's
output with.

usage: tf_gptoss.py SRC DST [bf16|fp16] [save_pretrained|state_dict]
"""

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from transformers import GptOssForCausalLM, Mxfp4Config  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(src, dst, to="bf16", how="save_pretrained"):
    model = GptOssForCausalLM.from_pretrained(
        src,
        quantization_config=Mxfp4Config(dequantize=True),
        dtype=DTYPES[to],
        device_map="cpu",
    )
    if how == "state_dict":
        from safetensors.torch import save_file

        os.makedirs(dst)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(dst)
    else:
        model.save_pretrained(dst)
    for name in sorted(os.listdir(dst)):  # durable, like the converter it is compared with
        fd = os.open(os.path.join(dst, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4, 5):
        sys.exit(__doc__.strip().splitlines()[-1])
    main(*sys.argv[1:])
