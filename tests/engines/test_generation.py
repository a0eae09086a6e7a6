"""The built-in generation engine in one process (TP=1, PP=1): KV-cache correctness,
stop tokens, max tokens, seeds, memory budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.engines import GenerationEngine, SamplingParams, kv_cache_bytes
from nereus.engines._base import stage_param_bytes
from nereus.engines.context import EmuContext
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.errors import ConfigError, OutOfMemory
from nereus.models import ModelConfig, ParallelContext, save_tiny_model, tiny_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_config(num_hidden_layers=2)
    path = save_tiny_model(tmp_path_factory.mktemp("gen") / "m", config, seed=1, init_std=0.3)
    return config, path


def _engine(
    model, *, ledger: MemoryLedger | None = None, name: str | None = None, **kw
) -> GenerationEngine:
    config, path = model
    options = EngineOptions(
        model_dir=path, ledger=ledger or MemoryLedger("gen-test", None), name=name
    )
    return GenerationEngine(config, options=options, **kw)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]


def test_greedy_matches_recomputing_without_cache(model):
    eng = _engine(model)
    out = eng.generate(PROMPTS, SamplingParams(max_tokens=7, temperature=0.0))
    assert out.finish_reasons == ["length"] * 3
    with torch.inference_mode():
        for prompt, toks, lps in zip(PROMPTS, out.token_ids, out.logprobs, strict=True):
            seq = list(prompt)
            assert len(toks) == 7
            for tok, lp in zip(toks, lps, strict=True):
                ids = torch.tensor([seq])
                logits = eng.stage(ids, torch.arange(len(seq)).unsqueeze(0))[0, -1]
                assert int(logits.argmax()) == tok
                assert abs(float(torch.log_softmax(logits, -1)[tok]) - lp) < 1e-4
                seq.append(tok)


def test_a_row_does_not_depend_on_its_batch(model):
    eng = _engine(model)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    together = eng.generate(PROMPTS, params)
    for i, p in enumerate(PROMPTS):
        alone = eng.generate([p], params)
        assert alone.token_ids[0] == together.token_ids[i]


def test_seed_makes_sampling_deterministic(model):
    eng = _engine(model)
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=123)
    a = eng.generate(PROMPTS * 4, p)
    b = eng.generate(PROMPTS * 4, p)
    c = eng.generate(
        PROMPTS * 4, SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=124)
    )
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    # chunks of max_batch draw from one generator in order: deterministic too
    chunked = _engine(model, max_batch=5, name="chunked")
    assert chunked.generate(PROMPTS * 4, p).token_ids == chunked.generate(PROMPTS * 4, p).token_ids


def test_stop_tokens_end_rows_and_are_kept_or_dropped(model):
    eng = _engine(model)
    free = eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    stop = free.token_ids[1][2]  # the third token of row 1 becomes a stop token
    out = eng.generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop,))
    )
    row = out.token_ids[1]
    first = free.token_ids[1].index(stop)
    assert row == free.token_ids[1][: first + 1] and out.finish_reasons[1] == "stop"
    assert len(out.logprobs[1]) == len(row)
    dropped = eng.generate(
        PROMPTS,
        SamplingParams(
            max_tokens=6, temperature=0.0, stop_token_ids=(stop,), include_stop_token=False
        ),
    )
    assert dropped.token_ids[1] == free.token_ids[1][:first]
    for i in (0, 2):  # rows that never produce the stop token are unaffected
        if stop not in free.token_ids[i]:
            assert out.token_ids[i] == free.token_ids[i] and out.finish_reasons[i] == "length"


def test_max_tokens_and_top_k_one_is_greedy(model):
    eng = _engine(model)
    greedy = eng.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0))
    top1 = eng.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=2.0, top_k=1, seed=3))
    assert top1.token_ids == greedy.token_ids
    one = eng.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0))
    assert [t[:1] for t in greedy.token_ids] == one.token_ids


def test_each_row_generates_exactly_its_own_length(model):
    eng = _engine(model, name="rows")
    prompts = PROMPTS * 2
    free = eng.generate(prompts, SamplingParams(max_tokens=7, temperature=1.0, seed=4))
    limits = (3, 7, 1, 5, 2, 6)
    out = eng.generate(
        prompts, SamplingParams(max_tokens=7, temperature=1.0, seed=4, row_max_tokens=limits)
    )
    assert [len(t) for t in out.token_ids] == list(limits)
    assert [len(lp) for lp in out.logprobs] == list(limits)
    # the same noise per step and row: a bounded row is the prefix of the free one
    assert out.token_ids == [t[:n] for t, n in zip(free.token_ids, limits, strict=True)]
    assert out.logprobs == [lp[:n] for lp, n in zip(free.logprobs, limits, strict=True)]
    assert out.finish_reasons == ["length"] * 6
    # a fresh cache holds the prompts and the longest row, not max_tokens
    fresh = _engine(model, name="rows-cache")
    short = fresh.generate(
        prompts[:2], SamplingParams(max_tokens=7, temperature=0.0, row_max_tokens=(2, 3))
    )
    assert [len(t) for t in short.token_ids] == [2, 3]
    assert fresh.cache_shape == (2, max(len(p) for p in prompts[:2]) + 3)
    fresh.close()
    # chunks of max_batch take their own rows' bounds
    chunked = _engine(model, max_batch=4, name="rows-chunked")
    got = chunked.generate(
        prompts, SamplingParams(max_tokens=7, temperature=1.0, seed=4, row_max_tokens=limits)
    )
    assert [len(t) for t in got.token_ids] == list(limits)
    eng.close()
    chunked.close()


def test_a_row_ends_at_a_stop_token_or_its_own_length(model):
    eng = _engine(model, name="rows-stop")
    free = eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    stop = free.token_ids[1][2]
    first = free.token_ids[1].index(stop)
    limits = (2, 6, 4)
    out = eng.generate(
        PROMPTS,
        SamplingParams(
            max_tokens=6, temperature=0.0, stop_token_ids=(stop,), row_max_tokens=limits
        ),
    )
    for i, n in enumerate(limits):
        row = free.token_ids[i]
        end = row.index(stop) + 1 if stop in row[:n] else n
        assert out.token_ids[i] == row[:end]
        assert out.finish_reasons[i] == ("stop" if stop in row[:n] else "length")
    assert out.token_ids[1] == free.token_ids[1][: first + 1]
    with pytest.raises(ConfigError, match="row_max_tokens"):
        eng.generate(PROMPTS, SamplingParams(max_tokens=6, row_max_tokens=(2, 3)))
    eng.close()


def test_bad_prompts_are_refused(model):
    eng = _engine(model)
    with pytest.raises(ConfigError, match="prompts"):
        eng.generate([], SamplingParams())
    with pytest.raises(ConfigError, match=r"prompts\[1\]"):
        eng.generate([[1], []], SamplingParams())
    with pytest.raises(ConfigError, match="vocab_size"):
        eng.generate([[1, 10_000]], SamplingParams())
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        eng.generate([[1, 2]], SamplingParams(max_tokens=10_000))


def test_out_of_memory_fires_exactly_at_the_budget(model):
    config, path = model
    ctx = EmuContext(ParallelContext())
    batch, max_tokens = len(PROMPTS), 5
    weights = stage_param_bytes(config, ctx, torch.float32)
    cache = kv_cache_bytes(config, ctx, batch, max(map(len, PROMPTS)) + max_tokens, torch.float32)
    fits = GenerationEngine(
        config, options=EngineOptions(model_dir=path, ledger=MemoryLedger(7, weights + cache))
    )
    fits.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    assert fits.ledger.used_bytes == weights + cache
    tight = GenerationEngine(
        config, options=EngineOptions(model_dir=path, ledger=MemoryLedger(7, weights + cache - 1))
    )
    with pytest.raises(OutOfMemory) as info:
        tight.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    err = info.value
    assert (err.device, err.need_bytes, err.budget_bytes) == (
        7,
        weights + cache,
        weights + cache - 1,
    )
    assert "kv_cache" in str(err) and "device 7" in str(err)
    assert tight.ledger.used_bytes == weights  # nothing of the cache was kept
    # Weights alone that do not fit fail at construction, before anything is built.
    with pytest.raises(OutOfMemory, match="weights"):
        GenerationEngine(
            config, options=EngineOptions(model_dir=path, ledger=MemoryLedger(8, weights - 1))
        )


def test_cache_is_reused_and_freed(model):
    eng = _engine(model)
    eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    held = eng.memory()["generation/kv_cache"]
    first = eng._cache
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0.0))
    assert eng._cache is first and eng.memory()["generation/kv_cache"] == held
    assert eng.free_cache() == held
    assert "generation/kv_cache" not in eng.memory()
    eng.close()
    assert eng.ledger.used_bytes == 0


def test_two_engines_may_not_share_a_name(model):
    ledger = MemoryLedger("shared", None)
    _engine(model, ledger=ledger, name="policy-generation")
    with pytest.raises(ConfigError, match="already used"):
        _engine(model, ledger=ledger, name="policy-generation")


def test_matches_transformers_greedy_generate(model):
    transformers = pytest.importorskip("transformers")
    config, path = model
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    eng = _engine(model)
    out = eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    for prompt, toks in zip(PROMPTS, out.token_ids, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0
            )
        assert ref[0, len(prompt) :].tolist() == toks


def test_model_config_is_what_the_engine_uses(model):
    config, _ = model
    assert isinstance(config, ModelConfig)


def test_sleep_frees_weights_and_cache_and_wake_up_restores_them(model):
    from nereus.errors import StateError

    eng = _engine(model, name="sleepy")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    before = eng.generate(PROMPTS, params)
    held = eng.ledger.used_bytes
    assert eng.sleep() == held and eng.ledger.used_bytes == 0
    with pytest.raises(ConfigError, match="wake_up"):
        eng.generate(PROMPTS, params)
    with pytest.raises(StateError, match="asleep"):
        eng.named_weights()
    eng.wake_up()  # from the model directory
    assert eng.generate(PROMPTS, params).token_ids == before.token_ids
    # waking with other weights (a weight sync) gives their tokens
    other = GenerationEngine(
        model[0], options=EngineOptions(seed=5, ledger=MemoryLedger("other", None), name="other")
    )
    eng.sleep()
    eng.wake_up(other.named_weights())
    assert eng.generate(PROMPTS, params).token_ids == other.generate(PROMPTS, params).token_ids


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    max_tokens=st.integers(1, 5),
    seed=st.integers(0, 2**20),
)
def test_ragged_batches_match_rows_alone(model, lengths, max_tokens, seed):
    eng = _engine(model, name=f"prop-{seed}")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    together = eng.generate(prompts, params)
    for prompt, toks, lps in zip(prompts, together.token_ids, together.logprobs, strict=True):
        alone = eng.generate([prompt], params)
        assert alone.token_ids[0] == toks
        torch.testing.assert_close(
            torch.tensor(alone.logprobs[0]), torch.tensor(lps), atol=1e-4, rtol=1e-4
        )
    eng.close()
