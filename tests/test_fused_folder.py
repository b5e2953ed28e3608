"""Fused MoE experts under FP8 targets in a Hugging Face folder (issue 32): the folder's
config.json proves the layout, each fused tensor is split per expert in its own shard, the
index lists the pieces and their scales there, config.json's `ignore` names what stays
unquantized, and the record (index metadata and every shard) carries the sizes split by.

Byte for byte against llm-compressor's `model_free_ptq` of the same two-shard folder
(tests/fixtures/fused/expected-folder.json, written once by make_fused_folder.py), as a
plain folder run, re-sharded (`--max-shard-size`), in `--shard i/N` runs with `finalize`,
and under `--resume`; `verify` with no options passes each and fails on a changed byte of a
source expert.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_error_line, main_in_process, tensor_bytes

FIX = Path(__file__).parent / "fixtures" / "fused"
EXPECTED = json.loads((FIX / "expected-folder.json").read_text())
SCHEME = {"fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK"}
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
P = "model.layers.0.mlp.experts."
H, INTER = 136, 40


def sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _write(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """As make_fused_folder.py writes a shard (its bytes are checked against it)."""
    header: dict = {}
    data, off = b"", 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def folder(tmp: Path, transposed: bool = False, config: dict | None = None) -> Path:
    """The two-shard folder model_free_ptq converted (make_fused_folder.py `folder`);
    `transposed`: its experts stored [E, H, 2I] and [E, I, H] with a Qwen3-VL-MoE config."""
    src = tmp / "src"
    src.mkdir()
    t = tensor_bytes(FIX / "qwen3-moe" / "model.safetensors")
    first = ("embed_tokens", "self_attn", "experts.gate_up_proj")
    parts: tuple[dict, dict] = ({}, {})
    for name, (dtype, shape, raw) in t.items():
        if transposed and name in (P + "gate_up_proj", P + "down_proj"):
            a = np.frombuffer(raw, dtype="<u2").reshape(shape).transpose(0, 2, 1)
            shape, raw = list(a.shape), np.ascontiguousarray(a).tobytes()
        parts[0 if any(p in name for p in first) else 1][name] = (dtype, shape, raw)
    weight_map = {}
    for file, tensors in zip(SHARDS, parts):
        _write(src / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    total = sum(len(r) for _, _, r in t.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (src / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    cfg = json.loads((FIX / "qwen3-moe" / "config.json").read_text())
    if transposed:
        text = {
            k: cfg.pop(k) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size")
        }
        cfg = {**cfg, "model_type": "qwen3_vl_moe", "text_config": text}
    if config is not None:
        cfg = config
    (src / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return src


def all_tensors(dst: Path) -> dict[str, tuple[str, tuple[str, list[int], bytes]]]:
    """Every tensor of DST's shards: name -> (shard, (dtype, shape, bytes))."""
    out = {}
    for f in sorted(dst.glob("*.safetensors")):
        for name, t in tensor_bytes(f).items():
            out[name] = (f.name, t)
    return out


def check_tensors(dst: Path, to: str) -> None:
    """Every tensor model_free_ptq writes, stcast writes with the same bytes."""
    run = EXPECTED["runs"][SCHEME[to]]
    got = all_tensors(dst)
    want = {n: r for shard in run["shards"].values() for n, r in shard.items()}
    assert set(got) == set(want)
    for name, rec in want.items():
        dtype, shape, raw = got[name][1]
        assert [dtype, shape, sha(raw)] == [rec["dtype"], rec["shape"], rec["sha256"]], name


def record_of(path: Path) -> dict:
    if path.name.endswith(".json"):
        return json.loads(json.loads(path.read_text())["metadata"]["stcast"])
    n = int.from_bytes(path.read_bytes()[:8], "little")
    meta = json.loads(path.read_bytes()[8 : 8 + n])["__metadata__"]
    return json.loads(meta["stcast"])


