"""A request decoded a few steps at a time: equal to one generate call, and weights that
change between calls are read by the next step with the KV cache kept."""

from __future__ import annotations

import torch

from nereus.engines.generation import GenerationEngine
from nereus.engines.options import EngineOptions
from nereus.engines.stepped import SteppedRollout
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
