"""FP8 targets (`--to fp8`, `--to fp8-block`): bytes equal to llm-compressor's model_free_ptq
on the fixtures (tests/fixtures/fp8), a numpy reference of the arithmetic on generated
weights, which weights are quantized, NaN/inf weights, folders, verify, reports.

(The bugs an adversarial round found are fixed; each has its test here.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import stcast
from conftest import assert_one_error_line, read_safetensors, tensor_bytes, write_safetensors

FIX = Path(__file__).parent / "fixtures" / "fp8"
EXPECTED = json.loads((FIX / "expected-quant.json").read_text())
DERIVED = json.loads((FIX / "derived-sources.json").read_text())
CT_KEYS = json.loads((FIX / "quantization_config-ct0.20.1.json").read_text())

SCHEME = {"fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK"}
NP = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
EPS = {"F32": 2.0**-23, "BF16": 2.0**-7, "F16": 2.0**-10}
# (source, its fp32 origin, the --to that derives it)
SOURCES = {
    "llama-fp32": ("llama-fp32", None),
    "llama-bf16": ("llama-fp32", "bf16"),
    "odd-fp16": ("odd-fp32", "fp16"),
}


def sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def as_array(dtype: str, shape: list[int], raw: bytes) -> np.ndarray:
    if dtype == "F8_E4M3":
        return np.frombuffer(raw, np.uint8).reshape(shape)
    return np.frombuffer(raw, NP[dtype]).reshape(shape)


def quiet_convert(src, dst, **kw):
    """stcast.convert with its plan warnings recorded: (report, [(kind, message)])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = stcast.convert(src, dst, **kw)
    got = [(getattr(w.message, "kind", None), str(w.message)) for w in caught]
    return report, got


# --- the numpy reference ---------------------------------------------------------------------