def check_ignore(dst: Path, to: str) -> None:
    """config.json's ignore names the modules model_free_ptq's patterns leave unquantized."""
    ignore = json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"]
    patterns = EXPECTED["runs"][SCHEME[to]]["ignore"]

    def ignored(module: str) -> bool:
        return any(
            re.match(p[3:], module) if p.startswith("re:") else module == p for p in patterns
        )

    modules = {n.rsplit(".", 1)[0] for n in all_tensors(dst) if n.endswith(".weight")}
    quantized = {n.rsplit(".", 1)[0] for n in all_tensors(dst) if n.endswith(".weight_scale")}
    for m in sorted(modules):
        if m in quantized:
            assert not ignored(m), m
    assert all(ignored(m) for m in ignore)


def flip_source_expert(src: Path) -> None:
    """One byte of expert 1's first half of the fused gate_up_proj in SRC's first shard."""
    path = src / SHARDS[0]
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    at = json.loads(raw[8 : 8 + n])[P + "gate_up_proj"]["data_offsets"][0]
    raw[8 + n + at + 2 * (2 * INTER * H + 7)] ^= 0x40
    path.write_bytes(bytes(raw))


def test_the_folder_is_model_free_ptqs(tmp_path):
    src = folder(tmp_path)
    assert {f: sha((src / f).read_bytes()) for f in SHARDS} == EXPECTED["source"]


@pytest.mark.parametrize("to", sorted(SCHEME))
def test_a_folder_equals_model_free_ptq_shard_for_shard(tmp_path, to):
    src = folder(tmp_path)
    dst = tmp_path / "out"
    rc, _, err = main_in_process("convert", src, dst, "--to", to)
    assert rc == 0, err
    assert "fused" not in err, err
    run = EXPECTED["runs"][SCHEME[to]]
    # Each tensor in the shard model_free_ptq puts it in, with its bytes.
    for shard, want in run["shards"].items():
        got = tensor_bytes(dst / shard)
        assert set(got) == set(want), shard
        for name, rec in want.items():
            dtype, shape, raw = got[name]
            assert [dtype, shape, sha(raw)] == [rec["dtype"], rec["shape"], rec["sha256"]], name
    index = json.loads((dst / INDEX).read_text())
    assert index["weight_map"] == run["index"]["weight_map"]
    assert index["metadata"]["total_size"] == run["index"]["metadata"]["total_size"]
    check_ignore(dst, to)
    # The record: in the index and in every shard (also the one that splits nothing).
    for path in [dst / INDEX, *(dst / s for s in SHARDS)]:
        assert record_of(path)["experts"] == [H, INTER], path
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err
    flip_source_expert(src)
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 1, err
    assert "experts.1.gate_proj" in assert_one_error_line(err)


def test_transposed_experts_are_split_by_the_folders_config(tmp_path):
    src = folder(tmp_path, transposed=True)
    dst = tmp_path / "out"
    rc, _, err = main_in_process("convert", src, dst, "--to", "fp8")
    assert rc == 0, err
    # Nothing stays fused; each file names the tensors it split transposed.
    notes = [line for line in err.splitlines() if "fused" in line]
    assert len(notes) == 2 and all("stored transposed" in n for n in notes), err
    check_tensors(dst, "fp8")
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err


