"""One RL step of GRPO, PPO and ReMax over model-stages.

Each algorithm is a short async function over a ``ModelStages`` (``nereus.rl.stages``):
generate -> score (rule reward or reward model, reference logprobs, critic values) -> advantages ->
train -> weight sync. The three differ only in how they sample and how they turn
scores into advantages:

- GRPO: ``k`` samples per prompt; advantage = score normalised within its group;
  KL to the reference as a loss term (``kl_mode = "loss"``) or a reward penalty.
- ReMax: ``k`` samples plus one greedy response per prompt; advantage = score minus
  the greedy response's score.
- PPO: a critic; per-token rewards (score on the last token, minus the KL penalty when
  ``kl_mode = "penalty"``), GAE over the critic's values, whitened advantages; the
  critic is trained with the clipped value loss.

Every step returns a flat record (``nereus.job.report``): stage times, reward and length
statistics, the policy version of the rollouts, and the losses' metrics. Sampling is
seeded from ``(run.seed, step)``, so a step's rollouts depend only on the weights and the
step number: what makes resume exact. With ``StepContext.lengths`` (a job's ``[trace]
lengths``) every response is generated to its own drawn length.

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nereus.config import require
from nereus.data.tasks import Sample, Task
from nereus.data.vocab import Codec
from nereus.rl.advantages import (
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_whiten,
    remax_advantages,
    token_rewards,
)
from nereus.rl.losses import value_loss
from nereus.rl.rollout import Rollouts, SamplingConfig, to_batch
from nereus.rl.stages import ModelStages

__all__ = [
    "AlgorithmConfig",
    "StepContext",
    "ALGORITHMS",
    "grpo_step",
    "ppo_step",
    "remax_step",
    "action_values",
    "critic_loss",
    "critic_loss_kwargs",
    "grpo_token_advantages",
    "policy_loss_kwargs",
    "ppo_targets",
    "remax_token_advantages",
    "sampling_seed",
    "train_epochs",
]


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL algorithm and its coefficients.

    ``kl_mode``: ``loss`` adds ``kl_coef * KL`` to the policy loss (GRPO's way),
    ``penalty`` subtracts it from the per-token rewards (PPO's way)."""

    name: Literal["grpo", "ppo", "remax"] = "grpo"
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["loss", "penalty"] = "loss"
    scale_by_std: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    whiten_advantages: bool = True
    epochs: int = 1
    aggregation: Literal["token-mean", "seq-mean"] = "token-mean"

    def __post_init__(self) -> None:
        require(
            self.name in ("grpo", "ppo", "remax"),
            "algorithm.name",
            self.name,
            "must be 'grpo', 'ppo' or 'remax'",
        )
        require(
            self.prompts_per_step >= 1,
            "algorithm.prompts_per_step",
            self.prompts_per_step,
            "must be >= 1",
        )
        if self.name == "grpo":
            require(
                self.samples_per_prompt >= 2,
                "algorithm.samples_per_prompt",
                self.samples_per_prompt,
                "must be >= 2 for grpo",
            )
        else:
            require(
                self.samples_per_prompt >= 1,
                "algorithm.samples_per_prompt",
                self.samples_per_prompt,
                "must be >= 1",
            )
        require(0 <= self.clip_eps < 1, "algorithm.clip_eps", self.clip_eps, "must be in [0, 1)")
        require(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, "must be >= 0")
        require(0 < self.gamma <= 1, "algorithm.gamma", self.gamma, "must be in (0, 1]")
        require(0 <= self.lam <= 1, "algorithm.lam", self.lam, "must be in [0, 1]")
        require(self.value_clip >= 0, "algorithm.value_clip", self.value_clip, "must be >= 0")
        require(self.epochs >= 1, "algorithm.epochs", self.epochs, "must be >= 1")

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


POLICY_LOSS = "nereus.rl.losses:policy_loss"
CRITIC_LOSS = "nereus.rl.algorithms:critic_loss"


