"""Checkpoint folders: shards, indexes, configs, copies, symlinks, resume, --shard, refusals.

Every folder is generated here, small. Outputs are checked independently of stcast: shards
are loaded with safetensors and compared with ml_dtypes / numpy, indexes and configs are
parsed and compared text for text, every other file byte for byte.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import stcast
from conftest import assert_one_error_line, read_safetensors, write_safetensors
from helpers import run_on_pty
from reference import bf16_bits_ml_dtypes

MANIFEST = ".stcast-manifest.json"
FLOATS = (np.float16, np.float32, np.float64)


# --- generated folders -----------------------------------------------------------------------


def save(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)


def layer(rng, k: int, rows: int = 8) -> dict[str, np.ndarray]:
    """A few tensors of mixed dtypes; F64 values are exact in F32, so one rounding suffices."""
    return {
        f"model.layers.{k}.mlp.weight": rng.standard_normal((rows, 16), dtype=np.float32),
        f"model.layers.{k}.norm.weight": rng.standard_normal(16).astype(np.float16),
        f"model.layers.{k}.proj.bias": rng.standard_normal(4, dtype=np.float32).astype(np.float64),
        f"model.layers.{k}.position_ids": np.arange(5, dtype=np.int64),
    }


def write_index(path: Path, weight_map: dict[str, str], metadata: dict | None = None) -> None:
    """An index as transformers writes it: indent 2, sorted keys, final newline."""
    doc = {"metadata": {"total_parameters": 1, "total_size": 999} if metadata is None else metadata}
    doc["weight_map"] = weight_map
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def write_sharded(folder: Path, rng, shards: int, stem: str = "model", rows=None) -> None:
    weight_map = {}
    for k in range(shards):
        name = f"{stem}-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = layer(rng, k, rows[k] if rows else 8)
        save(folder / name, tensors, {"format": "pt"})
        weight_map.update({t: name for t in tensors})
    write_index(folder / f"{stem}.safetensors.index.json", dict(sorted(weight_map.items())))


HF_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "rms_norm_eps": 1e-05,
    "text_config": {"model_type": "llama", "hidden_size": 16, "torch_dtype": "float32"},
    "vision_config": {"model_type": "clip", "dtype": "float32", "layers": [1, 2]},
    "torch_dtype": "float32",
    "transformers_version": "4.45.0",
    "name": "Ünïcode ✓",
}


def make_hf_model(root: Path, rng, shards: int = 3, rows=None) -> Path:
    """A sharded model with index, nested config, tokenizer files and a subfolder."""
    root.mkdir(parents=True)
    write_sharded(root, rng, shards, rows=rows)
    (root / "config.json").write_text(json.dumps(HF_CONFIG, indent=2, ensure_ascii=False) + "\n")
    (root / "generation_config.json").write_text('{\n  "torch_dtype": "float32"\n}\n')
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": {"vocab": {"a": 0}}}')
    (root / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    (root / "special_tokens_map.json").write_text("{}\n")
    (root / "README.md").write_text("# model\n")
    (root / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    sub = root / "original"
    sub.mkdir()
    (sub / "params.json").write_text('{"dim": 16, "dtype": "float32"}\n')
    (sub / "blob.bin").write_bytes(rng.bytes(3000))
    save(sub / "adapter.safetensors", {"lora.a": rng.standard_normal((2, 3), dtype=np.float32)})
    return root


def make_diffusers(root: Path, rng) -> Path:
    """A diffusers-style pipeline: per-component folders with their own weights and configs."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet"]})
    )
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text('{"beta_start": 0.00085}\n')
    unet = root / "unet"
    unet.mkdir()
    write_sharded(unet, rng, 2, stem="diffusion_pytorch_model")
    (unet / "config.json").write_text('{\n  "_class_name": "UNet",\n  "in_channels": 4\n}\n')
    vae = root / "vae"
    vae.mkdir()
    save(vae / "diffusion_pytorch_model.safetensors", layer(rng, 0))
    write_sharded(vae, rng, 2, stem="extra")  # a second index in the same folder
    (vae / "config.json").write_text('{\n  "_class_name": "AutoencoderKL"\n}\n')
    enc = root / "text_encoder"
    enc.mkdir()
    save(enc / "model.safetensors", layer(rng, 0), {"format": "pt"})
    (enc / "config.json").write_text('{\n  "torch_dtype": "float32",\n  "vocab_size": 10\n}\n')
    return root


# --- independent checks ----------------------------------------------------------------------


