"""torch.distributed.checkpoint (DCP) folders: converted as one checkpoint, streaming, without
torch. The fixtures in `fixtures/dcp/` were written once by torch 2.15 (FSDP2 on 3 ranks,
HSDP 2x2, FSDP x tensor parallel 2x2: see their README); `expected-model-*.safetensors` is
what torch's own path gives (`dcp_to_torch_save`, `torch.load(...)["model"]`, `.to(bf16)`).
The generated cases (`dcpfile.py`) cover what torch would not write."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, listing, tensor_bytes
from dcpfile import Tensor, rows, write_dcp

FIXTURES = Path(__file__).parent / "fixtures" / "dcp"
REAL = ["fsdp2-1d-3ranks", "hsdp-2x2", "fsdp-tp-2x2"]


def checkpoint(name: str, tmp_path: Path) -> Path:
    """The fixture's checkpoint files alone (`.metadata`, `*.distcp`), copied."""
    src = FIXTURES / name
    dst = tmp_path / name
    dst.mkdir()
    for f in src.iterdir():
        if f.name == ".metadata" or f.name.endswith(".distcp"):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("to", ["bf16", "keep"])
def test_real_dcp_checkpoints_convert_as_torch_consolidates_them(tmp_path, name, to):
    ck = checkpoint(name, tmp_path)
    out = tmp_path / "out.safetensors"
    stcast.convert(ck, out, key="model", to=to)
    want = tensor_bytes(
        FIXTURES / name / f"expected-model-{'bf16' if to == 'bf16' else 'fp32'}.safetensors"
    )
    got = tensor_bytes(out)
    assert set(got) == set(want)
    for k in want:
        assert got[k] == want[k], k
    assert stcast.verify(ck, out, key="model", to=None if to == "bf16" else to).ok


def test_the_cli_default_destination_is_a_hugging_face_folder(tmp_path, run_main):
    ck = checkpoint("fsdp2-1d-3ranks", tmp_path)
    rc, out, err = run_main("convert", ck, "--key", "model")
    assert rc == 0, err
    dst = tmp_path / "fsdp2-1d-3ranks-bf16" / "model.safetensors"
    assert tensor_bytes(dst) == tensor_bytes(
        FIXTURES / "fsdp2-1d-3ranks" / "expected-model-bf16.safetensors"
    )
    rc, out, err = run_main("verify", ck, tmp_path / "fsdp2-1d-3ranks-bf16", "--key", "model")
    assert rc == 0, err
    # A DST folder named: the file goes inside it.
    rc, out, err = run_main("convert", ck, tmp_path / "hf", "--key", "model")
    assert rc == 0, err
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_several_dicts_without_a_key_are_refused_listing_them(tmp_path, run_main):
    ck = checkpoint("fsdp2-1d-3ranks", tmp_path)
    before = listing(tmp_path)
    rc, out, err = run_main("convert", ck, tmp_path / "o.safetensors")
    line = assert_one_error_line(err)
    assert rc == 1 and "`model` (10 tensors)" in line and "`optim`" in line, line
    assert listing(tmp_path) == before


def test_inspect_lists_the_tensors(tmp_path, run_main):
    ck = checkpoint("fsdp-tp-2x2", tmp_path)
    rc, out, err = run_main("inspect", ck)
    assert rc == 0, err
    assert "fc2.weight" in out and "[5, 7]" in out
    # What is read, and what is left unread (the optimizer states, had it any).
    assert re.search(
        r"\nfolder: .* in its files; reads .* of tensor data, leaves .* unread", out
    ), out