@dataclass
class StepContext:
    """What a step needs besides its samples: the job's algorithm and sampling settings,
    its seed and whether a reward model (rather than the task's rule) scores rollouts.
    ``lengths(step, sample_indices, k)``: every response's length, ``k`` rows per sample
    in order (``nereus.job.traces.response_lengths``; None: the cap, or end-of-sequence)."""

    algorithm: AlgorithmConfig
    sampling: SamplingConfig
    seed: int
    reward_model: bool
    task: Task
    codec: Codec
    stages: ModelStages
    step: int
    lengths: Callable[[int, list[int], int], list[int]] | None = None


def sampling_seed(run_seed: int, step: int) -> int:
    return (run_seed * 1_000_003 + step * 7_919) % (2**31 - 1)


def action_values(values: torch.Tensor) -> torch.Tensor:
    """``values`` shifted right by one token: the value of the state before each token."""
    return torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)


def critic_loss(
    outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], **kwargs: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss on action-aligned values (see the module docstring)."""
    return value_loss({"values": action_values(outputs["values"])}, batch, **kwargs)


@contextmanager
def _timed(record: dict[str, Any], key: str) -> Iterator[None]:
    """Adds the seconds spent in the block to ``record[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        record[key] = record.get(key, 0.0) + time.perf_counter() - t0


async def _generate(
    ctx: StepContext, samples: list[Sample], k: int, greedy: bool = False
) -> Rollouts:
    sampling = ctx.sampling
    prompts: list[list[int]] = []
    index: list[int] = []
    for s in samples:
        ids = ctx.task.prompt_ids(s, ctx.codec)
        prompts += [ids] * k
        index += [s.index] * k
    params = {
        "max_tokens": sampling.cap_at(ctx.step),
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop_token_ids": [] if sampling.ignore_eos else [ctx.codec.eos_id],
        "seed": sampling_seed(ctx.seed, ctx.step),
    }
    if ctx.lengths is not None:
        params["row_max_tokens"] = ctx.lengths(ctx.step, [s.index for s in samples], k)
    out = await ctx.stages.generate(prompts, params)
    rollouts = Rollouts(prompts, out["token_ids"], out["logprobs"], index, out["policy_version"])
    rollouts.texts = [ctx.codec.decode(r) for r in rollouts.response_ids]
    by_index = {s.index: s for s in samples}
    rollouts.scores = [
        ctx.task.reward(by_index[i], t) for i, t in zip(index, rollouts.texts, strict=True)
    ]
    return rollouts


async def _score(
    ctx: StepContext,
    record: dict[str, Any],
    rollouts: Rollouts,
    batch: dict[str, torch.Tensor] | None = None,
) -> None:
    """Replace the rule scores with the reward model's when the job uses one (``batch``:
    the rollouts' training batch, when the step already built it)."""
    if not ctx.reward_model:
        return
    with _timed(record, "score_seconds"):
        scores = await ctx.stages.reward_scores(
            batch if batch is not None else to_batch(rollouts, ctx.codec.pad_id)
        )
    rollouts.task_scores, rollouts.scores = rollouts.scores, [float(x) for x in scores.tolist()]


def _base_record(ctx: StepContext, rollouts: Rollouts) -> dict[str, Any]:
    scores = rollouts.scores
    lengths = rollouts.response_lengths
    task = (
        {"task_reward_mean": statistics.fmean(rollouts.task_scores)} if rollouts.task_scores else {}
    )
    return {
        **task,
        "step": ctx.step,
        "reward_mean": statistics.fmean(scores),
        "reward_std": statistics.pstdev(scores),
        "reward_max": max(scores),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_p95": sorted(lengths)[
            min(len(lengths) - 1, math.ceil(0.95 * len(lengths)) - 1)
        ],
        "response_len_max": max(lengths),
        "prompt_len_max": max(len(p) for p in rollouts.prompt_ids),
        "policy_version": min(rollouts.policy_version),
        "rollouts": len(rollouts),
        "tokens_generated": sum(lengths),
    }


