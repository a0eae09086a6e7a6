"""The inference engine: forward-only log-probabilities, values and rewards at any TP x PP.

One ``InferenceEngine`` per rank of an inference EMU (reference-inference,
critic-inference, reward-inference, or the policy recomputing old log-probabilities);
every rank of the EMU is called with the same batch and returns the same tensor.

- ``logprobs(batch, temperature)``: ``[B, T]`` float32,
  ``out[b, t] = log softmax(logits / temperature)[input_ids[b, t]]`` given the tokens
  before ``t`` (``out[:, 0] = 0``), computed vocab-parallel (never full logits).
- ``values(batch)``: ``[B, T]`` float32, the value head on the final hidden state at every
  position (``value_head=True`` engines: critic, reward model).
- ``rewards(batch)``: ``[B]`` float32, a reward model's score: the value head at each
  row's last real token.
- ``rule_rewards(batch, fn, **kwargs)``: ``[B]`` float32 from a rule function named by
  import path, ``fn(input_ids, attention_mask, response_mask, **kwargs)`` returning a
  sequence or tensor of ``B`` floats (rule rewards need no model: any rank may run them).

The batch format is ``nereus.engines.losses``' (right-padded). Work is cut into
micro-batches of ``micro_batch_size`` rows; activation memory of one micro-batch is
reserved in the device's ledger while it runs.

Refuses (``ConfigError``): ``values``/``rewards`` on an engine without a value head, a
reward function that returns the wrong number of scores.
"""

from __future__ import annotations

from typing import Any

import torch

from nereus.config import require
from nereus.engines._base import EngineBase
from nereus.engines._pipeline import activation_bytes, token_logprobs
from nereus.engines.context import EmuContext
from nereus.engines.losses import normalize_batch, resolve_callable
from nereus.engines.options import EngineOptions
from nereus.models.config import ModelConfig

__all__ = ["InferenceEngine", "activation_bytes", "token_logprobs"]


class InferenceEngine(EngineBase):
    """One rank of an inference EMU (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: EmuContext | None = None,
        *,
        options: EngineOptions | None = None,
        value_head: bool = False,
        micro_batch_size: int = 16,
    ) -> None:
        require(
            micro_batch_size >= 1,
            "InferenceEngine.micro_batch_size",
            micro_batch_size,
            "must be >= 1",
        )
        super().__init__(
            config, ctx, options=options, value_head=value_head, default_name="inference"
        )
        self.micro_batch_size = micro_batch_size
        self.stage.eval()

    def rule_rewards(self, batch: dict[str, Any], fn: str, **kwargs: Any) -> torch.Tensor:
        """Scores ``[B]`` from a rule function named by import path (no model involved)."""
        data = normalize_batch(batch)
        rule = resolve_callable(fn, "reward fn")
        scores = torch.as_tensor(
            rule(data["input_ids"], data["attention_mask"], data["response_mask"], **kwargs),
            dtype=torch.float32,
        )
        rows = data["input_ids"].shape[0]
        require(
            tuple(scores.shape) == (rows,),
            f"reward fn {fn}",
            tuple(scores.shape),
            f"must return {rows} scores",
        )
        return scores
