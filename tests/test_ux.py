"""What a new user tripped over (the UX issue), one test per point, numbered as there.

Points tested elsewhere say where: 6 (progress) in test_cli.py's bar and log tests, 8
(verify hints) in test_verify.py, 13 (a short repr) in test_api.py.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, listing, tensor_bytes, write_safetensors
from helpers import cli_env, run_on_pty

ONES = np.ones(4, np.float32)


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def folder(path: Path, files: dict[str, dict], config: dict | None = None) -> Path:
    """A checkpoint folder: safetensors files (name -> tensors) and a config.json."""
    path.mkdir(parents=True)
    for name, tensors in files.items():
        write_safetensors(path / name, tensors)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


# --- 1. quantized means quantized ---------------------------------------------------------


def test_1_a_tensor_named_scale_is_not_a_quantized_checkpoint(tmp_path, run_main):
    """A diffusers text encoder with an F32 tensor named `scale` and U8 buffers converts
    as a folder, with --keep, as the same file alone does."""
    pipe = tmp_path / "pipe"
    folder(
        pipe / "text_encoder",
        {
            "model.safetensors": {
                "scale": ("F32", [1], f32(2)),
                "norm.weight": ("F32", [4], ONES),
                "w": ("F32", [4], ONES),
                "mask": ("U8", [4], np.uint8([1, 0, 1, 1])),
            }
        },
        config={"architectures": ["CLIPTextModel"]},
    )
    rc, out, err = run_main("convert", pipe, tmp_path / "out", "--keep", "*norm*")
    assert (rc, err) == (0, ""), err
    got = tensor_bytes(tmp_path / "out" / "text_encoder" / "model.safetensors")
    assert got["scale"][0] == "BF16" and got["norm.weight"][0] == "F32"
    assert got["mask"][0] == "U8"


@pytest.mark.parametrize(
    "case",
    ["config", "f8_beside_f32", "i8_with_config"],
)
def test_1_quantized_checkpoints_are_still_refused(tmp_path, run_main, case):
    src = _quantized_folder(tmp_path, case)
    rc, out, err = run_main("convert", src)
    assert rc == 1 and "quantized checkpoint" in assert_one_error_line(err)
    assert not (tmp_path / "q-bf16").exists()


@pytest.mark.parametrize(
    "case",
    ["config", "f8_beside_f32", "i8_with_config"],
)
def test_1_quantized_checkpoints_convert_when_allowed(tmp_path, run_main, case):
    src = _quantized_folder(tmp_path, case)
    rc, _, err = run_main("convert", src, "--allow-quantized")
    assert rc == 0, err


@pytest.mark.parametrize(
    "args", [[], ["--keep", "*scale*"], ["--keep", "*absmax", "--keep", "*quant_map"]]
)
@pytest.mark.parametrize("allow", [False, True], ids=["plain", "allow-quantized"])
def test_1_bitsandbytes_is_refused_naming_no_flag(tmp_path, run_main, args, allow):
    """bitsandbytes 4-bit (attack z10 r14): the refusal suggested `--keep '*scale*'` (which
    matched nothing: the same refusal again) and `--allow-quantized`, which wrote absmax
    and quant_map as BF16 under the unchanged bitsandbytes config, exit 0, and verify
    passed it. Refused in one line naming the format and a tensor, no flag suggested,
    whatever the options."""
    src = folder(
        tmp_path / "bnb",
        {
            "model.safetensors": {
                "l.weight": ("U8", [8, 1], np.arange(8, dtype=np.uint8).reshape(8, 1)),
                "l.weight.absmax": ("F32", [2], f32(0.5, 0.25)),
                "l.weight.quant_map": ("F32", [4], f32(-1, 0, 0.5, 1)),
                "l.weight.quant_state.bitsandbytes__nf4": ("U8", [4], np.zeros(4, np.uint8)),
                "norm.weight": ("F32", [4], ONES),
            }
        },
        config={"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
    )
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, *args, *(["--allow-quantized"] * allow))
    line = assert_one_error_line(err)
    assert rc == 1 and "`l.weight.absmax` is a bitsandbytes tensor" in line, line
    assert "--keep" not in line and "--allow" not in line, line
    assert not out.exists()


def _quantized_folder(tmp_path: Path, case: str) -> Path:
    tensors = {"w": ("F32", [4], ONES), "w_scale": ("F32", [1], f32(0.5))}
    config = {}
    if case == "config":
        config = {"quantization_config": {"quant_method": "awq"}}
    elif case == "f8_beside_f32":
        tensors["q"] = ("F8_E4M3", [4], np.uint8([1, 2, 3, 4]))
    else:
        tensors["q"] = ("I8", [4], np.int8([1, 2, 3, 4]))
        config = {"quantization_config": {"quant_method": "bitsandbytes"}}
    return folder(tmp_path / "q", {"model.safetensors": tensors}, config=config)


# --- 2. the dry run runs convert's checks ------------------------------------------------


def _dry_run_cases(tmp_path: Path) -> list[tuple[str, list[object], str]]:
    one = write_safetensors(tmp_path / "one.safetensors", {"w": ("F32", [4], ONES)})
    src = folder(tmp_path / "model", {"model.safetensors": {"w": ("F32", [4], ONES)}})
    (tmp_path / "a-folder" / "one-bf16.safetensors").mkdir(parents=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    existing = tmp_path / "existing.safetensors"
    existing.write_bytes(b"someone's file")
    return [
        ("folder is a file", [one, existing / "nope" / "x.safetensors"], "not a folder"),
        ("dst is a folder", [one, tmp_path / "a-folder"], "is a folder"),
        ("non-empty folder", [src, full], "full"),
        ("existing file", [one, existing], "exists"),
    ]


def test_2_inspect_fails_where_convert_fails_with_the_same_line(tmp_path, run_main):
    for what, args, says in _dry_run_cases(tmp_path):
        rc_i, out_i, err_i = run_main("inspect", *args)
        rc_d, out_d, err_d = run_main("convert", *args, "--dry-run")
        rc_c, out_c, err_c = run_main("convert", *args)
        assert rc_i == rc_d == rc_c == 1, what
        line = assert_one_error_line(err_c)
        assert says in line, (what, line)
        assert assert_one_error_line(err_i) == assert_one_error_line(err_d) == line, what
        assert out_i == out_d == out_c == "", what
    assert (tmp_path / "existing.safetensors").read_bytes() == b"someone's file"
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["notes.txt"]


def test_2_inspect_takes_the_flags_that_change_the_checks(tmp_path, run_main):
    one = write_safetensors(tmp_path / "one.safetensors", {"w": ("F32", [4], ONES)})
    existing = tmp_path / "existing.safetensors"
    existing.write_bytes(b"x")
    rc, out, err = run_main("inspect", one, existing, "--force")
    assert rc == 0 and "every check convert makes passed" in out, err
    src = folder(
        tmp_path / "model",
        {f"model-0000{i}-of-00002.safetensors": {"w": ("F32", [4], ONES)} for i in (1, 2)},
    )
    rc, out, err = run_main("inspect", src, tmp_path / "dst", "--shard", "3/2")
    assert rc == 2 and "--shard" in assert_one_error_line(err)
    rc, out, err = run_main("inspect", src, tmp_path / "dst", "--shard", "1/2", "--json")
    assert rc == 0, err
    assert json.loads(out)["result"]["destination"]["fits"] is True
    # An interrupted run's folder: refused without --resume, planned with it.
    run_main("convert", src, tmp_path / "dst", "--shard", "1/2")
    rc, _, err = run_main("inspect", src, tmp_path / "dst")
    assert rc == 1 and "--resume" in assert_one_error_line(err)
    rc, out, err = run_main("inspect", src, tmp_path / "dst", "--resume")
    assert rc == 0, err
    # Precision options change the plan, and with --strict an unmatched pattern refuses.
    rc, out, err = run_main("inspect", one, tmp_path / "o.safetensors", "--keep", "x", "--strict")
    assert rc == 1 and "`x`" in assert_one_error_line(err)


# --- 3. folder warnings name the file, once each, everywhere --------------------------------


def test_3_folder_warnings_name_the_file_in_every_channel(tmp_path, run_main):
    lossy = {"over": ("F64", [2], np.float64([1e300, 1])), "under": ("F32", [2], f32(1e-45, 1))}
    src = folder(
        tmp_path / "model",
        {f"model-0000{i}-of-00002.safetensors": lossy for i in (1, 2)},
    )
    rc, out, err = run_main("convert", src, tmp_path / "a", "--json")
    assert rc == 0, err
    said = json.loads(out)["result"]["warnings"]
    for i in (1, 2):
        name = f"model-0000{i}-of-00002.safetensors"
        mine = [w for w in said if w.startswith(f"{name}: ")]
        assert len(mine) == 2, said
        assert "became ±inf in BF16: `over` (1)" in mine[0]
        assert "1 value underflowed to zero in 1 tensor (worst: `under` 1)" in mine[1]
        assert "--on-overflow keep" in mine[0]  # the CLI's words
    assert err.splitlines() == [f"stcast: warning: {w}" for w in said]
    # The API: one StcastWarning per warning, with the file in its path.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = stcast.convert(src, tmp_path / "b")
    got = [(Path(w.message.path).name, w.message.kind) for w in caught]
    assert got == [
        (f"model-0000{i}-of-00002.safetensors", k)
        for i in (1, 2)
        for k in ("overflow", "underflow")
    ]
    assert len(report.warnings) == 4 and "on_overflow=" in str(report.warnings[0])
    # -q silences them all.
    rc, out, err = run_main("convert", src, tmp_path / "c", "-q")
    assert (rc, out, err) == (0, "", "")


# --- 4. verify folders ---------------------------------------------------------------------


def _two_files(tmp_path: Path) -> Path:
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    return folder(
        tmp_path / "model",
        {
            "model-00001-of-00002.safetensors": {"a": ("F32", [64], x), "norm": ("F32", [4], ONES)},
            "model-00002-of-00002.safetensors": {
                "b": ("F32", [64], -x),
                "i": ("I64", [1], np.int64([7])),
                "bias": ("F32", [2], f32(0.5, -0.5)),
            },
        },
        config={"torch_dtype": "float32"},
    )


def test_4_verify_a_folder_names_the_failing_file(tmp_path, run_main):
    src = _two_files(tmp_path)
    dst = tmp_path / "out"
    stcast.convert(src, dst, keep=["norm"], no_record=True)
    # Strict mode wants the options convert had (here none recorded: --no-record); --loose
    # accepts any kept tensor.
    rc, _, err = run_main("verify", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1 and "model-00001-of-00002.safetensors" in line and "`norm`" in line, line
    assert "--keep" in line and "--loose" in line
    rc, out, err = run_main("verify", src, dst, "--keep", "norm")
    assert (rc, err) == (0, "") and out.startswith(f"verified {dst}: exactly the conversion")
    assert "files    3 compared" in out  # 2 weight files and config.json
    rc, _, err = run_main("verify", src, dst, "--loose")
    assert rc == 0, err
    # A flipped bit in the second file: named, with the tensor and element.
    second = dst / "model-00002-of-00002.safetensors"
    data = bytearray(second.read_bytes())
    data[-9] ^= 1  # in `b`: the output holds `i` (I64) first, then `b` and `bias` (BF16)
    second.write_bytes(bytes(data))
    report = stcast.verify(src, dst, keep=["norm"])
    assert not report.ok and report.mismatch.file == "model-00002-of-00002.safetensors"
    assert report.mismatch.tensor == "b"
    rc, _, err = run_main("verify", src, dst, "--keep", "norm")
    assert rc == 1 and assert_one_error_line(err).startswith(f"stcast: {second}: tensor `b`")


def test_4_verify_a_folder_checks_every_file(tmp_path, run_main):
    src = _two_files(tmp_path)
    dst = tmp_path / "out"
    stcast.convert(src, dst)
    assert stcast.verify(src, dst).ok
    (dst / "model-00002-of-00002.safetensors").unlink()
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and "model-00002-of-00002.safetensors" in assert_one_error_line(err)
    stcast.convert(src, dst, force=True)
    (dst / "config.json").write_text('{"torch_dtype": "float32"}')  # not rewritten
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and "config.json" in assert_one_error_line(err)
    stcast.convert(src, dst, force=True)
    (dst / "extra.safetensors").write_bytes((src / "model-00001-of-00002.safetensors").read_bytes())
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and "extra.safetensors" in assert_one_error_line(err)


# --- 5. other formats are named -------------------------------------------------------------


def _others(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    html = tmp_path / "model.safetensors"
    html.write_bytes(b"<!DOCTYPE html>\n<html><body>Access denied</body></html>")
    torch_zip = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(torch_zip, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    npz = tmp_path / "arrays.npz"
    np.savez(npz, a=ONES)
    legacy = tmp_path / "legacy.pt"
    # torch's legacy format starts with a pickled magic number (a long).
    legacy.write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19." + bytes(32))
    readme = tmp_path / "README.md"
    readme.write_text("# Llama-3.1-8B\n\nThe weights are in model.safetensors, café.\n")
    config = tmp_path / "config.json"
    config.write_text('\n  {"architectures": ["LlamaForCausalLM"]}')
    not_read = ", not a safetensors file or a PyTorch checkpoint"
    return {
        # Text used to be "invalid safetensors file: header too large" (its first 8 bytes
        # read as a huge header length).
        "text": (readme, "a text file" + not_read),
        "json": (config, "a JSON text file (a config or an index?)" + not_read),
        "gguf": (gguf, "a GGUF file (llama.cpp)" + not_read),
        "html": (html, "an HTML page (a failed download?)" + not_read),
        "npz": (npz, "a NumPy .npz archive" + not_read),
        # PyTorch checkpoints are read (tests/test_torch.py): these two say what is wrong.
        "torch zip": (torch_zip, "the checkpoint holds no tensors"),
        "legacy": (legacy, "legacy protocol version, byte 0: unknown opcode 0x00"),
    }


def test_5_other_formats_are_named(tmp_path, run_main):
    for what, (path, named) in _others(tmp_path).items():
        rc, out, err = run_main("convert", path, tmp_path / "o.safetensors")
        assert rc == 1 and out == "", what
        assert assert_one_error_line(err).startswith(f"stcast: {path}: {named}"), (what, err)
        rc, _, err2 = run_main("inspect", path)
        assert rc == 1 and err2 == err, what
    assert not (tmp_path / "o.safetensors").exists()
    # Where only safetensors will do (verify's DST), a checkpoint is named as such.
    src = write_safetensors(tmp_path / "x.safetensors", {"w": ("F32", [1], ONES[:1])})
    dst = _others(tmp_path)["torch zip"][0]
    rc, _, err = run_main("verify", src, dst)
    assert rc == 1 and assert_one_error_line(err) == (
        f"stcast: {dst}: a PyTorch checkpoint (torch.save zip), not a safetensors file"
    )


@pytest.mark.parametrize(
    "given, repo",
    [
        ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
        ("https://huggingface.co/org/name", "org/name"),
        ("hf://org/name", "org/name"),
    ],
)
def test_5_a_hub_id_gets_a_download_hint(tmp_path, run_main, given, repo):
    rc, out, err = run_main("convert", given, cwd=tmp_path)
    line = assert_one_error_line(err)
    assert rc == 1 and f"`hf download {repo} --local-dir DIR`" in line, line


@pytest.mark.parametrize("given", ["ckpt/ckpt.json", "ckpt/model.safetensors", "here/name"])
def test_5_a_typo_of_a_local_path_gets_no_download_hint(tmp_path, run_main, given):
    """`ckpt/ckpt.json` (a typo of a local path) was told to `hf download` it: a path under a
    folder that exists, or naming a checkpoint's file, is not a repo id (issue 33, point 6)."""
    (tmp_path / "here").mkdir()
    rc, out, err = run_main("convert", given, cwd=tmp_path)
    line = assert_one_error_line(err)
    assert rc == 1 and "hf download" not in line and line.startswith(f"stcast: {given}: "), line


