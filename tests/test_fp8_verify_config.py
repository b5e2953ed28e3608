"""FP8 outputs: verify proves that the config describes the tensors (strict and loose alike),
reads the strategy from it, and convert refuses an input that is quantized already (issue 30:
findings 1, 5, 6 and the `ignore` part of 11)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, tensor_bytes, write_safetensors

FIX = Path(__file__).parent / "fixtures" / "fp8"
# model_free_ptq's own outputs of the committed fp32 source.
THEIRS = {"fp8": "llama-fp32.fp8-dynamic", "fp8-block": "llama-fp32.fp8-block"}
Q_PROJ = "model.layers.0.self_attn.q_proj"


def ours(tmp_path: Path, to: str) -> Path:
    """convert's own output of the fp32 fixture folder."""
    out = tmp_path / f"ours-{to}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k_proj's 64 rows under blocks: vLLM may refuse
        stcast.convert(FIX / "llama-fp32", out, to=to)
    return out


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    doc = json.loads(path.read_text())
    edit(doc["quantization_config"])
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def group(q: dict) -> dict:
    (g,) = q["config_groups"].values()
    return g


def set_block(q: dict) -> None:
    group(q)["weights"]["block_structure"] = [64, 64]


def add_quantized_to_ignore(q: dict) -> None:
    q["ignore"] = [*q["ignore"], Q_PROJ]


def set_format(q: dict) -> None:
    q["format"] = "naive-quantized"


def set_group_format(q: dict) -> None:
    group(q)["format"] = "int-quantized"


def drop_activations(q: dict) -> None:
    group(q)["input_activations"] = None


def set_targets(q: dict) -> None:
    group(q)["targets"] = ["re:.*mlp.*"]


def ignore_everything(q: dict) -> None:
    q["ignore"] = ["re:.*"]


def set_strategy(q: dict) -> None:
    w = group(q)["weights"]
    w["strategy"] = "tensor"


TAMPERS = {
    "quantized module in ignore": add_quantized_to_ignore,
    "block_structure [64, 64]": set_block,
    "format": set_format,
    "group format": set_group_format,
    "activations removed": drop_activations,
    "targets": set_targets,
    "ignore re:.*": ignore_everything,
    "strategy": set_strategy,
}


@pytest.mark.parametrize("who", ["ours", "theirs"])
@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_verify_refuses_a_config_that_misdescribes_the_tensors(tmp_path, run_main, who, to, tamper):
    if tamper == "block_structure [64, 64]" and to == "fp8":
        pytest.skip("per-channel weights have no block structure")
    dst = ours(tmp_path, to) if who == "ours" else tmp_path / "theirs"
    if who == "theirs":
        shutil.copytree(FIX / THEIRS[to], dst)
    # Untouched, it passes (strict for our own output, loose for both).
    modes = [["--loose"], []] if who == "ours" else [["--loose"]]
    for mode in modes:
        rc, _, err = run_main("verify", FIX / "llama-fp32", dst, "--to", to, *mode)
        assert rc == 0, (mode, err)
    edit_config(dst, TAMPERS[tamper])
    for mode in [["--loose"], []]:
        for given in (["--to", to], []):
            rc, _, err = run_main("verify", FIX / "llama-fp32", dst, *given, *mode)
            assert rc == 1, (mode, given, err)
            if mode:  # loose: the tensors are a conversion; the config is what is wrong
                assert "config.json" in err, err


