"""FP8 targets decide what each weight becomes before anything is planned (issue 30, points 3
and 4): a weight holding NaN or inf stays BF16, and every plan knows it before it is cut or
claimed. Re-sharded runs then write shards that hold what their index says, each within the
size; `inspect` shows the weights that stay BF16; a run killed between publishing a file
and recording it resumes (the manifest claims the header written).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import stcast
from conftest import tensor_bytes, tree, write_safetensors
from helpers import run_cli, stopped

NAN = "model.layers.0.self_attn.q_proj.weight"
INF = "model.layers.0.mlp.down_proj.weight"
FINITE = "model.layers.0.mlp.up_proj.weight"


def model(rng, nonfinite: bool = True) -> dict:
    """A small Llama-ish set of F32 tensors; `NAN` holds a NaN and `INF` an inf."""
    shapes = {
        "model.embed_tokens.weight": (32, 16),
        "model.layers.0.input_layernorm.weight": (16,),
        NAN: (16, 16),
        "model.layers.0.self_attn.k_proj.weight": (8, 16),
        INF: (16, 24),
        FINITE: (24, 16),
        "model.norm.weight": (16,),
        "lm_head.weight": (32, 16),
    }
    t = {n: ("F32", list(s), rng.standard_normal(s).astype("f4")) for n, s in shapes.items()}
    if nonfinite:
        t[NAN][2].flat[3] = np.nan
        t[INF][2].flat[5] = -np.inf
    return t


def folder_of(tmp_path: Path, tensors: dict, name: str = "src") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors, metadata={"format": "pt"})
    (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    return folder


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


def layouts(dst: Path) -> dict[str, dict[str, tuple[str, list[int], str]]]:
    """Each output file's tensors: name -> (dtype, shape, sha256 of the bytes)."""
    out = {}
    for p in sorted(dst.glob("*.safetensors")):
        out[p.name] = {
            n: (d, s, hashlib.sha256(b).hexdigest()) for n, (d, s, b) in tensor_bytes(p).items()
        }
    return out


def check_shards(dst: Path, limit: int, plain: Path) -> None:
    """Every shard within `limit`, the index listing what each holds (scales included), the
    tensors those of a conversion without re-sharding, NaN/inf weights in BF16 unscaled."""
    shards = layouts(dst)
    assert len(shards) > 1, shards
    for name in shards:
        assert (dst / name).stat().st_size <= limit, (name, (dst / name).stat().st_size)
    where = {t: n for n, layout in shards.items() for t in layout}
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == where
    merged = {t: v for layout in shards.values() for t, v in layout.items()}
    assert merged == layouts(plain.parent)[plain.name]
    for name in (NAN, INF):
        assert merged[name][0] == "BF16" and name + "_scale" not in merged
    assert merged[FINITE][0] == "F8_E4M3" and FINITE + "_scale" in merged


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
@pytest.mark.parametrize("whole", [False, True], ids=["folder", "file"])
def test_reshard_with_nonfinite_weights_holds_what_its_index_says(
    tmp_path, rng, to, whole, run_main
):
    """Several shards: the weights holding NaN or inf are BF16 in the plan the shards are
    cut from (twice their FP8 size, no scale), so each shard holds what the index lists and
    stays within the size. (Before: exit 1, "the index lists `...weight_scale` there, but
    the file written does not hold it", a manifest and shards left in DST.)"""
    tensors = model(rng)
    folder = folder_of(tmp_path, tensors)
    src = folder / "model.safetensors" if whole else folder
    plain = tmp_path / "plain" / "model.safetensors"
    plain.parent.mkdir()
    quiet(stcast.convert, folder / "model.safetensors", plain, to=to)
    dst = tmp_path / "dst"
    rc, _, err = run_main("convert", src, dst, "--to", to, "--max-shard-size", "1800B")
    assert rc == 0, err
    check_shards(dst, 1800, plain)
    got = {n: v for p in dst.glob("*.safetensors") for n, v in tensor_bytes(p).items()}
    assert got[NAN][2] == tensors[NAN][2].astype(ml_dtypes.bfloat16).tobytes()
    # (--to: without it, verify takes the target of the first shard, here all BF16.)
    rc, _, err = run_main("verify", src, dst, "--to", to)
    assert rc == 0, err
    # Done: no manifest is left, and a resume finds everything in place.
    assert not (dst / ".stcast-manifest.json").exists()