@pytest.mark.parametrize(
    "given, repo",
    [
        ("org\u00b2/name", "org\u00b2/name"),  # a number
        ("orge\u0301/name", None),  # a combining mark
        ("org\u203f/name", None),  # a connector
        (b"https://\xff", "ORG/NAME"),  # a URL, not UTF-8
        (b"org/\xffname", None),
    ],
)
def test_5_a_hub_id_s_word_characters_are_letters_numbers_and_underscores(
    tmp_path, monkeypatch, given, repo
):
    """The hint's repo id is made of Python's word characters, as it was when Python read it
    (the engine reads it now): a combining mark or a connector is none, a superscript
    digit is one; a path that is not UTF-8 names no repo, though a URL of it is one."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises((stcast.InvalidInput, OSError)) as e:
        stcast.convert(given)
    if repo is None:
        assert "hf download" not in str(e.value), e.value
    else:
        assert f"`hf download {repo} --local-dir DIR`" in str(e.value), e.value


# --- 7. the CLI and the API agree ----------------------------------------------------------


@pytest.mark.parametrize(
    "alias, target", [("bfloat16", "bf16"), ("float16", "fp16"), ("half", "fp16")]
)
def test_7_dtype_aliases_in_both(tmp_path, run_main, alias, target):
    src = write_safetensors(tmp_path / "in.safetensors", {"w": ("F32", [4], ONES)})
    rc, out, err = run_main("convert", src, "--to", alias, "--json")
    assert rc == 0, err
    assert json.loads(out)["result"]["to"] == target
    assert (tmp_path / f"in-{target}.safetensors").exists()
    report = stcast.convert(src, tmp_path / "api.safetensors", to=alias)
    assert report.to == target


def test_7_threads_zero_or_absent_means_every_core(tmp_path, run_main):
    import os

    src = write_safetensors(tmp_path / "in.safetensors", {"w": ("F32", [4], ONES)})
    cores = len(os.sched_getaffinity(0))
    assert stcast.convert(src, tmp_path / "a.safetensors", threads=0).threads == cores
    assert stcast.convert(src, tmp_path / "b.safetensors").threads == cores
    rc, out, _ = run_main("convert", src, tmp_path / "c.safetensors", "--threads", "0", "--json")
    assert json.loads(out)["result"]["threads"] == cores


def test_7_version_command_list_and_short_usage_errors(run_main, tmp_path):
    rc, out, _ = run_main("-V")
    assert (rc, out) == (0, f"stcast {stcast.__version__}\n")
    rc, out, err = run_main()
    assert rc == 2 and out == ""
    for name in ("convert", "inspect", "verify", "finalize", "demo", "completion", "manpage"):
        assert re.search(rf"^  {name} +\S", err, re.M), name
    for args, flag in [
        (["convert", "x", "--to", "int8"], "--to"),
        (["convert", "x", "--threads", "-1"], "--threads"),
        (["convert", "x", "--shard", "0/2"], "--shard"),
        (["verify", "x"], "DST"),
        (["convert", "x", "--bogus"], "--bogus"),
    ]:
        rc, out, err = run_main(*args, cwd=tmp_path)
        line = assert_one_error_line(err)
        assert rc == 2 and flag in line and line.endswith(f"(see `stcast {args[0]} --help`)"), line


def test_7_convert_dry_run_is_inspect(tmp_path, run_main):
    src = write_safetensors(
        tmp_path / "in.safetensors", {"w": ("F32", [4], ONES), "n": ("F32", [2], f32(1, 2))}
    )
    dst = tmp_path / "o.safetensors"
    dry = run_main("convert", src, dst, "--keep", "n", "--dry-run", "--json")
    plain = run_main("inspect", src, dst, "--keep", "n", "--json")
    assert dry[0] == plain[0] == 0
    a, b = json.loads(dry[1])["result"], json.loads(plain[1])["result"]
    for r in (a, b):
        r["destination"].pop("free_bytes")  # the disk is not still
    assert a == b and a["tensors_kept"] == 1
    assert not dst.exists()


# --- 9. no silent full copies --------------------------------------------------------------


def test_9_a_folder_already_in_the_target_dtype_is_refused(tmp_path, run_main):
    bf16 = ("BF16", [2], np.uint16([0x3F80, 0x4000]))
    src = folder(tmp_path / "m", {"a.safetensors": {"w": bf16}, "b.safetensors": {"w": bf16}})
    rc, out, err = run_main("convert", src)
    line = assert_one_error_line(err)
    assert rc == 1 and "nothing to convert" in line and "copy of the folder" in line
    assert not (tmp_path / "m-bf16").exists()
    # Partly converted is fine: one file converts, the other is copied.
    write_safetensors(src / "c.safetensors", {"w": ("F32", [4], ONES)})
    rc, out, err = run_main("convert", src)
    assert rc == 0 and "1 converted" in out, err
    # Every float tensor kept by the options: nothing changes either.
    rc, _, err = run_main("convert", src, tmp_path / "k", "--keep", "*")
    assert rc == 1 and "nothing to convert" in assert_one_error_line(err)


def _hub_repo(tmp_path: Path, snapshots: list[str], ref: str | None) -> Path:
    repo = tmp_path / "hub" / "models--org--name"
    blob = repo / "blobs" / "0123abcd"
    blob.parent.mkdir(parents=True)
    write_safetensors(blob, {"w": ("F32", [4], ONES)})
    for snap in snapshots:
        (repo / "snapshots" / snap).mkdir(parents=True)
        (repo / "snapshots" / snap / "model.safetensors").symlink_to(f"../../blobs/{blob.name}")
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(ref)
    return repo


def test_9_a_hub_cache_repo_root_converts_its_main_snapshot(tmp_path, run_main):
    repo = _hub_repo(tmp_path, ["aaaa", "bbbb"], ref="bbbb")
    rc, out, err = run_main("convert", repo)
    assert rc == 0, err
    dst = tmp_path / "hub" / "name-bf16"  # beside the repo, not in the cache, not cache-like
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]
    assert tensor_bytes(dst / "model.safetensors")["w"][0] == "BF16"
    assert sorted(p.name for p in (repo / "snapshots").iterdir()) == ["aaaa", "bbbb"]


@pytest.mark.parametrize("ref", [None, "..", "cccc"])
def test_9_a_hub_cache_repo_root_without_a_usable_ref_is_refused(tmp_path, run_main, ref):
    repo = _hub_repo(tmp_path, ["aaaa", "bbbb"], ref=ref)
    rc, out, err = run_main("convert", repo)
    line = assert_one_error_line(err)
    assert rc == 1 and "snapshot" in line, line
    if ref is None:
        assert "aaaa, bbbb" in line
    assert not (tmp_path / "hub" / "name-bf16").exists()


# --- 10. help ------------------------------------------------------------------------------


def test_10_every_command_has_examples_and_defaults(run_main):
    for name in ("convert", "inspect", "verify", "finalize", "demo", "completion", "manpage"):
        rc, out, _ = run_main(name, "--help")
        assert rc == 0 and "\nexamples:\n" in out, name
    _, out, _ = run_main("convert", "--help")
    assert "(default 0: all cores)" in out and "-fp16" in out and "(default bf16)" in out
    _, out, _ = run_main("demo", "--help")
    assert "--keep-files" in out and "--keep " not in out


def test_10_help_of_the_api_documents_every_parameter():
    for fn in (stcast.convert, stcast.inspect, stcast.verify, stcast.finalize):
        doc = fn.__doc__ or ""
        for name in inspect.signature(fn).parameters:
            assert re.search(rf"\b{name}\b", doc), (fn.__name__, name)
    assert "folder" in (stcast.convert.__doc__ or "").lower()


# --- 11. summaries add up --------------------------------------------------------------------


def test_11_summaries_say_what_happened(tmp_path, run_main):
    src = _two_files(tmp_path)
    dst = tmp_path / "out"
    rc, out, _ = run_main("convert", src, dst, "--keep", "norm", "--keep-min-size", "8")
    assert (
        rc == 0 and "kept     2 tensors (24 B) in their dtype (1 by --keep, 1 by min size)" in out
    )
    # A resume with everything done, and finalize, say so rather than "0 B -> 0 B".
    rc, out, _ = run_main("convert", src, dst, "--keep", "norm", "--keep-min-size", "8", "--resume")
    assert rc == 0 and out.startswith(f"nothing to do: every file is already converted in {dst}")
    assert "0 B" not in out
    # The shard hint gives the real paths.
    rc, out, _ = run_main("convert", "model", "sharded", "--shard", "1/2", cwd=tmp_path)
    assert f"stcast finalize {tmp_path / 'model'} {tmp_path / 'sharded'}" in out
    run_main("convert", "model", "sharded", "--shard", "2/2", cwd=tmp_path)
    rc, out, _ = run_main("finalize", src, tmp_path / "sharded")
    assert rc == 0 and out.startswith("finalized ") and "2 checked" in out


def test_11_the_bar_time_is_the_summary_time(tmp_path):
    x = np.ones((3 << 20) // 4, np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": ("F32", [x.size], x)})
    rc, out, err = run_on_pty(["convert", src], deterministic=True)
    assert rc == 0, err
    bar_time = re.findall(r"in (\d+\.\d+) s", err.decode())[-1]
    summary_time = re.search(r"time +(\d+\.\d+) s", out).group(1)
    assert bar_time == summary_time


def test_11_verify_progress_total_is_what_it_compares(tmp_path):
    src = _two_files(tmp_path)
    stcast.convert(src, tmp_path / "out")
    seen = []
    report = stcast.verify(src, tmp_path / "out", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (report.bytes_compared, report.bytes_compared)
    one = src / "model-00001-of-00002.safetensors"
    seen.clear()
    report = stcast.verify(
        one, tmp_path / "out" / one.name, progress=lambda d, t: seen.append((d, t))
    )
    assert seen[-1] == (report.bytes_compared, report.bytes_compared)


# --- 12. one unit system ---------------------------------------------------------------------


def test_12_decimal_units_everywhere(tmp_path, run_main):
    x = np.ones(300_000, np.float32)
    src = write_safetensors(tmp_path / "in.safetensors", {"w": ("F32", [x.size], x)})
    texts = [
        run_main("convert", src)[1],
        run_main("inspect", src)[1],
        run_main("verify", src, tmp_path / "in-bf16.safetensors")[1],
    ]
    for text in texts:
        assert not re.search(r"\d (KiB|MiB|GiB)", text), text
    assert "1.20 MB -> 600 kB" in texts[0]


# --- 14. the demo explains its warnings ------------------------------------------------------


def test_14_demo_explains_what_it_planted(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "stcast", "demo", "--size-gib", "0.005", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "stcast: warning" not in proc.stderr + proc.stdout
    assert "on purpose" in proc.stdout and "verified" in proc.stdout
    assert re.search(r"peak RSS +[\d.]+ MB", proc.stdout)


# --- 15. shell completion and the man page ---------------------------------------------------


def test_15_completion_scripts_parse_and_know_every_option(run_main, tmp_path):
    import shutil

    from stcast.cli import build_parser

    parser = build_parser()
    for shell in ("bash", "zsh", "fish"):
        rc, out, err = run_main("completion", shell)
        assert rc == 0 and err == "", shell
        for name, sub in parser.commands.items():
            assert name in out, (shell, name)
            for a in sub._actions:
                for flag in a.option_strings:
                    if flag.startswith("--") and a.help != "==SUPPRESS==":
                        assert flag[2:] in out, (shell, name, flag)
        exe = shutil.which(shell)
        if exe is not None:
            script = tmp_path / f"stcast.{shell}"
            script.write_text(out)
            check = subprocess.run([exe, "-n", str(script)], capture_output=True, text=True)
            assert check.returncode == 0, (shell, check.stderr)
    _, out, _ = run_main("completion", "bash")
    assert 'compgen -W "bf16 fp16 keep fp8 fp8-block bfloat16' in out  # --to offers the dtype names
    rc, _, err = run_main("completion", "tcsh")
    assert rc == 2


def test_15_manpage_renders(run_main, tmp_path):
    import shutil

    rc, out, err = run_main("manpage")
    assert rc == 0 and out.startswith(".TH STCAST 1 ")
    for name in ("convert", "inspect", "verify", "finalize"):
        assert f".SS {name}" in out
    man = shutil.which("man")
    if man is not None:
        page = tmp_path / "stcast.1"
        page.write_text(out)
        shown = subprocess.run(
            [man, "-l", str(page)],
            capture_output=True,
            text=True,
            env={**cli_env(), "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"},
        )
        assert shown.returncode == 0 and "--on-overflow" in shown.stdout.replace("‐", "-")


# --- found by a fresh-eyed attack on the above -----------------------------------------------


def _overflowing(tmp_path: Path) -> Path:
    return write_safetensors(
        tmp_path / "a.safetensors",
        {"w": ("F32", [4], ONES), "big": ("F32", [3], f32(1e5, 7e4, 1))},
    )


def test_verify_holds_convert_to_its_overflow_options(tmp_path, run_main):
    """A DST whose tensor overflowed to inf is not what `--on-overflow keep` (or error)
    writes: strict verify names it; the default (warn) accepts it."""
    src = _overflowing(tmp_path)
    dst = tmp_path / "o.safetensors"
    stcast.convert(src, dst, to="fp16")
    assert stcast.verify(src, dst).ok
    for option in ("keep", "error"):
        rc, _, err = run_main("verify", src, dst, "--on-overflow", option)
        line = assert_one_error_line(err)
        assert rc == 1 and "`big`" in line and "became ±inf" in line, line
    assert stcast.verify(src, dst, on_overflow="keep", loose=True).ok
    kept = tmp_path / "k.safetensors"
    stcast.convert(src, kept, to="fp16", on_overflow="keep")
    assert stcast.verify(src, kept, on_overflow="keep").ok


def test_the_dry_run_refuses_an_overflow_as_convert(tmp_path, run_main):
    src = _overflowing(tmp_path)
    args = ("--to", "fp16", "--on-overflow", "error")
    rc_c, _, err_c = run_main("convert", src, tmp_path / "o.safetensors", *args)
    rc_d, _, err_d = run_main("convert", src, tmp_path / "o.safetensors", *args, "--dry-run")
    assert rc_c == rc_d == 1 and err_c == err_d and "would become ±inf" in err_c
    assert listing(tmp_path) == ["a.safetensors"]


def test_dry_run_checks_the_default_destination(tmp_path, run_main):
    src = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [4], ONES)})
    (tmp_path / "a-bf16.safetensors").write_bytes(b"mine")
    rc, _, err = run_main("convert", src, "--dry-run")
    assert rc == 1 and "destination exists" in assert_one_error_line(err)
    rc, out, err = run_main("convert", src, "--dry-run", "-q")
    assert (rc, out) == (1, "")
    (tmp_path / "a-bf16.safetensors").unlink()
    assert run_main("convert", src, "--dry-run", "-q") == (0, "", "")


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_a_report_inside_the_source_or_destination_folder_is_refused(tmp_path, run_main, command):
    src = _two_files(tmp_path)
    (src / "README.md").write_text("mine")
    dst = tmp_path / "out"
    stcast.convert(src, dst)
    before = (src / "README.md").read_bytes()
    for inside in (src / "README.md", dst / "config.json"):
        args = [command, src, dst, "--report", inside, "--force"]
        if command == "convert":
            args.append("--resume")
        rc, _, err = run_main(*args)
        line = assert_one_error_line(err)
        assert rc == 1 and "lies inside the" in line, line
    assert (src / "README.md").read_bytes() == before
    assert stcast.verify(src, dst).ok


def test_options_may_come_between_src_and_dst(tmp_path, run_main):
    src = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [4], ONES)})
    rc, _, err = run_main("convert", src, "--to", "fp16", tmp_path / "o.safetensors")
    assert rc == 0, err
    assert tensor_bytes(tmp_path / "o.safetensors")["w"][0] == "F16"
    rc, _, err = run_main("-x")
    assert rc == 2 and "unrecognized option -x" in assert_one_error_line(err)


def test_json_usage_errors_are_json(tmp_path, run_main):
    src = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [4], ONES)})
    rc, out, _ = run_main("convert", src, "--threads", "5000", "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["error"]["kind"] == "usage" and "--threads" in doc["error"]["message"]


def test_lfs_pointers_and_other_files_are_named(tmp_path, run_main):
    lfs = tmp_path / "model.safetensors"
    lfs.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 12345\n"
    )
    rc, _, err = run_main("convert", lfs)
    assert rc == 1 and "Git LFS pointer" in assert_one_error_line(err)
    gz = tmp_path / "g.safetensors"
    gz.write_bytes(b"\x1f\x8b\x08\x00" + bytes(40))
    rc, _, err = run_main("convert", gz)
    assert rc == 1 and "gzip" in assert_one_error_line(err)


def test_verify_names_which_side_is_wrong(tmp_path, run_main):
    src = write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", [4], ONES)})
    (tmp_path / "d").mkdir()
    rc, _, err = run_main("verify", src, tmp_path / "d")
    assert rc == 1 and "a folder without .safetensors files, while" in assert_one_error_line(err)
    folder_src = _two_files(tmp_path)
    rc, _, err = run_main("verify", folder_src, tmp_path / "nowhere")
    assert rc == 1 and "no such folder" in assert_one_error_line(err)


def test_loose_folder_verify_compares_json_as_data(tmp_path):
    src = _two_files(tmp_path)
    (src / "config.json").write_text(json.dumps({"torch_dtype": "float32", "n": 1}, indent=2))
    dst = tmp_path / "out"
    stcast.convert(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config))  # other tools' layout
    assert not stcast.verify(src, dst).ok
    assert stcast.verify(src, dst, loose=True).ok
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))
    assert not stcast.verify(src, dst, loose=True).ok


def test_folder_reports_stay_lazy_and_short(tmp_path):
    src = _two_files(tmp_path)
    report = stcast.convert(src, tmp_path / "out")
    rows = report.numerics["tensors"]
    assert len(rows) == 4 and rows[0]["file"] == "model-00001-of-00002.safetensors"
    assert rows[-1]["file"] == "model-00002-of-00002.safetensors" and rows[1:2] == [rows[1]]
    checked = stcast.verify(src, tmp_path / "out")
    assert checked.numerics["tensors"] == rows
    assert len(repr(checked)) < 300 and "ok" in repr(checked)
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(rows)) == rows.tolist() == copy.deepcopy(rows)
    one = stcast.convert(src / "model-00001-of-00002.safetensors", tmp_path / "one.safetensors")
    t = one.numerics["tensors"]
    assert pickle.loads(pickle.dumps(t)) == list(t) == copy.deepcopy(t)
    assert t.index(t[0]) == 0 and t.count(t[0]) == 1
    with pytest.raises(IndexError):
        t[2**70]


def test_hf_download_metadata_is_not_copied(tmp_path):
    src = _two_files(tmp_path)
    meta = src / ".cache" / "huggingface"
    meta.mkdir(parents=True)
    (meta / "model-00001-of-00002.safetensors.metadata").write_text("sha of the fp32 file")
    stcast.convert(src, tmp_path / "out")
    assert not (tmp_path / "out" / ".cache").exists()


def test_the_bar_fits_wide_file_names(tmp_path):
    src = tmp_path / "模型"
    src.mkdir()
    x = np.ones((3 << 20) // 4, np.float32)
    write_safetensors(src / "扩散模型权重文件非常长的名字.safetensors", {"w": ("F32", [x.size], x)})
    rc, out, err = run_on_pty(["convert", src], columns=60, deterministic=True)
    assert rc == 0, err
    import pyte

    screen = pyte.Screen(60, 50)
    pyte.ByteStream(screen).feed(err)
    lines = [ln.rstrip() for ln in screen.display if ln.strip()]
    assert len(lines) == 1 and "100%" in lines[0], lines


# --- issue 21, 2: DST as users type it --------------------------------------------------------


def _ema(tmp_path: Path) -> Path:
    return write_safetensors(tmp_path / "ema.safetensors", {"w": ("F32", [4], f32(1, 2, 3, 4))})


def test_21_2_a_file_dst_gets_its_missing_folders(tmp_path, run_main):
    """The README's `convert ema.safetensors out/ema-bf16.safetensors`: the folders are made,
    nested ones too, as for a folder DST; the API alike."""
    src = _ema(tmp_path)
    rc, out, err = run_main(
        "convert", src, "out/ema-bf16.safetensors", "--threads", "2", cwd=tmp_path
    )
    assert rc == 0, err
    assert tensor_bytes(tmp_path / "out" / "ema-bf16.safetensors")["w"][0] == "BF16"
    report = stcast.convert(src, tmp_path / "a" / "b" / "c.safetensors")
    assert report.dst == str(tmp_path / "a" / "b" / "c.safetensors")
    rc, out, err = run_main("verify", src, tmp_path / "a" / "b" / "c.safetensors")
    assert rc == 0, err


def test_21_2_a_refused_run_creates_no_folder(tmp_path, run_main):
    """Every refusal is checked before the folders are made; a run that fails after (an
    overflow under `--on-overflow error`, found while converting) removes those it made."""
    src = _ema(tmp_path)
    big = write_safetensors(tmp_path / "big.safetensors", {"w": ("F32", [2], f32(1e6, 1))})
    (tmp_path / "exists.safetensors").write_bytes(b"mine")
    before = listing(tmp_path)
    for args in (
        [src, "new/a/b.safetensors", "--report", "nope/r.json"],
        [src, "new/a/b.safetensors", "--keep", "nothing*", "--strict"],
        [src, "new/a/ema.safetensors", "--to", "keep"],
        [big, "new/a/b.safetensors", "--to", "fp16", "--on-overflow", "error"],
        [src, "exists.safetensors/"],
    ):
        rc, out, err = run_main("convert", *args, cwd=tmp_path)
        assert rc == 1, (args, err)
        assert_one_error_line(err)
        assert listing(tmp_path) == before, args
        assert (tmp_path / "exists.safetensors").read_bytes() == b"mine"
    with pytest.raises(stcast.Refused):
        stcast.convert(big, tmp_path / "new" / "x.safetensors", to="fp16", on_overflow="error")
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    ("point", "code"),
    [
        ("mid-tensor=sigint", -signal.SIGINT),
        ("tmpfile=eopnotsupp,mid-tensor=sigterm", -signal.SIGTERM),
        ("publish=eio", 1),
    ],
)
def test_21_2_an_interrupted_or_failed_run_removes_the_folders_it_made(
    tmp_path, cli_process, point, code
):
    # 10 MiB: two of the CLI's 8 MiB windows, so that `mid-tensor` is reached.
    n = 10 << 18
    src = write_safetensors(
        tmp_path / "big.safetensors", {"w": ("F32", [n], np.ones(n, np.float32))}
    )
    rc, out, err = cli_process(
        "convert", src, "new/a/b.safetensors", cwd=tmp_path, env={"STCAST_FAILPOINT": point}
    )
    assert rc == code, err
    assert listing(tmp_path) == ["big.safetensors"]


@pytest.mark.parametrize("existing", [True, False], ids=["existing", "slash"])
def test_21_2_a_folder_dst_gets_the_default_name(tmp_path, run_main, existing):
    """A file SRC into a folder (one that exists, or a path ending in `/`) is written as
    convert names it by default, as `cp` does; inspect and verify look for the same name."""
    src = _ema(tmp_path)
    pt = tmp_path / "model.pt"
    from torchfile import StateDict, write_zip

    objs, storages = StateDict({"w": f32(1, 2)}).pickled()
    write_zip(pt, objs, storages)
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    dst = str(out) if existing else f"{out}/"
    for args, name in (
        ([src, dst], "ema-bf16.safetensors"),
        ([src, dst, "--to", "fp16"], "ema-fp16.safetensors"),
        ([pt, dst, "--to", "keep"], "model.safetensors"),
    ):
        rc, text, err = run_main("inspect", *args)
        assert rc == 0 and "every check convert makes passed" in text, err
        rc, text, err = run_main("convert", *args)
        assert rc == 0, err
        assert f"-> {out / name}" in text
        rc, text, err = run_main("verify", *args)
        assert rc == 0 and f"verified {out / name}" in text, err
        rc, text, err = run_main("inspect", *args)
        assert rc == 1 and "destination exists" in assert_one_error_line(err)
    assert listing(out) == ["ema-bf16.safetensors", "ema-fp16.safetensors", "model.safetensors"]
    # The API the same.
    for f in listing(out):
        (out / f).unlink()
    assert stcast.convert(src, out).dst == str(out / "ema-bf16.safetensors")
    assert stcast.verify(src, out).dst == str(out / "ema-bf16.safetensors")
    assert stcast.inspect(src, out, force=True).destination is not None
    # Both targets there: verify is told which.
    stcast.convert(src, out, to="fp16")
    rc, text, err = run_main("verify", src, out)
    assert rc == 2 and "--to" in assert_one_error_line(err)
    with pytest.raises(stcast.UsageError, match=r"give to\b"):
        stcast.verify(src, out)
    assert stcast.verify(src, out, to="fp16").ok


def test_21_2_with_max_shard_size_dst_stays_the_shard_folder(tmp_path, run_main):
    src = _ema(tmp_path)
    rc, text, err = run_main("convert", src, tmp_path / "shards", "--max-shard-size", "1GB")
    assert rc == 0, err
    assert listing(tmp_path / "shards") == ["ema.safetensors"]
    rc, text, err = run_main("verify", src, tmp_path / "shards")
    assert rc == 0 and f"verified {tmp_path / 'shards'}" in text, err


@pytest.mark.parametrize("exists", [True, False])
def test_21_2_inspect_out_folder_from_its_help(tmp_path, run_main, exists):
    """`stcast inspect ema.safetensors out/ --to fp16 --scan` and the guide's
    `inspect model.safetensors /data/out`, with the folder there or not."""
    _ema(tmp_path)
    if exists:
        (tmp_path / "out").mkdir()
    for dst in ("out/", "out"):
        rc, text, err = run_main(
            "inspect", "ema.safetensors", dst, "--to", "fp16", "--scan", cwd=tmp_path
        )
        assert rc == 0 and "every check convert makes passed" in text, err
    assert listing(tmp_path) == ["ema.safetensors", *(["out"] if exists else [])]


# --- issue 21, 3: re-sharding footguns ------------------------------------------------------


@pytest.mark.parametrize("unit", ["GB", "gb", "MiB", "kB", "B", "tib"])
def test_21_3_a_unit_as_dst_is_a_usage_error(tmp_path, run_main, unit):
    """`--max-shard-size 5 GB` (a space): `GB` would become DST, a folder of 5-byte shards."""
    src = _ema(tmp_path)
    before = listing(tmp_path)
    for args in (
        [src, "--max-shard-size", "5", unit],
        [src, "--max-shard-size", "5", f"{unit}/"],
        [src, f"{tmp_path}/shards/", "--max-shard-size", "5", unit],
    ):
        for command in ("convert", "inspect"):
            rc, out, err = run_main(command, *args, cwd=tmp_path)
            line = assert_one_error_line(err)
            assert rc == 2 and f"--max-shard-size 5{unit}" in line, line
            assert listing(tmp_path) == before
    # The API reads "5 GB" as 5 GB: there the space is unambiguous.
    assert stcast.inspect(src, max_shard_size="5 GB").max_shard_size == 5 * 10**9
    # A size with its unit has lost nothing: a folder named like a unit is just a folder.
    rc, _, err = run_main("convert", src, unit, "--max-shard-size", "3kB", cwd=tmp_path)
    assert rc == 0 and (tmp_path / unit).is_dir(), err


def test_21_3_a_bare_small_number_warns_and_runs(tmp_path, run_main):
    src = write_safetensors(
        tmp_path / "ema.safetensors", {"a": ("F32", [4], ONES), "b": ("F32", [4], ONES)}
    )
    rc, out, err = run_main("convert", src, tmp_path / "shards", "--max-shard-size", "5")
    assert rc == 0, err
    warned = [ln for ln in err.splitlines() if "--max-shard-size 5 " in ln]
    assert len(warned) == 1 and "5GB" in warned[0], err
    assert "ema.safetensors.index.json" in listing(tmp_path / "shards")
    rc, out, err = run_main("convert", src, tmp_path / "big", "--max-shard-size", "5000000")
    assert rc == 0 and "--max-shard-size" not in err, err


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_21_3_a_shard_folder_named_like_a_file_is_refused(tmp_path, run_main, command):
    src = _ema(tmp_path)
    before = listing(tmp_path)
    rc, out, err = run_main(command, src, tmp_path / "out.safetensors", "--max-shard-size", "1GB")
    line = assert_one_error_line(err)
    assert rc == 2 and "out.safetensors" in line and "--max-shard-size" in line, line
    assert listing(tmp_path) == before
    with pytest.raises(stcast.UsageError) as info:
        stcast.convert(src, tmp_path / "out.safetensors", max_shard_size="1GB")
    assert "--" not in str(info.value) and "max_shard_size" in str(info.value)
    assert listing(tmp_path) == before


# --- issue 21, point 4: docs that are true -------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benches/README-bench.md"]


def test_21_docs_name_only_what_exists():
    """Every `stcast.X` and every report class the docs name is real; no doc sends readers
    to the team's old `shared/peers` (they live in benches/peers)."""
    from stcast import reports

    assert (ROOT / "benches" / "peers").is_dir()
    for doc in DOCS:
        text = doc.read_text()
        assert "shared/peers" not in text, doc
        for name in set(re.findall(r"\bstcast\.([A-Za-z_]\w*)", text)):
            assert hasattr(stcast, name), f"{doc.name}: stcast.{name}"
        for name in set(re.findall(r"`([A-Z]\w*(?:Report|Info))`", text)):
            assert hasattr(reports, name) and name in stcast.__all__, f"{doc.name}: {name}"


