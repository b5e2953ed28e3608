"""Bad input and refusals: malformed files and hostile headers, sources that are not files,
odd names, refused destinations and misuse of the API.

Each refusal gives exit 1 and one `stcast: FILE: reason` line from the CLI, `StcastError` (or
the OSError of the system) from the API, no traceback and nothing new in the output folder.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import socket

import numpy as np
import pytest
import stcast
from conftest import (
    assert_json_error_stderr,
    assert_one_error_line,
    check_raising_progress,
    encode_header,
    listing,
    main_in_process,
    tensor_bytes,
    tree,
    write_checkpoint_folder,
    write_safetensors,
)
from helpers import run_cli, run_python, without_file_mode_overrides

# --- malformed files ---------------------------------------------------------------------

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
    ("empty", b"", ["an empty file (0 bytes)"]),
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


ENTRY = json.dumps(t()).encode()

# More malformed files: (id, file bytes, words the message must contain).
MORE_BAD_FILES = [
    (
        "span-not-multiple-of-f32",
        header_file({"a": t(offsets=[0, 6])}, F32_1 + b"\0\0"),
        ["tensor `a`", "needs 4 bytes", "give 6"],
    ),
    (
        "odd-span-f16",
        header_file({"a": t("F16", [2], [0, 3])}, b"\0\0\0"),
        ["tensor `a`", "needs 4 bytes", "give 3"],
    ),
    ("negative-offset", header_file({"a": t(offsets=[-4, 0])}, F32_1), ["integer `-4`"]),
    ("float-offsets", header_file({"a": t(offsets=[0.0, 4.0])}, F32_1), ["floating point `0.0`"]),
    ("one-offset", header_file({"a": {**t(), "data_offsets": [4]}}, F32_1), ["invalid length 1"]),
    ("offsets-string", header_file({"a": {**t(), "data_offsets": "0-4"}}, F32_1), ['string "0-4"']),
    ("dtype-number", header_file({"a": t(dtype=32)}, F32_1), ["integer `32`"]),
    (
        "missing-shape",
        header_file({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, F32_1),
        ["`shape`"],
    ),
    ("shape-2^64", header_file({"a": t(shape=[1 << 64])}, F32_1), ["expected usize"]),
    ("tensor-is-list", header_file({"a": [0, 4]}, F32_1), ["invalid type"]),
    (
        "metadata-nested-object",
        header_file({"__metadata__": {"k": {"x": "y"}}, "a": t()}, F32_1),
        ["invalid type: map"],
    ),
    ("metadata-null-value", header_file({"__metadata__": {"k": None}, "a": t()}, F32_1), ["null"]),
    (
        "metadata-twice",
        header_file(b'{"__metadata__":{},"__metadata__":{},"a":' + ENTRY + b"}", F32_1),
        ["duplicate field `__metadata__`"],
    ),
    ("header-number", header_file(b"42"), ["integer `42`"]),
    ("header-null", header_file(b"null"), ["invalid type: null"]),
    ("header-spaces-only", header_file(b"        "), ["EOF while parsing"]),
    ("utf8-bom", header_file(b"\xef\xbb\xbf{}"), ["expected value"]),
    ("nul-after-json", header_file(b"{}\x00"), ["trailing characters"]),
    ("lone-surrogate-escape", header_file(b'{"\\ud800":' + ENTRY + b"}", F32_1), ["escape"]),
    (
        "objects-100000-deep",
        header_file(b'{"a":' + b'{"b":' * DEEP + b"1" + b"}" * DEEP + b"}"),
        ["recursion limit"],
    ),
    (
        "second-tensor-past-eof",
        header_file({"a": t(), "b": t(offsets=[4, 1 << 40])}, F32_1 * 2),
        ["tensor `b`"],
    ),
    (
        "duplicate-empty-name",
        header_file(b'{"":' + ENTRY + b',"":' + ENTRY + b"}", F32_1),
        ["duplicate tensor name ``"],
    ),
    (
        "duplicate-name-far-apart",
        header_file(
            b'{"a":'
            + ENTRY
            + b',"b":'
            + json.dumps(t(offsets=[4, 8])).encode()
            + b',"a":'
            + ENTRY
            + b"}",
            F32_1 * 2,
        ),
        ["duplicate tensor name `a`"],
    ),
    ("length-8-bytes-only", (8).to_bytes(8, "little"), ["invalid header length"]),
    ("length-2^32", (1 << 32).to_bytes(8, "little") + b"{}", ["header too large"]),
]


def write_bad(tmp_path, case: tuple[str, bytes, list[str]]) -> tuple[pathlib.Path, list[str]]:
    """Write one catalogue case to `bad.safetensors`; return its path and expected words."""
    _, data, words = case
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    return path, words


def convert_is_refused(path: pathlib.Path, words: list[str]) -> str:
    """`stcast convert` of `path` exits 1 with one short error line naming the file and every
    one of `words`, prints nothing on stdout and leaves the folder as it was; returns the line.
    """
    folder = path.parent
    before = listing(folder)
    rc, out, err = main_in_process("convert", path, folder / "out.safetensors")
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


def test_bad_input_cli(bad_file):
    convert_is_refused(*bad_file)


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
def test_bad_input_default_destination(tmp_path, run_main, case):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(next(data for name, data, _ in BAD_FILES if name == case))
    rc, _, err = run_main("convert", path)
    assert rc == 1
    assert assert_one_error_line(err).startswith(f"stcast: {path}: ")
    with pytest.raises(stcast.StcastError):
        stcast.convert(path)
    assert listing(tmp_path) == ["bad.safetensors"]


def test_bad_input_json(tmp_path, run_main):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(header_file({"a": t(dtype="F128")}, F32_1))
    rc, out, err = run_main("inspect", path, "--json")
    assert rc == 1
    assert_json_error_stderr(err)
    doc = json.loads(out)
    assert doc["error"]["kind"] == "invalid_input"
    assert doc["error"]["path"] == str(path)
    assert "F128" in doc["error"]["message"]


@pytest.fixture(params=MORE_BAD_FILES, ids=[c[0] for c in MORE_BAD_FILES])
def more_bad_file(request, tmp_path):
    return write_bad(tmp_path, request.param)


def test_more_bad_input_cli_and_api(more_bad_file):
    path, words = more_bad_file
    folder = path.parent
    before = listing(folder)
    line = convert_is_refused(path, words)
    assert line.startswith(f"stcast: {path}: invalid "), line
    with pytest.raises(stcast.StcastError) as info:
        stcast.convert(path, folder / "out.safetensors")
    assert info.value.kind == "invalid_input" and info.value.path == str(path)
    assert str(info.value) == line[len("stcast: ") :]
    assert listing(folder) == before


def test_catalogue_has_at_least_25_distinct_files():
    files = [data for _, data, _ in BAD_FILES + MORE_BAD_FILES]
    assert len(set(files)) == len(files) >= 25 + len(MORE_BAD_FILES)


# --- refused destinations ---------------------------------------------------------------


@pytest.fixture
def small_model(tmp_path):
    """`model.safetensors`, alone in its folder: one F32 tensor `a` = [1.0]."""
    return write_safetensors(tmp_path / "model.safetensors", {"a": ("F32", [1], F32_1)})


def check_refused(src, dst, words, *extra, kind="refused", cls=stcast.StcastError):
    folder = dst.parent if dst.parent.exists() else src.parent
    before = listing(folder)
    snapshot = {p: (folder / p).read_bytes() for p in before if (folder / p).is_file()}
    rc, out, err = main_in_process("convert", src, dst, *extra)
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
def test_destination_is_input(small_model, force):
    line = check_refused(small_model, small_model, ["destination is the input"], *force)
    assert str(small_model) in line


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_destination_is_symlink_to_input(small_model, force):
    link = small_model.parent / "link.safetensors"
    link.symlink_to(small_model.name)
    check_refused(small_model, link, ["destination is the input"], *force)
    assert link.is_symlink()


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_destination_is_hard_link_to_input(small_model, force):
    link = small_model.parent / "hard.safetensors"
    os.link(small_model, link)
    check_refused(small_model, link, ["destination is the input"], *force)


def test_source_via_symlink_to_destination(small_model):
    link = small_model.parent / "link.safetensors"
    link.symlink_to(small_model.name)
    check_refused(link, small_model, ["destination is the input"], "--force")


def test_destination_exists(small_model, run_main):
    dst = small_model.parent / "out.safetensors"
    dst.write_bytes(b"precious")
    line = check_refused(
        small_model, dst, ["destination exists", "--force"], kind="destination_exists"
    )
    assert str(dst) in line
    # From Python: a FileExistsError (errno set) that is also a StcastError, in API words.
    with pytest.raises(FileExistsError) as info:
        stcast.convert(small_model, dst)
    e = info.value
    assert isinstance(e, stcast.StcastError) and isinstance(e, stcast.DestinationExists)
    assert e.errno == errno.EEXIST and e.filename == str(dst) and e.path == str(dst)
    assert str(e) == f"{dst}: destination exists (force=True replaces it)"
    rc, _, err = run_main("convert", small_model, dst, "--force")
    assert rc == 0, err
    assert tensor_bytes(dst)["a"] == ("BF16", [1], b"\x80\x3f")
    assert listing(small_model.parent) == ["model.safetensors", "out.safetensors"]


def test_default_destination_exists(small_model, run_main):
    dst = small_model.parent / "model-bf16.safetensors"
    dst.write_bytes(b"precious")
    rc, _, err = run_main("convert", small_model)
    assert rc == 1
    assert "destination exists" in assert_one_error_line(err)
    assert dst.read_bytes() == b"precious"


def test_destination_is_a_folder(small_model):
    """A folder DST gets convert's default name inside it (as `cp` does): a folder there is
    refused."""
    folder = small_model.parent / "sub"
    (folder / "model-bf16.safetensors").mkdir(parents=True)
    check_refused(small_model, folder, ["destination is a folder"], "--force")
    assert listing(folder) == ["model-bf16.safetensors"]


def test_destination_folder_under_a_file(small_model):
    """Missing folders are created, inside the nearest one that exists: a file there is
    refused, naming it."""
    (small_model.parent / "afile").write_bytes(b"precious")
    dst = small_model.parent / "afile" / "nope" / "out.safetensors"
    line = check_refused(small_model, dst, ["destination folder is not a folder"])
    assert line == f"stcast: {small_model.parent / 'afile'}: destination folder is not a folder"


@pytest.mark.parametrize("suffix", ["/", "/.", "//"])
def test_destination_written_as_a_folder_is_refused_before_converting(small_model, suffix):
    """`out/` names a folder: Path objects drop the slash, but publishing onto it fails, so
    it was refused only after the whole conversion (`cannot publish`, exit 1, kind io), and
    with --report only after the output was published. Now: refused up front."""
    folder = small_model.parent
    before = listing(folder)
    (folder / "afile").write_bytes(b"precious")
    dst = f"{folder}/afile{suffix}"
    rc, out, err = main_in_process("convert", small_model, dst, "--force")
    line = assert_one_error_line(err)
    assert rc == 1 and line == f"stcast: {folder}/afile: destination folder is not a folder", line
    with pytest.raises(stcast.Refused):
        stcast.convert(small_model, dst, force=True)
    # A folder, made or not: the output goes inside it, under convert's default name.
    (folder / "sub" / "model-bf16.safetensors").mkdir(parents=True)
    rc, out, err = main_in_process("convert", small_model, f"{folder}/sub{suffix}")
    assert rc == 1 and "destination is a folder" in assert_one_error_line(err)
    # The report path too: refused before the output is written.
    dst = folder / "out.safetensors"
    report = f"{folder}/newrep{suffix}"
    rc, out, err = main_in_process("convert", small_model, dst, "--report", report)
    line = assert_one_error_line(err)
    assert rc == 1 and line == f"stcast: {report}: the report path names no file", line
    assert listing(folder) == sorted([*before, "afile", "sub"])
    assert (folder / "afile").read_bytes() == b"precious"


# --- sources that are not regular files -----------------------------------------------------


def test_input_is_a_directory(tmp_path):
    src = tmp_path / "dir.safetensors"
    src.mkdir()
    # (Into `out.safetensors` a folder is a usage error first: it writes a folder.)
    line = check_refused(src, tmp_path / "out", ["directory"])
    assert str(src) in line
    with pytest.raises(stcast.StcastError):
        stcast.inspect(src)


def test_input_is_a_fifo(tmp_path, cli_process):
    src = tmp_path / "pipe.safetensors"
    os.mkfifo(src)
    line = check_refused(src, tmp_path / "out.safetensors", ["FIFO"])
    assert str(src) in line
    # Opening a FIFO blocks: `inspect` in a child with a timeout, like the API's check below.
    rc, _, err = cli_process("inspect", src, timeout=30)
    assert rc == 1 and "FIFO" in assert_one_error_line(err)


def test_input_missing(tmp_path):
    src = tmp_path / "missing.safetensors"
    line = check_refused(
        src, tmp_path / "out.safetensors", ["No such file"], kind=None, cls=FileNotFoundError
    )
    assert str(src) in line
    with pytest.raises(FileNotFoundError) as info:
        stcast.convert(src)
    assert info.value.filename == str(src)
    with pytest.raises(FileNotFoundError):
        stcast.inspect(src)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_source_is_a_device(tmp_path, run_main, device):
    rc, _, err = run_main("convert", device, tmp_path / "out.safetensors")
    assert rc == 1
    assert assert_one_error_line(err) == f"stcast: {device}: input is a device, not a regular file"
    with pytest.raises(stcast.StcastError) as info:
        stcast.inspect(device)
    assert info.value.kind == "refused"
    assert listing(tmp_path) == []


def test_source_is_a_socket(tmp_path, run_main):
    path = tmp_path / "s.safetensors"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        rc, _, err = run_main("inspect", path)
    assert rc == 1 and "cannot open the input" in assert_one_error_line(err)  # ENXIO


def test_destination_is_a_dangling_symlink(tmp_path, run_main):
    src = write_safetensors(tmp_path / "m.safetensors", {"a": ("F32", [1], F32_1)})
    link = tmp_path / "out.safetensors"
    link.symlink_to(tmp_path / "nowhere" / "x.safetensors")
    rc, _, err = run_main("convert", src, link)
    assert rc == 1 and "destination exists" in assert_one_error_line(err)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_unreadable_input_and_folder(small_model):
    """File modes are obeyed: an input without read permission, a folder without write one.

    In a child without the capabilities that let root ignore file modes, so that it runs as
    root too (see helpers.without_file_mode_overrides).
    """
    wrap = without_file_mode_overrides()
    os.chmod(small_model, 0)
    try:
        rc, _, err = run_cli(
            "convert", small_model, small_model.parent / "out.safetensors", wrap=wrap
        )
        assert rc == 1 and "Permission denied" in assert_one_error_line(err)
    finally:
        os.chmod(small_model, 0o644)
    ro = small_model.parent / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        rc, _, err = run_cli("convert", small_model, ro / "out.safetensors", wrap=wrap)
        assert rc == 1 and "Permission denied" in assert_one_error_line(err)
        assert listing(ro) == []
    finally:
        os.chmod(ro, 0o755)


@pytest.mark.parametrize("how", ["convert", "reshard", "finalize"])
def test_an_unreadable_companion_file_is_refused_before_anything_is_written(tmp_path, how):
    """A file a folder run copies that cannot be read (here tokenizer.json, mode 0) is
    refused, naming it, before the first byte is written: by convert and a re-sharding
    before any weight is converted (it used to fail once the weights were written, leaving
    them), by finalize before any copy is published. In a child without the capabilities
    that let root ignore file modes (helpers.without_file_mode_overrides)."""
    wrap = without_file_mode_overrides()
    src = write_checkpoint_folder(tmp_path / "src")
    dst = tmp_path / "out"
    tokenizer = src / "tokenizer.json"
    args: tuple[object, ...] = ("convert", src, dst, "-q")
    if how == "reshard":
        args = (*args, "--max-shard-size", "1GB")
    elif how == "finalize":
        for i in (1, 2):
            rc, _, err = run_cli("convert", src, dst, "--shard", f"{i}/2", "-q")
            assert rc == 0, err
        args = ("finalize", src, dst, "-q")
    before = tree(tmp_path) if dst.exists() else None
    os.chmod(tokenizer, 0)
    try:
        rc, _, err = run_cli(*args, wrap=wrap)
    finally:
        os.chmod(tokenizer, 0o644)
    line = assert_one_error_line(err)
    assert rc == 1 and "tokenizer.json" in line and "Permission denied" in line, line
    if before is None:
        assert not dst.exists() or listing(dst) == [], listing(dst)
    else:
        assert tree(tmp_path) == before
    # Readable again, the same run goes through.
    rc, _, err = run_cli(*args)
    assert rc == 0, err
    assert (dst / "tokenizer.json").read_bytes() == tokenizer.read_bytes()


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
    proc = run_python("-c", code, src, timeout=30)  # a child, in case it hangs
    assert proc.stdout.strip() == "refused", proc.stderr


# --- names: non-UTF-8, 255 bytes, longer than PATH_MAX ----------------------------------------


def write_two_floats(path):
    """A file at `path` (any name) with one F32 tensor `a` = [1.0, -2.0]."""
    return write_safetensors(path, {"a": ("F32", [2], np.array([1.0, -2.0], np.float32))})


def test_non_utf8_names(tmp_path, run_main):
    folder = os.fsencode(tmp_path)
    src = os.fsdecode(folder + b"/caf\xe9-\xff.safetensors")
    write_two_floats(src)
    rc, _, err = run_main("convert", "-q", src)
    assert (rc, err) == (0, "")
    dst = folder + b"/caf\xe9-\xff-bf16.safetensors"
    assert os.path.exists(dst)
    assert tensor_bytes(os.fsdecode(dst))["a"][0] == "BF16"
    # bytes paths through the API too
    report = stcast.convert(folder + b"/caf\xe9-\xff.safetensors", folder + b"/\xfe.safetensors")
    assert os.fsencode(report.dst) == folder + b"/\xfe.safetensors"
    # and a bad one is reported on one line
    bad = folder + b"/\x80bad.safetensors"
    with open(bad, "wb") as f:
        f.write(b"\0" * 3)
    rc, _, err = run_main("convert", os.fsdecode(bad), os.fsdecode(folder + b"/x.safetensors"))
    assert rc == 1 and "header too small" in assert_one_error_line(err)
    with pytest.raises(stcast.StcastError) as info:
        stcast.inspect(bad)
    assert os.fsencode(info.value.path) == bad


def test_255_byte_names(tmp_path, run_main):
    src = write_two_floats(tmp_path / ("s" * 243 + ".safetensors"))  # 255 bytes
    dst = tmp_path / ("d" * 243 + ".safetensors")
    rc, _, err = run_main("convert", "-q", src, dst)
    assert (rc, err) == (0, "")
    # The default name adds "-bf16": one byte too many for the file system, said clearly.
    os.remove(dst)
    before = listing(tmp_path)
    rc, _, err = run_main("convert", src)
    assert rc == 1
    assert "File name too long" in assert_one_error_line(err)
    assert listing(tmp_path) == before


def test_path_longer_than_path_max(tmp_path, run_main):
    src = write_two_floats(tmp_path / "s.safetensors")
    far = str(tmp_path) + "/." * 2100 + "/s.safetensors"  # > 4096 bytes, same file
    assert len(far) > 4096
    rc, _, err = run_main("convert", far, tmp_path / "out.safetensors")
    assert rc == 1
    line = assert_one_error_line(err)
    assert "cannot open the input: File name too long" in line and len(line) > 4096
    rc, _, err = run_main("convert", src, far[: -len("s.safetensors")] + "out.safetensors")
    assert rc == 1 and "File name too long" in assert_one_error_line(err)
    assert listing(tmp_path) == ["s.safetensors"]


def test_working_folder_deeper_than_path_max(tmp_path):
    """Relative paths work from a folder whose absolute path no syscall would accept."""
    home = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(20):  # 20 x 250 bytes > PATH_MAX
            os.mkdir("d" * 249, dir_fd=fd)
            nxt = os.open("d" * 249, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.fchdir(fd)
        write_safetensors("in.safetensors", {"a": ("F32", [1], b"\0\0\x80?")})
        r = stcast.convert("in.safetensors", "out.safetensors")
        assert (r.dst, sorted(os.listdir("."))) == (
            "out.safetensors",
            ["in.safetensors", "out.safetensors"],
        )
    finally:
        os.fchdir(home)
        os.close(home)
        os.close(fd)


# --- API misuse -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, 3, 1.5, ["m.safetensors"], object()], ids=repr)
def test_api_rejects_non_paths(small_model, bad):
    before = listing(small_model.parent)
    with pytest.raises(TypeError):
        stcast.convert(bad, small_model.parent / "out.safetensors")
    with pytest.raises(TypeError):
        stcast.convert(small_model, bad if bad is not None else 3)
    with pytest.raises(TypeError):
        stcast.inspect(bad)
    assert listing(small_model.parent) == before


@pytest.mark.parametrize("kind", [str, bytes, pathlib.Path, pathlib.PurePosixPath], ids=repr)
def test_api_accepts_path_types(small_model, kind):
    def as_kind(p):
        return os.fsencode(p) if kind is bytes else kind(str(p))

    report = stcast.convert(as_kind(small_model), as_kind(small_model.parent / "out.safetensors"))
    assert report.dst == str(small_model.parent / "out.safetensors")
    assert stcast.inspect(as_kind(small_model)).tensors[0].name == "a"


@pytest.mark.parametrize(
    "options, error",
    [
        ({"threads": -1}, stcast.UsageError),
        ({"threads": "2"}, stcast.UsageError),
        ({"threads": 1025}, stcast.UsageError),
        ({"threads": True}, stcast.UsageError),
        ({"keep_min_size": 2**64}, stcast.UsageError),
        ({"force": "yes"}, TypeError),
        ({"to": None}, stcast.UsageError),
        ({"exclude": None}, stcast.UsageError),
        ({"keep": None}, stcast.UsageError),
        ({"to": "int8"}, stcast.UsageError),
        ({"progress": 5}, TypeError),
        ({"cancel": object()}, AttributeError),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_api_bad_options(small_model, options, error):
    before = listing(small_model.parent)
    with pytest.raises(error):
        stcast.convert(small_model, small_model.parent / "out.safetensors", **options)
    assert listing(small_model.parent) == before


class Boom(Exception):
    pass


@pytest.mark.parametrize("raised", [Boom, SystemExit, KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("at_call", [1, 2])
def test_raising_progress_leaves_nothing(tmp_path, raised, at_call):
    check_raising_progress(tmp_path, raised, at_call)


def test_raising_progress_leaves_nothing_with_a_named_temp(tmp_path):
    """The same with the named temp file (failpoints are read once per process: a child)."""
    code = (
        "import sys, pathlib; sys.path.insert(0, sys.argv[2])\n"
        "from conftest import check_raising_progress\n"
        "class Boom(Exception):\n"
        "    pass\n"
        "for raised in (Boom, SystemExit, KeyboardInterrupt, MemoryError):\n"
        "    for at_call in (1, 2):\n"
        "        d = pathlib.Path(sys.argv[1]) / f'{raised.__name__}-{at_call}'\n"
        "        d.mkdir()\n"
        "        check_raising_progress(d, raised, at_call)\n"
    )
    env = {"STCAST_FAILPOINT": "tmpfile=eopnotsupp"}
    proc = run_python("-c", code, tmp_path, os.path.dirname(__file__), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_raising_warn_hook_leaves_nothing(tmp_path):
    """A plan warning turned into an error refuses the conversion before anything is written."""
    import warnings

    src = write_safetensors(tmp_path / "bf.safetensors", {"x": ("F32", [1], b"\x00\x00\x80\x3f")})
    with warnings.catch_warnings():
        warnings.simplefilter("error", stcast.StcastWarning)
        with pytest.raises(stcast.StcastWarning, match="keep pattern `typo`"):
            stcast.convert(src, tmp_path / "out.safetensors", keep=["typo"])
    assert listing(tmp_path) == ["bf.safetensors"]


@pytest.mark.parametrize(
    ("files", "words"),
    [
        (
            {".metadata": b"", "__0_0.distcp": b"", "__1_0.distcp": b""},
            "torch.distributed.checkpoint",
        ),
        (
            {"latest": b"global_step7\n", "global_step7/mp_rank_00_model_states.pt": b""},
            "DeepSpeed",
        ),
        ({"zero_pp_rank_0_mp_rank_00_model_states.pt": b""}, "DeepSpeed"),
    ],
)
def test_a_distributed_training_checkpoint_folder_is_named(tmp_path, run_main, files, words):
    """A DCP or DeepSpeed folder is no Hugging Face folder: before, it was "a directory
    without .safetensors files"; the engine now reads it as one checkpoint, and one of empty
    files is refused naming what it is, for every command, before anything is written."""
    src = tmp_path / "ckpt"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (["convert", src], ["inspect", src], ["verify", src, tmp_path / "out"]):
        rc, _, err = run_main(*args)
        line = assert_one_error_line(err)
        assert rc == 1 and words in line, line
    with pytest.raises(stcast.InvalidInput, match=words):
        stcast.convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_non_utf8_names_in_folders(tmp_path, run_main):
    """A folder whose files (a plain one, a shard group) are named in bytes that are not
    UTF-8: converted, verified and re-sharded under the same bytes."""
    src = os.fsencode(tmp_path) + b"/src"
    os.mkdir(src)
    write_two_floats(os.fsdecode(src + b"/m\xff.safetensors"))
    write_two_floats(os.fsdecode(src + b"/\xfe-00001-of-00001.safetensors"))
    with open(src + b"/notes\xfd.txt", "wb") as f:
        f.write(b"copied as it is")
    out = os.fsdecode(os.fsencode(tmp_path) + b"/out")
    rc, _, err = run_main("convert", "-q", os.fsdecode(src), out)
    assert (rc, err) == (0, "")
    assert sorted(os.listdir(os.fsencode(out))) == [
        b"m\xff.safetensors",
        b"notes\xfd.txt",
        b"\xfe-00001-of-00001.safetensors",
    ]
    rc, _, err = run_main("verify", "-q", os.fsdecode(src), out)
    assert (rc, err) == (0, "")
    # Re-sharded: a shard of one keeps the name; shards that need an index (JSON, which
    # cannot name them) are refused before any work, unless the output is named.
    out = os.fsdecode(os.fsencode(tmp_path) + b"/resharded")
    rc, _, err = run_main("convert", "-q", os.fsdecode(src), out, "--max-shard-size", "1KB")
    assert (rc, err) == (0, "")
    assert sorted(os.listdir(os.fsencode(out)))[0] == b"m\xff.safetensors"
    big = os.fsdecode(src + b"/big\xff.safetensors")
    row = np.ones(64, np.float32)
    write_safetensors(big, {n: ("F32", [64], row) for n in ("a", "b")})
    one = os.fsdecode(os.fsencode(tmp_path) + b"/one")
    rc, _, err = run_main("convert", big, one, "--max-shard-size", "300B")
    assert rc == 1 and "its name is not UTF-8" in assert_one_error_line(err)
    assert not os.path.exists(one)
    rc, _, err = run_main("convert", "-q", big, one, "--max-shard-size", "300B", "--name", "model")
    assert (rc, err) == (0, "")
    assert len(os.listdir(one)) == 3


def test_a_stem_that_is_not_utf8_names_the_file_by_its_path(tmp_path):
    """The refusal's `path` is the file a caller can open; its line names it as SRC does."""
    src = os.fsencode(tmp_path / "u")
    os.mkdir(src)
    row = np.ones(64, np.float32)
    write_safetensors(
        os.fsdecode(src + b"/w\xff.safetensors"), {n: ("F32", [64], row) for n in "ab"}
    )
    with pytest.raises(stcast.StcastError) as info:
        stcast.convert(os.fsdecode(src), tmp_path / "o", max_shard_size=300)
    assert info.value.path == os.fsdecode(src + b"/w\xff.safetensors")
    assert str(info.value).startswith("w\ufffd.safetensors: its name is not UTF-8")
    assert not os.path.exists(tmp_path / "o")