@pytest.mark.parametrize("who", ["ours", "theirs"])
@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_verify_refuses_a_weight_left_unquantized_outside_ignore(tmp_path, run_main, who, to):
    """q_proj put back to BF16 without its scale, not listed in `ignore`: a loader would
    make up a scale for it. The tensors themselves are a valid loose conversion."""
    dst = ours(tmp_path, to) if who == "ours" else tmp_path / "theirs"
    if who == "theirs":
        shutil.copytree(FIX / THEIRS[to], dst)
    src = tensor_bytes(FIX / "llama-fp32" / "model.safetensors")
    got = tensor_bytes(dst / "model.safetensors")
    name = Q_PROJ + ".weight"
    w = np.frombuffer(src[name][2], np.float32).astype(ml_dtypes.bfloat16)
    got[name] = ("BF16", src[name][1], w.tobytes())
    del got[name + "_scale"]
    write_safetensors(dst / "model.safetensors", got)
    index_path = dst / "model.safetensors.index.json"
    if index_path.exists():  # model_free_ptq writes one for a single shard too
        index = json.loads(index_path.read_text())
        del index["weight_map"][name + "_scale"]
        index["metadata"]["total_size"] = sum(len(t[2]) for t in got.values())
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    rc, _, err = run_main("verify", FIX / "llama-fp32", dst, "--to", to, "--loose")
    assert rc == 1, err
    assert "config.json" in err and Q_PROJ in err and "ignore" in err, err
    # Listed in `ignore`, the config describes the tensors again.
    edit_config(dst, lambda q: q.update(ignore=[*q["ignore"], Q_PROJ]))
    rc, _, err = run_main("verify", FIX / "llama-fp32", dst, "--to", to, "--loose")
    assert rc == 0, err


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_verify_loose_passes_convert_and_model_free_ptq_outputs(tmp_path, run_main, to):
    for dst in (ours(tmp_path, to), FIX / THEIRS[to]):
        for given in (["--to", to], []):
            rc, _, err = run_main("verify", FIX / "llama-fp32", dst, *given, "--loose")
            assert rc == 0, (dst, given, err)


# --- finding 11: every 2-D weight left unquantized is in `ignore` -----------------------------


def test_int8_matrix_weight_is_ignored(tmp_path, run_main):
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    src.mkdir()
    tensors = {
        "model.layers.0.mlp.up_proj.weight": ("F32", [8, 16], rng.standard_normal((8, 16))),
        "model.layers.0.mlp.packed.weight": ("I8", [4, 16], rng.integers(-9, 9, (4, 16))),
        "model.layers.0.mlp.down_proj.weight": ("F32", [16, 8], rng.standard_normal((16, 8))),
    }
    tensors = {
        k: (d, s, a.astype("f4" if d == "F32" else "i1")) for k, (d, s, a) in tensors.items()
    }
    write_safetensors(src / "model.safetensors", tensors)
    (src / "config.json").write_text('{"torch_dtype": "float32"}\n')
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, "--to", "fp8")
    assert rc == 0, err
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["model.layers.0.mlp.packed"]
    with pytest.warns(stcast.StcastWarning, match="no model config describes this FP8 output"):
        report = stcast.convert(src / "model.safetensors", tmp_path / "one.safetensors", to="fp8")
    assert report.unquantized == ["model.layers.0.mlp.packed"]
    # A lone file's quantization_config, beside it: the folder's, word for word.
    beside = json.loads((tmp_path / "one.quantization_config.json").read_text())
    assert beside == {
        "quantization_config": json.loads((out / "config.json").read_text())["quantization_config"]
    }
    for mode in ([], ["--loose"]):
        rc, _, err = run_main("verify", src, out, *mode)
        assert rc == 0, err
    # A config that leaves it out does not describe the tensors.
    edit_config(out, lambda q: q.update(ignore=[]))
    rc, _, err = run_main("verify", src, out, "--loose")
    assert rc == 1 and "packed" in err, err


# --- finding 5: a scale that fits both strategies --------------------------------------------


