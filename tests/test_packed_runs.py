"""Packed 4-/8-bit checkpoints back to bf16/fp16 in runs (issue 32): compressed-tensors
NVFP4, MXFP4, W4A16 (sym, asym), W8A16 as llm-compressor's `model_free_ptq` wrote them, and
gpt-oss MXFP4 blocks (tests/fixtures/packed: each tensor's reference hash, made by
compressed-tensors' and transformers' own dequantization), as lone files, folders and
re-sharded folders; verify passes on each output and fails once a packed byte of the source
changes. A W4A16 file packed here by numpy is checked against a numpy reference of the
compressed-tensors arithmetic. Layouts stcast does not read are refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_one_error_line, main_in_process, tensor_bytes, write_safetensors

FIX = Path(__file__).parent / "fixtures" / "packed"
EXPECTED = json.loads((FIX / "expected-dequant.json").read_text())["folders"]
FOLDERS = sorted(EXPECTED)
TO = {"bf16": ("bf16", []), "fp16": ("fp16", ["--from-bf16"])}


def hashes(folder: Path) -> dict[str, tuple[str, list[int], str]]:
    """Every tensor of every safetensors file under `folder` (or of one file)."""
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors"))
    out = {}
    for f in files:
        for name, (dtype, shape, data) in tensor_bytes(f).items():
            assert name not in out, name
            out[name] = (dtype, shape, hashlib.sha256(data).hexdigest())
    return out


def want(folder: str, to: str) -> dict[str, tuple[str, list[int], str]]:
    return {k: (v["dtype"], v["shape"], v["sha256"]) for k, v in EXPECTED[folder][to].items()}


def run(*args: object) -> tuple[int, str, str]:
    return main_in_process(*args)


def flip_packed_byte(path: Path) -> str:
    """Change one byte of the first packed tensor of a safetensors file; its name."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k.endswith(("_packed", "_blocks")))
    raw[8 + n + header[name]["data_offsets"][0] + 3] ^= 0x21
    path.write_bytes(bytes(raw))
    return name


@pytest.mark.parametrize("to", sorted(TO))
@pytest.mark.parametrize("folder", FOLDERS)
def test_lone_file_equals_the_reference(tmp_path, folder, to):
    src = FIX / folder / "model.safetensors"
    out = tmp_path / "out.safetensors"
    name, extra = TO[to]
    rc, _, err = run("convert", src, out, "--to", name, *extra)
    assert rc == 0, err
    assert hashes(out) == want(folder, to)
    rc, _, err = run("verify", src, out, *extra)
    assert rc == 0, err


@pytest.mark.parametrize("folder", FOLDERS)
def test_folder_and_reshard(tmp_path, folder):
    src = FIX / folder
    runs = [(tmp_path / "out", []), (tmp_path / "sharded", ["--max-shard-size", "40KB"])]
    for dst, extra in runs:
        rc, _, err = run("convert", src, dst, *extra)
        assert rc == 0, err
        assert hashes(dst) == want(folder, "bf16")
        config = json.loads((dst / "config.json").read_text())
        assert "quantization_config" not in config
        assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
        index = dst / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            assert sorted(weight_map) == sorted(want(folder, "bf16"))
            for name, shard in weight_map.items():
                assert name in tensor_bytes(dst / shard)
        rc, _, err = run("verify", src, dst)
        assert rc == 0, err
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1


@pytest.mark.parametrize("folder", FOLDERS)
def test_verify_fails_on_a_changed_packed_byte(tmp_path, folder):
    src = tmp_path / "src"
    shutil.copytree(FIX / folder, src)
    out = tmp_path / "out"
    rc, _, err = run("convert", src, out)
    assert rc == 0, err
    flipped = flip_packed_byte(src / "model.safetensors")
    rc, _, err = run("verify", src, out)
    assert rc == 1
    line = assert_one_error_line(err)
    assert flipped in line or flipped.rsplit("_", 1)[0] in line


