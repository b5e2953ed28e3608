"""verify, strict and loose alike, passes one run's output: every converted tensor converted
to one target (as asked, else the one DST's converted tensors show), every quantized weight
with that target's strategy. Loose mode accepts a float tensor kept in its source dtype
(another tool's keep list), never one converted to another target's dtype. verify finds
convert's default output name in a DST folder for every target, and a copy an earlier run
left in DST (a run replacing its output deletes none of what it does not write) is no
difference while it holds SRC's bytes (attack z10 r1, r7, r2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import write_safetensors

pytestmark = pytest.mark.filterwarnings("ignore::stcast.StcastWarning")

FIX = Path(__file__).parent / "fixtures" / "fp8"
LLAMA = FIX / "llama-fp32" / "model.safetensors"
THEIRS = {"fp8": "llama-fp32.fp8-dynamic", "fp8-block": "llama-fp32.fp8-block"}

rng = np.random.default_rng(9)
A, B = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))


def as_(dtype: str, x: np.ndarray) -> tuple[str, list[int], np.ndarray]:
    np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[dtype]
    return (dtype, list(x.shape), x.astype(np_dtype))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_safetensors(tmp_path / "src.safetensors", {"a": as_("F32", A), "b": as_("F32", B)})


def verify(src: Path, dst: Path, run_main, *options: str) -> tuple[int, str]:
    rc, _, err = run_main("verify", src, dst, "-q", *options)
    return rc, err


@pytest.mark.parametrize("loose", [[], ["--loose"]])
def test_a_tensor_converted_to_another_target_fails(src, tmp_path, run_main, loose):
    all_f16 = write_safetensors(
        tmp_path / "f16.safetensors", {"a": as_("F16", A), "b": as_("F16", B)}
    )
    mixed = write_safetensors(
        tmp_path / "mixed.safetensors", {"a": as_("BF16", A), "b": as_("F16", B)}
    )
    # Under an explicit bf16 target, an F16 conversion is another target's.
    for dst in (all_f16, mixed):
        rc, err = verify(src, dst, run_main, "--to", "bf16", *loose)
        assert rc == 1, err
        assert "is F16 in DST" in err or "converted to F16 in DST" in err, err
    # Without one, the output's BF16 conversions show bf16: its F16 one is a second target.
    rc, err = verify(src, mixed, run_main, *loose)
    assert rc == 1 and "`b`" in err, err
    # One target throughout passes (fp16 inferred, or asked).
    assert verify(src, all_f16, run_main, *loose)[0] == 0
    assert verify(src, all_f16, run_main, "--to", "fp16", *loose)[0] == 0


def test_loose_accepts_a_kept_tensor_but_no_other_conversion(src, tmp_path, run_main):
    """What loose mode is for (docs/guide.md): a float tensor kept in its source dtype by
    another tool passes, under the target its other tensors show or the one asked."""
    kept = write_safetensors(
        tmp_path / "kept.safetensors", {"a": as_("F32", A), "b": as_("BF16", B)}
    )
    assert verify(src, kept, run_main, "--loose")[0] == 0
    assert verify(src, kept, run_main, "--loose", "--to", "bf16")[0] == 0
    assert verify(src, kept, run_main)[0] == 1  # strict: convert converts `a`
    rc, err = verify(src, kept, run_main, "--loose", "--to", "fp16")
    assert rc == 1 and "`b` is converted to BF16 in DST" in err, err


def shards(root: Path) -> Path:
    root.mkdir()
    r = np.random.default_rng(3)
    for i, name in [(1, "a.w"), (2, "b.w")]:
        data = r.standard_normal((8, 8)).astype(np.float32)
        shard = root / f"model-0000{i}-of-00002.safetensors"
        write_safetensors(shard, {name: ("F32", [8, 8], data)}, metadata={"format": "pt"})
    weight_map = {
        "a.w": "model-00001-of-00002.safetensors",
        "b.w": "model-00002-of-00002.safetensors",
    }
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


@pytest.mark.parametrize("to", [[], ["--to", "bf16"]])
@pytest.mark.parametrize("loose", [[], ["--loose"]])
def test_a_folder_with_a_shard_of_another_target_fails(tmp_path, run_main, loose, to):
    """Without records (--no-record), each shard verified alone under the target it shows
    passed: the first shard's target is the folder's."""
    h = shards(tmp_path / "H")
    x, c = tmp_path / "X", tmp_path / "C"
    assert run_main("convert", h, x, "-q", "--no-record")[0] == 0
    assert run_main("convert", h, c, "--to", "fp16", "-q", "--no-record")[0] == 0
    assert verify(h, x, run_main, *loose, *to)[0] == 0
    shutil.copy(c / "model-00002-of-00002.safetensors", x)
    rc, err = verify(h, x, run_main, *loose, *to)
    assert rc == 1 and "model-00002-of-00002.safetensors" in err and "F16" in err, err


@pytest.mark.parametrize("loose", [[], ["--loose"]])
def test_a_plain_bf16_output_is_no_fp8_output(tmp_path, run_main, loose):
    dst = tmp_path / "lb.safetensors"
    assert run_main("convert", LLAMA, dst, "-q")[0] == 0
    for to in ("fp8", "fp8-block"):
        rc, err = verify(LLAMA, dst, run_main, "--to", to, *loose)
        assert rc == 1 and "holds no NaN or inf" in err, err
    assert verify(LLAMA, dst, run_main, *loose)[0] == 0


@pytest.mark.parametrize("loose", [[], ["--loose"]])
def test_weights_quantized_with_another_strategy_fail(tmp_path, run_main, loose):
    block = tmp_path / "block.safetensors"
    assert run_main("convert", LLAMA, block, "--to", "fp8-block", "-q")[0] == 0
    rc, err = verify(LLAMA, block, run_main, "--to", "fp8", *loose)
    assert rc == 1, err
    assert verify(LLAMA, block, run_main, "--to", "fp8-block", *loose)[0] == 0


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_loose_still_passes_model_free_ptq_outputs(run_main, to):
    for given in ([], ["--to", to]):
        rc, err = verify(FIX / "llama-fp32", FIX / THEIRS[to], run_main, "--loose", *given)
        assert rc == 0, err


@pytest.mark.parametrize("to", ["bf16", "fp16", "fp8", "fp8-block"])
def test_verify_finds_the_default_name_in_a_dst_folder(tmp_path, run_main, to):
    """`convert FILE DIR/` writes DIR/<stem>-<to>.safetensors: `verify FILE DIR/` finds it,
    with or without --to (DST's record names it)."""
    out = tmp_path / f"out-{to}"
    assert run_main("convert", LLAMA, f"{out}/", "--to", to, "-q")[0] == 0
    assert verify(LLAMA, Path(f"{out}/"), run_main)[0] == 0
    assert verify(LLAMA, out, run_main, "--to", to)[0] == 0


def folder_with_companions(root: Path) -> Path:
    root.mkdir()
    w = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    write_safetensors(
        root / "model.safetensors", {"w": ("F32", [8, 8], w)}, metadata={"format": "pt"}
    )
    (root / "config.json").write_text('{"torch_dtype": "float32"}')
    (root / "optimizer.pt").write_bytes(b"x" * 100)
    (root / "tokenizer.json").write_text("{}")
    return root


def test_a_copy_an_earlier_run_left_is_named_by_both_commands(tmp_path, run_main):
    """A narrower --force run leaves an earlier run's copy (it deletes nothing it does not
    write): convert warns that verify fails the output while it is there, and verify says
    what it is: SRC's file, left out by the companion policy (never "not in SRC")."""
    h, o = folder_with_companions(tmp_path / "H"), tmp_path / "O"
    assert run_main("convert", h, o, "--include", "optimizer*", "-q")[0] == 0
    assert verify(h, o, run_main)[0] == 0
    rc, _, err = run_main("convert", h, o, "--force")
    assert rc == 0, err
    assert "DST holds `optimizer.pt`, which this run leaves out and does not delete" in err, err
    assert "(remove it, or --include it)" in err, err
    rc, err = verify(h, o, run_main)
    assert rc == 1, err
    want = "optimizer.pt: is in SRC, but left out by this run's companion policy (--include"
    assert want in err and "not in SRC" not in err, err
    assert verify(h, o, run_main, "--loose")[0] == 0  # loose ignores extra files
    assert verify(h, o, run_main, "--include", "optimizer*")[0] == 0
    rc, _, err = run_main("convert", h, o, "--force", "--exclude", "tokenizer*")
    assert rc == 0 and "DST holds `optimizer.pt`, `tokenizer.json`, which" in err, err
    (o / "optimizer.pt").unlink()
    rc, err = verify(h, o, run_main)
    assert rc == 1 and "tokenizer.json: is in SRC, but left out" in err, err
    # A file SRC does not hold is still one DST has and SRC has not; a run that leaves out
    # nothing DST holds says nothing of it.
    (o / "tokenizer.json").unlink()
    (o / "notes.txt").write_text("mine")
    rc, err = verify(h, o, run_main)
    assert rc == 1 and "notes.txt: is in DST but not in SRC" in err, err
    rc, _, err = run_main("convert", h, o, "--force", "--exclude", "tokenizer*")
    assert rc == 0 and "DST holds" not in err, err