def test_21_readme_claims_the_sizes_the_benchmarks_measured():
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    claimed = re.search(r"measured from 1 to (\d+) GiB", readme)
    assert claimed is not None
    largest = max(int(g) for g in re.findall(r"\| (\d+) GiB \| stcast \|", bench))
    assert int(claimed.group(1)) == largest == 16


# --- issue 21, point 5: the smaller findings -----------------------------------------------


def test_21_dir_shows_the_public_names_only():
    names = dir(stcast)
    assert set(stcast.__all__) <= set(names)
    assert "TYPE_CHECKING" not in names and "annotations" not in names and "_LAZY" not in names
    assert "__version__" in names and "__doc__" in names
    stcast.convert  # noqa: B018 -- a loaded name or submodule adds nothing
    assert dir(stcast) == names


def test_21_the_inspect_table_pads_by_display_width(tmp_path, run_main):
    """CJK and emoji names take two columns each: the columns after them still line up (as
    a terminal draws them, which pyte does)."""
    import pyte

    names = ["w", "中文名字", "😀x", "e\u0301"]  # the last with a combining accent
    src = tmp_path / "m.safetensors"
    write_safetensors(src, {n: ("F32", [4], ONES) for n in names})
    rc, out, err = run_main("inspect", src)
    assert rc == 0, err
    screen = pyte.Screen(100, 20)
    pyte.Stream(screen).feed(out.replace("\n", "\r\n"))

    def column(word: str) -> set[int]:
        """The screen columns where `word` starts, one per line that has it."""
        found = set()
        for y in range(screen.lines):
            cells = "".join(screen.buffer[y][x].data[:1] or "?" for x in range(screen.columns))
            if word in cells:
                found.add(cells.index(word))
        return found

    assert out.count("F32") == len(names)
    assert len(column("F32")) == 1 and len(column("BF16")) == 1, screen.display


