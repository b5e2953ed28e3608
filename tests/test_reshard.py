"""Re-sharding (`--max-shard-size`): split, merge and re-pack, in files and folders.

Every checkpoint is generated here. Outputs are checked independently of stcast: each tensor
of each output shard against the input tensor of the same name (F32 and F64 through
ml_dtypes' bf16, everything else byte for byte), every shard's size against SIZE, the index
against the files, and the greedy cut against a plain reimplementation of the rule from the
shard headers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import stcast
from conftest import (
    assert_one_error_line,
    read_safetensors,
    tensor_bytes,
    tree,
    write_safetensors,
)
from helpers import run_cli, with_points

META = {"format": "pt"}


# --- generated checkpoints -------------------------------------------------------------------


def tensors_of(rng, k: int, rows: int = 8) -> dict:
    """A layer of mixed dtypes and sizes (F64 values exact in F32: one rounding)."""
    return {
        f"layers.{k}.w": ("F32", [rows, 16], rng.standard_normal((rows, 16), dtype=np.float32)),
        f"layers.{k}.norm": ("F16", [16], rng.standard_normal(16).astype(np.float16)),
        f"layers.{k}.bias": ("F64", [4], rng.standard_normal(4).astype(np.float32).astype("f8")),
        f"layers.{k}.ids": ("I64", [5], np.arange(5, dtype=np.int64)),
        f"layers.{k}.scalar": ("F32", [], np.float32(k + 0.5)),
        f"layers.{k}.empty": ("F32", [0, 4], np.zeros(0, np.float32)),
    }


def write_sharded(folder: Path, rng, shards: int, stem: str = "model", rows=None) -> Path:
    """`stem`-0000i-of-0000N shards of one layer each, their index, a config, a tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k in range(shards):
        name = f"{stem}-{k + 1:05d}-of-{shards:05d}.safetensors"
        t = tensors_of(rng, k, rows[k] if rows else 8)
        write_safetensors(folder / name, t, metadata=META)
        weight_map.update({n: name for n in t})
    index = {"metadata": {"total_size": 1, "total_parameters": 7}, "weight_map": weight_map}
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    (folder / f"{stem}.safetensors.index.json").write_text(text)
    (folder / "config.json").write_text('{\n  "torch_dtype": "float32",\n  "x": 1\n}\n')
    (folder / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return folder


def write_single(path: Path, rng, layers: int, metadata=META, rows: int = 8) -> Path:
    t = {}
    for k in range(layers):
        t.update(tensors_of(rng, k, rows))
    return write_safetensors(path, t, metadata=metadata)


def input_tensors(paths) -> dict:
    out = {}
    for p in paths:
        out.update(tensor_bytes(p))
    return out


def expected(dtype: str, raw: bytes) -> tuple[str, bytes]:
    """What bf16 conversion makes of a tensor, by an independent reference."""
    if dtype in ("F32", "F64", "F16"):
        x = np.frombuffer(raw, {"F32": "<f4", "F64": "<f8", "F16": "<f2"}[dtype])
        return "BF16", x.astype(ml_dtypes.bfloat16).tobytes()
    return dtype, raw


def meta_of(path: Path) -> dict | None:
    """A file's `__metadata__` as a dict but the record of convert's options, which must
    come last (issue 33; its contents: tests/test_verify_record.py); None without any other."""
    found = dict(read_safetensors(path)[1]).get("__metadata__")
    assert found and found[-1][0] == "stcast" and "to" in json.loads(found[-1][1]), found
    return dict(found[:-1]) or None


def shard_files(dst: Path) -> list[Path]:
    return sorted(p for p in dst.rglob("*.safetensors"))


def check_against_input(dst: Path, inputs: dict, files: list[Path]) -> None:
    """Every tensor of the input is in exactly one output file, converted exactly."""
    seen = {}
    for f in files:
        for name, (dtype, shape, raw) in tensor_bytes(f).items():
            assert name not in seen, (name, f, seen.get(name))
            seen[name] = f
            want_dtype, want = expected(inputs[name][0], inputs[name][2])
            assert (dtype, shape) == (want_dtype, inputs[name][1]), name
            assert raw == want, name
    assert set(seen) == set(inputs)


def check_cut(files: list[Path], size: int, src: Path, to: str = "bf16", **options) -> None:
    """Each shard at most SIZE unless it holds one tensor; the shards hold the tensors in
    input order; a shard is closed only when its next tensor would have pushed its file past
    SIZE: a file of the shard's tensors and that one, converted plainly, is larger."""
    inputs = {n: v for n, v in read_safetensors(src)[1] if n != "__metadata__"}
    raw = tensor_bytes(src)
    order = list(inputs)
    held = [[n for n in order if n in tensor_bytes(f)] for f in files]
    assert [n for names in held for n in names] == order
    for f, names in zip(files, held):
        assert f.stat().st_size <= size or len(names) == 1, (f, f.stat().st_size, size)
    for k in range(len(files) - 1):
        meta = dict(read_safetensors(files[k])[1]).get("__metadata__")
        candidate = src.parent / f"candidate-{k}.safetensors"
        names = [*held[k], held[k + 1][0]]
        write_safetensors(candidate, {n: raw[n] for n in names}, metadata=dict(meta or {}) or None)
        assert stcast.inspect(candidate, to=to, **options).output_bytes > size, (k, names)
        candidate.unlink()


def check_index(dst: Path, stem: str, files: list[Path]) -> dict:
    index = json.loads((dst / f"{stem}.safetensors.index.json").read_text())
    total = 0
    want_map = {}
    for f in files:
        for name, (_, _, raw) in tensor_bytes(f).items():
            want_map[name] = f.name
            total += len(raw)
    assert index["weight_map"] == want_map
    assert list(index["weight_map"]) == sorted(want_map)  # as save_pretrained writes it
    assert index["metadata"]["total_size"] == total
    assert {f.name for f in files} == set(index["weight_map"].values())
    return index


# --- SIZE ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [
        ("5GB", 5 * 10**9),
        ("5gb", 5 * 10**9),
        ("5Gb", 5 * 10**9),
        ("1.5GiB", 3 << 29),
        ("0.5kB", 500),
        ("2 MiB", 2 << 20),
        ("1234", 1234),
        ("1234b", 1234),
        ("1TB", 10**12),
        ("1tib", 1 << 40),
    ],
)
def test_size_forms(tmp_path, run_main, text, size):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(0), 2)
    rc, out, err = run_main("inspect", src, "--max-shard-size", text, "--json")
    assert rc == 0, err
    assert json.loads(out)["result"]["max_shard_size"] == size
    assert stcast.inspect(src, max_shard_size=text).max_shard_size == size


@pytest.mark.parametrize("text", ["", "5XB", "5 G", "5g", "0", "-1", "1e9", "0.1", "GB", "1.2.3"])
def test_bad_sizes_are_usage_errors(tmp_path, run_main, text):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(0), 1)
    for command in ("convert", "inspect"):
        rc, _, err = run_main(command, src, str(tmp_path / "out"), "--max-shard-size", text)
        assert rc == 2, (command, err)
        line = assert_one_error_line(err)
        assert line.count("--max-shard-size") == 1, line  # argparse names it: once
    with pytest.raises(stcast.UsageError) as info:
        stcast.convert(src, tmp_path / "out", max_shard_size=text)
    assert info.value.option == "max_shard_size"
    assert "max_shard_size" in str(info.value) and "--" not in str(info.value)
    for value in (0, -5, True, 2.5, 2**64):
        with pytest.raises(stcast.UsageError):
            stcast.inspect(src, max_shard_size=value)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


