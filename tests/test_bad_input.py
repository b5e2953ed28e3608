"""Malformed inputs and refused operations: one clear line, exit 1, nothing written."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys

import pytest
import stcast
from conftest import (
    assert_json_error_stderr,
    assert_one_error_line,
    encode_header,
    listing,
    tensor_bytes,
    write_safetensors,
)
from helpers import cli_env

F32_1 = b"\x00\x00\x80\x3f"


def t(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def header_file(header, data=b"", pad=True) -> bytes:
    return encode_header(header, pad) + data


def with_length(n: int, rest: bytes) -> bytes:
    return n.to_bytes(8, "little") + rest


DEEP = 100_000

# (id, file bytes, words the message must contain)
BAD_FILES = [
    ("empty", b"", ["header too small"]),
    ("short", b"\x05\x00\x00", ["header too small"]),
    ("seven-bytes", b"\x00" * 7, ["header too small"]),
    ("length-past-eof", with_length(100, b'{"a":1}'), ["invalid header length"]),
    ("length-2^63", with_length(1 << 63, b"{}      "), ["header too large"]),
    ("length-2^64-1", with_length((1 << 64) - 1, b"{}      "), ["header too large"]),
    ("header-over-100MB", with_length(100_000_001, b"{}      "), ["header too large"]),
    ("invalid-json", header_file(b"{not json}"), ["invalid JSON"]),
    ("json-list", header_file(b"[]"), ["invalid JSON"]),
    ("json-string", header_file(b'"abc"'), ["invalid JSON"]),
    ("empty-header", with_length(0, b""), ["invalid JSON"]),
    ("trailing-json", header_file(b"{} {}"), ["invalid JSON", "trailing"]),
    (
        "invalid-utf8",
        header_file(b'{"\xff\xfe":' + json.dumps(t()).encode() + b"}", F32_1),
        ["invalid UTF-8"],
    ),
    (
        "nesting-100000",
        header_file(b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}"),
        ["invalid JSON", "recursion limit"],
    ),
    (
        "missing-dtype",
        header_file({"a": {"shape": [1], "data_offsets": [0, 4]}}, F32_1),
        ["missing field `dtype`"],
    ),
    (
        "missing-offsets",
        header_file({"a": {"dtype": "F32", "shape": [1]}}, F32_1),
        ["missing field `data_offsets`"],
    ),
    ("tensor-not-object", header_file({"a": 5}), ["invalid JSON", "invalid type"]),
    ("negative-shape", header_file({"a": t(shape=[-1])}, F32_1), ["invalid JSON", "-1"]),
    ("float-shape", header_file({"a": t(shape=[1.5])}, F32_1), ["invalid JSON", "floating point"]),
    ("string-shape", header_file({"a": t(shape=["1"])}, F32_1), ["invalid JSON", "string"]),
    (
        "three-offsets",
        header_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, F32_1),
        ["invalid JSON"],
    ),
    (
        "metadata-int-value",
        header_file({"__metadata__": {"k": 1}, "a": t()}, F32_1),
        ["invalid JSON", "integer `1`"],
    ),
    ("metadata-not-object", header_file({"__metadata__": "x", "a": t()}, F32_1), ["invalid JSON"]),
    (
        "duplicate-name",
        header_file(
            b'{"a":' + json.dumps(t()).encode() + b',"a":' + json.dumps(t()).encode() + b"}", F32_1
        ),
        ["duplicate tensor name `a`"],
    ),
    (
        "duplicate-metadata-key",
        header_file(
            b'{"__metadata__":{"k":"1","k":"2"},"a":' + json.dumps(t()).encode() + b"}", F32_1
        ),
        ["duplicate __metadata__ key `k`"],
    ),
    ("unknown-dtype", header_file({"a": t(dtype="F128")}, F32_1), ["unknown variant `F128`"]),
    ("lowercase-dtype", header_file({"a": t(dtype="f32")}, F32_1), ["unknown variant `f32`"]),
    (
        "size-mismatch",
        header_file({"a": t(shape=[3], offsets=[0, 8])}, F32_1 * 2),
        ["invalid shape, data type, or offset"],
    ),
    (
        "shape-product-overflow",
        header_file({"a": t(shape=[1 << 32, 1 << 32], offsets=[0, 4])}, F32_1),
        ["overflow"],
    ),
    (
        "shape-bits-overflow",
        header_file({"a": t(dtype="F64", shape=[1 << 61], offsets=[0, 8])}, F32_1 * 2),
        ["overflow"],
    ),
    (
        "subbyte-misaligned",
        header_file({"a": t(dtype="F4", shape=[3], offsets=[0, 2])}, b"\0\0"),
        ["byte boundary"],
    ),
    (
        "overlap",
        header_file(
            {"a": t(shape=[2], offsets=[0, 8]), "b": t(shape=[2], offsets=[4, 12])}, F32_1 * 3
        ),
        ["invalid offset for tensor `b`"],
    ),
    (
        "hole",
        header_file({"a": t(), "b": t(offsets=[8, 12])}, F32_1 * 3),
        ["invalid offset for tensor `b`"],
    ),
    (
        "first-not-at-zero",
        header_file({"a": t(offsets=[4, 8])}, F32_1 * 2),
        ["invalid offset for tensor `a`"],
    ),
    (
        "end-before-start",
        header_file({"a": t(), "b": t(shape=[0], offsets=[4, 0])}, F32_1),
        ["invalid offset for tensor `b`"],
    ),
    (
        "offsets-near-2^64",
        header_file({"a": t(offsets=[(1 << 64) - 5, (1 << 64) - 1])}, F32_1),
        ["invalid offset for tensor `a`"],
    ),
    (
        "end-near-2^64",
        header_file({"a": t(offsets=[0, (1 << 64) - 1])}, F32_1),
        ["invalid shape, data type, or offset"],
    ),
    (
        "offsets-past-eof",
        header_file({"a": t(shape=[4], offsets=[0, 16])}, F32_1),
        ["not fully covered"],
    ),
    ("trailing-bytes", header_file({"a": t()}, F32_1 + b"junk"), ["not fully covered"]),
    (
        "truncated-data",
        header_file({"a": t(shape=[4], offsets=[0, 16])}, F32_1 * 3 + b"\0"),
        ["not fully covered"],
    ),
    ("header-only-no-data", header_file({"a": t()}), ["not fully covered"]),
]


def write_bad(tmp_path, case: tuple[str, bytes, list[str]]) -> tuple[pathlib.Path, list[str]]:
    """Write one catalogue case to `bad.safetensors`; return its path and expected words."""
    _, data, words = case
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    return path, words


def convert_is_refused(cli, path: pathlib.Path, words: list[str]) -> str:
    """`stcast convert` of `path` exits 1 with one short error line naming the file and every
    one of `words`, prints nothing on stdout and leaves the folder as it was; returns the line.
    """
    folder = path.parent
    before = listing(folder)
    rc, out, err = cli("convert", path, folder / "out.safetensors", timeout=60)
    assert rc == 1, err
    assert out == ""
    line = assert_one_error_line(err)
    assert str(path) in line
    for w in words:
        assert w in line, line
    assert len(line) < 500, line
    assert listing(folder) == before
    return line


@pytest.fixture(params=BAD_FILES, ids=[c[0] for c in BAD_FILES])
def bad_file(request, tmp_path):
    return write_bad(tmp_path, request.param)


def test_bad_input_cli(bad_file, cli):
    convert_is_refused(cli, *bad_file)


def test_bad_input_api(bad_file):
    path, words = bad_file
    before = listing(path.parent)
    with pytest.raises(stcast.StcastError) as info:
        stcast.convert(path, path.parent / "out.safetensors")
    e = info.value
    assert isinstance(e, ValueError)
    assert e.kind == "invalid_input"
    assert e.path == str(path)
    msg = str(e)
    assert "\n" not in msg and msg.startswith(f"{path}: ")
    for w in words:
        assert w in msg, msg
    assert listing(path.parent) == before
    with pytest.raises(stcast.StcastError):
        stcast.inspect(path)


@pytest.mark.parametrize("case", ["empty", "duplicate-name", "truncated-data"])
def test_bad_input_default_destination(tmp_path, cli, case):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(next(data for name, data, _ in BAD_FILES if name == case))
    rc, _, err = cli("convert", path)
    assert rc == 1
    assert assert_one_error_line(err).startswith(f"stcast: {path}: ")
    with pytest.raises(stcast.StcastError):
        stcast.convert(path)
    assert listing(tmp_path) == ["bad.safetensors"]


def test_bad_input_json(tmp_path, cli):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(header_file({"a": t(dtype="F128")}, F32_1))
    rc, out, err = cli("inspect", path, "--json")
    assert rc == 1
    assert_json_error_stderr(err)
    doc = json.loads(out)
    assert doc["error"]["kind"] == "invalid_input"
    assert doc["error"]["path"] == str(path)
    assert "F128" in doc["error"]["message"]


# --- refusals -------------------------------------------------------------------------------


@pytest.fixture
def model(tmp_path):
    return write_safetensors(tmp_path / "model.safetensors", {"a": ("F32", [1], F32_1)})


def check_refused(cli, src, dst, words, *extra, kind="refused", cls=stcast.StcastError):
    folder = dst.parent if dst.parent.exists() else src.parent
    before = listing(folder)
    snapshot = {p: (folder / p).read_bytes() for p in before if (folder / p).is_file()}
    rc, out, err = cli("convert", src, dst, *extra, timeout=30)
    assert rc == 1, err
    line = assert_one_error_line(err)
    for w in words:
        assert w in line, line
    assert listing(folder) == before
    with pytest.raises(cls) as info:
        stcast.convert(src, dst, force="--force" in extra)
    if kind is not None:
        assert info.value.kind == kind
    assert listing(folder) == before
    after = {p: (folder / p).read_bytes() for p in before if (folder / p).is_file()}
    assert after == snapshot
    return line


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_destination_is_input(model, cli, force):
    line = check_refused(cli, model, model, ["destination is the input"], *force)
    assert str(model) in line


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_destination_is_symlink_to_input(model, cli, force):
    link = model.parent / "link.safetensors"
    link.symlink_to(model.name)
    check_refused(cli, model, link, ["destination is the input"], *force)
    assert link.is_symlink()


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_destination_is_hard_link_to_input(model, cli, force):
    link = model.parent / "hard.safetensors"
    os.link(model, link)
    check_refused(cli, model, link, ["destination is the input"], *force)


def test_source_via_symlink_to_destination(model, cli):
    link = model.parent / "link.safetensors"
    link.symlink_to(model.name)
    check_refused(cli, link, model, ["destination is the input"], "--force")


def test_destination_exists(model, cli):
    dst = model.parent / "out.safetensors"
    dst.write_bytes(b"precious")
    line = check_refused(
        cli, model, dst, ["destination exists", "--force"], kind="destination_exists"
    )
    assert str(dst) in line
    # From Python: a FileExistsError (errno set) that is also a StcastError, in API words.
    with pytest.raises(FileExistsError) as info:
        stcast.convert(model, dst)
    e = info.value
    assert isinstance(e, stcast.StcastError) and isinstance(e, stcast.DestinationExists)
    assert e.errno == errno.EEXIST and e.filename == str(dst) and e.path == str(dst)
    assert str(e) == f"{dst}: destination exists (force=True replaces it)"
    rc, _, err = cli("convert", model, dst, "--force")
    assert rc == 0, err
    assert tensor_bytes(dst)["a"] == ("BF16", [1], b"\x80\x3f")
    assert listing(model.parent) == ["model.safetensors", "out.safetensors"]


def test_default_destination_exists(model, cli):
    dst = model.parent / "model-bf16.safetensors"
    dst.write_bytes(b"precious")
    rc, _, err = cli("convert", model)
    assert rc == 1
    assert "destination exists" in assert_one_error_line(err)
    assert dst.read_bytes() == b"precious"


def test_destination_is_a_folder(model, cli):
    folder = model.parent / "sub"
    folder.mkdir()
    check_refused(cli, model, folder, ["destination is a folder"], "--force")
    assert listing(folder) == []


def test_missing_destination_folder(model, cli):
    dst = model.parent / "nope" / "out.safetensors"
    line = check_refused(cli, model, dst, ["destination folder does not exist"])
    assert str(model.parent / "nope") in line


def test_input_is_a_directory(tmp_path, cli):
    src = tmp_path / "dir.safetensors"
    src.mkdir()
    line = check_refused(cli, src, tmp_path / "out.safetensors", ["directory"])
    assert str(src) in line
    with pytest.raises(stcast.StcastError):
        stcast.inspect(src)


def test_input_is_a_fifo(tmp_path, cli):
    src = tmp_path / "pipe.safetensors"
    os.mkfifo(src)
    line = check_refused(cli, src, tmp_path / "out.safetensors", ["FIFO"])
    assert str(src) in line
    rc, _, err = cli("inspect", src, timeout=30)
    assert rc == 1 and "FIFO" in assert_one_error_line(err)


def test_input_missing(tmp_path, cli):
    src = tmp_path / "missing.safetensors"
    line = check_refused(
        cli, src, tmp_path / "out.safetensors", ["No such file"], kind=None, cls=FileNotFoundError
    )
    assert str(src) in line
    with pytest.raises(FileNotFoundError) as info:
        stcast.convert(src)
    assert info.value.filename == str(src)
    with pytest.raises(FileNotFoundError):
        stcast.inspect(src)
    assert listing(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes anything")
def test_unreadable_input_and_folder(model, cli):
    os.chmod(model, 0)
    try:
        rc, _, err = cli("convert", model, model.parent / "out.safetensors")
        assert rc == 1 and "Permission denied" in assert_one_error_line(err)
    finally:
        os.chmod(model, 0o644)
    ro = model.parent / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        rc, _, err = cli("convert", model, ro / "out.safetensors")
        assert rc == 1 and "Permission denied" in assert_one_error_line(err)
        assert listing(ro) == []
    finally:
        os.chmod(ro, 0o755)


def test_fifo_does_not_hang_api(tmp_path):
    src = tmp_path / "pipe.safetensors"
    os.mkfifo(src)
    code = (
        "import stcast, sys\n"
        "try:\n"
        "    stcast.inspect(sys.argv[1])\n"
        "except stcast.StcastError as e:\n"
        "    print(e.kind)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(src)],
        capture_output=True,
        text=True,
        timeout=30,
        env=cli_env(),
    )
    assert proc.stdout.strip() == "refused", proc.stderr
