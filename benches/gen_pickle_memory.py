"""Checkpoints whose pickle, not their data, is large (issue 23, point 6): the memory and
time the unpickler takes per object. No torch needed (tests/torchfile.py writes them).

    python benches/gen_pickle_memory.py OUT_DIR [--scale 1.0]
    /usr/bin/time -v stcast convert OUT_DIR/views.pt /tmp/o.safetensors   # peak RSS
    python benches/compare.py --pickle-memory --pickle-dir OUT_DIR --repeats 3   # all, medians

Cases (at scale 1):
- views.pt: 500,000 tensors, each a view (one float) of one storage;
- storages.pt: 500,000 tensors, each with its own storage of one float;
- ints.pt: one tensor, and a list of 15,000,000 ints outside it;
- string.pt: one tensor, and a 200 MB string outside it.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torchfile as tf  # noqa: E402


def tensor_ops(name: str, key: str, offset: int) -> bytes:
    out = bytearray()
    tf._emit(name, out)
    tf._emit(tf.tensor(key, "float32", (1,), offset=offset, numel=1), out)
    return bytes(out)


def many(path: str, n: int, shared: bool) -> None:
    # One tensor's opcodes as a template, its name, key and offset patched in.
    parts = [b"\x80\x02}("]
    for i in range(n):
        key = "0" if shared else str(i)
        parts.append(tensor_ops(f"t{i}", key, i if shared else 0))
    parts.append(b"u.")
    pkl = b"".join(parts)
    if shared:
        storages = {"0": struct.pack("<f", 1.0) * n}
    else:
        storages = {str(i): struct.pack("<f", 1.0) for i in range(n)}
    # numel of a shared storage: the pickle names 1 per view; the storage must hold n.
    if shared:
        pkl = pkl.replace(
            b"X\x03\x00\x00\x00cpuJ\x01\x00\x00\x00",
            b"X\x03\x00\x00\x00cpuJ" + struct.pack("<i", n),
        )
    tf.write_zip(path, None, storages, pickle=pkl)


def outside(path: str, extra: bytes) -> None:
    pkl = b"\x80\x02}(" + tensor_ops("w", "0", 0) + tf.dumps("extra")[2:-1] + extra + b"u."
    tf.write_zip(path, None, {"0": struct.pack("<f", 1.0)}, pickle=pkl)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    n = int(500_000 * a.scale)
    many(os.path.join(a.out, "views.pt"), n, shared=True)
    many(os.path.join(a.out, "storages.pt"), n, shared=False)
    ints = int(15_000_000 * a.scale)
    outside(os.path.join(a.out, "ints.pt"), b"](" + b"M\x01\x01" * ints + b"e")
    size = int(200_000_000 * a.scale)
    outside(os.path.join(a.out, "string.pt"), b"\x8d" + struct.pack("<Q", size) + b"a" * size)


if __name__ == "__main__":
    main()
