#!/usr/bin/env python3
"""compare.py --fp8's dequantization check: a compressed-tensors FP8 folder FP8 (as
model_free_ptq wrote it) dequantized to bf16 by compressed-tensors' own reference path
against stcast's `convert FP8 OUT --to bf16`, every tensor bit for bit.

The reference is tests/fixtures/fp8/make_fp8.py's `dequant_ct`: CompressedTensorsDequantizer
(NaiveQuantizationCompressor.decompress -> dequantize: q.to(scale.dtype) * scale, then
.to(bfloat16)); the tensors it does not touch are cast to bfloat16. Prints the counts; exit 1
on a difference (names, dtypes, shapes or bits). Run with the llm-compressor venv's Python
(/work/venv-llmc: compressed-tensors 0.19.0, torch 2.14).

usage: fp8_dequant_check.py FP8 OUT
"""

import os
import sys
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (  # noqa: E402
    CompressedTensorsDequantizer,
)
from safetensors.torch import load_file  # noqa: E402


def tensors(folder):
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def main(fp8, got_dir):
    source = tensors(fp8)
    weights = sorted(k for k, v in source.items() if v.dtype == torch.float8_e4m3fn)
    conv = CompressedTensorsDequantizer(str(fp8), dtype=torch.bfloat16)
    ref = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
        for k, v in conv.validate(dict(source)).items()
    }
    got = tensors(got_dir)
    bad = []
    if sorted(ref) != sorted(got):
        bad.append(
            f"names differ: only ref {sorted(set(ref) - set(got))[:5]}, "
            f"only stcast {sorted(set(got) - set(ref))[:5]}"
        )
    same = 0
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(f"{k}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}")
        elif not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            n = int((a.view(torch.int16) != b.view(torch.int16)).sum())
            bad.append(f"{k}: {n} of {a.numel()} values differ")
        else:
            same += 1
    deq = sum(1 for k in weights if k in got and k in ref)
    print(
        f"dequant: {same} of {len(ref)} tensors bit-identical to compressed-tensors "
        f"({len(weights)} FP8 weights dequantized, {len(ref) - len(weights)} others cast)"
    )
    for line in bad[:10]:
        print("DIFF", line)
    return 1 if bad or deq != len(weights) else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    sys.exit(main(*sys.argv[1:]))
