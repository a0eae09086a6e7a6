"""The vLLM adapter on vLLM's CPU build: same tokens as the built-in engine, in-place
weight updates, stop/max tokens, memory accounting. Runs only where vllm is importable
(``.venv-vllm/bin/python -m pytest -m vllm tests/engines``)."""

from __future__ import annotations

import pytest
import torch

from nereus.engines import GenerationEngine, SamplingParams
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.errors import ConfigError
from nereus.models import save_tiny_model, tiny_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

# vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads.
CONFIG = tiny_config(num_hidden_layers=2, hidden_size=128, tie_word_embeddings=True)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    first = save_tiny_model(base / "a", CONFIG, seed=1, init_std=0.3)
    second = save_tiny_model(base / "b", CONFIG, seed=2, init_std=0.3)
    from nereus.engines.vllm_adapter import VllmGenerationEngine

    ledger = MemoryLedger("vllm-test", None)
    engine = VllmGenerationEngine(
        CONFIG,
        first,
        options=EngineOptions(ledger=ledger),
        max_model_len=64,
        kv_cache_bytes=32 << 20,
    )
    yield engine, first, second, ledger
    engine.close()


def _builtin(path, name):
    return GenerationEngine(
        CONFIG, options=EngineOptions(model_dir=path, ledger=MemoryLedger(name, None), name=name)
    )


def test_greedy_matches_the_builtin_engine(setup):
    engine, first, _, _ = setup
    params = SamplingParams(max_tokens=6, temperature=0.0)
    got = engine.generate(PROMPTS, params)
    ref = _builtin(first, "ref-a").generate(PROMPTS, params)
    assert got.token_ids == ref.token_ids
    for a, b in zip(got.logprobs, ref.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=1e-3)
    assert got.finish_reasons == ["length"] * 3


def test_weights_written_in_place_change_the_output(setup):
    engine, first, second, _ = setup
    params = SamplingParams(max_tokens=6, temperature=0.0)
    new = _builtin(second, "ref-b")
    written = engine.load_named(new.named_weights())
    assert written == sum(t.numel() * 4 for t in new.named_weights().values())
    assert engine.generate(PROMPTS, params).token_ids == new.generate(PROMPTS, params).token_ids
    old = _builtin(first, "ref-a2")
    engine.load_named(old.named_weights())
    assert engine.generate(PROMPTS, params).token_ids == old.generate(PROMPTS, params).token_ids


def test_stop_and_max_tokens_and_seeds(setup):
    engine, _, _, _ = setup
    free = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    stop = free.token_ids[1][2]
    first = free.token_ids[1].index(stop)
    out = engine.generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop,))
    )
    assert out.token_ids[1] == free.token_ids[1][: first + 1] and out.finish_reasons[1] == "stop"
    dropped = engine.generate(
        PROMPTS,
        SamplingParams(
            max_tokens=6, temperature=0.0, stop_token_ids=(stop,), include_stop_token=False
        ),
    )
    assert dropped.token_ids[1] == free.token_ids[1][:first]
    assert [
        len(t)
        for t in engine.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0)).token_ids
    ] == [2, 2, 2]
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    a = engine.generate([PROMPTS[0]] * 4, p)
    assert a.token_ids == engine.generate([PROMPTS[0]] * 4, p).token_ids
    assert len({tuple(t) for t in a.token_ids}) > 1  # repeated prompts get different samples


def test_each_row_generates_exactly_its_own_length(setup):
    engine, first, _, _ = setup
    free = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    limits = (2, 6, 1)
    out = engine.generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, row_max_tokens=limits)
    )
    assert [len(t) for t in out.token_ids] == list(limits)
    assert [len(lp) for lp in out.logprobs] == list(limits)
    assert out.token_ids == [t[:n] for t, n in zip(free.token_ids, limits, strict=True)]
    assert out.finish_reasons == ["length"] * 3
    ref = _builtin(first, "ref-rows").generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, row_max_tokens=limits)
    )
    assert out.token_ids == ref.token_ids


def test_memory_is_reserved_and_cpu_sleep_frees_nothing(setup):
    engine, _, _, ledger = setup
    held = engine.memory()
    assert held["vllm-generation/kv_cache"] == 32 << 20 and held["vllm-generation/weights"] > 0
    assert engine.sleep() == 0 and not engine.is_sleeping
    assert engine.memory() == held


def test_greedy_rows_decode_greedily_among_sampled_ones(setup):
    """ReMax's baseline rows in one request with the sampled ones (async mode on vLLM)."""
    engine = setup[0]
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0)).token_ids
    hot = SamplingParams(max_tokens=6, temperature=2.0, seed=3)
    out = engine.generate(PROMPTS * 4, hot, greedy_rows=[1, 5])
    assert out.token_ids[1] == greedy[1] and out.token_ids[5] == greedy[2]
    sampled = [i for i in range(12) if i not in (1, 5)]
    assert any(out.token_ids[i] != greedy[i % 3] for i in sampled)
    with pytest.raises(ConfigError, match="greedy_rows"):
        engine.generate(PROMPTS, hot, greedy_rows=[3])
