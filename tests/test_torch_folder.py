"""Folders of PyTorch weights (Hugging Face layouts) become safetensors folders.

`pytorch_model.bin` -> `model.safetensors`, shards `pytorch_model-0000i-of-0000N.bin` ->
`model-0000i-of-0000N.safetensors`, `pytorch_model.bin.index.json` ->
`model.safetensors.index.json` (the new names, the new total size), diffusers'
`diffusion_pytorch_model.bin` -> `diffusion_pytorch_model.safetensors`; configs rewritten as
for safetensors; `.bin` weights not copied; beside a safetensors version the PyTorch files
are left out; trainer state is left out unread. Resume, shards and finalize work as for
safetensors folders.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import stcast
import torchfile as tf
from conftest import assert_one_error_line
from reference import bf16_bits_ml_dtypes

pytestmark = pytest.mark.filterwarnings("ignore::stcast.StcastWarning")

CANARY = "stcast-canary"


class _System:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        import os

        return (os.system, (self.cmd,))


def save_bin(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    objs, storages = tf.StateDict(dict(arrays)).pickled()
    tf.write_zip(
        path, tf.Ordered(list(objs.items()), {"_metadata": {"": {"version": 1}}}), storages
    )


def layer(rng, k: int) -> dict[str, np.ndarray]:
    return {
        f"model.layers.{k}.mlp.weight": rng.standard_normal((4, 8), dtype=np.float32),
        f"model.layers.{k}.norm.weight": rng.standard_normal(8).astype(np.float16),
        f"model.layers.{k}.position_ids": np.arange(5, dtype=np.int64),
    }


def make_bin_model(root: Path, rng, shards: int = 2, trainer: bool = True) -> dict[str, dict]:
    """A sharded `pytorch_model-*.bin` checkpoint as transformers saves it, with trainer
    state beside it (whose optimizer.pt would create the canary if it were unpickled)."""
    root.mkdir(parents=True)
    weight_map, arrays = {}, {}
    for k in range(shards):
        name = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        a = layer(rng, k)
        save_bin(root / name, a)
        weight_map.update({t: name for t in a})
        arrays[name] = a
    index = {"metadata": {"total_size": 12345}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text('{\n  "torch_dtype": "float32",\n  "hidden": 8\n}\n')
    (root / "tokenizer.json").write_text('{"version": "1.0"}\n')
    if trainer:
        canary = root.parent / CANARY
        (root / "optimizer.pt").write_bytes(pickle.dumps(_System(f"touch {canary}"), protocol=2))
        (root / "scheduler.pt").write_bytes(b"\x80\x02}q\x00.")
        (root / "rng_state_0.pth").write_bytes(b"not even a pickle")
        (root / "training_args.bin").write_bytes(pickle.dumps(_System(f"touch {canary}")))
    return arrays


def bf16(a: np.ndarray) -> np.ndarray:
    if a.dtype in (np.float32, np.float16):
        return bf16_bits_ml_dtypes(a).view(ml_dtypes.bfloat16)
    return a


def check_shards(dst: Path, arrays: dict[str, dict], to: str = "bf16") -> None:
    for name, a in arrays.items():
        out = dst / name.replace("pytorch_model", "model").replace(".bin", ".safetensors")
        with safetensors.safe_open(str(out), framework="numpy") as f:
            # "format", then the record of convert's options (issue 33).
            assert f.metadata() == {"format": "pt", "stcast": f'{{"to":"{to}"}}'}
            assert set(f.keys()) == set(a)
        raw = Path(out).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        for t, x in a.items():
            want = bf16(x) if to == "bf16" else x
            lo, hi = header[t]["data_offsets"]
            assert raw[8 + n + lo : 8 + n + hi] == want.tobytes(), t


def test_a_sharded_bin_folder_converts(tmp_path, rng, run_main):
    src = tmp_path / "ckpt"
    arrays = make_bin_model(src, rng)
    dst = tmp_path / "out"
    rc, out, err = run_main("convert", src, dst)
    assert rc == 0, err
    sizes = {n: os.path.getsize(src / n) for n in os.listdir(src)}
    named = ", ".join(
        f"`{n}` ({stcast._core.format_bytes(sizes[n])})"
        for n in ("optimizer.pt", "rng_state_0.pth", "scheduler.pt", "training_args.bin")
    )
    assert f"left out: training state, not weights (never read): {named}" in err
    assert not (tmp_path / CANARY).exists()
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    check_shards(dst, arrays)
    index_text = (dst / "model.safetensors.index.json").read_text()
    index = json.loads(index_text)
    want_map = {
        t: n.replace("pytorch_model", "model").replace(".bin", ".safetensors")
        for n, a in arrays.items()
        for t in a
    }
    assert index["weight_map"] == dict(sorted(want_map.items()))
    sizes = sum(
        len(Path(dst / n).read_bytes())
        - 8
        - int.from_bytes(Path(dst / n).read_bytes()[:8], "little")
        for n in set(want_map.values())
    )
    assert index["metadata"]["total_size"] == sizes
    # Only the names and the total size changed in the text, and the record added.
    src_text = (src / "pytorch_model.bin.index.json").read_text()
    src_text = src_text.replace("pytorch_model-", "model-").replace(".bin", ".safetensors")
    record = '"stcast": "{\\"to\\":\\"bf16\\"}"'
    assert index_text == src_text.replace("12345", f"{sizes},\n    {record}")
    assert (
        dst / "config.json"
    ).read_text() == '{\n  "torch_dtype": "bfloat16",\n  "hidden": 8\n}\n'
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0, err
    # Resume: everything is done already.
    rc, out, err = run_main("convert", src, dst, "--resume")
    assert rc == 0 and "nothing to do" in out, (out, err)
    # One output gone: resume converts it alone.
    (dst / "model-00002-of-00002.safetensors").unlink()
    rc, out, err = run_main("convert", src, dst, "--resume", "--json")
    assert rc == 0, err
    entries = json.loads(out)["result"]["files"]
    files = {f["path"]: f["action"] for f in entries}
    assert files["model-00001-of-00002.safetensors"] == "skipped"
    assert files["model-00002-of-00002.safetensors"] == "converted"
    sources = {f["path"]: f["source"] for f in entries}
    assert sources["model-00002-of-00002.safetensors"] == "pytorch_model-00002-of-00002.bin"
    assert sources["model.safetensors.index.json"] == "pytorch_model.bin.index.json"
    assert sources["tokenizer.json"] is None
    # inspect describes the source: its files by their own names.
    r = stcast.inspect(src)
    assert [f.path for f in r.files] == [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
    ]
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0, err


@pytest.mark.parametrize("shards", [1, 2])
def test_keep_changes_the_format_only(tmp_path, rng, shards):
    src = tmp_path / "ckpt"
    arrays = make_bin_model(src, rng, shards=shards, trainer=False)
    dst = tmp_path / "out"
    report = stcast.convert(src, dst, to="keep")
    assert report.tensors_converted == 0
    check_shards(dst, arrays, to="keep")
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()
    # The target inferred: keep (sharded folders are checked through their index first, as
    # a re-sharding: the inference holds there too).
    assert stcast.verify(src, dst).ok
    assert stcast.verify(src, dst, to="keep").ok
    assert not stcast.verify(src, dst, to="bf16").ok
    # Re-sharded, a folder or a single checkpoint file.
    first = src / next(iter(arrays))
    for source, out in ((src, tmp_path / "resharded"), (first, tmp_path / "single")):
        stcast.convert(source, out, to="keep", max_shard_size=200)
        assert len(list(out.glob("*.safetensors"))) > 1
        assert stcast.verify(source, out).ok, stcast.verify(source, out).mismatch
        assert not stcast.verify(source, out, to="bf16").ok
    # A folder that is safetensors already: keep would change nothing.
    with pytest.raises(stcast.Refused) as e:
        stcast.convert(dst, tmp_path / "again", to="keep")
    assert "nothing to convert" in str(e.value) and 'to="keep"' in str(e.value)


def test_sharded_runs_and_finalize(tmp_path, rng, run_main):
    src = tmp_path / "ckpt"
    arrays = make_bin_model(src, rng, shards=3)
    dst = tmp_path / "out"
    for i in (1, 2, 3):
        rc, out, err = run_main("convert", src, dst, "--shard", f"{i}/3")
        assert rc == 0, err
    rc, out, err = run_main("finalize", src, dst)
    assert rc == 0, err
    check_shards(dst, arrays)
    assert not [p for p in dst.iterdir() if p.name.startswith(".stcast")]
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0, err


def test_safetensors_win_beside_pytorch_weights(tmp_path, rng, run_main):
    src = tmp_path / "repo"
    src.mkdir()
    a = layer(rng, 0)
    save_bin(src / "pytorch_model.bin", a)
    safetensors.numpy.save_file(a, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text('{"torch_dtype": "float32"}')
    dst = tmp_path / "out"
    rc, out, err = run_main("convert", src, dst)
    assert rc == 0, err
    assert (
        "left out: PyTorch weights beside their safetensors version (the safetensors files are "
        "converted): `pytorch_model.bin`" in err
    )
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0, err
    r = stcast.inspect(src)
    assert [f.path for f in r.files] == ["model.safetensors"]
    assert any(w.kind == "skipped_files" for w in r.warnings)


def test_diffusers_and_peft_names(tmp_path, rng):
    src = tmp_path / "pipe"
    save_bin(src / "unet" / "diffusion_pytorch_model.bin", layer(rng, 0))
    (src / "vae").mkdir()
    safetensors.numpy.save_file(
        layer(rng, 1), str(src / "vae" / "diffusion_pytorch_model.safetensors")
    )
    save_bin(src / "lora" / "adapter_model.bin", layer(rng, 2))
    (src / "model_index.json").write_text('{"_class_name": "Pipeline"}')
    (src / "unet" / "config.json").write_text('{"torch_dtype": "float32"}')
    dst = tmp_path / "out"
    stcast.convert(src, dst)
    got = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert got == [
        "lora/adapter_model.safetensors",
        "model_index.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert stcast.verify(src, dst).ok


def test_a_hostile_weight_file_fails_the_folder_before_anything_is_written(tmp_path, rng, run_main):
    src = tmp_path / "ckpt"
    make_bin_model(src, rng, shards=2, trainer=False)
    tf.write_zip(
        src / "pytorch_model-00002-of-00002.bin",
        None,
        {},
        pickle=pickle.dumps({"w": _System(f"touch {tmp_path / CANARY}")}, protocol=2),
    )
    dst = tmp_path / "out"
    rc, out, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert (
        rc == 1
        and "pytorch_model-00002-of-00002.bin: refusing to load: the pickle calls posix.system"
        in line
    )
    assert not dst.exists() and not (tmp_path / CANARY).exists()


def test_key_is_for_files_and_prefixes_for_any_input(tmp_path, rng):
    src = tmp_path / "ckpt"
    make_bin_model(src, rng, shards=1, trainer=False)
    with pytest.raises(stcast.UsageError):
        stcast.convert(src, tmp_path / "out", key="model")
    # A folder's PyTorch weight files lose the prefixes as any input's names (issue 33);
    # one that no name starts with is said once.
    report = stcast.inspect(src, strip_prefix=["module."])
    assert [w.kind for w in report.warnings].count("unmatched_prefix") == 1, report.warnings


# --- re-sharding PyTorch input ---------------------------------------------------------------


def _all_tensors(folder: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        for t, e in header.items():
            if t != "__metadata__":
                lo, hi = e["data_offsets"]
                assert t not in out
                out[t] = raw[8 + n + lo : 8 + n + hi]
    return out


def test_a_bin_folder_is_resharded_under_safetensors_names(tmp_path, rng, run_main):
    """Three `pytorch_model-*.bin` shards merged into one `model.safetensors`, and cut into
    shards of 200 bytes: safetensors names, a new index, each value bit for bit, verified."""
    src = tmp_path / "ckpt"
    arrays = make_bin_model(src, rng, shards=3)
    want = {t: bf16(x).tobytes() for a in arrays.values() for t, x in a.items()}

    merged = tmp_path / "merged"
    rc, _, err = run_main("convert", src, merged, "--max-shard-size", "1TB", "-q")
    assert rc == 0, err
    names = sorted(p.name for p in merged.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"], names
    assert _all_tensors(merged) == want
    assert stcast.verify(src, merged).ok

    cut = tmp_path / "cut"
    rc, _, err = run_main("convert", src, cut, "--max-shard-size", "200", "-q")
    assert rc == 0, err
    shards = sorted(p.name for p in cut.glob("*.safetensors"))
    assert len(shards) > 3 and all(s.startswith("model-0000") for s in shards), shards
    index = json.loads((cut / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == set(
        shards
    )
    assert _all_tensors(cut) == want
    for s in shards:
        with safetensors.safe_open(str(cut / s), framework="numpy") as f:
            assert f.metadata() == {"format": "pt", "stcast": '{"to":"bf16"}'}
    assert not (cut / "pytorch_model.bin.index.json").exists()
    assert not (tmp_path / CANARY).exists()
    rc, out, err = run_main("verify", src, cut)
    assert rc == 0, err + out
    # Resume finds every shard done; a changed input makes its shards stale.
    r = stcast.convert(src, cut, max_shard_size=200, resume=True)
    assert all(f.action != "converted" for f in r.files), r.files
    # The shards' input bytes add up to the input files' (headers and pickles included).
    r = stcast.convert(src, tmp_path / "cut2", max_shard_size=200)
    assert r.bytes_in == sum(p.stat().st_size for p in src.glob("pytorch_model-*.bin"))
    assert r.bytes_out == sum(p.stat().st_size for p in (tmp_path / "cut2").glob("*.safetensors"))
    plan = stcast.inspect(src, max_shard_size="200")
    assert [s["path"] for s in plan.shards] == shards
    assert {i for s in plan.shards for i in s["inputs"]} == set(arrays)  # the .bin names


def test_a_checkpoint_file_is_resharded_with_key_and_prefix(tmp_path, rng, run_main):
    a, b = rng.standard_normal(64, dtype=np.float32), rng.standard_normal(64, dtype=np.float32)
    obj = {
        "epoch": 3,
        "model": {"module.w": tf.tensor("0", "float32", (64,))},
        "ema": {
            "module.w": tf.tensor("1", "float32", (8, 8)),
            "module.b": tf.tensor("0", "float32", (64,)),
        },
    }
    src = tmp_path / "last.ckpt"
    tf.write_zip(src, obj, {"0": a.tobytes(), "1": b.tobytes()})
    dst = tmp_path / "ema-bf16"
    rc, _, err = run_main("convert", src, dst, "--max-shard-size", "200B")
    assert rc == 1 and "--key" in assert_one_error_line(err) and not dst.exists()
    rc, _, err = run_main(
        "convert", src, dst, "--max-shard-size", "200B", "--key", "ema", "--strip-prefix", "module."
    )
    assert rc == 0, err
    assert sorted(p.name for p in dst.iterdir()) == [
        "last-00001-of-00002.safetensors",
        "last-00002-of-00002.safetensors",
        "last.safetensors.index.json",
    ]
    got = _all_tensors(dst)
    assert got == {"w": bf16(b).tobytes(), "b": bf16(a).tobytes()}
    # verify reads SRC as convert read it: as given, or as DST's record says.
    ok = stcast.verify(src, dst, key="ema", strip_prefix=["module."])
    assert ok.ok, ok.mismatch
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err
    bare = tmp_path / "bare"
    stcast.convert(
        src, bare, key="ema", strip_prefix=["module."], max_shard_size="200B", no_record=True
    )
    rc, _, err = run_main("verify", src, bare)
    assert rc == 1 and "--key" in assert_one_error_line(err)
    rc, out, err = run_main(
        "inspect", src, "--max-shard-size", "200B", "--key", "ema", "--strip-prefix", "module."
    )
    assert rc == 0 and "last-00002-of-00002.safetensors" in out, err
    # A folder still takes neither.
    with pytest.raises(stcast.UsageError):
        stcast.convert(tmp_path / "ema-bf16", tmp_path / "x", max_shard_size=200, key="ema")


def test_an_incomplete_set_of_shards_is_refused(tmp_path, rng, run_main):
    """Shards `-0000i-of-0000N` with one missing and no index (an interrupted download) are
    refused before anything is written: converted, they would look like a whole checkpoint.
    Beside complete PyTorch shards of the same name, the message says those were not used."""
    src = tmp_path / "ckpt"
    arrays = make_bin_model(src, rng, shards=2, trainer=False)
    first = next(iter(arrays))
    safetensors.numpy.save_file(
        {k: v for k, v in arrays[first].items()},
        str(src / "model-00001-of-00002.safetensors"),
        metadata={"format": "pt"},
    )
    dst = tmp_path / "out"
    rc, out, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1 and "model-00002-of-00002.safetensors: missing" in line, line
    assert "PyTorch shards beside them are not used" in line and not dst.exists()
    # Without the PyTorch ones: the same refusal, without that clause; inspect too.
    for f in src.glob("pytorch_model*"):
        f.unlink()
    rc, out, err = run_main("inspect", src)
    line = assert_one_error_line(err)
    assert rc == 1 and "incomplete (an interrupted download?)" in line and "PyTorch" not in line
    # Complete, it converts.
    safetensors.numpy.save_file(
        dict(arrays[list(arrays)[1]]), str(src / "model-00002-of-00002.safetensors")
    )
    assert run_main("convert", src, dst, "-q")[0] == 0


def test_training_state_is_left_out_with_sizes(tmp_path, rng, run_main):
    """An accelerate FSDP checkpoint folder with DeepSpeed's ZeRO state beside the weights:
    the output holds the model and its config only; one note names every file and folder
    left out with its size; nothing of them is read (the pickles would create the canary);
    the disk-space check counts only what is written; verify passes."""
    src = tmp_path / "checkpoint-100"
    src.mkdir()
    a = layer(rng, 0)
    safetensors.numpy.save_file(a, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text('{"torch_dtype": "float32"}\n')
    canary = tmp_path / CANARY
    evil = pickle.dumps(_System(f"touch {canary}"), protocol=2)
    state = {
        "optimizer.bin": evil * 40,
        "scheduler.bin": evil,
        "scaler.pt": evil,
        "random_states_0.pkl": evil,
        "pytorch_model_fsdp.bin": evil * 20,
        "trainer_state.json": b'{"global_step": 100}',
        "latest": b"global_step100",
        "global_step100/mp_rank_00_model_states.pt": evil * 30,
        "global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt": evil * 50,
    }
    for rel, data in state.items():
        (src / rel).parent.mkdir(exist_ok=True)
        (src / rel).write_bytes(data)
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst)
    assert rc == 0, err
    assert not canary.exists()
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    size = stcast._core.format_bytes
    ds = sum(len(state[r]) for r in state if r.startswith("global_step100/"))
    shown = [("global_step100/", ds)] + [
        (r, len(state[r]))
        for r in (
            "latest",
            "optimizer.bin",
            "pytorch_model_fsdp.bin",
            "random_states_0.pkl",
            "scaler.pt",
            "scheduler.bin",
            "trainer_state.json",
        )
    ]
    named = ", ".join(f"`{r}` ({size(n)})" for r, n in shown)
    assert f"left out: training state, not weights (never read): {named}" in err
    assert stcast.verify(src, dst).ok
    # inspect counts what is written: the state is in no "other files" total.
    report = stcast.inspect(src, dst / "again")
    assert any(w.kind == "skipped_files" for w in report.warnings)


def test_a_folder_of_whole_fsdp_weights_converts_them(tmp_path, rng, run_main):
    """accelerate's `pytorch_model_fsdp.bin` (FULL_STATE_DICT) with no other weights beside
    it is the model: converted as `model.safetensors`; the per-rank files are left out."""
    src = tmp_path / "ckpt"
    src.mkdir()
    a = layer(rng, 0)
    save_bin(src / "pytorch_model_fsdp.bin", a)
    save_bin(src / "pytorch_model_fsdp_1.bin", layer(rng, 1))
    (src / "config.json").write_text('{"torch_dtype": "float32"}\n')
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst)
    assert rc == 0, err
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    check_shards(dst, {"model.safetensors": a})
    assert "`pytorch_model_fsdp_1.bin`" in err
    assert stcast.verify(src, dst).ok


@pytest.mark.parametrize("name", ["\ud800.bin", "\udcff.bin"])
def test_a_bin_index_naming_no_file_is_refused(tmp_path, rng, run_main, name):
    """A PyTorch index whose weight_map names a lone surrogate (a JSON escape): one line,
    no crash."""
    src = tmp_path / "m"
    make_bin_model(src, rng, trainer=False)
    index = src / "pytorch_model.bin.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.layers.0.mlp.weight"] = name
    index.write_text(json.dumps(doc))
    rc, _, err = run_main("convert", src, tmp_path / "o")
    assert rc == 1 and "plain relative names" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
