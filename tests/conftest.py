"""Shared helpers: a raw safetensors writer and reader, the CLI runners, shared checks.

The writer builds headers itself, so tests can craft any header, valid or not; the reader
parses output files without trusting stcast (and keeps the JSON key order).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any, Union

import numpy as np
import pytest
import stcast
from helpers import MountNamespace, MountNamespaceUnavailable, run_cli

# Bits per element of every dtype the safetensors format names.
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

Data = Union[bytes, bytearray, memoryview, np.ndarray]


def nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * DTYPE_BITS[dtype] // 8


def _as_bytes(data: Data) -> bytes:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).tobytes()
    return bytes(data)


def encode_header(header: dict | str | bytes, pad: bool = True) -> bytes:
    """The 8-byte length prefix and the JSON header, space-padded to 8 when `pad`."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    if isinstance(header, str):
        header = header.encode()
    if pad:
        header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def write_raw(
    path: os.PathLike | str, header: dict | str | bytes, data: bytes = b"", pad: bool = True
) -> Path:
    """Write a file from a header (dict, JSON text or raw bytes) and the data section."""
    path = Path(path)
    path.write_bytes(encode_header(header, pad) + data)
    return path


def write_safetensors(
    path: os.PathLike | str,
    tensors: dict[str, tuple[str, list[int] | tuple[int, ...], Data]],
    metadata: dict[str, str] | None = None,
    key_order: list[str] | None = None,
    pad: bool = True,
) -> Path:
    """Write a safetensors file: data laid out in `tensors` order, header keys in `key_order`.

    `tensors` maps name -> (dtype, shape, bytes or ndarray). `key_order` lists the header
    keys (tensor names, and "__metadata__" where it should go); default: metadata first,
    then the tensors in data order. The data size is checked against dtype and shape.
    """
    entries: dict[str, Any] = {}
    chunks = []
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        raw = _as_bytes(data)
        assert len(raw) == nbytes(dtype, shape), (name, len(raw), dtype, shape)
        entries[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    if metadata is not None:
        entries["__metadata__"] = dict(metadata)
    if key_order is None:
        key_order = (["__metadata__"] if metadata is not None else []) + list(tensors)
    assert sorted(key_order) == sorted(entries), "key_order must list every key once"
    header = {k: entries[k] for k in key_order}
    return write_raw(path, header, b"".join(chunks), pad=pad)


def read_safetensors(path: os.PathLike | str) -> tuple[int, list[tuple[str, Any]], bytes]:
    """Parse a file: (header length, header items in JSON order, data section)."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    items = json.loads(raw[8 : 8 + n], object_pairs_hook=list)
    return n, items, raw[8 + n :]


def tensor_bytes(path: os.PathLike | str) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a file as name -> (dtype, shape, bytes)."""
    _, items, data = read_safetensors(path)
    out = {}
    for name, info in items:
        if name == "__metadata__":
            continue
        info = dict(info)
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[a:b])
    return out


def listing(folder: os.PathLike | str) -> list[str]:
    """Every entry of a folder, hidden ones included."""
    return sorted(os.listdir(folder))


def tree(folder: os.PathLike | str) -> dict[str, bytes | None]:
    """Every entry under `folder`, hidden ones included, by relative path: a regular file's
    bytes, None for anything else (folders, links, FIFOs). Equal trees: nothing changed."""
    out: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(root, name)
            regular = os.path.isfile(p) and not os.path.islink(p)
            out[os.path.relpath(p, folder)] = Path(p).read_bytes() if regular else None
    return out


