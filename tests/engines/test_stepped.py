"""A request decoded a few steps at a time: equal to one generate call, weights that change
between calls read by the next step with the KV cache kept, and done slots refilled with
new rows that decode as requests of their own while the other rows are untouched."""

from __future__ import annotations

import pytest
import torch

from nereus.engines.generation import GenerationEngine, _Noise
from nereus.engines.options import EngineOptions
from nereus.engines.stepped import Refill, SteppedRollout
from nereus.errors import ConfigError
from nereus.models import ModelConfig, save_tiny_model
from tests.engines._refill import QUEUE, refilled_run

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


class _Shifted:
    """The noise a refilled row drew: the request's at ``shift`` steps later, its slot."""

    def __init__(self, seed: int, shift: int, slot: int, batch: int) -> None:
        self.noise, self.shift, self.slot, self.batch = _Noise(seed, 0), shift, slot, batch

    def rows(self, step: int, batch: int, rows: slice) -> torch.Tensor:
        return self.noise.rows(step + self.shift, self.batch, slice(self.slot, self.slot + 1))


def _alone(engine, prompt, params, shift, slot, rows, greedy=False):
    """A fresh one-row request for ``prompt`` drawing what slot ``slot`` drew from step
    ``shift`` on."""
    r = SteppedRollout(engine, [prompt], params, greedy_rows=[0] if greedy else ())
    r.noise = _Shifted(params["seed"], shift, slot, rows)
    tokens, logprobs = [], []
    while True:
        out = r.advance(5)
        tokens += out["tokens"][0]
        logprobs += out["logprobs"][0]
        if out["finished"]:
            return tokens, logprobs


@pytest.fixture
def engine(tmp_path):
    save_tiny_model(tmp_path / "model", CONFIG, seed=0)
    engine = GenerationEngine(CONFIG, options=EngineOptions(model_dir=tmp_path / "model"))
    yield engine
    engine.close()  # also after a failure: the engine's name is free for the next test


@pytest.mark.parametrize("stops", [[], [2]])
def test_a_refilled_row_is_a_fresh_request_and_the_others_are_untouched(engine, stops):
    params = {**PARAMS, "stop_token_ids": stops, "row_max_tokens": [2, 12, 5]}
    without = _run(SteppedRollout(engine, PROMPTS, params), 3)
    r = SteppedRollout(engine, PROMPTS, params, prompt_width=5)
    first = r.advance(3)
    assert first["done"][0] and not first["done"][1]
    new = [12, 13, 14, 15, 3]  # wider than any first prompt: prompt_width makes room
    tokens = [t for t in first["tokens"]]
    logprobs = [lp for lp in first["logprobs"]]
    refilled, refilled_lp = [], []
    out = r.advance(3, [Refill(0, new, 7)])
    while True:
        refilled += out["tokens"][0]
        refilled_lp += out["logprobs"][0]
        for i in (1, 2):
            tokens[i] += out["tokens"][i]
            logprobs[i] += out["logprobs"][i]
        if out["finished"]:
            break
        out = r.advance(3)
    # the rows not refilled drew exactly what they draw without the refill
    assert tokens[1:] == without[0][1:]
    assert [x for row in logprobs[1:] for x in row] == pytest.approx(
        [x for row in without[1][1:] for x in row], abs=1e-5
    )
    assert tokens[0] == without[0][0]
    # the new row: its own bound, and what a request of its own with its noise draws
    want = _alone(engine, new, {**params, "max_tokens": 7, "row_max_tokens": None}, 3, 0, 3)
    assert refilled == want[0]
    assert refilled_lp == pytest.approx(want[1], abs=1e-5)
    if not stops:
        assert len(refilled) == 7
    assert refilled_lp == pytest.approx(
        _recompute([engine.stage], new, refilled, [0] * len(refilled)), abs=1e-5
    )


def test_every_slot_refilled_at_once_and_a_greedy_refill(engine):
    """A finished request whose every slot is refilled (no decode forward at that step),
    one of them greedy; and the rows of the shared script each equal a request alone."""
    params = {**PARAMS, "stop_token_ids": [], "max_tokens": 6}
    r = SteppedRollout(engine, PROMPTS, params)
    while not r.advance(4)["finished"]:
        pass
    assert r.step == 6
    news = [[5, 4], [11, 10, 9], [3]]
    out = r.advance(2, [Refill(s, p, 4, greedy=s == 1) for s, p in enumerate(news)])
    got = [out["tokens"][s] for s in range(3)]
    assert not out["finished"]
    out = r.advance(2)
    got = [g + t for g, t in zip(got, out["tokens"], strict=True)]
    assert out["finished"] and [len(g) for g in got] == [4, 4, 4]
    for s, p in enumerate(news):
        one = {**params, "max_tokens": 4}
        if s == 1:
            want = engine.generate([p], {**one, "temperature": 0.0}).token_ids[0]
        else:
            want = _alone(engine, p, one, 6, s, 3)[0]
        assert got[s] == want, s
    prompts = PROMPTS + [[PROMPTS[0][0], *suffix] for suffix, _, _ in QUEUE]
    bounds = [2, 6, 4] + [bound for _, bound, _ in QUEUE]
    occupants = refilled_run(engine, PROMPTS, seed=5)
    assert [len(tokens) for tokens, _ in occupants] == bounds
    for i, (prompt, (tokens, logprobs)) in enumerate(zip(prompts, occupants, strict=True)):
        assert logprobs == pytest.approx(
            _recompute([engine.stage], prompt, tokens, [0] * len(tokens)), abs=1e-5
        ), i


def test_refills_that_do_not_fit_are_refused(engine):
    params = {**PARAMS, "stop_token_ids": [], "row_max_tokens": [2, 9, 5]}
    r = SteppedRollout(engine, PROMPTS, params)
    r.advance(3)  # row 0 done; the room is the widest prompt (4) + the longest row (9)
    for refill, field in [
        (Refill(1, [3, 4]), r"refill\[0\]\.slot"),  # not done
        (Refill(3, [3, 4]), r"refill\[0\]\.slot"),  # no such slot
        (Refill(0, [3, 4], 10), r"refill\[0\]\.max_tokens"),
        (Refill(0, [3, 4, 5, 6, 7], 9), r"refill\[0\]\.prompt"),
        (Refill(0, [3, 99], 2), r"refill\[0\]\.prompt"),
    ]:
        with pytest.raises(ConfigError, match=field):
            r.advance(1, [refill])
    with pytest.raises(ConfigError, match=r"refill\[1\]\.slot"):
        r.advance(1, [Refill(0, [3], 2), Refill(0, [4], 2)])
    assert r.step == 3  # nothing ran
    r.advance(1, [Refill(0, [3, 4, 5, 6], 9)])  # fits exactly