# --- split, merge, re-pack ------------------------------------------------------------------


def test_split_a_file(tmp_path, run_main):
    """54 GB ema.safetensors -> 5 GB shards, in small: ema-0000i-of-0000N and an index."""
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(1), 6, rows=32)
    size = 4000
    rc, out, err = run_main("convert", src, tmp_path / "out", "--max-shard-size", size)
    assert rc == 0, err
    dst = tmp_path / "out"
    files = shard_files(dst)
    n = len(files)
    assert n > 2
    assert [f.name for f in files] == [
        f"ema-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    assert sorted(os.listdir(dst)) == sorted(
        [f.name for f in files] + ["ema.safetensors.index.json"]
    )
    inputs = input_tensors([src])
    check_against_input(dst, inputs, files)
    check_cut(files, size, src)
    index = check_index(dst, "ema", files)
    assert index["metadata"] == {
        "total_size": index["metadata"]["total_size"],
        "stcast": '{"to":"bf16"}',
    }
    for f in files:  # every shard carries the input's metadata
        assert meta_of(f) == META
    assert f"shards   {n} of at most 4.00 kB" in out


def test_merge_a_sharded_folder_into_one_file(tmp_path, run_main):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(2), 3)
    rc, _, err = run_main("convert", src, tmp_path / "out", "--max-shard-size", "1GB")
    assert rc == 0, err
    dst = tmp_path / "out"
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors", "tokenizer.json"]
    check_against_input(
        dst, input_tensors(sorted(src.glob("*.safetensors"))), [dst / "model.safetensors"]
    )
    assert meta_of(dst / "model.safetensors") == META
    assert (dst / "config.json").read_text() == '{\n  "torch_dtype": "bfloat16",\n  "x": 1\n}\n'
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # Merged back into one, it verifies against the sharded source, and back the other way.
    assert stcast.verify(src, dst).ok
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0, err


def test_repack_moves_tensors_across_shards(tmp_path):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(3), 4, rows=[2, 40, 2, 40])
    dst = tmp_path / "out"
    report = stcast.convert(src, dst, max_shard_size=1600)
    files = shard_files(dst)
    assert len(files) >= 3 and report.max_shard_size == 1600
    inputs = input_tensors(sorted(src.glob("*.safetensors")))
    check_against_input(dst, inputs, files)
    # Some output shard reads two input files, and some input is spread over two outputs.
    where = {n: f.name for f in files for n in tensor_bytes(f)}
    spans = {f.name: {where[n] for n in tensor_bytes(f)} for f in sorted(src.glob("model-*"))}
    assert any(len(s) > 1 for s in spans.values()), spans
    reads = {f.name: {g for g, s in spans.items() if f.name in s} for f in files}
    assert any(len(r) > 1 for r in reads.values()), reads
    index = check_index(dst, "model", files)
    assert index["metadata"]["total_parameters"] == 7  # the source index's other metadata
    assert [f.path for f in report.files if f.kind == "index"] == ["model.safetensors.index.json"]
    # The old shards (4 of them) are nowhere in DST.
    assert not any("of-00004" in n for n in os.listdir(dst))
    assert stcast.verify(src, dst).ok


def test_to_keep_only_reshards(tmp_path, run_main):
    """`--to keep` with `--max-shard-size`: a pure re-shard. Every tensor keeps its dtype and
    bytes, config.json is copied as it is, the cut is that of the kept sizes, and `verify
    --to keep` passes across the shardings (a plain conversion would fail it)."""
    src = write_sharded(tmp_path / "hf", np.random.default_rng(7), 4, rows=[2, 40, 2, 40])
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--to", "keep", "--max-shard-size", "3000", "-q")
    assert rc == 0, err
    files = shard_files(dst)
    assert len(files) >= 2 and not any("of-00004" in f.name for f in files)
    inputs = input_tensors(sorted(src.glob("*.safetensors")))
    got = {n: v for f in files for n, v in tensor_bytes(f).items()}
    assert got == inputs  # dtype, shape and bytes of every tensor
    check_index(dst, "model", files)
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    rc, out, err = run_main("verify", src, dst, "--to", "keep")
    assert rc == 0, err + out
    assert not stcast.verify(src, dst, to="bf16").ok
    # A single bf16 file re-sharded the same way; without re-sharding it would be a copy.
    single = tmp_path / "one.safetensors"
    write_safetensors(single, {n: v for n, v in got.items()}, metadata=META)
    with pytest.raises(stcast.Refused):
        stcast.convert(single, tmp_path / "copy.safetensors", to="keep")
    r = stcast.convert(single, tmp_path / "one-keep", to="keep", max_shard_size="3kB")
    assert r.tensors_converted == 0 and len(shard_files(tmp_path / "one-keep")) >= 2
    assert stcast.verify(single, tmp_path / "one-keep", to="keep").ok


def test_boundaries(tmp_path):
    """A shard of exactly SIZE; a tensor bigger than SIZE; SIZE below every tensor; empty
    and scalar tensors."""
    rng = np.random.default_rng(4)
    t = {
        "a": ("F32", [64], rng.standard_normal(64, dtype=np.float32)),
        "b": ("F32", [64], rng.standard_normal(64, dtype=np.float32)),
        "big": ("F32", [4096], rng.standard_normal(4096, dtype=np.float32)),
        "c": ("F32", [64], rng.standard_normal(64, dtype=np.float32)),
        "scalar": ("F64", [], np.float64(3.25)),
        "empty": ("I64", [0], b""),
    }
    src = write_safetensors(tmp_path / "m.safetensors", t, metadata=META)

    def cut(size: int) -> list[list[str]]:
        dst = tmp_path / f"out{size}"
        stcast.convert(src, dst, max_shard_size=size)
        files = shard_files(dst)
        check_against_input(dst, input_tensors([src]), files)
        check_cut(files, size, src)
        held = [list(tensor_bytes(f)) for f in files]
        planned = stcast.inspect(src, max_shard_size=size).shards
        assert [s["bytes"] for s in planned] == [f.stat().st_size for f in files]
        return held

    # SIZE below every tensor: one each, the empty and the scalar ones too.
    assert cut(1) == [["a"], ["b"], ["big"], ["c"], ["scalar"], ["empty"]]
    # The smallest SIZE at which `a` and `b` share a shard is exactly their file's size.
    size = stcast.inspect(src, max_shard_size=1).shards[0]["bytes"]
    while stcast.inspect(src, max_shard_size=size).shards[0]["tensors"] == 1:
        size += 1
    held = cut(size)
    assert held[0] == ["a", "b"]
    assert shard_files(tmp_path / f"out{size}")[0].stat().st_size == size  # exactly SIZE
    held = cut(size - 1)
    assert held[0] == ["a"]
    assert ["big"] in held  # bigger than SIZE: a shard of its own
    # Everything fits: one file, named after the input, with no index.
    (one,) = cut(10**9)
    assert sorted(one) == sorted(t)
    assert os.listdir(tmp_path / f"out{10**9}") == ["m.safetensors"]


def test_determinism(tmp_path):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(5), 3, rows=[30, 3, 30])
    stcast.convert(src, tmp_path / "a", max_shard_size="1.5kB")
    stcast.convert(src, tmp_path / "b", max_shard_size="1.5kB", threads=1)
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    assert len(shard_files(tmp_path / "a")) > 2


