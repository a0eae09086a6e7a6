"""vLLM's CPU build serves Qwen3 and Llama-3 folders that nereus writes (its export), gives
the built-in engine's greedy tokens, and takes nereus's shards by name (Qwen3's q_norm and
k_norm included). Runs only where vllm is importable (``make test-vllm``)."""

from __future__ import annotations

import pytest

from nereus.engines import GenerationEngine, SamplingParams
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.models import build_stage, export_hf, load_stage_weights, save_tiny_model, tiny_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

# vLLM's CPU attention needs head_dim >= 32.
CONFIGS = {
    "qwen3": tiny_config(
        "qwen3", num_hidden_layers=2, hidden_size=128, head_dim=32, tie_word_embeddings=True
    ),
    "llama3": tiny_config(
        "llama",
        num_hidden_layers=2,
        hidden_size=128,
        rope_theta=500000.0,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=16,
    ),
}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20, 21, 22], [14]]


def _builtin(config, path, name):
    return GenerationEngine(
        config, options=EngineOptions(model_dir=path, ledger=MemoryLedger(name, None), name=name)
    )


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_exported_folder_serves_and_takes_shards_by_name(tmp_path, kind):
    from nereus.engines.vllm_adapter import VllmGenerationEngine

    config = CONFIGS[kind]
    source = save_tiny_model(tmp_path / "src", config, seed=1, init_std=0.3)
    model = build_stage(config)
    load_stage_weights(model, source)
    exported = export_hf(
        tmp_path / "hf", config, {n: p.detach() for n, p in model.named_parameters()}
    )
    params = SamplingParams(max_tokens=12, temperature=0.0)
    engine = VllmGenerationEngine(
        config,
        exported,
        options=EngineOptions(ledger=MemoryLedger(f"vllm-{kind}", None)),
        max_model_len=64,
        kv_cache_bytes=32 << 20,
    )
    try:
        served = engine.generate(PROMPTS, params).token_ids
        assert served == _builtin(config, source, "ref-a").generate(PROMPTS, params).token_ids
        # The features under test decide the tokens: without them the built-in engine differs.
        plain = config.replace(rope_type="default", rope_factor=1.0) if kind == "llama3" else None
        if plain is not None:
            assert (
                served != _builtin(plain, source, "ref-plain").generate(PROMPTS, params).token_ids
            )
        other = _builtin(
            config, save_tiny_model(tmp_path / "b", config, seed=2, init_std=0.3), "ref-b"
        )
        weights = other.named_weights()
        assert any("q_norm" in n for n in weights) == (kind == "qwen3")
        engine.load_named(weights)
        assert (
            engine.generate(PROMPTS, params).token_ids == other.generate(PROMPTS, params).token_ids
        )
    finally:
        engine.close()
