#!/usr/bin/env python3
"""Peer for benchmarks: a PyTorch checkpoint to bf16 safetensors with torch, as users do.

`torch.load(weights_only=True)` (with --mmap: `mmap=True`, storages mapped, not read up
front), each floating tensor `.to(torch.bfloat16)`, every tensor kept in a dict, then
`safetensors.torch.save_file` with `{"format": "pt"}`. Without --mmap the whole checkpoint
is read into memory first. The output is fsynced so that it does the same work as stcast.
A peer for benchmarks, not part of stcast.

usage: torch_bin.py [--mmap] SRC DST
"""

import os
import sys

import torch
from safetensors.torch import save_file

FLOATS = (torch.float32, torch.float16, torch.float64)


def main(src, dst, mmap):
    state = torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
    out = {}
    for k in list(state):
        t = state.pop(k)
        out[k] = (t.to(torch.bfloat16) if t.dtype in FLOATS else t).contiguous()
    save_file(out, dst, metadata={"format": "pt"})
    fd = os.open(dst, os.O_RDONLY)  # durable, like the converter it is compared with
    os.fsync(fd)
    os.close(fd)


if __name__ == "__main__":
    args = sys.argv[1:]
    mmap = args[0] == "--mmap"
    main(*args[int(mmap) :], mmap)
