"""DeepSpeed ZeRO checkpoint folders: converted as one checkpoint, streaming, without torch
or DeepSpeed. The fixtures in `fixtures/zero/` were written once by DeepSpeed 0.19.8 on CPU
(ZeRO-2 and ZeRO-3 on 3 ranks: see their README); `expected-*.safetensors` is what
DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint` gives (then `.to(bf16)`). The
generated cases (`zerofile.py`) cover what DeepSpeed would not write."""

from __future__ import annotations

import collections
import os
import pickle
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import stcast
import torchfile as tf
from conftest import assert_one_error_line, listing, tensor_bytes
from zerofile import size, write_zero

FIXTURES = Path(__file__).parent / "fixtures" / "zero"
REAL = ["stage2-3ranks", "stage3-3ranks"]
# zero_to_fp32's keys, in its order (fixtures/zero/layout.txt).
ORDER = [
    "position_ids",
    "scale",
    "frozen.weight",
    "emb.weight",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
    "norm.weight",
    "norm.bias",
    "proj.weight",
    "proj.bias",
    "out.weight",
]


def checkpoint(name: str, tmp_path: Path) -> Path:
    """The fixture's checkpoint alone (`latest`, `global_step1/`), copied: the fixture
    folder also holds the expected safetensors files, which make it a Hugging Face folder."""
    src = FIXTURES / name
    dst = tmp_path / name
    dst.mkdir()
    shutil.copy(src / "latest", dst / "latest")
    shutil.copytree(src / "global_step1", dst / "global_step1")
    return dst


def storage_records(path: Path) -> Any:
    """A torch zip checkpoint's pickle, loaded without torch: each tensor stands as the
    (start, end) file offsets of its storage's record, other objects as stubs."""

    class Stub:
        def __init__(self, *_: object, **__: object) -> None:
            pass

        def __setstate__(self, _: object) -> None:
            pass

    z = zipfile.ZipFile(path)
    pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
    prefix = pkl[: -len("data.pkl")]

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return lambda storage, *_, **__: storage
            if (module, name) == ("collections", "OrderedDict"):
                return collections.OrderedDict
            return Stub

        def persistent_load(self, pid: Any) -> tuple[int, int]:
            info = z.getinfo(f"{prefix}data/{pid[2]}")
            with open(path, "rb") as f:
                f.seek(info.header_offset)
                head = f.read(30)
            n, m = struct.unpack("<HH", head[26:30])
            start = info.header_offset + 30 + n + m
            return (start, start + info.file_size)

    return Unpickler(z.open(pkl)).load()


def expected(name: str, to: str) -> dict:
    return tensor_bytes(
        FIXTURES / name / f"expected-{'bf16' if to == 'bf16' else 'fp32'}.safetensors"
    )


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("to", ["bf16", "keep"])
@pytest.mark.parametrize("folder", ["top", "tag"])
def test_real_zero_checkpoints_convert_as_zero_to_fp32_rebuilds_them(tmp_path, name, to, folder):
    ck = checkpoint(name, tmp_path)
    src = ck if folder == "top" else ck / "global_step1"
    out = tmp_path / "out.safetensors"
    with warnings.catch_warnings():
        # DeepSpeed's classes are listed records: no "unlisted globals" warning.
        warnings.simplefilter("error", stcast.StcastWarning)
        stcast.convert(src, out, to=to)
    want = expected(name, to)
    got = tensor_bytes(out)
    assert set(got) == set(want)
    for k in want:
        assert got[k] == want[k], k
    assert stcast.verify(src, out, to=None if to == "bf16" else to).ok


@pytest.mark.parametrize("name", REAL)
def test_names_come_in_zero_to_fp32s_order(tmp_path, name):
    ck = checkpoint(name, tmp_path)
    assert [t.name for t in stcast.inspect(ck).tensors] == ORDER


