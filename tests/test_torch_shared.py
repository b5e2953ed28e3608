"""One storage key under several storage classes, end to end (issue 23, point A), and the
messages of point 7 for PyTorch inputs. What torch 2.15.0 does with these files is recorded
in tests/fixtures/torch/probe_shared_storage.py and rust/torch/tests/shared.rs."""

from __future__ import annotations

import numpy as np
import pytest
import stcast
import torchfile as tf
from conftest import assert_one_error_line, tensor_bytes
from reference import bf16_bits_ml_dtypes

pytestmark = pytest.mark.filterwarnings("ignore::stcast.StcastWarning")

DATA = np.arange(64, dtype=np.float32) + 0.5


def legacy_tensor(key, dtype, shape, numel):
    pid = ("storage", tf.Global("torch", tf.STORAGE_CLASS[dtype]), key, "cpu", numel, None)
    od = tf.Call(tf.Global("collections", "OrderedDict"))
    args = (tf.Pid(pid), 0, tuple(shape), (1,), False, od)
    return tf.Call(tf.Global("torch._utils", "_rebuild_tensor_v2"), args)


def write(path, refs, legacy):
    if legacy:
        obj = tf.Ordered([(n, legacy_tensor("0", d, [k], k)) for n, d, k in refs])
        tf.write_legacy(path, obj, [("0", refs[0][2], DATA.tobytes())])
    else:
        obj = tf.Ordered([(n, tf.tensor("0", d, [k], numel=k)) for n, d, k in refs])
        tf.write_zip(path, obj, {"0": DATA.tobytes()})


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_each_tensor_has_its_own_references_dtype(tmp_path, run_main, legacy):
    src = tmp_path / ("m.pth" if legacy else "m.pt")
    write(src, [("xi", "int32", 64), ("x", "float32", 64), ("h", "float16", 128)], legacy)
    dst = tmp_path / "out.safetensors"
    stcast.convert(src, dst, to="bf16")
    got = tensor_bytes(dst)
    assert got["xi"] == ("I32", [64], DATA.tobytes())
    assert got["x"] == ("BF16", [64], bf16_bits_ml_dtypes(DATA).tobytes())
    h = DATA.view(np.float16)
    assert got["h"] == ("BF16", [128], bf16_bits_ml_dtypes(h).tobytes())
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_references_of_another_byte_size_are_refused_by_name(tmp_path, run_main, legacy):
    src = tmp_path / ("m.pth" if legacy else "m.pt")
    write(src, [("x", "float32", 64), ("h", "float16", 64)], legacy)
    rc, _, err = run_main("convert", src, tmp_path / "out.safetensors")
    line = assert_one_error_line(err)
    assert rc == 1
    assert "tensor `h`: its reference to storage `0` says float16 of 128 bytes" in line, line


def test_an_empty_checkpoint_is_named_empty(tmp_path, run_main):
    src = tmp_path / "pytorch_model.bin"
    src.write_bytes(b"")
    rc, _, err = run_main("convert", src, tmp_path / "out.safetensors")
    line = assert_one_error_line(err)
    assert rc == 1 and "an empty file (0 bytes)" in line, line
    assert "invalid safetensors" not in line