def ref_quantize(w: np.ndarray, d: str, to: str) -> tuple[np.ndarray, np.ndarray]:
    """model_free_ptq's steps: (E4M3 bytes as uint8, scale in D)."""
    rows, cols = w.shape
    w32 = w.astype(np.float32)
    a = np.abs(w32)
    if to == "fp8":
        amax = a.max(axis=1, keepdims=True) if cols else np.zeros((rows, 1), np.float32)
        bs, bc = 1, cols
    else:
        tr, tc = -(-rows // 128), -(-cols // 128)
        pad = np.zeros((tr * 128, tc * 128), np.float32)
        pad[:rows, :cols] = a
        amax = pad.reshape(tr, 128, tc, 128).max(axis=(1, 3))
        bs = bc = 128
    s = (amax / np.float32(448.0)).astype(NP[d])
    s = np.where(s == 0, NP[d](EPS[d]), s).astype(NP[d])
    s32 = s.astype(np.float32)
    full = np.repeat(np.repeat(s32, bs, axis=0), bc, axis=1)[:rows, :cols]
    y = (w32 / full).astype(NP[d]).astype(np.float32)
    y = np.clip(y, -448.0, 448.0)  # torch's cast saturates; ml_dtypes' may not: clamp first
    q = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return q, s


def test_reference_matches_fixtures():
    """The reference itself against model_free_ptq's bytes on the committed fp32 runs."""
    src = tensor_bytes(FIX / "llama-fp32" / "model.safetensors")
    for to, folder in [("fp8", "llama-fp32.fp8-dynamic"), ("fp8-block", "llama-fp32.fp8-block")]:
        out = tensor_bytes(FIX / folder / "model.safetensors")
        for name in EXPECTED["runs"]["llama-fp32"][SCHEME[to]]["quantized"]:
            if name.endswith("_scale"):
                continue
            q, s = ref_quantize(as_array(*src[name]), "F32", to)
            assert q.tobytes() == out[name][2], name
            assert s.tobytes() == out[name + "_scale"][2], name


# --- the fixtures: model_free_ptq's bytes ------------------------------------------------------


def derive(source: str, tmp: Path) -> Path:
    """The source's model.safetensors, derived with stcast where not committed, checked
    against derived-sources.json."""
    origin, to = SOURCES[source]
    path = FIX / origin / "model.safetensors"
    if to is None:
        return path
    out = tmp / f"{source}.safetensors"
    if not out.exists():
        stcast.convert(path, out, to=to)
        want = DERIVED["sources"][source]["tensors"]
        got = tensor_bytes(out)
        assert sorted(got) == sorted(want)
        for name, rec in want.items():
            dtype, shape, raw = got[name]
            assert [dtype, shape, sha(raw)] == [rec["dtype"], rec["shape"], rec["sha256"]], name
    return out


def check_against_fixture(source: str, to: str, src_file: Path, out_file: Path) -> None:
    run = EXPECTED["runs"][source][SCHEME[to]]
    got = tensor_bytes(out_file)
    src = tensor_bytes(src_file)
    committed = tensor_bytes(FIX / run["folder"] / "model.safetensors")
    quantized = {n for n, (dt, _, _) in got.items() if dt == "F8_E4M3"}
    quantized |= {n + "_scale" for n in quantized}
    assert quantized == set(run["quantized"])
    assert set(got) - quantized == set(run["not_quantized"])
    for name, rec in run["quantized"].items():
        dtype, shape, raw = got[name]
        assert [dtype, shape, sha(raw)] == [rec["dtype"], rec["shape"], rec["sha256"]], name
        assert raw == committed[name][2]
    for name in run["not_quantized"]:
        dtype, shape, raw = got[name]
        assert dtype == "BF16", name
        want = as_array(*src[name]).astype(ml_dtypes.bfloat16)
        assert raw == want.tobytes(), name


RUNS = [(s, to) for s in SOURCES for to in SCHEME]


def run_folder(source: str, to: str) -> str:
    return EXPECTED["runs"][source][SCHEME[to]]["folder"]


@pytest.mark.parametrize("source, to", RUNS)
def test_fixture_file(tmp_path, source, to):
    src = derive(source, tmp_path)
    out = tmp_path / "out.safetensors"
    report, _ = quiet_convert(src, out, to=to)
    check_against_fixture(source, to, src, out)
    assert report.tensors_quantized == 7
    assert stcast.verify(src, out, to=to).ok
    assert stcast.verify(src, out).ok


@pytest.mark.parametrize("source, to", RUNS)
def test_fixture_folder(tmp_path, source, to):
    src_file = derive(source, tmp_path)
    origin = SOURCES[source][0]
    folder = tmp_path / "src"
    folder.mkdir()
    shutil.copy(src_file, folder / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(FIX / origin / name, folder / name)
    out = tmp_path / "dst"
    quiet_convert(folder, out, to=to)
    check_against_fixture(source, to, src_file, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert set(qc["ignore"]) == {"lm_head", "model.embed_tokens"}
    theirs = json.loads((FIX / run_folder(source, to) / "config.json").read_text())
    del theirs["quantization_config"]
    assert config == {**theirs, "dtype": "bfloat16"}
    assert qc["config_groups"][SCHEME[to]]["weights"]["strategy"] == (
        "block" if to == "fp8-block" else "channel"
    )


# --- generated weights against the reference ---------------------------------------------------

SHAPES = [(1, 7), (1, 300), (3, 129), (50, 128), (127, 1), (129, 130), (200, 257), (256, 64)]


def generated(rng, d: str) -> dict[str, np.ndarray]:
    """Weights of awkward shapes and edge rows, in dtype D."""
    out = {}
    tiny = np.float32(np.finfo(NP[d]).smallest_subnormal) if d != "BF16" else np.float32(1e-40)
    for k, (r, c) in enumerate(SHAPES):
        w = rng.standard_normal((r, c)).astype(np.float32)
        w *= np.logspace(-3, 2, r, dtype=np.float32)[:, None]
        if r >= 8:
            w[1] = 0.0  # all-zero row: eps scale
            w[2] = tiny * rng.integers(-3, 4, c)  # subnormal amax, values that flush
            w[3] = np.linspace(-3.5, 3.5, c, dtype=np.float32)  # scale 2^-7: ties
            w[4, ::2] = -0.0
            w[5] = 1e-4
            w[5, 0] = 1.0  # the rest flushes to zero or fp8 subnormals
            w[6] = 448.0 * 2.0 ** rng.integers(-8, 8, c)  # powers of two
        if r >= 9:
            w[7] = np.float32(1e-42) * rng.standard_normal(c)  # a coarse subnormal scale
        if r >= 200:
            w[:128, :128] = 0.0  # an all-zero tile
            w[128:, 128:256] *= 1e-30
        out[f"model.layers.{k}.mlp.w{k}.weight"] = w.astype(NP[d])
    return out


@pytest.mark.parametrize("to", list(SCHEME))
@pytest.mark.parametrize("d", list(NP))
def test_generated_against_reference(tmp_path, rng, d, to):
    weights = generated(rng, d)
    src = write_safetensors(
        tmp_path / "in.safetensors", {n: (d, list(w.shape), w) for n, w in weights.items()}
    )
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to=to)
    got = tensor_bytes(out)
    for name, w in weights.items():
        q, s = ref_quantize(w, d, to)
        dtype, shape, raw = got[name]
        assert (dtype, shape) == ("F8_E4M3", list(w.shape)), name
        bad = np.flatnonzero(np.frombuffer(raw, np.uint8) != q.ravel())
        assert not bad.size, f"{name}: {bad.size} bytes differ, first at {bad[:5]}"
        sd, sshape, sraw = got[name + "_scale"]
        assert (sd, sshape) == (d, list(s.shape)), name
        assert sraw == s.tobytes(), name


@pytest.mark.parametrize("d", list(NP))
def test_random_shapes(tmp_path, rng, d):
    """Many random shapes in one file, both strategies."""
    shapes = [(int(rng.integers(1, 300)), int(rng.integers(1, 300))) for _ in range(12)]
    weights = {
        f"m.l{k}.weight": (rng.standard_normal(s) * np.float32(10.0 ** rng.integers(-6, 4))).astype(
            NP[d]
        )
        for k, s in enumerate(shapes)
    }
    src = write_safetensors(
        tmp_path / "in.safetensors", {n: (d, list(w.shape), w) for n, w in weights.items()}
    )
    for to in SCHEME:
        out = tmp_path / f"{to}.safetensors"
        quiet_convert(src, out, to=to)
        got = tensor_bytes(out)
        for name, w in weights.items():
            q, s = ref_quantize(w, d, to)
            assert got[name][2] == q.tobytes(), (to, name, w.shape)
            assert got[name + "_scale"][2] == s.tobytes(), (to, name, w.shape)


# --- which weights: NaN / inf, experts, norms, embeddings, --keep -------------------------------


def small_model(rng, d: str = "F32", extra: dict | None = None) -> dict:
    """A small Llama-ish set of tensors: name -> (dtype, shape, array)."""
    t = {}

    def put(name, shape):
        t[name] = (d, list(shape), rng.standard_normal(shape).astype(NP[d]))

    put("model.embed_tokens.weight", (32, 16))
    put("model.layers.0.input_layernorm.weight", (16,))
    put("model.layers.0.self_attn.q_proj.weight", (16, 16))
    put("model.layers.0.self_attn.k_proj.weight", (8, 16))
    put("model.layers.0.mlp.down_proj.weight", (16, 24))
    put("model.layers.0.mlp.up_proj.weight", (24, 16))
    put("model.norm.weight", (16,))
    put("lm_head.weight", (32, 16))
    t.update(extra or {})
    return t


def with_nonfinite(rng, *names_values):
    t = small_model(rng)
    for name, value in names_values:
        arr = t[name][2].copy()
        arr.flat[3] = value
        t[name] = (t[name][0], t[name][1], arr)
    return t


NAN = "model.layers.0.self_attn.q_proj.weight"
INF = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("to", list(SCHEME))
def test_nonfinite_weights_stay_bf16(tmp_path, rng, to, run_main):
    tensors = with_nonfinite(rng, (NAN, np.nan), (INF, -np.inf))
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    report, caught = quiet_convert(src, out, to=to)
    got = tensor_bytes(out)
    for name in (NAN, INF):
        assert got[name][0] == "BF16"
        assert name + "_scale" not in got
        assert got[name][2] == tensors[name][2].astype(ml_dtypes.bfloat16).tobytes()
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert got[name][0] == "F8_E4M3"
        assert name + "_scale" in got
    kinds = [(k, m) for k, m in caught if k == "not_quantized"]
    assert len(kinds) == 1 and NAN in kinds[0][1] and INF in kinds[0][1], caught
    assert report.tensors_quantized == 2
    assert {q["name"] for q in report.quantized} == {
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    }


@pytest.mark.parametrize("to", [*SCHEME, None])
def test_verify_nonfinite_file(tmp_path, rng, to, run_main):
    tensors = with_nonfinite(rng, (NAN, np.nan), (INF, -np.inf))
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to=to or "fp8")
    rc, _, err = run_main("verify", src, out, *(["--to", to] if to else []))
    assert rc == 0, err


def test_nonfinite_weights_folder(tmp_path, rng, run_main):
    tensors = with_nonfinite(rng, (NAN, np.inf), (INF, np.nan))
    folder = tmp_path / "src"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    out = tmp_path / "dst"
    rc, _, err = run_main("convert", folder, out, "--to", "fp8")
    assert rc == 0, err
    assert "not_quantized" in err or NAN in err, err
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert set(ignore) == {
        "lm_head",
        "model.embed_tokens",
        NAN.removesuffix(".weight"),
        INF.removesuffix(".weight"),
    }
    got = tensor_bytes(out / "model.safetensors")
    assert got[NAN][0] == got[INF][0] == "BF16"


def test_a_vision_tower_stays_bf16_and_is_named(tmp_path, rng, run_main):
    """`--to fp8` on a vision-language model (issue 33): its vision tower and projector stay
    BF16 as llm-compressor's recipes leave them, listed in the config's ignore, named in one
    warning; the language model is quantized; verify passes."""
    vision = {
        "model.visual.blocks.0.attn.qkv.weight": (48, 16),
        "model.visual.merger.mlp.0.weight": (16, 64),
        "model.multi_modal_projector.linear_1.weight": (16, 16),
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": (32, 16),
    }
    extra = {
        n: ("F32", list(shape), rng.standard_normal(shape).astype(np.float32))
        for n, shape in vision.items()
    }
    folder = tmp_path / "vlm"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", small_model(rng, extra=extra))
    (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    out = tmp_path / "vlm-fp8"
    rc, _, err = run_main("convert", folder, out, "--to", "fp8")
    assert rc == 0, err
    said = [line for line in err.splitlines() if "vision tower" in line]
    assert len(said) == 1 and said[0].startswith(
        "stcast: warning: model.safetensors: 4 weights of the vision tower and its projector "
        "(vision_tower, visual, vision_model, multi_modal_projector) stay BF16, unquantized"
    ), err
    got = tensor_bytes(out / "model.safetensors")
    for name in vision:
        assert got[name][0] == "BF16" and name + "_scale" not in got, name
    assert got["model.layers.0.mlp.up_proj.weight"][0] == "F8_E4M3"
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {n.removesuffix(".weight") for n in vision} <= set(ignore)
    report = stcast.inspect(folder / "model.safetensors", to="fp8")
    reasons = {t.name: t.not_quantized for t in report.tensors}
    assert {reasons[n] for n in vision} == {"vision"}
    rc, _, err = run_main("verify", folder, out)
    assert rc == 0, err


def test_verify_nonfinite_folder(tmp_path, rng, run_main):
    tensors = with_nonfinite(rng, (NAN, np.inf), (INF, np.nan))
    folder = tmp_path / "src"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text('{"torch_dtype": "float32"}\n')
    out = tmp_path / "dst"
    rc, _, err = run_main("convert", folder, out, "--to", "fp8")
    assert rc == 0, err
    rc, _, err = run_main("verify", folder, out)
    assert rc == 0, err


def test_experts_norms_embeddings_keep(tmp_path, rng):
    experts = "model.layers.0.mlp.experts.gate_up_proj.weight"
    t = small_model(
        rng,
        extra={
            experts: ("F32", [2, 8, 16], rng.standard_normal((2, 8, 16)).astype("f4")),
            "bert.encoder.layer.0.attention.output.LayerNorm.weight": (
                "F32",
                [16],
                np.ones(16, "f4"),
            ),
            "bert.embeddings.word_embeddings.weight": (
                "F32",
                [32, 16],
                rng.standard_normal((32, 16)).astype("f4"),
            ),
            "bert.embeddings.position_embeddings.weight": (
                "F32",
                [32, 16],
                rng.standard_normal((32, 16)).astype("f4"),
            ),
            "bert.encoder.layer.0.attention.self.query.weight": (
                "F32",
                [16, 16],
                rng.standard_normal((16, 16)).astype("f4"),
            ),
        },
    )
    src = write_safetensors(tmp_path / "in.safetensors", t)
    out = tmp_path / "out.safetensors"
    report, caught = quiet_convert(src, out, to="fp8", keep=["*.k_proj.weight"])
    got = tensor_bytes(out)
    assert got[experts][0] == "BF16"
    assert [k for k, m in caught if experts in m] == ["not_quantized"], caught
    for name in (
        "bert.encoder.layer.0.attention.output.LayerNorm.weight",
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    ):
        assert got[name][0] == "BF16", name
        assert name + "_scale" not in got
    k = "model.layers.0.self_attn.k_proj.weight"
    assert got[k] == ("F32", [8, 16], t[k][2].tobytes())
    assert k + "_scale" not in got
    for name in (
        "bert.encoder.layer.0.attention.self.query.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ):
        assert got[name][0] == "F8_E4M3", name
    assert report.tensors_quantized == 4


# --- folders: shards, index, config -----------------------------------------------------------


def sharded(tmp_path, rng, d="F32", metadata: dict | None = None) -> Path:
    """A 2-shard folder with its index; shards with `metadata` ({"format": "pt"} by default,
    as save_pretrained writes; {} for none)."""
    metadata = {"format": "pt"} if metadata is None else metadata or None
    t = small_model(rng, d)
    names = list(t)
    half = {n: t[n] for n in names[:4]}, {n: t[n] for n in names[4:]}
    folder = tmp_path / "src"
    folder.mkdir()
    wm = {}
    for k, part in enumerate(half):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        write_safetensors(folder / shard, part, metadata=metadata)
        wm.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 1}, "weight_map": wm}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text('{"torch_dtype": "float32", "model_type": "llama"}\n')
    return folder


@pytest.mark.parametrize("to", list(SCHEME))
def test_sharded_folder(tmp_path, rng, to, run_main):
    folder = sharded(tmp_path, rng)
    out = tmp_path / "dst"
    rc, _, err = run_main("convert", folder, out, "--to", to)
    assert rc == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    total = 0
    scales = set()
    for shard in sorted(set(wm.values())):
        got = tensor_bytes(out / shard)
        total += sum(len(raw) for _, _, raw in got.values())
        for name in got:
            assert wm[name] == shard, name
            if name.endswith("_scale"):
                scales.add(name)
                assert got[name.removesuffix("_scale")][0] == "F8_E4M3"
    assert len(scales) == 4
    assert set(wm) == {n for s in set(wm.values()) for n in tensor_bytes(out / s)}
    assert index["metadata"]["total_size"] == total
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    want = dict(CT_KEYS[SCHEME[to]])
    del want["moe_sparsity_config"]
    assert set(qc) == set(want)
    want["ignore"] = ["lm_head", "model.embed_tokens"]
    assert qc == want
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    rc, _, err = run_main("verify", folder, out)
    assert rc == 0, err
    rc, _, err = run_main("verify", folder, out, "--to", to)
    assert rc == 0, err


@pytest.mark.parametrize("to", list(SCHEME))
def test_verify_sharded_without_metadata(tmp_path, rng, to, run_main):
    folder = sharded(tmp_path, rng, metadata={})
    out = tmp_path / "dst"
    rc, _, err = run_main("convert", folder, out, "--to", to)
    assert rc == 0, err
    rc, _, err = run_main("verify", folder, out)
    assert rc == 0, err


# --- verify -----------------------------------------------------------------------------------


def tamper(path: Path, name: str, at: int = 0) -> None:
    """Flip the low bit of byte `at` of tensor `name` in a safetensors file."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    info = json.loads(raw[8 : 8 + n])[name]
    pos = 8 + n + info["data_offsets"][0] + at
    raw[pos] ^= 1
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("to", list(SCHEME))
@pytest.mark.parametrize("what", ["scale", "byte"])
def test_verify_tampered(tmp_path, rng, run_main, to, what):
    t = small_model(rng)
    src = write_safetensors(tmp_path / "in.safetensors", t)
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to=to)
    name = "model.layers.0.mlp.up_proj.weight"
    if what == "scale":
        tamper(out, name + "_scale", at=4 * 3 if to == "fp8" else 0)
    else:
        tamper(out, name, at=16 * 5 + 2)
    rc, _, err = run_main("verify", src, out, "--to", to)
    assert rc == 1
    line = assert_one_error_line(err)
    assert name in line, line
    if to == "fp8":
        assert ("row 3" if what == "scale" else "(5, 2) in row 5") in line, line
    else:
        assert ("block (0, 0)" if what == "scale" else "(5, 2) in block (0, 0)") in line, line


def test_verify_tampered_config(tmp_path, rng, run_main):
    folder = sharded(tmp_path, rng)
    out = tmp_path / "dst"
    rc, _, err = run_main("convert", folder, out, "--to", "fp8")
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    rc, _, err = run_main("verify", folder, out)
    assert rc == 1, err
    assert "config.json" in assert_one_error_line(err)


def shard_layouts(dst: Path) -> dict[str, dict[str, tuple[str, list[int], str]]]:
    """Each output shard's tensors (file name -> tensor_hashes)."""
    return {p.name: tensor_hashes(p) for p in sorted(dst.glob("*.safetensors"))}


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
@pytest.mark.parametrize("whole", [False, True])
def test_reshard_to_fp8(tmp_path, to, whole, run_main):
    """--max-shard-size with an FP8 target: every shard within the size, each scale in its
    weight's shard and in the index, the same tensors as a conversion without re-sharding,
    verify passes (from the folder, and from a single file)."""
    src = FIX / "llama-fp32" / ("model.safetensors" if whole else "")
    plain, dst = tmp_path / "plain.safetensors", tmp_path / "dst"
    quiet_convert(FIX / "llama-fp32" / "model.safetensors", plain, to=to)
    rc, _, err = run_main("convert", src, dst, "--to", to, "--max-shard-size", "100KB")
    assert rc == 0, err
    shards = shard_layouts(dst)
    assert len(shards) > 1
    assert all((dst / n).stat().st_size <= 100_000 for n in shards)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    where = {t: n for n, layout in shards.items() for t in layout}
    assert index["weight_map"] == where
    for name in where:
        if name.endswith("_scale"):
            assert where[name] == where[name.removesuffix("_scale")]
    merged = {t: v for layout in shards.values() for t, v in layout.items()}
    assert merged == tensor_hashes(plain)
    data = sum(
        (dst / n).stat().st_size - 8 - int.from_bytes((dst / n).read_bytes()[:8], "little")
        for n in shards
    )
    assert index["metadata"]["total_size"] == data
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err


def test_reshard_dequantized(tmp_path, run_main):
    """FP8 in, re-sharded: each weight cut with its scales (model_free_ptq stores every F32
    scale before the FP8 weights), the bytes of the reference, no scale in the index."""
    src, dst = FIX / "llama-fp32.fp8-block", tmp_path / "dst"
    rc, _, err = run_main("convert", src, dst, "--to", "bf16", "--max-shard-size", "100KB")
    assert rc == 0, err
    shards = shard_layouts(dst)
    assert len(shards) > 1
    merged = {t: v for layout in shards.values() for t, v in layout.items()}
    want = DEQUANT["llama-fp32.fp8-block"]["bf16"]
    assert merged == {k: (w["dtype"], w["shape"], w["sha256"]) for k, w in want.items()}
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err


@pytest.mark.parametrize("reshard", [False, True])
def test_dequantized_folder_without_a_config(tmp_path, run_main, reshard):
    """A folder of FP8 weights with their scales and no config.json: the files decide, as
    for a lone file. Before, the shards were dequantized but the index kept the scales, and
    the run failed its re-check with "the file written does not hold it (was the source
    changed during the run?)"."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(FIX / "llama-fp32.fp8-block", src)
    (src / "config.json").unlink()
    extra = ["--max-shard-size", "100KB"] if reshard else []
    rc, _, err = run_main("convert", src, dst, *extra)
    assert rc == 0, err
    merged = {t: v for layout in shard_layouts(dst).values() for t, v in layout.items()}
    want = DEQUANT["llama-fp32.fp8-block"]["bf16"]
    assert merged == {k: (w["dtype"], w["shape"], w["sha256"]) for k, w in want.items()}
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    assert not list(dst.glob(".stcast-*"))
    rc, _, err = run_main("verify", src, dst)
    assert rc == 0, err


# --- reports ----------------------------------------------------------------------------------


def test_api_report(tmp_path, rng):
    t = small_model(rng)
    src = write_safetensors(tmp_path / "in.safetensors", t)
    report, _ = quiet_convert(src, tmp_path / "out.safetensors", to="fp8")
    assert report.tensors_quantized == 4 == len(report.quantized)
    by = {q["name"]: q for q in report.quantized}
    q = by["model.layers.0.mlp.up_proj.weight"]
    assert q["strategy"] == "channel" and q["scale_dtype"] == "F32"
    assert q["groups"] == 24 and q["zero_groups"] == 0 and q["elements"] == 24 * 16
    assert q["flushed"] >= 0
    assert 0 < q["max_abs_error"] < 0.2 and 0 < q["rel_error"] < 0.1
    assert sorted(report.unquantized) == ["lm_head", "model.embed_tokens"]
    block, _ = quiet_convert(src, tmp_path / "b.safetensors", to="fp8-block")
    assert {q["name"]: q["groups"] for q in block.quantized}[
        "model.layers.0.mlp.down_proj.weight"
    ] == 1


def test_zero_groups_and_flushed_counted(tmp_path):
    w = np.ones((4, 8), "f4")
    w[1] = 0.0
    w[2, 1:] = 1e-6  # flush to zero beside a 1.0
    src = write_safetensors(tmp_path / "in.safetensors", {"m.l.weight": ("F32", [4, 8], w)})
    report, _ = quiet_convert(src, tmp_path / "out.safetensors", to="fp8")
    (q,) = report.quantized
    assert (q["groups"], q["zero_groups"], q["flushed"]) == (4, 1, 7)


def test_json_report_fields(tmp_path, rng, run_main):
    src = write_safetensors(tmp_path / "in.safetensors", small_model(rng))
    rc, out, err = run_main("convert", "--json", src, tmp_path / "a.safetensors", "--to", "fp8")
    assert rc == 0, err
    result = json.loads(out)["result"]
    assert result["tensors_quantized"] == 4
    assert len(result["quantized"]) == 4
    assert {"groups", "zero_groups", "flushed", "max_abs_error", "rel_error"} <= set(
        result["quantized"][0]
    )
    assert sorted(result["unquantized"]) == ["lm_head", "model.embed_tokens"]
    rc, out, err = run_main("convert", "--json", src, tmp_path / "b.safetensors", "--to", "bf16")
    assert rc == 0, err
    result = json.loads(out)["result"]
    assert not {"tensors_quantized", "quantized", "unquantized"} & set(result)


# --- adversarial: other inputs, resumes, shards, signals, odd weights ---------------------------


def test_torch_input(tmp_path, rng):
    """A PyTorch zip checkpoint with a transposed view and tied weights."""
    import torchfile as tf

    base = rng.standard_normal((24, 16)).astype("f4")
    obj = {
        "m.a.weight": tf.tensor("0", "float32", (24, 16)),
        "m.t.weight": tf.tensor("0", "float32", (16, 24), stride=(1, 16)),
        "lm_head.weight": tf.tensor("0", "float32", (24, 16)),  # tied to m.a.weight
    }
    src = tmp_path / "in.pt"
    tf.write_zip(src, obj, {"0": base.tobytes()})
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to="fp8")
    got = tensor_bytes(out)
    for name, w in (("m.a.weight", base), ("m.t.weight", base.T)):
        q, s = ref_quantize(np.ascontiguousarray(w), "F32", "fp8")
        assert got[name] == ("F8_E4M3", list(w.shape), q.tobytes()), name
        assert got[name + "_scale"][2] == s.tobytes()
    assert got["lm_head.weight"] == ("BF16", [24, 16], base.astype(ml_dtypes.bfloat16).tobytes())
    assert stcast.verify(src, out, to="fp8").ok


def test_dcp_input(tmp_path, rng):
    from dcpfile import Tensor, rows, write_dcp

    w = rng.standard_normal((130, 40)).astype("f4")
    ck = tmp_path / "ck"
    write_dcp(ck, {"m.l.weight": Tensor(w, rows(w, [0, 50, 129]), ("m.l.weight",))}, ranks=3)
    for to in SCHEME:
        out = tmp_path / f"{to}.safetensors"
        quiet_convert(ck, out, to=to)
        q, s = ref_quantize(w, "F32", to)
        got = tensor_bytes(out)
        assert got["m.l.weight"][2] == q.tobytes()
        assert got["m.l.weight_scale"][2] == s.tobytes()
        assert stcast.verify(ck, out, to=to).ok


def test_resume_complete_folder(tmp_path, rng, run_main):
    folder = sharded(tmp_path, rng)
    out = tmp_path / "dst"
    rc, _, err = run_main("convert", folder, out, "--to", "fp8")
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, _, err = run_main("convert", folder, out, "--to", "fp8", "--resume")
    assert rc == 0, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("point", ["folder-file", "folder-publish", "folder-complete"])
def test_resume_after_sigint(tmp_path, rng, cli_process, point):
    folder = sharded(tmp_path, rng)
    whole = tmp_path / "whole"
    stcast.convert(folder, whole, to="fp8")
    out = tmp_path / "dst"
    rc, _, err = cli_process(
        "convert", folder, out, "--to", "fp8", env={"STCAST_FAILPOINT": f"{point}=sigint"}
    )
    assert rc == -2, err
    rc, _, err = cli_process("convert", folder, out, "--to", "fp8", "--resume")
    assert rc == 0, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in whole.iterdir()
    }


def test_shards_then_finalize(tmp_path, rng, run_main):
    folder = sharded(tmp_path, rng)
    whole = tmp_path / "whole"
    rc, _, err = run_main("convert", folder, whole, "--to", "fp8-block")
    assert rc == 0, err
    out = tmp_path / "dst"
    for i in (1, 2):
        rc, _, err = run_main("convert", folder, out, "--to", "fp8-block", "--shard", f"{i}/2")
        assert rc == 0, err
    rc, _, err = run_main("finalize", folder, out)
    assert rc == 0, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in whole.iterdir()
    }


def test_sigint_mid_tensor(tmp_path, rng, cli_process):
    w = rng.standard_normal((2176, 1024)).astype("f4")  # 8.5 MiB: more than one window
    src = write_safetensors(tmp_path / "in.safetensors", {"m.l.weight": ("F32", [2176, 1024], w)})
    out = tmp_path / "out.safetensors"
    rc, _, err = cli_process(
        "convert", src, out, "--to", "fp8", env={"STCAST_FAILPOINT": "mid-tensor=sigint"}
    )
    assert rc == -2, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_huge_row_left_bf16(tmp_path, cli_process):
    cols = 16 << 20  # one row of 64 MiB F32: over the 48 MiB group limit
    src = tmp_path / "in.safetensors"
    header = {"m.l.weight": {"dtype": "F32", "shape": [1, cols], "data_offsets": [0, 4 * cols]}}
    from conftest import encode_header

    with open(src, "wb") as f:
        f.write(encode_header(header))
        f.truncate(f.tell() + 4 * cols)  # sparse zeros
    out = tmp_path / "out.safetensors"
    rc, _, err = cli_process("convert", src, out, "--to", "fp8")
    # Left unquantized in BF16 (a window holds whole groups, at most 48 MiB), and named.
    assert rc == 0, err
    assert "m.l.weight" in err and "48 MiB" in err
    assert tensor_bytes(out)["m.l.weight"][0] == "BF16"


def test_zero_rows_f64_and_bare_weight(tmp_path, rng):
    t = {
        "m.empty.weight": ("F32", [0, 16], b""),
        "m.wide.weight": ("F64", [4, 8], rng.standard_normal((4, 8))),
        "weight": ("F32", [4, 8], rng.standard_normal((4, 8)).astype("f4")),
    }
    src = write_safetensors(tmp_path / "in.safetensors", t)
    out = tmp_path / "out.safetensors"
    report, _ = quiet_convert(src, out, to="fp8")
    got = tensor_bytes(out)
    assert got["m.empty.weight"] == ("BF16", [0, 16], b"")
    assert got["m.wide.weight"][0] == "BF16"
    q, s = ref_quantize(t["weight"][2], "F32", "fp8")
    assert got["weight"][2] == q.tobytes() and got["weight_scale"][2] == s.tobytes()
    assert stcast.verify(src, out, to="fp8").ok


def test_inspect_to_fp8(tmp_path, rng, run_main):
    src = write_safetensors(tmp_path / "in.safetensors", small_model(rng))
    rc, out, err = run_main("inspect", src, "--to", "fp8", "--json")
    assert rc == 0, err
    tensors = {t["name"]: t for t in json.loads(out)["result"]["tensors"]}
    q = tensors["model.layers.0.mlp.up_proj.weight"]
    assert q["action"] == "quantize" and q["target_dtype"] == "F8_E4M3"
    assert tensors["lm_head.weight"]["target_dtype"] == "BF16"


def test_nonfinite_in_a_later_window(tmp_path, rng):
    """The NaN is in the last element of a 8.5 MiB weight (its second 8 MiB window): the task
    scans and plans again; the weights before and after it are still quantized exactly."""
    a = rng.standard_normal((256, 1024)).astype("f4")
    b = rng.standard_normal((2176, 1024)).astype("f4")
    c = rng.standard_normal((300, 200)).astype("f4")
    b[-1, -1] = np.nan
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {
            "m.a.weight": ("F32", [256, 1024], a),
            "m.b.weight": ("F32", [2176, 1024], b),
            "m.c.weight": ("F32", [300, 200], c),
        },
    )
    out = tmp_path / "out.safetensors"
    report, caught = quiet_convert(src, out, to="fp8-block")
    assert [k for k, m in caught if "m.b.weight" in m] == ["not_quantized"]
    got = tensor_bytes(out)
    for name, w in (("m.a.weight", a), ("m.c.weight", c)):
        q, s = ref_quantize(w, "F32", "fp8-block")
        assert got[name][2] == q.tobytes() and got[name + "_scale"][2] == s.tobytes()
    assert got["m.b.weight"] == ("BF16", [2176, 1024], b.astype(ml_dtypes.bfloat16).tobytes())
    assert "m.b.weight_scale" not in got
    assert report.tensors_quantized == 2


def test_nonfinite_with_shards_and_finalize(tmp_path, rng, run_main):
    folder = sharded(tmp_path, rng)
    shard = "model-00002-of-00002.safetensors"
    t = tensor_bytes(folder / shard)
    name = "model.layers.0.mlp.up_proj.weight"
    arr = np.frombuffer(t[name][2], "f4").copy()
    arr[0] = np.nan
    t[name] = ("F32", t[name][1], arr)
    write_safetensors(folder / shard, t, metadata={"format": "pt"})
    whole = tmp_path / "whole"
    rc, _, err = run_main("convert", folder, whole, "--to", "fp8")
    assert rc == 0, err
    out = tmp_path / "dst"
    for i in (2, 1):
        rc, _, err = run_main("convert", folder, out, "--to", "fp8", "--shard", f"{i}/2")
        assert rc == 0, err
    rc, _, err = run_main("finalize", folder, out)
    assert rc == 0, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in whole.iterdir()
    }
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.up_proj" in ignore


def test_verify_other_strategy_fails(tmp_path, rng, run_main):
    src = write_safetensors(tmp_path / "in.safetensors", small_model(rng))
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to="fp8")
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err
    rc, _, err = run_main("verify", src, out, "--to", "fp8-block")
    assert rc == 1
    assert "q_proj" in assert_one_error_line(err)


def test_nonfinite_warning_grammar(tmp_path, rng):
    tensors = with_nonfinite(rng, (NAN, np.nan))
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    _, caught = quiet_convert(src, tmp_path / "out.safetensors", to="fp8")
    (message,) = [m for k, m in caught if k == "not_quantized"]
    assert message.startswith("1 weight holds NaN or inf"), message


def test_inspect_summary_counts_quantized(tmp_path, rng, run_main):
    t = small_model(rng)
    src = write_safetensors(tmp_path / "in.safetensors", t)
    rc, out, err = run_main("inspect", src, "--to", "fp8")
    assert rc == 0, err
    assert f"{len(t)} to convert" in out and "0 to copy" in out, out


@pytest.mark.parametrize("scale_shape", [[4, 1], [3]])
def test_existing_scale_name(tmp_path, scale_shape, run_main):
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {
            "m.a.weight": ("F32", [4, 8], np.ones((4, 8), "f4")),
            "m.a.weight_scale": ("F32", scale_shape, np.ones(scale_shape, "f4")),
        },
    )
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", "fp8")
    if rc == 0:
        _, items, _ = read_safetensors(out)
        names = [k for k, _ in items]
        assert len(names) == len(set(names)), names
    else:
        assert rc == 1 and "m.a.weight_scale" in assert_one_error_line(err)
        assert not out.exists()


def test_verify_sign_of_zero(tmp_path, run_main):
    """0x00 and 0x80 (-0) are different bytes: verify tells them apart."""
    w = np.ones((4, 8), "f4")
    w[2] = 0.0
    src = write_safetensors(tmp_path / "in.safetensors", {"m.a.weight": ("F32", [4, 8], w)})
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to="fp8")
    raw = bytearray(out.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    a = json.loads(raw[8 : 8 + n])["m.a.weight"]["data_offsets"][0]
    assert raw[8 + n + a + 16] == 0x00
    raw[8 + n + a + 16] = 0x80
    out.write_bytes(bytes(raw))
    rc, _, err = run_main("verify", src, out)
    assert rc == 1
    line = assert_one_error_line(err)
    assert "m.a.weight" in line and "2" in line, line


def test_verify_keep_pattern(tmp_path, rng, run_main):
    src = write_safetensors(tmp_path / "in.safetensors", small_model(rng))
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", "fp8", "--keep", "*.q_proj.weight")
    assert rc == 0, err
    assert tensor_bytes(out)["model.layers.0.self_attn.q_proj.weight"][0] == "F32"
    rc, _, err = run_main("verify", src, out, "--to", "fp8", "--keep", "*.q_proj.weight")
    assert rc == 0, err
    # Without options: DST's record holds them; another pattern given overrides it.
    rc, _, err = run_main("verify", src, out)
    assert rc == 0, err
    rc, _, err = run_main("verify", src, out, "--to", "fp8", "--keep", "nothing")
    assert rc == 1


def huge_row(tmp_path: Path) -> Path:
    """One weight of one 64 MiB F32 row (sparse zeros), beside a small one."""
    from conftest import encode_header

    cols = 16 << 20
    header = {
        "m.l.weight": {"dtype": "F32", "shape": [1, cols], "data_offsets": [0, 4 * cols]},
        "m.s.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4 * cols, 4 * cols + 16]},
    }
    src = tmp_path / "in.safetensors"
    with open(src, "wb") as f:
        f.write(encode_header(header))
        f.truncate(f.tell() + 4 * cols + 16)
    return src


def test_huge_row_keep(tmp_path, run_main):
    src = huge_row(tmp_path)
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", "fp8", "--keep", "m.l.weight")
    assert rc == 0, err
    assert tensor_bytes(out)["m.s.weight"][0] == "F8_E4M3"
    assert tensor_bytes(out)["m.l.weight"][0] == "F32"


def test_huge_row_dry_run(tmp_path, run_main):
    src = huge_row(tmp_path)
    rc, _, err = run_main("convert", src, tmp_path / "out.safetensors", "--to", "fp8", "--dry-run")
    # What convert does (the weight stays BF16, with the warning), the dry run says.
    assert rc == 0, err
    assert "m.l.weight" in err and "48 MiB" in err


def test_torch_bin_folder(tmp_path, rng, run_main):
    from test_torch_folder import make_bin_model

    arrays = make_bin_model(tmp_path / "src", rng, trainer=False)
    out = tmp_path / "dst"
    rc, _, err = run_main("convert", tmp_path / "src", out, "--to", "fp8-block")
    assert rc == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = 0
    for k, a in enumerate(arrays.values()):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        got = tensor_bytes(out / shard)
        total += sum(len(raw) for _, _, raw in got.values())
        w = a[f"model.layers.{k}.mlp.weight"]
        q, s = ref_quantize(w, "F32", "fp8-block")
        assert got[f"model.layers.{k}.mlp.weight"][2] == q.tobytes()
        assert got[f"model.layers.{k}.mlp.weight_scale"][2] == s.tobytes()
        assert index["weight_map"][f"model.layers.{k}.mlp.weight_scale"] == shard
    assert index["metadata"]["total_size"] == total
    rc, _, err = run_main("verify", tmp_path / "src", out)
    assert rc == 0, err


def test_torch_bf16_storage(tmp_path, rng):
    import torchfile as tf

    w = rng.standard_normal((130, 70)).astype(ml_dtypes.bfloat16)
    src = tmp_path / "in.pt"
    tf.write_zip(src, {"m.a.weight": tf.tensor("0", "bfloat16", (130, 70))}, {"0": w.tobytes()})
    for to in SCHEME:
        out = tmp_path / f"{to}.safetensors"
        quiet_convert(src, out, to=to)
        q, s = ref_quantize(w, "BF16", to)
        got = tensor_bytes(out)
        assert got["m.a.weight"][2] == q.tobytes()
        assert got["m.a.weight_scale"] == ("BF16", list(s.shape), s.tobytes())


@pytest.mark.parametrize("to", list(SCHEME))
def test_verify_loose_model_free_ptq_output(run_main, to):
    folder = EXPECTED["runs"]["llama-fp32"][SCHEME[to]]["folder"]
    rc, _, err = run_main("verify", FIX / "llama-fp32", FIX / folder, "--to", to, "--loose")
    assert rc == 0, err


def test_cli_names_fp8_targets(tmp_path, rng, run_main):
    src = write_safetensors(tmp_path / "in.safetensors", small_model(rng))
    rc, out, err = run_main("convert", src, tmp_path / "o.safetensors", "--to", "fp8block")
    assert rc == 2
    assert "fp8-block" in err, err
    rc, out, _ = run_main("convert", "--help")
    assert rc == 0 and "fp8-block" in out


def test_shared_expert_gate_not_quantized(tmp_path, rng):
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    t = small_model(rng, extra={name: ("F32", [1, 16], rng.standard_normal((1, 16)).astype("f4"))})
    src = write_safetensors(tmp_path / "in.safetensors", t)
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to="fp8")
    assert tensor_bytes(out)[name][0] == "BF16"


def test_router_gates_not_quantized(tmp_path, rng):
    names = [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.mlp.router.weight",
        "model.layers.0.feed_forward.router.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
    ]
    t = {n: ("F32", [4, 16], rng.standard_normal((4, 16)).astype("f4")) for n in names}
    t["model.layers.0.mlp.experts.0.gate_proj.weight"] = t[
        "model.layers.0.mlp.shared_expert.gate_proj.weight"
    ] = (
        "F32",
        [4, 16],
        rng.standard_normal((4, 16)).astype("f4"),
    )
    src = write_safetensors(tmp_path / "in.safetensors", t)
    out = tmp_path / "out.safetensors"
    quiet_convert(src, out, to="fp8")
    got = tensor_bytes(out)
    assert {n for n in names if got[n][0] != "BF16"} == set()
    assert got["model.layers.0.mlp.experts.0.gate_proj.weight"][0] == "F8_E4M3"
    assert got["model.layers.0.mlp.shared_expert.gate_proj.weight"][0] == "F8_E4M3"


def test_fused_experts_without_weight_suffix_warned(tmp_path, rng):
    t = small_model(
        rng,
        extra={
            "model.layers.0.mlp.experts.gate_up_proj": (
                "F32",
                [2, 16, 8],
                rng.standard_normal((2, 16, 8)).astype("f4"),
            ),
            "model.layers.0.mlp.experts.down_proj": (
                "F32",
                [2, 4, 16],
                rng.standard_normal((2, 4, 16)).astype("f4"),
            ),
        },
    )
    src = write_safetensors(tmp_path / "in.safetensors", t)
    _, caught = quiet_convert(src, tmp_path / "out.safetensors", to="fp8")
    warned = " ".join(m for k, m in caught if k == "not_quantized")
    assert "mlp.experts.gate_up_proj" in warned, caught


# --- FP8 in: dequantization --------------------------------------------------------------------

DEQUANT = json.loads((FIX / "expected-dequant.json").read_text())["folders"]


def tensor_hashes(path: Path) -> dict[str, tuple[str, list[int], str]]:
    """name -> (dtype, shape, sha256 of its bytes)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    return {
        k: (
            v["dtype"],
            v["shape"],
            sha(raw[base + v["data_offsets"][0] : base + v["data_offsets"][1]]),
        )
        for k, v in header.items()
        if k != "__metadata__"
    }


@pytest.mark.parametrize("to", ["bf16", "fp16"])
@pytest.mark.parametrize("folder", sorted(DEQUANT))
def test_dequantize_fixtures(tmp_path, folder, to):
    """compressed-tensors' own dequantization (`q.to(s.dtype) * s`, then to the target),
    and DeepSeek's `weight_dequant` for odd-deepseek-fp8, byte for byte; every scale
    dropped; verify proves it."""
    src = FIX / folder / "model.safetensors"
    out = tmp_path / "out.safetensors"
    # fp16: the BF16 tensors the reference casts too (stcast copies BF16 unless asked).
    report, _ = quiet_convert(src, out, to=to, from_bf16=True)
    want = DEQUANT[folder][to]
    got = tensor_hashes(out)
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name] == (w["dtype"], w["shape"], w["sha256"]), name
    assert stcast.verify(src, out, from_bf16=True).ok
    reasons = {t.name: t.reason for t in stcast.inspect(src, to=to).tensors}
    scales = [n for n in reasons if n.endswith(("_scale", "_scale_inv"))]
    assert scales and all(reasons[n] == "dropped" for n in scales)