def files_under(root: Path) -> dict[str, Path]:
    """Every file below `root` (through symlinks to files) by relative path."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            p = Path(folder) / name
            out[p.relative_to(root).as_posix()] = p
    return out


def expected_array(a: np.ndarray, to: str) -> np.ndarray:
    if to == "bf16":
        src = a.astype(np.float32) if a.dtype == np.float64 else a  # exact: see layer()
        return bf16_bits_ml_dtypes(src).view(ml_dtypes.bfloat16)
    return a.astype(np.float16)


def assert_shard(src: Path, dst: Path, to: str = "bf16") -> None:
    """`dst` loads with safetensors, holds every tensor of `src`, each exactly converted."""
    got = safetensors.numpy.load_file(str(dst))
    want = safetensors.numpy.load_file(str(src))
    assert list(got) == list(want) or set(got) == set(want)
    for name, a in want.items():
        b = got[name]
        assert b.shape == a.shape, name
        if a.dtype in FLOATS and not (to == "fp16" and a.dtype == np.float16):
            e = expected_array(a, to)
            assert b.dtype == e.dtype, (name, b.dtype)
            assert b.tobytes() == e.tobytes(), name
        else:
            assert b.dtype == a.dtype and b.tobytes() == a.tobytes(), name
    # SRC's __metadata__ in its order, then the record of convert's options (issue 33).
    got, want = metadata_of(dst), metadata_of(src) or []
    assert got is not None and got[:-1] == [kv for kv in want if kv[0] != "stcast"]
    assert got[-1][0] == "stcast" and json.loads(got[-1][1])["to"] == to


def metadata_of(path: Path) -> dict | None:
    _, items, _ = read_safetensors(path)
    return dict(items).get("__metadata__")


def with_dtype(doc, name: str):
    """The config as stcast should leave it: dtype keys set, quantization_config untouched."""
    if isinstance(doc, dict):
        return {
            k: (
                v
                if k == "quantization_config"
                else name
                if k in ("torch_dtype", "dtype") and (v is None or isinstance(v, str))
                else with_dtype(v, name)
            )
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [with_dtype(v, name) for v in doc]
    return doc


def ordered(doc):
    """JSON with key order made visible, for comparisons that care about it."""
    return json.dumps(doc, ensure_ascii=False)


def assert_folder(src: Path, dst: Path, to: str = "bf16") -> None:
    """`dst` is the complete conversion of `src`, checked file by file."""
    src_files = files_under(src)
    dst_files = files_under(dst)
    # A finished run leaves no stcast file behind: the folder can be uploaded as it is.
    assert set(dst_files) == set(src_files)
    for rel, s in src_files.items():
        d = dst_files[rel]
        assert not d.is_symlink() and d.is_file(), rel
        if rel.endswith(".safetensors"):
            assert_shard(s, d, to)
        elif rel.endswith(".safetensors.index.json"):
            assert_index(s, d)
        elif Path(rel).name == "config.json":
            old, new = json.loads(s.read_text()), json.loads(d.read_text())
            name = {"bf16": "bfloat16", "fp16": "float16"}[to]
            assert ordered(new) == ordered(with_dtype(old, name)), rel
            assert d.read_text().endswith("\n") == s.read_text().endswith("\n"), rel
        else:
            assert d.read_bytes() == s.read_bytes(), rel


def assert_index(src: Path, dst: Path, layout: bool = True) -> None:
    old, new = json.loads(src.read_text()), json.loads(dst.read_text())
    assert list(new) == list(old) or list(new) == ["metadata", *old]
    assert ordered(new["weight_map"]) == ordered(old["weight_map"])
    total = 0
    for shard in sorted(set(new["weight_map"].values())):
        arrays = safetensors.numpy.load_file(str(dst.parent / shard))
        total += sum(a.nbytes for a in arrays.values())
    old_meta = dict(old.get("metadata") or {})
    assert new["metadata"]["total_size"] == total
    old_meta["total_size"] = total
    # The record of convert's options, last: its shards' (`__metadata__["stcast"]`).
    shard = dst.parent / sorted(set(new["weight_map"].values()))[0]
    meta = stcast.inspect(shard).metadata or {}
    old_meta.pop("stcast", None)
    if "stcast" in meta:
        old_meta["stcast"] = meta["stcast"]
    assert new["metadata"] == old_meta
    if layout and "total_size" in (old.get("metadata") or {}):
        # Only the number changed, and the record added: same keys, order and formatting.
        text = re.sub(r'("total_size":\s*)\d+', rf"\g<1>{total}", src.read_text())
        written = re.sub(r',\s*"stcast":\s*"(?:[^"\\]|\\.)*"', "", dst.read_text())
        assert written == text


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file below root, to see what a run rewrote."""
    return {rel: (p.lstat().st_ino, p.lstat().st_mtime_ns) for rel, p in files_under(root).items()}


def actions(report) -> dict[str, str]:
    return {f.path: f.action for f in report.files}


# --- whole folders ---------------------------------------------------------------------------


