"""The files beside a lone checkpoint's output (a DCP, ZeRO or single-file source written
into a folder, or a file): the model config `--config` writes as `config.json`, an FP8
output's `<stem>.quantization_config.json`, an earlier re-sharding's shards and index under
the output's stem. None may describe the weights wrongly: convert refuses (or withdraws)
one that would, and verify fails one that does (attack z10 r10, r6, r9)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_error_line, write_safetensors
from helpers import run_cli, stopped, with_points

FIXTURES = Path(__file__).parent / "fixtures"
DCP = FIXTURES / "dcp" / "fsdp2-1d-3ranks"
FP8_CONFIG = FIXTURES / "fp8" / "llama-bf16.fp8-dynamic" / "config.json"
W4A16_CONFIG = FIXTURES / "packed" / "llama-bf16.w4a16" / "config.json"


def _dcp(tmp_path: Path) -> Path:
    c = tmp_path / "C"
    c.mkdir()
    for f in DCP.iterdir():
        if f.name == ".metadata" or f.name.endswith(".distcp"):
            shutil.copy(f, c / f.name)
    return c


def _dtypes(path: Path) -> set[str]:
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return {v["dtype"] for k, v in json.loads(b[8 : 8 + n]).items() if k != "__metadata__"}


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"model_type": "llama", "torch_dtype": "float32"}\n')
    return cfg


@pytest.mark.parametrize("given", [FP8_CONFIG, W4A16_CONFIG], ids=["fp8", "w4a16"])
def test_a_dense_output_config_loses_the_given_quantization(tmp_path, run_main, given):
    # r10: --config FILE with a bf16 target kept FILE's quantization_config.
    c = _dcp(tmp_path)
    q = tmp_path / "Q"
    rc, _, err = run_main("convert", c, q, "--key", "model", "--config", given)
    assert rc == 0, err
    assert "F8_E4M3" not in _dtypes(q / "model.safetensors")
    doc = json.loads((q / "config.json").read_text())
    assert "quantization_config" not in doc and "compression_config" not in doc
    assert doc.get("torch_dtype", doc.get("dtype")) == "bfloat16"
    rc, _, err = run_main("verify", c, q)
    assert rc == 0, err
    # A quantization key put back: verify fails it, strict and loose.
    doc["quantization_config"] = json.loads(given.read_text())["quantization_config"]
    (q / "config.json").write_text(json.dumps(doc))
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", c, q, *loose)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert f"{q / 'config.json'}: does not describe the weights beside it: has a " in line


def test_verify_checks_the_config_convert_wrote_beside_a_lone_output(tmp_path, run_main):
    # r6 (a): FP8 weights beside a --config config.json whose quantization_config is gone.
    c, cfg = _dcp(tmp_path), _config(tmp_path)
    a = tmp_path / "A"
    rc, _, err = run_main("convert", c, a, "--key", "model", "--to", "fp8", "--config", cfg)
    assert rc == 0, err
    rc, _, err = run_main("verify", c, a)
    assert rc == 0, err
    doc = json.loads((a / "config.json").read_text())
    doc.pop("quantization_config")
    (a / "config.json").write_text(json.dumps(doc))
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", c, a, *loose)
        assert rc == 1, err
        assert "has no compressed-tensors quantization_config" in assert_one_error_line(err)


@pytest.mark.parametrize("first, then", [("fp8", "bf16"), ("bf16", "fp8")])
def test_force_refuses_a_config_it_would_leave_describing_other_weights(
    tmp_path, run_main, first, then
):
    # r6 (b): --force over an earlier --config output kept the old config.json.
    c, cfg = _dcp(tmp_path), _config(tmp_path)
    d = tmp_path / "D"
    rc, _, err = run_main("convert", c, d, "--key", "model", "--to", first, "--config", cfg)
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    rc, _, err = run_main("convert", c, d, "--key", "model", "--to", then, "--force")
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert f"{d / 'config.json'}: " in line and "--config" in line, line
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # With the config given, the run replaces it, and the output verifies.
    again = ("--key", "model", "--to", then, "--force", "--config", cfg)
    rc, _, err = run_main("convert", c, d, *again)
    assert rc == 0, err
    rc, _, err = run_main("verify", c, d)
    assert rc == 0, err


def test_force_withdraws_an_fp8_side_config_a_dense_run_does_not_write(tmp_path, run_main):
    c = _dcp(tmp_path)
    d = tmp_path / "D"
    rc, _, err = run_main("convert", c, d, "--key", "model", "--to", "fp8")
    assert rc == 0, err
    side = d / "model.quantization_config.json"
    assert side.exists()
    rc, _, err = run_main("convert", c, d, "--key", "model", "--force")
    assert rc == 0, err
    assert not side.exists()
    rc, _, err = run_main("verify", c, d)
    assert rc == 0, err
    # One put back beside the dense weights: verify fails it.
    rc, _, err = run_main("convert", c, tmp_path / "E", "--key", "model", "--to", "fp8")
    shutil.copy(tmp_path / "E" / side.name, side)
    rc, _, err = run_main("verify", c, d)
    assert rc == 1 and "model.quantization_config.json: does not describe" in err, err


def _file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    tensors = {
        f"model.layers.0.mlp.{n}.weight": ("F32", [256, 128], rng.standard_normal((256, 128)))
        for n in ("up_proj", "down_proj")
    }
    tensors = {k: (d, s, a.astype("f4")) for k, (d, s, a) in tensors.items()}
    return write_safetensors(tmp_path / "f.safetensors", tensors)


def test_verify_checks_a_lone_file_side_quantization_config(tmp_path, run_main):
    # r6 (c): a tampered X.quantization_config.json passed.
    f = _file(tmp_path)
    one = tmp_path / "one.safetensors"
    rc, _, err = run_main("convert", f, one, "--to", "fp8")
    assert rc == 0, err
    side = tmp_path / "one.quantization_config.json"
    doc = json.loads(side.read_text())
    q = doc["quantization_config"]
    (group,) = q["config_groups"].values()
    for change in ("block", "ignore"):
        bad = json.loads(json.dumps(doc))
        if change == "block":
            (g,) = bad["quantization_config"]["config_groups"].values()
            g["weights"].update(strategy="block", block_structure=[128, 128])
        else:
            bad["quantization_config"]["ignore"] = ["re:.*"]
        side.write_text(json.dumps(bad))
        for loose in ([], ["--loose"]):
            rc, _, err = run_main("verify", f, one, *loose)
            assert rc == 1, (change, loose, err)
            assert f"{side}: does not describe the weights beside it" in assert_one_error_line(err)
    # Reformatted, the same config: loose passes it (strict too: the same values).
    side.write_text(json.dumps(doc, indent=4))
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", f, one, *loose)
        assert rc == 0, err


def test_a_lone_checkpoint_into_a_folder_with_an_earlier_resharding(tmp_path, run_main):
    # r9: model.safetensors written beside an index leading to the old shards.
    c = _dcp(tmp_path)
    g = tmp_path / "G"
    args = ("--key", "model", "--to", "fp16", "--max-shard-size", "300B")
    rc, _, err = run_main("convert", c, g, *args)
    assert rc == 0, err
    before = sorted(p.name for p in g.iterdir())
    for force in ([], ["--force"]):
        rc, _, err = run_main("convert", c, g, "--key", "model", *force)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert "model.safetensors.index.json" in line and "does not write" in line, line
        assert sorted(p.name for p in g.iterdir()) == before
    # Such a folder made by hand fails verify.
    rc, _, err = run_main("convert", c, tmp_path / "L", "--key", "model")
    assert rc == 0, err
    shutil.copy(tmp_path / "L" / "model.safetensors", g / "model.safetensors")
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", c, g, *loose)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert f"{g / 'model.safetensors.index.json'}: is named as an index or shard" in line


LLAMA = FIXTURES / "fp8" / "llama-fp32"


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("first, then", [("fp8", "bf16"), ("bf16", "fp8")])
def test_a_folder_run_refuses_a_config_it_leaves_describing_other_weights(
    tmp_path, run_main, first, then
):
    # r3: --force --exclude config.json over an earlier output kept its config.json.
    out = tmp_path / "out"
    rc, _, err = run_main("convert", LLAMA, out, "--to", first)
    assert rc == 0, err
    before = _tree(out)
    rc, _, err = run_main(
        "convert", LLAMA, out, "--to", then, "--force", "--exclude", "config.json"
    )
    assert rc == 1, err
    *warned, line = err.strip().splitlines()
    assert all(w.startswith("stcast: warning: ") for w in warned), err
    assert line.startswith(f"stcast: {out / 'config.json'}: "), line
    assert "this run writes no config there" in line, line
    assert _tree(out) == before


def test_verify_fails_a_quantization_config_beside_dense_shards(tmp_path, run_main):
    # r3: verify --loose passed BF16 shards under an FP8 config.json; strict said it is
    # "in DST but not in SRC" (it is: --exclude left it out).
    fp8, out = tmp_path / "fp8", tmp_path / "out"
    rc, _, err = run_main("convert", LLAMA, fp8, "--to", "fp8")
    assert rc == 0, err
    rc, _, err = run_main("convert", LLAMA, out, "--exclude", "config.json")
    assert rc == 0, err
    shutil.copy(fp8 / "config.json", out / "config.json")
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", LLAMA, out, *loose)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert f"{out / 'config.json'}: does not describe the weights beside it: has a " in line
    (out / "config.json").unlink()
    rc, _, err = run_main("verify", LLAMA, out)
    assert rc == 0, err


def test_an_interrupted_folder_run_leaves_no_config_of_the_old_weights(tmp_path):
    # r16: Ctrl-C once the FP8 shards were written left them under the bf16 config.json.
    out = tmp_path / "out"
    assert run_cli("convert", LLAMA, out, "-q")[0] == 0
    env = with_points(None, "folder-publish=sigint")
    rc, _, err = run_cli("convert", LLAMA, out, "--to", "fp8", "--force", "-q", env=env)
    assert rc in (130, -2), err  # the CLI re-raises SIGINT
    assert "F8_E4M3" in _dtypes(out / "model.safetensors")
    assert not (out / "config.json").exists()
    # The same run through: the config describes the FP8 weights.
    assert run_cli("convert", LLAMA, out, "--to", "fp8", "--force", "-q")[0] == 0
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    assert run_cli("verify", LLAMA, out)[0] == 0


def test_a_lone_run_withdraws_the_old_config_before_its_weights(tmp_path):
    # r16: kill -9 between the weights' publish and the config's left FP8 weights under the
    # old config.json.
    c, cfg = _dcp(tmp_path), _config(tmp_path)
    g = tmp_path / "G"
    assert run_cli("convert", c, g, "--key", "model", "--config", cfg, "-q")[0] == 0
    args = ("--key", "model", "--to", "fp8", "--config", cfg, "--force", "-q")
    run = stopped("convert", c, g, *args, at="publish")
    assert not (g / "config.json").exists()
    assert "F8_E4M3" not in _dtypes(g / "model.safetensors")  # not replaced yet
    rc, err = run.run_through()
    assert rc == 0, err
    assert "quantization_config" in json.loads((g / "config.json").read_text())
    assert run_cli("verify", c, g)[0] == 0


@pytest.mark.parametrize("how", ["no-config", "resharded", "excluded", "nested"], ids=lambda h: h)
def test_an_fp8_folder_without_a_model_config_gets_its_quantization_config(tmp_path, run_main, how):
    # r4: no quantization_config anywhere and no warning (a lone file gets both).
    src = tmp_path / "src"
    here = src / "part" if how == "nested" else src
    here.mkdir(parents=True)
    shutil.copy(LLAMA / "model.safetensors", here / "model.safetensors")
    args: tuple[str, ...] = ()
    if how == "resharded":
        args = ("--max-shard-size", "100kB")
    if how == "excluded":
        shutil.copy(LLAMA / "config.json", here / "config.json")
        args = ("--exclude", "config.json")
    if how == "nested":
        (src / "config.json").write_text('{"model_type": "pipeline"}\n')
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, "--to", "fp8", *args)
    assert rc == 0, err
    side = (out / "part" if how == "nested" else out) / "quantization_config.json"
    warned = [line for line in err.splitlines() if "no model config describes" in line]
    assert warned == [
        "stcast: warning: no model config describes this FP8 output: its quantization_config "
        f"is written to {side}; vLLM and transformers read it from the model's config.json "
        "only: merge it into that file (the guide shows how)"
    ], err
    q = json.loads(side.read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err
    # Tampered: verify fails it, strict and loose.
    g = next(iter(q["config_groups"].values()))
    g["weights"]["strategy"] = "block"
    side.write_text(json.dumps({"quantization_config": q}))
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", src, out, *loose)
        assert rc == 1, err
        assert f"{side}: is not the quantization_config of the FP8" in err, err


def test_a_dense_force_run_withdraws_a_folder_side_config(tmp_path, run_main):
    # The folder's own: a bf16 --force run over an FP8 output without a model config left
    # its quantization_config.json beside the BF16 shards (verify then failed it).
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    shutil.copy(LLAMA / "model.safetensors", src / "model.safetensors")
    rc, _, err = run_main("convert", src, out, "--to", "fp8")
    assert rc == 0, err
    assert (out / "quantization_config.json").exists()
    rc, _, err = run_main("convert", src, out, "--force", "-q")
    assert (rc, err) == (0, "")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err


@pytest.mark.parametrize("folder", [False, True], ids=["lone", "folder"])
def test_a_dense_force_run_keeps_a_side_config_it_did_not_write(tmp_path, run_main, folder):
    # (Attack z11 r5.) Withdrawn only when it is exactly the one stcast wrote beside the
    # weights there: the user's own notes stay; one that says quantized, which the dense
    # weights would then sit beside, is refused before anything is written.
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(LLAMA / "model.safetensors", src / "model.safetensors")
    if folder:
        args, out = [src], tmp_path / "out"
        side = out / "quantization_config.json"
    else:
        args, out = [src / "model.safetensors"], tmp_path / "out" / "model.safetensors"
        side = out.parent / "model.quantization_config.json"
    assert run_main("convert", "-q", *args, out)[0] == 0
    side.write_text("my notes, not JSON\n")
    rc, _, err = run_main("convert", "-q", *args, out, "--force")
    assert (rc, err) == (0, "")
    assert side.read_text() == "my notes, not JSON\n"
    claim = '{"quantization_config": {"quant_method": "compressed-tensors"}}\n'
    side.write_text(claim)
    before = out.read_bytes() if not folder else (out / "model.safetensors").read_bytes()
    rc, _, err = run_main("convert", "-q", *args, out, "--force")
    line = assert_one_error_line(err)
    assert rc == 1 and str(side) in line and "remove it" in line, err
    assert side.read_text() == claim
    after = out.read_bytes() if not folder else (out / "model.safetensors").read_bytes()
    assert after == before


@pytest.mark.parametrize("to", [[], ["--to", "fp8"]], ids=["bf16", "fp8"])
def test_one_reader_of_the_given_config(tmp_path, run_main, to):
    # (Attack z11 r18, r19.) Every target reads --config alike: a FIFO is refused in one
    # line (the FP8 path blocked in open(2), deaf to SIGTERM), a byte-order mark named.
    src = _file(tmp_path)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    rc, _, err = run_main("convert", src, tmp_path / "o" / "x.safetensors", "--config", fifo, *to)
    assert rc == 1 and "fifo.json: input is a FIFO" in assert_one_error_line(err), err
    bom = tmp_path / "bom.json"
    bom.write_bytes(b'\xef\xbb\xbf{"hidden_size": 4}')
    rc, _, err = run_main("convert", src, tmp_path / "o" / "x.safetensors", "--config", bom, *to)
    assert rc == 1 and "starts with a byte-order mark" in assert_one_error_line(err), err


@pytest.mark.parametrize("how", ["status", "asym", "static", "kv"])
def test_loose_verify_of_a_lone_output_reads_its_config_as_a_folders(tmp_path, run_main, how):
    # (Attack z11 r1.) One rule of an FP8 config (run::fp8config): a lone output's config
    # that a loader reads wrong fails --loose as a folder's does.
    src = _file(tmp_path)
    cfg = _config(tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    assert run_main("convert", "-q", src, out, "--to", "fp8", "--config", cfg)[0] == 0
    assert run_main("verify", src, out, "--loose")[0] == 0
    path = out.parent / "config.json"
    doc = json.loads(path.read_text())
    q = doc["quantization_config"]
    group = next(iter(q["config_groups"].values()))
    if how == "status":
        q["quantization_status"] = "frozen"
    elif how == "asym":
        group["weights"]["symmetric"] = False
    elif how == "static":
        group["input_activations"]["dynamic"] = False
    else:
        q["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    path.write_text(json.dumps(doc, indent=2))
    rc, _, err = run_main("verify", src, out, "--loose")
    assert rc == 1 and "config.json: does not describe" in assert_one_error_line(err), err


def test_model_safetensors_reads_the_config_beside_it_whatever_else_is_there(tmp_path, run_main):
    # (Attack z11 r9.) transformers loads model.safetensors with config.json beside it even
    # when the folder holds other weights: a stale FP8 config there is refused, as when alone.
    src, cfg = _file(tmp_path), _config(tmp_path)
    out = tmp_path / "O" / "model.safetensors"
    assert run_main("convert", "-q", src, out, "--to", "fp8", "--config", cfg)[0] == 0
    shutil.copy(out, out.parent / "backup-fp8.safetensors")
    before = out.read_bytes()
    rc, _, err = run_main("convert", "-q", src, out, "--force")
    line = assert_one_error_line(err)
    assert rc == 1 and "config.json: has a `quantization_config`" in line, err
    assert out.read_bytes() == before


def test_srcs_own_quantization_config_json_is_not_taken_for_stcasts(tmp_path, run_main):
    # (Attack z11 r3.) An FP8 folder run without a model config writes quantization_config.json
    # beside its weights: SRC's own file of that name, copied there, would stand for it.
    src = tmp_path / "G"
    src.mkdir()
    shutil.copy(_file(tmp_path), src / "model.safetensors")
    theirs = '{"quantization_config": {"quant_method": "compressed-tensors"}}\n'
    (src / "quantization_config.json").write_text(theirs)
    dst = tmp_path / "Go"
    rc, _, err = run_main("convert", src, dst, "--to", "fp8")
    line = assert_one_error_line(err)
    assert rc == 1 and "G/quantization_config.json: is SRC's own" in line, err
    assert "(--exclude quantization_config.json)" in line and not dst.exists(), err
    rc, _, err = run_main(
        "convert", src, dst, "--to", "fp8", "--exclude", "quantization_config.json"
    )
    assert rc == 0 and "no model config describes" in err, err
    assert (dst / "quantization_config.json").read_text() != theirs
    assert run_main("verify", src, dst)[0] == 0
    # A dense run copies it as any file.
    assert run_main("convert", "-q", src, tmp_path / "B")[0] == 0
    assert (tmp_path / "B" / "quantization_config.json").read_text() == theirs


def test_strict_verify_fails_an_fp8_folder_without_the_side_config_convert_wrote(
    tmp_path, run_main
):
    # (Attack z11 r4.) The only description of the FP8 weights, removed.
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(LLAMA / "model.safetensors", src / "model.safetensors")
    out = tmp_path / "out"
    assert run_main("convert", "-q", src, out, "--to", "fp8")[0] == 0
    side = out / "quantization_config.json"
    side.unlink()
    rc, _, err = run_main("verify", src, out)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert f"{side}: is the quantization_config convert writes" in line, line
    assert "but not in DST" in line, line


INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        }
    },
}


@pytest.mark.parametrize("folder", [False, True], ids=["lone", "folder"])
def test_an_fp8_config_holds_one_description_of_its_weights(tmp_path, run_main, folder):
    # (Attack z11 r20.) A given config's `compression_config` (int4) is dropped from an FP8
    # output's, as from a dense one's (a folder's own is refused: already quantized); one
    # put back fails verify, strict and loose, a lone output's as a folder's.
    doc = {"model_type": "llama", "torch_dtype": "float32", "compression_config": INT4}
    if folder:
        src = tmp_path / "src"
        src.mkdir()
        shutil.copy(_file(tmp_path), src / "model.safetensors")
        del doc["compression_config"]
        (src / "config.json").write_text(json.dumps(doc))
        out = tmp_path / "out"
        args: tuple[object, ...] = (src, out, "--to", "fp8")
        path = out / "config.json"
    else:
        src = _file(tmp_path)
        cfg = tmp_path / "cfg.json"
        cfg.write_text(json.dumps(doc))
        out = tmp_path / "out" / "model.safetensors"
        args = (src, out, "--to", "fp8", "--config", cfg)
        path = out.parent / "config.json"
    rc, _, err = run_main("convert", "-q", *args)
    assert rc == 0, err
    written = json.loads(path.read_text())
    assert "compression_config" not in written and "quantization_config" in written
    assert run_main("verify", src, out)[0] == 0
    written["compression_config"] = INT4
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", src, out, *loose)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert f"{path}: " in line and "has a `compression_config` beside" in line, line


@pytest.mark.parametrize("folder", ["new", "existing"])
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_a_lone_output_named_config_json_is_refused_before_it_is_written(
    tmp_path, run_main, folder, force
):
    """DST `config.json` with --config: the config would be written over the weights.
    Refused before the first byte, its folder new or not, and no hint to a `--force`
    that cannot help (attack z11, r7)."""
    src = _file(tmp_path)
    out = tmp_path / "out"
    if folder == "existing":
        out.mkdir()
    options = ["--force"] if force else []
    dst = out / "config.json"
    rc, _, err = run_main("convert", src, dst, "--config", _config(tmp_path), *options)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert f"{dst}: the config path is the output file" in line, line
    assert "--force" not in line, line
    assert (folder == "existing") == out.exists()
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("to", ["bf16", "fp16", "fp8"])
def test_verify_checks_the_dtype_of_the_config_convert_wrote_beside_a_lone_output(
    tmp_path, run_main, to
):
    # (Attack z11 r2.) The record says --config was given: the config.json beside the output
    # is what convert writes of a config (its dtype the target's), checked as a folder's.
    src, cfg = _file(tmp_path), _config(tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    assert run_main("convert", "-q", src, out, "--to", to, "--config", cfg)[0] == 0
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", src, out, *loose)
        assert rc == 0, err
    path = out.parent / "config.json"
    written = path.read_text()
    other = "float16" if to != "fp16" else "bfloat16"
    path.write_text(written.replace(json.loads(written)["torch_dtype"], other))
    differs = "config.json: is not the config given to convert (--config) with the dtype set"
    rc, _, err = run_main("verify", src, out)
    assert rc == 1 and differs in assert_one_error_line(err), err
    # Loose judges it as a folder's: the same data, its dtype the target's, under FP8 too
    # (attack a3 F4: a loader casts the tensors left unquantized to it).
    rc, _, err = run_main("verify", src, out, "--loose")
    assert rc == 1 and differs in assert_one_error_line(err), err
    path.unlink()
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", src, out, *loose)
        assert rc == 1, err
        assert "config.json: is missing: DST's record says convert wrote it" in err


def test_verify_leaves_a_config_convert_was_not_given_as_it_is(tmp_path, run_main):
    # (Attack z11 r2.) Without --config, convert leaves a config.json beside its output as it
    # is, whatever dtype it says: its output passes (the record says no config was given).
    src, cfg = _file(tmp_path), _config(tmp_path)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    shutil.copy(cfg, out.parent / "config.json")
    assert run_main("convert", "-q", src, out)[0] == 0
    assert json.loads((out.parent / "config.json").read_text())["torch_dtype"] == "float32"
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err