@pytest.mark.parametrize("folder", ["llama-fp32.fp8-block", "odd-deepseek-fp8"])
def test_dequantize_folder(tmp_path, folder, run_main):
    """A folder: the config loses its quantization_config, the index its scales (and its
    total_size is the shards'); verify proves the folder; a tampered element is named."""
    dst = tmp_path / "out"
    rc, _, err = run_main("convert", FIX / folder, dst, "--to", "bf16")
    assert rc == 0, err
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    index = dst / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        assert not [k for k in doc["weight_map"] if k.endswith(("_scale", "_scale_inv"))]
        layout = tensor_hashes(dst / "model.safetensors")
        assert set(doc["weight_map"]) == set(layout)
        data = (dst / "model.safetensors").stat().st_size
        n = int.from_bytes((dst / "model.safetensors").read_bytes()[:8], "little")
        assert doc["metadata"]["total_size"] == data - 8 - n
    rc, _, err = run_main("verify", FIX / folder, dst)
    assert rc == 0, err
    path = dst / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    weight = next(k for k in header if k.endswith("q_proj.weight"))
    raw[8 + n + header[weight]["data_offsets"][0] + 10] ^= 1
    path.write_bytes(bytes(raw))
    rc, _, err = run_main("verify", FIX / folder, dst)
    assert rc == 1 and weight in err, err


