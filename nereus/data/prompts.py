"""Prompt datasets with one global sample order and a resumable position.

A ``PromptDataset`` over a task (or a fixed list of samples) defines a single global
order of samples: epoch ``e`` visits the ``size`` sample indices in a permutation drawn
from ``(seed, e)``. The *position* counts samples consumed since the start of the
job; it is the only state, so checkpointing the position (``state_dict``) and
restoring it (``load_state_dict``) resumes the exact same sequence, with no sample
repeated or skipped.

Data parallelism never changes the order: a global batch is the ``n`` samples at
positions ``[position, position + n)``; DP rank ``r`` of ``d`` takes every sample whose
offset in the batch is ``r`` modulo ``d`` (``global_batch(..., dp_rank, dp_size)``), so
changing ``d`` between steps keeps the global batch, and the position, unchanged.

A dataset over a file (``nereus.data.filedata``) also carries the file's ``fingerprint``
in its state, and restoring a state whose fingerprint differs is refused: the same
position in a changed file would be other samples.

Refuses (``ConfigError``): ``size < 1``, a negative position, a batch size < 1, a
DP rank outside ``[0, dp_size)``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from nereus.config import require
from nereus.data.tasks import Sample, Task

__all__ = ["PromptDataset"]


class PromptDataset:
    """The global sample order over a task's ``size`` samples (or a list of samples)."""

    def __init__(
        self,
        task: Task | None = None,
        *,
        size: int = 1024,
        seed: int = 0,
        samples: Sequence[Sample] | None = None,
        shuffle: bool = True,
        fingerprint: str | None = None,
    ) -> None:
        require(
            (task is None) != (samples is None),
            "PromptDataset",
            (task, samples),
            "needs exactly one of task or samples",
        )
        self.task = task
        self.samples = list(samples) if samples is not None else None
        self.size = len(self.samples) if self.samples is not None else size
        require(self.size >= 1, "PromptDataset.size", self.size, "must be >= 1")
        self.seed = seed
        self.shuffle = shuffle
        self.fingerprint = fingerprint
        self.position = 0
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._perm, self._perm_epoch = order, epoch
        return self._perm

    def at(self, position: int) -> Sample:
        """The sample at ``position`` of the global order (a pure function of it)."""
        require(position >= 0, "PromptDataset.position", position, "must be >= 0")
        epoch, offset = divmod(position, self.size)
        index = self._order(epoch)[offset]
        if self.samples is not None:
            return self.samples[index]
        assert self.task is not None
        return self.task.sample(index, self.seed)

    def global_batch(
        self, n: int, position: int | None = None, dp_rank: int = 0, dp_size: int = 1
    ) -> list[Sample]:
        """The samples of the global batch of ``n`` at ``position`` that DP rank ``dp_rank``
        of ``dp_size`` takes (every ``dp_size``-th one). Does not move the position."""
        require(n >= 1, "PromptDataset.batch_size", n, "must be >= 1")
        require(
            0 <= dp_rank < dp_size,
            "PromptDataset.dp_rank",
            dp_rank,
            f"must be in [0, dp_size={dp_size})",
        )
        start = self.position if position is None else position
        return [self.at(start + i) for i in range(dp_rank, n, dp_size)]

    def take(self, n: int) -> list[Sample]:
        """The next ``n`` samples of the global order; advances the position by ``n``."""
        batch = self.global_batch(n)
        self.position += n
        return batch

    @property
    def epoch(self) -> int:
        return self.position // self.size

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"position": self.position, "seed": self.seed, "size": self.size}
        if self.fingerprint is not None:
            state["fingerprint"] = self.fingerprint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. The seed, size (and fingerprint, for a file) must match
        the saved ones, else the order would silently differ."""
        require(
            state.get("seed") == self.seed,
            "PromptDataset.seed",
            self.seed,
            f"must equal the checkpoint's seed={state.get('seed')!r}",
        )
        require(
            state.get("size") == self.size,
            "PromptDataset.size",
            self.size,
            f"must equal the checkpoint's size={state.get('size')!r}",
        )
        if self.fingerprint is not None:
            require(
                state.get("fingerprint") == self.fingerprint,
                "PromptDataset.fingerprint",
                self.fingerprint,
                f"must equal the checkpoint's fingerprint={state.get('fingerprint')!r} (the "
                "data file changed since it was saved)",
            )
        position = state.get("position")
        require(
            isinstance(position, int) and position >= 0,
            "PromptDataset.position",
            position,
            "must be an integer >= 0",
        )
        self.position = int(position)
