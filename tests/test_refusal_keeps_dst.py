"""A refused run leaves DST as it was, also over an earlier output (`--force`, `--resume`).

An overflow that `--on-overflow error` refuses (or, under `keep`, a dequantized weight's,
which has no dtype of its own to keep) was found only while converting the file that holds
it: a folder run had replaced the earlier files of DST by then, and said "nothing was
written" (stop 38's attack, H5). Over an earlier output such a run now reads for it first,
and `--dry-run`/`inspect --scan` refuse what convert refuses (M5)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_error_line, write_safetensors
from helpers import stopped


def _fp8(scale: float) -> dict:
    """An FP8 weight of 448s times `scale` (1000 overflows F16 once dequantized)."""
    return {
        "weight": ("F8_E4M3", [4, 16], b"\x7e" * 64),
        "weight_scale": ("F32", [4, 1], np.full((4, 1), scale, np.float32)),
    }


def _f32(value: float) -> dict:
    """An F32 weight of `value`s (1e6 overflows F16)."""
    return {"weight": ("F32", [4, 16], np.full((4, 16), value, np.float32))}


KINDS = {
    # name: (the second file's tensors, what is refused, the options)
    "cast-error": (_f32, (1.0, 1e6), ["--on-overflow", "error"]),
    "dequantized-error": (_fp8, (1.0, 1000.0), ["--on-overflow", "error"]),
    "dequantized-keep": (_fp8, (1.0, 1000.0), ["--on-overflow", "keep"]),
}


def _folder(path: Path, make, values: tuple[float, float]) -> Path:
    """Two shards and their index: the first converts, the second overflows F16."""
    path.mkdir()
    weight_map = {}
    for i, value in enumerate(values, start=1):
        name = f"model-0000{i}-of-00002.safetensors"
        tensors = {f"layer{i}.{k}": v for k, v in make(value).items()}
        write_safetensors(path / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text('{"model_type": "llama"}\n')
    return path


def _state(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file of `folder`: (device, inode, bytes)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = Path(root) / f
            st = p.stat()
            out[str(p.relative_to(folder))] = (st.st_dev, st.st_ino, p.read_bytes())
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["plain", "resharded"])
def test_a_refused_force_run_leaves_an_earlier_output_as_it_was(tmp_path, run_main, kind, layout):
    make, values, options = KINDS[kind]
    src = _folder(tmp_path / "src", make, values)
    dst = tmp_path / "out"
    shards = ["--max-shard-size", "200B"] if layout == "resharded" else []
    # An earlier output, written with the overflow let through (a warning).
    rc, _, err = run_main("convert", src, dst, "--to", "fp16", *shards, "-q")
    assert rc == 0, err
    before = _state(dst)
    assert len(before) >= 3, before.keys()
    # The source changed since: the run would replace every weight file.
    first = src / "model-00001-of-00002.safetensors"
    write_safetensors(first, {f"layer1.{k}": v for k, v in make(values[0] / 2).items()})
    rc, _, err = run_main("convert", src, dst, "--to", "fp16", *shards, *options, "--force")
    assert rc == 1, err
    # (`keep` says first that it reads the input once more.)
    line = assert_one_error_line(err.splitlines(keepends=True)[-1])
    assert "model-00002-of-00002.safetensors" in line, line
    assert "±inf in F16" in line, line
    assert _state(dst) == before  # the same files, by inode too: none replaced


@pytest.mark.parametrize("how", ["truncated", "bad-header"])
@pytest.mark.parametrize("into", ["new", "force"])
@pytest.mark.parametrize("layout", ["plain", "resharded"])
def test_an_input_broken_during_the_run_rolls_it_back(tmp_path, how, into, layout):
    """A weight file of SRC broken once the run began (truncated, or its header) is bad
    input when its conversion opens it, or an input that changed while read (a re-sharding
    opened it planning): the run is rolled back as for bad input found while converting
    (`--resume` would fail again), DST as it was, not left with the first shard and a
    manifest (the write side's move into the engine lost this, attack atk2)."""
    src = _folder(tmp_path / "src", _f32, (1.0, 2.0))
    dst = tmp_path / "out"
    force: list[str] = []
    if into == "force":
        dst.mkdir()
        (dst / "mine.txt").write_text("mine\n")
        force = ["--force"]
    before = _state(dst) if dst.exists() else None
    shards = ["--max-shard-size", "200B"] if layout == "resharded" else []
    run = stopped("convert", src, dst, *force, *shards, "-q", at="folder-file")
    second = src / "model-00002-of-00002.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[:-8] if how == "truncated" else data[:8] + b"x" * 8 + data[16:])
    rc, err = run.run_through()
    assert rc == 1, err
    assert "model-00002-of-00002.safetensors" in assert_one_error_line(err), err
    assert (_state(dst) if dst.exists() else None) == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_dry_run_refuses_what_convert_refuses(tmp_path, run_main, kind):
    """`--dry-run` (and `inspect --scan` under `error`) said such a run would pass."""
    make, values, options = KINDS[kind]
    src = write_safetensors(tmp_path / "one.safetensors", make(values[1]))
    dst = tmp_path / "one-fp16.safetensors"
    rc, _, convert_err = run_main("convert", src, dst, "--to", "fp16", *options)
    assert rc == 1, convert_err
    rc, _, err = run_main("convert", src, dst, "--to", "fp16", *options, "--dry-run")
    assert rc == 1, err
    last = err.splitlines(keepends=True)[-1]
    assert assert_one_error_line(last) == convert_err.splitlines()[-1]
    if "error" in options:
        rc, _, err = run_main("inspect", src, "--to", "fp16", *options, "--scan")
        assert rc == 1, err
        assert "±inf in F16" in assert_one_error_line(err)
    assert not dst.exists()


def test_a_refused_run_into_a_new_folder_leaves_nothing(tmp_path, run_main):
    """Without an earlier output nothing is read first: a failed run removes what it
    added, DST too."""
    src = _folder(tmp_path / "src", _f32, (1.0, 1e6))
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--to", "fp16", "--on-overflow", "error")
    assert rc == 1, err
    assert "model-00002-of-00002.safetensors" in assert_one_error_line(err)
    assert not dst.exists()


def test_a_dequantized_overflow_suggests_what_holds_it(tmp_path, run_main):
    """A dequantized weight that overflows F16 was told to keep its dtype (`--on-overflow
    keep`, `--keep`), both refused for it (attack z10, r13): the advice is a wider target,
    which converts it."""
    src = write_safetensors(tmp_path / "f8.safetensors", _fp8(1000.0))
    rc, _, err = run_main("convert", src, tmp_path / "o.safetensors", "--to", "fp16")
    assert rc == 0, err
    assert "--to bf16 holds its values" in err and "--on-overflow keep" not in err, err
    rc, _, err = run_main(
        "convert", src, tmp_path / "e.safetensors", "--to", "fp16", "--on-overflow", "error"
    )
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "--to bf16 holds its values" in line and "--keep" not in line, line
    rc, _, err = run_main("convert", src, tmp_path / "b.safetensors", "--to", "bf16")
    assert rc == 0 and "±inf" not in err, err
    # A cast beside it can still keep its dtype: both are said.
    both = {**_fp8(1000.0), **{f"c.{k}": v for k, v in _f32(1e6).items()}}
    src = write_safetensors(tmp_path / "both.safetensors", both)
    rc, _, err = run_main(
        "convert", src, tmp_path / "p.safetensors", "--to", "fp16", "--on-overflow", "error"
    )
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert "1 of the 2 tensors dequantized" in line and "keep the others" in line, line


@pytest.mark.parametrize("what", ["folder", "fifo"])
def test_a_force_run_refuses_a_copy_target_that_is_no_file_first(tmp_path, run_main, what):
    """A file the run copies (README.md) that is a folder (or a FIFO) in DST: no run
    replaces it, so `--force` is refused before the first byte, naming it, not after the
    weights and the manifest were written with a message blaming another program (attack
    z11, r14)."""
    src = _folder(tmp_path / "src", _f32, (1.0, 2.0))
    (src / "README.md").write_text("readme\n")
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", src, dst, "--to", "fp16", "-q")
    assert rc == 0, err
    (dst / "README.md").unlink()
    if what == "folder":
        (dst / "README.md").mkdir()
    else:
        os.mkfifo(dst / "README.md")
    (dst / "README.md").rename(tmp_path / "aside")  # `_state` reads no FIFO
    before = _state(dst)
    (tmp_path / "aside").rename(dst / "README.md")
    rc, _, err = run_main("convert", src, dst, "--to", "fp16", "--force")
    assert rc == 1, err
    line = assert_one_error_line(err)
    assert f"{dst / 'README.md'}: destination is " in line, line
    assert "another" not in line, line
    (dst / "README.md").rename(tmp_path / "aside")
    assert _state(dst) == before


def test_a_refusal_points_to_no_force_that_is_refused_too(tmp_path, run_main):
    """A lone output model.safetensors in a folder a re-sharding named `model` writes
    into: a loader would read it instead of the new index, which `--force` does not
    change. Refused so with or without `--force`, not with a hint to it (attack z11, r16)."""
    tensors = {k: ("F32", [16, 16], np.ones((16, 16), np.float32)) for k in ("a", "b")}
    src = write_safetensors(tmp_path / "a.safetensors", tensors)
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out / "model.safetensors", "-q")
    assert rc == 0, err
    before = _state(out)
    for force in ([], ["--force"]):
        shards = ["--max-shard-size", "700B", "--name", "model"]
        rc, _, err = run_main("convert", src, out, *shards, *force, "-q")
        assert rc == 1, err
        line = assert_one_error_line(err)
        assert "`model.safetensors`, named as a file of this checkpoint's output" in line, line
        assert "--force" not in line, line
        assert _state(out) == before
