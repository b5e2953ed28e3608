"""Outputs stay byte for byte what they were: the SHA-256 of every file that each run writes
from the committed fixtures (and from two small folders made here, deterministically),
recorded in `tests/data/output-hashes.json`.

A refactoring of how runs are driven (the folder runs moving into the engine) must not
change one byte of any output. Recorded with `python tests/test_outputs_stable.py
--record` before such a change; a change that is meant to alter outputs records them again,
and its commit says why.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stcast  # noqa: E402
from torchfile import tensor, write_zip  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HASHES = Path(__file__).resolve().parent / "data" / "output-hashes.json"


def _values(shape: tuple[int, ...], seed: int, dtype: str = "float32") -> np.ndarray:
    """Deterministic values with a spread of magnitudes (rounding in every direction)."""
    n = int(np.prod(shape))
    x = np.sin(np.arange(n, dtype=np.float64) * (0.37 + seed)) * 10.0 ** ((np.arange(n) % 7) - 3)
    return x.reshape(shape).astype(dtype)


def _hf_safetensors(root: Path) -> Path:
    """A sharded safetensors folder: an index and a config in their authors' own
    formatting (edited in place), a tokenizer file copied, a nested folder."""
    src = root / "hf"
    src.mkdir()
    a = {"model.embed.weight": _values((64, 32), 1), "model.norm.weight": _values((32,), 2)}
    b = {
        "model.layers.0.mlp.weight": _values((96, 32), 3),
        "model.layers.0.bias": _values((96,), 4, "float16"),
        "model.layers.0.steps": np.arange(5, dtype=np.int64),
    }
    save_file(a, str(src / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(src / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in b})
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (src / "config.json").write_text(
        '{"torch_dtype":  "float32", "text_config": {"dtype": "float32"},\n'
        ' "name": "caf\\u00e9", "hidden_size": 32}\n'
    )
    (src / "tokenizer.json").write_text('{"vocab": {"a": 1}}')
    (src / "sub").mkdir()
    save_file({"w": _values((16, 8), 5)}, str(src / "sub" / "extra.safetensors"))
    return src


def _hf_torch(root: Path) -> Path:
    """A PyTorch folder: two .bin shards and their index (renamed to safetensors names)."""
    src = root / "pt"
    src.mkdir()
    shards = {
        "pytorch_model-00001-of-00002.bin": {"embed.weight": _values((40, 24), 6)},
        "pytorch_model-00002-of-00002.bin": {
            "head.weight": _values((24, 40), 7),
            "head.bias": _values((24,), 8, "float16"),
        },
    }
    weight_map = {}
    for name, tensors in shards.items():
        entries = {}
        state = {}
        for i, (key, value) in enumerate(tensors.items()):
            state[key] = tensor(str(i), value.dtype.name, value.shape)
            entries[str(i)] = value.tobytes()
        write_zip(src / name, state, entries)
        weight_map.update({k: name for k in tensors})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    (src / "config.json").write_text(json.dumps({"torch_dtype": "float32"}, indent=2))
    return src


def _fixture(*parts: str) -> Callable[[Path], Path]:
    return lambda root: FIXTURES.joinpath(*parts)


def _zero(root: Path) -> Path:
    """The ZeRO fixture's checkpoint alone (the fixture folder also holds the expected
    outputs, which would make it read as a Hugging Face folder)."""
    src = root / "zero"
    src.mkdir()
    fixture = FIXTURES / "zero" / "stage3-3ranks"
    shutil.copy(fixture / "latest", src / "latest")
    shutil.copytree(fixture / "global_step1", src / "global_step1")
    return src


# name -> (source, calls: [(api function, options)] writing into the one DST)
RUNS: dict[str, tuple[Callable[[Path], Path], list[tuple[str, dict[str, Any]]]]] = {
    "hf-bf16": (_hf_safetensors, [("convert", {})]),
    "hf-fp16": (_hf_safetensors, [("convert", {"to": "fp16"})]),
    "hf-keep": (_hf_safetensors, [("convert", {"keep": ["*norm*"]})]),
    "hf-fp8": (_hf_safetensors, [("convert", {"to": "fp8"})]),
    "hf-reshard": (_hf_safetensors, [("convert", {"max_shard_size": "6KB"})]),
    "hf-shards-finalized": (
        _hf_safetensors,
        [
            ("convert", {"shard": (1, 2)}),
            ("convert", {"shard": (2, 2)}),
            ("finalize", {}),
        ],
    ),
    "hf-reshard-shards-finalized": (
        _hf_safetensors,
        [
            ("convert", {"shard": (1, 2), "max_shard_size": "6KB"}),
            ("convert", {"shard": (2, 2), "max_shard_size": "6KB"}),
            ("finalize", {}),
        ],
    ),
    "pt-bf16": (_hf_torch, [("convert", {})]),
    "pt-reshard": (_hf_torch, [("convert", {"max_shard_size": "3KB", "name": "model"})]),
    "llama-fp8": (_fixture("fp8", "llama-fp32"), [("convert", {"to": "fp8"})]),
    "llama-fp8-block": (_fixture("fp8", "llama-fp32"), [("convert", {"to": "fp8-block"})]),
    "llama-fp8-reshard": (
        _fixture("fp8", "llama-fp32"),
        [("convert", {"to": "fp8", "max_shard_size": "60KB"})],
    ),
    "dcp-reshard": (
        _fixture("dcp", "fsdp2-1d-3ranks"),
        [("convert", {"max_shard_size": "600B", "key": "model"})],
    ),
    "zero-reshard": (
        _zero,
        [("convert", {"max_shard_size": "1KB"})],
    ),
}
# Every FP8 checkpoint fixture, dequantized.
for _d in sorted(p.name for p in (FIXTURES / "fp8").iterdir() if p.is_dir()):
    if _d != "llama-fp32":
        RUNS[f"dequant-{_d}"] = (_fixture("fp8", _d), [("convert", {})])


def _hashes(dst: Path) -> dict[str, str]:
    """Every file under `dst` (a folder, or one file) by relative path."""
    if dst.is_file():
        return {dst.name: hashlib.sha256(dst.read_bytes()).hexdigest()}
    return {
        p.relative_to(dst).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(dst.rglob("*"))
        if p.is_file()
    }


def _run(name: str, root: Path) -> dict[str, str]:
    make, calls = RUNS[name]
    work = root / name
    work.mkdir()
    src = make(work)
    dst = work / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stcast.StcastWarning)  # what a run says is not its bytes
        for fn, options in calls:
            if fn == "finalize":
                stcast.finalize(src, dst)
            else:
                getattr(stcast, fn)(src, dst, **options)
    return _hashes(dst)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_outputs_are_as_recorded(name: str, tmp_path: Path) -> None:
    recorded = json.loads(HASHES.read_text())
    assert name in recorded, f"no hashes recorded for {name}: run this file with --record"
    assert _run(name, tmp_path) == recorded[name]


def test_every_run_writes_something_and_the_record_has_no_stale_runs(tmp_path: Path) -> None:
    recorded = json.loads(HASHES.read_text())
    assert sorted(recorded) == sorted(RUNS)
    assert all(recorded[name] for name in RUNS)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = {name: _run(name, Path(tmp)) for name in sorted(RUNS)}
    HASHES.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(out)} runs, {sum(len(v) for v in out.values())} files into {HASHES}")