def test_21_progress_hears_of_the_end_once(tmp_path):
    """`progress(total, total)` comes once, last (it came twice: after the last step and
    after sealing; a folder's per-file end again from the folder's own bookkeeping)."""
    src = _two_files(tmp_path)
    one = src / "model-00001-of-00002.safetensors"

    def calls(run) -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []
        run(lambda done, total: seen.append((done, total)))
        return seen

    runs = {
        "file": lambda p: stcast.convert(one, tmp_path / "one.safetensors", progress=p),
        "folder": lambda p: stcast.convert(src, tmp_path / "out", progress=p),
        "verify": lambda p: stcast.verify(one, tmp_path / "one.safetensors", progress=p),
        "verify folder": lambda p: stcast.verify(src, tmp_path / "out", progress=p),
        "scan": lambda p: stcast.inspect(one, scan=True, progress=p),
        "scan folder": lambda p: stcast.inspect(src, scan=True, progress=p),
    }
    for what, run in runs.items():
        seen = calls(run)
        total = seen[-1][1]
        assert total > 0 and seen[-1] == (total, total), (what, seen)
        assert seen.count((total, total)) == 1, (what, seen)
        assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:])), (what, seen)
    # A run with nothing left to do hears of its end too, once.
    for resumed in (
        lambda p: stcast.convert(src, tmp_path / "out", resume=True, progress=p),
        lambda p: stcast.convert(src, tmp_path / "half", shard=(1, 2), resume=True, progress=p),
    ):
        resumed(lambda done, total: None)  # the first time (the shard run does its half)
        seen = calls(resumed)
        assert seen and seen[-1][0] == seen[-1][1] and seen.count(seen[-1]) == 1, seen
    files: list[tuple[str, int, int]] = []
    stcast.convert(src, tmp_path / "again", file_progress=lambda *a: files.append(a))
    ends = [f for f in files if f[1] == f[2]]
    assert len(ends) == len({f[0] for f in files}), files