def test_the_cli_default_destination_is_a_hugging_face_folder(tmp_path, run_main):
    ck = checkpoint("stage3-3ranks", tmp_path)
    rc, out, err = run_main("convert", ck)
    assert rc == 0, err
    dst = tmp_path / "stage3-3ranks-bf16" / "model.safetensors"
    assert tensor_bytes(dst) == expected("stage3-3ranks", "bf16")
    rc, out, err = run_main("verify", ck, tmp_path / "stage3-3ranks-bf16")
    assert rc == 0, err
    # The tag folder: beside it.
    rc, out, err = run_main("convert", ck / "global_step1")
    assert rc == 0, err
    assert tensor_bytes(ck / "global_step1-bf16" / "model.safetensors") == expected(
        "stage3-3ranks", "bf16"
    )
    # A DST folder named: the file goes inside it.
    rc, out, err = run_main("convert", checkpoint("stage2-3ranks", tmp_path), tmp_path / "hf")
    assert rc == 0, err
    assert tensor_bytes(tmp_path / "hf" / "model.safetensors") == expected("stage2-3ranks", "bf16")


def test_inspect_lists_the_tensors(tmp_path, run_main):
    ck = checkpoint("stage2-3ranks", tmp_path)
    rc, out, err = run_main("inspect", ck)
    assert rc == 0, err
    assert "fc2.weight" in out and "[5, 7]" in out and "out.weight" in out
    assert "format:   DeepSpeed ZeRO checkpoint folder" in out, out
    # DeepSpeed's classes are listed records: shown among the allowed, none unlisted.
    assert "ZeroStageEnum" in out and "not on the allow-list" not in out, out
    r = stcast.inspect(ck)
    assert r.format == "deepspeed" and r.unlisted == []
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in r.globals


@pytest.mark.parametrize("name", REAL)
def test_the_adam_moments_are_never_read(tmp_path, name):
    """Overwrite the moments' bytes (and the step) in every optimizer file: the output is
    still exact, as nothing but the fp32 masters is read there."""
    ck = checkpoint(name, tmp_path)
    inner = "base_optimizer_state" if name.startswith("stage2") else "optimizer_state_dict"
    files = sorted((ck / "global_step1").glob("*_optim_states.pt"))
    assert len(files) == 3
    for f in files:
        # (Read here by Python's own unpickler: stcast refuses one rank's file whatever
        # --key names, test_one_rank_file_alone_is_refused_naming_the_checkpoint.)
        spans = storage_records(f)["optimizer_state_dict"][inner]["state"][0]
        assert set(spans) == {"step", "exp_avg", "exp_avg_sq"}
        data = bytearray(f.read_bytes())
        for a, b in spans.values():
            data[a:b] = b"\xff" * (b - a)
        f.write_bytes(bytes(data))
    out = tmp_path / "out.safetensors"
    stcast.convert(ck, out, to="keep")
    assert tensor_bytes(out) == expected(name, "keep")


@pytest.mark.parametrize("stage", [2, 3])
def test_generated_layouts_convert_exactly(tmp_path, rng, stage):
    """Several groups, alignment paddings, a 3-D, a scalar and an empty parameter, 4 ranks,
    frozen parameters, a tied one."""
    groups = [
        {
            "a.w": rng.standard_normal((5, 7)).astype(np.float32),
            "a.b": rng.standard_normal(3).astype(np.float32),
            "s": np.array(2.5, np.float32),
        },
        {
            "c.w": rng.standard_normal((2, 3, 5)).astype(np.float32),
            "e": np.zeros((0, 4), np.float32),
            "d": rng.standard_normal(13).astype(np.float32),
        },
    ]
    frozen = {"f.w": rng.standard_normal((4, 5)).astype(np.float32)}
    buffers = {"pos": np.arange(6), "sc": rng.standard_normal(3).astype(np.float32)}
    write_zero(
        tmp_path / "ck",
        groups,
        stage=stage,
        ranks=4,
        buffers=buffers,
        frozen=frozen,
        shared={"tied": "a.w", "gone": "not.a.param"},
        paddings=[[1, 0, 2], [0, 3, 0]] if stage == 2 else None,
    )
    out = tmp_path / "o.safetensors"
    stcast.convert(tmp_path / "ck", out, to="keep")
    want = {**buffers, **frozen, **groups[0], **groups[1], "tied": groups[0]["a.w"]}
    got = tensor_bytes(out)
    assert set(got) == set(want)  # an alias of no parameter is left out, as zero_to_fp32 does
    for k, a in want.items():
        assert got[k][1:] == (list(a.shape), a.tobytes()), k
    assert [t.name for t in stcast.inspect(tmp_path / "ck").tensors] == list(want)
    assert stcast.verify(tmp_path / "ck", out, to="keep").ok


