"""A folder output's indexes carry the record of convert's options too (`metadata.stcast`,
the text each shard's `__metadata__` holds), last in their metadata; `--no-record` leaves
them SRC's (their total size set). Option-less verify of a folder reads the index's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import write_safetensors

pytestmark = pytest.mark.filterwarnings("ignore::stcast.StcastWarning")


def sharded(root: Path) -> Path:
    root.mkdir()
    rng = np.random.default_rng(3)
    weight_map = {}
    for i, names in enumerate([["a.weight", "a.norm"], ["b.weight"]], 1):
        shard = f"model-{i:05d}-of-00002.safetensors"
        write_safetensors(
            root / shard,
            {n: ("F32", [16], rng.standard_normal(16, dtype=np.float32)) for n in names},
        )
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {"total_size": 1, "format": "pt"}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text('{"torch_dtype": "float32"}\n')
    return root


def index_of(folder: Path, name: str = "model.safetensors.index.json") -> dict:
    return json.loads((folder / name).read_text())


def shard_record(path: Path) -> str:
    meta = stcast.inspect(path).metadata
    assert meta is not None
    return meta["stcast"]


def test_a_folder_index_records_the_options_its_shards_record(tmp_path):
    src = sharded(tmp_path / "in")
    dst = tmp_path / "out"
    stcast.convert(src, dst, to="fp16", keep=["*norm"])
    meta = index_of(dst)["metadata"]
    assert list(meta) == ["total_size", "format", "stcast"]
    assert meta["stcast"] == shard_record(dst / "model-00001-of-00002.safetensors")
    assert json.loads(meta["stcast"]) == {"to": "fp16", "keep": ["*norm"]}
    assert stcast.verify(src, dst).ok
    # Option-less verify takes the index's record: a changed one is what DST is held to.
    index = index_of(dst)
    index["metadata"]["stcast"] = json.dumps({"to": "fp16"}, separators=(",", ":"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    assert not stcast.verify(src, dst).ok


def test_a_resharded_index_records_them_and_verify_needs_no_options(tmp_path):
    src = sharded(tmp_path / "in")
    dst = tmp_path / "out"
    stcast.convert(src, dst, max_shard_size="200B", name="model", keep_min_size=4)
    index = index_of(dst)
    record = json.loads(index["metadata"]["stcast"])
    assert record == {"to": "bf16", "keep_min_size": 4, "name": "model"}
    assert stcast.verify(src, dst).ok
    tampered = dict(index, metadata={**index["metadata"], "stcast": '{"to":"bf16"}'})
    (dst / "model.safetensors.index.json").write_text(json.dumps(tampered, indent=2) + "\n")
    assert not stcast.verify(src, dst).ok


def test_no_record_leaves_the_index_metadata_the_inputs(tmp_path):
    src = sharded(tmp_path / "in")
    dst = tmp_path / "out"
    stcast.convert(src, dst, no_record=True)
    assert index_of(dst)["metadata"] == {"total_size": 96, "format": "pt"}
    assert stcast.verify(src, dst).ok
    again = tmp_path / "again"
    stcast.convert(src, again, max_shard_size="200B", no_record=True)
    assert "stcast" not in index_of(again)["metadata"]
    assert stcast.verify(src, again).ok


def test_shard_runs_and_finalize_write_the_record_in_the_index(tmp_path):
    src = sharded(tmp_path / "in")
    dst = tmp_path / "out"
    for i in (1, 2):
        stcast.convert(src, dst, shard=(i, 2), to="fp16")
    stcast.finalize(src, dst)
    assert json.loads(index_of(dst)["metadata"]["stcast"]) == {"to": "fp16"}
    assert stcast.verify(src, dst).ok


def test_an_index_without_the_record_leaves_verify_to_the_shards_record(tmp_path):
    """An output of an older stcast records its options in its shards only."""
    src = sharded(tmp_path / "in")
    dst = tmp_path / "out"
    stcast.convert(src, dst, to="fp16", keep=["*norm"])
    index = index_of(dst)
    del index["metadata"]["stcast"]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # The options come from the shards; an index without the record is the one an earlier
    # stcast wrote, and what convert wrote always verifies.
    report = stcast.verify(src, dst)
    assert report.to == "fp16" and report.ok


@pytest.mark.parametrize("reshard", [False, True], ids=["plain", "resharded"])
def test_shards_of_two_runs_with_other_options_fail(tmp_path, reshard):
    """Each shard of a run with other options verifies alone, and the index may be the
    same bytes: the folder mixing them passed verify (stop 38's attack, in strict mode and
    with --to given too). Every shard must hold the record the others hold."""
    src = sharded(tmp_path / "in")
    extra = {"max_shard_size": "100B"} if reshard else {}
    a, b = tmp_path / "a", tmp_path / "b"
    stcast.convert(src, a, **extra)
    stcast.convert(src, b, to="fp16", **extra)
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(p.name for p in b.glob("*.safetensors"))
    (a / shards[-1]).write_bytes((b / shards[-1]).read_bytes())
    for options in ({}, {"to": "bf16"}, {"loose": True}):
        report = stcast.verify(src, a, **options)
        assert not report.ok and report.mismatch is not None, options
        assert report.mismatch.message.path == shards[-1], (options, report.mismatch)


def _set_shard_record(path: Path, text: str) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.setdefault("__metadata__", {})["stcast"] = text
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


@pytest.mark.parametrize("where", ["both", "shards", "index"])
@pytest.mark.parametrize("reshard", [False, True], ids=["plain", "resharded"])
def test_a_folder_record_convert_does_not_write_is_named_as_a_lone_files(tmp_path, where, reshard):
    """(Attack z11 r17.) Records rewritten with their keys in another order: SRC was paired
    without the prefix they hold, and the failure blamed a tensor (`is in no DST file`)."""
    src = tmp_path / "in"
    src.mkdir()
    weight_map = {}
    for i in range(2):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(src / shard, {f"module.w{i}": ("F32", [4, 4], np.ones((4, 4), "f4"))})
        weight_map[f"module.w{i}"] = shard
    index = {"metadata": {"total_size": 128}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = tmp_path / "out"
    extra = {"max_shard_size": "100B", "name": "model"} if reshard else {}
    stcast.convert(src, dst, strip_prefix=["module."], **extra)
    assert stcast.verify(src, dst).ok
    text = '{"strip_prefix":["module."],"to":"bf16"}'
    if where != "index":
        for shard in dst.glob("*.safetensors"):
            _set_shard_record(shard, text)
    if where != "shards":
        index = index_of(dst)
        index["metadata"]["stcast"] = text
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    report = stcast.verify(src, dst)
    assert not report.ok and report.mismatch is not None
    entry = "metadata" if where == "index" else "__metadata__"
    name = "model.safetensors.index.json" if where == "index" else "model-00001-of-"
    want = f'{entry} entry "stcast" is not a record convert writes (not the text convert writes)'
    assert want in report.mismatch.message, report.mismatch
    assert report.mismatch.file.startswith(name), report.mismatch


def test_a_record_srcs_shards_hold_is_theirs_under_no_record(tmp_path):
    """What `--no-record` leaves, SRC's metadata with a record convert does not write, is not
    DST's: verify given the options passes it."""
    src = sharded(tmp_path / "in")
    for shard in src.glob("*.safetensors"):
        _set_shard_record(shard, '{"keep":[],"to":"bf16"}')
    dst = tmp_path / "out"
    stcast.convert(src, dst, no_record=True)
    assert stcast.verify(src, dst, to="bf16").ok