# --- a W4A16 file packed here --------------------------------------------------------------


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """compressed-tensors 0.19's `pack_to_int32` along rows: code + 2^(bits-1), `bits` bits
    each, densely from bit 0 of word 0 (a field may span two words), words padded."""
    rows, cols = codes.shape
    words = -(-cols * bits // 32)
    out = np.zeros((rows, words), np.uint64)
    u = (codes.astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    for c in range(cols):
        at = c * bits
        k, off = at // 32, at % 32
        out[:, k] |= (u[:, c] << np.uint64(off)) & np.uint64(0xFFFFFFFF)
        if off + bits > 32:
            out[:, k + 1] |= u[:, c] >> np.uint64(32 - off)
    return out.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("asym", [False, True])
def test_numpy_packed_int_against_a_numpy_reference(tmp_path, bits, asym):
    rng = np.random.default_rng(bits * 2 + asym)
    rows, cols, group = 40, 96, 32
    groups = cols // group
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(lo, hi + 1, (rows, cols))
    s = rng.uniform(1e-3, 0.1, (rows, groups)).astype(np.float32)
    zp = rng.integers(lo, hi + 1, (rows, groups)) if asym else np.zeros((rows, groups), int)
    tensors = {
        "m.weight_packed": ("I32", list(pack_rows(q, bits).shape), pack_rows(q, bits)),
        "m.weight_scale": ("F32", [rows, groups], s),
        "m.weight_shape": ("I64", [2], np.array([rows, cols], np.int64)),
        "n.weight": ("F32", [4, 4], np.ones((4, 4), np.float32)),
    }
    if asym:
        zpp = pack_rows(zp.T, bits).T.copy()  # packed along rows: [ceil(O*bits/32), G]
        tensors["m.weight_zero_point"] = ("I32", list(zpp.shape), zpp)
    src = write_safetensors(tmp_path / "q.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    rc, _, err = run("convert", src, out)
    assert rc == 0, err
    got = tensor_bytes(out)
    assert sorted(got) == ["m.weight", "n.weight"]
    dtype, shape, data = got["m.weight"]
    assert (dtype, shape) == ("BF16", [rows, cols])
    x = (q - np.repeat(zp, group, axis=1)).astype(np.float32)
    ref = (x * np.repeat(s, group, axis=1)).astype(ml_dtypes.bfloat16)
    assert data == ref.tobytes()
    rc, _, err = run("verify", src, out)
    assert rc == 0, err
    # A weight_shape that its packed words cannot hold is refused, naming it.
    bad = dict(tensors)
    bad["m.weight_shape"] = ("I64", [2], np.array([rows, cols * 3], np.int64))
    src2 = write_safetensors(tmp_path / "bad.safetensors", bad)
    rc, _, err = run("convert", src2, tmp_path / "bad-out.safetensors")
    assert rc == 1
    line = assert_one_error_line(err)
    assert "m.weight" in line and "pack-quantized" in line
    assert "allow" not in line


def test_gptq_and_unpaired_packs_are_refused_naming_them(tmp_path):
    gptq = write_safetensors(
        tmp_path / "gptq.safetensors",
        {
            "m.qweight": ("I32", [4, 8], np.zeros((4, 8), np.int32)),
            "m.qzeros": ("I32", [1, 4], np.zeros((1, 4), np.int32)),
            "m.scales": ("F16", [1, 8], np.ones((1, 8), np.float16)),
            "n.weight": ("F32", [2, 2], np.ones((2, 2), np.float32)),
        },
    )
    rc, _, err = run("convert", gptq, tmp_path / "o.safetensors")
    assert rc == 1
    line = assert_one_error_line(err)
    assert "GPTQ" in line and "m.q" in line and "allow" not in line
    lone = write_safetensors(
        tmp_path / "lone.safetensors",
        {
            "m.weight_packed": ("U8", [4, 8], np.zeros((4, 8), np.uint8)),
            "n.weight": ("F32", [2, 2], np.ones((2, 2), np.float32)),
        },
    )
    rc, _, err = run("convert", lone, tmp_path / "o2.safetensors")
    assert rc == 1
    line = assert_one_error_line(err)
    assert "m.weight_packed" in line and "allow" not in line
    assert not (tmp_path / "o.safetensors").exists()
    assert not (tmp_path / "o2.safetensors").exists()


MISMATCHES = [
    ("llama-bf16.w4a16", {"num_bits": 8}, "num_bits 8", "4-bit codes"),
    ("llama-bf16.w4a16", {"group_size": 64}, "group_size 64", "a scale per 128 columns"),
    ("llama-bf16.w4a16", {"symmetric": False}, "symmetric false", "no zero point"),
    ("llama-bf16.w4a16-asym", {"symmetric": True}, "symmetric true", "a zero point"),
    ("llama-bf16.w8a16", {"num_bits": 4}, "num_bits 4", "8-bit codes"),
    ("llama-bf16.nvfp4a16", {"group_size": 32}, "group_size 32", "a scale per 16 columns"),
    ("llama-bf16.mxfp4a16", {"group_size": 16}, "group_size 16", "a scale per 32 columns"),
]


@pytest.mark.parametrize(("folder", "edit", "says", "holds"), MISMATCHES)
@pytest.mark.parametrize("extra", [[], ["--max-shard-size", "40KB"]])
def test_a_config_that_does_not_describe_its_packs_is_refused(
    tmp_path, folder, edit, says, holds, extra
):
    """The packed weights' config is checked against their tensors before anything is
    written: one line naming the weights file, the tensor, the config and both sides."""
    src = tmp_path / "src"
    shutil.copytree(FIX / folder, src)
    config = json.loads((src / "config.json").read_text())
    (group,) = config["quantization_config"]["config_groups"].values()
    group["weights"].update(edit)
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    rc, _, err = run("convert", src, dst, *extra)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert str(src / "model.safetensors") in line and "config.json" in line, line
    assert "weight_packed`" in line and says in line and holds in line, line
    assert "pack-quantized" in line and "allow" not in line and "--" not in line, line
    assert not dst.exists()


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_packed_weight_beside_a_tensor_of_its_output_name_is_refused(tmp_path, folder):
    """`X.weight_packed` (or gpt-oss `X_blocks`) comes out as `X.weight` (`X`): a tensor of
    that name beside it would make a file with one name twice. Refused before anything is
    written, for a file, a folder and a re-sharding alike."""
    src = tmp_path / "src"
    shutil.copytree(FIX / folder, src)
    tensors = tensor_bytes(src / "model.safetensors")
    packed = next(k for k in tensors if k.endswith(("_packed", "_blocks")))
    out = packed.removesuffix("_packed").removesuffix("_blocks")
    tensors[out] = ("BF16", [2], b"\0" * 4)
    write_safetensors(src / "model.safetensors", tensors)
    index = src / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"][out] = "model.safetensors"
        index.write_text(json.dumps(doc))
    for what, extra in [
        (src / "model.safetensors", []),
        (src, []),
        (src, ["--max-shard-size", "40KB"]),
    ]:
        dst = tmp_path / "out"
        rc, _, err = run("convert", what, dst, *extra)
        line = assert_one_error_line(err)
        assert rc == 1 and "one name, two tensors" in line and f"`{out}`" in line, line
        assert not dst.exists(), what


@pytest.mark.parametrize("folder", FOLDERS)
def test_strip_prefix_on_a_packed_file(tmp_path, folder):
    """`--strip-prefix model.` on a packed file: the same tensors as without, renamed (the
    `weight_shape` values read with the header follow their names); verify passes."""
    src = FIX / folder / "model.safetensors"
    plain, stripped = tmp_path / "plain.safetensors", tmp_path / "stripped.safetensors"
    assert run("convert", "-q", src, plain) == (0, "", "")
    rc, _, err = run("convert", "-q", src, stripped, "--strip-prefix", "model.")
    assert (rc, err) == (0, "")
    want = {k.removeprefix("model."): v for k, v in hashes(plain).items()}
    assert hashes(stripped) == want
    rc, _, err = run("verify", "-q", src, stripped)
    assert (rc, err) == (0, "")


# --- what a run refuses around packed weights, in one line -----------------------------------


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("part", ["weight", "scale"])
def test_keep_matching_a_packed_weight_or_its_scale_is_refused(tmp_path, folder, part):
    """`--keep` of a packed weight (or its scale) cannot keep it: its codes mean nothing
    without the scales, and the output's config loses its quantization_config. It was
    silently ignored, even with --strict; now refused before anything is written, naming
    the file, the tensor and the pattern, suggesting no flag."""
    src = FIX / folder / "model.safetensors"
    names = sorted(tensor_bytes(src))
    packed = next(k for k in names if k.endswith(("_packed", "_blocks")))
    stem = packed.removesuffix("_packed").removesuffix("_blocks")
    tensor = packed if part == "weight" else f"{stem}_scale" if stem + "_scale" in names else ""
    tensor = tensor or f"{stem}_scales"
    assert tensor in names
    for what in (src, src.parent):
        for strict in ([], ["--strict"]):
            dst = tmp_path / "out"
            rc, _, err = run("convert", what, dst, "--keep", tensor, *strict)
            assert rc == 1, err
            line = assert_one_error_line(err)
            assert str(src) in line and f"`{tensor}`" in line, line
            assert f"--keep pattern `{tensor}`" in line, line
            assert "allow" not in line and "--strict" not in line, line
            assert not dst.exists()
    # Patterns that match no quantized tensor still keep what they match.
    dst = tmp_path / "kept.safetensors"
    rc, _, err = run("convert", src, dst, "--keep", "*norm*")
    assert rc == 0, err


@pytest.mark.parametrize(
    ("tensor", "dtype", "role"),
    [
        ("z.weight_shape", "I64", "a shape (I64)"),
        ("z.weight_global_scale", "U8", "a global scale (U8)"),
        ("z.weight_global_scale", "F32", "a global scale (F32)"),
        ("z.weight_scale", "U8", "a scale (U8)"),
        ("z.weight_zero_point", "I32", "a zero point (I32)"),
    ],
)
def test_a_stray_companion_names_what_it_is(tmp_path, tensor, dtype, role):
    """A scale, global scale, zero point or shape whose packed weight is not in its file is
    refused naming what it is (it said "an FP8 scale" for each; a stray weight_shape or
    global scale was copied), for a file and a folder."""
    folder = "llama-bf16.w4a16"
    src = tmp_path / "src"
    shutil.copytree(FIX / folder, src)
    tensors = tensor_bytes(src / "model.safetensors")
    size = {"I64": 16, "U8": 1, "F32": 4, "I32": 4}[dtype]
    shape = [2] if dtype == "I64" else [1]
    tensors[tensor] = (dtype, shape, b"\x01" * size)
    write_safetensors(src / "model.safetensors", tensors)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][tensor] = "model.safetensors"
    index.write_text(json.dumps(doc))
    for what in (src / "model.safetensors", src):
        dst = tmp_path / "out"
        rc, _, err = run("convert", what, dst)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert f"`{tensor}` is {role} whose weight is not in this file" in line, line
        assert "FP8" not in line and "allow" not in line, line
        assert not dst.exists()


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ({"num_bits": "4"}, 'says `num_bits` "4", not a whole number'),
        (
            {"format": "nvfp4-pack-quantized"},
            'says format "nvfp4-pack-quantized", which holds float 4-bit weights, with int '
            "4-bit ones",
        ),
        ({"type": "fp"}, 'says `type` "fp", neither int nor float'),
    ],
)
def test_a_config_of_another_scheme_says_what_it_is(tmp_path, edit, says):
    """A W4A16 folder whose config names another packed format, or `num_bits` as a
    string: one line saying which group and what (it was a generic "not a scheme")."""
    src = tmp_path / "src"
    shutil.copytree(FIX / "llama-bf16.w4a16", src)
    config = json.loads((src / "config.json").read_text())
    ((name, group),) = config["quantization_config"]["config_groups"].items()
    target = group if "format" in edit else group["weights"]
    target.update(edit)
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    rc, _, err = run("convert", src, dst)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert f"config group `{name}` {says}" in line, line
    assert "allow" not in line, line
    assert not dst.exists()


