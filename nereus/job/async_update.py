"""One update of asynchronous RL, per algorithm: finished buffer entries in, the policy (and
PPO's critic) trained on policy-training's side.

Buffer entries (``nereus.rl.async_buffer.Group``), in the unit ``EntryShape.of`` gives:

- GRPO: an entry is one prompt's group of ``k`` samples; entry n is the n-th prompt of the
  global sample order.
- ReMax: an entry is one prompt's ``k`` samples and its greedy baseline row, decoded in the
  same request on the same generation EMU (temperature 0 for that row only,
  ``SteppedRollout(greedy_rows=...)``) and released when all ``k + 1`` rows are done. The
  baseline's tokens carry versions and count for staleness like any token (the deadline
  and the commit's bound): its score is in every advantage of the entry, so a stale
  baseline is a stale gradient. It is never trained on and is not in the histogram of
  trained tokens.
- PPO: an entry is one sample: entry e is sample ``e mod k`` of prompt ``e // k`` (k may be
  1), so an update takes ``prompts_per_step * k`` entries. PPO's advantages are per sample,
  so a prompt's samples may train in different updates (a straggler carried), each once.

The loop (``nereus.job.async_loop``) issues entries through the ledger in that unit, so the
gate, the straggler rule and batch formation (entries in order, stragglers carried) are
the GRPO rules unchanged.

``train_entries`` runs one update over a batch of entries (their trained rows in entry
order), with the synchronous steps' math (``nereus.rl.algorithms``, not a copy):

1. the proximal log-probs (policy-training's weights now: with one epoch, the training
   forward's own, detached, since the update is one optimizer step on the weights that
   forward runs with; with more, a separate forward first) and, with ``kl_coef > 0``, the
   reference's (reference-inference);
2. advantages: GRPO, each score normalised in its group; ReMax, each score less its
   prompt's greedy score; PPO, the critic's values of the batch now (critic-inference,
   on the training side), per-token rewards, GAE with the job's ``gamma``/``lam``,
   whitened, and returns. A KL ``penalty`` reads the behaviour log-probs against the
   reference, as sync mode reads its rollouts' log-probs;
3. ``algorithm.epochs`` passes: the policy with the decoupled objective
   (``nereus.rl.decoupled``: behaviour log-probs recorded per token at generation, a KL
   ``loss`` term in it), then for PPO the critic with its clipped value loss (its weights
   then go to critic-inference, ``ClusterStages.train_critic``).

Scores are the task's rule, computed when an entry is released.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from nereus.job.cluster_stages import ClusterStages
from nereus.rl.algorithms import (
    AlgorithmConfig,
    grpo_token_advantages,
    policy_loss_kwargs,
    ppo_targets,
    remax_token_advantages,
    train_epochs,
)
from nereus.rl.async_buffer import Group
from nereus.rl.decoupled import DECOUPLED_LOSS
from nereus.rl.rollout import Rollouts, to_batch

__all__ = ["EntryShape", "entry_rollouts", "train_entries", "update_record"]


@dataclass(frozen=True)
class EntryShape:
    """What one buffer entry holds (see the module docstring)."""

    per_prompt: int  # entries per prompt of the global sample order
    samples: int  # sampled (trained) rows per entry
    baseline: bool  # a greedy baseline row per entry

    @classmethod
    def of(cls, a: AlgorithmConfig) -> EntryShape:
        if a.name == "ppo":
            return cls(a.samples_per_prompt, 1, False)
        return cls(1, a.samples_per_prompt, a.name == "remax")

    def prompt(self, entry: int) -> int:
        """The position, in the global sample order, of ``entry``'s prompt."""
        return entry // self.per_prompt

    def prompts_before(self, entry: int) -> int:
        """Prompts of which some entry below ``entry`` was issued (the dataset position)."""
        return -(-entry // self.per_prompt)


def entry_rollouts(groups: list[Group]) -> Rollouts:
    """The trained rows of ``groups`` in entry order (baseline rows left out), each row's
    policy version that of its oldest token, scores set."""
    rollouts = Rollouts(
        [g.prompt_ids for g in groups for _ in range(g.rows)],
        [r for g in groups for r in g.response_ids],
        [lp for g in groups for lp in g.logprobs],
        [g.sample_index for g in groups for _ in range(g.rows)],
        [min(v, default=g.start_version) for g in groups for v in g.versions],
    )
    rollouts.scores = [s for g in groups for s in g.scores]
    return rollouts


async def train_entries(
    stages: ClusterStages,
    a: AlgorithmConfig,
    groups: list[Group],
    pad_id: int,
    importance_cap: float,
) -> tuple[Rollouts, dict[str, Any]]:
    """One update over ``groups`` (see the module docstring); returns their rollouts and
    the update's metrics (``train_seconds`` the whole of it)."""
    t0 = time.perf_counter()
    rollouts = entry_rollouts(groups)
    batch = to_batch(rollouts, pad_id)
    record: dict[str, Any] = {}
    # One epoch is one optimizer step on the weights every micro-batch's forward runs
    # with: that forward's log-probs are the proximal policy's, exactly; a separate pass
    # is needed only when later epochs run on updated weights.
    proximal = "forward" if a.epochs == 1 else "batch"
    if proximal == "batch":
        batch["prox_logprobs"] = await stages.proximal_logprobs(batch)
    if a.kl_coef > 0:
        batch["ref_logprobs"] = await stages.reference_logprobs(batch)
    if a.name == "grpo":
        batch["advantages"] = grpo_token_advantages(a, rollouts.scores, batch)
    elif a.name == "remax":
        greedy = [g.baseline_score for g in groups]
        batch["advantages"] = remax_token_advantages(rollouts.scores, greedy, batch)
        record["greedy_reward_mean"] = statistics.fmean(greedy)
    else:
        values = await stages.critic_values(batch)
        record["value_mean"] = ppo_targets(a, rollouts.scores, batch, values)
    kw = {**policy_loss_kwargs(a), "importance_cap": importance_cap, "proximal": proximal}
    record.update(await train_epochs(stages, a, batch, DECOUPLED_LOSS, kw, critic=a.name == "ppo"))
    record["train_seconds"] = time.perf_counter() - t0
    return rollouts, record


def update_record(rollouts: Rollouts, groups: list[Group]) -> dict[str, Any]:
    """An update's reward, length and order figures (the job's record fields)."""
    lengths = rollouts.response_lengths
    return {
        "reward_mean": statistics.fmean(rollouts.scores),
        "reward_std": statistics.pstdev(rollouts.scores),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_max": max(lengths),
        "tokens_generated": sum(lengths),
        "rollouts": len(rollouts),
        "positions": [g.position for g in groups],
        "policy_version": min(rollouts.policy_version),
    }