def small_folder(tmp: Path, config: dict) -> Path:
    """A folder of one layer's fused experts, 2I == H (8 and 4), with `config`."""
    rng = np.random.default_rng(32)

    def bf16(shape: list[int]) -> tuple[str, list[int], bytes]:
        raw = (rng.standard_normal(shape).astype("<f4").view("<u4") >> 16).astype("<u2")
        return ("BF16", shape, raw.tobytes())

    src = tmp / "small"
    src.mkdir()
    _write(src / "a.safetensors", {P + "gate_up_proj": bf16([2, 8, 8])})
    _write(src / "b.safetensors", {P + "down_proj": bf16([2, 8, 4]), "q.weight": bf16([8, 8])})
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize(
    "config, split, why",
    [
        # 2I == H for gate_up_proj: both layouts have its shape; down_proj is told. (A block
        # of experts is split whole or not at all within one file; here its two tensors are
        # in two files, each judged alone: down_proj is split.)
        ({"num_experts": 2, "hidden_size": 8, "moe_intermediate_size": 4}, True, "both"),
        # A dense model's config (no experts declared): nothing is split.
        ({"hidden_size": 8, "moe_intermediate_size": 4}, False, "no model config"),
    ],
)
def test_what_the_folders_config_cannot_tell_stays_bf16(tmp_path, config, split, why):
    src = small_folder(tmp_path, config)
    dst = tmp_path / "out"
    rc, _, err = main_in_process("convert", src, dst, "--to", "fp8")
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "fused MoE experts" in line]
    assert warnings and why in warnings[0], err
    assert all(why in w or "other fused tensor" in w for w in warnings), err
    got = all_tensors(dst)
    assert got[P + "gate_up_proj"][1][0] == "BF16"
    assert (P + "1.down_proj.weight" in got) == split
    assert (P + "down_proj" in got) == (not split)
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err


@pytest.mark.parametrize("to", sorted(SCHEME))
def test_a_resharded_folder_splits_and_sizes_count_the_pieces(tmp_path, to):
    src = folder(tmp_path)
    dst = tmp_path / "out"
    rc, out, err = main_in_process("inspect", src, "--to", to, "--max-shard-size", "60KB", "--json")
    assert rc == 0, err
    planned = {Path(s["path"]).name: s["bytes"] for s in json.loads(out)["result"]["shards"]}
    rc, _, err = main_in_process("convert", src, dst, "--to", to, "--max-shard-size", "60KB")
    assert rc == 0, err
    written = {f.name: f.stat().st_size for f in dst.glob("*.safetensors")}
    assert planned == written and len(written) > 2
    check_tensors(dst, to)
    check_ignore(dst, to)
    index = json.loads((dst / INDEX).read_text())
    assert set(index["weight_map"]) == set(all_tensors(dst))
    for path in [dst / INDEX, *dst.glob("*.safetensors")]:
        assert record_of(path)["experts"] == [H, INTER], path
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err
    flip_source_expert(src)
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 1, err
    assert "experts.1.gate_proj" in assert_one_error_line(err)


@pytest.mark.parametrize("reshard", [[], ["--max-shard-size", "60KB"]])
def test_shard_runs_and_finalize_write_the_whole_runs_bytes(tmp_path, reshard):
    src = folder(tmp_path)
    whole = tmp_path / "whole"
    rc, _, err = main_in_process("convert", src, whole, "--to", "fp8", *reshard)
    assert rc == 0, err
    dst = tmp_path / "out"
    for i in (1, 2):
        rc, _, err = main_in_process(
            "convert", src, dst, "--to", "fp8", "--shard", f"{i}/2", *reshard
        )
        assert rc == 0, err
    rc, _, err = main_in_process("finalize", src, dst)
    assert rc == 0, err
    files = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in dst.iterdir()) == files
    for f in files:
        assert (dst / f).read_bytes() == (whole / f).read_bytes(), f
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err


@pytest.mark.parametrize("reshard", [[], ["--max-shard-size", "60KB"]])
def test_resume_writes_what_is_missing_as_a_whole_run(tmp_path, reshard):
    src = folder(tmp_path)
    whole = tmp_path / "whole"
    rc, _, err = main_in_process("convert", src, whole, "--to", "fp8", *reshard)
    assert rc == 0, err
    dst = tmp_path / "out"
    # A first run of half the shards, then the rest under resume.
    rc, _, err = main_in_process("convert", src, dst, "--to", "fp8", "--shard", "1/2", *reshard)
    assert rc == 0, err
    rc, _, err = main_in_process("convert", src, dst, "--to", "fp8", "--resume", *reshard)
    assert rc == 0, err
    files = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in dst.iterdir()) == files
    for f in files:
        assert (dst / f).read_bytes() == (whole / f).read_bytes(), f
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err
    shutil.rmtree(dst)