def test_21_a_strict_metadata_order_mismatch_hints_at_loose(tmp_path, run_main):
    """Every strict-only mismatch says that --loose accepts it; metadata key order did not."""
    meta = {"a": "1", "z": "2"}
    src = write_safetensors(tmp_path / "m.safetensors", {"w": ("F32", [4], ONES)}, meta)
    out_ = tmp_path / "o.safetensors"
    stcast.convert(src, out_)
    bad = write_safetensors(tmp_path / "bad.safetensors", tensor_bytes(out_), {"z": "2", "a": "1"})
    rc, out, err = run_main("verify", src, bad)
    assert rc == 1 and assert_one_error_line(out + err).endswith(
        'key order differs at position 0: expected "a", found "z" (--loose accepts any key order)'
    ), (out, err)
    assert stcast.verify(src, bad, loose=True).ok
    # No __metadata__ for an empty one: also strict only.
    empty = write_safetensors(tmp_path / "e.safetensors", {"w": ("F32", [4], ONES)}, {})
    none = write_safetensors(tmp_path / "none.safetensors", tensor_bytes(out_))
    m = stcast.verify(empty, none).mismatch
    assert m is not None and m.message == (
        "__metadata__ differs: SRC has a __metadata__ entry, DST has none "
        "(loose=True takes no __metadata__ for an empty one)"
    )
    assert stcast.verify(empty, none, loose=True).ok