def test_hf_model_folder(tmp_path, rng):
    src = make_hf_model(tmp_path / "model", rng)
    dst = tmp_path / "out"
    report = stcast.convert(src, dst)
    assert isinstance(report, stcast.ConvertReport) and report.folder
    assert_folder(src, dst)

    # Config text: only the dtype values changed, indentation and non-ASCII kept.
    want = json.dumps(with_dtype(HF_CONFIG, "bfloat16"), indent=2, ensure_ascii=False) + "\n"
    assert (dst / "config.json").read_text() == want
    # Only config.json files are rewritten; other JSON with a dtype key is copied.
    assert (dst / "original/params.json").read_bytes() == (
        src / "original/params.json"
    ).read_bytes()

    assert report.complete and report.shard is None and report.to == "bf16"
    acts = actions(report)
    assert acts["model-00001-of-00003.safetensors"] == "converted"
    assert acts["original/adapter.safetensors"] == "converted"
    assert acts["config.json"] == acts["model.safetensors.index.json"] == "rewritten"
    assert acts["tokenizer.json"] == acts["original/blob.bin"] == "copied"
    assert report.tensors_converted == 3 * 3 + 1 and report.tensors_copied == 3
    weights = [f for f in report.files if f.kind == "weights"]
    assert report.bytes_in == sum(f.bytes_in for f in weights)
    # The index and configs come last in the report, as on disk.
    kinds = [f.kind for f in report.files]
    assert kinds[-1] == "index" and kinds.index("config") > kinds.index("copy")
    d = report.to_dict()
    assert json.loads(json.dumps(d))["files"][0]["path"] == "model-00001-of-00003.safetensors"

    # Finished: no manifest, no temp file is left.
    assert not [p for p in dst.rglob(".stcast-*")]


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("shards", [False, True])
def test_a_folder_into_a_file_name_is_a_usage_error(tmp_path, rng, run_main, command, shards):
    """A folder of files (or any re-sharding) writes a folder: DST `x.safetensors` would
    become a folder no loader opens as a file (issue 33). Exit 2 naming the folder to give,
    nothing created; a folder of that name that exists is a folder."""
    src = make_hf_model(tmp_path / "model", rng, shards=1)
    before = sorted(os.listdir(tmp_path))
    extra = ["--max-shard-size", "1MB"] if shards else []
    for dst in ("x.safetensors", "Y.SAFETENSORS"):
        rc, out, err = run_main(command, src, tmp_path / dst, *extra)
        line = assert_one_error_line(err)
        stem = dst.split(".")[0]
        why = (
            "--max-shard-size writes a folder of shards and an index"
            if shards
            else "the source is a folder of files, converted into a folder"
        )
        assert rc == 2 and line == (
            f"stcast: {tmp_path / dst}: {why}, not one file: name a folder (e.g. "
            f"{tmp_path / stem}/)"
        ), line
        assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(stcast.UsageError) as info:
        stcast.convert(src, tmp_path / "x.safetensors", max_shard_size=1 << 20 if shards else None)
    assert info.value.option == ("max_shard_size" if shards else None)
    assert sorted(os.listdir(tmp_path)) == before
    (tmp_path / "x.safetensors").mkdir()
    rc, out, err = run_main(command, src, tmp_path / "x.safetensors", *extra)
    assert rc == 0, err


def test_fp16_and_default_destination(tmp_path, rng):
    src = make_hf_model(tmp_path / "model", rng)
    report = stcast.convert(str(src) + "/", to="fp16")
    assert report.dst == str(tmp_path / "model-fp16")
    assert_folder(src, tmp_path / "model-fp16", to="fp16")
    cfg = json.loads((tmp_path / "model-fp16/config.json").read_text())
    assert cfg["torch_dtype"] == cfg["text_config"]["torch_dtype"] == "float16"