# --- several config groups: each module by its group's targets --------------------------------


def mixed_folder(tmp_path: Path) -> Path:
    """A mixed-precision folder: the attention projections of the W4A16 fixture, the MLP
    ones of the W8A16 fixture (both model_free_ptq of one source), and a config of two
    groups, `re:.*self_attn.*` INT4 and `re:.*mlp.*` INT8 (format mixed-precision)."""
    w4 = tensor_bytes(FIX / "llama-bf16.w4a16" / "model.safetensors")
    w8 = tensor_bytes(FIX / "llama-bf16.w8a16" / "model.safetensors")
    tensors = {k: v for k, v in w4.items() if ".mlp." not in k}
    tensors.update({k: v for k, v in w8.items() if ".mlp." in k})
    src = tmp_path / "mixed"
    src.mkdir()
    write_safetensors(src / "model.safetensors", tensors)
    config = json.loads((FIX / "llama-bf16.w4a16" / "config.json").read_text())
    q = config["quantization_config"]
    (w4a16,) = q["config_groups"].values()
    w8a16 = json.loads(json.dumps(w4a16))
    w8a16["weights"]["num_bits"] = 8
    w4a16["targets"], w8a16["targets"] = ["re:.*self_attn.*"], ["re:.*mlp.*"]
    q["config_groups"] = {"group_0": w4a16, "group_1": w8a16}
    q["format"] = "mixed-precision"
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_a_mixed_precision_folder_equals_its_references(tmp_path):
    """Each module is matched to its own group (`re:` targets, `ignore`): the INT4 and INT8
    weights come out as compressed-tensors dequantized each fixture."""
    src = mixed_folder(tmp_path)
    expected = {
        k: v
        for folder in ("llama-bf16.w4a16", "llama-bf16.w8a16")
        for k, v in want(folder, "bf16").items()
        if (".mlp." in k) == folder.endswith("w8a16")
    }
    dst = tmp_path / "out"
    rc, _, err = run("convert", src, dst)
    assert rc == 0, err
    assert hashes(dst) == expected
    rc, _, err = run("verify", src, dst)
    assert rc == 0, err