def _stdout_on_pty(args: list[object], columns: int) -> str:
    """The CLI's stdout as a terminal `columns` wide shows it (stderr left out)."""
    rc, _, shown = run_on_pty(args, columns=columns, terminal="stdout")
    assert rc == 0
    return shown.decode().replace("\r\n", "\n")


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_21_the_summary_wraps_at_spaces_on_a_narrow_terminal(tmp_path, run_main, kind):
    """At 50 columns the summary's `time` line (about 60 wide) wrapped mid-word; now every
    line fits and is cut at a space, the rest indented under the value."""
    src = _two_files(tmp_path) if kind == "folder" else tmp_path / "m.safetensors"
    if kind == "file":
        write_safetensors(src, {"w": ("F32", [4], ONES)})
    shown = _stdout_on_pty(["convert", src, tmp_path / "o", "--threads", "2"], columns=50)
    rc, piped, _ = run_main("convert", src, tmp_path / "p", "--threads", "2")
    assert rc == 0
    lines = shown.rstrip("\n").split("\n")
    assert all(len(ln) <= 50 for ln in lines if " " in ln.strip()), lines
    time_at = next(i for i, ln in enumerate(lines) if ln.startswith("  time     "))
    assert lines[time_at + 1].startswith(" " * 11) and lines[time_at + 1][11] != " ", lines

    # The same words as a pipe gets them on one line each (paths and figures aside, and
    # the units of figures: one run's rate is in B/s, the next one's in kB/s).
    def words(text: str) -> list[str]:
        unit = re.compile(r"\(?[kMGT]?B(/s)?\)?,?")
        return [
            w
            for w in text.split()
            if tmp_path.name not in w and not re.search(r"\d", w) and not unit.fullmatch(w)
        ]

    assert words(shown) == words(piped)


