"""A lone checkpoint's FP8 output and the quantization_config convert writes beside it,
judged as a folder's by the run's target (attack a3 F3, F5): an FP8 run in which no weight
is quantized (all NaN, norms only, empty weights) still writes one, every module in its
`ignore`, and verify passes it; strict verify fails an FP8 output whose quantization_config
convert wrote is gone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import stcast
from conftest import write_safetensors


def _nan_weight():
    w = np.ones((4, 8), np.float32)
    w[0, 0] = np.nan
    return {"m.x.weight": ("F32", [4, 8], w)}


WEIGHTS = {
    "nan": _nan_weight,
    "norms": lambda: {"m.norm.weight": ("F32", [8], np.ones(8, np.float32))},
    "empty": lambda: {"m.x.weight": ("F32", [0, 8], np.zeros((0, 8), np.float32))},
}


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")
@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("how", ["plain", "config", "no-record"])
def test_a_lone_fp8_output_that_quantizes_nothing_verifies(tmp_path, run_main, to, weights, how):
    src = write_safetensors(tmp_path / "in.safetensors", WEIGHTS[weights]())
    out = tmp_path / "o" / "model.safetensors"
    out.parent.mkdir()
    extra: list[object] = []
    if how == "config":
        given = tmp_path / "given.json"
        given.write_text('{"model_type": "llama", "torch_dtype": "float32"}\n')
        extra = ["--config", given]
    elif how == "no-record":
        extra = ["--no-record"]
    rc, _, err = run_main("convert", src, out, "--to", to, *extra)
    assert rc == 0, err
    side = out.parent / ("config.json" if how == "config" else "model.quantization_config.json")
    q = json.loads(side.read_text())["quantization_config"]
    assert q["ignore"] == ([] if weights == "norms" else ["m.x"]), q
    for loose in ([], ["--loose"]):
        rc, _, err = run_main("verify", src, out, *loose)
        assert rc == 0, (loose, err)
    # Its target is the run's, as a folder's is (its tensors became BF16, as under bf16).
    assert stcast.verify(src, out).to == to
    # A folder of the same weights writes the same quantization_config, and verifies.
    folder = tmp_path / "F"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(src.read_bytes())
    (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    rc, _, err = run_main("convert", folder, tmp_path / "Fo", "--to", to)
    assert rc == 0, err
    assert json.loads((tmp_path / "Fo" / "config.json").read_text())["quantization_config"] == q
    assert stcast.verify(folder, tmp_path / "Fo").to == to
    # Asked for a dense target, the quantization_config beside it is wrong.
    rc, _, err = run_main("verify", src, out, "--to", "bf16")
    assert rc == 1 and "while the weights beside it are not quantized" in err, err


def _quantized(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {
        "m.up.weight": ("F32", [8, 16], rng.standard_normal((8, 16)).astype("f4")),
        "m.norm.weight": ("F32", [16], np.ones(16, np.float32)),
    }
    return write_safetensors(tmp_path / "in.safetensors", tensors)


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")
@pytest.mark.parametrize("weights", ["quantized", "nan"])
@pytest.mark.parametrize("record", [True, False])
def test_strict_fails_a_lone_fp8_output_without_its_side_config(
    tmp_path, run_main, weights, record
):
    """As a folder missing its quantization_config.json fails strict (attack z11 r4)."""
    if weights == "quantized":
        src = _quantized(tmp_path)
    else:
        src = write_safetensors(tmp_path / "in.safetensors", _nan_weight())
    out = tmp_path / "out.safetensors"
    no_record = [] if record else ["--no-record"]
    rc, _, err = run_main("convert", src, out, "--to", "fp8", *no_record)
    assert rc == 0, err
    side = tmp_path / "out.quantization_config.json"
    side.unlink()
    # Without a record, the target is given (nothing else says it of unquantized weights).
    to = [] if record or weights == "quantized" else ["--to", "fp8"]
    rc, _, err = run_main("verify", src, out, *to)
    assert rc == 1, err
    assert f"{side}: is missing: convert writes the quantization_config" in err, err
    # Loose takes weights without it, as a folder's.
    assert run_main("verify", src, out, "--loose", *to)[0] == 0


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")
@pytest.mark.parametrize("config", [True, False])
def test_one_file_of_an_fp8_folder_output_verifies_alone(tmp_path, config):
    """Its quantization_config is the folder's (config.json, or quantization_config.json)."""
    folder = tmp_path / "F"
    folder.mkdir()
    _quantized(tmp_path)
    (folder / "a.safetensors").write_bytes((tmp_path / "in.safetensors").read_bytes())
    (folder / "b.safetensors").write_bytes((tmp_path / "in.safetensors").read_bytes())
    if config:
        (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    stcast.convert(folder, tmp_path / "Fo", to="fp8")
    side = tmp_path / "Fo" / ("config.json" if config else "quantization_config.json")
    assert side.exists()
    assert stcast.verify(folder / "a.safetensors", tmp_path / "Fo" / "a.safetensors").ok
    side.unlink()
    report = stcast.verify(folder / "a.safetensors", tmp_path / "Fo" / "a.safetensors")
    assert not report.ok


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")
@pytest.mark.parametrize("to", ["fp8", "bf16"])
def test_loose_takes_a_config_dtype_of_src_or_the_target_only(tmp_path, run_main, to):
    """(Attack a3 F4.) An FP8 folder's config.json, as a bf16 one's: its dtype SRC's (what
    another tool leaves, FP8 only) or the target's, not another: a loader casts the tensors
    left unquantized to it. Nested configs' dtypes alike."""
    folder = tmp_path / "F"
    folder.mkdir()
    _quantized(tmp_path)
    (folder / "model.safetensors").write_bytes((tmp_path / "in.safetensors").read_bytes())
    config = {"model_type": "llama", "torch_dtype": "float32", "text_config": {"dtype": "float32"}}
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "Fo"
    rc, _, err = run_main("convert", folder, out, "--to", to)
    assert rc == 0, err
    written = json.loads((out / "config.json").read_text())
    assert written["text_config"]["dtype"] == "bfloat16"
    for dtype, nested, loose_ok in [
        ("bfloat16", "bfloat16", True),
        ("float32", "float32", to == "fp8"),
        ("float16", "float32", False),
        ("float16", "float16", False),
        ("bfloat16", "float16", False),
    ]:
        edited = dict(written, torch_dtype=dtype, text_config={"dtype": nested})
        (out / "config.json").write_text(json.dumps(edited))
        rc, _, err = run_main("verify", folder, out, "--loose")
        assert (rc == 0) == loose_ok, (dtype, nested, err)
        if not loose_ok:
            assert f"{out / 'config.json'}:" in err, err


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")
@pytest.mark.parametrize("to", ["fp8", "bf16"])
def test_loose_fails_another_dtype_in_a_lone_outputs_given_config(tmp_path, run_main, to):
    """The config a `--config` run wrote, its own source: its dtype the target's, FP8 too."""
    src = _quantized(tmp_path)
    given = tmp_path / "given.json"
    given.write_text('{"model_type": "llama", "torch_dtype": "float32"}\n')
    out = tmp_path / "o" / "model.safetensors"
    out.parent.mkdir()
    rc, _, err = run_main("convert", src, out, "--to", to, "--config", given)
    assert rc == 0, err
    config = out.parent / "config.json"
    written = json.loads(config.read_text())
    config.write_text(json.dumps(written))
    assert run_main("verify", src, out, "--loose")[0] == 0
    config.write_text(json.dumps(dict(written, torch_dtype="float16")))
    rc, _, err = run_main("verify", src, out, "--loose")
    assert rc == 1 and f"{config}: is not the config given to convert" in err, err
