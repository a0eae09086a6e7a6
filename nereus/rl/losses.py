"""Policy and value losses of PPO, GRPO and ReMax, in the shape the training engine calls.

The training engine resolves a loss by import path (``"nereus.rl.losses:policy_loss"``)
inside the worker and calls it once per micro-batch as
``loss_fn(outputs, batch, **loss_kwargs) -> (loss, metrics)`` where ``outputs`` holds the
model's per-token ``logprobs`` (policy) or ``values`` (critic), ``[B, T]`` aligned with
``batch["input_ids"]``, and ``batch`` holds the tensors the RL step put in it:

- ``response_mask`` ``[B, T]``: 1 on response tokens (the only tokens with a loss);
- policy: ``old_logprobs``, ``advantages`` and, for KL as a loss, ``ref_logprobs``;
- critic: ``old_values`` and ``returns``.

``loss`` is a scalar tensor with a graph; ``metrics`` maps names to floats. The mean is
over response tokens of the micro-batch (``token-mean``) or of per-sequence token means
(``seq-mean``); the engine averages over gradient-accumulation steps.

The pure functions ``clipped_policy_objective`` and ``clipped_value_objective`` do the
math and are what the tests pin down; the ``*_loss`` functions only read the batch.

Refuses (``ConfigError``): unknown aggregation or KL estimator names, a negative clip
range, missing batch keys (named).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from nereus.config import require
from nereus.rl.advantages import KLKind, kl_estimate, masked_mean

__all__ = [
    "Aggregation",
    "aggregate",
    "clipped_policy_objective",
    "clipped_value_objective",
    "policy_loss",
    "value_loss",
]

Aggregation = Literal["token-mean", "seq-mean"]


def aggregate(x: torch.Tensor, mask: torch.Tensor, how: Aggregation = "token-mean") -> torch.Tensor:
    """Scalar mean of per-token ``x`` over the mask: over all tokens, or per sequence."""
    if how == "token-mean":
        return masked_mean(x, mask)
    if how == "seq-mean":
        per_seq = masked_mean(x, mask, dim=1)
        has_tokens = (mask.sum(dim=1) > 0).to(x.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    require(False, "aggregation", how, "must be 'token-mean' or 'seq-mean'")
    raise AssertionError  # unreachable


def clipped_policy_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (negated, to minimise), plus ``kl_coef * KL`` to the
    reference when ``ref_logprobs`` is given (KL *as a loss*, GRPO's way).

    ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` per token with ``r = exp(logp - old)``."""
    require(clip_eps >= 0, "clip_eps", clip_eps, "must be >= 0")
    ratio = torch.exp((logprobs - old_logprobs).clamp(max=20.0))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        clip_frac = masked_mean((unclipped > clipped).to(logprobs.dtype), mask)
        approx_kl_old = masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask)
    metrics = {
        "policy_loss": float(loss.detach()),
        "clip_frac": float(clip_frac),
        "approx_kl_old": float(approx_kl_old),
    }
    if ref_logprobs is not None and kl_coef:
        kl = aggregate(kl_estimate(logprobs, ref_logprobs, kl_kind), mask, aggregation)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = float(kl.detach())
    return loss, metrics


def clipped_value_objective(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.2,
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Value loss ``0.5 * max((v - R)^2, (v_clipped - R)^2)`` where ``v_clipped`` stays
    within ``clip_range`` of the old value (PPO's value clipping); no clip if None."""
    err = (values - returns) ** 2
    if clip_range is not None:
        require(clip_range >= 0, "value_clip", clip_range, "must be >= 0 or None")
        v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err = torch.maximum(err, (v_clipped - returns) ** 2)
    loss = 0.5 * aggregate(err, mask, aggregation)
    with torch.no_grad():
        explained = masked_mean((values - returns) ** 2, mask)
    return loss, {"value_loss": float(loss.detach()), "value_mse": float(explained)}


def _need(batch: dict[str, Any], key: str, loss: str) -> torch.Tensor:
    require(key in batch, f"{loss}.batch", sorted(batch), f"must contain {key!r}")
    return batch[key]


def policy_loss(
    outputs: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of PPO, GRPO and ReMax (they differ only in their advantages).

    KL to the reference is a loss term when ``kl_coef > 0`` (the batch must then hold
    ``ref_logprobs``); PPO's KL *penalty* lives in the rewards instead (kl_coef=0 here)."""
    logprobs = _need(outputs, "logprobs", "policy_loss")
    mask = _need(batch, "response_mask", "policy_loss").to(logprobs.dtype)
    ref = _need(batch, "ref_logprobs", "policy_loss") if kl_coef else None
    return clipped_policy_objective(
        logprobs,
        _need(batch, "old_logprobs", "policy_loss").to(logprobs.dtype),
        _need(batch, "advantages", "policy_loss").to(logprobs.dtype),
        mask,
        clip_eps=clip_eps,
        ref_logprobs=None if ref is None else ref.to(logprobs.dtype),
        kl_coef=kl_coef,
        kl_kind=kl_kind,
        aggregation=aggregation,
    )


def value_loss(
    outputs: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    value_clip: float | None = 0.2,
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped value loss (PPO)."""
    values = _need(outputs, "values", "value_loss")
    return clipped_value_objective(
        values,
        _need(batch, "old_values", "value_loss").to(values.dtype),
        _need(batch, "returns", "value_loss").to(values.dtype),
        _need(batch, "response_mask", "value_loss").to(values.dtype),
        clip_range=value_clip,
        aggregation=aggregation,
    )
