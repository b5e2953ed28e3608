#!/usr/bin/env python3
"""Peer for benchmarks: a DeepSpeed ZeRO checkpoint folder to bf16 safetensors with torch,
as users are told to do it.

`deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(SRC)` (SRC holds
`latest` and the tag folder; every rank's fp32 partitions merged into one fp32 state dict in
this process), then each floating tensor `.to(torch.bfloat16)` (the rest unchanged, every
entry contiguous), `safetensors.torch.save_file` with `{"format": "pt"}`. The output is
fsynced so that it does the same work as stcast. Run with the Python of a venv that has
DeepSpeed (/work/venv-ds; DS_ACCELERATOR=cpu is set here when unset). A peer for benchmarks,
not part of stcast.

usage: torch_zero.py SRC DST
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

FLOATS = (torch.float32, torch.float16, torch.float64)


def main(src, dst):
    state = get_fp32_state_dict_from_zero_checkpoint(src)
    out = {}
    for k in list(state):
        t = state.pop(k)
        out[k] = (t.to(torch.bfloat16) if t.dtype in FLOATS else t).contiguous()
    del state
    save_file(out, dst, metadata={"format": "pt"})
    fd = os.open(dst, os.O_RDONLY)  # durable, like the converter it is compared with
    os.fsync(fd)
    os.close(fd)


if __name__ == "__main__":
    main(*sys.argv[1:])
