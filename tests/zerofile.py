"""Write DeepSpeed ZeRO checkpoint folders without torch or DeepSpeed, for tests.

`write_zero(dir, groups, stage=2 or 3, ranks=N)` lays out what `engine.save_checkpoint`
writes (see `fixtures/zero/README.md`, made by DeepSpeed 0.19.8): `latest` naming the tag
folder (`global_step1/`), the model states (`mp_rank_00_model_states.pt` for ZeRO-1/2, one
`zero_pp_rank_{r}_mp_rank_00_model_states.pt` per rank for ZeRO-3) and one
`zero_pp_rank_{r}_mp_rank_00_optim_states.pt` per rank holding the fp32 masters:

- ZeRO-2: per group, the parameters one after another (each followed by its alignment
  padding), the tail padded to a multiple of 2 x ranks, cut in `ranks` equal partitions; the
  last rank's trailing padding is not saved (as DeepSpeed does);
- ZeRO-3: each parameter padded to a multiple of `ranks`, rank r taking its r-th part; a
  rank's group is its parts end to end.

Beside them sit Adam moments (`exp_avg`, `exp_avg_sq`) of each partition. The hooks let a
test lie (`optim_hook(rank, optimizer_state_dict)`, `model_hook(rank, root)`, `tail`: that
many elements more in every rank's first group).

Checked once against the real thing: DeepSpeed 0.19.8's `get_fp32_state_dict_from_zero_checkpoint`
(torch 2.15, `/work/venv-ds`) loads what this writes, ZeRO-2 with alignment paddings and
ZeRO-3, 2 groups, 4 ranks, buffers, a frozen and a tied parameter, and gives exactly the
arrays written (the loss scaler is pickled as DeepSpeed does, NEWOBJ then BUILD, so that
`torch.load(weights_only=False)` rebuilds it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torchfile as tf

TAG = "global_step1"


def stage_enum(stage: int) -> tf.Call:
    return tf.Call(tf.Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (stage,))


def loss_scaler() -> tf.Build:
    """As DeepSpeed pickles it: `copyreg.__newobj__` (NEWOBJ of no arguments), then BUILD."""
    newobj = b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n)\x81"
    return tf.Build(tf.Raw(newobj), {"cur_scale": 1.0, "dynamic": False})


def size(shape: tuple[int, ...]) -> tf.Call:
    return tf.Call(tf.Global("torch", "Size"), (tuple(shape),))


class Storages:
    """The storages of one file, keyed `0`, `1`, ..."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, a: np.ndarray) -> tf.Call:
        a = np.ascontiguousarray(a)
        key = str(len(self.data))
        self.data[key] = a.astype(a.dtype.newbyteorder("<")).tobytes()
        return tf.tensor(key, a.dtype.name, a.shape, numel=a.size)