def test_inspect_plan_is_what_convert_writes(tmp_path, run_main):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(6), 3, rows=[30, 3, 30])
    rc, out, err = run_main("inspect", src, "--max-shard-size", "2.5kB", "--json")
    assert rc == 0, err
    result = json.loads(out)["result"]
    rc, human, err = run_main("inspect", src, "--max-shard-size", "2.5kB")
    assert rc == 0, err
    assert "shards:   " in human and "index:    model.safetensors.index.json" in human
    stcast.convert(src, tmp_path / "out", max_shard_size=2500)
    dst = tmp_path / "out"
    for s in result["shards"]:
        f = dst / s["path"]
        assert f.stat().st_size == s["bytes"]
        assert len(tensor_bytes(f)) == s["tensors"]
        assert s["index"] == "model.safetensors.index.json"
        assert all((src / i).exists() for i in s["inputs"])
    (index,) = result["indexes"]
    text = (dst / "model.safetensors.index.json").read_text()
    assert index["bytes"] == len(text.encode())
    assert index["total_size"] == json.loads(text)["metadata"]["total_size"]
    assert index["shards"] == len(result["shards"])
    files = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    assert result["output_bytes"] == files
    # With DST, the checks run too; the plan is the same.
    rc, out, err = run_main("inspect", src, tmp_path / "new", "--max-shard-size", "2.5kB", "--json")
    assert rc == 0, err
    assert json.loads(out)["result"]["shards"] == result["shards"]
    rc, _, err = run_main("inspect", src, dst, "--max-shard-size", "2.5kB")
    assert rc == 1 and "--resume" in err


def test_format_is_added_to_indexed_shards_and_said(tmp_path, run_main):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(7), 4, metadata=None)
    with pytest.warns(stcast.StcastWarning, match="format") as caught:
        stcast.convert(src, tmp_path / "out", max_shard_size=2000)
    assert [w.message.kind for w in caught] == ["format_added"]
    for f in shard_files(tmp_path / "out"):
        assert meta_of(f) == {"format": "pt"}
    # One file: no index, nothing added (as the input had none).
    stcast.convert(src, tmp_path / "one", max_shard_size="1GB")
    one = dict(read_safetensors(tmp_path / "one" / "ema.safetensors")[1])
    assert one["__metadata__"] == [("stcast", '{"to":"bf16"}')]  # the record alone
    # Other metadata keeps its order, format comes after it, and the record last.
    src2 = write_single(
        tmp_path / "m2.safetensors", np.random.default_rng(7), 4, {"z": "1", "a": "2"}
    )
    rc, _, err = run_main("convert", src2, tmp_path / "out2", "--max-shard-size", 2000)
    assert rc == 0
    assert "warning" in err and "format" in err
    items = read_safetensors(shard_files(tmp_path / "out2")[0])[1]
    record = ("stcast", '{"to":"bf16"}')
    assert items[0] == ("__metadata__", [("z", "1"), ("a", "2"), ("format", "pt"), record])


def test_diffusers_stems_and_lone_files(tmp_path):
    rng = np.random.default_rng(8)
    src = tmp_path / "pipe"
    write_sharded(src / "unet", rng, 2, stem="diffusion_pytorch_model", rows=[40, 40])
    (src / "vae").mkdir()
    write_single(src / "vae" / "diffusion_pytorch_model.safetensors", rng, 1)
    write_single(src / "consolidated.safetensors", rng, 1)
    (src / "model_index.json").write_text('{"_class_name": "X"}\n')
    dst = tmp_path / "out"
    stcast.convert(src, dst, max_shard_size="2kB")
    got = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    unet = [p for p in got if p.startswith("unet/diffusion_pytorch_model-")]
    assert len(unet) >= 2 and all(p.endswith(f"-of-{len(unet):05d}.safetensors") for p in unet)
    assert "unet/diffusion_pytorch_model.safetensors.index.json" in got
    assert "vae/diffusion_pytorch_model.safetensors" in got  # one shard: its own name
    assert "consolidated.safetensors" in got
    assert "model_index.json" in got
    assert stcast.verify(src, dst).ok


def test_a_name_clash_is_refused(tmp_path, run_main):
    rng = np.random.default_rng(9)
    src = write_sharded(tmp_path / "hf", rng, 2)
    write_single(src / "model.safetensors", rng, 1)  # beside the shards of the same stem
    rc, _, err = run_main("convert", src, tmp_path / "out", "--max-shard-size", "1GB")
    assert rc == 1
    assert "model.safetensors" in assert_one_error_line(err)
    assert not (tmp_path / "out").exists()


# --- resume, --shard, finalize, free space ---------------------------------------------------


def test_resume_skips_the_shards_written(tmp_path, cli_process):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(10), 4, rows=[30] * 4)
    dst = tmp_path / "out"
    args = ("convert", src, dst, "--max-shard-size", "3kB", "-q")
    rc, _, err = cli_process(*args, env=with_points(None, "folder-file=eio"))
    assert rc == 1, err
    written = shard_files(dst)
    assert len(written) == 1 and not (dst / "model.safetensors.index.json").exists()
    stamp = written[0].stat().st_ino
    rc, out, err = cli_process(*args[:-1], "--resume", "--json")
    assert rc == 0, err
    files = json.loads(out)["result"]["files"]
    assert [f["action"] for f in files if f["kind"] == "weights"][0] == "skipped"
    assert written[0].stat().st_ino == stamp
    stcast.convert(src, tmp_path / "fresh", max_shard_size="3kB")
    assert tree(dst) == tree(tmp_path / "fresh")
    # Stopped again after one shard; then an input of the first shard changes: resume
    # writes that shard again, and skips none it cannot trust.
    shutil.rmtree(dst)
    rc, _, err = cli_process(*args, env=with_points(None, "folder-file=eio"))
    assert rc == 1
    first = sorted(src.glob("model-*.safetensors"))[0]
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
    rc, out, err = cli_process(*args[:-1], "--resume", "--json")
    assert rc == 0, err
    actions = [f["action"] for f in json.loads(out)["result"]["files"] if f["kind"] == "weights"]
    assert "skipped" not in actions
    assert tree(dst) == tree(tmp_path / "fresh")


def test_resume_trusts_an_entry_that_lists_its_one_input(tmp_path, cli_process):
    """A manifest entry names a shard's one input flat, as a plain run's file; one that lists
    it (as stcast wrote a shard's entry before plain runs were one-file groups) is trusted
    the same, and not once that input changed."""
    src = write_sharded(tmp_path / "hf", np.random.default_rng(10), 4, rows=[30] * 4)
    dst = tmp_path / "out"
    args = ("convert", src, dst, "--max-shard-size", "2kB", "-q")
    for touch in (False, True):
        shutil.rmtree(dst, ignore_errors=True)
        rc, _, err = cli_process(*args, env=with_points(None, "folder-file=eio"))
        assert rc == 1, err
        manifest = dst / ".stcast-manifest.json"
        doc = json.loads(manifest.read_text())
        ((rel, entry),) = doc["files"].items()
        flat = [entry.pop(k) for k in ("source_size", "source_mtime_ns", "source_header_sha256")]
        first = sorted(src.glob("model-*.safetensors"))[0]
        entry["inputs"] = [[first.name, *flat]]
        manifest.write_text(json.dumps(doc))
        if touch:
            os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
        rc, out, err = cli_process(*args[:-1], "--resume", "--json")
        assert rc == 0, err
        files = json.loads(out)["result"]["files"]
        action = next(f["action"] for f in files if f["path"] == rel)
        assert action == ("converted" if touch else "skipped")