def policy_loss_kwargs(a: AlgorithmConfig) -> dict[str, Any]:
    """The policy loss's coefficients (the KL term only with ``kl_mode = "loss"``)."""
    in_loss = a.kl_mode == "loss" and a.kl_coef > 0
    return {
        "clip_eps": a.clip_eps,
        "kl_coef": a.kl_coef if in_loss else 0.0,
        "kl_kind": a.kl_kind,
        "aggregation": a.aggregation,
    }


def critic_loss_kwargs(a: AlgorithmConfig) -> dict[str, Any]:
    """The critic's value loss coefficients."""
    return {"value_clip": a.value_clip, "aggregation": a.aggregation}


async def train_epochs(
    stages: ModelStages,
    a: AlgorithmConfig,
    batch: dict[str, torch.Tensor],
    policy_loss: str,
    policy_kwargs: dict[str, Any],
    critic: bool = False,
) -> dict[str, float]:
    """``a.epochs`` passes over ``batch``: the policy with ``policy_loss``, then (``critic``)
    the critic with its value loss; the last pass's numeric metrics, the engine's update
    counter named ``updates`` ("step" is the RL step)."""
    metrics: dict[str, float] = {}
    for _ in range(a.epochs):
        metrics = await stages.train_policy(batch, policy_loss, policy_kwargs)
        if critic:
            metrics.update(await stages.train_critic(batch, CRITIC_LOSS, critic_loss_kwargs(a)))
    return {
        ("updates" if k == "step" else k): v
        for k, v in metrics.items()
        if isinstance(v, (int, float))
    }


def grpo_token_advantages(
    a: AlgorithmConfig, scores: list[float], batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """GRPO's per-token advantages of ``batch`` (groups of ``a.samples_per_prompt`` rows,
    group after group): each score, less ``kl_coef`` times its row's summed KL when
    ``kl_mode = "penalty"`` (``old_logprobs`` against ``ref_logprobs``), normalised within
    its group."""
    mask = batch["response_mask"]
    seq = torch.tensor(scores, dtype=torch.float32)
    if a.kl_mode == "penalty" and a.kl_coef > 0:
        # KL as a penalty: in the sequence's reward, before the group normalisation.
        kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], a.kl_kind) * mask
        seq = seq - a.kl_coef * kl.sum(dim=1)
    adv = grpo_advantages(seq, a.samples_per_prompt, a.scale_by_std)
    return broadcast_to_tokens(adv, mask)


def remax_token_advantages(
    scores: list[float], greedy_scores: list[float], batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """ReMax's per-token advantages of ``batch``: each row's score less the greedy score
    of its prompt (``greedy_scores`` one per prompt, rows laid out prompt after prompt)."""
    per_prompt = len(scores) // max(1, len(greedy_scores))
    require(
        per_prompt * len(greedy_scores) == len(scores),
        "greedy_scores",
        len(greedy_scores),
        f"must divide the {len(scores)} scores (one greedy response per prompt)",
    )
    baseline = torch.tensor(greedy_scores, dtype=torch.float32).repeat_interleave(per_prompt)
    adv = remax_advantages(torch.tensor(scores, dtype=torch.float32), baseline)
    return broadcast_to_tokens(adv, batch["response_mask"])


def ppo_targets(
    a: AlgorithmConfig,
    scores: list[float],
    batch: dict[str, torch.Tensor],
    values: torch.Tensor,
) -> float:
    """PPO's targets into ``batch`` from the critic's ``values`` of it: ``old_values``
    (action-aligned), ``advantages`` (GAE over per-token rewards: the score on the last
    token, less the KL penalty with ``kl_mode = "penalty"``; whitened if asked) and
    ``returns``. Returns the mean value over response tokens."""
    mask = batch["response_mask"]
    old_values = action_values(values.float()) * mask
    kl = None
    if a.kl_mode == "penalty" and a.kl_coef > 0:
        kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], a.kl_kind)
    rewards = token_rewards(torch.tensor(scores, dtype=torch.float32), mask, kl, a.kl_coef)
    adv, returns = gae(rewards, old_values, mask, a.gamma, a.lam)
    if a.whiten_advantages:
        adv = masked_whiten(adv, mask)
    batch.update({"advantages": adv, "returns": returns, "old_values": old_values})
    return float((old_values * mask).sum() / mask.sum().clamp(min=1))


