"""Advantage and KL math of PPO, GRPO and ReMax as pure torch functions.

Tensors are per response token: shape ``[B, T]`` with a float ``mask`` (1 on response
tokens, 0 on prompt and padding); per-sequence scores are ``[B]``. Every function is
pure (no state, no randomness, no in-place change of its inputs) and works in
float32 or float64.

- ``kl_estimate``: per-token KL(policy || reference) estimators from logprobs: ``k1``
  (``logp - ref``, unbiased, can be negative), ``k2`` (``(logp - ref)^2 / 2``) and
  ``k3`` (``exp(ref - logp) - (ref - logp) - 1``, unbiased and >= 0; Schulman's).
- ``token_rewards``: the score on each sequence's last response token, minus
  ``kl_coef * kl`` on every response token (KL *as a penalty* in the reward).
- ``gae``: generalised advantage estimation and returns over masked tokens.
- ``grpo_advantages``: scores normalised within each group of ``k`` samples of the
  same prompt (mean removed, optionally divided by the group's std).
- ``remax_advantages``: the score minus the score of the greedy response to the
  same prompt (ReMax's baseline).

Refuses (``ValueError`` via ``ConfigError``): shapes that disagree, a group size that
does not divide the number of scores, unknown estimator names.
"""

from __future__ import annotations

from typing import Literal

import torch

from nereus.config import require

__all__ = [
    "KLKind",
    "masked_mean",
    "masked_whiten",
    "kl_estimate",
    "token_rewards",
    "gae",
    "grpo_advantages",
    "remax_advantages",
    "broadcast_to_tokens",
]

KLKind = Literal["k1", "k2", "k3"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 if the mask is empty)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``x`` scaled to unit variance (and zero mean if ``shift_mean``) over the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs."""
    require(
        logprobs.shape == ref_logprobs.shape,
        "ref_logprobs.shape",
        tuple(ref_logprobs.shape),
        f"must equal logprobs.shape={tuple(logprobs.shape)}",
    )
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        # Clamp keeps exp() finite when the two policies disagree wildly early on.
        neg = (-log_ratio).clamp(min=-20.0, max=20.0)
        return torch.exp(neg) - neg - 1.0
    require(False, "kl_kind", kind, "must be 'k1', 'k2' or 'k3'")
    raise AssertionError  # unreachable


def _last_index(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards: ``score`` on the last response token of each row, minus
    ``kl_coef * kl`` on every response token. Rows with an empty mask get nothing."""
    require(
        scores.shape == (mask.shape[0],),
        "scores.shape",
        tuple(scores.shape),
        f"must be ({mask.shape[0]},)",
    )
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    last = _last_index(mask)
    rows = torch.nonzero(last >= 0).flatten()
    rewards[rows, last[rows]] = scores[rows]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.to(rewards.dtype) * mask
    return rewards


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both ``[B, T]`` and zero off the mask.

    The value after the last response token is 0 (the episode ends there); masked
    positions inside a row are skipped, so left or right padding both work."""
    require(
        rewards.shape == values.shape == mask.shape,
        "values.shape",
        tuple(values.shape),
        f"must equal rewards.shape={tuple(rewards.shape)} and mask.shape={tuple(mask.shape)}",
    )
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        # Off-mask positions pass the running values through untouched.
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    returns = (adv + values) * mask
    return adv, returns


def grpo_advantages(
    scores: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each score minus its group's mean, divided by the group's std if asked.

    Scores are laid out group after group: rows ``[g*k, (g+1)*k)`` are the ``k``
    samples of prompt ``g``. A group whose samples all score the same gets 0."""
    n = scores.shape[0]
    require(
        group_size >= 1 and n % group_size == 0,
        "group_size",
        group_size,
        f"must be >= 1 and divide the number of scores {n}",
    )
    grouped = scores.reshape(n // group_size, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(n)


def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax: the score minus the greedy response's score for the same prompt."""
    require(
        scores.shape == greedy_scores.shape,
        "greedy_scores.shape",
        tuple(greedy_scores.shape),
        f"must equal scores.shape={tuple(scores.shape)}",
    )
    return scores - greedy_scores


def broadcast_to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence value ``[B]`` copied onto every response token ``[B, T]``."""
    require(
        per_sequence.shape == (mask.shape[0],),
        "per_sequence.shape",
        tuple(per_sequence.shape),
        f"must be ({mask.shape[0]},)",
    )
    return per_sequence[:, None].to(mask.dtype) * mask