def test_21_paths_are_shown_as_the_user_spelled_them(tmp_path, run_main, monkeypatch):
    """SRC and DST as given (relative stays relative), joined with the file's name inside a
    folder; `inspect`'s space line and `convert .`'s default DST were absolute."""
    monkeypatch.chdir(tmp_path)
    folder(Path("adir"), {"model.safetensors": {"w": ("F32", [4], ONES)}})
    (tmp_path / "adir" / "bad.safetensors").write_text("# not weights\n")
    for given in ["adir", "adir/.", "./adir", str(tmp_path / "adir")]:
        for args in (["convert", given, "out"], ["inspect", given]):
            rc, out, err = run_main(*args)
            assert rc == 1 and assert_one_error_line(err).startswith(
                f"stcast: {os.path.join(given, 'bad.safetensors')}: a text file, not"
            ), (args, err)
    (tmp_path / "adir" / "bad.safetensors").unlink()
    for dst, shown in [("x.safetensors", "."), ("new/sub", "."), ("../y", "..")]:
        src = "adir/model.safetensors" if dst == "x.safetensors" else "adir"
        rc, out, err = run_main("inspect", src, dst)
        assert rc == 0 and f"\nspace:    {shown} has " in out, (dst, out, err)
    rc, out, err = run_main("inspect", "adir", str(tmp_path / "new"))
    assert rc == 0 and f"\nspace:    {tmp_path} has " in out, (out, err)
    monkeypatch.chdir(tmp_path / "adir")
    rc, out, err = run_main("convert", ".")
    assert rc == 0 and out.startswith("converted . -> ../adir-bf16\n"), (out, err)
    assert (tmp_path / "adir-bf16" / "model.safetensors").is_file()


