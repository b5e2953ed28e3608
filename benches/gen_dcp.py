"""Generate a `torch.distributed.checkpoint` (DCP) folder of a Llama-shaped F32 model, without
torch, for compare.py's DCP case.

The model has gen.py's shapes (`plan_tensors(SIZE_GIB)`), sharded as FSDP2 shards it over
RANKS ranks: every tensor cut in row bands of ceil(rows / RANKS) rows, the last band shorter
(uneven: 1024 rows on 3 ranks are 342 + 342 + 340). The state dict saved is
`{"model": model.state_dict()}`, with --optim also `"optim": get_optimizer_state_dict(...)`
of Adam: `exp_avg` and `exp_avg_sq` of every parameter, sharded like it, a 0-d `step` per
parameter and the `param_groups` values as Bytes items (pickled Python objects), laid out
as torch 2.15 lays them out (tests/fixtures/dcp/fsdp2-1d-3ranks): the optimizer doubles the
folder's tensor bytes a converter of the model must never read.

The layout is tests/dcpfile.py's (copied here: the benches do not import the tests):
`.metadata` is a pickle of `Metadata` whose dataclasses are made as pickle makes them
(NEWOBJ of the class, then BUILD with its state; tests/dcpfile.py calls the class instead,
which torch's own unpickler refuses); `__{rank}_0.distcp` holds, back to back, one
`torch.save` zip per chunk of that rank (the model's chunks first, then the optimizer's),
each zip laid out as torch writes it (stored entries, 64-byte aligned data, CRC-32s, data
descriptors, a ZIP64 end record). Data goes out 64 MiB at a time, so the model is never in
memory. Model values are N(0, 0.02) float32 from a seed per (tensor, rank) (every mantissa
bit random); the optimizer's are slices of one random 64 MiB pool (they are only read by
torch, never compared).

Checked against torch 2.15.0 (/work/venv-torch): `dcp_to_torch_save` and
`_load_state_dict_from_keys` read folders of 0.02 GiB (3 and 7 ranks, with --optim) and
1 GiB (3 ranks), giving the tensors stcast gives, bit for bit after `.to(torch.bfloat16)`.

usage: python benches/gen_dcp.py SIZE_GIB DIR [--ranks 3] [--optim] [--seed N]
compare.py runs this in a child process, so that the bench itself stays small.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gen import plan_tensors  # noqa: E402

CHUNK_BYTES = 64 << 20
M = "torch.distributed.checkpoint.metadata"
FS = "torch.distributed.checkpoint.filesystem"

# ---------------------------------------------------------------- a tiny protocol-2 pickler


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(frozen=True)
class Call:
    func: Any
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Pid:
    items: tuple[Any, ...]


@dataclass(frozen=True)
class Build:
    obj: Any
    state: Any


@dataclass(frozen=True)
class NewObj:
    """`cls.__new__(cls)`: the class, an empty tuple, NEWOBJ (how pickle makes dataclasses)."""

    cls: Global


@dataclass(frozen=True)
class Raw:
    ops: bytes


def _emit(v: Any, out: bytearray) -> None:
    if v is None:
        out += b"N"
    elif v is True:
        out += b"\x88"
    elif v is False:
        out += b"\x89"
    elif isinstance(v, int):
        if -(2**31) <= v < 2**31:
            out += b"J" + struct.pack("<i", v)
        else:
            out += b"\x8a\x08" + struct.pack("<q", v)
    elif isinstance(v, float):
        out += b"G" + struct.pack(">d", v)
    elif isinstance(v, str):
        b = v.encode("utf-8")
        out += b"X" + struct.pack("<I", len(b)) + b
    elif isinstance(v, tuple):
        out += b"("
        for x in v:
            _emit(x, out)
        out += b"t"
    elif isinstance(v, list):
        out += b"]"
        if v:
            out += b"("
            for x in v:
                _emit(x, out)
            out += b"e"
    elif isinstance(v, dict):
        out += b"}"
        _setitems(list(v.items()), out)
    elif isinstance(v, Global):
        out += b"c" + v.module.encode() + b"\n" + v.name.encode() + b"\n"
    elif isinstance(v, Call):
        _emit(v.func, out)
        _emit(tuple(v.args), out)
        out += b"R"
    elif isinstance(v, Pid):
        _emit(tuple(v.items), out)
        out += b"Q"
    elif isinstance(v, Build):
        _emit(v.obj, out)
        _emit(v.state, out)
        out += b"b"
    elif isinstance(v, NewObj):
        _emit(v.cls, out)
        out += b")\x81"
    elif isinstance(v, Raw):
        out += v.ops
    else:
        raise TypeError(f"cannot pickle {type(v).__name__}")


def _setitems(items: list[tuple[Any, Any]], out: bytearray) -> None:
    if items:
        out += b"("
        for k, x in items:
            _emit(k, out)
            _emit(x, out)
        out += b"u"


def dumps(v: Any) -> bytes:
    out = bytearray(b"\x80\x02")
    _emit(v, out)
    return bytes(out + b".")


ORDERED_DICT = Call(Global("collections", "OrderedDict"))


def tensor_pickle(shape: Sequence[int]) -> bytes:
    """What `torch.save` pickles for one contiguous F32 tensor in storage "0"."""
    stride, n = [], 1
    for d in reversed(shape):
        stride.insert(0, n)
        n *= d
    pid = ("storage", Global("torch", "FloatStorage"), "0", "cpu", math.prod(shape))
    return dumps(
        Call(
            Global("torch._utils", "_rebuild_tensor_v2"),
            (Pid(pid), 0, tuple(shape), tuple(stride), False, ORDERED_DICT),
        )
    )


# ---------------------------------------------------------------- torch.save's zip, streamed

Writer = Callable[[Callable[[bytes | memoryview], None]], None]


def write_item(f: BinaryIO, entries: list[tuple[str, bytes | tuple[int, Writer]]]) -> int:
    """Write one `torch.save` zip at f's position (offsets relative to its start, as torch
    writes an item into a .distcp file); return its length. An entry's data is bytes, or
    (size, writer) where writer(put) calls put with the data piece by piece."""
    base = f.tell()
    central = bytearray()
    for name, data in entries:
        header = f.tell() - base
        raw = name.encode()
        pad = (64 - (header + 30 + len(raw) + 4) % 64) % 64
        f.write(struct.pack("<IHHHIIIIHH", 0x04034B50, 0, 0x0808, 0, 0, 0, 0, 0, len(raw), 4 + pad))
        f.write(raw + struct.pack("<HH", 0x4246, pad) + b"Z" * pad)
        crc = 0
        if isinstance(data, bytes):
            size = len(data)
            f.write(data)
            crc = zlib.crc32(data)
        else:
            size, writer = data
            at = f.tell()

            def put(piece: bytes | memoryview) -> None:
                nonlocal crc
                crc = zlib.crc32(piece, crc)
                f.write(piece)

            writer(put)
            assert f.tell() - at == size, name
        f.write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        big = header >= 0xFFFFFFFF or size >= 0xFFFFFFFF
        small = 0xFFFFFFFF if big else None
        central += struct.pack(
            "<IHHHHIIIIHHHHHII",
            0x02014B50,
            0x031E,
            45,
            0x0808,
            0,
            0,
            crc,
            small or size,
            small or size,
            len(raw),
            28 if big else 0,
            0,
            0,
            0,
            0,
            small or header,
        )
        central += raw
        if big:
            central += struct.pack("<HHQQQ", 1, 24, size, size, header)
    cd = f.tell() - base
    n = len(entries)
    f.write(central)
    z64 = f.tell() - base
    f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, len(central), cd))
    f.write(struct.pack("<IIQI", 0x07064B50, 0, z64, 1))
    f.write(
        struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(n, 0xFFFF),
            min(n, 0xFFFF),
            min(len(central), 0xFFFFFFFF),
            min(cd, 0xFFFFFFFF),
            0,
        )
    )
    return f.tell() - base


def save_zip(f: BinaryIO, pickle: bytes, storage: tuple[int, Writer] | None) -> int:
    """`torch.save(obj)` into f: the entries torch 2.15 writes, in its order."""
    entries: list[tuple[str, bytes | tuple[int, Writer]]] = [
        ("archive/data.pkl", pickle),
        ("archive/.format_version", b"1"),
        ("archive/.storage_alignment", b"64"),
        ("archive/byteorder", b"little"),
    ]
    if storage is not None:
        entries.append(("archive/data/0", storage))
    entries += [("archive/version", b"3\n"), ("archive/.data/serialization_id", b"0" * 40)]
    return write_item(f, entries)


# ---------------------------------------------------------------- DCP's Metadata records


def record(cls: str, state: Any, module: str = M) -> Build:
    return Build(NewObj(Global(module, cls)), state)


def torch_size(dims: Sequence[int]) -> Call:
    return Call(Global("torch", "Size"), (tuple(dims),))


def properties(strides: Sequence[int]) -> Build:
    layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    mem = Call(Global(M, "_MEM_FORMAT_ENCODING"), (0,))
    return record(
        "TensorProperties", (Global("torch", "float32"), layout, False, mem, False, tuple(strides))
    )


def dict_ops(items: list[tuple[Any, Any]]) -> bytes:
    """A dict whose keys are records: EMPTY_DICT, the items, SETITEMS."""
    out = bytearray(b"}")
    _setitems(items, out)
    return bytes(out)


def bands(rows: int, ranks: int) -> list[tuple[int, int]]:
    """FSDP2's row bands: (first row, rows) per rank, ceil(rows / ranks) each, the last ones
    shorter or empty (torch lists and writes an empty chunk too)."""
    step = -(-rows // ranks)
    return [(min(r * step, rows), max(0, min(step, rows - r * step))) for r in range(ranks)]


@dataclass
class Entry:
    """One tensor of the state dict: its flat key, its path, its shape; how to fill it."""

    fqn: str
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    fill: str  # "model" (seeded per chunk), "pool" (the optimizer's), "step"
    index: int = 0


def entries(size_gib: float, optim: bool) -> list[Entry]:
    plan = plan_tensors(size_gib)
    out = [Entry(f"model.{n}", ("model", n), tuple(s), "model", i) for i, (n, s) in enumerate(plan)]
    if optim:
        for n, s in plan:
            for moment in ("step", "exp_avg", "exp_avg_sq"):
                shape = () if moment == "step" else tuple(s)
                fill = "step" if moment == "step" else "pool"
                path = ("optim", "state", n, moment)
                out.append(Entry(f"optim.state.{n}.{moment}", path, shape, fill))
    return out


def param_groups(names: list[str]) -> list[tuple[str, Any]]:
    """Adam's param_groups[0], as get_optimizer_state_dict flattens it (Bytes items)."""
    return [
        ("lr", 0.0003),
        ("betas", (0.9, 0.95)),
        ("eps", 1e-08),
        ("weight_decay", 0.1),
        ("amsgrad", False),
        ("maximize", False),
        ("foreach", None),
        ("capturable", False),
        ("differentiable", False),
        ("fused", None),
        ("decoupled_weight_decay", False),
        ("params", names),
    ]


