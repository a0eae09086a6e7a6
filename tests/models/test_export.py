"""Export: a Hugging Face folder that transformers loads with the same numbers (Qwen3 and
Llama-3), and refusals of incomplete or foreign parameters."""

from __future__ import annotations

import pytest
import torch

from nereus.errors import StateError
from nereus.models import (
    ModelConfig,
    build_stage,
    load_stage_weights,
    save_tiny_model,
    tiny_config,
    train_tiny_tokenizer,
)
from nereus.models.chat import CHATML_TEMPLATE
from nereus.models.export import export_hf

LLAMA3 = dict(
    rope_type="llama3",
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_position_embeddings=64,
)


@pytest.mark.parametrize(
    "config",
    [
        tiny_config("qwen3", tie_word_embeddings=True, attention_bias=True),
        tiny_config("llama", **LLAMA3),
    ],
    ids=["qwen3", "llama3"],
)
def test_exported_folder_loads_in_transformers_with_the_same_logits(tmp_path, config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = train_tiny_tokenizer(
        tmp_path / "tok",
        ["two apples and three pears"] * 8,
        vocab_size=280,
        chat_template=CHATML_TEMPLATE,
    )
    config = config.replace(vocab_size=288)
    assert tok.vocab_size <= config.vocab_size
    save_tiny_model(tmp_path / "src", config, seed=4)
    model = build_stage(config)
    load_stage_weights(model, tmp_path / "src")
    with torch.no_grad():  # "trained" weights: not the ones the source folder holds
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = export_hf(
        tmp_path / "hf",
        config,
        {**params, "value_head.weight": torch.zeros(1, 64)},
        tokenizer_dir=tmp_path / "tok",
    )
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == (
        "Qwen3ForCausalLM" if config.architecture == "qwen3" else "LlamaForCausalLM"
    )
    ids = torch.randint(0, 280, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(
            hf(ids).logits, model(ids, torch.arange(12).expand(2, 12)), rtol=1e-4, atol=1e-5
        )
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = hf_tok.apply_chat_template(
        [{"role": "user", "content": "two apples"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    # nereus reads its own export back to the same config.
    assert ModelConfig.from_hf(out) == config


def test_export_refuses_missing_and_misshaped_parameters(tmp_path):
    config = tiny_config("qwen3")
    params = {n: p.detach() for n, p in build_stage(config).named_parameters()}
    missing = dict(params)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(StateError, match="k_norm"):
        export_hf(tmp_path / "a", config, missing)
    with pytest.raises(StateError, match="shape"):
        export_hf(tmp_path / "b", config, {**params, "model.norm.weight": torch.ones(3)})
    with pytest.raises(StateError, match="not parameters"):
        export_hf(tmp_path / "c", config, {**params, "model.extra.weight": torch.ones(3)})
