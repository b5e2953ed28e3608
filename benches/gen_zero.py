"""Generate a DeepSpeed ZeRO-2 (or, with --stage 3, ZeRO-3) checkpoint folder of a
Llama-shaped F32 model, without torch or DeepSpeed, for compare.py's ZeRO case.

The model has gen.py's shapes (`plan_tensors(SIZE_GIB)`), all in one parameter group, no
buffers, no frozen or shared parameters, trained in fp32 (no `fp16`/`bf16` section) with a
client `torch.optim.Adam` over RANKS data-parallel ranks. The folder is laid out as
DeepSpeed 0.19.8 writes it (tests/fixtures/zero: README.md, layout.txt, globals.txt):
`latest` (the tag, no newline), `zero_to_fp32.py` (the fixture's copy, as DeepSpeed copies
it into every checkpoint) and the tag folder `global_step1/` with:

- ZeRO-2: `mp_rank_00_model_states.pt`, whose `module` is the whole fp32 model as views into
  one flat storage padded to a multiple of 2 x RANKS (the flat buffer the ranks partition),
  with `buffer_names`, `param_shapes`, `frozen_param_shapes`, `shared_params`,
  `frozen_param_fragments`, `dp_world_size`, `ds_config`, `ds_version` and the rest; and per
  rank `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` with `single_partition_of_fp32_groups`
  (the rank's `P = padded / RANKS` elements of the flat buffer, the last rank's without its
  padding: `group_paddings`), `base_optimizer_state` (Adam's `step` and `exp_avg` and
  `exp_avg_sq` of P elements each), `param_slice_mappings` (`fragment_address`es),
  `param_alignment_paddings` (zeros), `partition_count` [RANKS], `zero_stage`, `loss_scaler`.
- ZeRO-3 (`stage3_param_persistence_threshold: 0`, as in the fixture): per rank
  `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (module params empty `(0,)` tensors) and
  `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` whose `fp32_flat_groups[0]` holds, for each
  parameter in `param_shapes` order, its `ceil(numel / RANKS)` elements of rank r
  (zero-padded at the parameter's end), pickled with `_rebuild_from_type_v2` and a `ds_id`;
  the Adam moments of the same size beside it, in a nested `optimizer_state_dict`.

Every `.pt` is a `torch.save` zip (pickle protocol 2, archive folder named after the file,
one entry per storage: gen_dcp.py's zip writer), written 64 MiB at a time, so the model is
never in memory. Parameter values are N(0, 0.02) float32 from a seed per (parameter, 4 Mi
element block), so that any slice of a parameter can be made on its own (the ZeRO-2 module
and partitions hold the same values, as fp32 training leaves them); Adam's moments are
slices of one random 64 MiB pool (read by DeepSpeed's loader, never compared).

Checked against DeepSpeed 0.19.8 + torch 2.15.0 (/work/venv-ds, DS_ACCELERATOR=cpu): with
--check, `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(DIR)` reads
the folder and gives every parameter the values written here, bit for bit (checked on 0.02
GiB over 1, 3 and 4 ranks and 1 GiB over 3 ranks, stages 2 and 3); and (--check over 3
ranks) `torch.load` of each file gives the same structure as the fixture's file of that name: the
same keys in the same order (the model's own names aside), types, tensor dtypes,
requires_grad flags and tensor subclass state (`ds_id`).

usage: python benches/gen_zero.py SIZE_GIB DIR [--ranks 3] [--stage 2|3] [--seed N] [--check]
compare.py runs this in a child process, so that the bench itself stays small.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gen import plan_tensors  # noqa: E402
from gen_dcp import (  # noqa: E402
    CHUNK_BYTES,
    ORDERED_DICT,
    Build,
    Call,
    Global,
    NewObj,
    Pid,
    Raw,
    Writer,
    _setitems,
    dumps,
    write_item,
)

TAG = "global_step1"
DS_VERSION = "0.19.8"
BLOCK = 4 << 20  # elements per seeded block of a parameter's values
FIXTURES = HERE.parent / "tests" / "fixtures" / "zero"

Put = Callable[[bytes | memoryview], None]
Shapes = list[tuple[str, tuple[int, ...]]]

# ---------------------------------------------------------------- values


class Values:
    """The parameters' values (seeded per block) and the optimizer's pool."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = np.random.default_rng([seed, 1 << 20])
        pool = rng.standard_normal(CHUNK_BYTES // 4, dtype=np.float32) * 1e-3
        self.pool = pool.data.cast("B")

    def param(self, index: int, numel: int, lo: int, hi: int) -> Iterator[np.ndarray]:
        """Elements [lo, hi) of parameter `index` (of numel elements), in pieces."""
        while lo < hi:
            block = lo // BLOCK
            start = block * BLOCK
            n = min(BLOCK, numel - start)
            rng = np.random.default_rng([self.seed, index, block])
            values = rng.standard_normal(n, dtype=np.float32)
            values *= 0.02
            end = min(hi, start + n)
            yield values[lo - start : end - start]
            lo = end

    def full(self, index: int, numel: int) -> np.ndarray:
        return np.concatenate(list(self.param(index, numel, 0, numel)) or [np.zeros(0, np.float32)])

    def pool_writer(self, nbytes: int, salt: str) -> Writer:
        def write(put: Put) -> None:
            at = zlib.crc32(salt.encode()) % 16384 * 4096 % len(self.pool)
            left = nbytes
            while left:
                n = min(left, len(self.pool) - at)
                put(self.pool[at : at + n])
                left -= n
                at = 0

        return write


def zeros(put: Put, count: int) -> None:
    if count:
        put(bytes(4 * count))


# ---------------------------------------------------------------- pickle pieces


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.insert(0, n)
        n *= d
    return tuple(out)


def storage_pid(key: int, numel: int, cls: str = "FloatStorage") -> Pid:
    return Pid(("storage", Global("torch", cls), str(key), "cpu", numel))


def tensor(
    key: int, numel: int, shape: tuple[int, ...], offset: int = 0, grad: bool = False
) -> Call:
    """`torch._utils._rebuild_tensor_v2` of a contiguous F32 tensor in storage `key`."""
    args = (storage_pid(key, numel), offset, shape, strides(shape), grad, ORDERED_DICT)
    return Call(Global("torch._utils", "_rebuild_tensor_v2"), args)


def torch_size(dims: tuple[int, ...]) -> Call:
    return Call(Global("torch", "Size"), (tuple(dims),))


def ordered(items: list[tuple[Any, Any]]) -> Any:
    """`OrderedDict(items)`: OrderedDict() then SETITEMS, as torch pickles it."""
    out = bytearray(b"ccollections\nOrderedDict\n)R")
    _setitems(items, out)
    return Raw(bytes(out))


def loss_scaler() -> Build:
    return Build(
        NewObj(Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")),
        {"cur_scale": 1.0, "dynamic": False},
    )


def zero_stage(stage: int) -> Call:
    return Call(Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (stage,))


def fragment(numel: int, start: int) -> Build:
    return Build(
        NewObj(Global("deepspeed.utils.tensor_fragment", "fragment_address")),
        {"numel": numel, "start": start},
    )


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # ZeRO-3: no parameter stays whole on every rank (the fixtures' setting; DeepSpeed's
        # default keeps those under 1e5 elements whole in the module, not in the partitions)
        "zero_optimization": {"stage": 2}
        if stage == 2
        else {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }


def adam_groups() -> list[dict[str, Any]]:
    return [
        {
            "lr": 0.0003,
            "betas": (0.9, 0.95),
            "eps": 1e-08,
            "weight_decay": 0,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": False,
            "params": [0],
        }
    ]


def adam_state(first_key: int, numel: int) -> dict[str, Any]:
    """Adam's state of one flat partition: step (storage first_key), exp_avg, exp_avg_sq."""
    return {
        "state": {
            0: {
                "step": tensor(first_key, 1, ()),
                "exp_avg": tensor(first_key + 1, numel, (numel,)),
                "exp_avg_sq": tensor(first_key + 2, numel, (numel,)),
            }
        },
        "param_groups": adam_groups(),
    }


def model_states(module: list[tuple[str, Any]], shapes: Shapes, stage: int, ranks: int) -> bytes:
    state = {
        "module": ordered(module),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [ordered([(n, torch_size(s)) for n, s in shapes])],
        "frozen_param_shapes": ordered([]),
        "shared_params": {},
        "frozen_param_fragments": ordered([]),
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": 1,
        "global_samples": ranks,
        "dp_world_size": ranks,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config(stage),
        "ds_version": DS_VERSION,
    }
    return dumps(state)


# ---------------------------------------------------------------- the zip files


def save(path: Path, pickle: bytes, storages: list[tuple[int, Writer]]) -> None:
    """`torch.save` of an object whose storages are `storages` (keys 0, 1, ...) into path."""
    arch = path.stem
    entries: list[tuple[str, bytes | tuple[int, Writer]]] = [
        (f"{arch}/data.pkl", pickle),
        (f"{arch}/.format_version", b"1"),
        (f"{arch}/.storage_alignment", b"64"),
        (f"{arch}/byteorder", b"little"),
    ]
    entries += [(f"{arch}/data/{k}", s) for k, s in enumerate(storages)]
    entries += [(f"{arch}/version", b"3\n"), (f"{arch}/.data/serialization_id", b"0" * 40)]
    with open(path, "wb") as f:
        write_item(f, entries)


def step_storage() -> tuple[int, Writer]:
    one = np.array(1.0, dtype=np.float32).tobytes()
    return 4, lambda put: put(one)


def flat_writer(values: Values, shapes: Shapes, lo: int, hi: int) -> Writer:
    """ZeRO-2: elements [lo, hi) of the flat buffer (the parameters back to back, then zeros)."""

    def write(put: Put) -> None:
        at = 0
        for i, (_, shape) in enumerate(shapes):
            n = math.prod(shape)
            a, b = max(lo, at), min(hi, at + n)
            for piece in values.param(i, n, a - at, b - at) if a < b else ():
                put(piece.data.cast("B"))
            at += n
        zeros(put, max(0, hi - max(lo, at)))

    return write


def write_stage2(tag: Path, values: Values, shapes: Shapes, ranks: int) -> None:
    total = sum(math.prod(s) for _, s in shapes)
    align = 2 * ranks
    padded = -(-total // align) * align
    part = padded // ranks
    module, at = [], 0
    for name, shape in shapes:
        module.append((name, tensor(0, padded, shape, offset=at)))
        at += math.prod(shape)
    pickle = model_states(module, shapes, 2, ranks)
    module_flat = (4 * padded, flat_writer(values, shapes, 0, padded))
    save(tag / "mp_rank_00_model_states.pt", pickle, [module_flat])
    for r in range(ranks):
        lo, hi = r * part, min((r + 1) * part, total)
        hi = max(hi, lo)
        mappings, at = [], 0
        for name, shape in shapes:
            n = math.prod(shape)
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                mappings.append((name, fragment(b - a, a - lo)))
            at += n
        osd = {
            "loss_scaler": loss_scaler(),
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": 1.0,
            "base_optimizer_state": adam_state(0, part),
            "single_partition_of_fp32_groups": [tensor(3, hi - lo, (hi - lo,), grad=True)],
            "zero_stage": zero_stage(2),
            "group_paddings": [part - (hi - lo)],
            "param_alignment_paddings": [[0] * len(shapes)],
            "partition_count": [ranks],
            "ds_version": DS_VERSION,
            "param_slice_mappings": [ordered(mappings)],
        }
        state = {"optimizer_state_dict": osd, "ds_config": ds_config(2), "ds_version": DS_VERSION}
        storages = [
            step_storage(),
            (4 * part, values.pool_writer(4 * part, f"{r}.exp_avg")),
            (4 * part, values.pool_writer(4 * part, f"{r}.exp_avg_sq")),
            (4 * (hi - lo), flat_writer(values, shapes, lo, hi)),
        ]
        save(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", dumps(state), storages)


def write_stage3(tag: Path, values: Values, shapes: Shapes, ranks: int) -> None:
    cuts = [-(-math.prod(s) // ranks) for _, s in shapes]
    flat = sum(cuts)
    for r in range(ranks):
        module = [(name, tensor(k, 0, (0,))) for k, (name, _) in enumerate(shapes)]
        pickle = model_states(module, shapes, 3, ranks)
        empty: Writer = lambda put: None  # noqa: E731
        name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        save(tag / name, pickle, [(0, empty)] * len(shapes))

        def write(put: Put, r: int = r) -> None:
            for i, ((_, shape), c) in enumerate(zip(shapes, cuts)):
                n = math.prod(shape)
                lo, hi = min(r * c, n), min((r + 1) * c, n)
                for piece in values.param(i, n, lo, hi):
                    put(piece.data.cast("B"))
                zeros(put, c - (hi - lo))

        flat_tensor = Call(
            Global("torch._tensor", "_rebuild_from_type_v2"),
            (
                Global("torch._utils", "_rebuild_tensor_v2"),
                Global("torch", "Tensor"),
                (storage_pid(3, flat), 0, (flat,), (1,), True, ORDERED_DICT),
                {"ds_id": f"0_{len(shapes) - 1}"},
            ),
        )
        osd = {
            "zero_stage": zero_stage(3),
            "loss_scaler": loss_scaler(),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": ranks,
            "optimizer_state_dict": adam_state(0, flat),
            "fp32_flat_groups": [flat_tensor],
        }
        state = {"optimizer_state_dict": osd, "ds_config": ds_config(3), "ds_version": DS_VERSION}
        storages = [
            step_storage(),
            (4 * flat, values.pool_writer(4 * flat, f"{r}.exp_avg")),
            (4 * flat, values.pool_writer(4 * flat, f"{r}.exp_avg_sq")),
            (4 * flat, write),
        ]
        save(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", dumps(state), storages)


def write_zero(folder: Path, size_gib: float, ranks: int, stage: int, seed: int) -> int:
    """Write the checkpoint folder (via DIR.partial, renamed at the end); return the model's
    F32 bytes."""
    shapes = [(n, tuple(s)) for n, s in plan_tensors(size_gib)]
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / TAG).mkdir(parents=True)
    values = Values(seed)
    (write_stage2 if stage == 2 else write_stage3)(tmp / TAG, values, shapes, ranks)
    (tmp / "latest").write_text(TAG)
    script = FIXTURES / "stage2-3ranks" / "zero_to_fp32.py"
    if script.exists():
        shutil.copyfile(script, tmp / "zero_to_fp32.py")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return 4 * sum(math.prod(s) for _, s in shapes)


def check(folder: Path, size_gib: float, seed: int) -> None:
    """Read the folder with DeepSpeed's own loader; compare every parameter bit for bit."""
    import torch  # the venv with DeepSpeed: /work/venv-ds
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    shapes = [(n, tuple(s)) for n, s in plan_tensors(size_gib)]
    state = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    assert list(state) == [n for n, _ in shapes], (list(state)[:4], len(state))
    values = Values(seed)
    for i, (name, shape) in enumerate(shapes):
        got = state.pop(name)
        assert tuple(got.shape) == shape and str(got.dtype) == "torch.float32", (name, got.shape)
        want = values.full(i, math.prod(shape)).view(np.uint32)
        if not np.array_equal(got.detach().contiguous().view(-1).numpy().view(np.uint32), want):
            sys.exit(f"check: {name} differs from what was written")
    print(f"check: DeepSpeed's loader gives the {len(shapes)} parameters written, bit for bit")
    model = folder / TAG / "mp_rank_00_model_states.pt"
    if model.exists():  # ZeRO-2: the module holds the same values
        module = torch.load(model, map_location="cpu", mmap=True, weights_only=False)["module"]
        for i, (name, shape) in enumerate(shapes):
            got = module[name].contiguous().view(-1).numpy().view(np.uint32)
            if not np.array_equal(got, values.full(i, math.prod(shape)).view(np.uint32)):
                sys.exit(f"check: the module's {name} differs from what was written")
        print(f"check: torch.load gives the module's {len(shapes)} parameters, the same values")


# the model's own names (the fixture's Tiny model is another model): keys not compared
MODEL_KEYED = ("module", "param_shapes", "param_slice_mappings", "frozen", "shared_params")


def same_structure(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where a loaded `.pt` differs from the fixture's file of the same name: dict types, keys
    and key order (but under the model's own names), value types, tensor dtypes, tensor
    types, requires_grad and subclass state (`ds_id`); lists by their first item."""
    import torch

    if isinstance(theirs, dict):
        if type(ours) is not type(theirs):
            return [f"{path}: {type(ours).__name__}, not {type(theirs).__name__}"]
        if any(k in path for k in MODEL_KEYED):
            return []
        if list(ours) != list(theirs):
            return [f"{path}: keys {list(ours)}, not {list(theirs)}"]
        return [d for k in theirs for d in same_structure(ours[k], theirs[k], f"{path}.{k}")]
    if isinstance(theirs, list) and isinstance(ours, list):
        return same_structure(ours[0], theirs[0], f"{path}[0]") if ours and theirs else []
    if isinstance(theirs, torch.Tensor):
        a = (type(ours), getattr(ours, "dtype", None), getattr(ours, "requires_grad", None))
        b = (type(theirs), theirs.dtype, theirs.requires_grad)
        if a != b or set(vars(ours)) != set(vars(theirs)):
            return [f"{path}: tensor {a} {vars(ours)}, not {b} {vars(theirs)}"]
        return []
    if type(ours) is not type(theirs):
        return [f"{path}: {type(ours).__name__}, not {type(theirs).__name__}"]
    return []


def check_structure(folder: Path, stage: int) -> None:
    """Compare every file's structure with the real fixture's (tests/fixtures/zero)."""
    import torch

    fixture = FIXTURES / f"stage{stage}-3ranks" / TAG
    if not fixture.is_dir():
        print(f"check: no {fixture} to compare the structure with")
        return
    names = sorted(p.name for p in fixture.glob("*.pt"))
    if sorted(p.name for p in (folder / TAG).glob("*.pt")) != names:
        sys.exit(f"check: the files are not {names} (the fixture's: compare with --ranks 3)")
    for name in names:
        ours, theirs = (
            torch.load(d / name, map_location="cpu", mmap=True, weights_only=False)
            for d in (folder / TAG, fixture)
        )
        diffs = same_structure(ours, theirs)
        if diffs:
            sys.exit(f"check: {name} differs from the fixture's: " + "; ".join(diffs[:5]))
    print(f"check: the {len(names)} files have the structure of {fixture.parent.name}'s")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("size", type=float, metavar="SIZE_GIB", help="the model's F32 data, in GiB")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--ranks", type=int, default=3, help="data-parallel ranks (default 3)")
    ap.add_argument("--stage", type=int, default=2, choices=(2, 3), help="ZeRO stage (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--check", action="store_true", help="then read it with DeepSpeed's zero_to_fp32 (venv-ds)"
    )
    args = ap.parse_args()
    if args.ranks < 1:
        ap.error("--ranks must be at least 1")
    data = write_zero(args.dir, args.size, args.ranks, args.stage, args.seed)
    print(
        f"{args.dir}: ZeRO-{args.stage} x{args.ranks}, model {data / (1 << 30):.3f} GiB, "
        f"{folder_bytes(args.dir):,} bytes"
    )
    if args.check:
        check(args.dir, args.size, args.seed)
        if args.ranks == 3:
            check_structure(args.dir, args.stage)


if __name__ == "__main__":
    main()
