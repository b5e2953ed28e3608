#!/usr/bin/env python3
"""Peer for benchmarks: compressed-tensors' own dequantization of a packed checkpoint
(NVFP4, MXFP4, INT4/INT8 pack-quantized) back to bf16 or fp16, the reference stcast's
packed inputs match bit for bit (docs/rounding.md).

`convert_checkpoint(SRC, DST, CompressedTensorsDequantizer(SRC, dtype=T), max_workers=1,
device="cpu")` (compressed-tensors 0.19's `entrypoints.convert`: per shard, load every
tensor, each module's compressor `decompress`, `.to(T)`, `save_file`; `config.json` without
`quantization_config`, the index rewritten) with CUDA hidden. Its output files are then
fsynced, so that it does the same work as stcast. Run with the Python of the llm-compressor
venv (/work/venv-llmc: llmcompressor 0.14.0.1, compressed-tensors 0.19.0, torch 2.14). A
peer for benchmarks, not part of stcast.

usage: ct_dequantize.py SRC DST [bf16|fp16]
"""

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from compressed_tensors.entrypoints.convert.convert_checkpoint import (  # noqa: E402
    convert_checkpoint,
)
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (  # noqa: E402
    CompressedTensorsDequantizer,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(src, dst, to="bf16"):
    dequantizer = CompressedTensorsDequantizer(src, dtype=DTYPES[to])
    convert_checkpoint(src, dst, dequantizer, max_workers=1, device="cpu")
    for name in sorted(os.listdir(dst)):  # durable, like the converter it is compared with
        fd = os.open(os.path.join(dst, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__.strip().splitlines()[-1])
    main(*sys.argv[1:])