def write_dcp(folder: Path, size_gib: float, ranks: int, optim: bool, seed: int) -> int:
    """Write the DCP folder (via DIR.partial, renamed at the end); return its tensor bytes."""
    tensors = entries(size_gib, optim)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng([seed, 1 << 20])
    pool = (rng.standard_normal(CHUNK_BYTES // 4, dtype=np.float32) * 1e-3).data.cast("B")
    storage: list[tuple[Any, Any]] = []
    chunks: dict[str, list[Build]] = {t.fqn: [] for t in tensors}
    groups = param_groups([n for n, _ in plan_tensors(size_gib)]) if optim else []
    data_bytes = 0
    for rank in range(ranks):
        name = f"__{rank}_0.distcp"
        with open(tmp / name, "wb") as f:
            if optim and rank == ranks - 1:  # torch put the Bytes items first, on one rank
                for key, value in groups:
                    at = f.tell()
                    length = save_zip(f, dumps(value), None)
                    fqn = f"optim.param_groups.0.{key}"
                    index = record("MetadataIndex", {"fqn": fqn, "index": None, "offset": None})
                    info = {"relative_path": name, "offset": at, "length": length}
                    storage.append((index, record("_StorageInfo", info, FS)))
            for t in tensors:
                if t.fill == "step":
                    if rank != ranks - 1:
                        continue
                    offsets, sizes = (), ()
                    value = np.array(1.0, dtype=np.float32).tobytes()
                    writer: Writer = lambda put, v=value: put(v)  # noqa: E731
                else:
                    first, count = bands(t.shape[0], ranks)[rank]
                    offsets = (first, *([0] * (len(t.shape) - 1)))
                    sizes = (count, *t.shape[1:])
                    writer = chunk_writer(t, rank, seed, math.prod(sizes), pool)
                nbytes = 4 * math.prod(sizes)
                data_bytes += nbytes
                at = f.tell()
                length = save_zip(f, tensor_pickle(sizes), (nbytes, writer))
                at_index = {
                    "fqn": t.fqn,
                    "index": len(chunks[t.fqn]),
                    "offset": torch_size(offsets),
                }
                index = record("MetadataIndex", at_index)
                info = {"relative_path": name, "offset": at, "length": length}
                storage.append((index, record("_StorageInfo", info, FS)))
                chunks[t.fqn].append(
                    record(
                        "ChunkStorageMetadata",
                        {"offsets": torch_size(offsets), "sizes": torch_size(sizes)},
                    )
                )
    sdm: list[tuple[Any, Any]] = []
    planner: list[tuple[Any, Any]] = []
    for t in tensors:
        strides, n = [], 1
        for d in reversed(t.shape):
            strides.insert(0, n)
            n *= d
        sdm.append(
            (
                t.fqn,
                record(
                    "TensorStorageMetadata",
                    {
                        "properties": properties(strides),
                        "size": torch_size(t.shape),
                        "chunks": chunks[t.fqn],
                    },
                ),
            )
        )
        planner.append((t.fqn, t.path))
    for key, _ in groups:
        fqn = f"optim.param_groups.0.{key}"
        sdm.append((fqn, Call(Global(M, "BytesStorageMetadata"), ())))
        planner.append((fqn, ("optim", "param_groups", 0, key)))
    meta = {
        "state_dict_metadata": dict(sdm),
        "planner_data": dict(planner),
        "storage_data": Raw(dict_ops(storage)),
        "storage_meta": record(
            "StorageMeta",
            {
                "checkpoint_id": Call(Global("pathlib", "PosixPath"), (folder.name,)),
                "save_id": "0",
                "load_id": None,
                "modules": [],
            },
        ),
        "version": "1.0.0",
    }
    (tmp / ".metadata").write_bytes(dumps(record("Metadata", meta)))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return data_bytes


def chunk_writer(t: Entry, rank: int, seed: int, count: int, pool: memoryview) -> Writer:
    """A writer of the chunk's `count` F32 values, 64 MiB at a time."""

    def write(put: Callable[[bytes | memoryview], None]) -> None:
        left = 4 * count
        if t.fill == "model":
            rng = np.random.default_rng([seed, t.index, rank])
            while left:
                n = min(left, CHUNK_BYTES) // 4
                values = rng.standard_normal(n, dtype=np.float32)
                values *= 0.02
                put(values.data.cast("B"))
                left -= 4 * n
            return
        # any slice of the pool: torch reads it, no one checks it
        at = zlib.crc32(t.fqn.encode()) % 16384 * 4096 % len(pool)
        while left:
            n = min(left, len(pool) - at)
            put(pool[at : at + n])
            left -= n
            at = 0

    return write


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("size", type=float, metavar="SIZE_GIB", help="the model's F32 data, in GiB")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--ranks", type=int, default=3, help="FSDP ranks (default 3: uneven bands)")
    ap.add_argument("--optim", action="store_true", help="add Adam's state (2x the model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.ranks < 1:
        ap.error("--ranks must be at least 1")
    data = write_dcp(args.dir, args.size, args.ranks, args.optim, args.seed)
    print(f"{args.dir}: {data / (1 << 30):.3f} GiB of tensors, {folder_bytes(args.dir):,} bytes")


if __name__ == "__main__":
    main()
