"""PyTorch checkpoints (`torch.save`: .bin, .pt, .pth) as input, read without torch.

- Real-torch fixtures (tests/fixtures/torch, made by make_fixtures.py with torch 2.15) convert
  exactly: every tensor's bytes as torch saw them with `to="keep"`, and as the bf16/fp16
  references with `to="bf16"`/`"fp16"`; the fixtures that torch's reader must refuse are
  refused with the reader's message.
- Generated checkpoints (tests/torchfile.py): shapes, strides, every dtype, big-endian,
  legacy, ZIP64 from Python's own zipfile, a storage past 4 GiB in a sparse file.
- Hostile pickles: each is refused, a canary file it would create never appears, and
  nothing is written.
- The command line: --key, --strip-prefix, --to keep, inspect.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import stcast
import torchfile as tf
from conftest import assert_one_error_line, listing, tensor_bytes
from reference import bf16_bits_ml_dtypes, f64_bits_to_bf16_exact

# The notes a checkpoint gives (unlisted globals, entries left out) are checked where they
# are the subject; elsewhere they are expected.
pytestmark = pytest.mark.filterwarnings("ignore::stcast.StcastWarning")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "torch"
DOCS = {p.name[: -len(".json")]: json.loads(p.read_text()) for p in FIXTURES.glob("*.json")}
CONVERTIBLE = sorted(name for name, doc in DOCS.items() if "error" not in doc)
REFUSED = sorted(name for name, doc in DOCS.items() if "error" in doc)

# numpy dtypes of the safetensors names, for the references.
NP = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
}


def metadata_of(path: Path) -> dict[str, str] | None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]).get("__metadata__")


def expected_bits(dtype: str, raw: bytes, to: str) -> tuple[str, bytes]:
    """The dtype and bytes stcast writes for a tensor of `dtype` holding `raw`."""
    if to == "keep" or dtype not in ("F64", "F32", "F16", "BF16"):
        return dtype, raw
    if to == "bf16":
        if dtype == "BF16":
            return dtype, raw
        if dtype == "F64":
            bits = np.frombuffer(raw, "<u8")
            return "BF16", np.array([f64_bits_to_bf16_exact(int(b)) for b in bits], "<u2").tobytes()
        return "BF16", bf16_bits_ml_dtypes(np.frombuffer(raw, NP[dtype])).tobytes()
    # fp16: BF16 stays (without from_bf16); F32 and F16 via numpy's own rounding (RNE).
    if dtype in ("BF16", "F16"):
        return dtype, raw
    if dtype == "F64":
        # numpy rounds F64 to F16 once, correctly (as stcast does).
        with np.errstate(over="ignore"):
            return "F16", np.frombuffer(raw, "<f8").astype("<f2").tobytes()
    with np.errstate(over="ignore"):
        return "F16", np.frombuffer(raw, "<f4").astype("<f2").tobytes()


def fixture_args(doc: dict) -> dict:
    return {"key": doc.get("key"), "strip_prefix": doc.get("strip") or []}


# --- real torch -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONVERTIBLE)
@pytest.mark.parametrize("to", ["keep", "bf16", "fp16"])
def test_real_torch_fixtures_convert_exactly(tmp_path, request, name, to):
    doc = DOCS[name]
    src = FIXTURES / name
    dst = tmp_path / "out.safetensors"
    options = fixture_args(doc)
    if name == "dtypes.pt" and to != "keep":
        # Every dtype: F8 beside F32, a quantized checkpoint, converted only when allowed.
        options["allow_quantized"] = True
    report = stcast.convert(src, dst, to=to, **options)
    got = tensor_bytes(dst)
    assert list(got) == sorted(got, key=list(got).index)  # (dict order: the file's)
    assert set(got) == {t["name"] for t in doc["tensors"]}
    for t in doc["tensors"]:
        dtype, shape, data = got[t["name"]]
        want_dtype, want = expected_bits(t["dtype"], bytes.fromhex(t["hex"]), to)
        assert (dtype, shape) == (want_dtype, t["shape"]), t["name"]
        assert data == want, t["name"]
    # A PyTorch checkpoint has no __metadata__: "format" as transformers wants, then the
    # record of convert's options (issue 33), defaults left out.
    record = {"to": to, **{k: v for k, v in fixture_args(doc).items() if v}}
    assert metadata_of(dst) == {"format": "pt", "stcast": json.dumps(record, separators=(",", ":"))}
    assert report.tensors_converted + report.tensors_copied == len(doc["tensors"])
    # verify reads the checkpoint the same way (given, or as DST records it).
    assert stcast.verify(src, dst, to=to, **fixture_args(doc)).ok
    assert stcast.verify(src, dst).ok
    if to == "keep":
        # Without `to`, a DST whose every tensor kept its dtype is checked as `keep`.
        assert stcast.verify(src, dst, **fixture_args(doc)).ok


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_inspect_names_the_dict_the_skipped_entries_and_the_globals(name):
    doc = DOCS[name]
    r = stcast.inspect(FIXTURES / name, **fixture_args(doc))
    assert r.format == ("pytorch" if doc["format"] == "zip" else "pytorch-legacy")
    assert r.key == doc["select"]
    assert r.unlisted == doc["placeholders"]
    assert set(r.unlisted) <= set(r.globals)
    assert (
        "torch._utils._rebuild_tensor_v2" in r.globals
        or "torch._utils._rebuild_tensor_v3" in r.globals
    )
    assert [t.name for t in r.tensors] == sorted(
        [t["name"] for t in doc["tensors"]], key=[t.name for t in r.tensors].index
    )
    if doc.get("skipped"):
        assert r.skipped == doc["skipped"]
        assert any(w.kind == "skipped_entries" for w in r.warnings)
    if doc["placeholders"]:
        assert any(w.kind == "unlisted_globals" for w in r.warnings)


@pytest.mark.parametrize("name", REFUSED)
def test_real_torch_fixtures_that_must_be_refused(tmp_path, name, run_main):
    doc = DOCS[name]
    dst = tmp_path / "out.safetensors"
    rc, out, err = run_main("convert", FIXTURES / name, dst)
    line = assert_one_error_line(err)
    # The reader's words, but for the option's name, which the CLI gives as a flag.
    assert rc == 1 and doc["error"].split("; select one")[0] in line, line
    assert listing(tmp_path) == []


# --- generated checkpoints ------------------------------------------------------------------


def f32(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(n).astype(np.float32) * 10


def check_converted(dst: Path, want: dict[str, np.ndarray], to: str = "bf16") -> None:
    """`dst` holds exactly `want` (logical order, little-endian), converted to `to`."""
    got = tensor_bytes(dst)
    assert set(got) == set(want)
    for name, a in want.items():
        dtype = {
            "float64": "F64",
            "float32": "F32",
            "float16": "F16",
            "bfloat16": "BF16",
            "int64": "I64",
            "int32": "I32",
            "int16": "I16",
            "int8": "I8",
            "uint8": "U8",
            "bool": "BOOL",
            "complex64": "C64",
        }[a.dtype.name]
        raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        want_dtype, want_bytes = expected_bits(dtype, raw, to)
        assert got[name][0] == want_dtype, name
        assert got[name][1] == list(a.shape), name
        assert got[name][2] == want_bytes, name


def test_generated_shapes_strides_and_dtypes(tmp_path, rng):
    base = f32(7 * 6, rng).reshape(7, 6)
    big = np.arange(120, dtype=np.float64).reshape(4, 5, 6) / 7
    ints = np.arange(-20, 20, dtype=np.int16)
    storages = {"0": base.tobytes(), "1": big.tobytes(), "2": ints.tobytes()}
    obj: dict = {
        "row": tf.tensor("0", "float32", (6,), offset=6, numel=42),
        "transposed": tf.tensor("0", "float32", (6, 7), stride=(1, 6), numel=42),
        "sliced": tf.tensor("0", "float32", (3, 2), stride=(12, 2), offset=1, numel=42),
        "broadcast": tf.tensor("0", "float32", (4, 6), stride=(0, 1), offset=12, numel=42),
        "scalar": tf.tensor("1", "float64", (), stride=(), offset=5, numel=120),
        "empty": tf.tensor("1", "float64", (0, 3), numel=120),
        "permuted": tf.tensor("1", "float64", (6, 4, 5), stride=(1, 30, 6), numel=120),
        "tied_a": tf.tensor("2", "int16", (40,)),
        "tied_b": tf.tensor("2", "int16", (5, 8)),
        "reversed_ints": tf.tensor("2", "int16", (2, 20), stride=(1, 2), numel=40),
    }
    want = {
        "row": base[1],
        "transposed": base.T,
        "sliced": base.reshape(-1)[1:].reshape(-1)[: 12 * 3].reshape(3, 12)[:, :4:2],
        "broadcast": np.broadcast_to(base.reshape(-1)[12:18], (4, 6)),
        "scalar": big.reshape(-1)[5],
        "empty": np.zeros((0, 3)),
        "permuted": big.transpose(2, 0, 1),
        "tied_a": ints,
        "tied_b": ints.reshape(5, 8),
        "reversed_ints": ints.reshape(20, 2).T,
    }
    src = tmp_path / "gen.pt"
    tf.write_zip(src, obj, storages)
    for to in ("keep", "bf16", "fp16"):
        dst = tmp_path / f"{to}.safetensors"
        stcast.convert(src, dst, to=to)
        check_converted(dst, want, to)
        assert stcast.verify(src, dst, to=to).ok


def test_every_dtype_and_big_endian(tmp_path, rng):
    arrays = {
        "f64": rng.standard_normal(5),
        "f32": f32(5, rng),
        "f16": rng.standard_normal(5).astype(np.float16),
        "bf16": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
        "i64": np.array([-(2**40), 1, 2], np.int64),
        "i32": np.array([-7, 8], np.int32),
        "i16": np.array([-7, 8], np.int16),
        "i8": np.array([-7, 8], np.int8),
        "u8": np.array([7, 250], np.uint8),
        "bool": np.array([True, False, True]),
        "c64": np.array([1 + 2j, -3.5j], np.complex64),
    }
    for byteorder in ("little", "big"):
        obj, storages = {}, {}
        for i, (name, a) in enumerate(arrays.items()):
            key = str(i)
            dtype = "bfloat16" if a.dtype == ml_dtypes.bfloat16 else a.dtype.name
            raw = a.view(np.uint16) if dtype == "bfloat16" else a
            order = "<" if byteorder == "little" else ">"
            if raw.dtype.kind == "c":  # complex: each half swapped on its own
                raw = raw.view(np.float32)
            storages[key] = raw.astype(raw.dtype.newbyteorder(order)).tobytes()
            obj[name] = tf.tensor(key, dtype, a.shape)
        src = tmp_path / f"{byteorder}.pt"
        tf.write_zip(src, obj, storages, byteorder=byteorder)
        for to in ("keep", "bf16"):
            dst = tmp_path / f"{byteorder}-{to}.safetensors"
            stcast.convert(src, dst, to=to)
            check_converted(dst, arrays, to)
            assert stcast.verify(src, dst, to=to).ok


def test_legacy_format_little_and_big_endian(tmp_path, rng):
    """Legacy storages hold little-endian numbers whatever sys_info says (torch's writer
    converts on big-endian machines); only the element counts of old files are big-endian."""
    a = f32(12, rng)
    for little in (True, False):
        obj = {
            "w": tf.tensor("140", "float32", (3, 4), numel=12),
            "wt": tf.tensor("140", "float32", (4, 3), stride=(1, 4), numel=12),
            # A legacy storage view: elements 4.. of storage 140.
            "v": tf.tensor("140", "float32", (2, 2), numel=12, view=("141", 4, 8)),
        }
        src = tmp_path / f"legacy-{little}.pth"
        tf.write_legacy(src, obj, [("140", 12, a.astype("<f4").tobytes())], little_endian=little)
        dst = tmp_path / f"legacy-{little}.safetensors"
        stcast.convert(src, dst, to="keep")
        check_converted(
            dst, {"w": a.reshape(3, 4), "wt": a.reshape(3, 4).T, "v": a[4:8].reshape(2, 2)}, "keep"
        )
        assert stcast.inspect(src).format == "pytorch-legacy"


def test_zip64_from_pythons_zipfile(tmp_path, rng):
    """A checkpoint written by Python's zipfile with ZIP64 records everywhere."""
    a = f32(10, rng)
    src = tmp_path / "py.pt"
    with zipfile.ZipFile(src, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in [
            ("m/data.pkl", tf.dumps({"a": tf.tensor("0", "float32", (2, 5))})),
            ("m/byteorder", b"little"),
            ("m/data/0", a.tobytes()),
            ("m/version", b"3\n"),
        ]:
            with z.open(name, "w", force_zip64=True) as f:
                f.write(data)
    dst = tmp_path / "py.safetensors"
    stcast.convert(src, dst)
    check_converted(dst, {"a": a.reshape(2, 5)})


def test_a_storage_past_4_gib(tmp_path, rng):
    """Offsets past 4 GiB (ZIP64 extra fields in the central directory), in a sparse file."""
    a = f32(64, rng)
    src = tmp_path / "far.pt"
    tf.write_zip(
        src, {"a": tf.tensor("0", "float32", (8, 8))}, {"0": a.tobytes()}, gap=(4 << 30) + 123
    )
    assert src.stat().st_size > 4 << 30
    if src.stat().st_blocks * 512 > 64 << 20:
        pytest.skip("this file system does not make sparse files")
    dst = tmp_path / "far.safetensors"
    stcast.convert(src, dst)
    check_converted(dst, {"a": a.reshape(8, 8)})
    assert stcast.inspect(src).file_bytes == src.stat().st_size


def test_nested_key_and_prefixes(tmp_path, run_main, rng):
    a, b = f32(4, rng), f32(4, rng)
    storages = {"0": a.tobytes(), "1": b.tobytes()}
    obj = {
        "epoch": 3,
        "model": {
            "module.w": tf.tensor("0", "float32", (4,)),
            "module._orig_mod.v": tf.tensor("1", "float32", (4,)),
            "step": 10,
        },
        "ema": {"inner": {"w": tf.tensor("1", "float32", (2, 2))}, "decay": 0.999},
    }
    src = tmp_path / "nested.pt"
    tf.write_zip(src, obj, storages)
    dst = tmp_path / "o.safetensors"
    rc, out, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1 and "several dicts of tensors: `model` (2 tensors), `ema` (1 tensor)" in line
    assert line.endswith("choose one with --key model"), line
    assert not dst.exists()
    with pytest.raises(stcast.Refused) as e:
        stcast.convert(src, dst)
    assert 'key="model"' in str(e.value)

    rc, out, err = run_main(
        "convert",
        src,
        dst,
        "--key",
        "model",
        "--strip-prefix",
        "module.",
        "--strip-prefix",
        "_orig_mod.",
        "--to",
        "keep",
    )
    assert rc == 0, err
    # One warning: the entry `step` is not a tensor.
    assert err.count("warning") == 1 and "entry `step` of `model` is not a tensor" in err
    # Each prefix in turn, from what the one before left.
    assert set(tensor_bytes(dst)) == {"w", "v"}
    rc, out, err = run_main("convert", src, dst, "--force", "--key", "ema.inner")
    assert rc == 0, err
    assert list(tensor_bytes(dst)) == ["w"]
    rc, out, err = run_main("convert", src, dst, "--force", "--key", "nope")
    line = assert_one_error_line(err)
    assert (
        rc == 1 and "key `nope` is not in the checkpoint" in line and "`model` (2 tensors)" in line
    )
    assert "`ema` (1 tensor)" in line, line  # not "1 tensors"
    rc, out, err = run_main("convert", src, dst, "--force", "--key", "epoch")
    assert rc == 1 and "key `epoch` names an int, not a dict of tensors" in assert_one_error_line(
        err
    )
    # Two names that would collide once stripped.
    rc, out, err = run_main(
        "convert",
        src,
        dst,
        "--force",
        "--key",
        "model",
        "--strip-prefix",
        "module.",
        "--strip-prefix",
        "module._orig_mod.",
    )
    assert rc == 0
    obj["model"]["v"] = tf.tensor("0", "float32", (4,))
    tf.write_zip(src, obj, storages)
    rc, out, err = run_main(
        "convert",
        src,
        dst,
        "--force",
        "--key",
        "model",
        "--strip-prefix",
        "module._orig_mod.",
        "--strip-prefix",
        "module.",
    )
    line = assert_one_error_line(err)
    assert rc == 1 and "would both be named `v`" in line, line


@pytest.mark.parametrize(
    "obj, first, second",
    [
        ({"a": {"b": "T"}, "a.b": "T"}, "['a']['b']", "['a.b']"),
        ({"1": "T", 1: "T"}, "['1']", "[1]"),
        ({"it's": {"x": "T"}, "it's.x": "T"}, "[\"it's\"]['x']", '["it\'s.x"]'),
    ],
)
def test_a_name_clash_names_the_keys_as_python_writes_them(tmp_path, run_main, obj, first, second):
    """Two tensors whose dotted names are one string are told apart by their keys, not named
    twice as "`a.b` and `a.b`" (issue 23, point 7)."""
    src, dst = tmp_path / "clash.pt", tmp_path / "out.safetensors"
    storages = {"0": np.arange(4, dtype=np.float32).tobytes()}

    def fill(d):
        return {
            k: fill(v) if isinstance(v, dict) else tf.tensor("0", "float32", (4,))
            for k, v in d.items()
        }

    tf.write_zip(src, fill(obj), storages)
    rc, out, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1, err
    name = next(iter(k for k in obj if isinstance(k, str) and "." in k), "1")
    assert f"tensors `{first}` and `{second}` would both be named `{name}`" in line, line
    assert not dst.exists()


def test_names_a_safetensors_header_cannot_hold_are_refused(tmp_path, run_main, rng):
    """A tensor named `__metadata__` (as saved, or once a prefix is stripped) would write a
    header with that key twice, a file no loader (nor stcast) reads; a tensor under a bytes
    or tuple dict key has no name. Both are refused before anything is written."""
    storages = {"0": f32(4, rng).tobytes()}
    t = tf.tensor("0", "float32", (4,))
    src, dst = tmp_path / "m.pt", tmp_path / "out.safetensors"
    tf.write_zip(src, {"__metadata__": t, "w": t}, storages)
    for extra in ([], ["--max-shard-size", "1KB"], ["--to", "keep"]):
        out_path = tmp_path / "shards" if extra[:1] == ["--max-shard-size"] else dst
        rc, out, err = run_main("convert", src, out_path, *extra)
        line = assert_one_error_line(err)
        assert rc == 1 and line == (
            f"stcast: {src}: tensor `__metadata__`: its name would be `__metadata__`, which a "
            "safetensors header reserves for the file's metadata"
        ), line
    tf.write_zip(src, {"module.__metadata__": t, "module.w": t}, storages)
    rc, out, err = run_main("convert", src, dst, "--strip-prefix", "module.")
    line = assert_one_error_line(err)
    assert rc == 1 and "tensor `module.__metadata__`: its name would be `__metadata__`" in line
    with pytest.raises(stcast.InvalidInput, match="__metadata__"):
        stcast.convert(src, dst, strip_prefix=["module."])
    # Unstripped, the name is an ordinary one.
    rc, out, err = run_main("convert", src, dst)
    assert rc == 0, err
    assert set(tensor_bytes(dst)) == {"module.__metadata__", "module.w"}
    dst.unlink()
    # A folder of PyTorch weights: one line, nothing written.
    folder = tmp_path / "folder"
    folder.mkdir()
    tf.write_zip(folder / "pytorch_model.bin", {"__metadata__": t}, storages)
    rc, out, err = run_main("convert", folder, tmp_path / "folder-out")
    line = assert_one_error_line(err)
    assert rc == 1 and "pytorch_model.bin: tensor `__metadata__`" in line, line
    assert not (tmp_path / "folder-out").exists()
    # Dict keys that are not strings.
    tf.write_zip(src, {b"w": t}, storages)
    rc, out, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1 and "tensor `<bytes key>`: its dict key is bytes, not a string" in line, line
    tf.write_zip(src, {"x": t, "m": {("a", 1): {"w": t}}}, storages)
    rc, out, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1 and "tensor `m.<a tuple key>.w`: its dict key is a tuple" in line, line
    assert listing(tmp_path) == ["folder", "m.pt"]


def test_prefixes_strip_in_turn_on_safetensors_and_in_verify(tmp_path, run_main, rng):
    """`--strip-prefix` on a safetensors file (issue 33): each prefix in turn, from what the
    one before left; one that matches no name warns; names that would collide are refused
    before anything is written; verify reads SRC under the same prefixes."""
    from conftest import write_safetensors

    a, b = f32(4, rng), f32(3, rng)
    src = write_safetensors(
        tmp_path / "ddp.safetensors",
        {"module._orig_mod.a": ("F32", [4], a), "module._orig_mod.b": ("F32", [3], b)},
    )
    dst = tmp_path / "out.safetensors"
    both = ["--strip-prefix", "module.", "--strip-prefix", "_orig_mod."]
    rc, out, err = run_main("convert", src, dst, *both, "--strip-prefix", "zz.")
    assert rc == 0, err
    assert sorted(tensor_bytes(dst)) == ["a", "b"]
    warned = [line for line in err.splitlines() if "warning" in line]
    assert warned == [
        "stcast: warning: --strip-prefix `zz.` matches no tensor name (once the prefixes "
        "before are stripped): a typo, or another order?"
    ], err
    rc, out, err = run_main("verify", src, dst, *both)
    assert rc == 0 and "exactly the conversion" in out, err
    rc, out, err = run_main("verify", src, dst)  # the prefixes convert recorded
    assert rc == 0 and "exactly the conversion" in out, err
    bare = tmp_path / "bare.safetensors"
    rc, out, err = run_main("convert", "-q", src, bare, *both, "--no-record")
    assert rc == 0, err
    rc, out, err = run_main("verify", src, bare)  # nothing recorded: SRC's own names
    assert rc == 1, out
    with pytest.warns(stcast.StcastWarning) as caught:
        stcast.convert(src, tmp_path / "api.safetensors", strip_prefix=["_orig_mod.", "module."])
    assert [w.message.kind for w in caught] == ["unmatched_prefix"]
    # Re-sharded too.
    rc, out, err = run_main("convert", src, tmp_path / "shards", *both, "--max-shard-size", "1MB")
    assert rc == 0, err
    (shard,) = (tmp_path / "shards").glob("*.safetensors")
    assert sorted(tensor_bytes(shard)) == ["a", "b"]
    # Two names that would be one: refused, nothing written.
    clash = write_safetensors(
        tmp_path / "clash.safetensors",
        {"module.a": ("F32", [4], a), "a": ("F32", [4], a)},
    )
    before = listing(tmp_path)
    rc, out, err = run_main("convert", clash, tmp_path / "c.safetensors", *both)
    line = assert_one_error_line(err)
    assert rc == 1 and line.endswith("tensors `module.a` and `a` would both be named `a`"), line
    assert listing(tmp_path) == before


def test_key_and_prefix_options_are_for_checkpoints(tmp_path, run_main):
    from conftest import write_safetensors

    st = write_safetensors(tmp_path / "x.safetensors", {"w": ("F32", [2], np.ones(2, np.float32))})
    rc, out, err = run_main("convert", st, tmp_path / "o.safetensors", "--key", "model")
    line = assert_one_error_line(err)
    assert rc == 2 and "--key applies to PyTorch checkpoints" in line, line
    rc, out, err = run_main("convert", tmp_path, tmp_path / "out", "--key", "m")
    assert rc == 2 and "--key applies to PyTorch checkpoint files" in assert_one_error_line(err)
    # keep with a safetensors input: only the format would change, and it does not.
    rc, out, err = run_main("convert", st, "--to", "keep")
    line = assert_one_error_line(err)
    assert rc == 1 and "nothing to convert" in line and "--to keep keeps every dtype" in line, line
    assert listing(tmp_path) == ["x.safetensors"]


def test_default_names_and_keep(tmp_path, run_main, rng):
    a = f32(6, rng)
    src = tmp_path / "pytorch_model.bin"
    tf.write_zip(src, {"w": tf.tensor("0", "float32", (2, 3))}, {"0": a.tobytes()})
    rc, out, err = run_main("convert", src)
    assert rc == 0, err
    assert (tmp_path / "pytorch_model-bf16.safetensors").exists()
    rc, out, err = run_main("convert", src, "--to", "keep", "--json")
    assert rc == 0, err
    result = json.loads(out)["result"]
    assert result["to"] == "keep" and result["tensors_converted"] == 0
    assert result["dst"] == str(tmp_path / "pytorch_model.safetensors")
    check_converted(tmp_path / "pytorch_model.safetensors", {"w": a.reshape(2, 3)}, "keep")
    rc, out, err = run_main("verify", src, tmp_path / "pytorch_model.safetensors", "--to", "keep")
    assert rc == 0, err
    # A keep output is not the bf16 conversion.
    rc, out, err = run_main("verify", src, tmp_path / "pytorch_model.safetensors", "--to", "bf16")
    assert rc == 1 and "kept in F32 in DST, but these options convert it to BF16" in err
    # Human inspect: the plan, the format and the globals.
    rc, out, err = run_main("inspect", src, "--to", "keep")
    assert rc == 0, err
    assert "copy: already the target" in out
    assert "format:   PyTorch checkpoint (zip); tensors from the top level" in out
    assert (
        "allow-listed: torch._utils._rebuild_tensor_v2, torch.FloatStorage, collections.OrderedDict"
        in out
    )


# --- hostile pickles ------------------------------------------------------------------------


CANARY = "stcast-canary"


class _System:
    """Pickles as `os.system(cmd)` (posix.system on Linux), as a malicious file would."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _ReduceEx:
    """A `__reduce_ex__` that pickles a call of `builtins.exec`."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce_ex__(self, protocol):
        return (exec, (self.code,))


def _hostile_cases(tmp: Path) -> dict[str, tuple[bytes | None, dict, str]]:
    """name -> (pickle bytes, or None for a whole file made below; storages; expected message)."""
    canary = tmp / CANARY
    touch = f"touch {canary}"
    w = tf.tensor("0", "float32", (2,))
    st = {"0": struct.pack("<2f", 1, 2)}
    ops = lambda raw: b"\x80\x02" + raw + b"."  # noqa: E731
    frag = lambda v: tf.dumps(v)[2:-1]  # noqa: E731
    cases = {
        "os.system": (
            pickle.dumps({"x": _System(touch)}, protocol=2),
            {},
            "refusing to load: the pickle calls posix.system",
        ),
        "posix.system as the tensor": (
            tf.dumps({"w": tf.Call(tf.Global("posix", "system"), (touch,))}),
            st,
            "refusing to load: the pickle calls posix.system",
        ),
        "builtins.eval": (
            tf.dumps(
                {"w": w, "x": tf.Call(tf.Global("builtins", "eval"), (f"open('{canary}', 'w')",))}
            ),
            st,
            "refusing to load: the pickle calls builtins.eval",
        ),
        "exec via __reduce_ex__": (
            pickle.dumps({"x": _ReduceEx(f"open('{canary}', 'w')")}, protocol=2),
            {},
            "refusing to load: the pickle calls builtins.exec",
        ),
        "getattr chain": (
            tf.dumps(
                {
                    "x": tf.Call(
                        tf.Call(
                            tf.Global("builtins", "getattr"), (tf.Global("os", "path"), "join")
                        ),
                        ("a",),
                    )
                }
            ),
            {},
            "refusing to load: the pickle calls builtins.getattr",
        ),
        "__import__": (
            tf.dumps({"x": tf.Call(tf.Global("builtins", "__import__"), ("os",))}),
            {},
            "refusing to load: the pickle calls builtins.__import__",
        ),
        "subprocess via NEWOBJ": (
            ops(b"csubprocess\nPopen\n" + frag((["touch", str(canary)],)) + b"\x81"),
            {},
            "refusing to load: the pickle calls subprocess.Popen",
        ),
        "INST": (ops(b"(X\x01\x00\x00\x00aiposix\nsystem\n"), {}, "opcode INST is not allowed"),
        "BUILD on a dict": (ops(b"}}b"), {}, "BUILD on a dict"),
        "BUILD on an allowed global": (
            ops(b"ctorch._utils\n_rebuild_tensor_v2\n}b"),
            {},
            "BUILD on an allowed global",
        ),
        "an unlisted global builds a tensor": (
            tf.dumps({"a": w, "w": tf.Call(tf.Global("evil", "make_tensor"), (1,))}),
            st,
            "refusing to load: entry `w` is built by evil.make_tensor, which is not on the "
            "allow-list",
        ),
        "missing storage": (
            tf.dumps({"w": tf.tensor("7", "float32", (2,))}),
            st,
            "a tensor uses storage `7`, but the file has no entry `archive/data/7`",
        ),
        "storage shorter than the tensor": (
            tf.dumps({"w": tf.tensor("0", "float32", (3,))}),
            st,
            "storage `0` needs 12 bytes but the file holds 8",
        ),
        "stride past the storage": (
            tf.dumps({"w": tf.tensor("0", "float32", (2,), stride=(2,), numel=2)}),
            st,
            "tensor `w`: its last element is element 2 of a storage that holds 2",
        ),
        "persistent id that is not a storage": (
            tf.dumps({"w": tf.Pid(("module", "x"))}),
            {},
            "persistent id is not a storage",
        ),
        "deep nesting": (
            ops(b"]" * 5000 + b"a" * 4999),
            {},
            "containers nest deeper than the limit of 1000",
        ),
    }
    return cases


@pytest.mark.parametrize(
    "case",
    [
        "os.system",
        "posix.system as the tensor",
        "builtins.eval",
        "exec via __reduce_ex__",
        "getattr chain",
        "__import__",
        "subprocess via NEWOBJ",
        "INST",
        "BUILD on a dict",
        "BUILD on an allowed global",
        "an unlisted global builds a tensor",
        "missing storage",
        "storage shorter than the tensor",
        "stride past the storage",
        "persistent id that is not a storage",
        "deep nesting",
    ],
)
def test_hostile_pickles_are_refused(tmp_path, run_main, case):
    data, storages, message = _hostile_cases(tmp_path)[case]
    src = tmp_path / "in" / "evil.pt"
    src.parent.mkdir()
    tf.write_zip(src, None, storages, pickle=data)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for command in ("convert", "inspect", "verify"):
        args = [command, src] + ([out_dir / "o.safetensors"] if command != "inspect" else [])
        rc, out, err = run_main(*args)
        line = assert_one_error_line(err)
        assert rc == 1 and message in line, (command, line)
    assert not (tmp_path / CANARY).exists()
    assert listing(out_dir) == [] and listing(src.parent) == ["evil.pt"]


def test_the_canary_is_live(tmp_path):
    """The os.system pickle does create the canary when Python's own pickle loads it: the
    refusal above is what keeps it from appearing (run in a child, in a scratch folder)."""
    canary = tmp_path / CANARY
    data = pickle.dumps({"x": _System(f"touch {canary}")}, protocol=2)
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=data,
        check=True,
        cwd=tmp_path,
    )
    assert canary.exists()


