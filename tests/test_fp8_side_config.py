"""A lone file's FP8 output has no model config to take its `quantization_config`: it goes
beside the output, in `<stem>.quantization_config.json`, checked before anything is written,
published with the output, and named in one warning (issue 33: FP8 without a config was
silent, and transformers then read the E4M3 codes as the weights)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_error_line, write_safetensors


def _model(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {
        "model.layers.0.mlp.up_proj.weight": ("F32", [8, 16], rng.standard_normal((8, 16))),
        "model.layers.0.input_layernorm.weight": ("F32", [16], rng.standard_normal(16)),
        "lm_head.weight": ("F32", [4, 16], rng.standard_normal((4, 16))),
    }
    tensors = {k: (d, s, a.astype("f4")) for k, (d, s, a) in tensors.items()}
    return write_safetensors(tmp_path / "in.safetensors", tensors)


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_written_beside_and_named(tmp_path, run_main, to):
    src = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", to)
    assert rc == 0, err
    side = tmp_path / "out.quantization_config.json"
    assert f"its quantization_config is written to {side}" in err
    q = json.loads(side.read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["ignore"] == ["lm_head"]
    # The quantization_config a folder run writes for the same weights, key for key.
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(src.read_bytes())
    (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    rc, _, err = run_main("convert", folder, tmp_path / "hf", "--to", to)
    assert rc == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"] == q
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err


def test_an_existing_one_is_refused_before_anything_is_written(tmp_path, run_main):
    src = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    side = tmp_path / "out.quantization_config.json"
    side.write_text("mine\n")
    for command in (["convert"], ["inspect"], ["convert", "--dry-run"]):
        rc, _, err = run_main(*command[:1], src, out, "--to", "fp8", *command[1:])
        assert rc == 1, (command, err)
        line = assert_one_error_line(err)
        assert f"{side}: destination exists (--force replaces it)" in line, line
        assert not out.exists() and side.read_text() == "mine\n"
    rc, _, err = run_main("convert", src, out, "--to", "fp8", "--force")
    assert rc == 0, err
    assert "quantization_config" in json.loads(side.read_text())


def test_not_the_report_nor_an_input(tmp_path, run_main):
    src = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    side = tmp_path / "out.quantization_config.json"
    rc, _, err = run_main("convert", src, out, "--to", "fp8", "--report", side)
    assert rc == 1 and "the config path is the output file" in err, err
    assert not out.exists() and not side.exists()
    # A DST named so that the side file would be the input itself.
    alias = tmp_path / "a.quantization_config.json"
    alias.write_bytes(src.read_bytes())
    rc, _, err = run_main("convert", alias, tmp_path / "a.safetensors", "--to", "fp8")
    assert rc == 1 and "the config path is the input file" in err, err
    assert alias.read_bytes() == src.read_bytes() and not (tmp_path / "a.safetensors").exists()


def test_not_for_other_targets_nor_folders(tmp_path, run_main):
    src = _model(tmp_path)
    rc, _, err = run_main("convert", src, tmp_path / "out.safetensors")
    assert rc == 0, err
    assert "quantization_config" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors", "out.safetensors"]


@pytest.mark.parametrize("to", ["fp8", "bf16", "fp16"])
def test_config_given_goes_beside_with_dtype_and_quantization(tmp_path, run_main, to):
    """`--config FILE`: the model's config.json beside a lone file's output, as a folder run
    writes it from the same config (dtype set; under FP8 its quantization_config)."""
    src = _model(tmp_path)
    text = '{\n  "model_type": "llama",\n  "torch_dtype": "float32"\n}\n'
    given = tmp_path / "given.json"
    given.write_text(text)
    out = tmp_path / "hf" / "model.safetensors"
    out.parent.mkdir()
    rc, _, err = run_main("convert", src, out, "--to", to, "--config", given)
    assert rc == 0, err
    assert "no model config" not in err
    assert not (tmp_path / "hf" / "model.quantization_config.json").exists()
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(src.read_bytes())
    (folder / "config.json").write_text(text)
    rc, _, err = run_main("convert", folder, tmp_path / "ref", "--to", to)
    assert rc == 0, err
    assert (out.parent / "config.json").read_bytes() == (
        tmp_path / "ref" / "config.json"
    ).read_bytes()
    assert given.read_text() == text


def test_config_refusals(tmp_path, run_main):
    src = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]\n")
    rc, _, err = run_main("convert", src, out, "--config", bad)
    assert rc == 1 and f"{bad}: not a model config: not a JSON object" in err, err
    assert not out.exists()
    good = tmp_path / "config.json"
    good.write_text("{}\n")
    # The config given is where the output's would go: never written over.
    rc, _, err = run_main("convert", src, out, "--config", good, "--force")
    assert rc == 1 and "the config path is the input file" in err, err
    assert good.read_text() == "{}\n" and not out.exists()
    # A folder of files brings its own.
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(src.read_bytes())
    rc, _, err = run_main("convert", folder, tmp_path / "o", "--config", bad)
    assert rc == 2 and "--config applies to a lone checkpoint" in err, err


def test_a_dcp_folder_with_config_gives_a_loadable_folder(tmp_path, run_main):
    """The guide's DCP recipe: `convert ckpt/ --to fp8 --config config.json` writes the
    Hugging Face folder beside it, weights and the config that describes them."""
    from dcpfile import Tensor, rows, write_dcp

    rng = np.random.default_rng(11)
    tensors = {}
    for name, shape in [
        ("model.layers.0.mlp.up_proj.weight", (8, 16)),
        ("model.norm.weight", (16,)),
    ]:
        w = rng.standard_normal(shape).astype(np.float32)
        chunks = rows(w, [0, shape[0] // 2])
        tensors[name] = Tensor(w, chunks, ("model", name))
    src = tmp_path / "ckpt"
    write_dcp(src, tensors, ranks=2)
    given = tmp_path / "config.json"
    given.write_text('{"model_type": "llama", "torch_dtype": "float32"}\n')
    rc, _, err = run_main("convert", src, "--key", "model", "--to", "fp8", "--config", given)
    assert rc == 0, err
    out = tmp_path / "ckpt-fp8"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["model_type"] == "llama"
    assert config["quantization_config"]["config_groups"]
    rc, _, err = run_main("verify", src, out / "model.safetensors", "--key", "model")
    assert rc == 0, err