def one_row_model(rng) -> dict:
    """A weight of one row and <= 128 columns first (its block scale is [1, 1], as a channel
    scale is), then weights whose scale shows the strategy."""
    return {
        "model.layers.0.mlp.gate.proj.weight": ("F32", [1, 64], rng.standard_normal((1, 64))),
        "model.layers.0.mlp.up_proj.weight": ("F32", [130, 200], rng.standard_normal((130, 200))),
        "model.layers.1.mlp.tiny.weight": ("F32", [1, 128], rng.standard_normal((1, 128))),
    }


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_verify_one_row_weight_file(tmp_path, run_main, to):
    rng = np.random.default_rng(5)
    tensors = {k: (d, s, a.astype("f4")) for k, (d, s, a) in one_row_model(rng).items()}
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    with pytest.warns(stcast.StcastWarning, match="no model config"):
        stcast.convert(src, out, to=to)
    for given in (["--to", to], []):
        for mode in ([], ["--loose"]):
            rc, _, err = run_main("verify", src, out, *given, *mode)
            assert rc == 0, (given, mode, err)
    assert stcast.verify(src, out).to == to


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_verify_folder_reads_the_strategy_from_the_config(tmp_path, run_main, to):
    """The first shard holds only a one-row weight (either strategy's scale); the second
    shows the strategy. Without --to, verify reads it from config.json."""
    rng = np.random.default_rng(6)
    src = tmp_path / "src"
    src.mkdir()
    a = {"model.layers.0.mlp.tiny.weight": ("F32", [1, 96], rng.standard_normal((1, 96)))}
    b = {"model.layers.1.mlp.up_proj.weight": ("F32", [130, 200], rng.standard_normal((130, 200)))}
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for name, part in (
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ):
        write_safetensors(src / name, {k: (d, s, x.astype("f4")) for k, (d, s, x) in part.items()})
        index["weight_map"].update({k: name for k in part})
        index["metadata"]["total_size"] += sum(x.size * 4 for _, _, x in part.values())
    (src / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (src / "config.json").write_text('{"torch_dtype": "float32"}\n')
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, "--to", to)
    assert rc == 0, err
    for given in (["--to", to], []):
        for mode in ([], ["--loose"]):
            rc, _, err = run_main("verify", src, out, *given, *mode)
            assert rc == 0, (given, mode, err)


# --- finding 6: an FP8 input under an FP8 target -----------------------------------------------


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
@pytest.mark.parametrize(
    "options",
    [[], ["--allow-quantized"], ["--keep", "*scale*"], ["--allow-quantized", "--keep", "*scale*"]],
)
def test_fp8_input_refused_whatever_the_options(tmp_path, run_main, to, options):
    src = FIX / "llama-fp32.fp8-dynamic" / "model.safetensors"
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", to, *options)
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "already quantized" in line and "F8_E4M3" in line and "model.safetensors" in line
    assert "--allow-quantized" not in line and "--keep" not in line, line
    assert not out.exists()
    # The folder too (its config names it quantized as well).
    rc, _, err = run_main(
        "convert", FIX / "llama-fp32.fp8-dynamic", tmp_path / "dir", "--to", to, *options
    )
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "already quantized" in line, line
    assert "--allow-quantized" not in line and "--keep" not in line, line
    assert not (tmp_path / "dir").exists()


def test_quantized_config_refused_under_fp8(tmp_path, run_main):
    """An int8 checkpoint's folder (its config has a quantization_config): no flag converts
    it to FP8."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(1)
    write_safetensors(
        src / "model.safetensors",
        {"m.weight": ("F32", [4, 8], rng.standard_normal((4, 8)).astype("f4"))},
    )
    (src / "config.json").write_text('{"quantization_config": {"quant_method": "bitsandbytes"}}\n')
    for options in ([], ["--allow-quantized"], ["--keep", "*scale*"]):
        rc, _, err = run_main("convert", src, tmp_path / "out", "--to", "fp8", *options)
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert "already quantized" in line and "config.json" in line, line
        assert "--allow-quantized" not in line and "--keep" not in line, line


def test_dequantized_folder_with_an_fp8_config_is_a_config_difference(tmp_path, run_main):
    """DST's config says FP8 but SRC is the FP8 one: verify does not take DST's strategy for
    the target (that would ask for FP8 input quantized again), the config differs."""
    src = FIX / THEIRS["fp8"]
    out = tmp_path / "bf16"
    rc, _, err = run_main("convert", src, out, "--to", "bf16")
    assert rc == 0, err
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"] = json.loads((src / "config.json").read_text())[
        "quantization_config"
    ]
    (out / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    rc, _, err = run_main("verify", src, out)
    assert rc == 1 and "config.json" in err and "already quantized" not in err, err


def ct_matches(entry: str, module: str, classes: tuple[str, ...]) -> bool:
    """compressed-tensors' rule for an `ignore` or `targets` entry (utils/match.py): `re:X`
    is `re.match(X, name)`; another entry is the module's name or the name of its class or
    a class it derives from."""
    import re

    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module or entry in classes


@pytest.mark.parametrize("module", ["re:.*", "Linear", "Module", "re:b"])
def test_fp8_ignore_entry_from_module_name(tmp_path, run_main, module):
    """`MODULE.weight` holds a NaN (so it stays BF16 and goes into `ignore`), `b.weight` is
    quantized. The module's name went into `ignore` as it is, which compressed-tensors reads
    as a regex (`re:.*`) or a class name (`Linear`, `Module`: every Linear module), naming
    `b` too; verify then refused convert's own output. Now such a name is written as an
    escaped regex anchored at both ends, naming that module only; verify passes it."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    w[0, 0] = np.nan
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(
        src / "model.safetensors",
        {
            f"{module}.weight": ("F32", [4, 8], w),
            "b.weight": ("F32", [4, 8], rng.standard_normal((4, 8)).astype(np.float32)),
            "lm_head.weight": ("F32", [4, 8], w),
        },
    )
    (src / "config.json").write_text(json.dumps({"model_type": "x"}))
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, "--to", "fp8")
    assert rc == 0, err
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    linear = ("Linear", "Module")
    for name in (module, "lm_head"):
        assert [e for e in ignore if ct_matches(e, name, linear)], (name, ignore)
    assert not [e for e in ignore if ct_matches(e, "b", linear)], ignore
    assert not [e for e in ignore if ct_matches(e, module + "x", linear)], ignore
    assert "lm_head" in ignore  # a plain name stays as llm-compressor writes it
    rc, _, err = run_main("verify", src, out, "--to", "fp8")
    assert rc == 0, err
    rc, _, err = run_main("verify", src, out, "--to", "fp8", "--loose")
    assert rc == 0, err