def write_checkpoint_folder(root: os.PathLike | str, files: int = 2) -> Path:
    """A tiny sharded checkpoint: `files` weight files of one F32 tensor each, their index,
    a config.json and a tokenizer.json (for the folder tests where only the layout
    matters; tests/test_folder.py has realistic ones)."""
    root = Path(root)
    root.mkdir(parents=True)
    weight_map = {}
    for k in range(files):
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        weight_map[f"layers.{k}.weight"] = name
        x = np.linspace(-k, k + 1, 32, dtype=np.float32)
        write_safetensors(root / name, {f"layers.{k}.weight": ("F32", [4, 8], x)})
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text('{\n  "torch_dtype": "float32"\n}\n')
    (root / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return root


def main_in_process(*args: object, cwd: os.PathLike | str | None = None) -> tuple[int, str, str]:
    """Run `stcast.cli.main(ARGS)` in this process; return (exit code, stdout, stderr).

    For every test where no process boundary is under test (see helpers.py for the others).
    stdout and stderr are captured by swapping sys.stdout and sys.stderr; the warning filters
    and `warnings.showwarning` (which main sets for its commands) are checked to be as they
    were, and restored in any case, so that no run leaks state into the next test.
    """
    from stcast import cli

    argv = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    home = os.getcwd() if cwd is not None else None
    with warnings.catch_warnings():  # restores the filters and showwarning on the way out
        filters, show = list(warnings.filters), warnings.showwarning
        try:
            if cwd is not None:
                os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(argv)
        finally:
            if home is not None:
                os.chdir(home)
        leaked = list(warnings.filters) != filters or warnings.showwarning is not show
    assert not leaked, "stcast.cli.main left the warning filters or showwarning changed"
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def run_main():
    """The CLI in-process: `rc, out, err = run_main("convert", src, dst)`."""
    return main_in_process


@pytest.fixture
def cli_process():
    """The CLI in a child, `python -m stcast`: `rc, out, err = cli_process("convert", src,
    dst, env={...})`, for failpoints, exit codes of the process and the like (helpers.py)."""
    return run_cli


@pytest.fixture
def mount_ns():
    """A private mount namespace (helpers.MountNamespace) for tests that mount: bind mounts,
    small tmpfs. Skipped only without root and without user namespaces."""
    try:
        ns = MountNamespace()
    except MountNamespaceUnavailable as e:
        if os.geteuid() == 0:
            raise
        pytest.skip(f"mounting needs root or user namespaces: {e}")
    yield ns
    ns.close()


@pytest.fixture
def tmpfs(mount_ns, tmp_path):
    """mount(size) -> a fresh tmpfs folder of that size, in the private mount namespace."""

    def mount(size="1M", name="mnt"):
        d = tmp_path / name
        d.mkdir()
        return mount_ns.tmpfs(d, size)

    return mount


@pytest.fixture
def rng(request):
    """A numpy Generator with a fixed seed, printed so that a failure can be replayed."""
    seed = 20240229
    print(f"{request.node.nodeid}: numpy seed {seed}")
    return np.random.default_rng(seed)


def assert_one_error_line(stderr: str) -> str:
    """stderr is exactly one `stcast: ` line, without a traceback; return that line."""
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("stcast: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def assert_json_error_stderr(stderr: str) -> None:
    """With --json an error is on stdout; stderr holds at most the same one `stcast: ` line."""
    if stderr:
        assert_one_error_line(stderr)


# --- checks shared with a child process ---------------------------------------------------------


def check_raising_progress(folder: Path, raised: type[BaseException], at_call: int) -> None:
    """A progress callback that raises at its `at_call`-th call: the exception reaches the
    caller and `--force` leaves the old destination as it was, with no temp file. A child runs
    it too, with a failpoint armed (tests/test_bad_input.py)."""
    n = 1 << 16
    src = write_safetensors(folder / "in.safetensors", {"x": ("F32", [n], np.ones(n, "f4"))})
    dst = folder / "out.safetensors"
    dst.write_bytes(b"old")
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == at_call:
            raise raised("from progress")

    with pytest.raises(raised, match="from progress"):
        stcast.convert(src, dst, force=True, progress=progress)
    assert len(calls) == at_call
    assert listing(folder) == ["in.safetensors", "out.safetensors"]
    assert dst.read_bytes() == b"old"


def pytest_configure(config):
    # Started in the background by a script (`cmd &` without job control), the suite
    # inherits SIGINT ignored, and so would every child: the Ctrl-C tests need it delivered.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A plan warning a test did not ask for is a failure: expected ones use pytest.warns.
    config.addinivalue_line("filterwarnings", "error::stcast.StcastWarning")
    # Except the overflow guard's (--on-overflow warn): edge-value tables overflow on purpose.
    # tests/test_precision.py checks it with pytest.warns.
    config.addinivalue_line("filterwarnings", "ignore:.* became ±inf in:stcast.StcastWarning")
    # And the underflow warning: edge-value tables hold subnormals that become zero.
    config.addinivalue_line(
        "filterwarnings", "ignore:.* underflowed to zero in:stcast.StcastWarning"
    )
