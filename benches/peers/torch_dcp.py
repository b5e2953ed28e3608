#!/usr/bin/env python3
"""Peer for benchmarks: a torch.distributed.checkpoint (DCP) folder to bf16 safetensors with
torch, as users are told to do it.

Default: `format_utils.dcp_to_torch_save(SRC, TMP)` (the whole checkpoint, optimizer
included, read into memory and written as one torch.save file TMP beside DST), then
`torch.load(TMP, weights_only=True)["model"]`, each floating tensor `.to(torch.bfloat16)`,
`safetensors.torch.save_file` with `{"format": "pt"}`, TMP deleted.
--inmem: no temporary file: `state_dict_loader._load_state_dict_from_keys({"model"},
checkpoint_id=SRC)` (an `_EmptyStateDictLoadPlanner` restricted to the model's keys, in
this process), then the same. The output is fsynced so that it does the same work as
stcast. A peer for benchmarks, not part of stcast.

usage: torch_dcp.py [--inmem] SRC DST
"""

import os
import sys
import warnings

import torch
from safetensors.torch import save_file

FLOATS = (torch.float32, torch.float16, torch.float64)
KEY = "model"


def load(src, dst, inmem):
    if inmem:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        return _load_state_dict_from_keys({KEY}, checkpoint_id=src)[KEY]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = dst + ".tmp.pt"
    try:
        dcp_to_torch_save(src, tmp)
        return torch.load(tmp, map_location="cpu", weights_only=True)[KEY]
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(src, dst, inmem):
    warnings.simplefilter("ignore")  # "no process group: loading locally", every run
    state = load(src, dst, inmem)
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
    inmem = args[0] == "--inmem"
    main(*args[int(inmem) :], inmem)