def test_zip_bombs_slips_and_oversized_pickles(tmp_path, run_main):
    pkl = tf.dumps({"w": tf.tensor("0", "float32", (2,))})
    data = struct.pack("<2f", 1, 2)

    def entries(**storage):
        return [
            tf.Entry("archive/data.pkl", pkl),
            tf.Entry("archive/byteorder", b"little"),
            tf.Entry(storage.pop("name", "archive/data/0"), data, **storage),
        ]

    cases = {
        # Deflate claimed for a storage whose central directory says 1 TB: never inflated
        # (its claimed bytes do not even fit in the file).
        "bomb": (entries(method=8, header_size=1 << 40), "run past the start of the directory"),
        # A storage must be stored: it is mapped in place, never inflated.
        "deflated": (entries(method=8), "is compressed (method 8)"),
        "slip": (entries(name="archive/../../etc/passwd"), "has an unsafe name"),
        "absolute": (entries(name="/archive/data/0"), "has an unsafe name"),
        "big pickle": (
            [
                tf.Entry("archive/data.pkl", tf.Hole((256 << 20) + 1)),
                tf.Entry("archive/data/0", data),
            ],
            "the pickle is larger than the limit of 268435456 bytes",
        ),
    }
    for what, (es, message) in cases.items():
        src = tmp_path / f"{what}.pt"
        tf.write_entries(src, es)
        dst = tmp_path / "o.safetensors"
        rc, out, err = run_main("convert", src, dst)
        line = assert_one_error_line(err)
        assert rc == 1 and message in line, (what, line)
        assert not dst.exists()