def test_a_lone_file_resharded_with_its_config_splits(tmp_path):
    """A lone file re-sharded (`--max-shard-size`) with `--config`: split as the folder is,
    inspect's planned shards the files written, verify passes."""
    src, config = FIX / "qwen3-moe" / "model.safetensors", FIX / "qwen3-moe" / "config.json"
    dst = tmp_path / "out"
    args = ("--to", "fp8", "--config", config, "--max-shard-size", "60KB")
    rc, out, err = main_in_process("inspect", src, *args, "--json")
    assert rc == 0, err
    result = json.loads(out)["result"]
    assert not [w for w in result["warnings"] if "fused" in str(w)], result["warnings"]
    planned = {Path(s["path"]).name: s["bytes"] for s in result["shards"]}
    rc, _, err = main_in_process("convert", src, dst, *args)
    assert rc == 0, err
    assert "fused" not in err, err
    assert planned == {f.name: f.stat().st_size for f in dst.glob("*.safetensors")}
    check_tensors(dst, "fp8")
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err


def test_inspect_of_a_folder_lists_the_pieces(tmp_path):
    src = folder(tmp_path)
    rc, out, err = main_in_process("inspect", src, "--to", "fp8", "--json")
    assert rc == 0, err
    files = {Path(f["path"]).name: f for f in json.loads(out)["result"]["files"]}
    tensors = {t["name"]: t for t in files[SHARDS[0]]["tensors"]}
    assert P + "gate_up_proj" not in tensors
    t = tensors[P + "3.up_proj.weight"]
    assert t["split_from"] == P + "gate_up_proj" and t["target_dtype"] == "F8_E4M3", t


@pytest.mark.parametrize("reshard", [[], ["--max-shard-size", "60KB"]])
def test_an_output_without_record_verifies_by_the_sources_config(tmp_path, reshard):
    """`--no-record`: DST records no sizes, so verify splits SRC by SRC's config.json (an
    FP8 output's), and still fails on a changed byte of a source expert."""
    src = folder(tmp_path)
    dst = tmp_path / "out"
    rc, _, err = main_in_process("convert", src, dst, "--to", "fp8", "--no-record", *reshard)
    assert rc == 0, err
    check_tensors(dst, "fp8")
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 0, err
    flip_source_expert(src)
    rc, _, err = main_in_process("verify", src, dst)
    assert rc == 1, err


@pytest.mark.parametrize("reshard", [[], ["--max-shard-size", "60KB"]])
def test_a_keep_pattern_naming_a_fused_tensor_keeps_it_fused_in_a_folder(tmp_path, reshard):
    # (Attack z11 r12.) As for a lone file: the fused tensor a pattern names is kept as it
    # is, not split; the pattern matches (no warning, --strict runs); verify agrees.
    src = folder(tmp_path)
    dst = tmp_path / "out"
    args = ["--to", "fp8", "--keep", P + "gate_up_proj", "--strict", *reshard]
    rc, _, err = main_in_process("convert", src, dst, *args)
    assert rc == 0, err
    assert "matches no tensor name" not in err, err
    got = all_tensors(dst)
    assert got[P + "gate_up_proj"][1][0] == "BF16"
    assert not [n for n in got if ".gate_proj." in n and n.startswith(P)], sorted(got)
    # Each file of SRC is judged alone, re-sharded too: its down_proj, in the other file,
    # is split.
    assert P + "0.down_proj.weight" in got and P + "down_proj" not in got
    for loose in ([], ["--loose"]):
        rc, _, err = main_in_process("verify", src, dst, *loose)
        assert rc == 0, err