def test_strip_prefix_applies_and_key_is_refused(tmp_path, rng, run_main):
    w = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    ck = tmp_path / "ck"
    write_zero(ck, [{"module.w": w, "module.b": b}], stage=3, ranks=2)
    out = tmp_path / "o.safetensors"
    stcast.convert(ck, out, to="keep", strip_prefix=["module."])
    got = tensor_bytes(out)
    assert got["w"] == ("F32", [3, 4], w.tobytes()) and got["b"] == ("F32", [4], b.tobytes())
    before = listing(tmp_path)
    rc, _, err = run_main("convert", ck, tmp_path / "p.safetensors", "--key", "module")
    line = assert_one_error_line(err)
    assert rc == 2 and "--key" in line and "one state dict" in line, line
    with pytest.raises(stcast.UsageError, match="key"):
        stcast.convert(ck, tmp_path / "p.safetensors", key="module")
    assert listing(tmp_path) == before


# --- hostile and broken checkpoints: refused in one line naming the file, nothing written ---


def hostile(tmp_path: Path, stage: int = 2, **kwargs) -> Path:
    w = np.arange(21, dtype=np.float32).reshape(7, 3)
    b = np.arange(5, dtype=np.float32)
    ck = tmp_path / "ck"
    write_zero(ck, [{"w": w, "b": b}], stage=stage, ranks=3, **kwargs)
    return ck


def refused(run_main, tmp_path: Path, ck: Path, *words: str, rc: int = 1) -> str:
    before = listing(tmp_path)
    got_rc, out, err = run_main("convert", ck, tmp_path / "o.safetensors")
    line = assert_one_error_line(err)
    assert got_rc == rc, err
    for w in words:
        assert w in line, line
    assert listing(tmp_path) == before
    return line


def shorter(rank: int, by: int):
    """An optimizer hook: rank `rank`'s first fp32 group `by` elements shorter than it says
    it is (the storage keeps its bytes; the tensor's size lies)."""

    def hook(r, osd):
        if r == rank:
            key = (
                "single_partition_of_fp32_groups"
                if "base_optimizer_state" in osd
                else "fp32_flat_groups"
            )
            t = osd[key][0]
            args = list(t.args)
            args[2] = (args[2][0] - by,)
            osd[key] = [tf.Call(t.func, tuple(args))] + osd[key][1:]
        return osd

    return hook


def test_partition_sizes_that_do_not_add_up_are_refused(tmp_path, run_main):
    # ZeRO-2: 26 elements in partitions of 10, 10, 6; one partition 4 short.
    ck = hostile(tmp_path, optim_hook=shorter(1, 4))
    refused(run_main, tmp_path, ck, "rank_2", "`b`", "past the 22 elements", "do not add up")
    shutil.rmtree(ck)
    # ZeRO-3: each rank's group 7 + 2 elements; one rank's 1 short.
    ck = hostile(tmp_path, stage=3, optim_hook=shorter(2, 1))
    refused(run_main, tmp_path, ck, "rank_2_mp_rank_00_optim_states.pt", "[8]", "rank 0's [9]")
    shutil.rmtree(ck)
    # Every rank's partition longer than the parameters take.
    ck = hostile(tmp_path, tail=4)
    refused(run_main, tmp_path, ck, "rank_0", "take 26 elements", "hold 38", "do not add up")
    shutil.rmtree(ck)
    ck = hostile(tmp_path, stage=3, tail=1)
    refused(run_main, tmp_path, ck, "rank_0", "take 9 elements", "hold 10", "do not add up")


def test_shapes_past_the_flat_vectors_are_refused(tmp_path, run_main):
    def bigger(r, model):
        model["param_shapes"] = [tf.Ordered([("w", size((7, 3))), ("b", size((9,)))])]
        return model

    ck = hostile(tmp_path, model_hook=bigger)
    refused(run_main, tmp_path, ck, "`b`", "past the 26 elements")
    shutil.rmtree(ck)
    ck = hostile(tmp_path, stage=3, model_hook=bigger)
    refused(run_main, tmp_path, ck, "`b`", "past the 9 elements")