def test_unlisted_globals_elsewhere_are_a_note(tmp_path, run_main, rng):
    a = f32(4, rng)
    obj = {
        "state_dict": {"w": tf.tensor("0", "float32", (4,))},
        "hyper_parameters": tf.Build(tf.Call(tf.Global("argparse", "Namespace")), {"lr": 0.1}),
        "rng": tf.Call(tf.Global("numpy.core.multiarray", "_reconstruct"), (1,)),
    }
    src = tmp_path / "last.ckpt"
    tf.write_zip(src, obj, {"0": a.tobytes()})
    rc, out, err = run_main("convert", src, tmp_path / "o.safetensors")
    assert rc == 0, err
    assert "the pickle names 2 globals outside the allow-list, none of them called" in err
    assert "`argparse.Namespace`, `numpy.core.multiarray._reconstruct`" in err
    with pytest.warns(stcast.StcastWarning) as caught:
        stcast.convert(src, tmp_path / "p.safetensors")
    assert [w.message.kind for w in caught] == ["unlisted_globals"]
    # Selected, the same global is refused.
    rc, out, err = run_main("convert", src, tmp_path / "q.safetensors", "--key", "rng")
    assert rc == 1 and "numpy.core.multiarray._reconstruct" in assert_one_error_line(err)


def test_unsupported_dtypes_are_refused_by_name(tmp_path, run_main):
    obj = {"z": tf.tensor("0", "complex128", (2,))}
    src = tmp_path / "c.pt"
    tf.write_zip(src, obj, {"0": bytes(32)})
    rc, out, err = run_main("convert", src, tmp_path / "o.safetensors")
    line = assert_one_error_line(err)
    assert rc == 1 and "tensor `z`: dtype complex128 has no safetensors equivalent" in line
    with pytest.raises(stcast.InvalidInput) as e:
        stcast.inspect(src)
    assert e.value.tensor == "z"


def test_a_pickle_that_python_refuses_to_write_is_still_just_data(tmp_path):
    """The unpickler never imports: a global naming a module that does not exist is inert."""
    buf = io.BytesIO()
    obj = {"sd": {"w": tf.tensor("0", "float32", (1,))}, "x": tf.Global("no_such_module_xyz", "f")}
    buf.write(tf.dumps(obj))
    src = tmp_path / "x.pt"
    tf.write_zip(src, None, {"0": struct.pack("<f", 1)}, pickle=buf.getvalue())
    r = stcast.inspect(src)
    assert r.unlisted == ["no_such_module_xyz.f"]
    assert "no_such_module_xyz" not in sys.modules
