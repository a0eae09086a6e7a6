"""Model-stages as the RL step sees them: the ``ModelStages`` interface.

``ModelStages`` is the async interface every algorithm step calls: ``generate``,
``reference_logprobs``, ``critic_values``, ``reward_scores``, ``train_policy``, ``train_critic``,
``sync_policy``, ``save``/``load`` (the job checkpoint), ``close``; plus the job's plan
(``plan``, ``apply_plan``, ``transition_done``), each device's memory (``memory``) and
the seconds each model-stage worked (``take_stage_seconds``). Two backends implement it,
both in ``nereus.job``: ``InProcessStages`` (``nereus.job.local_stages``: one engine per
model-stage inside the driver process) and ``ClusterStages``
(``nereus.job.cluster_stages``: each model-stage's EMUs as actor meshes placed by the
job's plan).

Promises (both backends):
- ``generate`` returns ``token_ids``, ``logprobs`` and, per row, the ``policy_version``
  of the weights that generated it (the number of weight syncs applied so far).
- ``reward_scores`` is the reward model's score of each row (its value head on the
  row's last token, as transformers' sequence classifiers pool, ``last_token_scores``),
  ``[B]`` float32.
- ``sync_policy`` copies policy-training's weights into policy-generation and bumps
  the policy version; it returns ``bytes``, ``seconds`` and ``gbps``.
- ``save(dir)`` writes every piece of logical state the stages hold (policy and critic
  parameters, AdamW moments, update counters, policy version) as safetensors plus a
  JSON manifest; ``load(dir)`` restores it in place and re-syncs generation, so the
  next step is the one the saved job would have taken.

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelStages", "last_token_scores"]


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's value at its last attended token (right padding)."""
    last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
    return values.float().gather(1, last.unsqueeze(1)).squeeze(1)


class ModelStages(abc.ABC):
    """The model-stages of one job (see the module docstring)."""

    policy_version: int = 0
    # the job's position in its global sample order, carried by every transition
    sample_position: int = 0

    def __init__(self) -> None:
        self._stage_seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Adds the seconds spent in the block to ``stage``'s account."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._stage_seconds[stage] = (
                self._stage_seconds.get(stage, 0.0) + time.perf_counter() - t0
            )

    def take_stage_seconds(self) -> dict[str, float]:
        """Seconds each model-stage worked since the last call (and start a new account)."""
        out, self._stage_seconds = self._stage_seconds, {}
        return out

    @property
    @abc.abstractmethod
    def plan(self) -> Any:
        """The job's placement now: a ``nereus.planner.Plan`` under the job's names."""

    @abc.abstractmethod
    async def apply_plan(self, target: Any, *, overlap: bool | str = False) -> dict[str, Any]:
        """Change the placement to ``target`` at a step boundary; returns a report. With
        ``overlap`` (``True`` or ``"auto"``, where the backend supports it) the change
        may run beside the next step's work; ``transition_done`` waits for it."""

    async def transition_done(self) -> dict[str, Any] | None:
        """Wait for a change running beside the step's work; its report, or None when
        none runs (a backend without such changes: always None). Raises what it raised."""
        return None

    @abc.abstractmethod
    async def memory(self) -> dict[int, dict[str, Any]]:
        """Per device: budget, used and peak bytes and who holds them."""

    async def memory_peaks(self, reset: bool = True) -> dict[int, int]:
        """Each device's ledger high-water mark since the last reset (then reset it)."""
        out = {d: int(r["peak_bytes"]) for d, r in (await self.memory()).items()}
        if reset:
            for ledger in getattr(self, "ledgers", {}).values():
                ledger.reset_peak()
        return out

    @abc.abstractmethod
    async def generate(
        self, prompts: list[list[int]], params: dict[str, Any]
    ) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    async def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    async def reward_scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    async def train_policy(
        self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]: ...

    @abc.abstractmethod
    async def train_critic(
        self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]: ...

    @abc.abstractmethod
    async def sync_policy(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def save(self, folder: str | Path) -> None: ...

    @abc.abstractmethod
    async def load(self, folder: str | Path) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