def test_a_missing_or_extra_rank_is_refused(tmp_path, run_main):
    ck = hostile(tmp_path)
    (ck / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(
        run_main, tmp_path, ck, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rank 1", "missing"
    )
    shutil.rmtree(ck)
    ck = hostile(tmp_path, stage=3)
    (ck / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    refused(run_main, tmp_path, ck, "rank 0", "missing")
    shutil.rmtree(ck)
    # partition_count says 4 ranks: rank 3 is missing.
    ck = hostile(tmp_path, optim_hook=lambda r, osd: {**osd, "partition_count": [4]})
    refused(run_main, tmp_path, ck, "rank 3", "partition_count says 4")
    shutil.rmtree(ck)
    # Ranks that disagree on the world size.
    ck = hostile(
        tmp_path, stage=3, optim_hook=lambda r, osd: {**osd, "partition_count": 3 + (r == 2)}
    )
    refused(run_main, tmp_path, ck, "rank_2", "of 4 ranks", "rank 0's says stage 3 of 3")
    shutil.rmtree(ck)
    # A stray rank past the world size.
    ck = hostile(tmp_path)
    tag = ck / "global_step1"
    shutil.copy(
        tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
        tag / "zero_pp_rank_5_mp_rank_00_optim_states.pt",
    )
    refused(run_main, tmp_path, ck, "rank_5", "says 3 ranks")
    shutil.rmtree(ck)
    # ZeRO-3 frozen fragments: every rank's model states are needed.
    ck = hostile(tmp_path, stage=3, frozen={"f": np.ones((2, 2), np.float32)})
    (ck / "global_step1" / "zero_pp_rank_2_mp_rank_00_model_states.pt").unlink()
    refused(run_main, tmp_path, ck, "zero_pp_rank_2_mp_rank_00_model_states.pt", "missing")


def test_model_parallel_checkpoints_are_refused_as_not_supported(tmp_path, run_main):
    ck = checkpoint("stage2-3ranks", tmp_path)
    tag = ck / "global_step1"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    line = refused(
        run_main, tmp_path, ck, "mp_rank_01_model_states.pt", "model parallel", "not supported"
    )
    assert "rank 1" in line
    with pytest.raises(stcast.StcastError, match="not supported"):
        stcast.convert(ck, tmp_path / "o.safetensors")
    (tag / "mp_rank_01_model_states.pt").unlink()
    (tag / "layer_01-model_states.pt").write_bytes(b"")
    refused(run_main, tmp_path, ck, "layer_01-model_states.pt", "pipeline", "not supported")


def test_a_model_states_pickle_that_calls_a_global_is_refused(tmp_path, run_main):
    canary = tmp_path / "canary"
    for stage in (2, 3):
        ck = hostile(
            tmp_path,
            stage=stage,
            model_hook=lambda r, m: {
                **m,
                "ds_config": tf.Call(tf.Global("os", "system"), (f"touch {canary}",)),
            },
        )
        refused(run_main, tmp_path, ck, "model_states.pt", "os.system")
        assert not canary.exists()
        shutil.rmtree(ck)
    ck = hostile(
        tmp_path,
        optim_hook=lambda r, osd: {
            **osd,
            "loss_scaler": tf.Call(tf.Global("subprocess", "run"), (["touch", str(canary)],)),
        },
    )
    refused(run_main, tmp_path, ck, "optim_states.pt", "subprocess")
    assert not canary.exists()


def test_a_missing_or_bad_latest_is_refused(tmp_path, run_main):
    ck = hostile(tmp_path)
    (ck / "latest").write_text("global_step9")
    # `latest` names no folder holding model states: refused (what it says: below).
    rc, _, err = run_main("convert", ck, tmp_path / "o.safetensors")
    assert rc == 1, err
    (ck / "latest").write_text("global_step1")
    (ck / "global_step1" / "mp_rank_00_model_states.pt").unlink()
    tag_only = ck / "global_step1"
    assert "mp_rank_00_model_states.pt" in refused(run_main, tmp_path, tag_only, "missing")


def test_the_default_destination_is_beside_the_checkpoint(tmp_path):
    ck = checkpoint("stage2-3ranks", tmp_path)
    before = sorted(os.listdir(ck / "global_step1"))
    stcast.convert(ck)
    assert (tmp_path / "stage2-3ranks-bf16" / "model.safetensors").is_file()
    assert sorted(os.listdir(ck / "global_step1")) == before


def test_peak_rss_is_bounded_and_the_moments_stay_unread(tmp_path):
    """ZeRO-3 on 4 ranks: the peak RSS does not grow with the checkpoint (its parameters
    gathered window by window from the mapped partitions; the moments, twice the masters,
    never touched)."""
    from test_memory import MIB, peak_rss_of_convert

    peaks = {}
    for size_mib in (16, 96):
        n = size_mib * MIB // 4 // 8
        x = np.linspace(-3.0, 3.0, n, dtype=np.float32)
        groups = [{f"layers.{i}.w": x.reshape(-1, 1024) for i in range(8)}]
        ck = tmp_path / f"ck{size_mib}"
        write_zero(ck, groups, stage=3, ranks=4)
        dst = tmp_path / f"out{size_mib}.safetensors"
        peaks[size_mib] = peak_rss_of_convert(ck, dst)
        assert dst.stat().st_size < size_mib * MIB // 2 + 4096
        shutil.rmtree(ck)
        dst.unlink()
    print({k: f"{v / MIB:.1f} MiB" for k, v in peaks.items()})
    for size_mib, peak in peaks.items():
        assert peak < 150 * MIB, f"{size_mib} MiB of masters: peak RSS {peak / MIB:.1f} MiB"
    assert peaks[96] <= 1.25 * peaks[16] + 16 * MIB, peaks


@pytest.mark.parametrize("name", REAL)
def test_resharded_shard_runs_finalize_and_resume(tmp_path, run_main, cli_process, name):
    """`--max-shard-size`, `--shard I/N` + `finalize` (a SLURM array), `--resume`: as for a
    file; the shards hold exactly zero_to_fp32's tensors in bf16."""
    ck = checkpoint(name, tmp_path)
    want = expected(name, "bf16")

    def shards(folder: Path) -> dict:
        got: dict = {}
        for f in sorted(folder.glob("model-*.safetensors")):
            got.update(tensor_bytes(f))
        return got

    rc, out, err = run_main("convert", ck, tmp_path / "rs", "--max-shard-size", "300B")
    assert rc == 0, err
    assert (tmp_path / "rs" / "model.safetensors.index.json").is_file()
    assert shards(tmp_path / "rs") == want
    rc, out, err = run_main("verify", ck, tmp_path / "rs")
    assert rc == 0, err
    for i in (1, 2):
        rc, out, err = run_main(
            "convert", ck, tmp_path / "sh", "--max-shard-size", "300B", "--shard", f"{i}/2"
        )
        assert rc == 0, err
    rc, out, err = run_main("finalize", ck, tmp_path / "sh")
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path / "sh")) == sorted(os.listdir(tmp_path / "rs"))
    assert shards(tmp_path / "sh") == want
    # Stopped after the first shard, then resumed.
    env = {"STCAST_FAILPOINT": "folder-file=sigint"}
    rc, out, err = cli_process("convert", ck, tmp_path / "re", "--max-shard-size", "300B", env=env)
    assert rc != 0 and (tmp_path / "re" / ".stcast-manifest.json").is_file(), err
    rc, out, err = run_main("convert", ck, tmp_path / "re", "--max-shard-size", "300B", "--resume")
    assert rc == 0, err
    assert shards(tmp_path / "re") == want
    assert sorted(os.listdir(tmp_path / "re")) == sorted(os.listdir(tmp_path / "rs"))


