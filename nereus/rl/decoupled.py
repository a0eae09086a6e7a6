"""The decoupled PPO objective for off-policy (asynchronous) rollouts.

Form (Hilton, Cobbe, Schulman 2022, "Batch size-invariance for policy optimization",
the decoupled PPO objective; the form AReaL trains with): with pi_behav the policy that
generated each token (its log-probability recorded at generation, per token: under
partial rollouts one sequence mixes versions), pi_prox a *proximal* policy recomputed
at training (the weights about to be updated), and pi_theta the policy being optimised,

    L = - E_t[ w_t * min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t) ]
    r_t = pi_theta(a_t) / pi_prox(a_t)       (the trust region is around pi_prox)
    w_t = min(pi_prox(a_t) / pi_behav(a_t), cap)   (behaviour correction, truncated,
                                                    no gradient)

so a stale sample is corrected by ``w`` while PPO's clip still bounds the step from the
current weights. With on-policy tokens (pi_behav = pi_prox) it is PPO's clipped
surrogate. ``w`` is truncated at ``importance_cap`` as verl's and AReaL's truncated
importance sampling do.

The batch holds ``old_logprobs`` (behaviour, from generation), ``prox_logprobs``
(recomputed), ``advantages``, ``response_mask`` and, for a KL loss, ``ref_logprobs``.
Metrics: ``importance_weight_mean`` (of the untruncated weight over response tokens),
``importance_clipped_frac`` (tokens whose weight was truncated), ``behaviour_kl`` (the k3
estimate of KL(pi_behav || pi_prox) per response token: how far the weights moved since
the tokens were generated), ``clip_frac``. The weight's mean is 1 in expectation however
stale the tokens are (E_behav[pi_prox / pi_behav] = 1), so it shows only sampling noise;
``behaviour_kl`` is 0 on-policy and grows with staleness and step size.

Refuses (``ConfigError``): missing batch keys (named), a cap below 1.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from nereus.config import require
from nereus.rl.advantages import KLKind, kl_estimate, masked_mean
from nereus.rl.losses import Aggregation, aggregate

__all__ = [
    "DECOUPLED_LOSS",
    "decoupled_policy_objective",
    "decoupled_policy_loss",
    "importance_weights",
]

DECOUPLED_LOSS = "nereus.rl.decoupled:decoupled_policy_loss"


def importance_weights(
    prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated weights ``min(pi_prox / pi_behav, cap)``, mask of truncated tokens)."""
    require(cap >= 1, "importance_cap", cap, "must be >= 1")
    raw = torch.exp((prox_logprobs - behav_logprobs).clamp(max=20.0))
    return raw.clamp(max=cap), raw > cap


def decoupled_policy_objective(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    importance_cap: float = 5.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled objective of the module docstring (negated, to minimise)."""
    require(clip_eps >= 0, "clip_eps", clip_eps, "must be >= 0")
    with torch.no_grad():
        raw = torch.exp((prox_logprobs - behav_logprobs).clamp(max=20.0))
        weight, truncated = importance_weights(prox_logprobs, behav_logprobs, importance_cap)
    ratio = torch.exp((logprobs - prox_logprobs).clamp(max=20.0))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -weight * torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        metrics = {
            "policy_loss": float(loss.detach()),
            "clip_frac": float(masked_mean((unclipped > clipped).to(logprobs.dtype), mask)),
            "importance_weight_mean": float(masked_mean(raw, mask)),
            "importance_clipped_frac": float(masked_mean(truncated.to(logprobs.dtype), mask)),
            "behaviour_kl": float(masked_mean(kl_estimate(behav_logprobs, prox_logprobs), mask)),
            "approx_kl_old": float(masked_mean(0.5 * (logprobs - prox_logprobs) ** 2, mask)),
        }
    if ref_logprobs is not None and kl_coef:
        kl = aggregate(kl_estimate(logprobs, ref_logprobs, kl_kind), mask, aggregation)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = float(kl.detach())
    return loss, metrics


def _need(batch: dict[str, Any], key: str) -> torch.Tensor:
    require(key in batch, "decoupled_policy_loss.batch", sorted(batch), f"must contain {key!r}")
    return batch[key]


def decoupled_policy_loss(
    outputs: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    clip_eps: float = 0.2,
    importance_cap: float = 5.0,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    aggregation: Aggregation = "token-mean",
    proximal: Literal["batch", "forward"] = "batch",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training engine's entry point (``DECOUPLED_LOSS``), reading the batch.
    ``proximal = "forward"``: pi_prox is this forward's own log-probabilities (detached),
    exact when the update is one optimizer step on the weights the forward ran with (one
    epoch: every micro-batch's forward sees the weights before the step), so the batch
    needs no ``prox_logprobs`` and no separate forward computes them."""
    require(proximal in ("batch", "forward"), "proximal", proximal, "must be 'batch' or 'forward'")
    logprobs = _need(outputs, "logprobs")
    dt = logprobs.dtype
    ref = _need(batch, "ref_logprobs").to(dt) if kl_coef else None
    prox = logprobs.detach() if proximal == "forward" else _need(batch, "prox_logprobs").to(dt)
    return decoupled_policy_objective(
        logprobs,
        prox,
        _need(batch, "old_logprobs").to(dt),
        _need(batch, "advantages").to(dt),
        _need(batch, "response_mask").to(dt),
        clip_eps=clip_eps,
        importance_cap=importance_cap,
        ref_logprobs=ref,
        kl_coef=kl_coef,
        kl_kind=kl_kind,
        aggregation=aggregation,
    )
