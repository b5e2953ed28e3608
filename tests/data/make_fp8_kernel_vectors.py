"""Writes tests/data/fp8-kernel-vectors.json, the slim FP8 vectors `rust/fp8/tests.rs` reads.

    python3 tests/data/make_fp8_kernel_vectors.py FP8_FIXTURES_DIR

FP8_FIXTURES_DIR is the fixture folder written by real torch 2.14 + llm-compressor
(`kernel_vectors.json` and the `*.fp8-*` folders; see its README.md). Standard library only.
Everything is hex bits (little-endian bytes for `q` and `out`, one string per row).

- `codes`: f32 bits of each of the 256 e4m3 bytes (torch's `.to(float32)`).
- `casts`: per input dtype, `in_bits` then the e4m3 byte, of all of `casts_rne` (specials,
  every e4m3 value, every midpoint and its neighbours in f32 / bf16 / f16, negated).
- `groups`: the eager groups (rows; for tiles the first 32 elements) with D, w, amax,
  the scale written, y rounded to D and the bytes model_free_ptq wrote.
- `dequant`: rows of quantized weights with their scales and the bf16 that
  compressed-tensors' own dequantizer gave (`expected-dequant-bf16.safetensors`).
"""

import json
import struct
import sys
from pathlib import Path

SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}


def read_st(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n :]
    return {
        k: (v["dtype"], v["shape"], body[v["data_offsets"][0] : v["data_offsets"][1]])
        for k, v in header.items()
    }


def f32_of(dtype, b):
    if dtype == "F32":
        return struct.unpack("<f", b)[0]
    if dtype == "BF16":
        return struct.unpack("<f", b"\0\0" + b)[0]
    return struct.unpack("<e", b)[0]


def e4m3(b):
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 15, b & 7
    return s * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def bf16_bits(x):
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def dequant_rows(folder, tensor, layout, want):
    """`want` rows of `tensor`: the rows where an f32 product then bf16 differs from the
    expected output most, then the first rows."""
    model = read_st(folder / "model.safetensors")
    expected = read_st(folder / "expected-dequant-bf16.safetensors")
    qd, (rows, cols), q = model[tensor]
    sname = tensor + ("_scale_inv" if folder.name.startswith("odd-deepseek") else "_scale")
    sd, sshape, sb = model[sname]
    ssz = SIZES[sd]
    scales = [f32_of(sd, sb[i : i + ssz]) for i in range(0, len(sb), ssz)]
    out = expected[tensor][2]
    tcols = sshape[1] if layout == "block" else 1
    diffs = []
    for r in range(rows):
        d = 0
        for c in range(cols):
            s = scales[(r // 128) * tcols + c // 128] if layout == "block" else scales[r]
            naive = bf16_bits(struct.unpack("<f", struct.pack("<f", e4m3(q[r * cols + c]) * s))[0])
            d += naive != struct.unpack("<H", out[2 * (r * cols + c) : 2 * (r * cols + c) + 2])[0]
        diffs.append((d, r))
    picked = [r for d, r in sorted(diffs, key=lambda t: (-t[0], t[1])) if d][: want // 2]
    spread = [0, 3, rows // 2 + 5, rows - 1]
    picked += [r for r in dict.fromkeys(spread) if r not in picked][: want - len(picked)]
    res = []
    for r in sorted(picked):
        srow = (
            sb[(r // 128) * tcols * ssz : ((r // 128) + 1) * tcols * ssz]
            if layout == "block"
            else sb[r * ssz : (r + 1) * ssz]
        )
        res.append(
            {
                "fixture": folder.name,
                "tensor": tensor,
                "row": r,
                "cols": cols,
                "layout": layout,
                "s_dtype": sd,
                "scales": srow.hex(),
                "q": q[r * cols : (r + 1) * cols].hex(),
                "out_bf16": out[2 * r * cols : 2 * (r + 1) * cols].hex(),
                "f32_product_diffs": diffs[r][0],
            }
        )
    return res


def main():
    src = Path(sys.argv[1])
    kv = json.loads((src / "kernel_vectors.json").read_text())
    out = {
        "about": (
            "made by tests/data/make_fp8_kernel_vectors.py from the FP8 fixtures' "
            "kernel_vectors.json and expected-dequant-bf16 files (torch {}, llmcompressor {}, "
            "compressed-tensors {})"
        ).format(
            kv["versions"]["torch"],
            kv["versions"]["llmcompressor"],
            kv["versions"]["compressed_tensors"],
        ),
        "codes": [c["f32_bits"] for c in kv["e4m3fn_codes"]],
        "casts": {
            d: [c["in_bits"] + c["e4m3"] for c in kv["casts_rne"][d]]
            for d in ("f32", "bf16", "f16")
        },
        "groups": [
            {
                "fixture": g["fixture"],
                "tensor": g["tensor"],
                "group": g["group"],
                "D": g["D"],
                "w": "".join(g["w_bits"]),
                "amax": g["amax_bits"],
                "scale": g["scale_written_bits"],
                "y_D": "".join(g["y_D_bits"]),
                "q": "".join(g["q_written"]),
            }
            for g in kv["eager_groups"]
        ],
        "dequant": [],
    }
    for g in kv["eager_groups"]:
        assert g["q_written"] == g["q_repro"] and g["scale_bits"] == g["scale_written_bits"]
    for folder, tensor, layout in [
        ("llama-fp32.fp8-dynamic", "model.layers.0.self_attn.q_proj.weight", "channel"),
        ("llama-fp32.fp8-block", "model.layers.1.mlp.up_proj.weight", "block"),
        ("llama-bf16.fp8-dynamic", "model.layers.0.self_attn.q_proj.weight", "channel"),
        ("llama-bf16.fp8-block", "model.layers.0.mlp.down_proj.weight", "block"),
        ("odd-fp16.fp8-dynamic", "model.layers.0.self_attn.q_proj.weight", "channel"),
        ("odd-fp16.fp8-dynamic", "model.layers.0.mlp.down_proj.weight", "channel"),
        ("odd-fp16.fp8-block-contiguous", "model.layers.0.mlp.down_proj.weight", "block"),
        ("odd-fp16.fp8-block-contiguous", "model.layers.0.mlp.up_proj.weight", "block"),
        ("odd-deepseek-fp8", "model.layers.0.mlp.up_proj.weight", "block"),
    ]:
        out["dequant"] += dequant_rows(src / folder, tensor, layout, 4)
    dst = Path(__file__).with_name("fp8-kernel-vectors.json")
    dst.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(dst, dst.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
