"""Generate DCP folders whose `.metadata` is big beside a small model, without torch, to
measure what reading `.metadata` costs (issue 30, finding 9).

`.metadata` is written by Python's own pickler (the default protocol, MEMOIZE, FRAME,
SETITEMS in batches of 1000), as `dcp.save` writes it: the dataclasses are stand-ins
registered under torch's module names, so each is pickled as torch's (NEWOBJ of the class,
then BUILD with its `__dict__`; `TensorProperties` with its tuple state; `torch.Size` as a
call of `torch.Size` with a tuple; dtypes and layouts as torch reduces them). Only the
model's chunks are written to the rank files (by tests/dcpfile.py's `torch.save` writer);
the optimizer's entries point into the rank files but are never read by `--key model`.

Cases:
  adam    20,000 small model tensors, and Adam's exp_avg, exp_avg_sq and a 0-d step of each
          (one chunk each): about 80,000 entries.
  moe     18 small model tensors, and 1000 optimizer tensors (exp_avg and exp_avg_sq of 500
          experts' weights) cut over 256 ranks: 256,000 chunks (an MoE under FSDP).

usage: python benches/gen_dcp_meta.py {adam,moe} DIR [--tensors N] [--ranks N]
"""

from __future__ import annotations

import argparse
import enum
import os
import pickle
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from dcpfile import item_bytes  # noqa: E402

M = "torch.distributed.checkpoint.metadata"
FS = "torch.distributed.checkpoint.filesystem"


def _module(name: str) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            sys.modules[sub] = types.ModuleType(sub)
    return sys.modules[name]


def _register(module: str, obj: Any, name: str | None = None) -> Any:
    name = name or obj.__name__
    setattr(_module(module), name, obj)
    if isinstance(obj, type):
        obj.__module__ = module
        obj.__qualname__ = name
    return obj


class Size(tuple):  # noqa: SLOT001
    def __reduce__(self) -> Any:
        return (Size, (tuple(self),))


_register("torch", Size, "Size")


class _Dtype:
    def __init__(self, name: str) -> None:
        self.name = name
        self.__module__ = "torch"

    def __reduce__(self) -> str:
        return self.name


for _n in ("float32", "int64"):
    _register("torch", _Dtype(_n), _n)


def _get_layout(name: str) -> Any:
    raise NotImplementedError


_get_layout.__module__ = "torch.serialization"
_register("torch.serialization", _get_layout, "_get_layout")


class _Layout:
    def __reduce__(self) -> Any:
        return (_get_layout, ("torch.strided",))


class _MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801
    TORCH_CONTIGUOUS_FORMAT = 0


_register(M, _MEM_FORMAT_ENCODING)


@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


@dataclass
class TensorProperties:
    dtype: Any
    layout: Any
    requires_grad: bool = False
    pin_memory: bool = False

    def __getstate__(self) -> Any:
        enc = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
        return (self.dtype, self.layout, self.requires_grad, enc, self.pin_memory)

    def __setstate__(self, state: Any) -> None:
        raise NotImplementedError


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: Size | None = None
    index: int | None = None


@dataclass
class StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


@dataclass
class Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: str | None = None


for _c in (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
    BytesStorageMetadata,
    MetadataIndex,
    Metadata,
):
    _register(M, _c)
_register(FS, StorageInfo, "_StorageInfo")

LAYOUT = _Layout()
F32 = sys.modules["torch"].float32
I64 = sys.modules["torch"].int64


class Writer:
    """Entries of `.metadata`, and the model's items in rank 0's file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.sdm: dict[str, Any] = {}
        self.planner: dict[str, tuple[str, ...]] = {}
        self.storage: dict[MetadataIndex, StorageInfo] = {}
        self.rank0 = bytearray()
        self.items: dict[bytes, bytes] = {}

    def tensor(
        self,
        path: tuple[str, ...],
        shape: tuple[int, ...],
        chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]],
        value: np.ndarray | None = None,
    ) -> None:
        """One tensor of `path` in chunks (offsets, sizes, rank); `value`: write its items
        (one chunk, rank 0), else point them at offset 0 of their rank's file."""
        fqn = ".".join(path)
        metas = []
        for i, (offsets, sizes, rank) in enumerate(chunks):
            at, length = 0, 64
            if value is not None:
                data = self.items.get(value.tobytes()) or item_bytes(value)
                self.items[value.tobytes()] = data
                at, length = len(self.rank0), len(data)
                self.rank0 += data
            # A new str, as the gathered write results give it (not the key object).
            key = MetadataIndex("".join(fqn), Size(offsets), i)
            self.storage[key] = StorageInfo(f"__{rank}_0.distcp", at, length)
            metas.append(ChunkStorageMetadata(Size(offsets), Size(sizes)))
        dtype = F32 if value is None or value.dtype == np.float32 else I64
        props = TensorProperties(dtype, LAYOUT)
        self.sdm[fqn] = TensorStorageMetadata(props, Size(shape), metas)
        self.planner[fqn] = path

    def finish(self, ranks: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = Metadata(self.sdm, self.planner, self.storage, None, "1.0.0")
        with open(self.folder / ".metadata", "wb") as f:
            pickle.dump(meta, f)
        for r in range(ranks):
            data = bytes(self.rank0) if r == 0 else b""
            (self.folder / f"__{r}_0.distcp").write_bytes(data)


def adam(folder: Path, tensors: int) -> None:
    w = Writer(folder)
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(4, dtype=np.float32) for _ in range(64)]
    for i in range(tensors):
        value = values[i % len(values)]
        w.tensor(("model", f"layers.{i}.weight"), (4,), [((0,), (4,), 0)], value)
    for i in range(tensors):
        name = f"layers.{i}.weight"
        for state in ("exp_avg", "exp_avg_sq"):
            w.tensor(("optim", "state", name, state), (4,), [((0,), (4,), 0)])
        w.tensor(("optim", "state", name, "step"), (), [((), (), 0)])
    w.finish(1)


def moe(folder: Path, tensors: int, ranks: int) -> None:
    w = Writer(folder)
    rng = np.random.default_rng(0)
    for i in range(18):
        value = rng.standard_normal(8, dtype=np.float32)
        w.tensor(("model", f"layers.{i}.norm"), (8,), [((0,), (8,), 0)], value)
    rows = 4 * ranks
    for i in range(tensors // 2):
        name = f"layers.{i // 8}.experts.{i % 8}.w"
        cuts = [((r * 4, 0), (4, 64), r) for r in range(ranks)]
        for state in ("exp_avg", "exp_avg_sq"):
            w.tensor(("optim", "state", name, state), (rows, 64), cuts)
    w.finish(ranks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["adam", "moe"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--tensors", type=int)
    ap.add_argument("--ranks", type=int, default=256)
    a = ap.parse_args()
    if a.case == "adam":
        adam(a.dir, a.tensors or 20_000)
    else:
        moe(a.dir, a.tensors or 1000, a.ranks)
    print(f"{a.dir}: .metadata {os.path.getsize(a.dir / '.metadata') / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