def test_reshard_with_nonfinite_weights_stays_within_one_shard_size(tmp_path, rng, run_main):
    """A limit that the all-FP8 file just fits: the BF16 weights make it larger, so the plan
    cuts several shards, each within the limit. (Before: exit 0 with one shard over it.)"""
    tensors = model(rng)
    folder = folder_of(tmp_path, tensors)
    clean = tmp_path / "clean.safetensors"
    quiet(stcast.convert, write_safetensors(tmp_path / "c.safetensors", model(rng, False)), clean)
    limit = quiet(stcast.inspect, tmp_path / "c.safetensors", to="fp8").output_bytes
    plain = tmp_path / "plain" / "model.safetensors"
    plain.parent.mkdir()
    quiet(stcast.convert, folder / "model.safetensors", plain, to="fp8")
    assert plain.stat().st_size > limit
    dst = tmp_path / "dst"
    rc, _, err = run_main("convert", folder, dst, "--to", "fp8", "--max-shard-size", f"{limit}B")
    assert rc == 0, err
    check_shards(dst, limit, plain)
    rc, _, err = run_main("verify", folder, dst, "--to", "fp8")
    assert rc == 0, err


@pytest.mark.parametrize("shard_size", [None, "1800B"], ids=["plain", "resharded"])
def test_inspect_to_fp8_reads_the_weights_it_plans(tmp_path, rng, run_main, shard_size):
    """`inspect --to fp8` plans as convert does: it reads the weights it would quantize, so
    those holding NaN or inf are BF16 in its plan (reason `nonfinite`), its output header is
    the one convert writes, and a shard plan has the sizes of the shards written."""
    tensors = model(rng)
    folder = folder_of(tmp_path, tensors)
    f = folder / "model.safetensors"
    extra = [] if shard_size is None else ["--max-shard-size", shard_size]
    rc, out, err = run_main("inspect", f, "--to", "fp8", "--json", *extra)
    assert rc == 0, err
    result = json.loads(out)["result"]
    dst = tmp_path / "out"
    if shard_size is None:
        rows = {t["name"]: t for t in result["tensors"]}
        for name in (NAN, INF):
            assert rows[name]["target_dtype"] == "BF16", rows[name]
            assert rows[name]["not_quantized"] == "nonfinite", rows[name]
        assert rows[FINITE]["target_dtype"] == "F8_E4M3"
        quiet(stcast.convert, f, dst, to="fp8")
        n = int.from_bytes(dst.read_bytes()[:8], "little")
        header = dst.read_bytes()[: 8 + n]
        assert result["output_header_sha256"] == hashlib.sha256(header).hexdigest()
        assert result["output_bytes"] == dst.stat().st_size
    else:
        quiet(stcast.convert, f, dst, to="fp8", max_shard_size=shard_size)
        sizes = {s["path"]: s["bytes"] for s in result["shards"]}
        assert sizes == {p.name: p.stat().st_size for p in dst.glob("*.safetensors")}


