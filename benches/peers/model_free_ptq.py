#!/usr/bin/env python3
"""Peer for benchmarks: llm-compressor's `model_free_ptq`, the reference FP8 writer that
stcast's `--to fp8` / `--to fp8-block` match byte for byte.

`model_free_ptq(model_stub=SRC, save_directory=DST, scheme=SCHEME, ignore=["lm_head",
"re:.*embed_tokens.*"], max_workers=1, device="cpu")` with CUDA hidden (the eager CPU path,
as tests/fixtures/fp8/make_fp8.py ran it), SCHEME FP8_DYNAMIC or FP8_BLOCK. Its output
files are then fsynced, so that it does the same work as stcast. Run with the Python of the
llm-compressor venv (/work/venv-llmc: llmcompressor 0.14.0.1, compressed-tensors 0.19.0,
torch 2.14). A peer for benchmarks, not part of stcast.

usage: model_free_ptq.py SRC DST SCHEME
"""

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""

from llmcompressor import model_free_ptq  # noqa: E402

IGNORE = ["lm_head", "re:.*embed_tokens.*"]


def main(src, dst, scheme):
    model_free_ptq(
        model_stub=src,
        save_directory=dst,
        scheme=scheme,
        ignore=IGNORE,
        max_workers=1,
        device="cpu",
    )
    for name in sorted(os.listdir(dst)):  # durable, like the converter it is compared with
        fd = os.open(os.path.join(dst, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__.strip().splitlines()[-1])
    main(*sys.argv[1:])
