"""The options every engine is built with, in one place (``EngineOptions``).

Every engine (generation, inference, training, the vLLM adapter) takes the same few
things besides its model and its parallel context: where its weights come from (a model
folder, or tensors a shard store already holds, never both), their dtype, the seed of
weights it initialises itself, the memory ledger it accounts against and its name in
that ledger. ``EngineOptions`` holds them, validated once when built; each engine's own
keywords (``max_batch``, ``micro_batch_size``, ``optim`` ...) stay its own.

Refuses (``ConfigError``): both ``model_dir`` and ``tensors``, an unknown dtype, a seed
that is not an integer, an empty name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nereus.config import require
from nereus.engines.memory import MemoryLedger
from nereus.models.decoder import torch_dtype

__all__ = ["EngineOptions"]


@dataclass(frozen=True)
class EngineOptions:
    """What an engine is built with besides its model and context (see the module
    docstring). ``name`` None: the engine's own default name."""

    model_dir: str | Path | None = None
    tensors: Mapping[str, torch.Tensor] | None = None
    dtype: str | torch.dtype = "float32"
    seed: int = 0
    ledger: MemoryLedger | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        require(
            self.tensors is None or self.model_dir is None,
            "engine weights",
            "tensors and model_dir",
            "give one of them: tensors (a shard store's) or model_dir",
        )
        torch_dtype(self.dtype)  # raises ConfigError for a dtype no engine knows
        require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool),
            "engine seed",
            self.seed,
            "must be an integer",
        )
        require(
            self.name is None or (isinstance(self.name, str) and self.name != ""),
            "engine name",
            self.name,
            "must be a non-empty string (or None for the engine's default)",
        )

    def named(self, default: str) -> str:
        """The engine's name: ``name``, or ``default`` when none was given."""
        return self.name if self.name is not None else default

    def with_(self, **changes: Any) -> EngineOptions:
        """These options with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