async def _train_and_sync(
    ctx: StepContext, batch: dict[str, torch.Tensor], record: dict[str, Any], critic: bool = False
) -> None:
    a = ctx.algorithm
    with _timed(record, "train_seconds"):
        record.update(
            await train_epochs(ctx.stages, a, batch, POLICY_LOSS, policy_loss_kwargs(a), critic)
        )
    with _timed(record, "sync_seconds"):
        sync = await ctx.stages.sync_policy()
    record["sync_bytes"] = sync.get("bytes", 0)
    record["sync_gbps"] = sync.get("gbps", 0.0)


async def _reference(
    ctx: StepContext, record: dict[str, Any], batch: dict[str, torch.Tensor]
) -> None:
    if ctx.algorithm.kl_coef > 0:
        with _timed(record, "score_seconds"):
            batch["ref_logprobs"] = await ctx.stages.reference_logprobs(batch)


async def grpo_step(ctx: StepContext, samples: list[Sample]) -> dict[str, Any]:
    a = ctx.algorithm
    record: dict[str, Any] = {}
    with _timed(record, "generate_seconds"):
        rollouts = await _generate(ctx, samples, a.samples_per_prompt)
    batch = to_batch(rollouts, ctx.codec.pad_id)
    await _score(ctx, record, rollouts, batch)
    await _reference(ctx, record, batch)
    batch["advantages"] = grpo_token_advantages(a, rollouts.scores, batch)
    await _train_and_sync(ctx, batch, record)
    return {**_base_record(ctx, rollouts), **record}


async def remax_step(ctx: StepContext, samples: list[Sample]) -> dict[str, Any]:
    a = ctx.algorithm
    record: dict[str, Any] = {}
    with _timed(record, "generate_seconds"):
        rollouts = await _generate(ctx, samples, a.samples_per_prompt)
    with _timed(record, "generate_seconds"):
        greedy = await _generate(ctx, samples, 1, greedy=True)
    batch = to_batch(rollouts, ctx.codec.pad_id)
    await _score(ctx, record, rollouts, batch)
    await _score(ctx, record, greedy)
    await _reference(ctx, record, batch)
    batch["advantages"] = remax_token_advantages(rollouts.scores, greedy.scores, batch)
    record["greedy_reward_mean"] = statistics.fmean(greedy.scores)
    await _train_and_sync(ctx, batch, record)
    return {**_base_record(ctx, rollouts), **record}


async def ppo_step(ctx: StepContext, samples: list[Sample]) -> dict[str, Any]:
    a = ctx.algorithm
    record: dict[str, Any] = {}
    with _timed(record, "generate_seconds"):
        rollouts = await _generate(ctx, samples, a.samples_per_prompt)
    batch = to_batch(rollouts, ctx.codec.pad_id)
    await _score(ctx, record, rollouts, batch)
    await _reference(ctx, record, batch)
    with _timed(record, "score_seconds"):
        values = await ctx.stages.critic_values(batch)
    record["value_mean"] = ppo_targets(a, rollouts.scores, batch, values)
    await _train_and_sync(ctx, batch, record, critic=True)
    return {**_base_record(ctx, rollouts), **record}


ALGORITHMS: dict[str, Callable[[StepContext, list[Sample]], Awaitable[dict[str, Any]]]] = {
    "grpo": grpo_step,
    "ppo": ppo_step,
    "remax": remax_step,
}
