"""Whatever convert writes, verify with the same options accepts (issue 23, point 4).

A property over the folder cases the other test files generate (tests/test_folder.py,
tests/test_reshard.py, tests/test_torch_folder.py, tests/test_folder_safety.py), plain and
hostile, times the option sets that change the output: each case is converted with each
option set, and a convert that exits 0 must be followed by a verify (the same options,
less `--max-shard-size`, which verify finds by itself) that exits 0; a convert that does
not is a refusal: exit 1, one line, nothing written. Tensors are tiny: the whole grid runs
in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import test_folder as tfo
import test_reshard as trs
import test_torch_folder as ttf
from conftest import assert_one_error_line, write_checkpoint_folder, write_safetensors


def _hf_model(root: Path, rng) -> None:
    tfo.make_hf_model(root, rng, shards=2)


def _diffusers(root: Path, rng) -> None:
    tfo.make_diffusers(root, rng)


def _mixed_dtypes(root: Path, rng) -> None:
    trs.write_sharded(root, rng, 3, rows=[30, 2, 12])


def _one_file(root: Path, rng) -> None:
    root.mkdir()
    trs.write_single(root / "model.safetensors", rng, 2)


def _two_groups(root: Path, rng) -> None:
    # A sharded checkpoint and a lone file of another stem beside it.
    trs.write_sharded(root, rng, 2)
    trs.write_single(root / "ema.safetensors", rng, 1)


def _compact_index(root: Path, rng) -> None:
    tfo.write_sharded(root, rng, 2)
    index = root / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": weight_map}, separators=(",", ":")))


def _odd_config(root: Path, rng) -> None:
    tfo.save(root / "model.safetensors", tfo.layer(rng, 0))
    old, _ = tfo.CONFIG_CASES["non-ascii-and-escapes"]
    (root / "config.json").write_text(old, encoding="utf-8")


def _tiny(root: Path, rng) -> None:
    write_checkpoint_folder(root)


def _pytorch_bins(root: Path, rng) -> None:
    # Sharded PyTorch weights, their index and trainer state (left out, unread).
    ttf.make_bin_model(root, rng, shards=2)


def _both_formats(root: Path, rng) -> None:
    # PyTorch weights beside their safetensors version: those are left out.
    trs.write_sharded(root, rng, 2)
    ttf.save_bin(root / "pytorch_model.bin", {"x": rng.standard_normal(4, dtype=np.float32)})


def _links_within(root: Path, rng) -> None:
    # Shards reached through symlinks that stay within the source.
    trs.write_sharded(root, rng, 2)
    store = root / "store"
    store.mkdir()
    for p in sorted(root.glob("model-*.safetensors")):
        shutil.move(p, store / p.name)
        os.symlink(os.path.join("store", p.name), p)


def _empty_and_odd_files(root: Path, rng) -> None:
    tfo.write_sharded(root, rng, 2)
    (root / "empty.txt").write_bytes(b"")
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "sub" / "deeper" / "notes.md").write_text("x\n")
    write_safetensors(root / "sub" / "empty.safetensors", {}, metadata={"format": "pt"})


def _only_ints_and_empties(root: Path, rng) -> None:
    root.mkdir()
    write_safetensors(
        root / "model.safetensors",
        {
            "ids": ("I64", [5], np.arange(5, dtype=np.int64)),
            "w": ("F32", [3, 4], rng.standard_normal((3, 4), dtype=np.float32)),
            "none": ("F32", [0, 4], np.zeros(0, np.float32)),
            "big": ("F32", [2], np.array([1e30, -1e30], np.float32)),  # overflows in fp16
        },
    )


def _metadata_differs(root: Path, rng) -> None:
    # Shards of one tensor each, one with other metadata: a cut where SRC's fell.
    trs.write_one_tensor_shards(root, rng, [trs.META, {"format": "pt", "k": "2"}, trs.META])


def _two_indexes_one_set(root: Path, rng) -> None:
    # Issue 23 point 4: a second index naming the same shards.
    trs.write_sharded(root, rng, 2)
    shutil.copy(root / "model.safetensors.index.json", root / "other.safetensors.index.json")


def _empty_weight_map(root: Path, rng) -> None:
    # Issue 23 point 4: an index naming no shard, beside shards.
    trs.write_sharded(root, rng, 2)
    (root / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}\n')


FOLDERS: dict[str, Callable[[Path, np.random.Generator], None]] = {
    "hf-model": _hf_model,
    "diffusers": _diffusers,
    "mixed-dtypes": _mixed_dtypes,
    "one-file": _one_file,
    "two-groups": _two_groups,
    "compact-index": _compact_index,
    "odd-config": _odd_config,
    "tiny": _tiny,
    "pytorch-bins": _pytorch_bins,
    "both-formats": _both_formats,
    "links-within": _links_within,
    "empty-and-odd-files": _empty_and_odd_files,
    "ints-and-empties": _only_ints_and_empties,
    "metadata-differs": _metadata_differs,
    "two-indexes-one-set": _two_indexes_one_set,
    "empty-weight-map": _empty_weight_map,
}

# The option sets: (convert's, verify's).
OPTIONS: dict[str, tuple[list[str], list[str]]] = {
    "plain": ([], []),
    "reshard": (["--max-shard-size", "1500B"], []),
    "reshard-merge": (["--max-shard-size", "1GB"], []),
    "reshard-name": (["--max-shard-size", "2kB", "--name", "model"], ["--name", "model"]),
    "fp16": (["--to", "fp16"], ["--to", "fp16"]),
    "keep": (["--keep", "*norm*"], ["--keep", "*norm*"]),
    "fp16-keep-overflow": (["--to", "fp16", "--on-overflow", "keep"],) * 2,
    "reshard-fp16-keep": (
        ["--max-shard-size", "2kB", "--to", "fp16", "--keep", "*bias"],
        ["--to", "fp16", "--keep", "*bias"],
    ),
}

# Cases every option set must refuse, before anything is written.
REFUSED = {"two-indexes-one-set", "empty-weight-map"}


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("folder", list(FOLDERS))
def test_verify_accepts_what_convert_writes(tmp_path, run_main, folder, options):
    src, dst = tmp_path / "src", tmp_path / "out"
    FOLDERS[folder](src, np.random.default_rng(23))
    convert_args, verify_args = OPTIONS[options]
    rc, _, err = run_main("convert", src, dst, "-q", *convert_args)
    if rc != 0:
        assert rc in (1, 2), err  # 2: an option this folder cannot take (`--name`)
        assert_one_error_line(err)
        assert not dst.exists()
        assert folder not in REFUSED or "index" in err
        return
    assert folder not in REFUSED, "convert wrote what verify refuses"
    rc, _, err = run_main("verify", src, dst, "-q", *verify_args)
    assert rc == 0, f"convert {convert_args} exited 0, verify {verify_args} says: {err}"


@pytest.mark.parametrize("options", ["plain", "reshard"])
def test_two_indexes_naming_the_same_shards_are_refused_alike(tmp_path, run_main, options):
    """convert (plain or re-sharding) and verify refuse the source with the same line,
    naming both indexes, before anything is written."""
    src = tmp_path / "src"
    _two_indexes_one_set(src, np.random.default_rng(1))
    rc, _, err = run_main("convert", src, tmp_path / "out", *OPTIONS[options][0])
    line = assert_one_error_line(err)
    assert rc == 1 and "cannot tell which checkpoint" in line
    assert "model.safetensors.index.json" in line and "other.safetensors.index.json" in line
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    rc, _, err = run_main("verify", src, tmp_path / "out")
    assert rc == 1 and assert_one_error_line(err) == line


@pytest.mark.parametrize("options", ["plain", "reshard"])
def test_an_index_with_an_empty_weight_map_is_refused(tmp_path, run_main, options):
    """An index that names no shard: a plain run used to copy it (a loader reading it loads
    nothing), a re-sharding to drop it and exit 0 (verify then missed it). Both refuse it,
    naming it, and so does verify."""
    src = tmp_path / "src"
    _empty_weight_map(src, np.random.default_rng(1))
    rc, _, err = run_main("convert", src, tmp_path / "out", *OPTIONS[options][0])
    line = assert_one_error_line(err)
    assert rc == 1 and "model.safetensors.index.json" in line and "weight_map is empty" in line
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    rc, _, err = run_main("verify", src, tmp_path / "out")
    assert rc == 1 and assert_one_error_line(err) == line