def test_diffusers_folder(tmp_path, rng):
    src = make_diffusers(tmp_path / "sd", rng)
    dst = tmp_path / "sd-bf16"
    report = stcast.convert(src, dst)
    assert_folder(src, dst)
    acts = actions(report)
    # Configs without a dtype key are copied unchanged; each index gets its own total.
    assert acts["unet/config.json"] == acts["vae/config.json"] == "copied"
    assert acts["text_encoder/config.json"] == "rewritten"
    for index in [
        "unet/diffusion_pytorch_model.safetensors.index.json",
        "vae/extra.safetensors.index.json",
    ]:
        assert acts[index] == "rewritten"
    assert json.loads((dst / "text_encoder/config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (dst / "model_index.json").read_bytes() == (src / "model_index.json").read_bytes()


def test_hf_cache_symlinks(tmp_path, rng):
    """A cache snapshot is a folder of relative symlinks into ../../blobs: read through them."""
    built = make_hf_model(tmp_path / "built", rng)
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    for i, (rel, p) in enumerate(sorted(files_under(built).items())):
        blob = blobs / f"{i:040x}"
        blob.write_bytes(p.read_bytes())
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    before = {p.name: p.read_bytes() for p in blobs.iterdir()}

    dst = tmp_path / "out"
    stcast.convert(snap, dst)
    assert_folder(snap, dst)
    assert all(not p.is_symlink() for p in files_under(dst).values())
    assert {p.name: p.read_bytes() for p in blobs.iterdir()} == before


def test_hf_cache_repo_root_shard_runs_then_finalize(tmp_path, rng):
    """Shard runs of a cache repo root read its snapshot; `finalize` given the same root
    finds their manifests (it read the root itself, whose identity no manifest holds)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abcd"
    make_hf_model(snap, rng)
    dst = tmp_path / "out"
    for i in (1, 2):
        stcast.convert(repo, dst, shard=(i, 2))
    stcast.finalize(repo, dst)
    assert_folder(snap, dst)
    assert stcast.verify(repo, dst).ok


# --- JSON rewriting --------------------------------------------------------------------------

CONFIG_CASES = {
    "indent4-newline": (
        '{\n    "torch_dtype": "float32",\n    "eps": 1.0e-5\n}\n',
        '{\n    "torch_dtype": "bfloat16",\n    "eps": 1.0e-5\n}\n',
    ),
    "tabs-no-newline": (
        '{\n\t"a": {\n\t\t"dtype": "float32"\n\t},\n\t"b": [1, 2]\n}',
        '{\n\t"a": {\n\t\t"dtype": "bfloat16"\n\t},\n\t"b": [1, 2]\n}',
    ),
    "compact": (
        '{"torch_dtype":"float32","sub":[{"dtype":"float16"}],"x":"dtype"}',
        '{"torch_dtype":"bfloat16","sub":[{"dtype":"bfloat16"}],"x":"dtype"}',
    ),
    "non-ascii-and-escapes": (
        '{"name": "模型", "e": "\\u00e9", "torch_dtype" : null}\n',
        '{"name": "模型", "e": "\\u00e9", "torch_dtype" : "bfloat16"}\n',
    ),
    "quantization-config-untouched": (
        '{"quantization_config": {"dtype": "float8"}, "torch_dtype": "float32"}',
        '{"quantization_config": {"dtype": "float8"}, "torch_dtype": "bfloat16"}',
    ),
    "no-dtype-key": ('{"a": 1}', '{"a": 1}'),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_text_is_kept(tmp_path, rng, case):
    old, new = CONFIG_CASES[case]
    src = tmp_path / "m"
    save(src / "model.safetensors", layer(rng, 0))
    (src / "config.json").write_text(old, encoding="utf-8")
    if "quantization_config" in old:
        # Converted anyway: the folder's quantization_config makes its file quantized.
        with pytest.warns(stcast.StcastWarning, match="quantized checkpoint"):
            stcast.convert(src, tmp_path / "o", allow_quantized=True)
    else:
        stcast.convert(src, tmp_path / "o", allow_quantized=True)
    assert (tmp_path / "o/config.json").read_text(encoding="utf-8") == new


def test_a_dry_run_into_dst_says_each_warning_once(tmp_path, rng):
    """`inspect SRC DST` of a folder says what the run would say, each warning once (the
    run's checks and the engine's dry run both heard the plan's)."""
    src = tmp_path / "m"
    save(src / "model.safetensors", layer(rng, 0))
    (src / "config.json").write_text('{"quantization_config": {"dtype": "float8"}}')
    (src / "optimizer.pt").write_bytes(b"x" * 10)
    report = stcast.inspect(src, tmp_path / "o", allow_quantized=True, include=["*.nope"])
    kinds = [w.kind for w in report.warnings]
    assert kinds.count("quantized") == 1, report.warnings
    assert kinds.count("unmatched_pattern") == 1, report.warnings
    assert kinds.count("skipped_files") == 1, report.warnings


INDEX_CASES = {
    "no-total-size": ('{\n  "metadata": {"format": "pt"},\n  "weight_map": WM\n}\n', 2),
    "no-metadata": ('{\n    "weight_map": WM\n}', 4),
    "compact": ('{"metadata":{"total_size":1},"weight_map":WM}', None),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_index_variants(tmp_path, rng, case):
    template, indent = INDEX_CASES[case]
    src = tmp_path / "m"
    write_sharded(src, rng, 2)
    index = src / "model.safetensors.index.json"
    wm = json.loads(index.read_text())["weight_map"]
    index.write_text(template.replace("WM", json.dumps(wm)))
    stcast.convert(src, tmp_path / "o")
    # An index whose record is added is dumped again in its own style: one of mixed
    # separators (compact, its weight map not) gets the separators of its first member.
    assert_index(index, tmp_path / "o" / index.name, layout=case != "compact")
    out = (tmp_path / "o" / index.name).read_text()
    assert out.endswith("\n") == template.endswith("\n")
    if indent is None:
        assert "\n" not in out
    else:
        assert out.startswith("{\n" + " " * indent + '"metadata"')


# --- progress, CLI ---------------------------------------------------------------------------


def test_progress_counts_the_whole_folder(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    calls, per_file = [], {}

    def file_progress(path, done, total):
        per_file.setdefault(path, []).append((done, total))

    stcast.convert(
        src, tmp_path / "o", progress=lambda d, t: calls.append((d, t)), file_progress=file_progress
    )
    totals = {t for _, t in calls}
    assert len(totals) == 1
    total = totals.pop()
    data = sum(stcast.inspect(p).data_bytes for p in src.rglob("*.safetensors"))
    copied = sum(
        p.stat().st_size
        for p in src.rglob("*")
        if p.is_file()
        and not p.name.endswith((".safetensors", ".index.json"))
        and p.name != "config.json"
    )
    assert total == data + copied
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == total
    assert {p for p in per_file if p.endswith(".safetensors")} == {
        p.relative_to(src).as_posix() for p in src.rglob("*.safetensors")
    }
    for seq in per_file.values():
        assert seq[0][0] == 0 and seq[-1][0] == seq[-1][1]


def test_cli_folder_json_and_summary(tmp_path, rng, run_main):
    src = make_hf_model(tmp_path / "m", rng)
    rc, out, err = run_main("convert", src, tmp_path / "o", "--json")
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert (doc["schema"], doc["command"], doc["version"]) == (1, "convert", stcast.__version__)
    result = doc["result"]
    for key in ["src", "dst", "to", "tensors_converted", "bytes_in", "bytes_out", "seconds"]:
        assert key in result
    files = {f["path"]: f for f in result["files"]}
    assert files["config.json"]["action"] == "rewritten"
    assert files["model-00003-of-00003.safetensors"]["kind"] == "weights"
    assert_folder(src, tmp_path / "o")

    rc, out, err = run_main("convert", src, tmp_path / "o2")
    assert rc == 0 and err == ""
    assert out.startswith(f"converted {src} -> {tmp_path / 'o2'}\n")
    assert "4 converted" in out and "rewritten" in out

    rc, out, err = run_main("convert", src, tmp_path / "o2")  # not empty now
    assert rc == 1 and out == ""
    line = assert_one_error_line(err)
    assert "--resume" in line and "--force" in line

    rc, out, err = run_main("convert", src, tmp_path / "o2", "--resume", "-q")
    assert (rc, out, err) == (0, "", "")


def test_cli_progress_on_a_terminal(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    rc, out, err = run_on_pty(["convert", src, tmp_path / "o"])
    assert rc == 0, err
    text = err.decode(errors="replace")
    # The file's name, maybe clipped at the front to fit the line.
    assert "%" in text and "0001-of-00003.safetensors 0%" in text
    assert "Traceback" not in text


# --- interruption, rerun, resume -------------------------------------------------------------


class Stop(Exception):
    pass


def interrupt_at_second_file(src: Path, dst: Path, at: int = 2) -> None:
    """Stop a run of `src` into `dst` as its `at`-th file starts (default: the second)."""
    seen: list[str] = []

    def file_progress(path, done, total):
        if path not in seen:
            seen.append(path)
        if len(seen) == at:
            raise Stop

    with pytest.raises(Stop):
        stcast.convert(src, dst, file_progress=file_progress)


def test_interrupted_run_never_looks_complete(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    dst = tmp_path / "o"
    interrupt_at_second_file(src, dst)
    # The first file is done and recorded; no index, config or other file is there yet.
    names = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()}
    assert names == {MANIFEST, "model-00001-of-00003.safetensors"}
    manifest = json.loads((dst / MANIFEST).read_text())
    assert not manifest["complete"] and list(manifest["files"]) == [
        "model-00001-of-00003.safetensors"
    ]
    # What resume needs: the source's identity, the options, what the run planned, and per
    # file written its identity and the source's size, mtime and header.
    assert manifest["version"] == stcast.__version__ and manifest["options"] == {"to": "bf16"}
    assert manifest["src_id"] == [src.stat().st_dev, src.stat().st_ino]
    assert set(manifest["planned"]) == {
        p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()
    }
    entry = manifest["files"]["model-00001-of-00003.safetensors"]
    out = (dst / "model-00001-of-00003.safetensors").stat()
    assert (entry["dev"], entry["ino"], entry["size"]) == (out.st_dev, out.st_ino, out.st_size)
    st = (src / "model-00001-of-00003.safetensors").stat()
    assert (entry["source_size"], entry["source_mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    assert len(entry["source_header_sha256"]) == 64

    # A plain rerun is refused; --resume converts only what is left.
    with pytest.raises(stcast.StcastError, match="resume=True continues it") as e:
        stcast.convert(src, dst)
    assert e.value.kind == "refused"
    first = dst / "model-00001-of-00003.safetensors"
    before = (first.stat().st_ino, first.stat().st_mtime_ns)
    report = stcast.convert(src, dst, resume=True)
    acts = actions(report)
    assert acts["model-00001-of-00003.safetensors"] == "skipped"
    assert acts["model-00002-of-00003.safetensors"] == "converted"
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == before
    assert report.tensors_converted == 2 * 3 + 1
    assert_folder(src, dst)


def test_resume_skips_only_what_checks_out(tmp_path, rng):
    """With the manifest of an interrupted run, resume trusts exactly what it recorded."""
    src = make_hf_model(tmp_path / "m", rng)
    dst = tmp_path / "o"
    interrupt_at_second_file(src, dst, at=3)  # two weight files done and recorded
    done = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    assert set(json.loads((dst / MANIFEST).read_text())["files"]) == set(done)
    # A touched source and a damaged output are converted again; the rest is skipped.
    touched = src / done[0]
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    damaged = dst / done[1]
    damaged.write_bytes(damaged.read_bytes()[:-2])
    report = stcast.convert(src, dst, resume=True)
    acts = actions(report)
    assert acts[done[0]] == "converted" and acts[done[1]] == "converted"
    assert acts["model-00003-of-00003.safetensors"] == "converted"
    assert_folder(src, dst)


@pytest.mark.parametrize("size", ["other", "same"])
def test_resume_never_takes_a_new_file_that_reuses_a_recorded_inode(tmp_path, rng, size):
    """A device and inode are another file's once the recorded file is gone: a user who
    deletes a recorded output and writes a file of their own, which the file system gives
    the freed inode number, keeps it. Resume refuses it, named, instead of replacing it (a
    size that differs: re-converted over it) or skipping it as done (the same size). The
    record holds the birth time too; here the inode reuse is made certain by recording the
    new file's device and inode in the manifest, as a reuse would."""
    src = make_hf_model(tmp_path / "m", rng)
    dst = tmp_path / "o"
    interrupt_at_second_file(src, dst, at=3)
    doc = json.loads((dst / MANIFEST).read_text())
    rel = "model-00002-of-00003.safetensors"
    entry = doc["files"][rel]
    assert isinstance(entry["born"], int)  # (ext4 and tmpfs keep birth times)
    old = (dst / rel).stat().st_size
    (dst / rel).unlink()
    mine = b"my notes " * (old // 9 + 1)
    (dst / rel).write_bytes(mine[:old] if size == "same" else mine)
    st = (dst / rel).stat()
    entry.update(dev=st.st_dev, ino=st.st_ino, size=st.st_size)
    (dst / MANIFEST).write_text(json.dumps(doc, indent=1))
    with pytest.raises(stcast.Refused, match="no stcast manifest says it wrote them") as e:
        stcast.convert(src, dst, resume=True)
    assert rel in str(e.value)
    assert (dst / rel).read_bytes().startswith(b"my notes ")


def test_resume_after_a_finished_run_adopts_exact_outputs_only(tmp_path, rng):
    """A finished run leaves no manifest: resume then recognises its outputs by their
    content (the planned size and header, then a verify against the source), and refuses
    to replace anything else."""
    src = make_hf_model(tmp_path / "m", rng)
    dst = tmp_path / "o"
    stcast.convert(src, dst)
    again = stcast.convert(src, dst, resume=True)
    assert {a for p, a in actions(again).items() if p.endswith(".safetensors")} == {"skipped"}
    assert again.tensors_converted == 0 and again.threads is None
    assert_folder(src, dst)

    # A header that differs in its bytes (same size) is not the planned one: refused.
    out3 = dst / "model-00003-of-00003.safetensors"
    raw = bytearray(out3.read_bytes())
    i = raw.index(b'"format"')
    raw[i + 1 : i + 7] = b"FORMAT"
    out3.write_bytes(bytes(raw))
    before = snapshot(dst)
    with pytest.raises(stcast.Refused, match="no stcast manifest says it wrote them") as e:
        stcast.convert(src, dst, resume=True)
    assert "model-00003-of-00003.safetensors" in str(e.value) and "force=True" in str(e.value)
    assert snapshot(dst) == before
    stcast.convert(src, dst, force=True)
    # A source touched after its output was written, same content: still exactly its
    # conversion, adopted.
    touched = src / "model-00001-of-00003.safetensors"
    st = (dst / "model-00001-of-00003.safetensors").stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    again = stcast.convert(src, dst, resume=True)
    assert actions(again)["model-00001-of-00003.safetensors"] == "skipped"
    # A source whose values changed (same header, same size) is not its conversion.
    raw = bytearray(touched.read_bytes())
    raw[-1] ^= 0x40
    touched.write_bytes(bytes(raw))
    with pytest.raises(stcast.Refused, match="model-00001-of-00003.safetensors"):
        stcast.convert(src, dst, resume=True)
    report = stcast.convert(src, dst, force=True)
    assert {a for p, a in actions(report).items() if p.endswith(".safetensors")} == {"converted"}
    assert_folder(src, dst)


def test_resume_after_options_change_converts_again(tmp_path, rng):
    """The files an interrupted run recorded are its own: resume with other options
    replaces them. After a finished run (no manifest), only force does."""
    src = make_hf_model(tmp_path / "m", rng)
    dst = tmp_path / "o"
    interrupt_at_second_file(src, dst)
    report = stcast.convert(src, dst, to="fp16", resume=True)
    assert {a for p, a in actions(report).items() if p.endswith(".safetensors")} == {"converted"}
    assert_folder(src, dst, to="fp16")
    with pytest.raises(stcast.Refused, match="force=True replaces them"):
        stcast.convert(src, dst, resume=True)
    stcast.convert(src, dst, force=True)
    assert_folder(src, dst)


def test_force_converts_everything_again(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    dst = tmp_path / "o"
    interrupt_at_second_file(src, dst)
    (dst / "stray.txt").write_text("left alone")
    before = snapshot(dst)
    report = stcast.convert(src, dst, force=True)
    assert {a for p, a in actions(report).items() if p.endswith(".safetensors")} == {"converted"}
    assert (
        snapshot(dst)["model-00001-of-00003.safetensors"]
        != before["model-00001-of-00003.safetensors"]
    )
    assert (dst / "stray.txt").read_text() == "left alone"
    (dst / "stray.txt").unlink()
    assert_folder(src, dst)


# --- --shard and finalize --------------------------------------------------------------------


def test_shards_then_finalize_equal_a_plain_run(tmp_path, rng, run_main):
    src = make_hf_model(tmp_path / "m", rng, shards=5, rows=[40, 8, 24, 8, 16])
    plain = tmp_path / "plain"
    stcast.convert(src, plain)

    dst = tmp_path / "sharded"
    done: list[set[str]] = []
    for i in (1, 2, 3):
        if i == 2:  # one through the command line
            rc, out, err = run_main("convert", src, dst, "--shard", "2/3", "--json")
            assert (rc, err) == (0, ""), err
            result = json.loads(out)["result"]
            assert result["shard"] == [2, 3] and result["complete"] is False
            mine = {f["path"] for f in result["files"]}
        else:
            report = stcast.convert(src, dst, shard=(i, 3))
            assert report.shard == [i, 3] and not report.complete
            mine = {f.path for f in report.files}
        assert all(p.endswith(".safetensors") for p in mine)
        done.append(mine)
        # Until finalize, nothing but converted shards and the shard manifests.
        present = {p.name for p in dst.rglob("*") if p.is_file()}
        assert "config.json" not in present and "tokenizer.json" not in present
        assert "model.safetensors.index.json" not in present
        if i == 1:
            with pytest.raises(stcast.StcastError, match=r"not converted.*shard=\([23], 3\)"):
                stcast.finalize(src, dst)
            with pytest.raises(stcast.StcastError, match="already ran"):
                stcast.convert(src, dst, shard=(1, 3))

    every = {p.relative_to(src).as_posix() for p in src.rglob("*.safetensors")}
    assert set().union(*done) == every and sum(map(len, done)) == len(every)

    rc, out, err = run_main("finalize", src, dst, "--json")
    assert (rc, err) == (0, ""), err
    result = json.loads(out)["result"]
    assert result["complete"] is True
    assert {f["path"] for f in result["files"] if f["action"] == "checked"} == every

    assert_folder(src, dst)
    plain_files, sharded_files = files_under(plain), files_under(dst)
    assert set(plain_files) == set(sharded_files)
    for rel in plain_files:
        assert plain_files[rel].read_bytes() == sharded_files[rel].read_bytes(), rel
    assert not list(dst.glob(".stcast-*"))

    # A resumed plain run over the finalized folder trusts the shard runs' work.
    report = stcast.convert(src, dst, resume=True)
    assert {a for p, a in actions(report).items() if p in every} == {"skipped"}


def test_a_shard_that_is_no_pair_of_whole_numbers_is_a_usage_error(tmp_path, rng):
    """`shard` is read as Python reads whole numbers: one of any size is named as written,
    and an endless iterable is not read to its end. Nothing is written."""
    src = make_hf_model(tmp_path / "m", rng, shards=2)
    dst = tmp_path / "o"
    with pytest.raises(stcast.UsageError, match=r"'1/1(0){40}' is not I/N with N at most 3,"):
        stcast.convert(src, dst, shard=(1, 10**40))
    for bad in [itertools.count(1), (10**40, 1), (1, 2, 3), "123", 3]:
        with pytest.raises(stcast.UsageError, match=r"a pair \(i, n\) of whole numbers"):
            stcast.convert(src, dst, shard=bad)
    assert not dst.exists()


def test_finalize_needs_a_manifest(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    (tmp_path / "o").mkdir()
    with pytest.raises(stcast.StcastError, match="no stcast manifest"):
        stcast.finalize(src, tmp_path / "o")


def test_a_shard_run_says_how_to_finalize_from_anywhere(tmp_path, rng, run_main, monkeypatch):
    """A shard run given relative paths names the absolute SRC and DST that `finalize`
    takes (the other shards' jobs may start elsewhere): in its report, its `--json` result
    and the command it prints; a complete run names none."""
    make_hf_model(tmp_path / "m", rng, shards=2)
    monkeypatch.chdir(tmp_path)
    want = (str(tmp_path / "m"), str(tmp_path / "out"))
    report = stcast.convert("m/../m", "out/", shard=(1, 2))
    assert report.finalize == want
    rc, out, err = run_main("convert", "m", "out", "--shard", "2/2", "--json")
    assert (rc, err) == (0, ""), err
    assert json.loads(out)["result"]["finalize"] == list(want)
    rc, out, err = run_main("convert", "m", "other", "--shard", "1/2")
    assert (rc, err) == (0, ""), err
    assert f"stcast finalize {tmp_path / 'm'} {tmp_path / 'other'}" in out
    done = stcast.finalize("m", "out")
    assert done.finalize is None and "finalize" not in done.to_dict()


# --- refusals --------------------------------------------------------------------------------


def assert_refused_cleanly(tmp_path: Path, src: Path, dst: Path, match: str, kind: str) -> None:
    """The conversion fails with StcastError before writing anything."""
    before, existed = snapshot(tmp_path), dst.exists()
    with pytest.raises(stcast.StcastError, match=match) as e:
        stcast.convert(src, dst)
    assert e.value.kind == kind
    assert snapshot(tmp_path) == before
    assert dst.exists() == existed


@pytest.mark.parametrize(
    "name",
    [
        "../model-00001-of-00003.safetensors",
        "/etc/passwd",
        "sub/../model-00001-of-00003.safetensors",
        "./model-00001-of-00003.safetensors",
        "model-00001-of-00003.safetensors\x00.txt",
        "",
        "a\\b.safetensors",
        "\ud800.safetensors",  # a JSON escape naming no file
        "\udcff.safetensors",
    ],
)
def test_weight_map_names_must_be_plain(tmp_path, rng, name):
    src = make_hf_model(tmp_path / "m", rng)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.layers.0.mlp.weight"] = name
    index.write_text(json.dumps(doc, indent=2))
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", "plain relative names", "refused")


@pytest.mark.parametrize("edit", ["missing-shard", "not-in-shard", "not-in-index", "moved"])
def test_index_must_agree_with_shards(tmp_path, rng, edit):
    src = make_hf_model(tmp_path / "m", rng)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    wm = doc["weight_map"]
    if edit == "missing-shard":
        (src / "model-00002-of-00003.safetensors").unlink()
        match = "names shard `model-00002-of-00003.safetensors`, which is missing"
    elif edit == "not-in-shard":
        wm["lm_head.weight"] = "model-00001-of-00003.safetensors"
        match = "`lm_head.weight` is listed for `model-00001-of-00003.safetensors` but"
    elif edit == "not-in-index":
        del wm["model.layers.1.norm.weight"]
        match = "`model.layers.1.norm.weight` of shard `model-00002-of-00003.safetensors` is abs"
    else:
        wm["model.layers.1.norm.weight"] = "model-00001-of-00003.safetensors"
        match = "listed for `model-00001-of-00003.safetensors`"
    index.write_text(json.dumps(doc, indent=2))
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", re.escape(match), "invalid_input")


def test_folders_must_not_nest(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    for dst in [src / "out", src, src / "original" / "x"]:
        assert_refused_cleanly(tmp_path, src, dst, "is the source folder or lies", "refused")
    inner = tmp_path / "outer" / "inner"
    make_hf_model(inner, rng)
    assert_refused_cleanly(tmp_path, inner, tmp_path / "outer", "contains the source", "refused")
    # Also through a symlink to the source.
    (tmp_path / "link").symlink_to(src)
    assert_refused_cleanly(tmp_path, src, tmp_path / "link" / "o", "lies inside", "refused")


def test_odd_entries_are_refused(tmp_path, rng, run_main):
    src = make_hf_model(tmp_path / "m", rng)
    (tmp_path / "elsewhere").mkdir()
    (src / "linked").symlink_to(tmp_path / "elsewhere")
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", "symlink to a folder", "refused")
    (src / "linked").unlink()
    (src / "dangling").symlink_to(tmp_path / "nothing")
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", "broken symlink", "invalid_input")
    (src / "dangling").unlink()
    os.mkfifo(src / "fifo")
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", "not a regular file", "refused")
    rc, out, err = run_main("convert", src, tmp_path / "o")
    assert rc == 1 and out == "" and "not a regular file" in assert_one_error_line(err)
    (src / "fifo").unlink()
    (tmp_path / "file").write_text("x")
    assert_refused_cleanly(tmp_path, src, tmp_path / "file", "not a folder", "refused")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_refused_cleanly(
        tmp_path, empty, tmp_path / "o", "directory without .safetensors files", "refused"
    )


def test_destination_links_are_not_followed(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    dst = tmp_path / "o"
    dst.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (dst / "original").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(stcast.StcastError, match="exists and is not a folder") as e:
        stcast.convert(src, dst, force=True)
    assert e.value.kind == "refused"
    assert not any((tmp_path / "elsewhere").iterdir())


def quantized_shard(path: Path, rng) -> None:
    write_safetensors(
        path,
        {
            "w": ("F8_E4M3", [4, 4], rng.integers(0, 256, 16, dtype=np.uint8).tobytes()),
            "w_scale": ("F32", [1], np.float32(0.5).tobytes()),
            "norm": ("F32", [4], rng.standard_normal(4, dtype=np.float32)),
        },
    )


def test_quantized_checkpoints_are_refused(tmp_path, rng, run_main):
    src = make_hf_model(tmp_path / "m", rng)
    cfg = dict(HF_CONFIG, quantization_config={"quant_method": "fp8", "dtype": "float8"})
    (src / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", "quantization_config", "refused")
    rc, out, err = run_main("convert", src, tmp_path / "o")
    line = assert_one_error_line(err)
    # No tensor of that file is named like a scale: `--keep '*scale*'` would keep none.
    assert rc == 1 and "round its F32 tensors" in line and "'*scale*'" not in line
    assert "--keep patterns naming them" in line and "--allow-quantized" in line

    (src / "config.json").write_text(json.dumps(HF_CONFIG, indent=2) + "\n")
    quantized_shard(src / "original" / "fp8.safetensors", rng)
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", r"fp8\.safetensors.*F8_E4M3", "refused")


def test_quantized_checkpoints_convert_when_allowed(tmp_path, rng):
    src = make_hf_model(tmp_path / "m", rng)
    cfg = dict(HF_CONFIG, quantization_config={"quant_method": "fp8", "dtype": "float8"})
    quantized_shard(src / "original" / "fp8.safetensors", rng)
    (src / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    with pytest.warns(stcast.StcastWarning, match="quantized"):
        report = stcast.convert(src, tmp_path / "o", allow_quantized=True)
    assert report.complete
    out_cfg = json.loads((tmp_path / "o/config.json").read_text())
    assert out_cfg["quantization_config"] == cfg["quantization_config"]
    assert out_cfg["torch_dtype"] == "bfloat16"
    fp8 = safetensors.deserialize((tmp_path / "o/original/fp8.safetensors").read_bytes())
    assert {name: t["dtype"] for name, t in fp8} == {
        "w": "F8_E4M3",
        "w_scale": "BF16",
        "norm": "BF16",
    }


def test_file_only_options(tmp_path, rng):
    path = tmp_path / "x.safetensors"
    save(path, layer(rng, 0))
    with pytest.raises(stcast.StcastError, match="applies to folders"):
        stcast.convert(path, resume=True)
    with pytest.raises(stcast.StcastError, match="applies to folders"):
        stcast.convert(path, shard=(1, 2))


@pytest.mark.parametrize(
    "file, text, match",
    [
        ("config.json", '{"torch_dtype": "float32",}', "not valid JSON"),
        ("config.json", b"\xff\xfe{}", "not valid JSON"),
        ("config.json", '{"a":' * 150 + "1" + "}" * 150, "nested deeper than 100"),
        ("model.safetensors.index.json", '{"metadata": {}}', "no weight_map object"),
        ("model.safetensors.index.json", '{"metadata": 3, "weight_map": {}}', "not an object"),
    ],
)
def test_bad_json_is_refused(tmp_path, rng, file, text, match):
    src = make_hf_model(tmp_path / "m", rng)
    path = src / file
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    assert_refused_cleanly(tmp_path, src, tmp_path / "o", match, "invalid_input")