def test_resume_after_the_plan_changed_converts_again(tmp_path, run_main):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(11), 3, rows=[30] * 3)
    dst = tmp_path / "out"
    assert run_main("convert", src, dst, "--max-shard-size", "3kB", "-q")[0] == 0
    rc, _, err = run_main("convert", src, dst, "--max-shard-size", "2kB", "--resume", "-q")
    # Another cut: the first run's manifest is gone (it finished), and its index is not
    # this plan's: refused, nothing replaced.
    assert rc == 1 and "model.safetensors.index.json" in assert_one_error_line(err)
    rc, _, err = run_main("convert", src, dst, "--max-shard-size", "3kB", "--resume", "--json")
    assert rc == 0, err  # the same plan: adopted, every shard verified


def test_resume_with_another_size_removes_the_interrupted_runs_shards(tmp_path, cli_process):
    """Stopped after a shard at one size, resumed at another: the first run's shard (its
    manifest proves stcast wrote it) would sit beside the new ones, named by no index, and
    make `verify` fail. It is removed; a file no manifest records stays."""
    src = write_sharded(tmp_path / "hf", np.random.default_rng(12), 4, rows=[30] * 4)
    dst = tmp_path / "out"
    args = ("convert", src, dst, "--max-shard-size", "1500", "-q")
    rc, _, err = cli_process(*args, env=with_points(None, "folder-file=eio"))
    assert rc == 1, err
    assert [p.name for p in shard_files(dst)] == ["model-00001-of-00005.safetensors"]
    rc, _, err = cli_process("convert", src, dst, "--max-shard-size", "3kB", "--resume", "-q")
    assert rc == 0, err
    stcast.convert(src, tmp_path / "fresh", max_shard_size="3kB")
    assert tree(dst) == tree(tmp_path / "fresh")
    assert stcast.verify(src, dst).ok
    # The same with --force, and a file of someone else's beside: that one stays.
    shutil.rmtree(dst)
    rc, _, err = cli_process(*args, env=with_points(None, "folder-file=eio"))
    assert rc == 1, err
    (dst / "notes.safetensors").write_bytes(b"mine")
    rc, _, err = cli_process("convert", src, dst, "--max-shard-size", "3kB", "--force", "-q")
    assert rc == 0, err
    assert tree(dst) == {**tree(tmp_path / "fresh"), "notes.safetensors": b"mine"}


@pytest.mark.parametrize("at", ["folder-sealed", "folder-published", "folder-complete"])
@pytest.mark.parametrize("named", [False, True], ids=["tmpfile", "named"])
def test_sigkill_around_a_shard_publish_then_resume_at_another_size(tmp_path, at, named):
    """Killed once a shard is sealed and claimed in the manifest (`folder-sealed`), once it
    is published but before the manifest records it (`folder-published`), or once the
    index and configs are published too (`folder-complete`), then resumed at another size:
    each file of the first run that got its name is proven this run's by the identity its
    manifest claimed before publishing; the shards are removed, the index and configs
    replaced, and the folder is exactly a fresh conversion at the new size, which verify
    accepts. (Issue 23, point 5: the shard used to stay beside the new cut, named by no
    index; the index made the run refuse.)"""
    from helpers import stopped

    src = write_sharded(tmp_path / "hf", np.random.default_rng(12), 4, rows=[30] * 4)
    dst = tmp_path / "out"
    env = {"STCAST_FAILPOINT": "tmpfile=eopnotsupp"} if named else None
    run = stopped("convert", src, dst, "--max-shard-size", "1500", "-q", at=at, env=env)
    first = dst / "model-00001-of-00005.safetensors"
    assert first.exists() == (at != "folder-sealed")
    run.kill()
    rc, _, err = run_cli("convert", src, dst, "--max-shard-size", "3kB", "--resume", "-q")
    assert rc == 0, err
    assert "unindexed" not in err and "left from another cut" not in err, err
    assert not first.exists()
    stcast.convert(src, tmp_path / "fresh", max_shard_size="3kB")
    assert tree(dst) == tree(tmp_path / "fresh")
    rc, _, err = run_cli("verify", src, dst, "-q")
    assert rc == 0, err


def test_sigkill_while_replacing_a_shard_keeps_the_old_one_proven(tmp_path):
    """A resume that writes a shard again (an input of it changed) is killed once the new
    shard is sealed and claimed, before it replaces the old one: the old shard is still
    claimed too, so a resume at another size removes it."""
    from helpers import stopped

    src = write_sharded(tmp_path / "hf", np.random.default_rng(12), 4, rows=[30] * 4)
    dst = tmp_path / "out"
    args = ("convert", src, dst, "--max-shard-size", "1500B", "-q")
    rc, _, err = run_cli(*args, env=with_points(None, "folder-file=eio"))
    assert rc == 1, err
    first = dst / "model-00001-of-00005.safetensors"
    old = first.stat().st_ino
    inp = sorted(src.glob("model-*.safetensors"))[0]
    os.utime(inp, ns=(inp.stat().st_atime_ns, inp.stat().st_mtime_ns + 10**9))
    run = stopped(*args, "--resume", at="folder-sealed")
    assert first.stat().st_ino == old  # not replaced yet
    run.kill()
    rc, _, err = run_cli("convert", src, dst, "--max-shard-size", "3kB", "--resume", "-q")
    assert rc == 0, err
    assert not first.exists()
    stcast.convert(src, tmp_path / "fresh", max_shard_size="3kB")
    assert tree(dst) == tree(tmp_path / "fresh")


def test_a_claim_proves_only_the_header_it_names(tmp_path):
    """A claim whose file never got its name (killed before the publish) could meet a file
    of someone else's at that name that took over the freed inode: the claim names the
    planned header too, so a file with the same device, inode and size but another header
    is not taken for stcast's. It stays, and the run is refused naming it."""
    from helpers import stopped

    src = write_sharded(tmp_path / "hf", np.random.default_rng(12), 4, rows=[30] * 4)
    dst = tmp_path / "out"
    run = stopped("convert", src, dst, "--max-shard-size", "1500B", "-q", at="folder-sealed")
    run.kill()
    rel = "model-00001-of-00005.safetensors"
    theirs = write_single(dst / rel, np.random.default_rng(99), 1)
    mine = theirs.read_bytes()
    manifest = dst / ".stcast-manifest.json"
    doc = json.loads(manifest.read_text())
    [claim] = doc["pending"][rel]
    st = theirs.stat()
    claim.update(dev=st.st_dev, ino=st.st_ino, size=st.st_size)  # as if the inode was reused
    manifest.write_text(json.dumps(doc))
    rc, _, err = run_cli("convert", src, dst, "--max-shard-size", "3kB", "--resume")
    assert rc == 1 and rel in err, err
    assert theirs.read_bytes() == mine


def test_an_input_changed_between_two_shards_is_refused(tmp_path):
    """The inputs are held open from the start: one written to after the first shard is
    reported when a later shard reads it, and the index is never published; one replaced by
    a rename is not a change (the run reads the file it opened)."""
    from helpers import stopped

    src = write_sharded(tmp_path / "hf", np.random.default_rng(19), 4, rows=[30] * 4)
    stcast.convert(src, tmp_path / "whole", max_shard_size="3kB")
    last = sorted(src.glob("model-*.safetensors"))[-1]
    args = ("convert", src, tmp_path / "out", "--max-shard-size", "3kB", "-q")
    run = stopped(*args, at="folder-file")
    original = last.read_bytes()
    with open(last, "ab") as f:  # grows: no longer what was validated
        f.write(b"\0")
    rc, err = run.run_through()
    assert rc == 1 and "input changed" in assert_one_error_line(err) and last.name in err
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    last.write_bytes(original)
    run = stopped(*args[:2], tmp_path / "out2", *args[3:], at="folder-file")
    twin = last.with_suffix(".new")
    twin.write_bytes(original[:-8] + bytes(8))  # other data, renamed over the input
    os.replace(twin, last)
    assert run.run_through() == (0, "")
    assert tree(tmp_path / "out2") == tree(tmp_path / "whole")


