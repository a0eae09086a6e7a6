"""Advantage and KL math against direct reference computations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError
from nereus.rl.advantages import (
    gae,
    grpo_advantages,
    kl_estimate,
    masked_whiten,
    remax_advantages,
    token_rewards,
)


def _gae_reference(rewards, values, mask, gamma, lam):
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b][t] + gamma * nxt_v - values[b][t]
            nxt_a = delta + gamma * lam * nxt_a
            adv[b][t] = nxt_a
            nxt_v = values[b][t]
    return adv


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 7),
    st.floats(0.5, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_gae_matches_reference(B, T, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref = torch.tensor(
        _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam),
        dtype=torch.float64,
    )
    torch.testing.assert_close(adv, ref)
    torch.testing.assert_close(ret, (ref + values) * mask)


def test_gae_with_lambda_one_and_no_discount_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, 0.9]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.ones(1, 3))
    torch.testing.assert_close(adv, 1.0 - values)


def test_token_rewards_put_the_score_on_the_last_response_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    kl = torch.full((3, 4), 0.5)
    r = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl, kl_coef=0.1)
    expected = torch.tensor(
        [[0.0, -0.05, 0.95, 0.0], [-0.05, -0.05, -0.05, 1.95], [0.0, 0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(r, expected)


def test_kl_estimators():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), lp - ref)
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), 0.5 * (lp - ref) ** 2)
    k3 = kl_estimate(lp, ref, "k3")
    assert (k3 >= 0).all() and k3[2] == 0
    # k3 is unbiased: under samples from p, E[k3] = KL(p || q).
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    exact = float((p * (p / q).log()).sum())
    est = float((p * kl_estimate(p.log(), q.log(), "k3")).sum())
    assert est == pytest.approx(exact, rel=1e-5)
    with pytest.raises(ConfigError, match="kl_kind='k9'"):
        kl_estimate(lp, ref, "k9")  # type: ignore[arg-type]


def test_grpo_advantages_are_normalised_per_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = grpo_advantages(scores, group_size=4)
    assert adv[:4].mean().abs() < 1e-6 and adv[:4].std() == pytest.approx(1.0, rel=1e-4)
    assert torch.all(adv[4:] == 0)
    torch.testing.assert_close(
        grpo_advantages(scores, 4, scale_by_std=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5])
    )
    with pytest.raises(ConfigError, match="group_size=3"):
        grpo_advantages(scores, 3)


def test_remax_and_whiten():
    torch.testing.assert_close(
        remax_advantages(torch.tensor([1.0, 0.2]), torch.tensor([0.5, 0.5])),
        torch.tensor([0.5, -0.3]),
    )
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, m)
    assert w[0, 3] == 0 and abs(float(w[0, :3].mean())) < 1e-6
    assert float((w[0, :3] ** 2).mean()) == pytest.approx(1.0, rel=1e-4)
    assert math.isfinite(float(masked_whiten(torch.zeros(1, 2), torch.zeros(1, 2)).sum()))
