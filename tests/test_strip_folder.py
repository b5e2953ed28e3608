"""`--strip-prefix` on folders of safetensors files (issue 33): the files' tensors and their
indexes' weight_map names lose the prefixes alike, in turn; a re-sharding's new index
names them so; verify uses the prefixes DST records (options given to it override); two
names that would be one are refused before anything is written; a prefix that matches no
name of the whole input warns once, as does an `--include`/`--exclude` glob that matches
no file of the folder."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, read_safetensors, tensor_bytes, tree, write_safetensors

BOTH = ["--strip-prefix", "module.", "--strip-prefix", "_orig_mod."]
PRE = "module._orig_mod."


def _hf_folder(root: Path, prefix: str = PRE, clash: bool = False) -> Path:
    """An HF folder: two shards (F32) with `prefix` on every name, their index (indent 2,
    keys unsorted), a config and a tokenizer; `clash` names a tensor of shard 2 as shard
    1's would be once stripped."""
    root.mkdir(parents=True)
    names = [["model.embed.weight", "model.layers.0.w"], ["model.layers.1.w", "lm_head.weight"]]
    if clash:
        names[1][0] = "_orig_mod.model.layers.0.w"
    weight_map = {}
    for k, group in enumerate(names):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        tensors = {}
        for j, n in enumerate(group):
            name = n if n.startswith("_orig_mod.") else prefix + n
            x = np.linspace(-1 - j, 1 + k, 8, dtype=np.float32)
            tensors[name] = ("F32", [2, 4], x)
            weight_map[name] = shard
        write_safetensors(root / shard, tensors, metadata={"format": "pt", "note": "x"})
    index = {"metadata": {"total_size": 128}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text('{\n  "torch_dtype": "float32"\n}\n')
    (root / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return root


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("stcast: warning:")]


def test_a_folder_of_shards_loses_the_prefixes_and_verifies(tmp_path, run_main):
    src = _hf_folder(tmp_path / "src")
    dst = tmp_path / "out"
    rc, out, err = run_main("convert", src, dst, *BOTH)
    assert rc == 0, err
    assert _warnings(err) == [], err
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    want = ["model.embed.weight", "model.layers.0.w", "model.layers.1.w", "lm_head.weight"]
    # The index's names in their order, its style kept (indent 2), its record added.
    assert list(index["weight_map"]) == want
    assert (dst / "model.safetensors.index.json").read_text().startswith('{\n  "metadata"')
    assert "stcast" in index["metadata"]
    held = {}
    for shard in sorted(dst.glob("model-*.safetensors")):
        tensors = tensor_bytes(shard)
        held.update(dict.fromkeys(tensors, shard.name))
        assert all(t[0] == "BF16" for t in tensors.values())
        # __metadata__ is never renamed: the input's keys, then the record.
        meta = dict(dict(read_safetensors(shard)[1])["__metadata__"])
        assert list(meta)[:2] == ["format", "note"] and meta["note"] == "x"
        assert "_orig_mod." in meta["stcast"]  # the prefixes recorded
    assert held == index["weight_map"]
    # verify knows what convert did: no option needed.
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0 and "exactly the conversion" in out, (out, err)
    rc, out, err = run_main("verify", src, dst, *BOTH)
    assert rc == 0, (out, err)
    # An option given to verify overrides the record: read under `module.` only, SRC's
    # names are not DST's.
    rc, out, err = run_main("verify", src, dst, "--strip-prefix", "module.")
    assert rc == 1, (out, err)
    # Without the record, verify needs the prefixes.
    bare = tmp_path / "bare"
    rc, out, err = run_main("convert", "-q", src, bare, *BOTH, "--no-record")
    assert rc == 0, err
    assert run_main("verify", src, bare)[0] == 1
    rc, out, err = run_main("verify", src, bare, *BOTH)
    assert rc == 0, (out, err)


def test_a_tampered_index_fails_verify(tmp_path, run_main):
    src = _hf_folder(tmp_path / "src")
    dst = tmp_path / "out"
    assert run_main("convert", "-q", src, dst, *BOTH)[0] == 0
    path = dst / "model.safetensors.index.json"
    path.write_text(path.read_text().replace('"lm_head.weight"', '"module.lm_head.weight"'))
    rc, out, err = run_main("verify", src, dst)
    assert rc == 1 and "model.safetensors.index.json" in out + err, (out, err)


def test_a_folder_resharded_loses_the_prefixes(tmp_path, run_main):
    src = _hf_folder(tmp_path / "src")
    dst = tmp_path / "shards"
    rc, out, err = run_main("convert", src, dst, *BOTH, "--max-shard-size", "100B")
    assert rc == 0, err
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(
        ["model.embed.weight", "model.layers.0.w", "model.layers.1.w", "lm_head.weight"]
    )
    shards = sorted(dst.glob("model-*.safetensors"))
    assert len(shards) == 4
    assert {n: s.name for s in shards for n in tensor_bytes(s)} == index["weight_map"]
    rc, out, err = run_main("verify", src, dst)
    assert rc == 0 and "exactly the conversion" in out, (out, err)
    # inspect plans the same names.
    report = stcast.inspect(src, strip_prefix=["module.", "_orig_mod."], max_shard_size="100B")
    assert sorted(n for s in report.shards for n in [s["path"]]) == [s.name for s in shards]


def test_names_that_would_be_one_are_refused_before_anything_is_written(tmp_path, run_main):
    # Across the shards of one index: the index names both.
    src = _hf_folder(tmp_path / "src", clash=True)
    before = tree(tmp_path)
    for extra in [[], ["--max-shard-size", "100B"]]:
        rc, out, err = run_main("convert", src, tmp_path / "out", *BOTH, *extra)
        line = assert_one_error_line(err)
        assert rc == 1, err
        assert "model.safetensors.index.json" in line, line
        assert line.endswith(
            "tensors `module._orig_mod.model.layers.0.w` and `_orig_mod.model.layers.0.w` "
            "would both be named `model.layers.0.w`"
        ), line
        assert tree(tmp_path) == before
    # Within one file of a folder: the file names both.
    lone = tmp_path / "lone"
    lone.mkdir()
    x = np.zeros(4, np.float32)
    tensors = {"module.a": ("F32", [4], x), "a": ("F32", [4], x)}
    write_safetensors(lone / "model.safetensors", tensors)
    before = tree(tmp_path)
    rc, out, err = run_main("convert", lone, tmp_path / "out2", *BOTH)
    line = assert_one_error_line(err)
    assert rc == 1 and "model.safetensors" in line, err
    assert line.endswith("tensors `module.a` and `a` would both be named `a`"), line
    assert tree(tmp_path) == before


def test_a_prefix_matching_no_name_of_the_folder_warns_once(tmp_path, run_main):
    src = _hf_folder(tmp_path / "src")
    rc, out, err = run_main("convert", src, tmp_path / "a", *BOTH, "--strip-prefix", "zz.")
    assert rc == 0, err
    assert _warnings(err) == [
        "stcast: warning: --strip-prefix `zz.` matches no tensor name (once the prefixes "
        "before are stripped): a typo, or another order?"
    ], err
    # A prefix that one file's names start with is no typo: no warning.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    x = np.zeros(4, np.float32)
    write_safetensors(mixed / "ema.safetensors", {"module.a": ("F32", [4], x)})
    write_safetensors(mixed / "model.safetensors", {"a": ("F32", [4], x)})
    rc, out, err = run_main("convert", mixed, tmp_path / "b", "--strip-prefix", "module.")
    assert rc == 0 and _warnings(err) == [], err
    assert list(tensor_bytes(tmp_path / "b" / "ema.safetensors")) == ["a"]
    # Re-sharded: once too.
    rc, out, err = run_main(
        "convert", src, tmp_path / "c", *BOTH, "--strip-prefix", "zz.", "--max-shard-size", "1MB"
    )
    assert rc == 0, err
    assert len(_warnings(err)) == 1 and "`zz.`" in err, err
    # inspect says it once, with or without DST.
    for dst in [None, tmp_path / "d"]:
        report = stcast.inspect(src, dst, strip_prefix=["module.", "_orig_mod.", "zz."])
        kinds = [w.kind for w in report.warnings]
        assert kinds.count("unmatched_prefix") == 1, report.warnings


def test_verify_warns_of_a_prefix_given_that_matches_no_name(tmp_path, run_main):
    src = _hf_folder(tmp_path / "src")
    dst = tmp_path / "out"
    assert run_main("convert", "-q", src, dst, *BOTH)[0] == 0
    rc, out, err = run_main("verify", src, dst, *BOTH, "--strip-prefix", "zz.")
    assert rc == 0, (out, err)
    assert _warnings(err) == [
        "stcast: warning: --strip-prefix `zz.` matches no tensor name (once the prefixes "
        "before are stripped): a typo, or another order?"
    ], err
    # A re-sharded output too (its groups verified as wholes).
    shards = tmp_path / "shards"
    assert run_main("convert", "-q", src, shards, *BOTH, "--max-shard-size", "100B")[0] == 0
    rc, out, err = run_main("verify", src, shards, *BOTH, "--strip-prefix", "zz.")
    assert rc == 0 and len(_warnings(err)) == 1 and "`zz.`" in err, (out, err)
    rc, out, err = run_main("verify", src, shards)
    assert rc == 0 and _warnings(err) == [], (out, err)
    # A file too; the record's prefixes are not warned of again.
    one = tmp_path / "one.safetensors"
    assert run_main("convert", "-q", src / "model-00001-of-00002.safetensors", one, *BOTH)[0] == 0
    rc, out, err = run_main("verify", src / "model-00001-of-00002.safetensors", one)
    assert rc == 0 and _warnings(err) == [], (out, err)
    rc, out, err = run_main(
        "verify", src / "model-00001-of-00002.safetensors", one, *BOTH, "--strip-prefix", "zz."
    )
    assert rc == 0 and len(_warnings(err)) == 1 and "`zz.`" in err, (out, err)


@pytest.mark.parametrize("option", ["--include", "--exclude"])
def test_a_glob_matching_no_file_warns_once(tmp_path, run_main, option):
    src = _hf_folder(tmp_path / "src", prefix="")
    (src / "optimizer.pt").write_bytes(b"x" * 10)
    rc, out, err = run_main("convert", src, tmp_path / "a", option, "*.nope", option, "*.pt")
    assert rc == 0, err
    assert [w for w in _warnings(err) if "glob" in w] == [
        f"stcast: warning: {option} glob `*.nope` matches no file of the folder (a typo?)"
    ], err
    report = stcast.inspect(src, **{option[2:]: ["*.nope"]})
    assert [w for w in report.warnings if w.kind == "unmatched_pattern"] == [
        f"{option[2:]} glob `*.nope` matches no file of the folder (a typo?)"
    ]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        report = stcast.inspect(src, tmp_path / "b", **{option[2:]: ["*.nope"]})
    assert [w.kind for w in report.warnings].count("unmatched_pattern") == 1, report.warnings


@pytest.mark.parametrize("max_shard_size", [None, "100B"])
def test_shard_runs_then_finalize_name_the_tensors_as_a_plain_run(tmp_path, max_shard_size):
    """`--shard i/N` runs with the prefixes, then `finalize` (given no option: the manifests
    record them): the same folder as one run, which verify passes with no option."""
    src = _hf_folder(tmp_path / "src")
    sized = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    plain, dst = tmp_path / "plain", tmp_path / "sharded"
    stcast.convert(src, plain, strip_prefix=["module.", "_orig_mod."], **sized)
    for i in (1, 2):
        stcast.convert(src, dst, strip_prefix=["module.", "_orig_mod."], shard=(i, 2), **sized)
    stcast.finalize(src, dst)
    assert tree(dst) == tree(plain)
    assert stcast.verify(src, dst).ok
    # resume of a finished run: nothing to redo, the same folder.
    stcast.convert(src, plain, strip_prefix=["module.", "_orig_mod."], resume=True, **sized)
    assert tree(dst) == tree(plain)