def test_strip_prefix_and_nested_keys(tmp_path, rng):
    w = rng.standard_normal((5, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    ck = tmp_path / "ck"
    write_dcp(
        ck,
        {
            "app.model.module.w": Tensor(w, rows(w, [0, 2, 4]), ("app", "model", "module.w")),
            "app.model.module.b": Tensor(b, rows(b, [0, 3]), ("app", "model", "module.b")),
        },
        ranks=3,
    )
    out = tmp_path / "o.safetensors"
    stcast.convert(ck, out, to="keep", strip_prefix=["module."])
    got = tensor_bytes(out)
    assert got["w"] == ("F32", [5, 3], w.tobytes()) and got["b"] == ("F32", [4], b.tobytes())
    stcast.convert(ck, out, to="keep", key="app.model", force=True)
    assert set(tensor_bytes(out)) == {"module.w", "module.b"}


def test_tiles_in_any_order_and_an_empty_chunk(tmp_path, rng):
    w = rng.standard_normal((5, 7)).astype(np.float32)
    tiles = [
        ((3, 4), (2, 3)),
        ((0, 0), (3, 4)),
        ((3, 0), (2, 4)),
        ((0, 4), (3, 3)),
        ((5, 0), (0, 7)),
    ]
    ck = tmp_path / "ck"
    write_dcp(ck, {"w": Tensor(w, tiles, ("w",))}, ranks=4)
    out = tmp_path / "o.safetensors"
    stcast.convert(ck, out, to="keep")
    assert tensor_bytes(out)["w"] == ("F32", [5, 7], w.tobytes())


def hostile(tmp_path: Path, **kwargs) -> Path:
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    ck = tmp_path / "ck"
    tensors = kwargs.pop("tensors", {"w": Tensor(w, rows(w, [0, 2]), ("w",))})
    write_dcp(ck, tensors, **kwargs)
    return ck


def refused(run_main, tmp_path: Path, ck: Path, *words: str) -> str:
    before = listing(tmp_path)
    rc, out, err = run_main("convert", ck, tmp_path / "o.safetensors")
    line = assert_one_error_line(err)
    assert rc == 1, err
    for w in words:
        assert w in line, line
    assert listing(tmp_path) == before
    return line


def test_overlapping_chunks_and_gaps_are_refused_naming_the_tensor(tmp_path, run_main):
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    ck = hostile(tmp_path, tensors={"w": Tensor(w, [((0, 0), (3, 3)), ((2, 0), (2, 3))], ("w",))})
    refused(run_main, tmp_path, ck, "`w`")
    shutil.rmtree(ck)
    ck = hostile(tmp_path, tensors={"w": Tensor(w, [((0, 0), (1, 3)), ((2, 0), (2, 3))], ("w",))})
    refused(run_main, tmp_path, ck, "`w`")
    shutil.rmtree(ck)
    ck = hostile(tmp_path, tensors={"w": Tensor(w, [((0, 0), (2, 3)), ((2, 0), (3, 3))], ("w",))})
    refused(run_main, tmp_path, ck, "`w`")


def test_an_item_past_its_file_or_outside_the_folder_is_refused(tmp_path, run_main):
    def past(fqn, i, info):
        return {**info, "offset": info["offset"] + 10_000}

    ck = hostile(tmp_path, storage_info=past)
    refused(run_main, tmp_path, ck, "`w`", "past the file")
    shutil.rmtree(ck)

    def escape(fqn, i, info):
        return {**info, "relative_path": "../secret.distcp"}

    ck = hostile(tmp_path, storage_info=escape)
    refused(run_main, tmp_path, ck, "`w`", "not a file name inside")


def test_an_item_that_is_not_its_chunk_is_refused(tmp_path, run_main):
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    lie = Tensor(w, rows(w, [0, 2]), ("w",), lie={1: np.zeros((2, 2), np.float32)})
    ck = hostile(tmp_path, tensors={"w": lie})
    refused(run_main, tmp_path, ck, "`w`", "shape")
    shutil.rmtree(ck)
    lie = Tensor(w, rows(w, [0, 2]), ("w",), lie={1: np.zeros((2, 3), np.float64)})
    ck = hostile(tmp_path, tensors={"w": lie})
    refused(run_main, tmp_path, ck, "`w`")


def test_transformed_items_are_refused(tmp_path, run_main):
    def zstd(fqn, i, info):
        return {**info, "transform_descriptors": ["zstd"]}

    ck = hostile(tmp_path, storage_info=zstd)
    refused(run_main, tmp_path, ck, "`w`", "zstd")


def test_a_metadata_that_calls_a_dangerous_global_is_refused(tmp_path, run_main):
    import torchfile as tf

    canary = tmp_path / "canary"

    def evil(state):
        return tf.Call(tf.Global("os", "system"), (f"touch {canary}",))

    ck = hostile(tmp_path, metadata=evil)
    refused(run_main, tmp_path, ck, ".metadata", "os.system")
    assert not canary.exists()


def test_bytes_items_are_skipped_unread(tmp_path, rng):
    w = rng.standard_normal((3, 2)).astype(np.float32)
    ck = tmp_path / "ck"
    write_dcp(
        ck,
        {"model.w": Tensor(w, rows(w, [0, 1]), ("model", "w"))},
        bytes_items=[("model.step", ("model", "step"))],
    )
    out = tmp_path / "o.safetensors"
    with pytest.warns(stcast.StcastWarning, match="step"):
        stcast.convert(ck, out)
    assert list(tensor_bytes(out)) == ["w"]


def test_the_default_destination_is_beside_the_checkpoint(tmp_path):
    ck = checkpoint("hsdp-2x2", tmp_path)
    before = sorted(os.listdir(ck))
    stcast.convert(ck)
    assert (tmp_path / "hsdp-2x2-bf16" / "model.safetensors").is_file()
    assert sorted(os.listdir(ck)) == before


@pytest.mark.parametrize("to", ["bf16", "keep"])
def test_huggingface_storage_writer_shards_are_gathered(tmp_path, to):
    """A distributed save of DCP's HuggingFaceStorageWriter: one safetensors file per rank,
    its chunks placed by `DCP_SHARDING_INFO`, no `.metadata`. Read as a plain Hugging Face
    folder it would be two half checkpoints; it is one, sized where its chunks end."""
    ck = tmp_path / "hf"
    ck.mkdir()
    for f in (FIXTURES / "hf-variant").glob("shard-*.safetensors"):
        shutil.copy(f, ck / f.name)
    out = tmp_path / "o.safetensors"
    stcast.convert(ck, out, to=to)
    want = (
        FIXTURES / "hf-variant" / f"expected-model-{'bf16' if to == 'bf16' else 'fp32'}.safetensors"
    )
    assert tensor_bytes(out) == tensor_bytes(want)
    assert stcast.verify(ck, out).ok
    _, items, _ = __import__("conftest").read_safetensors(out)
    meta = dict(dict(items).get("__metadata__", []))
    assert "DCP_SHARDING_INFO" not in meta and meta.get("format") == "pt"


def test_optimizer_items_are_never_read(tmp_path, rng):
    """`--key model` touches the model's items only: the optimizer's, beside them in the
    same rank files, are garbage here and the conversion is still exact."""
    w = rng.standard_normal((8, 3)).astype(np.float32)
    garbage = {0: np.zeros(1, np.int8), 1: np.zeros(1, np.int8)}
    ck = tmp_path / "ck"
    write_dcp(
        ck,
        {
            "model.w": Tensor(w, rows(w, [0, 4]), ("model", "w")),
            "optim.state.w.exp_avg": Tensor(
                w, rows(w, [0, 4]), ("optim", "state", "w", "exp_avg"), lie=garbage
            ),
        },
    )
    out = tmp_path / "o.safetensors"
    stcast.convert(ck, out, key="model", to="keep")
    assert tensor_bytes(out)["w"] == ("F32", [8, 3], w.tobytes())
    with pytest.raises(stcast.InvalidInput, match="exp_avg"):
        stcast.convert(ck, out, key="optim", force=True)


def test_peak_rss_is_bounded_for_a_dcp_folder(tmp_path):
    """A DCP folder converts in the same bounded memory as a file, whatever its size: each
    window gathers from the ranks' items in place (and their pages are released)."""
    from test_memory import MIB, peak_rss_of_convert

    peaks = {}
    for size_mib in (32, 160):
        n = size_mib * MIB // 4 // 1024
        w = np.linspace(-3, 3, n * 1024, dtype=np.float32).reshape(n, 1024)
        ck = tmp_path / f"ck{size_mib}"
        cuts = [0, n // 4 + 3, n // 2, 3 * n // 4 - 5]
        write_dcp(ck, {"w": Tensor(w, rows(w, cuts), ("w",))}, ranks=4)
        del w
        dst = tmp_path / f"out{size_mib}.safetensors"
        peaks[size_mib] = peak_rss_of_convert(ck, dst)
        assert dst.stat().st_size < size_mib * MIB // 2 + 4096
        shutil.rmtree(ck)
        dst.unlink()
    print({k: f"{v / MIB:.1f} MiB" for k, v in peaks.items()})
    for size_mib, peak in peaks.items():
        assert peak < 150 * MIB, f"{size_mib} MiB input: peak RSS {peak / MIB:.1f} MiB"
    assert peaks[160] <= 1.25 * peaks[32] + 16 * MIB, peaks


def test_resharded_shard_runs_finalize_and_resume(tmp_path, run_main, cli_process):
    """`--max-shard-size`, `--shard I/N` + `finalize` (a SLURM array), `--resume`: as for a
    file. The shards hold exactly the tensors of the one-file conversion. (finalize reads
    the source with the shard runs' --key: it once read it without.)"""
    ck = checkpoint("fsdp2-1d-3ranks", tmp_path)
    one = tmp_path / "one.safetensors"
    stcast.convert(ck, one, key="model")
    want = tensor_bytes(one)

    def shards(folder: Path) -> dict:
        got: dict = {}
        for f in sorted(folder.glob("model-*.safetensors")):
            got.update(tensor_bytes(f))
        return got

    rc, out, err = run_main(
        "convert", ck, tmp_path / "rs", "--key", "model", "--max-shard-size", "300B"
    )
    assert rc == 0, err
    assert (tmp_path / "rs" / "model.safetensors.index.json").is_file()
    assert shards(tmp_path / "rs") == want
    rc, out, err = run_main("verify", ck, tmp_path / "rs", "--key", "model")
    assert rc == 0, err
    for i in (1, 2):
        rc, out, err = run_main(
            "convert",
            ck,
            tmp_path / "sh",
            "--key",
            "model",
            "--max-shard-size",
            "300B",
            "--shard",
            f"{i}/2",
        )
        assert rc == 0, err
    rc, out, err = run_main("finalize", ck, tmp_path / "sh")
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path / "sh")) == sorted(os.listdir(tmp_path / "rs"))
    assert shards(tmp_path / "sh") == want
    # Stopped after the first shard, then resumed.
    env = {"STCAST_FAILPOINT": "folder-file=sigint"}
    rc, out, err = cli_process(
        "convert", ck, tmp_path / "re", "--key", "model", "--max-shard-size", "300B", env=env
    )
    assert rc != 0 and (tmp_path / "re" / ".stcast-manifest.json").is_file(), err
    rc, out, err = run_main(
        "convert", ck, tmp_path / "re", "--key", "model", "--max-shard-size", "300B", "--resume"
    )
    assert rc == 0, err
    assert shards(tmp_path / "re") == want
    assert sorted(os.listdir(tmp_path / "re")) == sorted(os.listdir(tmp_path / "rs"))


def test_a_destination_that_is_a_checkpoint_file_is_refused(tmp_path, run_main):
    """The rank files and `.metadata` are the input: a DST that is one of them (here a hard
    link named like an output) is refused, with `--force` too, and nothing changes."""
    ck = checkpoint("hsdp-2x2", tmp_path)
    for name in (".metadata", "__1_0.distcp"):
        link = tmp_path / f"link-{name.strip('.')}.safetensors"
        os.link(ck / name, link)
        before = (ck / name).read_bytes()
        rc, out, err = run_main("convert", ck, link, "--key", "model", "--force")
        line = assert_one_error_line(err)
        assert rc == 1 and "destination is the input" in line, line
        assert (ck / name).read_bytes() == before


def test_a_transposed_tensor_saved_whole_is_gathered(tmp_path, rng, run_main):
    """`dcp.save` of `w.t()` (a view over its whole storage: DCP clones only views of a
    larger storage) writes the item with its strides; torch reads it, and so does stcast.
    Strided chunks of a sharded tensor are refused, naming the tensor."""
    w = rng.standard_normal((6, 8)).astype(np.float32)
    ck = tmp_path / "ck"
    write_dcp(ck, {"w": Tensor(w, [((0, 0), (6, 8))], ("w",), transposed=True)}, ranks=1)
    out = tmp_path / "o.safetensors"
    stcast.convert(ck, out, to="keep")
    assert tensor_bytes(out)["w"] == ("F32", [6, 8], w.tobytes())
    assert stcast.verify(ck, out, to="keep").ok
    shutil.rmtree(ck)
    write_dcp(ck, {"w": Tensor(w, rows(w, [0, 3]), ("w",), transposed=True)}, ranks=2)
    refused(run_main, tmp_path, ck, "`w`", "strided")


def test_review_findings_dst_inside_messages_and_dot(tmp_path, run_main, monkeypatch):
    """From the adversarial review: a DST inside the checkpoint folder is refused (it would
    become part of it); a safetensors file beside HuggingFaceStorageWriter's shards is named,
    not taken for a Hugging Face folder; rank files without `.metadata` are an incomplete
    checkpoint; --shard without --max-shard-size says what it needs; `convert .` writes
    beside the folder."""
    ck = checkpoint("hsdp-2x2", tmp_path)
    for dst in (ck / "out.safetensors", ck / "sub" / "hf"):
        rc, out, err = run_main("convert", ck, dst, "--key", "model")
        line = assert_one_error_line(err)
        assert rc == 1 and "inside the checkpoint folder" in line, line
        assert not dst.exists()
    rc, out, err = run_main("convert", ck, ck / "rs", "--key", "model", "--max-shard-size", "300B")
    assert rc == 1 and "inside the checkpoint folder" in assert_one_error_line(err)
    rc, out, err = run_main(
        "convert", ck, tmp_path / "x.safetensors", "--key", "model", "--shard", "1/2"
    )
    line = assert_one_error_line(err)
    assert rc == 2 and "--max-shard-size" in line and "one checkpoint" in line, line

    hf = tmp_path / "hf"
    hf.mkdir()
    for f in (FIXTURES / "hf-variant").glob("shard-*.safetensors"):
        shutil.copy(f, hf / f.name)
    shutil.copy(FIXTURES / "hf-variant" / "expected-model-fp32.safetensors", hf / "a.safetensors")
    before = listing(tmp_path)
    rc, out, err = run_main("convert", hf, tmp_path / "o")
    line = assert_one_error_line(err)
    assert rc == 1 and "a.safetensors" in line and "HuggingFaceStorageWriter" in line, line
    assert listing(tmp_path) == before

    (ck / ".metadata").unlink()
    rc, out, err = run_main("convert", ck, tmp_path / "o.safetensors", "--key", "model")
    line = assert_one_error_line(err)
    assert rc == 1 and "no .metadata" in line, line

    ck2 = checkpoint("fsdp-tp-2x2", tmp_path)
    monkeypatch.chdir(ck2)
    rc, out, err = run_main("convert", ".", "--key", "model")
    assert rc == 0, err
    assert (tmp_path / "fsdp-tp-2x2-bf16" / "model.safetensors").is_file()
    assert not any(n.endswith("-bf16") for n in os.listdir(ck2))


def test_a_rank_file_or_a_key_for_hf_shards_says_what_it_is(tmp_path, run_main):
    """Issue 30, finding 11: a `.distcp` file as SRC got the zip reader's wording; it is one
    rank's file of a DCP folder, and the line says to convert the folder. `--key` on a
    folder of HuggingFaceStorageWriter shards said "this is a safetensors file"; it names
    what the folder is."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "fsdp2-1d-3ranks", ck)
    for cmd in ("convert", "inspect"):
        args = [tmp_path / "o.safetensors"] if cmd == "convert" else []
        rc, _, err = run_main(cmd, ck / "__0_0.distcp", *args)
        line = assert_one_error_line(err)
        assert rc == 1 and "a rank file of a torch.distributed.checkpoint" in line, line
        assert f"convert the checkpoint folder `{ck}`" in line and "zip" not in line, line
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in (FIXTURES / "hf-variant").glob("shard-*.safetensors"):
        shutil.copy(f, hf / f.name)
    rc, _, err = run_main("convert", hf, tmp_path / "o.safetensors", "--key", "model")
    line = assert_one_error_line(err)
    assert rc == 2 and "HuggingFaceStorageWriter" in line, line
    assert "this is a safetensors file" not in line, line
    assert not (tmp_path / "o.safetensors").exists()


def test_verify_of_a_resharded_output_names_the_dcp_folder_not_model_safetensors(
    tmp_path, rng, run_main
):
    """A DCP folder re-sharded: its output's files are `model-*` (or `model.safetensors`),
    names SRC does not have. A verify failure names SRC as it is, the DCP folder."""
    w = rng.standard_normal((6, 4)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    ck = tmp_path / "ck"
    write_dcp(ck, {"w": Tensor(w, rows(w, [0, 3]), ("w",)), "b": Tensor(b, rows(b, [0]), ("b",))})
    out = tmp_path / "rs"
    stcast.convert(ck, out, max_shard_size="40B")
    index = out / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    shards = sorted(set(doc["weight_map"].values()))
    assert len(shards) == 2 and stcast.verify(ck, out).ok
    # A shard gone, and the index with it: its tensors are in no DST file.
    gone = tmp_path / "gone"
    shutil.copytree(out, gone)
    (gone / shards[1]).unlink()
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if v != shards[1]}
    (gone / index.name).write_text(json.dumps(doc))
    rc, _, err = run_main("verify", ck, gone)
    line = assert_one_error_line(err)
    assert rc == 1 and f"of SRC ({ck})" in line and "(model.safetensors)" not in line, line
    # The output left whole out: named as the output of the DCP folder.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "x.safetensors").write_bytes((out / shards[0]).read_bytes())
    rc, _, err = run_main("verify", ck, bare)
    line = assert_one_error_line(err)
    assert rc == 1 and f"model.safetensors: is the output of {ck} but not in DST" in line, line
