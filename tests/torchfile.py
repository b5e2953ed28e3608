"""Write PyTorch checkpoints without torch, for tests (and the benchmark's inputs).

A tiny protocol-2 pickler over a value tree (`Global`, `Call`, `Pid`, `Build`, `Raw` for
hand-made opcodes, plus plain dicts, lists, tuples and scalars), and the two file layouts of
`torch.save`:

- `write_zip`: the zip format (torch >= 1.6) as torch lays it out: stored entries, flag bit 3
  with zero sizes in the local headers and a data descriptor after the data, each entry's
  data aligned to 64 bytes by an extra field, a central directory (with ZIP64 extra fields
  where needed) and always a ZIP64 end record. `gap` puts zero bytes before an entry (made
  with a seek: a sparse file, so offsets past 4 GiB cost nothing), `Hole(n)` is an entry of
  `n` zero bytes made the same way, and storages may be given as callables that write
  themselves (large inputs, written in chunks).
- `write_legacy`: the legacy format (torch < 1.6): the magic number, protocol and sys-info
  pickles, the main pickle, the storage keys, then each storage as an 8-byte element count
  and its bytes.

`tensor()` builds what `torch.save` pickles for one tensor (`_rebuild_tensor_v2` over a
persistent id naming its storage). Nothing here imports torch or unpickles anything.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Union

import numpy as np

# numpy dtype name -> (torch storage class, torch dtype global)
STORAGE_CLASS = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
    "bfloat16": "BFloat16Storage",
}


@dataclass(frozen=True)
class Global:
    """`module.name`, as GLOBAL writes it."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """`func(*args)`: the function, the argument tuple, REDUCE."""

    func: Any
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Pid:
    """A persistent id (BINPERSID) of a tuple."""

    items: tuple[Any, ...]


@dataclass(frozen=True)
class Build:
    """`obj`, then `state`, then BUILD."""

    obj: Any
    state: Any


@dataclass(frozen=True)
class Ordered:
    """`collections.OrderedDict()`, its items (SETITEMS), then BUILD with `state` if any
    (torch's `state_dict()` keeps `{"_metadata": ...}` there)."""

    items: Sequence[tuple[Any, Any]]
    state: Any = None


@dataclass(frozen=True)
class Raw:
    """Opcodes written as they are."""

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
    elif isinstance(v, bytes):
        out += b"C" + bytes([len(v)]) + v if len(v) < 256 else b"B" + struct.pack("<I", len(v)) + v
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
        _setitems(v.items(), out)
    elif isinstance(v, Ordered):
        _emit(Call(Global("collections", "OrderedDict")), out)
        _setitems(v.items, out)
        if v.state is not None:
            _emit(v.state, out)
            out += b"b"
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
    elif isinstance(v, Raw):
        out += v.ops
    else:
        raise TypeError(f"cannot pickle {type(v).__name__}")


def _setitems(items: Iterable[tuple[Any, Any]], out: bytearray) -> None:
    items = list(items)
    if not items:
        return
    out += b"("
    for k, x in items:
        _emit(k, out)
        _emit(x, out)
    out += b"u"


def dumps(v: Any) -> bytes:
    """A whole protocol-2 pickle of `v` (PROTO 2 ... STOP)."""
    out = bytearray(b"\x80\x02")
    _emit(v, out)
    out += b"."
    return bytes(out)


def tensor(
    key: str,
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int] | None = None,
    offset: int = 0,
    numel: int | None = None,
    view: tuple[str, int, int] | None = None,
    requires_grad: bool = False,
) -> Call:
    """`_rebuild_tensor_v2(('storage', torch.<Class>Storage, key, 'cpu', numel[, view]),
    offset, shape, stride, requires_grad, OrderedDict())`. `stride` defaults to row-major;
    `numel` (of the storage) to what the view reaches; `view` makes a legacy persistent id."""
    shape = tuple(shape)
    if stride is None:
        stride, n = [], 1
        for d in reversed(shape):
            stride.insert(0, n)
            n *= d
    stride = tuple(stride)
    if numel is None:
        numel = offset + (0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, stride)))
    pid: tuple[Any, ...] = ("storage", Global("torch", STORAGE_CLASS[dtype]), key, "cpu", numel)
    if view is not None:
        pid = (*pid, view)
    return Call(
        Global("torch._utils", "_rebuild_tensor_v2"),
        (
            Pid(pid),
            offset,
            shape,
            stride,
            requires_grad,
            Call(Global("collections", "OrderedDict")),
        ),
    )


@dataclass(frozen=True)
class Hole:
    """An entry of `size` zero bytes, made by a seek (a sparse file)."""

    size: int


# What an entry holds: bytes, a hole, or (size, writer) where writer(file) writes `size` bytes.
Data = Union[bytes, Hole, tuple[int, Callable[[BinaryIO], None]]]


@dataclass
class Entry:
    name: str
    data: Data
    method: int = 0  # the compression method written (the data is stored as given)
    gap: int = 0  # zero bytes before the local header (a seek)
    flags: int = 0x0808
    header_size: int | None = None  # a size for the central directory to claim instead