@pytest.mark.parametrize(
    ("edit", "tensor", "says"),
    [
        # The INT8 group says 4 bits: the INT4 group would describe the MLP weights, but it
        # does not target them (it passed while a weight had only to agree with one group).
        ((1, "weights", "num_bits", 4), "mlp", "num_bits 4"),
        ((1, "targets", None, ["re:.*up_proj"]), "mlp", "no config group's `targets` names"),
        ((0, "targets", None, ["Linear"]), "mlp", "num_bits 4"),
        ((None, "ignore", None, ["lm_head", "re:.*o_proj"]), "o_proj", "`ignore` entry"),
        ((0, "targets", None, ["re:(?<=x)y"]), "", "cannot match as compressed-tensors"),
    ],
)
def test_each_module_is_judged_by_the_group_that_targets_it(tmp_path, edit, tensor, says):
    src = mixed_folder(tmp_path)
    config = json.loads((src / "config.json").read_text())
    q = config["quantization_config"]
    group, key, sub, value = edit
    at = q if group is None else list(q["config_groups"].values())[group]
    if sub is None:
        at[key] = value
    else:
        at[key][sub] = value
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    rc, _, err = run("convert", src, dst)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert says in line and tensor in line and "config.json" in line, line
    assert "allow" not in line, line
    assert not dst.exists()
