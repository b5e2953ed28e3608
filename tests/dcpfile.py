"""Write `torch.distributed.checkpoint` (DCP) folders without torch, for tests.

`write_dcp(dir, tensors)` lays out what `dcp.save` writes: `.metadata`, a pickle of
`Metadata` whose dataclasses are records (NEWOBJ of the class, then BUILD with its state,
as `copyreg.__newobj__` pickles them: torch 2.15 reads what this writes), and
`__{rank}_0.distcp` files that hold one `torch.save` zip per chunk, back to back. The real
tool's output is in `fixtures/dcp/` (made by torch 2.15); this makes the cases torch would
not write (hostile ones, big ones).
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torchfile as tf

M = "torch.distributed.checkpoint.metadata"
FS = "torch.distributed.checkpoint.filesystem"


def newobj(cls: str, module: str = M) -> tf.Raw:
    """`cls.__new__(cls)`, as `copyreg.__newobj__` pickles a dataclass: the class, an empty
    tuple, NEWOBJ (torch's own unpickler refuses a call of the class, REDUCE)."""
    return tf.Raw(b"c" + module.encode() + b"\n" + cls.encode() + b"\n)\x81")


def record(cls: str, state: Any, module: str = M) -> tf.Build:
    """A dataclass record: NEWOBJ, then BUILD with its state."""
    return tf.Build(newobj(cls, module), state)


def size(dims: Sequence[int]) -> tf.Call:
    return tf.Call(tf.Global("torch", "Size"), (tuple(dims),))


def properties(dtype: str, strides: Sequence[int]) -> tf.Build:
    layout = tf.Call(tf.Global("torch.serialization", "_get_layout"), ("torch.strided",))
    mem = tf.Call(tf.Global(M, "_MEM_FORMAT_ENCODING"), (0,))
    return record(
        "TensorProperties", (tf.Global("torch", dtype), layout, False, mem, False, tuple(strides))
    )


TORCH_DTYPE = {"float32": "float32", "float16": "float16", "int64": "int64", "float64": "float64"}


@dataclass
class Tensor:
    """One tensor: its full value, its chunks as boxes (offsets, sizes), its key path."""

    value: np.ndarray
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
    path: tuple[Any, ...]
    # Per chunk: the rank file that holds it (default: chunk index modulo `ranks`).
    ranks: list[int] | None = None
    # Per chunk: what to write instead of the chunk's own values (a lie), if any.
    lie: dict[int, np.ndarray] = field(default_factory=dict)
    # Save each (2-D) chunk as torch saves `x.t()` of a contiguous `x`: a transposed view over
    # its whole storage (DCP writes such a tensor as it is).
    transposed: bool = False


def item_bytes(value: np.ndarray, transposed: bool = False) -> bytes:
    """`torch.save(tensor)` of a contiguous tensor (or of a transposed view of one), as a zip
    in memory."""
    if transposed:
        rows_, cols = value.shape
        obj = tf.tensor("0", value.dtype.name, (rows_, cols), stride=(1, rows_))
        data = np.ascontiguousarray(value.T).tobytes()
    else:
        value = np.ascontiguousarray(value)
        obj, data = tf.tensor("0", value.dtype.name, value.shape), value.tobytes()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.pt")
        tf.write_zip(p, obj, {"0": data})
        with open(p, "rb") as f:
            return f.read()


def _saved(obj: Any) -> bytes:
    """`torch.save(obj)` of an object that is no tensor, as a zip in memory."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "o.pt")
        tf.write_zip(p, obj, {})
        with open(p, "rb") as f:
            return f.read()


def box(value: np.ndarray, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    return value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def write_dcp(
    folder: str | os.PathLike[str],
    tensors: dict[str, Tensor],
    *,
    ranks: int = 2,
    bytes_items: Sequence[tuple[str, tuple[Any, ...]]] = (),
    storage_info: Callable[[str, int, dict[str, Any]], dict[str, Any]] | None = None,
    metadata: Callable[[dict[str, Any]], Any] | None = None,
) -> None:
    """Write a DCP folder of `tensors` (fqn -> Tensor) over `ranks` files. `bytes_items`:
    (fqn, path) entries of pickled objects (a Bytes item each). `storage_info(fqn, chunk,
    info)` may change an item's `_StorageInfo` fields; `metadata(state)` the whole state of
    `Metadata` (or return another root object)."""
    os.makedirs(folder, exist_ok=True)
    files: dict[int, io.BytesIO] = {r: io.BytesIO() for r in range(ranks)}
    sdm: list[tuple[Any, Any]] = []
    storage: list[tuple[Any, Any]] = []
    planner: list[tuple[Any, Any]] = []
    for fqn, t in tensors.items():
        chunks = []
        for i, (offsets, sizes) in enumerate(t.chunks):
            rank = t.ranks[i] if t.ranks is not None else i % ranks
            f = files[rank]
            data = item_bytes(t.lie.get(i, box(t.value, offsets, sizes)), t.transposed)
            at = f.tell()
            f.write(data)
            info: dict[str, Any] = {
                "relative_path": f"__{rank}_0.distcp",
                "offset": at,
                "length": len(data),
            }
            if storage_info is not None:
                info = storage_info(fqn, i, info)
            key = record("MetadataIndex", {"fqn": fqn, "index": i, "offset": size(offsets)})
            storage.append((key, record("_StorageInfo", info, FS)))
            chunks.append(
                record("ChunkStorageMetadata", {"offsets": size(offsets), "sizes": size(sizes)})
            )
        strides = [int(s) // t.value.itemsize for s in t.value.strides]
        sdm.append(
            (
                fqn,
                record(
                    "TensorStorageMetadata",
                    {
                        "properties": properties(TORCH_DTYPE[t.value.dtype.name], strides),
                        "size": size(t.value.shape),
                        "chunks": chunks,
                    },
                ),
            )
        )
        planner.append((fqn, tuple(t.path)))
    for fqn, path in bytes_items:
        f = files[0]
        data = _saved(3)  # torch.save of a plain object (a step count)
        at = f.tell()
        f.write(data)
        sdm.append((fqn, newobj("BytesStorageMetadata")))
        key = record("MetadataIndex", {"fqn": fqn, "index": None, "offset": None})
        info = {"relative_path": "__0_0.distcp", "offset": at, "length": len(data)}
        storage.append((key, record("_StorageInfo", info, FS)))
        planner.append((fqn, tuple(path)))
    meta = {
        "state_dict_metadata": dict(sdm),
        "planner_data": dict(planner),
        "storage_data": tf.Raw(_dict_ops(storage)),
        "storage_meta": record(
            "StorageMeta",
            {
                "checkpoint_id": tf.Call(tf.Global("pathlib", "PosixPath"), ("ckpt",)),
                "save_id": "0",
                "load_id": None,
                "modules": [],
            },
        ),
        "version": "1.0.0",
    }
    root = metadata(meta) if metadata is not None else record("Metadata", meta)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(tf.dumps(root))
    for r, f in files.items():
        with open(os.path.join(folder, f"__{r}_0.distcp"), "wb") as out:
            out.write(f.getvalue())


def _dict_ops(items: list[tuple[Any, Any]]) -> bytes:
    """A dict whose keys are records (unhashable in Python's dicts here): EMPTY_DICT, then
    the items, SETITEMS."""
    out = bytearray(b"}")
    if items:
        out += b"("
        for k, v in items:
            tf._emit(k, out)
            tf._emit(v, out)
        out += b"u"
    return bytes(out)


def rows(value: np.ndarray, cuts: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row bands of `value` (FSDP): chunks starting at each row of `cuts`."""
    edges = [*cuts, value.shape[0]]
    rest = tuple(value.shape[1:])
    return [((a, *([0] * len(rest))), (b - a, *rest)) for a, b in zip(edges, edges[1:])]
