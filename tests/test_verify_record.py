"""convert records its options in each output's `__metadata__` (`stcast`); `verify SRC DST`
with no options uses them, options given override them, `no_record` records nothing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line
from safetensors.numpy import save_file


def _meta(path: Path) -> dict[str, str] | None:
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8 : 8 + n]).get("__metadata__")


@pytest.fixture
def src(tmp_path: Path) -> Path:
    rng = np.random.default_rng(3)
    p = tmp_path / "m.safetensors"
    tensors = {
        "layer.weight": rng.standard_normal((32, 32)).astype(np.float32),
        "norm.weight": rng.standard_normal(32).astype(np.float32),
        "big": (rng.standard_normal(8) * 1e6).astype(np.float32),
    }
    save_file(tensors, str(p), metadata={"z": "1", "stcast": "old", "a": "2"})
    return p


CASES = [
    {},
    {"keep": ["*norm*"], "keep_min_size": 64},
    {"to": "fp16", "on_overflow": "keep"},
    {"to": "fp16", "from_bf16": True},
    {"to": "fp8"},
    {"to": "fp8-block"},
]


@pytest.mark.filterwarnings("ignore:no model config describes")
@pytest.mark.parametrize("options", CASES)
def test_optionless_verify_passes_on_what_convert_wrote(src, tmp_path, options):
    dst = tmp_path / "out.safetensors"
    stcast.convert(str(src), str(dst), **options)
    meta = _meta(dst)
    assert meta is not None
    # The input's keys in their order, its own record replaced, then the record.
    own = [k for k in _meta(src) or {} if k != "stcast"]
    assert list(meta) == [*own, "stcast"]
    record = json.loads(meta["stcast"])
    assert record["to"] == options.get("to", "bf16")
    for k in ("keep", "keep_min_size", "on_overflow", "from_bf16"):
        assert record.get(k) == options.get(k)
    assert stcast.verify(str(src), str(dst)).ok


def test_given_options_override_the_record(src, tmp_path):
    dst = tmp_path / "out.safetensors"
    stcast.convert(str(src), str(dst), keep=["*norm*"])
    assert stcast.verify(str(src), str(dst)).ok
    assert stcast.verify(str(src), str(dst), keep=["*norm*"]).ok
    # Another pattern given: norm.weight is then one these options convert.
    r = stcast.verify(str(src), str(dst), keep=["nothing*"])
    assert not r.ok and "norm.weight" in str(r.mismatch)
    r = stcast.verify(str(src), str(dst), to="fp16")
    assert not r.ok


def test_a_tampered_output_fails(src, tmp_path):
    dst = tmp_path / "out.safetensors"
    stcast.convert(str(src), str(dst), to="fp16", on_overflow="keep")
    b = bytearray(dst.read_bytes())
    b[-1] ^= 1
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(b))
    assert not stcast.verify(str(src), str(bad)).ok
    # A record convert never writes.
    text = dst.read_bytes()
    bad.write_bytes(text.replace(b'"on_overflow\\":\\"keep\\"', b'"on_overflow\\":\\"kept\\"'))
    r = stcast.verify(str(src), str(bad))
    assert not r.ok and "not a record convert writes" in str(r.mismatch)
    # The record says warn: the kept tensor is then one convert would have converted.
    old = b',\\"on_overflow\\":\\"keep\\"'
    assert old in text
    bad.write_bytes(text.replace(old, b" " * len(old)))
    assert not stcast.verify(str(src), str(bad)).ok


def test_a_record_with_a_glob_convert_refuses_is_no_record(src, tmp_path, run_main):
    # (Attack z10 r11.) Same length, so the header stays valid: the record is DST's content,
    # bad input naming DST (exit 1), not a usage error of an option the caller never gave.
    dst = tmp_path / "out.safetensors"
    stcast.convert(str(src), str(dst), keep=["*norm*"])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(dst.read_bytes().replace(b"*norm*", b"[norm*"))
    rc, out, err = run_main("verify", src, bad)
    assert rc == 1, (out, err)
    assert str(bad) in err and 'keep pattern "[norm*" is not a valid glob' in err, err
    r = stcast.verify(str(src), str(bad))
    assert not r.ok and "not a record convert writes" in str(r.mismatch)
    # Given, the pattern is the caller's: a usage error naming the option.
    assert run_main("verify", src, dst, "--keep", "[norm*")[0] == 2


def test_no_record_leaves_the_inputs_metadata_and_needs_the_options(src, tmp_path):
    dst = tmp_path / "out.safetensors"
    stcast.convert(str(src), str(dst), keep=["*norm*"], no_record=True)
    assert _meta(dst) == {"z": "1", "stcast": "old", "a": "2"}
    assert not stcast.verify(str(src), str(dst)).ok
    assert stcast.verify(str(src), str(dst), keep=["*norm*"]).ok


def test_missing_dst_is_named(src, tmp_path):
    with pytest.raises(OSError, match="DST does not exist"):
        stcast.verify(str(src), str(tmp_path / "nope.safetensors"))


@pytest.mark.filterwarnings("ignore:__metadata__ has no")
def test_folder_and_reshard_outputs_verify_without_options(src, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(src.read_bytes())
    out = tmp_path / "out"
    stcast.convert(str(folder), str(out), keep=["*norm*"], to="fp16", on_overflow="keep")
    assert json.loads(_meta(out / "model.safetensors")["stcast"])["keep"] == ["*norm*"]
    assert stcast.verify(str(folder), str(out)).ok
    assert not stcast.verify(str(folder), str(out), keep=["x"]).ok
    shards = tmp_path / "shards"
    stcast.convert(str(folder), str(shards), max_shard_size="1KB", keep_min_size=64)
    files = sorted(p.name for p in shards.glob("*.safetensors"))
    assert len(files) > 1
    for f in files:
        assert json.loads(_meta(shards / f)["stcast"])["keep_min_size"] == 64
    assert stcast.verify(str(folder), str(shards)).ok
    assert not stcast.verify(str(folder), str(shards), keep_min_size=0).ok


@pytest.mark.filterwarnings("ignore:__metadata__ has no")
def test_a_named_resharding_verifies_without_name_and_hints_it_without_a_record(src, tmp_path):
    out = tmp_path / "named"
    stcast.convert(str(src), str(out), max_shard_size="1KB", name="model")
    assert (out / "model.safetensors.index.json").exists()
    assert stcast.verify(str(src), str(out)).ok
    bare = tmp_path / "bare"
    stcast.convert(str(src), str(bare), max_shard_size="1KB", name="model", no_record=True)
    r = stcast.verify(str(src), str(bare))
    assert not r.ok and "{name=model}" in r.mismatch.message.template
    assert stcast.verify(str(src), str(bare), name="model").ok


def test_a_pytorch_checkpoint_read_at_a_key_verifies_without_it(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torchfile import StateDict, write_zip

    rng = np.random.default_rng(5)
    arrays = {
        "module.a.weight": rng.standard_normal((16, 16)).astype(np.float32),
        "module.b.weight": rng.standard_normal((16, 16)).astype(np.float32),
    }
    objs, storages = StateDict(arrays).pickled()
    ckpt = tmp_path / "last.ckpt"
    write_zip(ckpt, {"state_dict": objs, "epoch": 3}, storages)
    one = tmp_path / "out.safetensors"
    stcast.convert(str(ckpt), str(one), key="state_dict", strip_prefix=["module."])
    assert json.loads(_meta(one)["stcast"]) == {
        "to": "bf16",
        "key": "state_dict",
        "strip_prefix": ["module."],
    }
    assert stcast.verify(str(ckpt), str(one)).ok
    shards = tmp_path / "shards"
    stcast.convert(
        str(ckpt), str(shards), key="state_dict", strip_prefix=["module."], max_shard_size="1KB"
    )
    assert len(list(shards.glob("*.safetensors"))) > 1
    assert stcast.verify(str(ckpt), str(shards)).ok


def _with_record(path: Path, out: Path, record: str | None) -> None:
    """`path`'s bytes with its `__metadata__` record set to `record` (last), or removed."""
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    meta = {k: v for k, v in header.pop("__metadata__", {}).items() if k != "stcast"}
    if record is not None:
        meta["stcast"] = record
    text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out.write_bytes(struct.pack("<Q", len(text)) + text + b[8 + n :])