# --- found by the review of the boundary work (issue 22) ------------------------------------


def test_22_a_tuning_flag_must_be_a_bool(tmp_path):
    """`{"populate": "false"}` was read as true (a deserializer took the string's truth)."""
    src = _ema(tmp_path)
    for bad in ("false", "yes", 2):
        with pytest.raises((TypeError, ValueError)):
            stcast.convert(src, tmp_path / "o.safetensors", tuning={"populate": bad})
        assert not (tmp_path / "o.safetensors").exists()
    stcast.convert(src, tmp_path / "o.safetensors", tuning={"populate": False})


def test_22_a_trainer_checkpoint_under_deepspeed_is_a_hugging_face_folder(tmp_path, run_main):
    """The Trainer's checkpoint-N/ holds model.safetensors beside DeepSpeed's `latest` and
    partitions: its weights are there, so it converts as a folder, not refused as ZeRO."""
    src = tmp_path / "checkpoint-10"
    src.mkdir()
    x = np.arange(8, dtype=np.float32)
    write_safetensors(src / "model.safetensors", {"w": ("F32", [8], x)})
    (src / "latest").write_text("global_step10\n")
    (src / "global_step10").mkdir()
    (src / "global_step10" / "mp_rank_00_model_states.pt").write_bytes(b"")
    rc, _, err = run_main("convert", src, tmp_path / "out")
    assert rc == 0, err
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_22_a_keep_pattern_lets_no_unnamed_scale_through(tmp_path, run_main):
    """F8 beside an F32 tensor not named like a scale: a pattern that keeps nothing
    (`--keep zzz`) converted it silently; any F32 tensor may be the scale there."""
    w = np.zeros(4, np.uint8)
    src = write_safetensors(
        tmp_path / "q.safetensors",
        {"w": ("F8_E4M3", [4], w), "s": ("F32", [1], np.ones(1, np.float32))},
    )
    rc, _, err = run_main("convert", src, tmp_path / "o.safetensors", "--keep", "zzz")
    line = assert_one_error_line(err)
    assert rc == 1 and "quantized checkpoint" in line and "`s`" in line, line
    assert not (tmp_path / "o.safetensors").exists()
    rc, _, err = run_main(
        "convert", src, tmp_path / "o.safetensors", "--keep", "zzz", "--allow-quantized", "-q"
    )
    assert rc == 0, err


def test_the_top_level_help_and_the_man_page_name_every_input_and_target(run_main):
    """They said "safetensors checkpoints to bf16 or fp16" long after PyTorch, DCP, ZeRO and
    FP8 inputs and the FP8 targets came (issue 33, point 6)."""
    _, top, _ = run_main("--help")
    _, man, _ = run_main("manpage")
    description = man.split(".SH DESCRIPTION", 1)[1].split(".SH", 1)[0]
    for text in (top, description):
        flat = " ".join(text.split())
        for word in ("safetensors", "PyTorch", "DCP", "DeepSpeed ZeRO", "bf16", "fp16", "FP8"):
            assert word in flat, (word, flat)