@pytest.mark.parametrize("reshard", [False, True], ids=["plain", "resharded"])
def test_sigkill_after_publishing_a_nonfinite_weight_then_resume(tmp_path, rng, reshard):
    """Killed once an output holding a BF16 weight (NaN in it) is published but not yet
    recorded (`folder-published`): the manifest claimed the header written, so `--resume`
    proves the file its own and ends with exactly a fresh conversion. (Before: the claim
    named the all-FP8 header planned; resume refused "no stcast manifest says it wrote
    them"; re-sharded, the run failed as in the tests above.)"""
    tensors = model(rng)
    folder = tmp_path / "src"
    folder.mkdir()
    names = [NAN, *(n for n in tensors if n != NAN)]  # in the first output, either way
    parts = {n: tensors[n] for n in names[:4]}, {n: tensors[n] for n in names[4:]}
    weight_map = {}
    for k, part in enumerate(parts):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        write_safetensors(folder / shard, part, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    extra = ["--max-shard-size", "1800B"] if reshard else []
    dst = tmp_path / "out"
    args = ("convert", folder, dst, "--to", "fp8", "-q", *extra)
    run = stopped(*args, at="folder-published")
    first = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(first) == 1 and NAN in tensor_bytes(dst / first[0]), first
    assert tensor_bytes(dst / first[0])[NAN][0] == "BF16"
    run.kill()
    # The claim names the header of the file published, read back from what was written.
    raw = (dst / first[0]).read_bytes()
    written = hashlib.sha256(raw[: 8 + int.from_bytes(raw[:8], "little")]).hexdigest()
    claims = json.loads((dst / ".stcast-manifest.json").read_text())["pending"][first[0]]
    assert [c["output_header_sha256"] for c in claims] == [written]
    rc, _, err = run_cli(*args, "--resume")
    assert rc == 0, err
    fresh = tmp_path / "fresh"
    kw = {"max_shard_size": "1800B"} if reshard else {}
    quiet(stcast.convert, folder, fresh, to="fp8", **kw)
    assert tree(dst) == tree(fresh)
    rc, _, err = run_cli("verify", folder, dst, "--to", "fp8", "-q")
    assert rc == 0, err
    assert os.path.exists(dst / "config.json")


def test_reshard_a_dcp_checkpoint_with_a_nonfinite_weight(tmp_path, rng, run_main):
    """A DCP folder (rank files, chunks of rows) re-sharded to FP8 with a NaN in one weight:
    the cut knows that weight stays BF16; every shard within the size, the index exact,
    verify passes, and the tensors are those of a conversion to one file."""
    from dcpfile import Tensor, rows, write_dcp

    tensors = model(rng)
    dcp = {n: Tensor(a, rows(a, [0, len(a) // 2]), (n,)) for n, (_, _, a) in tensors.items()}
    ck = tmp_path / "ck"
    write_dcp(ck, dcp, ranks=2)
    plain = tmp_path / "plain" / "model.safetensors"
    plain.parent.mkdir()
    quiet(stcast.convert, ck, plain, to="fp8")
    dst = tmp_path / "dst"
    rc, _, err = run_main("convert", ck, dst, "--to", "fp8", "--max-shard-size", "1800B")
    assert rc == 0, err
    check_shards(dst, 1800, plain)
    rc, _, err = run_main("verify", ck, dst, "--to", "fp8")
    assert rc == 0, err


def test_a_claim_names_the_header_written_when_the_plan_did_not_know_it(tmp_path, rng):
    """`on_overflow="keep"` finds what it keeps while converting a plain folder's file: the
    claim made once the file is sealed names the header written all the same (before: none,
    so the claim proved a file by device, inode and size alone)."""
    hot = rng.standard_normal((8, 8)).astype("f4")
    hot[0, 0] = 1e6  # beyond fp16: kept F32
    folder = tmp_path / "src"
    folder.mkdir()
    t = {"a.weight": ("F32", [8, 8], hot), "b.weight": ("F32", [8, 8], hot * 0 + 1)}
    write_safetensors(folder / "model.safetensors", t, metadata={"format": "pt"})
    dst = tmp_path / "out"
    args = ("convert", folder, dst, "--to", "fp16", "--on-overflow", "keep", "-q")
    run = stopped(*args, at="folder-published")
    run.kill()
    raw = (dst / "model.safetensors").read_bytes()
    assert tensor_bytes(dst / "model.safetensors")["a.weight"][0] == "F32"
    written = hashlib.sha256(raw[: 8 + int.from_bytes(raw[:8], "little")]).hexdigest()
    doc = json.loads((dst / ".stcast-manifest.json").read_text())
    assert [c["output_header_sha256"] for c in doc["pending"]["model.safetensors"]] == [written]
    rc, _, err = run_cli(*args, "--resume")
    assert rc == 0, err
