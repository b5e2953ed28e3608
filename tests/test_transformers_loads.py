"""transformers loads what stcast writes from training checkpoints (issue 33's done-when).

These need torch and transformers (FP8: compressed-tensors too), which CI does not install:
they are skipped there and run in the real tools' venv (README, "Real tools"), e.g.
`PYTHONPATH=python /work/venv-llmc/bin/python -m pytest -q tests/test_transformers_loads.py`.
"""

from __future__ import annotations

import json
import os

import pytest
import stcast

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _tiny_llama(transformers, torch):
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    # Weights of a trained model's spread rather than the init's tiny ones.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    return model


def _config_file(model, path):
    model.config.save_pretrained(path)
    return path / "config.json"


def test_strip_prefix_of_ddp_and_compile_names_loads(tmp_path):
    """DDP + torch.compile names (`module._orig_mod.model.layers...`): two --strip-prefix in
    order give HF names; from_pretrained matches every key, every parameter the model's in
    bf16."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    model = _tiny_llama(transformers, torch)
    state = {f"module._orig_mod.{k}": v.contiguous() for k, v in model.state_dict().items()}
    src = tmp_path / "ema.safetensors"
    save_file(state, src)
    out = tmp_path / "out"
    out.mkdir()
    _config_file(model, out)
    stcast.convert(src, out / "model.safetensors", strip_prefix=["module.", "_orig_mod."])
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, p in model.state_dict().items():
        q = loaded.state_dict()[name]
        assert torch.equal(p.to(torch.bfloat16), q.to(torch.bfloat16)), name
    assert stcast.verify(src, out / "model.safetensors").ok


def test_strip_prefix_of_an_hf_folder_of_shards_loads(tmp_path):
    """An HF folder (save_pretrained, several shards and their index) whose names carry
    DDP + torch.compile's `module._orig_mod.`: converted with the two --strip-prefix, its
    shards and index name HF keys; from_pretrained matches every key, every parameter the
    model's in bf16; verify with no option passes (the prefixes recorded)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    model = _tiny_llama(transformers, torch)
    src = tmp_path / "ckpt"
    model.save_pretrained(src, max_shard_size="400KB")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    for shard in shards:
        state = load_file(src / shard)
        renamed = {f"module._orig_mod.{k}": v for k, v in state.items()}
        save_file(renamed, src / shard, {"format": "pt"})
    index["weight_map"] = {f"module._orig_mod.{k}": v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    out = tmp_path / "out"
    stcast.convert(src, out, strip_prefix=["module.", "_orig_mod."])
    written = json.loads((out / "model.safetensors.index.json").read_text())
    assert all(not k.startswith("module.") for k in written["weight_map"])
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, p in model.state_dict().items():
        q = loaded.state_dict()[name]
        assert torch.equal(p.to(torch.bfloat16), q.to(torch.bfloat16)), name
    assert stcast.verify(src, out).ok


def _cosine(torch, model, other) -> float:
    ids = torch.randint(
        0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        a = model(ids).logits.float().flatten()
        b = other(ids).logits.float().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("to", ["fp8", "fp8-block"])
def test_fp8_of_a_dcp_folder_with_its_config_loads(tmp_path, to):
    """A DCP checkpoint (dcp.save, one process) to FP8 with --config: the output loads in
    transformers through compressed-tensors, logits with cosine > 0.99 to the fp32 model's."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    import torch.distributed.checkpoint as dcp

    model = _tiny_llama(transformers, torch)
    src = tmp_path / "step-100"
    dcp.save(
        {k: v.contiguous() for k, v in model.state_dict().items()}, checkpoint_id=src, no_dist=True
    )
    config = _config_file(model, tmp_path / "model-config")
    out = tmp_path / "out"
    out.mkdir()
    stcast.convert(src, out / "model.safetensors", to=to, config=config)
    written = json.loads((out / "config.json").read_text())
    assert written["quantization_config"]["quant_method"] == "compressed-tensors"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, torch_dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cosine = _cosine(torch, model, loaded.eval())
    print(f"cosine {to}: {cosine:.5f}")
    assert cosine > 0.99
    assert stcast.verify(src, out / "model.safetensors").ok
