"""Clipped policy and value objectives: values, gradients, batch-key checks."""

from __future__ import annotations

import pytest
import torch

from nereus.errors import ConfigError
from nereus.rl.losses import (
    aggregate,
    clipped_policy_objective,
    clipped_value_objective,
    policy_loss,
    value_loss,
)


def test_policy_objective_equals_advantage_weighted_ratio_inside_the_clip():
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([[2.0, -1.0]])
    loss, m = clipped_policy_objective(lp, old, adv, torch.ones(1, 2), clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.5)  # -(2 - 1) / 2 at ratio 1
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.5]]))
    assert m["clip_frac"] == 0.0


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_(True)  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = clipped_policy_objective(lp, old, adv, torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    assert torch.all(lp.grad == 0)  # both sides clipped: no push further away
    assert m["clip_frac"] == 1.0
    assert loss.item() == pytest.approx(-(1.2 - 0.8) / 2)


def test_kl_loss_term_and_masking():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    batch = {
        "old_logprobs": lp.detach().clone(),
        "advantages": torch.zeros(1, 3),
        "response_mask": torch.tensor([[0.0, 1.0, 1.0]]),
        "ref_logprobs": torch.tensor([[-1.0, -1.0, -3.0]]),
    }
    loss, m = policy_loss({"logprobs": lp}, batch, kl_coef=0.5, kl_kind="k1")
    assert loss.item() == pytest.approx(0.5 * (-1.0 + 0.0) / 2)
    assert m["kl_ref"] == pytest.approx(-0.5)
    loss.backward()
    assert lp.grad[0, 0] == 0  # prompt token carries no loss
    with pytest.raises(ConfigError, match="must contain 'ref_logprobs'"):
        policy_loss(
            {"logprobs": lp}, {k: v for k, v in batch.items() if k != "ref_logprobs"}, kl_coef=0.1
        )


def test_value_clipping_takes_the_pessimistic_error():
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[1.0, 1.0]])
    v = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = clipped_value_objective(v, old, ret, torch.ones(1, 2), clip_range=0.2)
    # token 0: max((0.5-1)^2, (0.2-1)^2) = 0.64; token 1: max(1, (0.2-1)^2) = 1.0
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.5]]))  # clipped branch has no grad
    unclipped, _ = value_loss(
        {"values": v.detach()},
        {"old_values": old, "returns": ret, "response_mask": torch.ones(1, 2)},
        value_clip=None,
    )
    assert float(unclipped) == pytest.approx(0.5 * (0.25 + 1.0) / 2)


def test_aggregations():
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(x, m, "token-mean")) == pytest.approx(7 / 4)
    assert float(aggregate(x, m, "seq-mean")) == pytest.approx((1 + 4) / 2)
    with pytest.raises(ConfigError, match="aggregation='sum'"):
        aggregate(x, m, "sum")  # type: ignore[arg-type]