def test_shard_runs_and_finalize(tmp_path, run_main):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(12), 4, rows=[30] * 4)
    stcast.convert(src, tmp_path / "whole", max_shard_size="3kB")
    n_out = len(shard_files(tmp_path / "whole"))
    dst = tmp_path / "out"
    for i in (1, 2):
        rc, out, err = run_main("convert", src, dst, "--max-shard-size", "3kB", "--shard", f"{i}/2")
        assert rc == 0, err
        assert not (dst / "model.safetensors.index.json").exists()
    rc, _, err = run_main("finalize", src, dst)
    assert rc == 0, err
    assert tree(dst) == tree(tmp_path / "whole")
    # N is bounded by the number of output shards, not of input files.
    rc, _, err = run_main(
        "convert", src, tmp_path / "x", "--max-shard-size", "3kB", "--shard", f"1/{n_out + 1}"
    )
    assert rc == 2 and "output shards" in err
    rc, _, err = run_main(
        "convert", src, tmp_path / "y", "--max-shard-size", "3kB", "--shard", f"{n_out}/{n_out}"
    )
    assert rc == 0, err


def test_shard_runs_of_a_file_started_together(tmp_path):
    """N concurrent `--shard i/N` runs of one big file into one folder all succeed, then
    finalize writes the index; the result equals a whole run."""
    import subprocess
    import sys

    from helpers import cli_env

    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(13), 8, rows=32)
    stcast.convert(src, tmp_path / "whole", max_shard_size="3kB")
    n = 4
    assert len(shard_files(tmp_path / "whole")) >= n
    dst = tmp_path / "out"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "stcast", "convert", str(src), str(dst)]
            + ["--max-shard-size", "3kB", "--shard", f"{i}/{n}", "-q"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=cli_env(),
        )
        for i in range(1, n + 1)
    ]
    results = [(p.wait(120), p.stderr.read().decode()) for p in procs]
    assert results == [(0, "")] * n
    assert run_cli("finalize", src, dst, "-q")[:2] == (0, "")
    assert tree(dst) == tree(tmp_path / "whole")


def test_free_space_for_the_whole_output_is_checked_first(tmp_path, tmpfs, run_main):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(14), 8, rows=8000)
    mnt = tmpfs("1M")
    rc, _, err = run_main("convert", src, mnt / "out", "--max-shard-size", "200kB")
    assert rc == 1 and "not enough disk space" in err
    assert not (mnt / "out").exists() or os.listdir(mnt / "out") == []


# --- verify across shardings -----------------------------------------------------------------


def test_verify_across_shardings_names_the_failing_file(tmp_path, run_main):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(15), 3, rows=[30] * 3)
    dst = tmp_path / "out"
    stcast.convert(src, dst, max_shard_size="3kB")
    report = stcast.verify(src, dst)
    assert report.ok and report.tensors_converted > 0 and report.numerics is not None
    # One bit of one tensor in the second shard.
    victim = shard_files(dst)[1]
    raw = bytearray(victim.read_bytes())
    raw[-40] ^= 1
    victim.write_bytes(bytes(raw))
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1
    line = assert_one_error_line(err)
    assert str(victim) in line and "tensor `" in line, line
    # A shard the index names is gone: the index and the shard named, each once.
    victim.unlink()
    rc, _, err = run_main("verify", src, dst)
    line = assert_one_error_line(err)
    index = dst / "model.safetensors.index.json"
    assert rc == 1 and line.count(str(index)) == 1 and victim.name in line, line


