"""The decoupled PPO objective: PPO's surrogate on-policy, behaviour weights truncated."""

from __future__ import annotations

import pytest
import torch

from nereus.errors import ConfigError
from nereus.rl.decoupled import (
    decoupled_policy_loss,
    decoupled_policy_objective,
    importance_weights,
)
from nereus.rl.losses import clipped_policy_objective


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(3, 6, generator=g) * 0.1 - 1.0
    adv = torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    mask[0, :2] = 0
    return logp, adv, mask


def test_on_policy_it_is_ppos_clipped_surrogate():
    logp, adv, mask = _data()
    old = logp - 0.15 * torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    ours, m = decoupled_policy_objective(logp, old, old, adv, mask)
    ref, _ = clipped_policy_objective(logp, old, adv, mask)
    assert torch.allclose(ours, ref)
    assert m["importance_weight_mean"] == pytest.approx(1.0) and m["importance_clipped_frac"] == 0.0


def test_stale_tokens_are_weighted_by_prox_over_behaviour_truncated_at_the_cap():
    logp, adv, mask = _data()
    prox = logp.detach().clone()
    behav = prox.clone()
    behav[1, 3] = prox[1, 3] - 3.0  # weight e^3 > cap 2: truncated
    behav[2, 1] = prox[2, 1] + 0.5  # weight e^-0.5
    w, cut = importance_weights(prox, behav, 2.0)
    assert (
        w[1, 3] == 2.0
        and bool(cut[1, 3])
        and w[2, 1] == pytest.approx(float(torch.exp(torch.tensor(-0.5))))
    )
    lp = logp.clone().requires_grad_(True)
    loss, m = decoupled_policy_objective(lp, prox, behav, adv, mask, importance_cap=2.0)
    expected = -(w * adv * mask).sum() / mask.sum()  # ratio 1 at logp == prox
    assert torch.allclose(loss, expected)
    assert m["importance_clipped_frac"] == pytest.approx(1 / float(mask.sum()))
    loss.backward()
    # the behaviour weight scales the gradient of its token
    assert torch.allclose(lp.grad[1, 3], -2.0 * adv[1, 3] / mask.sum())


def test_the_batch_must_carry_the_proximal_logprobs():
    logp, adv, mask = _data()
    with pytest.raises(ConfigError, match="prox_logprobs"):
        decoupled_policy_loss(
            {"logprobs": logp}, {"old_logprobs": logp, "advantages": adv, "response_mask": mask}
        )


def test_behaviour_kl_is_zero_on_policy_and_measures_how_far_the_weights_moved():
    logp, adv, mask = _data()
    _, on = decoupled_policy_objective(logp, logp, logp, adv, mask)
    assert on["behaviour_kl"] == 0.0
    shift = 0.3 * torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    behav = logp - shift  # log w = prox - behav = shift
    _, m = decoupled_policy_objective(logp, logp, behav, adv, mask)
    w = torch.exp(shift)
    expected = float(((w - 1 - shift) * mask).sum() / mask.sum())
    assert m["behaviour_kl"] == pytest.approx(expected, rel=1e-5) and expected > 0
    _, far = decoupled_policy_objective(logp, logp, logp - 2 * shift, adv, mask)
    assert far["behaviour_kl"] > m["behaviour_kl"]


def test_the_forward_as_proximal_policy_gives_the_recomputed_loss_and_gradient():
    """One optimizer step on the weights the forward ran with: pi_prox recomputed by a
    separate pass equals the forward's own log-probs, so both ways give one loss and one
    gradient; a batch without prox_logprobs is refused unless the forward is the proximal."""
    logp, adv, mask = _data(3)
    behav = logp - 0.3 * torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    batch = {"old_logprobs": behav, "advantages": adv, "response_mask": mask}
    grads = []
    for proximal in ("batch", "forward"):
        theta = logp.clone().requires_grad_(True)
        b = dict(batch, prox_logprobs=logp.clone()) if proximal == "batch" else dict(batch)
        loss, metrics = decoupled_policy_loss(
            {"logprobs": theta}, b, importance_cap=2.0, proximal=proximal
        )
        loss.backward()
        grads.append((loss.item(), theta.grad.clone(), metrics["importance_weight_mean"]))
    assert grads[0][0] == pytest.approx(grads[1][0])
    assert torch.allclose(grads[0][1], grads[1][1]) and grads[0][1].abs().sum() > 0
    assert grads[0][2] == pytest.approx(grads[1][2])
    with pytest.raises(ConfigError, match="prox_logprobs"):
        decoupled_policy_loss({"logprobs": logp}, batch)
    with pytest.raises(ConfigError, match="proximal"):
        decoupled_policy_loss({"logprobs": logp}, batch, proximal="later")