@pytest.mark.parametrize(
    "record",
    [
        # Every tensor kept: convert refuses it (nothing to convert).
        '{"to":"bf16","keep":["*"]}',
        '{"to":"keep"}',
        # Values convert refuses as options.
        '{"to":"bf16","strip_prefix":[""]}',
        '{"to":"bf16","name":"a/b"}',
    ],
)
def test_a_record_convert_refuses_is_not_trusted(tmp_path, run_main, record):
    """M2: a byte copy of SRC whose record says options convert refuses is no output of
    convert: verify fails it in one line naming DST (exit 1)."""
    src = tmp_path / "s.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, str(src))
    dst = tmp_path / "d.safetensors"
    _with_record(src, dst, record)
    assert not stcast.verify(str(src), str(dst)).ok
    rc, out, err = run_main("verify", str(src), str(dst))
    assert rc == 1 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and err.startswith(f"stcast: {dst}: "), err


def test_a_folder_file_may_convert_nothing(tmp_path):
    """One file of a folder converts nothing (a BF16 shard beside an F32 one): it still
    verifies, as convert writes it so."""
    src = tmp_path / "in"
    src.mkdir()
    save_file({"a": np.ones(4, np.float32)}, str(src / "model-00001-of-00002.safetensors"))
    bf16 = np.ones(4, np.float32).view(np.uint32) >> 16
    # A BF16 shard, written raw (numpy has no bfloat16).
    _raw(src / "model-00002-of-00002.safetensors", "b", "BF16", bf16.astype(np.uint16).tobytes())
    index = {
        "metadata": {"total_size": 24},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="nothing to convert"):
        stcast.convert(str(src), str(out))
    assert stcast.verify(str(src), str(out)).ok
    # Every file a copy of SRC's, as records that keep every tensor say: convert refuses
    # such a folder run (nothing to convert), so verify fails it.
    forged = tmp_path / "forged"
    forged.mkdir()
    record = '{"to":"bf16","keep":["*"]}'
    for f in src.glob("*.safetensors"):
        _with_record(f, forged / f.name, record)
    index["metadata"]["stcast"] = record
    (forged / "model.safetensors.index.json").write_text(json.dumps(index))
    r = stcast.verify(str(src), str(forged))
    assert not r.ok and "nothing to convert" in r.mismatch.message.template, r
    # With on_overflow keep, convert writes it: verify passes it.
    copy = tmp_path / "copy"
    with pytest.warns(UserWarning, match="nothing to convert"):
        stcast.convert(str(src), str(copy), keep=["*"], on_overflow="keep")
    assert stcast.verify(str(src), str(copy)).ok