def test_verify_a_file_against_its_shards(tmp_path, run_main):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(16), 5, rows=32)
    dst = tmp_path / "out"
    stcast.convert(src, dst, max_shard_size="3kB")
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0, err
    # A tensor missing from every shard, and a shard whose index entry lies.
    index = json.loads((dst / "ema.safetensors.index.json").read_text())
    first = shard_files(dst)[0]
    name = next(iter(tensor_bytes(first)))
    index["weight_map"][name] = shard_files(dst)[1].name
    (dst / "ema.safetensors.index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and "ema.safetensors.index.json" in assert_one_error_line(err)


def write_one_tensor_shards(folder: Path, rng, metadata: list) -> Path:
    """Shards of one 8 KiB F32 tensor each (each file's own metadata), their index as
    `json.dump` writes it (not save_pretrained's layout)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(metadata)
    weight_map = {}
    for k, meta in enumerate(metadata):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        w = rng.standard_normal((32, 64), dtype=np.float32)
        write_safetensors(folder / name, {f"l{k}.w": ("F32", [32, 64], w)}, metadata=meta)
        weight_map[f"l{k}.w"] = name
    text = json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)
    return folder


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")  # format_added, metadata_differs
@pytest.mark.parametrize("metadata", [[None] * 3, [META, {"format": "pt", "k": "2"}, META]])
def test_verify_a_resharding_cut_where_the_source_was(tmp_path, run_main, metadata):
    """A cut that falls where SRC's did gives SRC's file names: those shards are still a
    re-sharding (its index, `format` added, the first file's metadata everywhere), and verify
    says so; a plain conversion of SRC still verifies too, and each reports a flipped bit."""
    src = write_one_tensor_shards(tmp_path / "hf", np.random.default_rng(30), metadata)
    dst, plain = tmp_path / "out", tmp_path / "plain"
    stcast.convert(src, dst, max_shard_size="5kB")
    stcast.convert(src, plain)
    assert sorted(os.listdir(dst)) == sorted(os.listdir(src))
    for out in (dst, plain):
        for loose in (False, True):
            report = stcast.verify(src, out, loose=loose)
            assert report.ok, (out, loose, report.mismatch)
        assert run_main("verify", src, out, "-q")[0] == 0
        victim = out / "model-00002-of-00003.safetensors"
        raw = bytearray(victim.read_bytes())
        raw[-7] ^= 1
        victim.write_bytes(bytes(raw))
        rc, _, err = run_main("verify", src, out)
        line = assert_one_error_line(err)
        assert rc == 1 and str(victim) in line and "tensor `l1.w`" in line, line


def test_loose_verify_checks_where_the_index_puts_each_tensor(tmp_path, run_main):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(31), 3, rows=[30] * 3)
    dst = tmp_path / "out"
    stcast.convert(src, dst, max_shard_size="3kB")
    index = dst / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = sorted(doc["weight_map"])[0]
    shards = sorted(set(doc["weight_map"].values()))
    doc["weight_map"][first] = next(s for s in shards if s != doc["weight_map"][first])
    index.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    for loose in ((), ("--loose",)):
        rc, _, err = run_main("verify", src, dst, *loose)
        line = assert_one_error_line(err)
        assert rc == 1 and str(index) in line and f"`{first}`" in line, (loose, line)


def test_verify_strict_and_loose_across_shardings(tmp_path, run_main):
    """Strict wants stcast's cut, names and headers; --loose any split that holds every
    tensor exactly once, converted exactly."""
    rng = np.random.default_rng(17)
    src = write_sharded(tmp_path / "hf", rng, 2, rows=[30, 30])
    names = {}
    for f in sorted(src.glob("model-*.safetensors")):
        names.update(tensor_bytes(f))
    # Another tool's split: two shards with the tensors dealt out of order.
    out = tmp_path / "other"
    out.mkdir()
    order = sorted(names)
    parts = [order[0::2], order[1::2]]
    weight_map = {}
    for i, part in enumerate(parts):
        t = {}
        for n in part:
            dtype, shape, raw = names[n]
            d, b = expected(dtype, raw)
            t[n] = (d, shape, b)
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(out / fname, t, metadata=META)
        weight_map.update({n: fname for n in part})
    total = sum(len(expected(*names[n][::2])[1]) for n in names)
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(
        json.dumps(doc, indent=2, sort_keys=True) + "\n"
    )
    shutil.copy(src / "tokenizer.json", out)
    (out / "config.json").write_text('{\n  "torch_dtype": "bfloat16",\n  "x": 1\n}\n')
    rc, _, err = run_main("verify", src, out)
    assert rc == 1 and "--loose" in assert_one_error_line(err)
    rc, _, err = run_main("verify", src, out, "--loose")
    assert rc == 0, err
    # A tensor in no shard fails both.
    fname = "model-00002-of-00002.safetensors"
    t = {n: names[n] for n in parts[1][1:]}
    t = {n: (expected(d, r)[0], s, expected(d, r)[1]) for n, (d, s, r) in t.items()}
    write_safetensors(out / fname, t, metadata=META)
    rc, _, err = run_main("verify", src, out, "--loose")
    assert rc == 1 and "in no DST file" in assert_one_error_line(err)


# --- precision options -----------------------------------------------------------------------


def test_keep_and_on_overflow_keep_change_sizes_before_the_cut(tmp_path, run_main):
    rng = np.random.default_rng(18)
    t = {}
    for k in range(6):
        x = rng.standard_normal(256).astype(np.float32)
        if k == 2:
            x[7] = 1e6  # overflows in fp16: kept in F32 under --on-overflow keep
        t[f"l{k}.w"] = ("F32", [256], x)
        t[f"l{k}.norm"] = ("F32", [64], rng.standard_normal(64).astype(np.float32))
    src = write_safetensors(tmp_path / "m.safetensors", t, metadata=META)
    dst = tmp_path / "out"
    args = ["--to", "fp16", "--on-overflow", "keep", "--keep", "*norm"]
    rc, _, err = run_main("convert", src, dst, "--max-shard-size", "1.5kB", *args, "-q")
    assert rc == 0, err
    files = shard_files(dst)
    got = {n: d for f in files for n, (d, _, _) in tensor_bytes(f).items()}
    assert got["l2.w"] == "F32" and got["l1.w"] == "F16" and got["l0.norm"] == "F32"
    for f in files:
        assert f.stat().st_size <= 1500 or len(tensor_bytes(f)) == 1
    rc, _, err = run_main("verify", src, dst, *args)
    assert rc == 0, err
    rc, _, err = run_main("verify", src, dst)  # as DST records them
    assert rc == 0, err
    rc, _, err = run_main(
        "verify", src, dst, "--to", "fp16", "--keep", "*norm", "--on-overflow", "warn"
    )
    assert rc == 1 and "l2.w" in err
    rc, out, err = run_main("inspect", src, "--max-shard-size", "1.5kB", *args, "--json")
    assert rc == 0, err
    planned = [s["bytes"] for s in json.loads(out)["result"]["shards"]]
    assert planned == [f.stat().st_size for f in files]


# --- transformers ----------------------------------------------------------------------------


def tiny_bert(transformers, torch):
    """A 2-layer BERT with a fixed seed."""
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config)


def check_bert_loads(transformers, torch, model, dst: Path) -> None:
    """transformers loads DST with no missing or unexpected key, every parameter the
    model's in bf16."""
    loaded, info = transformers.BertModel.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, p in model.state_dict().items():
        q = loaded.state_dict()[name]
        assert torch.equal(p.to(torch.bfloat16), q.to(torch.bfloat16)), name


def test_transformers_loads_a_resharded_bert(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = tiny_bert(transformers, torch)
    src = tmp_path / "bert"
    model.save_pretrained(src, safe_serialization=True)
    dst = tmp_path / "bert-bf16"
    stcast.convert(src, dst, max_shard_size="20kB")
    assert len(shard_files(dst)) > 1 and (dst / "model.safetensors.index.json").exists()
    check_bert_loads(transformers, torch, model, dst)


def test_transformers_loads_a_resharded_pytorch_bert(tmp_path):
    """The same from `pytorch_model.bin` (torch.save): re-sharded into model-*.safetensors."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = tiny_bert(transformers, torch)
    src = tmp_path / "bert"
    model.save_pretrained(src)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for f in src.glob("model*.safetensors*"):
        f.unlink()
    torch.save(state, src / "pytorch_model.bin")
    dst = tmp_path / "bert-bf16"
    stcast.convert(src, dst, max_shard_size="20kB")
    assert not list(dst.glob("*.bin")) and (dst / "model.safetensors.index.json").exists()
    assert len(shard_files(dst)) > 1
    check_bert_loads(transformers, torch, model, dst)
    assert stcast.verify(src, dst).ok


# --- memory ----------------------------------------------------------------------------------


def write_many_f32(path: Path, size: int, tensor: int) -> Path:
    """An F32 file of `size` data bytes in tensors of `tensor` bytes, 8 MiB at a time."""
    from conftest import encode_header

    header: dict = {"__metadata__": META}
    for k in range(size // tensor):
        header[f"t{k}"] = {
            "dtype": "F32",
            "shape": [tensor // 4],
            "data_offsets": [k * tensor, (k + 1) * tensor],
        }
    chunk = np.linspace(-3.0, 3.0, (8 << 20) // 4, dtype=np.float32).tobytes()
    with open(path, "wb") as f:
        f.write(encode_header(header))
        for _ in range(size // len(chunk)):
            f.write(chunk)
    return path


def peak_rss(*args: object) -> int:
    """Peak RSS in bytes of `python -m stcast ARGS -q` (see test_memory.py)."""
    import subprocess
    import sys

    from helpers import cli_env
    from test_memory import LAUNCHER

    cmd = [sys.executable, "-m", "stcast", *map(str, args), "-q"]
    launcher = subprocess.run(
        [sys.executable, "-c", LAUNCHER, os.devnull, os.devnull, *cmd],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert launcher.returncode == 0, launcher.stderr
    child = json.loads(launcher.stdout)
    assert child["rc"] == 0
    return int(child["maxrss_kib"]) * 1024


def test_peak_rss_is_the_single_file_bound(tmp_path):
    """Splitting 512 MiB into 11 shards, and merging 4 files into one shard, peak at what a
    plain conversion of the same data peaks at."""
    mib = 1 << 20
    src = write_many_f32(tmp_path / "ema.safetensors", 512 * mib, 16 * mib)
    plain = peak_rss("convert", src, tmp_path / "plain.safetensors")
    (tmp_path / "plain.safetensors").unlink()
    split = peak_rss("convert", src, tmp_path / "split", "--max-shard-size", "32MiB")
    assert len(shard_files(tmp_path / "split")) == 11  # 3 tensors of 8 MiB in each
    shutil.rmtree(tmp_path / "split")
    folder = tmp_path / "hf"
    folder.mkdir()
    weight_map = {}
    for i in range(4):
        name = f"model-{i + 1:05d}-of-00004.safetensors"
        write_many_f32(folder / name, 128 * mib, 16 * mib)
        raw = tensor_bytes(folder / name)
        # Names unique across the files.
        renamed = {f"l{i}.{n}": (d, s, b) for n, (d, s, b) in raw.items()}
        write_safetensors(folder / name, renamed, metadata=META)
        weight_map.update({n: name for n in renamed})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    src.unlink()
    merge = peak_rss("convert", folder, tmp_path / "merged", "--max-shard-size", "1GB")
    assert os.listdir(tmp_path / "merged") == ["model.safetensors"]
    print({k: f"{v / mib:.1f} MiB" for k, v in dict(plain=plain, split=split, merge=merge).items()})
    for peak in (split, merge):
        assert peak < 150 * mib and peak <= 1.25 * plain + 16 * mib, (plain, split, merge)


def test_a_file_resharded_into_its_own_folder(tmp_path, run_main):
    """With --force into the folder that holds it, a shard named like the input would
    replace it: refused before anything is written (no manifest either)."""
    src = write_single(tmp_path / "m.safetensors", np.random.default_rng(20), 2)
    before = tree(tmp_path)
    rc, _, err = run_main("convert", src, tmp_path, "--max-shard-size", "1GB", "--force")
    assert rc == 1 and "the input file itself" in assert_one_error_line(err)
    assert tree(tmp_path) == before
    # Shards named otherwise may go beside it, with --force (the folder is not empty).
    rc, _, err = run_main("convert", src, tmp_path, "--max-shard-size", "600", "--force", "-q")
    assert rc == 0, err
    assert (tmp_path / "m.safetensors.index.json").exists()
    assert (tmp_path / "m.safetensors").read_bytes() == before["m.safetensors"]


def test_an_empty_checkpoint(tmp_path, run_main):
    src = write_safetensors(tmp_path / "empty.safetensors", {}, metadata=META)
    rc, out, err = run_main("inspect", src, "--max-shard-size", "1kB")
    assert rc == 0, err
    assert "empty.safetensors" in out and "  -" in out
    stcast.convert(src, tmp_path / "out", max_shard_size="1kB")
    assert os.listdir(tmp_path / "out") == ["empty.safetensors"]
    assert tensor_bytes(tmp_path / "out" / "empty.safetensors") == {}
    assert stcast.verify(src, tmp_path / "out").ok


def test_shards_of_another_cut_that_are_not_provably_ours_are_named(tmp_path, run_main):
    """A finished run leaves no manifest, so a later `--force` at another size cannot prove
    the old shards are stcast's: it cannot remove them, and left beside the new output a
    loader reading every .safetensors file would load them too. The run is refused before
    anything is written (in inspect too), naming them; once they are removed it goes
    through. (It used to warn and leave them.)"""
    src = write_sharded(tmp_path / "hf", np.random.default_rng(21), 3)
    dst = tmp_path / "out"
    assert run_main("convert", src, dst, "--max-shard-size", "1300", "-q")[0] == 0
    old = sorted(p.name for p in dst.glob("model-*.safetensors"))
    (dst / "notes.txt").write_text("mine")
    (dst / "model.safetensors.index.json").unlink()  # the shards alone
    before = tree(dst)
    rc, out, err = run_main("inspect", src, dst, "--max-shard-size", "1TB", "--force")
    assert rc == 1 and old[0] in err, out + err
    rc, _, err = run_main("convert", src, dst, "--max-shard-size", "1TB", "--force")
    assert rc == 1 and f"holds `{old[0]}`" in assert_one_error_line(err), err
    assert f"and {len(old) - 4} more" in err or old[-1] in err, err
    assert tree(dst) == before
    with pytest.raises(stcast.Refused, match="remove them"):
        stcast.convert(src, dst, max_shard_size="1TB", force=True)
    for name in old:
        (dst / name).unlink()
    rc, _, err = run_main("convert", src, dst, "--max-shard-size", "1TB", "--force", "-q")
    assert (rc, err) == (0, "")
    assert (dst / "model.safetensors").exists() and (dst / "notes.txt").read_text() == "mine"


# --- --name: the output stem -----------------------------------------------------------------


def test_name_a_split_file(tmp_path, run_main):
    """`ema.safetensors --name model`: model-0000i-of-0000N and model.safetensors.index.json,
    which `verify --name model` (and inspect's plan) expect; no hint is printed then."""
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(30), 6, rows=32)
    dst = tmp_path / "out"
    args = ("--max-shard-size", 4000, "--name", "model")
    rc, out, err = run_main("inspect", src, dst, *args, "--json")
    assert rc == 0, err
    planned = [s["path"] for s in json.loads(out)["result"]["shards"]]
    rc, out, err = run_main("convert", src, dst, *args)
    assert rc == 0, err
    assert "--name" not in out
    files = shard_files(dst)
    n = len(files)
    assert n > 2
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert [f.name for f in files] == names == planned
    assert sorted(os.listdir(dst)) == sorted([*names, "model.safetensors.index.json"])
    check_against_input(dst, input_tensors([src]), files)
    check_cut(files, 4000, src)
    check_index(dst, "model", files)
    rc, _, err = run_main("verify", src, dst, "--name", "model")
    assert rc == 0, err
    assert stcast.verify(src, dst, name="model").ok
    # Without --name, verify takes it from DST's record.
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err
    # Another name: DST holds no files of that stem.
    assert not stcast.verify(src, dst, name="other").ok


def test_name_with_one_shard(tmp_path, run_main):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(31), 2)
    dst = tmp_path / "out"
    rc, out, err = run_main("convert", src, dst, "--max-shard-size", "1GB", "--name", "model")
    assert rc == 0, err
    assert os.listdir(dst) == ["model.safetensors"]
    check_against_input(dst, input_tensors([src]), [dst / "model.safetensors"])
    assert run_main("verify", src, dst, "--name", "model")[0] == 0


def test_name_a_folder_of_one_group(tmp_path, run_main):
    src = write_sharded(tmp_path / "hf", np.random.default_rng(32), 3, stem="consolidated")
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--max-shard-size", "2kB", "--name", "model")
    assert rc == 0, err
    files = shard_files(dst)
    n = len(files)
    assert n > 1
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    assert sorted(os.listdir(dst)) == sorted(
        [f.name for f in files] + ["model.safetensors.index.json", "config.json", "tokenizer.json"]
    )
    index = check_index(dst, "model", files)
    assert index["metadata"]["total_parameters"] == 7  # the source index's, kept
    check_against_input(dst, input_tensors(sorted(src.glob("*.safetensors"))), files)
    rc, _, err = run_main("verify", src, dst, "--name", "model")
    assert rc == 0, err


def test_name_of_a_folder_of_two_groups_is_a_usage_error(tmp_path, run_main):
    rng = np.random.default_rng(33)
    src = write_sharded(tmp_path / "hf", rng, 2)
    write_single(src / "ema.safetensors", rng, 1)
    dst = tmp_path / "out"
    for command in ("convert", "inspect"):
        rc, _, err = run_main(command, src, dst, "--max-shard-size", "1kB", "--name", "model")
        assert rc == 2, (command, err)
        line = assert_one_error_line(err)
        assert "--name" in line and "2" in line and "ema.safetensors" in line, line
    assert not dst.exists()
    with pytest.raises(stcast.UsageError) as info:
        stcast.convert(src, dst, max_shard_size="1kB", name="model")
    assert info.value.option == "name"
    assert "name" in str(info.value) and "--" not in str(info.value)
    assert not dst.exists()
    # verify too, before reading anything of DST.
    stcast.convert(src, dst, max_shard_size="1kB")
    rc, _, err = run_main("verify", src, dst, "--name", "model")
    assert rc == 2 and "--name" in assert_one_error_line(err)


@pytest.mark.parametrize(
    "stem",
    ["", ".", "..", "a/b", "/model", "model/", ".hidden", " ", "a\nb", "m.safetensors", "x" * 229],
)
def test_bad_names_are_usage_errors(tmp_path, run_main, stem):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(34), 1)
    dst = tmp_path / "out"
    for command in ("convert", "inspect", "verify"):
        args = ("--max-shard-size", "1kB") if command != "verify" else ()
        rc, _, err = run_main(command, src, dst, *args, "--name", stem)
        assert rc == 2, (command, err)
        assert assert_one_error_line(err).count("--name") == 1, err  # argparse names it
    for bad in (stem, "a\0b", 5):
        with pytest.raises(stcast.UsageError) as info:
            stcast.convert(src, dst, max_shard_size="1kB", name=bad)  # type: ignore[arg-type]
        assert info.value.option == "name" and "--" not in str(info.value)
        with pytest.raises(stcast.UsageError):
            stcast.verify(src, dst, name=bad)  # type: ignore[arg-type]
    assert not dst.exists()


def test_name_needs_max_shard_size(tmp_path, run_main):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(35), 1)
    dst = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, dst, "--name", "model")
    assert rc == 2 and "--max-shard-size" in assert_one_error_line(err)
    with pytest.raises(stcast.UsageError) as info:
        stcast.inspect(src, name="model")
    assert info.value.option == "name" and "max_shard_size" in str(info.value)
    assert not dst.exists()
    stcast.convert(src, dst)
    with pytest.raises(stcast.UsageError):  # two files: nothing is re-sharded
        stcast.verify(src, dst, name="model")