def write_zero(
    root: os.PathLike[str] | str,
    groups: list[dict[str, np.ndarray]],
    *,
    stage: int = 2,
    ranks: int = 3,
    buffers: dict[str, np.ndarray] | None = None,
    frozen: dict[str, np.ndarray] | None = None,
    shared: dict[str, str] | None = None,
    paddings: list[list[int]] | None = None,
    tail: int = 0,
    tag: str = TAG,
    optim_hook: Callable[[int, dict[str, Any]], Any] | None = None,
    model_hook: Callable[[int, dict[str, Any]], Any] | None = None,
    module_params: bool = False,
) -> Path:
    """Write the checkpoint under `root` (`latest`, `global_step1/`); return the tag folder."""
    root = Path(root)
    (root / "latest").parent.mkdir(parents=True, exist_ok=True)
    (root / "latest").write_text(tag)
    tag_dir = root / tag
    tag_dir.mkdir()
    buffers = buffers or {}
    frozen = frozen or {}

    # Each rank's fp32 groups.
    parts: list[list[np.ndarray]] = [[] for _ in range(ranks)]
    for g, params in enumerate(groups):
        if stage <= 2:
            pads = paddings[g] if paddings else [0] * len(params)
            chunks = []
            for (_, a), pad in zip(params.items(), pads):
                chunks += [a.astype(np.float32).ravel(), np.zeros(pad, np.float32)]
            flat = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            used = flat.size
            align = 2 * ranks
            flat = np.concatenate([flat, np.zeros(-used % align, np.float32)])
            ps = flat.size // ranks
            for r in range(ranks):
                part = flat[r * ps : (r + 1) * ps]
                if r == ranks - 1:
                    part = part[: max(0, used - r * ps)]
                parts[r].append(part)
        else:
            per_rank: list[list[np.ndarray]] = [[] for _ in range(ranks)]
            for a in params.values():
                v = a.astype(np.float32).ravel()
                pn = math.ceil(v.size / ranks)
                v = np.concatenate([v, np.zeros(pn * ranks - v.size, np.float32)])
                for r in range(ranks):
                    per_rank[r].append(v[r * pn : (r + 1) * pn])
            for r in range(ranks):
                parts[r].append(
                    np.concatenate(per_rank[r]) if per_rank[r] else np.zeros(0, np.float32)
                )

    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    for r in range(ranks):
        if tail and parts[r]:
            # A lie: elements past what the layout says, on every rank's first group.
            parts[r][0] = np.concatenate([parts[r][0], np.zeros(tail, np.float32)])
        st = Storages()
        masters = [st.add(p) for p in parts[r]]
        total = sum(p.size for p in parts[r])
        moments = {
            "state": {
                0: {
                    "step": st.add(np.array(1.0, np.float32)),
                    "exp_avg": st.add(np.full(total, 7.0, np.float32)),
                    "exp_avg_sq": st.add(np.full(total, 9.0, np.float32)),
                }
            },
            "param_groups": [{"lr": 0.01, "params": [0]}],
        }
        osd: dict[str, Any] = {
            "zero_stage": stage_enum(stage),
            "loss_scaler": loss_scaler(),
            "partition_count": [ranks] if stage <= 2 else ranks,
            "base_optimizer_state" if stage <= 2 else "optimizer_state_dict": moments,
            key: masters,
        }
        if stage <= 2:
            osd["param_alignment_paddings"] = paddings or [[0] * len(p) for p in groups]
        if optim_hook is not None:
            osd = optim_hook(r, osd)
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states"
        tf.write_zip(
            tag_dir / f"{name}.pt",
            {"optimizer_state_dict": osd, "ds_version": "0.19.8"},
            st.data,
            prefix=name,
        )

    for r in range(ranks if stage == 3 else 1):
        st = Storages()
        module = [(n, st.add(b)) for n, b in buffers.items()]
        if module_params:
            # As DeepSpeed saves `module`: ZeRO-1/2 the 16-bit parameters, ZeRO-3 an empty
            # placeholder per parameter (its weights are in the ranks' partitions).
            for params in groups:
                for n, a in params.items():
                    value = a.astype(np.float16) if stage <= 2 else np.zeros(0, np.float16)
                    module.append((n, st.add(value)))
        fragments = []
        for n, a in frozen.items():
            if stage <= 2:
                fragments.append((n, st.add(a)))
            else:
                v = a.ravel()
                pn = math.ceil(v.size / ranks)
                v = np.concatenate([v, np.zeros(pn * ranks - v.size, v.dtype)])
                fragments.append((n, st.add(v[r * pn : (r + 1) * pn])))
        model: dict[str, Any] = {
            "module": tf.Ordered(module),
            "buffer_names": list(buffers),
            "optimizer": None,
            "param_shapes": [
                tf.Ordered([(n, size(a.shape)) for n, a in params.items()]) for params in groups
            ],
            "frozen_param_shapes": tf.Ordered([(n, size(a.shape)) for n, a in frozen.items()]),
            "shared_params": dict(shared or {}) if r == 0 else {},
            "frozen_param_fragments": tf.Ordered(fragments),
            "ds_version": "0.19.8",
        }
        if model_hook is not None:
            model = model_hook(r, model)
        name = (
            "mp_rank_00_model_states" if stage <= 2 else f"zero_pp_rank_{r}_mp_rank_00_model_states"
        )
        tf.write_zip(tag_dir / f"{name}.pt", model, st.data, prefix=name)
    return tag_dir