def test_a_latest_naming_a_missing_tag_or_tags_without_latest_say_so(tmp_path, run_main):
    """Issue 30, finding 11: a ZeRO folder whose `latest` names a tag that is not there, or
    that has tag folders and no `latest`, was "a directory without .safetensors files ...
    nothing to convert". It is a DeepSpeed checkpoint: the line says so, names `latest`, the
    tag it names and the tag folders found."""
    ck = hostile(tmp_path)
    (ck / "latest").write_text("global_step9\n")
    line = refused(run_main, tmp_path, ck, "DeepSpeed", "`latest`", "`global_step9`")
    assert "`global_step1`" in line and "nothing to convert" not in line
    (ck / "latest").unlink()
    line = refused(run_main, tmp_path, ck, "DeepSpeed", "no `latest`", "`global_step1`")
    assert "nothing to convert" not in line
    for cmd in ("inspect", "verify"):
        rc, _, err = run_main(cmd, ck, *([tmp_path / "o.safetensors"] if cmd == "verify" else []))
        line = assert_one_error_line(err)
        assert rc == 1 and "DeepSpeed" in line and "no `latest`" in line, line


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_file_alone_is_refused_naming_the_checkpoint(tmp_path, run_main, stage):
    """Issue 30, finding 10: one ZeRO-3 rank's model states as SRC suggested `--key module`,
    which then wrote ZeRO-3's empty `[0]` placeholders as the model (exit 0); a rank's
    optimizer states converted its flat partition. Told by their content (renamed, too),
    both are refused with and without --key (any key reads placeholders, a partition of
    the flat weights or its Adam moments: `--key optimizer_state_dict.base_optimizer_state`
    on an optimizer states file wrote one rank's moments as a model, exit 0), naming the
    checkpoint folder to convert."""
    ck = tmp_path / "ck"
    w = np.arange(21, dtype=np.float32).reshape(7, 3)
    write_zero(ck, [{"w": w}], stage=stage, ranks=3, module_params=True)
    tag = ck / "global_step1"
    files = [tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    if stage == 3:
        renamed = tag / "rank0.pt"
        shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", renamed)
        files += [tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", renamed]
    inner = "base_optimizer_state" if stage == 2 else "optimizer_state_dict"
    keys = [[], ["--key", "module"], ["--key", f"optimizer_state_dict.{inner}"]]
    for f in files:
        for key in keys if "optim" in f.name else keys[:2]:
            before = listing(tmp_path)
            rc, _, err = run_main("convert", f, tmp_path / "o.safetensors", *key)
            line = assert_one_error_line(err)
            assert rc == 1 and "one data-parallel rank's" in line and "DeepSpeed" in line, line
            assert f"convert the checkpoint folder `{ck}`" in line, line
            assert listing(tmp_path) == before
    # DeepSpeed's own optimizer states file (the fixture), with the keys it holds.
    lone = FIXTURES / f"stage{stage}-3ranks" / "global_step1"
    for key in (["--key", "module"], ["--key", f"optimizer_state_dict.{inner}"]):
        f = lone / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        rc, _, err = run_main("convert", f, tmp_path / "o.safetensors", *key)
        line = assert_one_error_line(err)
        assert rc == 1 and "one data-parallel rank's" in line and "DeepSpeed" in line, line
        assert not (tmp_path / "o.safetensors").exists()
    if stage == 2:
        # ZeRO-1/2's model states hold the whole 16-bit module: a model, still converted.
        out = tmp_path / "m.safetensors"
        stcast.convert(tag / "mp_rank_00_model_states.pt", out, key="module")
        assert out.exists()


def test_a_huge_latest_is_never_read_whole(tmp_path):
    """`latest` names a tag in a few bytes; one of 256 MiB (a file saved there by mistake) is
    refused in one line after reading at most 4 KiB of it. Found by the adversarial round
    after issue 30: it was read whole first (about 274 MiB of peak RSS)."""
    import sys

    from test_memory import MIB, peak_rss_of

    src = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).parent / "fixtures" / "zero" / "stage3-3ranks", src)
    for stray in src.glob("expected-*.safetensors"):
        stray.unlink()
    with open(src / "latest", "r+b") as f:
        f.truncate(256 * MIB)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    cmd = [sys.executable, "-m", "stcast", "convert", str(src), str(tmp_path / "o.safetensors")]
    rc, peak = peak_rss_of(cmd, out, err)
    assert rc == 1, err.read_text()
    assert_one_error_line(err.read_text())
    assert "latest" in err.read_text()
    assert peak <= 64 * MIB, f"{peak / MIB:.1f} MiB"


def test_a_stray_latest_in_a_hugging_face_folder_is_no_deepspeed_checkpoint(tmp_path):
    """A diffusers pipeline (`model_index.json`, weights in subfolders) with a file named
    `latest` beside: a Hugging Face folder still. DeepSpeed needs its tag folders of
    partitions (`global_step*/` with `*_model_states.pt`), not the name `latest` alone."""
    from safetensors.numpy import save_file

    src = tmp_path / "pipe"
    (src / "unet").mkdir(parents=True)
    (src / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    (src / "unet" / "config.json").write_text("{}")
    save_file({"w": np.ones((4, 4), np.float32)}, str(src / "unet" / "model.safetensors"))
    (src / "latest").write_text("global_step7\n")
    (src / "global_step7").mkdir()  # even a tag folder, without partitions
    out = tmp_path / "out"
    # Converted as the folder it is (a trainer's state beside weights is left out, said).
    with pytest.warns(stcast.StcastWarning, match="left out: training state"):
        stcast.convert(src, out)
    assert (out / "unet" / "model.safetensors").is_file()
    assert stcast.verify(src, out).ok