def test_name_in_the_api(tmp_path):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(36), 4, rows=32)
    dst = tmp_path / "out"
    plan = stcast.inspect(src, max_shard_size="3kB", name="model")
    n = len(plan.shards)
    assert n > 1 and [s["path"] for s in plan.shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    assert [i["path"] for i in plan.indexes] == ["model.safetensors.index.json"]
    report = stcast.convert(src, dst, max_shard_size="3kB", name="model")
    assert sorted(f.path for f in report.files) == sorted(
        [s["path"] for s in plan.shards] + ["model.safetensors.index.json"]
    )
    assert stcast.verify(src, dst, name="model").ok
    assert stcast.verify(src, dst).ok  # the name is in DST's record


def test_the_summary_says_how_to_get_from_pretrained_names(tmp_path, run_main):
    rng = np.random.default_rng(37)
    src = write_single(tmp_path / "ema.safetensors", rng, 4, rows=32)
    rc, out, err = run_main("convert", src, tmp_path / "a", "--max-shard-size", "3kB")
    assert rc == 0, err
    hint = [line for line in out.splitlines() if "from_pretrained" in line]
    assert len(hint) == 1 and "--name model" in hint[0], out
    # Not with --name, not for a file named so already, not for a folder.
    rc, out, _ = run_main("convert", src, tmp_path / "b", "--max-shard-size", "3kB", "--name", "x")
    assert rc == 0 and "from_pretrained" not in out
    model = write_single(tmp_path / "model.safetensors", rng, 4, rows=32)
    rc, out, _ = run_main("convert", model, tmp_path / "c", "--max-shard-size", "3kB")
    assert rc == 0 and "from_pretrained" not in out
    folder = write_sharded(tmp_path / "hf", rng, 2, stem="consolidated")
    rc, out, _ = run_main("convert", folder, tmp_path / "d", "--max-shard-size", "1kB")
    assert rc == 0 and "from_pretrained" not in out


def test_resume_with_another_name_removes_the_interrupted_runs_shards(tmp_path, cli_process):
    """As for another size: the first run's shard, which its manifest proves stcast's, is
    not left beside the shards of the new name."""
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(38), 4, rows=30)
    dst = tmp_path / "out"
    args = ("convert", src, dst, "--max-shard-size", "3kB", "-q")
    rc, _, err = cli_process(*args, "--name", "first", env=with_points(None, "folder-file=eio"))
    assert rc == 1, err
    assert [p.name for p in shard_files(dst)][0].startswith("first-00001-of-")
    rc, _, err = cli_process(*args, "--name", "model", "--resume")
    assert rc == 0, err
    stcast.convert(src, tmp_path / "fresh", max_shard_size="3kB", name="model")
    assert tree(dst) == tree(tmp_path / "fresh")
    assert stcast.verify(src, dst, name="model").ok


