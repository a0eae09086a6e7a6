"""The sampler: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.engines.sampling import SamplingParams, make_generator, sample_next, step_noise
from nereus.errors import ConfigError


def _logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_raw_logprob():
    logits = _logits()
    tokens, lp = sample_next(logits, SamplingParams(temperature=0.0), make_generator(0))
    assert torch.equal(tokens, logits.argmax(-1))
    expect = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expect)


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = _logits(rows=64, vocab=200)
    p = SamplingParams(temperature=1.0)
    a, _ = sample_next(logits, p, make_generator(7))
    b, _ = sample_next(logits, p, make_generator(7))
    c, _ = sample_next(logits, p, make_generator(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_only_draws_from_k_largest():
    logits = torch.zeros(1, 100)
    logits[0, :10] = torch.linspace(1, 2, 10)  # ten clearly largest: 0..9
    g = make_generator(1)
    p = SamplingParams(temperature=5.0, top_k=3)
    seen = {int(sample_next(logits, p, g)[0]) for _ in range(300)}
    assert seen == {7, 8, 9}


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    g = make_generator(2)
    seen = {int(sample_next(logits, SamplingParams(top_p=0.8), g)[0]) for _ in range(400)}
    assert seen == {0, 1}  # 0.5 < 0.8, 0.5 + 0.3 reaches it
    seen = {int(sample_next(logits, SamplingParams(top_p=0.81), g)[0]) for _ in range(400)}
    assert seen == {0, 1, 2}
    seen = {int(sample_next(logits, SamplingParams(top_p=0.01), g)[0]) for _ in range(50)}
    assert seen == {0}  # the most likely token is always kept


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(20_000, 3).contiguous()
    tokens, lp = sample_next(logits, SamplingParams(), make_generator(3))
    freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)
    torch.testing.assert_close(lp, probs.log()[tokens])


def test_logprob_is_temperature_scaled_before_filtering():
    logits = _logits(rows=8, vocab=30)
    p = SamplingParams(temperature=0.7, top_k=5)
    tokens, lp = sample_next(logits, p, make_generator(4))
    expect = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expect)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
        ({"max_tokens": 4, "row_max_tokens": (2, 5)}, "row_max_tokens"),
        ({"max_tokens": 4, "row_max_tokens": (0,)}, "row_max_tokens"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_params_roundtrip_through_plain_data():
    p = SamplingParams(
        max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, stop_token_ids=(1, 2), seed=3
    )
    assert SamplingParams.from_any(p.to_dict()) == p
    rows = SamplingParams(max_tokens=5, row_max_tokens=[1, 5, 3])
    assert rows.row_max_tokens == (1, 5, 3) and SamplingParams.from_any(rows.to_dict()) == rows
    assert rows.row_limits(3) == [1, 5, 3] and p.row_limits(2) is None
    with pytest.raises(ConfigError, match="one bound per row"):
        rows.row_limits(2)
    assert SamplingParams.from_any(None) == SamplingParams()
    with pytest.raises(ConfigError, match="unknown"):
        SamplingParams.from_any({"max_tokens": 3, "beam": 2})


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 40),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.05, 1.0),
    temp=st.floats(0.1, 3.0),
    seed=st.integers(0, 2**31),
)
def test_sampled_token_always_survives_filtering(rows, vocab, top_k, top_p, temp, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    p = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p)
    tokens, lp = sample_next(logits, p, make_generator(seed))
    assert tokens.shape == (rows,) and lp.shape == (rows,)
    assert bool(torch.isfinite(lp).all())
    scaled = logits / temp
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, -1).values[:, -1]
        assert bool((scaled.gather(-1, tokens[:, None]).squeeze(-1) >= kth).all())
    # a token strictly less likely than a set of tokens whose mass reaches top_p is never drawn
    probs = torch.softmax(scaled, -1)
    chosen = probs.gather(-1, tokens[:, None])
    mass_above = (probs * (probs > chosen)).sum(-1)
    if top_k == 0 or top_k >= vocab:
        assert bool((mass_above < top_p + 1e-6).all())


def test_extreme_uniforms_never_draw_a_filtered_token():
    # Tokens 0, 2 and 4 are filtered out by top-k (probability 0): the inverse CDF must
    # skip their empty buckets at both ends of [0, 1).
    logits = torch.tensor([[-9.0, 1.0, -9.0, 2.0, -9.0]]).expand(3, 5)
    p = SamplingParams(top_k=2)
    uniform = torch.tensor([0.0, 0.5, 1.0 - 2**-24])
    tokens, lp = sample_next(logits, p, uniform=uniform)
    assert tokens.tolist()[0] == 1 and tokens.tolist()[2] == 3
    assert set(tokens.tolist()) <= {1, 3}
    torch.testing.assert_close(
        lp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    )


def test_step_noise_from_a_reused_generator_equals_a_fresh_one():
    g = torch.Generator()
    torch.rand(7, generator=g)  # a used generator: reseeding must reset all of its state
    for seed, chunk, step in ((0, 0, 0), (3, 1, 5), (2**40, 2, 63)):
        assert torch.equal(step_noise(seed, chunk, step, 9, g), step_noise(seed, chunk, step, 9))
    assert not torch.equal(step_noise(3, 1, 5, 9), step_noise(3, 1, 6, 9))