def _size(data: Data) -> int:
    if isinstance(data, bytes):
        return len(data)
    if isinstance(data, Hole):
        return data.size
    return data[0]


def write_entries(path: str | os.PathLike[str], entries: Sequence[Entry]) -> None:
    """Write a zip archive of `entries` as torch lays one out (see the module doc)."""
    central = bytearray()
    with open(path, "wb") as f:
        for e in entries:
            if e.gap:
                f.seek(e.gap, os.SEEK_CUR)
            header = f.tell()
            name = e.name.encode("utf-8")
            unpadded = header + 30 + len(name) + 4
            pad = (64 - unpadded % 64) % 64
            f.write(
                struct.pack(
                    "<IHHHIIIIHH", 0x04034B50, 45, e.flags, e.method, 0, 0, 0, 0, len(name), 4 + pad
                )
            )
            f.write(name + struct.pack("<HH", 0x4246, pad) + b"Z" * pad)
            size = _size(e.data)
            if isinstance(e.data, bytes):
                f.write(e.data)
            elif isinstance(e.data, Hole):
                f.seek(size, os.SEEK_CUR)
            else:
                at = f.tell()
                e.data[1](f)
                assert f.tell() - at == size, e.name
            f.write(struct.pack("<IIQQ", 0x08074B50, 0, size, size))
            claimed = size if e.header_size is None else e.header_size
            big = header >= 0xFFFFFFFF or claimed >= 0xFFFFFFFF
            small = (lambda x: 0xFFFFFFFF) if big else (lambda x: x)
            central += struct.pack(
                "<IHHHHIIIIHHHHHII",
                0x02014B50,
                0x031E,
                45,
                e.flags,
                e.method,
                0,
                0,
                small(claimed),
                small(claimed),
                len(name),
                28 if big else 0,
                0,
                0,
                0,
                0,
                small(header),
            )
            central += name
            if big:
                central += struct.pack("<HHQQQ", 1, 24, claimed, claimed, header)
        cd_offset = f.tell()
        n = len(entries)
        f.write(central)
        z64 = f.tell()
        f.write(
            struct.pack(
                "<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, len(central), cd_offset
            )
        )
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
                min(cd_offset, 0xFFFFFFFF),
                0,
            )
        )


def write_zip(
    path: str | os.PathLike[str],
    obj: Any,
    storages: dict[str, Data],
    *,
    prefix: str = "archive",
    byteorder: str = "little",
    gap: int = 0,
    pickle: bytes | None = None,
) -> None:
    """A torch zip checkpoint: `PREFIX/data.pkl` (the pickle of `obj`, or `pickle` as given),
    `PREFIX/byteorder`, `PREFIX/data/KEY` per storage (the first after `gap` zero bytes),
    `PREFIX/version`."""
    entries = [
        Entry(f"{prefix}/data.pkl", dumps(obj) if pickle is None else pickle),
        Entry(f"{prefix}/byteorder", byteorder.encode()),
    ]
    for i, (key, data) in enumerate(storages.items()):
        entries.append(Entry(f"{prefix}/data/{key}", data, gap=gap if i == 0 else 0))
    entries.append(Entry(f"{prefix}/version", b"3\n"))
    entries.append(Entry(f"{prefix}/.data/serialization_id", b"0123456789"))
    write_entries(path, entries)


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def write_legacy(
    path: str | os.PathLike[str],
    obj: Any,
    storages: Sequence[tuple[str, int, bytes]],
    *,
    little_endian: bool = True,
) -> None:
    """A legacy torch checkpoint; `storages` are (key, element count, bytes) in file order.
    Files of big-endian machines (`little_endian=False`) hold big-endian element counts (old
    torch versions); their numbers are little-endian all the same (torch converts them)."""
    magic = _LEGACY_MAGIC.to_bytes(10, "little")
    sys_info = {
        "protocol_version": 1001,
        "little_endian": little_endian,
        "type_sizes": {"short": 2, "int": 4, "long": 4},
    }
    with open(path, "wb") as f:
        f.write(b"\x80\x02\x8a\x0a" + magic + b".")
        f.write(dumps(1001))
        f.write(dumps(sys_info))
        f.write(dumps(obj))
        f.write(dumps([k for k, _, _ in storages]))
        for _, count, data in storages:
            f.write(struct.pack("<Q" if little_endian else ">Q", count))
            f.write(data)


@dataclass
class StateDict:
    """A state dict of numpy arrays laid out as `torch.save` lays out its storages: one
    storage per array (its bytes, C order, little-endian)."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def pickled(self) -> tuple[dict[str, Call], dict[str, bytes]]:
        """The pickled objects (name -> tensor) and the storages (key -> bytes)."""
        objs, storages = {}, {}
        for i, (name, a) in enumerate(self.arrays.items()):
            a = np.ascontiguousarray(a)
            key = str(i)
            storages[key] = a.astype(a.dtype.newbyteorder("<")).tobytes()
            objs[name] = tensor(key, a.dtype.name, a.shape, numel=a.size)
        return objs, storages