def test_loose_fp8_dcp_output_with_copied_config(tmp_path, run_main):
    """`convert DCP hf/ --key model --to fp8 --max-shard-size 1KB`, then the model's
    config.json copied into hf/ (without a quantization_config, a loader reads the E4M3
    codes as the weights). `verify --loose` passed it (loose ignores extra files); now a
    model config added beside FP8 shards must describe them, strict and loose. One with
    the quantization_config a folder conversion writes passes loose."""
    dcp = Path(__file__).parent / "fixtures" / "dcp" / "fsdp2-1d-3ranks"
    out = tmp_path / "hf"
    rc, _, err = run_main(
        "convert", dcp, out, "--key", "model", "--to", "fp8", "--max-shard-size", "1KB"
    )
    assert rc == 0, err
    assert run_main("verify", dcp, out, "--key", "model")[0] == 0
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, _, err = run_main("verify", dcp, out, "--key", "model", "--loose")
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "config.json" in line and "quantization_config" in line, line
    rc, _, err = run_main("verify", dcp, out, "--key", "model")
    assert rc == 1 and "config.json" in err, err
    # A config that describes the shards passes loose: the model's, with the
    # quantization_config that the conversion (which had no config) wrote beside them.
    quantization = json.loads((out / "quantization_config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "llama", **quantization}))
    rc, _, err = run_main("verify", dcp, out, "--key", "model", "--loose")
    assert rc == 0, err


def test_a_folder_whose_top_quantizes_nothing_verifies_with_its_subfolder_side_config(
    tmp_path, run_main
):
    """A folder with no model config whose top file holds only a norm (no weight FP8
    quantizes) while a subfolder's holds a projection: convert writes the quantization_config
    beside the subfolder's FP8 shard only, and verify passes it (before, it wanted one at the
    top too: convert and verify disagreed). Without the subfolder's, verify still fails."""
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    norm = rng.standard_normal(64).astype(np.float32)
    proj = rng.standard_normal((64, 64)).astype(np.float32)
    write_safetensors(src / "model.safetensors", {"model.norm.weight": ("F32", [64], norm)})
    write_safetensors(
        src / "sub" / "model.safetensors",
        {"model.layers.0.mlp.down_proj.weight": ("F32", [64, 64], proj)},
    )
    dst = tmp_path / "dst"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no model config describes the FP8 output)
        stcast.convert(src, dst, to="fp8")
    assert (dst / "sub" / "quantization_config.json").is_file()
    assert not (dst / "quantization_config.json").exists()
    assert run_main("verify", src, dst, "-q") == (0, "", "")
    (dst / "sub" / "quantization_config.json").unlink()
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and "sub/quantization_config.json" in assert_one_error_line(err), err
