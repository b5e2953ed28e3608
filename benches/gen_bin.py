"""Turn a generated safetensors checkpoint into a PyTorch checkpoint (`torch.save`'s zip
format) holding the same tensors, for compare.py's `.bin` case; no torch needed.

Each tensor becomes one storage, copied 64 MiB at a time from a map of the input (so a
4 GiB input needs no more memory than that), laid out as torch lays out its zips (stored
entries aligned to 64 bytes, ZIP64 records): tests/torchfile.py writes it.

usage: python benches/gen_bin.py SRC.safetensors DST.bin
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torchfile as tf  # noqa: E402

CHUNK = 64 << 20
DTYPES = {"F32": "float32", "F16": "float16", "F64": "float64", "I64": "int64"}


def main(src: str, dst: str) -> None:
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        (n,) = struct.unpack("<Q", m[:8])
        header = json.loads(m[8 : 8 + n])
        base = 8 + n
        obj, storages = {}, {}
        for i, (name, info) in enumerate((k, v) for k, v in header.items() if k != "__metadata__"):
            a, b = info["data_offsets"]
            key = str(i)
            shape = tuple(info["shape"])
            obj[name] = tf.tensor(key, DTYPES[info["dtype"]], shape)

            def write(out, a: int = base + a, b: int = base + b) -> None:
                for at in range(a, b, CHUNK):
                    out.write(m[at : min(at + CHUNK, b)])

            storages[key] = (b - a, write)
        tf.write_zip(dst, tf.Ordered(list(obj.items())), storages)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
