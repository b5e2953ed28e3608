"""An FP8 re-sharding of a lone checkpoint (a file, a DCP folder) gets its config as a lone
file's output does: with `--config`, the model's config.json with its dtype and the
quantization_config of the shards; without, `quantization_config.json` in the output folder
and one warning naming it. verify passes both and fails a tampered one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_safetensors
from dcpfile import Tensor, rows, write_dcp

SHAPES = {
    "model.layers.0.mlp.up_proj.weight": (32, 16),
    "model.layers.0.mlp.down_proj.weight": (16, 32),
    "model.layers.0.input_layernorm.weight": (16,),
    "lm_head.weight": (8, 16),
}


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _file(tmp_path):
    tensors = {k: ("F32", list(a.shape), a) for k, a in _arrays().items()}
    return write_safetensors(tmp_path / "in.safetensors", tensors)


def _dcp(tmp_path):
    ck = tmp_path / "dcp"
    tensors = {
        k: Tensor(a, rows(a, [0, a.shape[0] // 2]), tuple(k.split(".")[:1]) + (k,))
        for k, a in _arrays().items()
    }
    write_dcp(ck, {k: Tensor(t.value, t.chunks, (k,)) for k, t in tensors.items()})
    return ck


@pytest.mark.parametrize("make", [_file, _dcp])
def test_without_a_config_quantization_config_json_is_written_and_named(tmp_path, run_main, make):
    src = make(tmp_path)
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--to", "fp8", "--max-shard-size", "1KB")
    assert rc == 0, err
    side = dst / "quantization_config.json"
    assert err.count("no model config describes this FP8 output") == 1, err
    assert f"its quantization_config is written to {side}" in err
    q = json.loads(side.read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["ignore"] == ["lm_head"]
    assert not (dst / "config.json").exists()
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err
    q["ignore"] = []
    side.write_text(json.dumps({"quantization_config": q}, indent=2) + "\n")
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and "quantization_config.json" in err, err


@pytest.mark.parametrize("make", [_file, _dcp])
def test_with_a_config_the_output_gets_it_with_dtype_and_quantization_config(
    tmp_path, run_main, make
):
    src = make(tmp_path)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "torch_dtype": "float32"}\n')
    dst = tmp_path / "out"
    rc, _, err = run_main(
        "convert", src, dst, "--to", "fp8", "--max-shard-size", "1KB", "--config", config
    )
    assert rc == 0, err
    assert "no model config describes" not in err
    assert not (dst / "quantization_config.json").exists()
    written = json.loads((dst / "config.json").read_text())
    assert written["model_type"] == "llama"
    assert written["torch_dtype"] == "bfloat16"
    assert written["quantization_config"]["ignore"] == ["lm_head"]
    assert len(list(dst.glob("*.safetensors"))) > 1
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err
    # A bf16 re-sharding takes the config too, its dtype set.
    other = tmp_path / "bf16"
    rc, _, err = run_main("convert", src, other, "--max-shard-size", "1KB", "--config", config)
    assert rc == 0, err
    assert json.loads((other / "config.json").read_text()) == {
        "model_type": "llama",
        "torch_dtype": "bfloat16",
    }


def test_config_is_refused_with_shard_runs(tmp_path, run_main):
    src = _file(tmp_path)
    config = tmp_path / "config.json"
    config.write_text("{}\n")
    rc, _, err = run_main(
        "convert",
        src,
        tmp_path / "out",
        "--max-shard-size",
        "1KB",
        "--shard",
        "1/2",
        "--config",
        config,
    )
    assert rc == 2, err
    assert "--config applies to a lone checkpoint" in err
