"""Tiny Llama and Qwen2 checkpoints written by transformers load through nereus and give
transformers' logits; checkpoints nereus writes load in transformers and give nereus'.

transformers is a test dependency only: nereus never imports it.
"""

from __future__ import annotations

import json

import pytest
import torch

from nereus.models import ModelConfig, build_stage, load_stage_weights, save_tiny_model, tiny_config

CLOSE = dict(rtol=1e-4, atol=1e-5)


def _hf_model(arch: str, tied: bool, bias: bool, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(attention_bias=bias, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def _nereus(model_dir):
    stage = build_stage(ModelConfig.from_hf(model_dir))
    report = load_stage_weights(stage, model_dir)
    return stage.eval(), report


CASES = [
    ("llama", False, False),
    ("llama", True, True),
    ("qwen2", False, True),
    ("qwen2", True, True),
]


@pytest.mark.parametrize(
    ("arch", "tied", "bias"), CASES, ids=[f"{a}-tied{t}-bias{b}" for a, t, b in CASES]
)
@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_transformers_checkpoint_loads_and_matches(tmp_path, arch, tied, bias, shard):
    hf = _hf_model(arch, tied, bias, seed=len(arch) + tied)
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path, **kwargs)
    if shard:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "the checkpoint should really be sharded"
    stage, report = _nereus(tmp_path)
    assert report.params == len(list(stage.parameters()))
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        expected = hf(ids).logits
        got = stage(ids, torch.arange(11).expand(2, 11))
    torch.testing.assert_close(got, expected, **CLOSE)


def test_left_padded_batch_matches_transformers_attention_mask(tmp_path):
    hf = _hf_model("qwen2", tied=False, bias=True, seed=11)
    hf.save_pretrained(tmp_path)
    stage, _ = _nereus(tmp_path)
    ids = torch.randint(0, 96, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, -1)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions.clamp(min=0)).logits
        got = stage(ids, positions)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], **CLOSE)


def test_bfloat16_checkpoint_loads_into_float32(tmp_path):
    hf = _hf_model("llama", tied=False, bias=False, seed=5)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path).torch_dtype == "bfloat16"
    stage, report = _nereus(tmp_path)
    assert stage.model.norm.weight.dtype == torch.float32
    assert report.bytes_read == sum(p.numel() * 2 for p in stage.parameters())
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        expected = hf.float()(ids).logits
        got = stage(ids, torch.arange(7)[None])
    torch.testing.assert_close(got, expected, **CLOSE)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shard_bytes", [None, 64 * 1024])
def test_nereus_checkpoint_loads_in_transformers(tmp_path, arch, shard_bytes):
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, tie_word_embeddings=arch == "qwen2")
    save_tiny_model(tmp_path, config, seed=9, max_shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard_bytes is not None)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    stage, _ = _nereus(tmp_path)
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(
            stage(ids, torch.arange(8).expand(2, 8)), hf(ids).logits, **CLOSE
        )


def test_save_tiny_model_is_deterministic(tmp_path):
    config = tiny_config("qwen2")
    a = save_tiny_model(tmp_path / "a", config, seed=1)
    b = save_tiny_model(tmp_path / "b", config, seed=1)
    c = save_tiny_model(tmp_path / "c", config, seed=2)
    read = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)
