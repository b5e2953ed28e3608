"""Every kind of source is the same to the paths a run writes and the links it follows.

- One territory: every path a run writes (the output, the report; a re-sharding's shards)
  is checked, by device and inode, against every file and folder of the source, whatever
  its kind: a DCP folder, HuggingFaceStorageWriter's shards, a ZeRO folder and its tag
  folder (through a link too). A dry run (`inspect` with DST) fails as `convert` would.
- One link policy: a link among a checkpoint folder's files that leads outside the folder
  (not into a Hugging Face cache's blobs/) is refused, naming it and `--follow-links`, as
  in a Hugging Face folder; links that stay inside are followed.
- `verify` with SRC and DST swapped says so.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import stcast
from conftest import assert_one_error_line, tree

FIXTURES = Path(__file__).parent / "fixtures"
KINDS = ["dcp", "hf-writer", "zero", "zero-linked-tag"]


def checkpoint(kind: str, tmp_path: Path) -> tuple[Path, list[str]]:
    """A checkpoint folder of `kind` under `tmp_path`, and the options that convert it."""
    ck = tmp_path / kind
    if kind == "dcp":
        shutil.copytree(FIXTURES / "dcp" / "hsdp-2x2", ck)
        return ck, ["--key", "model"]
    if kind == "hf-writer":
        ck.mkdir()
        for f in (FIXTURES / "dcp" / "hf-variant").glob("shard-*.safetensors"):
            shutil.copy(f, ck / f.name)
        return ck, []
    zero = FIXTURES / "zero" / "stage2-3ranks"
    ck.mkdir()
    shutil.copy(zero / "latest", ck / "latest")
    if kind == "zero":
        shutil.copytree(zero / "global_step1", ck / "global_step1")
    else:  # the tag folder is a link to a folder elsewhere (--follow-links takes it)
        shutil.copytree(zero / "global_step1", tmp_path / "real-tag")
        (ck / "global_step1").symlink_to(tmp_path / "real-tag")
    return ck, ["--follow-links"] if kind == "zero-linked-tag" else []


def inside(kind: str, ck: Path, tmp_path: Path) -> list[Path]:
    """Paths that lie inside the checkpoint (files of it among them)."""
    if kind == "dcp":
        return [ck / ".metadata", ck / "__1_0.distcp", ck / "r.json", ck / "sub" / "r.json"]
    if kind == "hf-writer":
        return [ck / "shard-00001-model-00001-of-00001.safetensors", ck / "r.json"]
    tag = tmp_path / "real-tag" if kind == "zero-linked-tag" else ck / "global_step1"
    return [ck / "latest", ck / "global_step1" / "r.json", tag / "r.json", tag / "x.json"]


@pytest.mark.parametrize("kind", KINDS)
def test_no_path_a_run_writes_lies_in_the_source(tmp_path, run_main, kind):
    """`--report` and DST inside a DCP, HuggingFaceStorageWriter or ZeRO folder (its
    `latest`, its tag folder, the real folder a linked tag folder leads to) are refused,
    with `--force` too, before anything is written; `inspect` with DST fails as `convert`
    does; `verify --report` too. (Before: the report replaced `latest`, or landed inside.)"""
    ck, opts = checkpoint(kind, tmp_path)
    out = tmp_path / "out.safetensors"
    assert run_main("convert", ck, out, *opts)[0] == 0
    before = tree(tmp_path)
    for path in inside(kind, ck, tmp_path):
        for args in (
            ["convert", ck, tmp_path / "o.safetensors", "--report", path, "--force"],
            ["convert", ck, path.with_suffix(".safetensors"), "--force"],
            ["convert", ck, path.with_name(path.name + "-rs"), "--max-shard-size", "1KB"],
            ["inspect", ck, path.with_suffix(".safetensors")],
            ["inspect", ck, tmp_path / "o.safetensors", "--report", path, "--force"],
            ["verify", ck, out, "--report", path, "--force"],
        ):
            if args[0] == "verify":  # verify takes no --follow-links (it follows them)
                args += [o for o in opts if o != "--follow-links"]
            else:
                args += opts
            rc, _, err = run_main(*args)
            line = assert_one_error_line(err)
            assert rc == 1, (args, line)
            assert "inside the checkpoint folder" in line or "is the input file" in line, line
            assert tree(tmp_path) == before, args


def test_a_dry_run_of_a_folder_refuses_a_report_inside_as_convert(tmp_path, run_main):
    """A Hugging Face folder: `inspect SRC DST --report` inside the source or the destination
    folder fails as `convert` does. (Before: the dry run said it would run.)"""
    src = tmp_path / "m"
    src.mkdir()
    shutil.copy(
        FIXTURES / "dcp" / "hf-variant" / "expected-model-fp32.safetensors",
        src / "model.safetensors",
    )
    (src / "README.md").write_text("mine")
    dst = tmp_path / "out"
    dst.mkdir()
    before = tree(tmp_path)
    for report in (src / "README.md", src / "new.json", dst / "r.json"):
        for command in ("convert", "inspect"):
            rc, _, err = run_main(command, src, dst, "--report", report, "--force")
            line = assert_one_error_line(err)
            assert rc == 1 and "lies inside the" in line, (command, line)
    assert tree(tmp_path) == before


def test_the_api_refuses_as_the_cli(tmp_path):
    ck, _ = checkpoint("zero", tmp_path)
    before = (ck / "latest").read_bytes()
    with pytest.raises(stcast.Refused, match="inside the checkpoint folder"):
        stcast.convert(ck, tmp_path / "o.safetensors", report=ck / "latest", force=True)
    with pytest.raises(stcast.Refused, match="inside the checkpoint folder"):
        stcast.inspect(ck, ck / "global_step1" / "o.safetensors")
    assert (ck / "latest").read_bytes() == before


def linked(kind: str, tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A checkpoint of `kind` one of whose files (or its tag folder) is a link to a copy
    outside it; the link, and the options that convert it."""
    ck, opts = checkpoint(kind.split(":")[0], tmp_path)
    away = tmp_path / "away"
    away.mkdir()
    name = {
        "dcp:rank": "__1_0.distcp",
        "dcp:metadata": ".metadata",
        "hf-writer": "shard-00002-model-00001-of-00001.safetensors",
        "zero": "global_step1",
        "zero:rank": "global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }[kind]
    link = ck / name
    shutil.move(link, away / link.name)
    link.symlink_to(away / link.name)
    return ck, link, opts


@pytest.mark.parametrize("kind", ["dcp:rank", "dcp:metadata", "hf-writer", "zero", "zero:rank"])
def test_a_link_out_of_a_checkpoint_is_refused_unless_followed(tmp_path, run_main, kind):
    """As in a Hugging Face folder: refused naming the link and `--follow-links` (API:
    `follow_links`), for convert, inspect and a re-sharding; followed when asked, and the
    output verifies. (Before: converted with exit 0.)"""
    ck, link, opts = linked(kind, tmp_path)
    out = tmp_path / "o.safetensors"
    for args in (
        ["convert", ck, out],
        ["inspect", ck],
        ["inspect", ck, out],
        ["convert", ck, tmp_path / "rs", "--max-shard-size", "1KB"],
    ):
        rc, _, err = run_main(*args, *opts)
        line = assert_one_error_line(err)
        assert rc == 1, line
        assert line.startswith(f"stcast: {link}: a symlink to a"), line
        assert "outside the source folder" in line and "(--follow-links follows it)" in line
        assert not out.exists() and not (tmp_path / "rs").exists()
    key = {"key": "model"} if opts else {}
    with pytest.raises(stcast.Refused, match=r"\(follow_links=True follows it\)"):
        stcast.convert(ck, out, **key)
    rc, _, err = run_main("convert", ck, out, "--follow-links", *opts)
    assert rc == 0, err
    assert stcast.verify(ck, out, **key).ok
    rc, _, err = run_main(
        "convert", ck, tmp_path / "rs", "--max-shard-size", "1KB", "--follow-links", *opts
    )
    assert rc == 0, err
    assert stcast.verify(ck, tmp_path / "rs", **key).ok


def test_links_that_stay_inside_or_into_a_cache_are_followed(tmp_path):
    """A tag folder linked within the checkpoint folder, and a DCP folder of a Hugging Face
    cache snapshot (its files link into the repo's blobs/), convert without the option."""
    ck, _ = checkpoint("zero", tmp_path)
    (ck / "global_step1").rename(ck / "real")
    (ck / "global_step1").symlink_to("real")
    stcast.convert(ck, tmp_path / "z.safetensors")

    repo = tmp_path / "models--org--name"
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    src = FIXTURES / "dcp" / "hsdp-2x2"
    for i, name in enumerate([".metadata", *sorted(p.name for p in src.glob("*.distcp"))]):
        shutil.copy(src / name, repo / "blobs" / f"{i:040x}")
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / f"{i:040x}")
    stcast.convert(snap, tmp_path / "d.safetensors", key="model")
    assert stcast.verify(snap, tmp_path / "d.safetensors", key="model").ok