def test_fp8_without_a_scale_stays_refused(tmp_path):
    """An F8_E4M3 weight with no scale beside it is not dequantizable: the quantized
    refusal, in one line, and nothing written."""
    t = {
        "m.w.weight": ("F8_E4M3", [2, 2], np.zeros(4, np.uint8)),
        "m.s": ("F32", [1], np.ones(1, np.float32)),
    }
    src = write_safetensors(tmp_path / "in.safetensors", t)
    with pytest.raises(stcast.StcastError, match="quantized"):
        stcast.convert(src, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_numeric_report_file_has_the_fp8_rows(tmp_path):
    """--report: the bf16 rows as for any conversion, and a `quantized` row per weight."""
    src = FIX / "llama-fp32" / "model.safetensors"
    out, report = tmp_path / "out.safetensors", tmp_path / "report.json"
    r, _ = quiet_convert(src, out, to="fp8-block", report=report)
    doc = json.loads(report.read_text())["result"]
    assert [q["name"] for q in doc["quantized"]] == [q["name"] for q in r.quantized]
    assert doc["quantized"] == [dict(q) for q in r.quantized]
    assert all(q["strategy"] == "block" and q["groups"] > 0 for q in doc["quantized"])
    assert {t["name"] for t in doc["tensors"]} == {
        n for n in tensor_hashes(out) if not n.endswith("_scale")
    } - {q["name"] for q in doc["quantized"]}


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_fp8_bf16_nonfinite_weight_verify(tmp_path, run_main, to, value):
    """A BF16 source whose `q.weight` holds one NaN (or inf): convert --to fp8 leaves it BF16,
    byte for byte; verify with the same options must pass it. It refused it ("tensor
    `q.weight` is BF16 in DST, but --to fp8 quantizes it"): rust/verify.rs exempted only
    weights converted to BF16 (an F32 or F16 source), not ones kept in it. It must still
    refuse a BF16 weight without NaN or inf left unquantized."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    q.flat[1] = value
    k = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {"q.weight": ("BF16", [4, 8], q), "k.weight": ("BF16", [4, 8], k)},
    )
    out = tmp_path / "out.safetensors"
    rc, _, err = run_main("convert", src, out, "--to", to)
    assert rc == 0, err
    assert tensor_bytes(out)["q.weight"][0] == "BF16"
    rc, _, err = run_main("verify", src, out, "--to", to)
    assert rc == 0, err
    # The same output against a source whose `q.weight` is finite: the BF16 copy is wrong.
    q.flat[1] = 1.0
    finite = write_safetensors(
        tmp_path / "finite.safetensors",
        {"q.weight": ("BF16", [4, 8], q), "k.weight": ("BF16", [4, 8], k)},
    )
    rc, _, err = run_main("verify", finite, out, "--to", to)
    assert rc == 1 and "q.weight" in err, err


@pytest.mark.parametrize("text", ["[1, 2]", '"x"'])
def test_fp8_config_not_an_object(tmp_path, run_main, text):
    """A config.json that is JSON but not an object (a list, a string): --to fp8 failed with
    "internal error: TypeError" after the weights were written (DST left with a manifest and
    model.safetensors), and inspect passed it. Now convert and inspect refuse it in
    one line naming the file, before anything is written."""
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(
        src / "model.safetensors", {"a.weight": ("F32", [4, 4], np.ones((4, 4), np.float32))}
    )
    (src / "config.json").write_text(text)
    out = tmp_path / "out"
    rc, _, err = run_main("convert", src, out, "--to", "fp8")
    assert rc == 1
    assert_one_error_line(err)
    assert "internal error" not in err, err
    assert "config.json" in err and "not a JSON object" in err, err
    assert not out.exists()
    # inspect, with DST or without, says the same.
    for dst in ([out], []):
        rc, _, err = run_main("inspect", src, *dst, "--to", "fp8")
        assert rc == 1 and "not a JSON object" in err, err
    assert not out.exists()
    # --to bf16 copies such a config (no quantization_config goes into it).
    assert run_main("convert", src, out)[0] == 0
    assert run_main("verify", src, out)[0] == 0
