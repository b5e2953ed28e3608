"""Fused MoE experts under FP8 targets (issue 32): `--to fp8` / `--to fp8-block` split a 3-D
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] into per-expert weights, as
llm-compressor's `model_free_ptq` names and splits them, and quantize each: every per-expert
weight and scale byte-identical to `model_free_ptq`'s (tests/fixtures/fused, written once by
make_fused.py). The transposed layout ([E, H, 2I], [E, I, H]: Qwen3-VL-MoE, Llama 4) is
split as the transpose of each block: the same bytes (model_free_ptq itself splits it along
H, wrongly). Where the layout cannot be told the experts stay fused and BF16, with one
warning naming them and why.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, main_in_process, tensor_bytes, write_safetensors

FIX = Path(__file__).parent / "fixtures" / "fused"
EXPECTED = json.loads((FIX / "expected-quant.json").read_text())
SCHEME = {"fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK"}
P = "model.layers.0.mlp.experts."
E, H, INTER = EXPECTED["E"], EXPECTED["H"], EXPECTED["I"]


def sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def transposed(tmp: Path) -> tuple[Path, Path]:
    """The fixture with its experts stored transposed ([E, H, 2I], [E, I, H]) and a
    Qwen3-VL-MoE config (sizes under `text_config`)."""
    src = tensor_bytes(FIX / "qwen3-moe" / "model.safetensors")
    out = {}
    for name, (dtype, shape, raw) in src.items():
        if name in (P + "gate_up_proj", P + "down_proj"):
            a = np.frombuffer(raw, dtype="<u2").reshape(shape).transpose(0, 2, 1)
            out[name] = (dtype, list(a.shape), np.ascontiguousarray(a).tobytes())
        else:
            out[name] = (dtype, shape, raw)
    path = write_safetensors(tmp / "transposed.safetensors", out, metadata={"format": "pt"})
    config = tmp / "transposed-config.json"
    text = {"hidden_size": H, "intermediate_size": 3 * H, "moe_intermediate_size": INTER}
    config.write_text(json.dumps({"model_type": "qwen3_vl_moe", "text_config": text}))
    return path, config


def source(layout: str, tmp: Path) -> tuple[Path, Path]:
    if layout == "rows":
        return FIX / "qwen3-moe" / "model.safetensors", FIX / "qwen3-moe" / "config.json"
    return transposed(tmp)


@pytest.mark.parametrize("to", sorted(SCHEME))
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_every_expert_weight_and_scale_equals_model_free_ptq(tmp_path, layout, to):
    src, config = source(layout, tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    rc, _, err = main_in_process("convert", src, out, "--to", to, "--config", config)
    assert rc == 0, err
    # Nothing stays fused; a transposed layout is named, once, with both tensors.
    notes = [line for line in err.splitlines() if "fused" in line]
    if layout == "rows":
        assert notes == [], err
    else:
        assert len(notes) == 1 and "stored transposed" in notes[0], err
        assert f"`{P}down_proj`, `{P}gate_up_proj`" in notes[0], err
    got = tensor_bytes(out)
    run = EXPECTED["runs"][SCHEME[to]]
    experts = {n: r for n, r in run["tensors"].items() if n.startswith(P)}
    assert len(experts) == E * 3 * 2  # gate, up, down per expert, each with its scale
    for name, rec in run["tensors"].items():
        if rec["dtype"] != "F8_E4M3" and not name.endswith("_scale"):
            continue
        dtype, shape, raw = got[name]
        assert [dtype, shape, sha(raw)] == [rec["dtype"], rec["shape"], rec["sha256"]], name
    assert {n for n in got if n.startswith(P)} == set(experts)
    # The config's ignore names no expert: each is quantized.
    ignore = json.loads((out.parent / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"]
    rc, _, err = main_in_process("verify", src, out)
    assert rc == 0, err


@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_verify_fails_on_a_changed_expert_weight_or_source_byte(tmp_path, layout):
    src, config = source(layout, tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    rc, _, err = main_in_process("convert", src, out, "--to", "fp8", "--config", config)
    assert rc == 0, err
    good = out.read_bytes()
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])
    for name in (P + "1.up_proj.weight", P + "3.down_proj.weight_scale"):
        raw = bytearray(good)
        raw[8 + n + header[name]["data_offsets"][0] + 1] ^= 0x04
        out.write_bytes(bytes(raw))
        rc, _, err = main_in_process("verify", src, out)
        assert rc == 1, (name, err)
        # Long names are shortened in the middle: the expert's part is kept.
        assert name[len(P) :].split(".weight")[0] in assert_one_error_line(err)
    out.write_bytes(good)
    # A byte of the source's fused tensor: the expert it belongs to no longer verifies.
    changed = tmp_path / "changed.safetensors"
    raw = bytearray(src.read_bytes())
    m = int.from_bytes(raw[:8], "little")
    at = json.loads(raw[8 : 8 + m])[P + "gate_up_proj"]["data_offsets"][0]
    raw[8 + m + at + 2 * (2 * INTER * H + 7)] ^= 0x40  # expert 1's first half
    changed.write_bytes(bytes(raw))
    rc, _, err = main_in_process("verify", changed, out)
    assert rc == 1, err
    assert "experts.1." in assert_one_error_line(err)


def test_inspect_lists_the_split(tmp_path):
    src, config = source("transposed", tmp_path)
    rc, out, err = main_in_process("inspect", src, "--to", "fp8", "--config", config, "--json")
    assert rc == 0, err
    names = {t["name"]: t for t in json.loads(out)["result"]["tensors"]}
    assert P + "gate_up_proj" not in names
    for e in range(E):
        parts = (("gate_proj", [INTER, H]), ("up_proj", [INTER, H]), ("down_proj", [H, INTER]))
        for part, shape in parts:
            t = names[f"{P}{e}.{part}.weight"]
            assert t["shape"] == shape and t["target_dtype"] == "F8_E4M3", t


def small(tmp: Path, gate_up: list[int], down: list[int]) -> Path:
    rng = np.random.default_rng(32)

    def bf16(shape: list[int]) -> bytes:
        return (rng.standard_normal(shape).astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()

    return write_safetensors(
        tmp / "m.safetensors",
        {
            P + "gate_up_proj": ("BF16", gate_up, bf16(gate_up)),
            P + "down_proj": ("BF16", down, bf16(down)),
            "model.layers.0.self_attn.q_proj.weight": ("BF16", [8, 8], bf16([8, 8])),
        },
    )


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if "fused MoE experts" in line]


@pytest.mark.parametrize(
    "config, gate_up, down, split, why",
    [
        # 2I == H: [E, 2I, H] and [E, H, 2I] are one shape; down_proj is told.
        ({"hidden_size": 8, "moe_intermediate_size": 4}, [2, 8, 8], [2, 8, 4], "down", "both"),
        # Shapes that fit no layout of the config's sizes.
        ({"hidden_size": 8, "intermediate_size": 3}, [2, 10, 8], [2, 8, 3], "down", "no layout"),
        # gpt-oss: gate and up interleaved.
        (
            {"model_type": "gpt_oss", "hidden_size": 8, "intermediate_size": 3},
            [2, 8, 6],
            [2, 3, 8],
            None,
            "interleaves",
        ),
        (None, [2, 6, 8], [2, 8, 3], None, "no model config"),
    ],
)
def test_what_cannot_be_told_stays_bf16_with_one_warning(
    tmp_path, config, gate_up, down, split, why
):
    src = small(tmp_path, gate_up, down)
    args = []
    if config is not None:
        (tmp_path / "c.json").write_text(json.dumps(config))
        args = ["--config", tmp_path / "c.json"]
    out = tmp_path / "out" / "m.safetensors"
    out.parent.mkdir()
    rc, _, err = main_in_process("convert", src, out, "--to", "fp8", *args)
    assert rc == 0, err
    got = tensor_bytes(out)
    # A block of experts is split whole or not at all (attack z11 r11): down_proj, whose
    # layout is told, stays fused with gate_up_proj, and a second warning says why.
    for name in [P + "gate_up_proj", P + "down_proj"]:
        assert got[name][0] == "BF16", name
    assert not [n for n in got if n.startswith(P + "1.")], sorted(got)
    warnings = warnings_of(err)
    own = [P + "gate_up_proj"] + ([] if split == "down" else [P + "down_proj"])
    assert why in warnings[0] and all(f"`{n}`" in warnings[0] for n in own), warnings
    if split == "down":
        assert len(warnings) == 2 and f"`{P}down_proj`" in warnings[1], warnings
        assert "other fused tensor of their experts stays fused" in warnings[1], warnings
    else:
        assert len(warnings) == 1, warnings
    rc, _, err = main_in_process("verify", src, out)
    assert rc == 0, err


def test_pieces_that_would_take_a_name_in_use_stay_fused(tmp_path):
    src = small(tmp_path, [2, 6, 8], [2, 8, 3])
    t = tensor_bytes(src)
    t[P + "1.up_proj.weight"] = ("BF16", [3, 8], t[P + "gate_up_proj"][2][: 3 * 8 * 2])
    t[P + "empty.gate_up_proj"] = ("BF16", [0, 6, 8], b"")
    src = write_safetensors(tmp_path / "taken.safetensors", t)
    (tmp_path / "c.json").write_text(json.dumps({"hidden_size": 8, "intermediate_size": 3}))
    out = tmp_path / "out" / "m.safetensors"
    out.parent.mkdir()
    rc, _, err = main_in_process(
        "convert", src, out, "--to", "fp8", "--config", tmp_path / "c.json"
    )
    assert rc == 0, err
    got = tensor_bytes(out)
    assert got[P + "gate_up_proj"][0] == "BF16"  # its pieces' names: one is taken
    assert got[P + "1.up_proj.weight"][0] == "F8_E4M3"  # the file's own
    assert got[P + "empty.gate_up_proj"][:2] == ("BF16", [0, 6, 8])  # no expert: kept
    assert got[P + "0.down_proj.weight"][0] == "F8_E4M3"
    [warning] = warnings_of(err)
    assert f"`{P}gate_up_proj`" in warning, warning
    rc, _, err = main_in_process("verify", src, out)
    assert rc == 0, err


def transposed_folder(tmp_path):
    """Two shards, each with a layer of experts stored transposed, their index, and a
    Qwen3-VL-MoE config."""
    one, config = transposed(tmp_path)
    layer0 = tensor_bytes(one)
    layer1 = {n.replace("layers.0", "layers.1"): v for n, v in layer0.items() if P in n}
    src = tmp_path / "src"
    src.mkdir()
    weight_map = {}
    for i, tensors in enumerate([layer0, layer1]):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        write_safetensors(src / name, tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    doc = json.loads(config.read_text())
    doc["text_config"]["num_experts"] = E
    (src / "config.json").write_text(json.dumps(doc))
    return src


@pytest.mark.parametrize("extra", [{}, {"max_shard_size": "1GB"}, {"max_shard_size": "200kB"}])
def test_a_folder_of_transposed_experts_names_them(tmp_path, extra):
    # Split per expert and named, each fused tensor once: a file converted as it is names
    # its own, a re-sharding names them all in one note (not once per output shard).
    src = transposed_folder(tmp_path)
    dst = tmp_path / "out"
    with pytest.warns(stcast.StcastWarning) as caught:
        report = stcast.convert(src, dst, to="fp8", **extra)
    notes = [str(w.message) for w in caught if w.message.kind == "transposed_experts"]
    assert len(notes) == (1 if extra else 2), notes
    named = [n for note in notes for n in re.findall(r"`([^`]+)`", note)]
    layers = (P, P.replace("layers.0", "layers.1"))
    assert sorted(named) == sorted(
        p + part for p in layers for part in ("down_proj", "gate_up_proj")
    )
    assert not [w for w in report.warnings if "stay" in w.template], report.warnings
    held = {n for f in dst.glob("*.safetensors") for n in tensor_bytes(f)}
    assert f"{P}0.gate_proj.weight" in held and P + "gate_up_proj" not in held
    assert stcast.verify(src, dst).mismatch is None


@pytest.mark.parametrize("size", ["1GB", "200kB"])
def test_a_re_sharding_names_its_group_in_the_transposed_note(tmp_path, size):
    # The note names the experts of every file of the group: it is about the group, and
    # says so by its index, not by its first file (attack finding r15).
    src = transposed_folder(tmp_path)
    with pytest.warns(stcast.StcastWarning) as caught:
        report = stcast.convert(src, tmp_path / "out", to="fp8", max_shard_size=size)
    [note] = [w.message for w in caught if w.message.kind == "transposed_experts"]
    assert note.path == "model.safetensors.index.json", note.path
    [said] = [n for n in report.warnings if n.kind == "transposed_experts"]
    assert said.path == "model.safetensors.index.json", said.path


def test_an_output_without_record_is_split_by_the_config_beside_it(tmp_path):
    # `--no-record` keeps no sizes: verify splits SRC by the model config `--config` wrote
    # beside the output, as convert split it; without it SRC stays fused, and DST fails.
    src, config = source("rows", tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    args = ["--to", "fp8", "--config", config, "--no-record"]
    assert main_in_process("convert", src, out, *args)[0] == 0
    assert (out.parent / "config.json").exists()
    rc, _, err = main_in_process("verify", src, out)
    assert rc == 0, err
    raw = bytearray(out.read_bytes())
    raw[-3] ^= 1
    tampered = out.parent / "model.safetensors"
    tampered.write_bytes(bytes(raw))
    assert main_in_process("verify", src, tampered)[0] == 1
    raw[-3] ^= 1
    alone = tmp_path / "alone" / "model.safetensors"
    alone.parent.mkdir()
    alone.write_bytes(bytes(raw))
    rc, _, err = main_in_process("verify", src, alone)
    assert rc == 1 and "experts.0." in assert_one_error_line(err), err


def f32_experts(tmp: Path) -> tuple[Path, Path]:
    """F32 fused experts of two layers ([E, 2I, H], [E, H, I]: E 2, H 8, I 3) and their
    config: a kept tensor keeps F32, one converted becomes BF16."""
    rng = np.random.default_rng(12)
    tensors = {}
    for layer in ("0", "1"):
        p = P.replace("layers.0", f"layers.{layer}")
        for name, shape in ((p + "gate_up_proj", [2, 6, 8]), (p + "down_proj", [2, 8, 3])):
            tensors[name] = ("F32", shape, rng.standard_normal(shape).astype("<f4"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = ("F32", [8, 8], np.ones((8, 8), "<f4"))
    src = write_safetensors(tmp / "m.safetensors", tensors)
    (tmp / "c.json").write_text(json.dumps({"hidden_size": 8, "intermediate_size": 3}))
    return src, tmp / "c.json"


@pytest.mark.parametrize("pattern", [P + "gate_up_proj", "*layers.0.mlp.experts*"])
def test_a_keep_pattern_naming_a_fused_tensor_keeps_it_fused(tmp_path, pattern):
    # (Attack z11 r12.) The pattern names the fused tensor as SRC holds it: kept as it is
    # (F32, fused), its block with it (down_proj stays fused, BF16, with a warning saying
    # why), where the split ignored it and the warning said it matched no tensor name.
    src, config = f32_experts(tmp_path)
    out = tmp_path / "out" / "m.safetensors"
    args = ["--to", "fp8", "--config", config, "--keep", pattern, "--strict"]
    rc, _, err = main_in_process("convert", src, out, *args)
    assert rc == 0, err
    assert "matches no tensor name" not in err, err
    got = tensor_bytes(out)
    assert got[P + "gate_up_proj"][:2] == ("F32", [2, 6, 8])
    both = pattern.endswith("*")  # down_proj is kept too
    assert got[P + "down_proj"][:2] == ("F32" if both else "BF16", [2, 8, 3])
    assert not [n for n in got if n.startswith(P + "0.")], sorted(got)
    # The other layer's experts are split and quantized as ever.
    other = P.replace("layers.0", "layers.1")
    assert got[other + "0.gate_proj.weight"][0] == "F8_E4M3"
    [warning] = warnings_of(err) or [""]
    if both:
        assert not warning, err
    else:
        assert f"`{P}down_proj`" in warning and "other fused tensor" in warning, err
    for loose in ([], ["--loose"]):
        rc, _, err = main_in_process("verify", src, out, *loose)
        assert rc == 0, err
    # verify splits SRC as convert did: the pattern given again, or another one.
    rc, _, err = main_in_process("verify", src, out, "--keep", pattern)
    assert rc == 0, err
    rc, _, err = main_in_process("verify", src, out, "--keep", "*q_proj*")
    assert rc == 1, err


def test_a_keep_pattern_naming_pieces_keeps_the_pieces(tmp_path):
    # A pattern that names the split pieces (not the fused tensor) keeps those pieces, split.
    src, config = f32_experts(tmp_path)
    out = tmp_path / "out" / "m.safetensors"
    args = ["--to", "fp8", "--config", config, "--keep", "*experts.0.*"]
    rc, _, err = main_in_process("convert", src, out, *args)
    assert rc == 0, err
    got = tensor_bytes(out)
    assert got[P + "0.gate_proj.weight"][0] == "F32"
    assert got[P + "1.gate_proj.weight"][0] == "F8_E4M3"
    rc, _, err = main_in_process("verify", src, out)
    assert rc == 0, err