def test_dst_through_a_linked_tag_folder_never_lands_in_it(tmp_path, run_main):
    """With `--follow-links`, the real tag folder is the source's too: DST inside it is
    refused, by whatever path (the link, the real one); so is DST that reaches a rank file
    through a link."""
    ck, opts = checkpoint("zero-linked-tag", tmp_path)
    before = tree(tmp_path)
    real = tmp_path / "real-tag"
    (tmp_path / "to-real").symlink_to(real)
    for dst in (
        real / "o.safetensors",
        tmp_path / "to-real" / "o.safetensors",
        ck / "global_step1" / "o.safetensors",
        real / "sub" / "o.safetensors",
    ):
        rc, _, err = run_main("convert", ck, dst, *opts, "--force")
        line = assert_one_error_line(err)
        assert rc == 1 and "inside the checkpoint folder" in line, line
    (tmp_path / "x.safetensors").symlink_to(real / "mp_rank_00_model_states.pt")
    rc, _, err = run_main("convert", ck, tmp_path / "x.safetensors", *opts, "--force")
    assert rc == 1 and "destination is the input file" in assert_one_error_line(err)
    os.unlink(tmp_path / "x.safetensors")
    assert tree(tmp_path) == before | {"to-real": None}


@pytest.mark.parametrize("kind", ["dcp", "hf-writer", "zero"])
def test_verify_with_src_and_dst_swapped_says_so(tmp_path, run_main, kind):
    """DST a checkpoint folder: named as what it is, a checkpoint to convert, and the swap
    suggested. (Before: "is in SRC but not in DST", or "a folder without .safetensors
    files".)"""
    ck, opts = checkpoint(kind, tmp_path)
    out = tmp_path / "out"
    assert run_main("convert", ck, out, *opts)[0] == 0
    for src in (out, out / "model.safetensors"):
        rc, _, err = run_main("verify", src, ck, *opts)
        line = assert_one_error_line(err)
        assert rc == 1, line
        assert f"stcast: {ck}: DST is a" in line and "were they swapped?" in line, line
