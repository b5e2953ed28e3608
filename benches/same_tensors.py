"""Check that two safetensors files hold the same tensors: the same names, dtypes and
shapes, and every value bit for bit, except that a NaN may be any NaN (two tools may
encode NaNs differently); tensor order and header layout are ignored.

compare.py runs it (in a child: numpy) on each DCP peer's first output against stcast's.
Exit 0 when they are the same, 1 naming the first difference.

usage: python benches/same_tensors.py A.safetensors B.safetensors
"""

from __future__ import annotations

import json
import mmap
import struct
import sys

import numpy as np

PIECE = 64 << 20
NAN_CHECK = {"BF16": (np.uint16, 0x7F80, 0x007F), "F16": (np.uint16, 0x7C00, 0x03FF)}
NAN_CHECK["F32"] = (np.uint32, 0x7F800000, 0x007FFFFF)


def header(m: mmap.mmap) -> tuple[dict, int]:
    (n,) = struct.unpack("<Q", m[:8])
    h = json.loads(m[8 : 8 + n])
    h.pop("__metadata__", None)
    return h, 8 + n


def nan(bits: np.ndarray, exp: int, man: int) -> np.ndarray:
    return ((bits & exp) == exp) & ((bits & man) != 0)


def main(a: str, b: str) -> int:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        ma = mmap.mmap(fa.fileno(), 0, prot=mmap.PROT_READ)
        mb = mmap.mmap(fb.fileno(), 0, prot=mmap.PROT_READ)
        ha, ba = header(ma)
        hb, bb = header(mb)
        if set(ha) != set(hb):
            print(
                f"names differ: only in A {sorted(set(ha) - set(hb))[:5]}, "
                f"only in B {sorted(set(hb) - set(ha))[:5]}"
            )
            return 1
        for name, ta in ha.items():
            tb = hb[name]
            if (ta["dtype"], ta["shape"]) != (tb["dtype"], tb["shape"]):
                print(f"{name}: {ta['dtype']} {ta['shape']} against {tb['dtype']} {tb['shape']}")
                return 1
            (a0, a1), (b0, b1) = ta["data_offsets"], tb["data_offsets"]
            if a1 - a0 != b1 - b0:
                print(f"{name}: {a1 - a0} bytes against {b1 - b0}")
                return 1
            for at in range(0, a1 - a0, PIECE):
                n = min(PIECE, a1 - a0 - at)
                pa, pb = ma[ba + a0 + at : ba + a0 + at + n], mb[bb + b0 + at : bb + b0 + at + n]
                if pa == pb:
                    continue
                check = NAN_CHECK.get(ta["dtype"])
                if check is None:
                    print(f"{name}: bytes differ ({ta['dtype']})")
                    return 1
                kind, exp, man = check
                xa, xb = np.frombuffer(pa, kind), np.frombuffer(pb, kind)
                bad = (xa != xb) & ~(nan(xa, exp, man) & nan(xb, exp, man))
                if bad.any():
                    i = int(np.argmax(bad))
                    print(
                        f"{name}: value {at // xa.itemsize + i} differs: "
                        f"{int(xa[i]):#x} against {int(xb[i]):#x}"
                    )
                    return 1
    print(f"same: {len(ha)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
