"""A request decoded a few steps at a time: equal to one generate call, and weights that
change between calls are read by the next step with the KV cache kept."""

from __future__ import annotations

import pytest
import torch

from nereus.engines.generation import GenerationEngine
from nereus.engines.options import EngineOptions
from nereus.engines.stepped import SteppedRollout
from nereus.errors import ConfigError
from nereus.models import ModelConfig, save_tiny_model

CONFIG = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
PARAMS = {"max_tokens": 12, "temperature": 1.0, "stop_token_ids": [2], "seed": 5}


def _run(r: SteppedRollout, steps: int, between=None):
    tokens = [[] for _ in PROMPTS]
    logprobs = [[] for _ in PROMPTS]
    calls = 0
    while True:
        out = r.advance(steps)
        calls += 1
        for i in range(len(PROMPTS)):
            tokens[i] += out["tokens"][i]
            logprobs[i] += out["logprobs"][i]
        if out["finished"]:
            return tokens, logprobs
        if between is not None:
            between(calls)


def test_stepped_equals_one_generate_call(tmp_path):
    save_tiny_model(tmp_path, CONFIG, seed=0)
    engine = GenerationEngine(CONFIG, options=EngineOptions(model_dir=tmp_path))
    ref = engine.generate(PROMPTS, PARAMS)
    for steps in (1, 3, 12):
        assert _run(SteppedRollout(engine, PROMPTS, PARAMS), steps) == (ref.token_ids, ref.logprobs)
    engine.close()


def test_rows_with_their_own_lengths_finish_across_calls(tmp_path):
    save_tiny_model(tmp_path, CONFIG, seed=0)
    engine = GenerationEngine(CONFIG, options=EngineOptions(model_dir=tmp_path))
    limits = [2, 9, 5]
    free = {**PARAMS, "stop_token_ids": []}
    bounded = {**free, "row_max_tokens": limits}
    ref = engine.generate(PROMPTS, bounded)
    assert [len(t) for t in ref.token_ids] == limits
    for stops in ([], [2]):
        params = {**bounded, "stop_token_ids": stops}
        want = engine.generate(PROMPTS, params)
        r = SteppedRollout(engine, PROMPTS, params)
        tokens = [[] for _ in PROMPTS]
        dones = []
        while True:
            out = r.advance(3)
            for i, t in enumerate(out["tokens"]):
                tokens[i] += t
            dones.append(out["done"])
            if out["finished"]:
                break
        assert tokens == want.token_ids
        if not stops:
            assert [len(t) for t in tokens] == limits
            # three calls of three steps: row 0 is done after the first, row 2 the second
            assert dones == [[True, False, False], [True, False, True], [True, True, True]]
    engine.close()


def test_new_weights_are_read_at_the_next_step_with_the_cache_kept(tmp_path):
    save_tiny_model(tmp_path / "a", CONFIG, seed=0)
    save_tiny_model(tmp_path / "b", CONFIG, seed=1)
    engine = GenerationEngine(CONFIG, options=EngineOptions(model_dir=tmp_path / "a", name="live"))
    other = GenerationEngine(CONFIG, options=EngineOptions(model_dir=tmp_path / "b", name="next"))
    new = {k: v.clone() for k, v in other.named_weights().items()}
    other.close()
    swapped = {}

    def swap(calls: int) -> None:
        if calls == 2:
            with torch.no_grad():
                engine.load_named(new)
            swapped["at"] = r.step

    r = SteppedRollout(engine, PROMPTS, {**PARAMS, "stop_token_ids": []})
    tokens, _ = _run(r, 2, swap)
    engine.close()
    engine_a = GenerationEngine(
        CONFIG, options=EngineOptions(model_dir=tmp_path / "a", name="reference")
    )
    ref_a = engine_a.generate(PROMPTS, {**PARAMS, "stop_token_ids": []})
    engine_a.close()
    at = swapped["at"]
    assert at == 4
    # the prefix decoded before the swap is the old weights' ...
    assert [t[:at] for t in tokens] == [t[:at] for t in ref_a.token_ids]
    # ... and the request went on from its cache: no new prefill, the full length came out
    assert all(len(t) == 12 for t in tokens) and r.step == 12
    assert [t[at:] for t in tokens] != [t[at:] for t in ref_a.token_ids]