def test_shard_runs_and_finalize_with_a_name(tmp_path, run_main):
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(39), 4, rows=30)
    stcast.convert(src, tmp_path / "whole", max_shard_size="3kB", name="model")
    dst = tmp_path / "out"
    for i in (1, 2):
        rc, _, err = run_main(
            "convert", src, dst, "--max-shard-size", "3kB", "--name", "model", "--shard", f"{i}/2"
        )
        assert rc == 0, err
    rc, _, err = run_main("finalize", src, dst)
    assert rc == 0, err
    assert tree(dst) == tree(tmp_path / "whole")


def test_transformers_loads_a_named_resharded_file(tmp_path):
    """A lone `ema.safetensors` re-sharded with `--name model` beside a config loads."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = tiny_bert(transformers, torch)
    saved = tmp_path / "bert"
    model.save_pretrained(saved, safe_serialization=True)
    src = tmp_path / "ema.safetensors"
    shutil.move(saved / "model.safetensors", src)
    dst = tmp_path / "ema-bf16"
    stcast.convert(src, dst, max_shard_size="20kB", name="model")
    assert len(shard_files(dst)) > 1 and (dst / "model.safetensors.index.json").exists()
    shutil.copy(saved / "config.json", dst / "config.json")
    check_bert_loads(transformers, torch, model, dst)


def test_shards_of_the_own_stem_left_beside_a_named_output_are_named(tmp_path, run_main):
    """A finished run under the input's stem, then `--force --name model`: the old shards
    (no manifest proves them stcast's) stay and the run is refused naming them; the input
    file itself, re-sharded into its own folder, is never called a leftover."""
    src = write_single(tmp_path / "ema.safetensors", np.random.default_rng(40), 4, rows=30)
    dst = tmp_path / "out"
    assert run_main("convert", src, dst, "--max-shard-size", "3kB", "-q")[0] == 0
    old = sorted(p.name for p in dst.glob("ema-*.safetensors"))
    assert old
    args = ("--max-shard-size", "3kB", "--name", "model", "--force")
    rc, _, err = run_main("convert", src, dst, *args)
    assert rc == 1 and old[0] in assert_one_error_line(err), err
    assert sorted(p.name for p in dst.glob("ema-*.safetensors")) == old
    # Into the input's own folder: the input is not a leftover of anything.
    rc, _, err = run_main("convert", src, tmp_path, *args)
    assert rc == 0, err
    assert (tmp_path / "model.safetensors.index.json").exists() and src.exists()


def test_a_shard_warning_points_at_the_callers_line(tmp_path: Path) -> None:
    """An output shard's warning names the line that called stcast, as a file's does."""
    import warnings

    from safetensors.numpy import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": np.array([1e39, 1.0]), "b": np.ones(4, np.float32)}, str(src / "m.safetensors"))
    for i, options in enumerate(({}, {"max_shard_size": 10**6})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stcast.convert(src, tmp_path / f"out{i}", **options)  # type: ignore[arg-type]
        assert [(w.filename, w.category) for w in caught] == [(__file__, stcast.StcastWarning)], (
            options
        )
