"""Rollouts: generated responses, their scores, and the training batch built from them.

A ``Rollouts`` holds, for every generated response, the prompt and response token ids,
the per-token log-probabilities the generation engine sampled them with, the score
(the rule reward, or the reward model's with the rule reward kept in ``task_scores``), the index of
the prompt's sample in the global order and the *policy version*
that generated it (the number of weight syncs the generation EMU had received), so a
rollout can always be traced to the weights that produced it.

``to_batch`` lays the rollouts out in the training engine's batch format
(``nereus.engines.losses``): ``input_ids`` ``[B, T]`` = prompt then response, right-padded;
``attention_mask``; ``response_mask`` (1 on response tokens); ``old_logprobs`` at the
response positions (``logprobs[b, t]`` is the log-probability of ``input_ids[b, t]``).
Per-token tensors the algorithms add later (advantages, returns, reference logprobs)
use the same ``[B, T]`` alignment.

``SamplingConfig.lengths`` (a ``TraceLengths``, set from ``[trace] lengths`` by
``nereus.job.traces.with_lengths``) holds each step's mean and longest response length of
a length log, scaled to the job's cap; each response's length is drawn from them.

Refuses (``ConfigError``): responses whose logprobs and token counts disagree, rows
whose lengths disagree across fields, trace lengths below one token or maxima below
their mean, trace lengths without ``ignore_eos`` or above the step's cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from nereus.config import require

__all__ = ["Rollouts", "SamplingConfig", "TraceLengths", "to_batch"]


@dataclass(frozen=True)
class TraceLengths:
    """Each step's response lengths from a length log, in tokens scaled to the job's cap:
    ``means[s]`` and, where the log gives it, ``maxima[s]``, the longest response of
    step ``s``; steps past the end keep the last. Every response of step ``s`` gets a
    length drawn from them (``nereus.sim.lengths``), at most the step's cap."""

    trace: str
    means: list[float]
    maxima: list[float] | None = None

    def __post_init__(self) -> None:
        require(
            len(self.means) >= 1 and all(m >= 1 for m in self.means),
            "sampling.lengths.means",
            self.means[:4],
            "must give at least one step, each >= 1 token",
        )
        if self.maxima is not None:
            require(
                len(self.maxima) == len(self.means)
                and all(x >= m for x, m in zip(self.maxima, self.means, strict=True)),
                "sampling.lengths.maxima",
                self.maxima[:4],
                f"must give each of the {len(self.means)} steps a maximum >= its mean",
            )

    def mean_at(self, step: int) -> float:
        return float(self.means[min(max(0, step), len(self.means) - 1)])

    def max_at(self, step: int) -> float | None:
        """Step ``step``'s longest response (None: the log gives none)."""
        if self.maxima is None:
            return None
        return float(self.maxima[min(max(0, step), len(self.maxima) - 1)])


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling of policy-generation."""

    max_new_tokens: int | list[list[int]] = 8
    """The length cap: a number of tokens, or a schedule ``[[step, cap], ...]`` (steps
    increasing from 0) whose cap holds from its step on, as caps are raised mid-run."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    """Generate exactly the cap (benchmarks: a fixed amount of work per step), or with
    ``lengths``, exactly each response's drawn length."""
    lengths: TraceLengths | None = None
    """Set from ``[trace] lengths`` (``nereus.job.traces``): each step's mean and longest
    response, which each response's length is drawn from (needs ``ignore_eos``)."""
    engine: Literal["builtin", "vllm"] = "builtin"
    """What runs policy-generation's EMUs: ``builtin`` (nereus's batched KV-cache sampler,
    on the worker's device) or ``vllm`` (one vLLM engine per EMU in the worker that holds
    its shards, weights written in place from them at start and after every weight
    sync; its KV cache holds the EMU's share of a step's rollouts at the model's full
    length, reserved in the device's ledger; needs vLLM importable in the workers,
    ``plan.policy_generation.pp = 1`` and ``cluster.mode`` ``local`` or ``connect``)."""

    def __post_init__(self) -> None:
        require(
            self.engine in ("builtin", "vllm"),
            "sampling.engine",
            self.engine,
            "must be 'builtin' or 'vllm'",
        )
        name = "sampling.max_new_tokens"
        if isinstance(self.max_new_tokens, int):
            require(self.max_new_tokens >= 1, name, self.max_new_tokens, "must be >= 1")
        else:
            sched = self.max_new_tokens
            require(
                len(sched) >= 1 and all(len(e) == 2 for e in sched),
                name,
                sched,
                "must be a number or a list of [step, cap] pairs",
            )
            steps = [e[0] for e in sched]
            require(
                steps[0] == 0 and all(a < b for a, b in zip(steps, steps[1:], strict=False)),
                name,
                sched,
                "must start at step 0 with steps strictly increasing",
            )
            require(all(e[1] >= 1 for e in sched), name, sched, "caps must be >= 1")
        require(self.temperature > 0, "sampling.temperature", self.temperature, "must be > 0")
        require(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        require(self.top_k >= 0, "sampling.top_k", self.top_k, "must be >= 0 (0 = off)")
        if self.lengths is not None:
            require(
                self.ignore_eos,
                "sampling.ignore_eos",
                self.ignore_eos,
                "must be true with sampling.lengths (responses run to their drawn length)",
            )
            over = [s for s, m in enumerate(self.lengths.means) if m > self.cap_at(s)]
            require(
                not over,
                "sampling.lengths.means",
                over[:4],
                "are steps whose mean exceeds sampling.max_new_tokens there (the cap bounds "
                "every drawn length)",
            )

    def cap_at(self, step: int) -> int:
        """The length cap of step ``step``."""
        if isinstance(self.max_new_tokens, int):
            return self.max_new_tokens
        return [cap for start, cap in self.max_new_tokens if start <= step][-1]

    @property
    def max_cap(self) -> int:
        """The largest cap the schedule ever sets."""
        if isinstance(self.max_new_tokens, int):
            return self.max_new_tokens
        return max(cap for _, cap in self.max_new_tokens)


@dataclass
class Rollouts:
    """Responses of one step, row-aligned (group after group for k samples per prompt)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    sample_index: list[int]
    policy_version: list[int]
    texts: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    task_scores: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        for name in ("response_ids", "logprobs", "sample_index", "policy_version"):
            require(
                len(getattr(self, name)) == n,
                f"Rollouts.{name}",
                len(getattr(self, name)),
                f"must have {n} rows",
            )
        for i, (r, lp) in enumerate(zip(self.response_ids, self.logprobs, strict=True)):
            require(
                len(r) == len(lp),
                f"Rollouts.logprobs[{i}]",
                len(lp),
                f"must have one logprob per response token ({len(r)})",
            )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


def to_batch(rollouts: Rollouts, pad_id: int) -> dict[str, torch.Tensor]:
    """The training batch of ``rollouts`` (see the module docstring)."""
    rows = len(rollouts)
    require(rows >= 1, "rollouts", rows, "must hold at least one response")
    lengths = [
        len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids, strict=True)
    ]
    width = max(lengths)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    response = torch.zeros(rows, width, dtype=torch.float32)
    old = torch.zeros(rows, width, dtype=torch.float32)
    for b, (p, r, lp) in enumerate(
        zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.logprobs, strict=True)
    ):
        n = len(p) + len(r)
        input_ids[b, :n] = torch.tensor(p + r, dtype=torch.long)
        attention[b, :n] = 1
        response[b, len(p) : n] = 1.0
        if r:
            old[b, len(p) : n] = torch.tensor(lp, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "response_mask": response,
        "old_logprobs": old,
    }