def _recompute(stages, prompt, tokens, versions):
    """Log-probs of ``tokens`` rebuilt row by row with the KV state the request had: the
    prompt's keys and values by the weights of the first token, each later position's by
    the weights that held when it was decoded."""
    cache = stages[0].new_kv_cache(1, CONFIG.max_position_embeddings)
    out = []
    with torch.inference_mode():
        for t, (token, v) in enumerate(zip(tokens, versions, strict=True)):
            if t == 0:
                ids, pos = torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0)
                index = torch.tensor([len(prompt) - 1])
            else:
                ids, pos = torch.tensor([[tokens[t - 1]]]), torch.tensor([[len(prompt) + t - 1]])
                index = torch.tensor([0])
            logits = stages[v](ids, pos, kv_cache=cache, logits_index=index, gather_logits=True)
            out.append(float(torch.log_softmax(logits.float().view(-1), -1)[token]))
    return out


def test_logprobs_across_two_swaps_are_those_of_the_distribution_sampled_from(tmp_path):
    """What the decoupled objective trusts: after each swap a row's recorded log-prob is
    that of the new weights over the cache the old ones wrote, at the row's own position;
    a row that is done returns nothing more."""
    models = []
    for i in range(3):
        save_tiny_model(tmp_path / str(i), CONFIG, seed=i)
        models.append(
            GenerationEngine(
                CONFIG, options=EngineOptions(model_dir=tmp_path / str(i), name=str(i))
            )
        )
    weights = [{k: v.clone() for k, v in m.named_weights().items()} for m in models]
    live = GenerationEngine(CONFIG, options=EngineOptions(model_dir=tmp_path / "0", name="live"))
    prompts = [*PROMPTS, [12]]
    for stops in ([], [2]):
        live.load_named(weights[0])
        r = SteppedRollout(live, prompts, {**PARAMS, "max_tokens": 14, "stop_token_ids": stops})
        tokens, logprobs, versions = ([[] for _ in prompts] for _ in range(3))
        version, calls, done = 0, 0, [False] * len(prompts)
        while True:
            out = r.advance(2)
            calls += 1
            for i in range(len(prompts)):
                assert not (done[i] and out["tokens"][i]), f"row {i} returned tokens after done"
                tokens[i] += out["tokens"][i]
                logprobs[i] += out["logprobs"][i]
                versions[i] += [version] * len(out["tokens"][i])
            done = out["done"]
            if out["finished"]:
                break
            if calls in (2, 4):
                version += 1
                live.load_named(weights[version])
        if stops:  # rows stopped at different steps, and some went on past a swap
            assert len({len(t) for t in tokens}) > 1
            assert any(len(set(v)) > 1 for v in versions)
        else:
            assert versions == [[0] * 4 + [1] * 4 + [2] * 6] * len(prompts)
        stages = [m.stage for m in models]
        for i, p in enumerate(prompts):
            again = _recompute(stages, p, tokens[i], versions[i])
            assert logprobs[i] == pytest.approx(again, abs=1e-5), f"row {i}, stops {stops}"
    for engine in (*models, live):
        engine.close()


def test_greedy_rows_decode_as_a_greedy_request_beside_the_sampled_ones(tmp_path):
    save_tiny_model(tmp_path, CONFIG, seed=0)
    engine = GenerationEngine(CONFIG, options=EngineOptions(model_dir=tmp_path))
    greedy = engine.generate(PROMPTS, {**PARAMS, "temperature": 0.0})
    sampled = engine.generate(PROMPTS, PARAMS)
    n = len(PROMPTS)
    r = SteppedRollout(engine, PROMPTS + PROMPTS, PARAMS, greedy_rows=range(n, 2 * n))
    tokens, logprobs = [[] for _ in range(2 * n)], [[] for _ in range(2 * n)]
    while True:
        out = r.advance(2)
        for i in range(2 * n):
            tokens[i] += out["tokens"][i]
            logprobs[i] += out["logprobs"][i]
        if out["finished"]:
            break
    with pytest.raises(ConfigError, match="greedy_rows"):
        SteppedRollout(engine, PROMPTS, PARAMS, greedy_rows=[n])
    engine.close()
    assert tokens[n:] == greedy.token_ids
    assert torch.allclose(
        torch.tensor([x for row in logprobs[n:] for x in row]),
        torch.tensor([x for row in greedy.logprobs for x in row]),
    )
    # the sampled rows drew from the distribution (not the argmax), with the request's noise
    assert tokens[:n] != greedy.token_ids
    assert tokens[:n] == sampled.token_ids