def _raw(path: Path, name: str, dtype: str, data: bytes) -> None:
    header = {name: {"dtype": dtype, "shape": [len(data) // 2], "data_offsets": [0, len(data)]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("meta_first", [False, True])
def test_src_holding_the_same_record_still_verifies(tmp_path, meta_first):
    """M3: SRC carries the very record convert writes: DST's record is still DST's own
    (convert replaced SRC's), and verify passes what convert wrote."""
    rng = np.random.default_rng(1)
    src = tmp_path / "s.safetensors"
    record = '{"to":"bf16","keep":["*norm*"]}'
    meta = {"stcast": record, "z": "1"} if meta_first else {"stcast": record}
    tensors = {
        "w": rng.standard_normal((16, 16)).astype(np.float32),
        "norm": rng.standard_normal(16).astype(np.float32),
    }
    save_file(tensors, str(src), metadata=meta)
    dst = tmp_path / "c.safetensors"
    stcast.convert(str(src), str(dst), keep=["*norm*"])
    assert _meta(dst) == {"z": "1", "stcast": record} if meta_first else {"stcast": record}
    assert stcast.verify(str(src), str(dst)).ok
    # Another output of the same SRC, with other options: its own record says them.
    fp16 = tmp_path / "h.safetensors"
    stcast.convert(str(src), str(fp16), to="fp16")
    assert stcast.verify(str(src), str(fp16)).ok
    # --no-record keeps SRC's metadata as it is (its record SRC's, not DST's options):
    # verified with the options given (the target DST's converted tensors have).
    bare = tmp_path / "b.safetensors"
    stcast.convert(str(src), str(bare), to="fp16", no_record=True)
    assert _meta(bare) == meta
    assert stcast.verify(str(src), str(bare)).ok
    assert stcast.verify(str(src), str(bare), to="fp16").ok
    assert not stcast.verify(str(src), str(bare), to="bf16").ok


def test_a_record_key_src_cannot_be_read_by_is_bad_input(src, tmp_path, run_main):
    """(a) DST's record names a `key` (a file's content, not the caller's option): SRC
    that cannot be read at it fails as bad input naming DST (exit 1), not as usage."""
    dst = tmp_path / "out.safetensors"
    stcast.convert(str(src), str(dst))
    bad = tmp_path / "bad.safetensors"
    _with_record(dst, bad, '{"to":"bf16","key":"model"}')
    rc, out, err = run_main("verify", str(src), str(bad))
    assert rc == 1 and err.count("\n") == 1, (rc, err)
    assert err.startswith(f"stcast: {bad}: SRC cannot be read as its stcast record says"), err
    assert "--key" not in err
    with pytest.raises(stcast.InvalidInput):
        stcast.verify(str(src), str(bad))


def test_a_record_key_a_pytorch_src_lacks_names_dst(tmp_path, run_main):
    """(attack z11 r8) DST's record names a `key` a PyTorch SRC lacks, while SRC read
    without it fails otherwise (several dicts of tensors): the record's fault, naming DST,
    not SRC's; SRC's own problem (a key it lacks, given) still names SRC."""
    import torchfile as tf

    src = tmp_path / "ck.pt"
    obj = {
        "model": {"w": tf.tensor("0", "float32", (4,))},
        "ema": {"w": tf.tensor("1", "float32", (4,))},
    }
    tf.write_zip(src, obj, {"0": np.ones(4, np.float32).tobytes(), "1": bytes(16)})
    dst = tmp_path / "out.safetensors"
    stcast.convert(str(src), str(dst), key="model")
    assert stcast.verify(str(src), str(dst)).ok
    bad = tmp_path / "bad.safetensors"
    _with_record(dst, bad, '{"to":"bf16","key":"nokey"}')
    rc, out, err = run_main("verify", str(src), str(bad))
    line = assert_one_error_line(err)
    assert rc == 1 and line.startswith(f"stcast: {bad}: SRC cannot be read as its stcast"), line
    assert "nokey" in line, line
    rc, out, err = run_main("verify", str(src), str(bad), "--key", "other")
    line = assert_one_error_line(err)
    assert rc == 1 and line.startswith(f"stcast: {src}: "), line


@pytest.mark.filterwarnings("ignore:__metadata__ has no")
def test_a_resharded_outputs_record_key_src_cannot_be_read_by_is_bad_input(src, tmp_path, run_main):
    """(a), re-sharded: the shards' and index's record name a `key` a safetensors SRC
    cannot be read at: bad input naming DST's file (exit 1), not a usage error."""
    out = tmp_path / "rs"
    stcast.convert(str(src), str(out), max_shard_size="1KB")
    assert stcast.verify(str(src), str(out)).ok
    forged = tmp_path / "forged"
    forged.mkdir()
    record = '{"to":"bf16","key":"model"}'
    for f in out.iterdir():
        if f.name.endswith(".safetensors"):
            _with_record(f, forged / f.name, record)
        else:
            doc = json.loads(f.read_text())
            doc["metadata"]["stcast"] = record
            (forged / f.name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    rc, out_, err = run_main("verify", str(src), str(forged))
    line = assert_one_error_line(err)
    assert rc == 1 and "SRC cannot be read as its stcast record says" in line, line
    assert line.startswith(f"stcast: {forged}/") and "--key" not in line, line


@pytest.mark.parametrize("extra", [[], ["--max-shard-size", "600B"]])
def test_an_fp8_folder_whose_first_file_quantizes_nothing_verifies(tmp_path, run_main, extra):
    # (Attack z11 r10.) A file of an FP8 output holding no quantized weight (embeddings,
    # norms: BF16 under either target) does not make the output a bf16 one: the record's
    # target is the whole output's, strict and loose.
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    a = {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32)}
    b = {"model.layers.0.self_attn.q_proj.weight": rng.standard_normal((16, 8)).astype(np.float32)}
    save_file(a, str(src / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(src / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {
        **dict.fromkeys(a, "model-00001-of-00002.safetensors"),
        **dict.fromkeys(b, "model-00002-of-00002.safetensors"),
    }
    index = {"metadata": {"total_size": 1024}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", "-q", src, dst, "--to", "fp8", *extra)
    assert rc == 0, err
    for loose in [[], ["--loose"]]:
        rc, out, err = run_main("verify", src, dst, *loose)
        assert rc == 0, (out, err)
    # Asked for bf16, it is not one.
    assert run_main("verify", src, dst, "--to", "bf16")[0] == 1


@pytest.mark.filterwarnings("ignore::stcast.StcastWarning")
def test_one_file_of_a_folder_output_verifies_alone(src, tmp_path):
    """(Attack z11 r13, not changed.) A folder run's outputs record `include`, `exclude` or a
    re-sharding's `name`, options convert refuses for a lone file; verifying one output file
    by itself is still legitimate (the record holds no option that changes that file's
    bytes), so verify trusts such a record rather than fail what convert wrote."""
    folder = tmp_path / "F"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(src.read_bytes())
    (folder / "notes.txt").write_text("x")
    stcast.convert(folder, tmp_path / "Fo", exclude=["notes.txt"])
    out = tmp_path / "Fo" / "model.safetensors"
    assert json.loads((_meta(out) or {})["stcast"])["exclude"] == ["notes.txt"]
    assert stcast.verify(folder / "model.safetensors", out).ok
    stcast.convert(src, tmp_path / "one", max_shard_size="1GB", name="model")
    one = tmp_path / "one" / "model.safetensors"
    assert json.loads((_meta(one) or {})["stcast"])["name"] == "model"
    assert stcast.verify(src, one).ok
