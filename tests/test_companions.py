"""A folder's companion policy overridden: `--include GLOB` copies what is left out as
training state (a folder of it whole), `--exclude GLOB` leaves out what would be copied or
rewritten (never weights or indexes); `inspect` names every copy and every left-out file
with its size; the output records the globs, so that `verify SRC DST` needs none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import write_safetensors

pytestmark = pytest.mark.filterwarnings("ignore::stcast.StcastWarning")


def make_folder(root: Path) -> Path:
    """An accelerate-like checkpoint: HF weights, a config, a tokenizer, pictures, and
    training state (files, and DeepSpeed's tag folder)."""
    root.mkdir()
    write_safetensors(
        root / "model.safetensors",
        {"w": ("F32", [4], np.float32([1, 2, 3, 4])), "i": ("I64", [1], np.int64([7]))},
    )
    (root / "config.json").write_text('{"torch_dtype": "float32"}\n')
    (root / "tokenizer.json").write_text("{}\n")
    (root / "README.md").write_text("# model\n")
    (root / "images").mkdir()
    (root / "images" / "a.png").write_bytes(b"png" * 10)
    (root / "optimizer.bin").write_bytes(b"o" * 100)
    (root / "scheduler.bin").write_bytes(b"s" * 7)
    (root / "latest").write_text("global_step5")
    (root / "global_step5").mkdir()
    (root / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"m" * 30)
    return root


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_include_and_exclude_decide_the_copies_and_verify_reads_them_back(tmp_path, run_main):
    src = make_folder(tmp_path / "ckpt")
    dst = tmp_path / "out"
    rc, _, err = run_main(
        "convert",
        src,
        dst,
        "--include",
        "optimizer.bin",
        "--include",
        "global_step*",
        "--exclude",
        "images",
        "--exclude",
        "*.md",
    )
    assert rc == 0, err
    assert files(dst) == [
        "config.json",
        "global_step5/mp_rank_00_model_states.pt",
        "model.safetensors",
        "optimizer.bin",
        "tokenizer.json",
    ]
    assert (dst / "optimizer.bin").read_bytes() == b"o" * 100
    # One note per reason, each file named with its size.
    assert "left out by --exclude: `README.md` (8 B), `images/a.png` (30 B)" in err
    assert "`latest` (12 B), `scheduler.bin` (7 B)" in err
    meta = stcast.inspect(dst / "model.safetensors").metadata
    assert meta is not None
    record = json.loads(meta["stcast"])
    assert record["include"] == ["optimizer.bin", "global_step*"]
    assert record["exclude"] == ["images", "*.md"]
    # verify reads the globs from the record; given others, it holds DST to them.
    assert stcast.verify(src, dst).ok
    assert run_main("verify", src, dst)[0] == 0
    other = stcast.verify(src, dst, exclude=["*.md"])
    assert not other.ok
    assert other.mismatch is not None and "images/a.png" in other.mismatch.message.render("api")
    # A copy that is not SRC's bytes fails.
    (dst / "optimizer.bin").write_bytes(b"x" * 100)
    assert not stcast.verify(src, dst).ok


def test_without_a_record_verify_needs_the_globs(tmp_path):
    src = make_folder(tmp_path / "ckpt")
    dst = tmp_path / "out"
    stcast.convert(src, dst, include=["optimizer.bin"], no_record=True)
    assert (dst / "optimizer.bin").exists()
    assert not stcast.verify(src, dst).ok
    assert stcast.verify(src, dst, include=["optimizer.bin"]).ok


def test_inspect_lists_copies_and_left_outs_by_name_with_sizes(tmp_path, run_main):
    src = make_folder(tmp_path / "ckpt")
    report = stcast.inspect(src, exclude=["images"])
    assert report.other_files == [
        {"path": "README.md", "bytes": 8, "action": "copied"},
        {"path": "config.json", "bytes": 27, "action": "rewritten"},
        {"path": "tokenizer.json", "bytes": 3, "action": "copied"},
    ]
    assert report.left_out == [
        {"path": "global_step5/", "bytes": 30, "why": "trainer"},
        {"path": "images/a.png", "bytes": 30, "why": "excluded"},
        {"path": "latest", "bytes": 12, "why": "trainer"},
        {"path": "optimizer.bin", "bytes": 100, "why": "trainer"},
        {"path": "scheduler.bin", "bytes": 7, "why": "trainer"},
    ]
    # The dry run with DST plans the same.
    planned = stcast.inspect(src, tmp_path / "out", exclude=["images"])
    assert planned.left_out == report.left_out
    assert [f["path"] for f in planned.other_files] == [f["path"] for f in report.other_files]
    rc, out, err = run_main("inspect", src, "--exclude", "images")
    assert rc == 0, err
    assert "other files:" in out
    assert "optimizer.bin" in out and "training state (--include copies it)" in out
    assert "images/a.png" in out and "--exclude" in out
    rc, out, err = run_main("inspect", src, "--json")
    assert rc == 0, err
    result = json.loads(out)["result"]
    assert {"path": "optimizer.bin", "bytes": 100, "why": "trainer"} in result["left_out"]
    assert {"path": "tokenizer.json", "bytes": 3, "action": "copied"} in result["other_files"]


def test_an_excluded_link_or_special_file_is_left_out_unread(tmp_path, run_main):
    """A broken link, a link to a file outside the folder and a FIFO are refused by the walk,
    but one an `exclude` glob names is left out unread, as any excluded file (before, the
    walk refused it before exclusion applied)."""
    import os

    src = make_folder(tmp_path / "ckpt")
    (src / "notes.txt").symlink_to(tmp_path / "missing")
    (src / "logs").mkdir()
    os.mkfifo(src / "logs" / "pipe")
    (tmp_path / "outside.txt").write_text("not the checkpoint's\n")
    (src / "outside.json").symlink_to(tmp_path / "outside.txt")
    for name in ("notes.txt", "logs/pipe", "outside.json"):
        others = [g for g in ("notes.txt", "logs", "outside.json") if not name.startswith(g)]
        args = [a for g in others for a in ("--exclude", g)]
        rc, _, err = run_main("convert", src, tmp_path / "refused", *args)
        assert rc == 1 and name.split("/")[0] in err, err
        assert not (tmp_path / "refused").exists()
    args = ["--exclude", "notes.txt", "--exclude", "logs", "--exclude", "outside.json"]
    rc, _, err = run_main("convert", src, tmp_path / "out", *args, "-q")
    assert rc == 0, err
    left = {f["path"]: f["why"] for f in stcast.inspect(src, exclude=args[1::2]).left_out}
    assert {k: left[k] for k in ("notes.txt", "logs/pipe", "outside.json")} == {
        "notes.txt": "excluded",
        "logs/pipe": "excluded",
        "outside.json": "excluded",
    }
    assert not (tmp_path / "out" / "notes.txt").exists()
    assert run_main("verify", src, tmp_path / "out")[0] == 0


def test_a_linked_folder_is_never_left_out_unread(tmp_path, run_main):
    """A link to a folder is walked as a folder (with `--follow-links`) or refused, even
    when an `exclude` glob names it: what it holds may be weights, which no glob leaves out
    (attack F1 of this stop: its weights were dropped and verify passed)."""
    src = make_folder(tmp_path / "ckpt")
    outside = tmp_path / "ema"
    outside.mkdir()
    write_safetensors(outside / "model.safetensors", {"w": ("F32", [2], np.float32([1, 2]))})
    (src / "ema").symlink_to(outside)
    real = make_folder(tmp_path / "real")
    (real / "ema").mkdir()
    write_safetensors(real / "ema" / "model.safetensors", {"w": ("F32", [2], np.float32([1, 2]))})
    for folder, extra in ((src, ["--follow-links"]), (real, [])):
        out = tmp_path / f"out-{folder.name}"
        rc, _, err = run_main("convert", folder, out, "--exclude", "ema", *extra, "-q")
        assert rc == 0, err
        assert (out / "ema" / "model.safetensors").is_file()
    rc, _, err = run_main("convert", src, tmp_path / "refused", "--exclude", "ema")
    assert rc == 1 and "ema" in err, err
    assert not (tmp_path / "refused").exists()


def test_globs_apply_to_folders_of_files_only_and_bad_ones_are_usage_errors(tmp_path, run_main):
    src = make_folder(tmp_path / "ckpt")
    rc, _, err = run_main(
        "convert", src / "model.safetensors", tmp_path / "o.safetensors", "--include", "*"
    )
    assert rc == 2
    assert "--include applies to a folder of files" in err
    rc, _, err = run_main("convert", src, tmp_path / "out", "--exclude", "a[")
    assert rc == 2
    assert "--exclude: invalid pattern `a[`" in err
    assert not (tmp_path / "out").exists()


def test_shard_runs_and_finalize_copy_what_the_globs_say(tmp_path):
    src = make_folder(tmp_path / "ckpt")
    write_safetensors(
        src / "sub" / "model.safetensors", {"w": ("F32", [2], np.float32([5, 6]))}
    ) if (src / "sub").mkdir() is None else None
    dst = tmp_path / "out"
    for i in (1, 2):
        stcast.convert(src, dst, shard=(i, 2), include=["optimizer.bin"], exclude=["*.md"])
    stcast.finalize(src, dst)
    assert (dst / "optimizer.bin").exists() and not (dst / "README.md").exists()
    assert stcast.verify(src, dst).ok


def test_latest_naming_a_folder_of_weights_leaves_nothing_out(tmp_path, run_main):
    """A `latest` file naming a folder that holds no DeepSpeed states (`ema/`, weights) is
    no DeepSpeed `latest`: the folder is converted as any other, `latest` copied (attack
    z10 r5: `ema/` was left out unread as training state, its weights missing, and verify
    passed)."""
    src = tmp_path / "P"
    src.mkdir()
    (src / "ema").mkdir()
    for f in ("model.safetensors", "ema/model.safetensors"):
        write_safetensors(src / f, {"w": ("F32", [4], np.float32([1, 2, 3, 4]))})
        (src / f).with_name("config.json").write_text('{"torch_dtype": "float32"}\n')
    (src / "latest").write_text("ema")
    dst = tmp_path / "PO"
    rc, _, err = run_main("convert", src, dst, "-q")
    assert rc == 0 and "left out" not in err, err
    assert files(dst) == [
        "config.json",
        "ema/config.json",
        "ema/model.safetensors",
        "latest",
        "model.safetensors",
    ]
    assert stcast.verify(str(src), str(dst)).ok
    # DeepSpeed's states in it make it the tag folder `latest` names: training state.
    (src / "ema" / "mp_rank_00_model_states.pt").write_bytes(b"m" * 30)
    rc, _, err = run_main("convert", src, tmp_path / "PO2")
    assert rc == 0 and "`ema/`" in err and "`latest`" in err, err
    assert files(tmp_path / "PO2") == ["config.json", "model.safetensors"]


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("kind", ["dcp-hf-writer", "zero"])
def test_a_checkpoint_folder_names_the_files_beside_it(tmp_path, run_main, kind):
    """A DCP folder of HuggingFaceStorageWriter shards (or a ZeRO folder) holding the
    model's config.json and tokenizer.json converts to one file: they were dropped without a
    note, exit 0 (attack z10 r15). The note names them with their sizes (not the
    checkpoint's own files, nor training state), and how to bring the config."""
    src = tmp_path / "ckpt"
    src.mkdir()
    if kind == "dcp-hf-writer":
        for f in (FIXTURES / "dcp" / "hf-variant").glob("shard-*.safetensors"):
            (src / f.name).write_bytes(f.read_bytes())
    else:
        zero = FIXTURES / "zero" / "stage2-3ranks"
        (src / "global_step1").mkdir()
        for f in (zero / "global_step1").iterdir():
            (src / "global_step1" / f.name).write_bytes(f.read_bytes())
        (src / "latest").write_bytes((zero / "latest").read_bytes())
        (src / "zero_to_fp32.py").write_text("# DeepSpeed's\n")
        (src / "trainer_state.json").write_text("{}\n")
    (src / "config.json").write_text('{"model_type": "llama", "torch_dtype": "float32"}\n')
    (src / "tokenizer.json").write_text("{}\n")
    rc, _, err = run_main("convert", src, tmp_path / "out")
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "left out" in line]
    assert len(notes) == 1, err
    assert "`config.json` (50 B), `tokenizer.json` (3 B)" in notes[0], notes
    assert "--config" in notes[0] and "trainer_state" not in notes[0], notes
    assert files(tmp_path / "out") == ["model.safetensors"]
