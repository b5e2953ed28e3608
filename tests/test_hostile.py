"""Hostile input beyond tests/test_bad_input.py: more malformed files, odd paths, API misuse.

Each malformed file must give exit 1 and one `stcast: FILE: reason` line from the CLI,
`StcastError` from the API, no traceback and nothing new in the output folder.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import stcast
from conftest import (
    assert_one_error_line,
    check_raising_progress,
    listing,
    tensor_bytes,
    write_safetensors,
)
from helpers import cli_env
from test_bad_input import BAD_FILES, F32_1, convert_is_refused, t, write_bad
from test_bad_input import header_file as hf

ENTRY = json.dumps(t()).encode()
DEEP = 100_000

# (id, file bytes, words the message must contain): cases test_bad_input.py does not have.
MORE_BAD_FILES = [
    (
        "span-not-multiple-of-f32",
        hf({"a": t(offsets=[0, 6])}, F32_1 + b"\0\0"),
        ["tensor `a`", "needs 4 bytes", "give 6"],
    ),
    (
        "odd-span-f16",
        hf({"a": t("F16", [2], [0, 3])}, b"\0\0\0"),
        ["tensor `a`", "needs 4 bytes", "give 3"],
    ),
    ("negative-offset", hf({"a": t(offsets=[-4, 0])}, F32_1), ["integer `-4`"]),
    ("float-offsets", hf({"a": t(offsets=[0.0, 4.0])}, F32_1), ["floating point `0.0`"]),
    ("one-offset", hf({"a": {**t(), "data_offsets": [4]}}, F32_1), ["invalid length 1"]),
    ("offsets-string", hf({"a": {**t(), "data_offsets": "0-4"}}, F32_1), ['string "0-4"']),
    ("dtype-number", hf({"a": t(dtype=32)}, F32_1), ["integer `32`"]),
    ("missing-shape", hf({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, F32_1), ["`shape`"]),
    ("shape-2^64", hf({"a": t(shape=[1 << 64])}, F32_1), ["expected usize"]),
    ("tensor-is-list", hf({"a": [0, 4]}, F32_1), ["invalid type"]),
    (
        "metadata-nested-object",
        hf({"__metadata__": {"k": {"x": "y"}}, "a": t()}, F32_1),
        ["invalid type: map"],
    ),
    ("metadata-null-value", hf({"__metadata__": {"k": None}, "a": t()}, F32_1), ["null"]),
    (
        "metadata-twice",
        hf(b'{"__metadata__":{},"__metadata__":{},"a":' + ENTRY + b"}", F32_1),
        ["duplicate field `__metadata__`"],
    ),
    ("header-number", hf(b"42"), ["integer `42`"]),
    ("header-null", hf(b"null"), ["invalid type: null"]),
    ("header-spaces-only", hf(b"        "), ["EOF while parsing"]),
    ("utf8-bom", hf(b"\xef\xbb\xbf{}"), ["expected value"]),
    ("nul-after-json", hf(b"{}\x00"), ["trailing characters"]),
    ("lone-surrogate-escape", hf(b'{"\\ud800":' + ENTRY + b"}", F32_1), ["escape"]),
    (
        "objects-100000-deep",
        hf(b'{"a":' + b'{"b":' * DEEP + b"1" + b"}" * DEEP + b"}"),
        ["recursion limit"],
    ),
    (
        "second-tensor-past-eof",
        hf({"a": t(), "b": t(offsets=[4, 1 << 40])}, F32_1 * 2),
        ["tensor `b`"],
    ),
    (
        "duplicate-empty-name",
        hf(b'{"":' + ENTRY + b',"":' + ENTRY + b"}", F32_1),
        ["duplicate tensor name ``"],
    ),
    (
        "duplicate-name-far-apart",
        hf(
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


def test_catalogue_has_at_least_25_distinct_files():
    files = [data for _, data, _ in BAD_FILES + MORE_BAD_FILES]
    assert len(set(files)) == len(files) >= 25 + len(MORE_BAD_FILES)


@pytest.fixture(params=MORE_BAD_FILES, ids=[c[0] for c in MORE_BAD_FILES])
def bad_file(request, tmp_path):
    return write_bad(tmp_path, request.param)


def test_more_bad_input_cli_and_api(bad_file, cli):
    path, words = bad_file
    folder = path.parent
    before = listing(folder)
    line = convert_is_refused(cli, path, words)
    assert line.startswith(f"stcast: {path}: invalid "), line
    with pytest.raises(stcast.StcastError) as info:
        stcast.convert(path, folder / "out.safetensors")
    assert info.value.kind == "invalid_input" and info.value.path == str(path)
    assert str(info.value) == line[len("stcast: ") :]
    assert listing(folder) == before


# --- sources that are not files ---------------------------------------------------------------


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_source_is_a_device(tmp_path, cli, device):
    rc, _, err = cli("convert", device, tmp_path / "out.safetensors", timeout=30)
    assert rc == 1
    assert assert_one_error_line(err) == f"stcast: {device}: input is a device, not a regular file"
    with pytest.raises(stcast.StcastError) as info:
        stcast.inspect(device)
    assert info.value.kind == "refused"
    assert listing(tmp_path) == []


def test_source_is_a_socket(tmp_path, cli):
    import socket

    path = tmp_path / "s.safetensors"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        rc, _, err = cli("inspect", path, timeout=30)
    assert rc == 1 and "cannot open the input" in assert_one_error_line(err)  # ENXIO


def test_destination_is_a_dangling_symlink(tmp_path, cli):
    src = write_safetensors(tmp_path / "m.safetensors", {"a": ("F32", [1], F32_1)})
    link = tmp_path / "out.safetensors"
    link.symlink_to(tmp_path / "nowhere" / "x.safetensors")
    rc, _, err = cli("convert", src, link)
    assert rc == 1 and "destination exists" in assert_one_error_line(err)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


# --- names: non-UTF-8, 255 bytes, longer than PATH_MAX ----------------------------------------


def small_model(path):
    return write_safetensors(path, {"a": ("F32", [2], np.array([1.0, -2.0], np.float32))})


def test_non_utf8_names(tmp_path, cli):
    folder = os.fsencode(tmp_path)
    src = os.fsdecode(folder + b"/caf\xe9-\xff.safetensors")
    small_model(src)
    rc, _, err = cli("convert", "-q", src)
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
    rc, _, err = cli("convert", os.fsdecode(bad), os.fsdecode(folder + b"/x.safetensors"))
    assert rc == 1 and "header too small" in assert_one_error_line(err)
    with pytest.raises(stcast.StcastError) as info:
        stcast.inspect(bad)
    assert os.fsencode(info.value.path) == bad


def test_255_byte_names(tmp_path, cli):
    src = small_model(tmp_path / ("s" * 243 + ".safetensors"))  # 255 bytes
    dst = tmp_path / ("d" * 243 + ".safetensors")
    rc, _, err = cli("convert", "-q", src, dst)
    assert (rc, err) == (0, "")
    # The default name adds "-bf16": one byte too many for the file system, said clearly.
    os.remove(dst)
    before = listing(tmp_path)
    rc, _, err = cli("convert", src)
    assert rc == 1
    assert "File name too long" in assert_one_error_line(err)
    assert listing(tmp_path) == before


def test_path_longer_than_path_max(tmp_path, cli):
    src = small_model(tmp_path / "s.safetensors")
    far = str(tmp_path) + "/." * 2100 + "/s.safetensors"  # > 4096 bytes, same file
    assert len(far) > 4096
    rc, _, err = cli("convert", far, tmp_path / "out.safetensors")
    assert rc == 1
    line = assert_one_error_line(err)
    assert "cannot open the input: File name too long" in line and len(line) > 4096
    rc, _, err = cli("convert", src, far[: -len("s.safetensors")] + "out.safetensors")
    assert rc == 1 and "File name too long" in assert_one_error_line(err)
    assert listing(tmp_path) == ["s.safetensors"]


def test_working_folder_deeper_than_path_max(tmp_path):
    """Relative paths work from a folder whose absolute path no syscall would accept."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(20):  # 20 x 250 bytes > PATH_MAX
            os.mkdir("d" * 249, dir_fd=fd)
            nxt = os.open("d" * 249, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        code = (
            "import os, sys, stcast\n"
            "os.fchdir(int(sys.argv[1]))\n"
            "sys.path.insert(0, sys.argv[2])\n"
            "from conftest import write_safetensors\n"
            "write_safetensors('in.safetensors', {'a': ('F32', [1], b'\\0\\0\\x80?')})\n"
            "r = stcast.convert('in.safetensors', 'out.safetensors')\n"
            "print(r.dst, sorted(os.listdir('.')))\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(fd), os.path.dirname(__file__)],
            capture_output=True,
            text=True,
            timeout=60,
            env=cli_env(),
            pass_fds=(fd,),
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split(None, 1) == [
            "out.safetensors",
            "['in.safetensors', 'out.safetensors']\n",
        ]
    finally:
        os.close(fd)


# --- API misuse -------------------------------------------------------------------------------


@pytest.fixture
def model(tmp_path):
    return small_model(tmp_path / "m.safetensors")


@pytest.mark.parametrize("bad", [None, 3, 1.5, ["m.safetensors"], object()], ids=repr)
def test_api_rejects_non_paths(model, bad):
    before = listing(model.parent)
    with pytest.raises(TypeError):
        stcast.convert(bad, model.parent / "out.safetensors")
    with pytest.raises(TypeError):
        stcast.convert(model, bad if bad is not None else 3)
    with pytest.raises(TypeError):
        stcast.inspect(bad)
    assert listing(model.parent) == before


@pytest.mark.parametrize("kind", [str, bytes, pathlib.Path, pathlib.PurePosixPath], ids=repr)
def test_api_accepts_path_types(model, kind):
    def as_kind(p):
        return os.fsencode(p) if kind is bytes else kind(str(p))

    report = stcast.convert(as_kind(model), as_kind(model.parent / "out.safetensors"))
    assert report.dst == str(model.parent / "out.safetensors")
    assert stcast.inspect(as_kind(model)).tensors[0].name == "a"


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
        ({"to": "int8"}, stcast.UsageError),
        ({"progress": 5}, TypeError),
        ({"cancel": object()}, AttributeError),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_api_bad_options(model, options, error):
    before = listing(model.parent)
    with pytest.raises(error):
        stcast.convert(model, model.parent / "out.safetensors", **options)
    assert listing(model.parent) == before


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
    env = cli_env({"STCAST_FAILPOINT": "tmpfile=eopnotsupp"})
    here = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), here],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_raising_warn_hook_leaves_nothing(tmp_path):
    """A plan warning turned into an error refuses the conversion before anything is written."""
    import warnings

    src = write_safetensors(tmp_path / "bf.safetensors", {"x": ("BF16", [1], b"\x80\x3f")})
    with warnings.catch_warnings():
        warnings.simplefilter("error", stcast.StcastWarning)
        with pytest.raises(stcast.StcastWarning, match="nothing to convert"):
            stcast.convert(src, tmp_path / "out.safetensors")
    assert listing(tmp_path) == ["bf.safetensors"]
