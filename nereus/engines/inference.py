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

from pathlib import Path
from typing import Any

import torch

from nereus.config import require
from nereus.engines._base import EngineBase
from nereus.engines._pipeline import forward_only
from nereus.engines.context import EmuContext
from nereus.engines.losses import normalize_batch, resolve_callable, split_batch
from nereus.engines.memory import MemoryLedger
from nereus.models.config import ModelConfig
from nereus.models.parallel import vocab_parallel_logprobs

__all__ = ["InferenceEngine", "activation_bytes", "token_logprobs"]


def activation_bytes(config: ModelConfig, ctx: EmuContext, rows: int, length: int, dtype: torch.dtype, training: bool) -> int:
    """An estimate of the activation bytes one micro-batch of ``rows x length`` needs on
    this rank: per local layer the residual stream, attention and MLP intermediates (kept
    for backward when training), plus float32 vocab-parallel logits on the last stage."""
    from nereus.models.parallel import stage_layer_range

    c = config
    elem = torch.empty((), dtype=dtype).element_size()
    layers = len(stage_layer_range(c.num_hidden_layers, ctx.pp_size, ctx.pp_rank, ctx.parallel.layer_cuts))
    tokens = rows * length
    qkv = (c.q_size + 2 * c.kv_size) // ctx.tp_size
    per_layer = tokens * (4 * c.hidden_size + 2 * qkv + 3 * c.intermediate_size // ctx.tp_size) * elem
    per_layer += rows * (c.num_attention_heads // ctx.tp_size) * length * length * elem  # scores
    live_layers = layers if training else 1
    total = per_layer * live_layers + 2 * tokens * c.hidden_size * elem
    if ctx.is_last_stage:
        total += 3 * tokens * (c.vocab_size // ctx.tp_size) * 4
    return total


def token_logprobs(local_logits: torch.Tensor, input_ids: torch.Tensor, ctx: EmuContext, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probabilities of ``input_ids`` from ``[B, T, V/tp]`` logits (first
    column 0), differentiable, replicated over TP."""
    lp = vocab_parallel_logprobs(local_logits[:, :-1], input_ids[:, 1:], ctx.parallel, temperature)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


class InferenceEngine(EngineBase):
    """One rank of an inference EMU (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: EmuContext | None = None,
        *,
        model_dir: str | Path | None = None,
        dtype: str | torch.dtype = "float32",
        value_head: bool = False,
        micro_batch_size: int = 16,
        seed: int = 0,
        ledger: MemoryLedger | None = None,
        name: str = "inference",
    ) -> None:
        require(micro_batch_size >= 1, "InferenceEngine.micro_batch_size", micro_batch_size, "must be >= 1")
        super().__init__(config, ctx, model_dir=model_dir, dtype=dtype, value_head=value_head, seed=seed, ledger=ledger, name=name)
        self.has_value_head = value_head
        self.micro_batch_size = micro_batch_size
        self.stage.eval()

    def _run(self, batch: dict[str, Any], head, output: str, micro_batch_size: int | None) -> torch.Tensor:
        data = {k: v.to(self.device) for k, v in normalize_batch(batch).items()}
        mbs = split_batch(data, micro_batch_size or self.micro_batch_size)
        rows = mbs[0]["input_ids"].shape[0]
        need = activation_bytes(self.config, self.ctx, rows, data["input_ids"].shape[1], self.dtype, training=False)
        self.ledger.reserve(f"{self.name}/activations", need)
        try:
            return forward_only(self.stage, self.ctx, mbs, head, output=output).cpu()
        finally:
            self.ledger.release(f"{self.name}/activations")

    def logprobs(self, batch: dict[str, Any], temperature: float = 1.0, micro_batch_size: int | None = None) -> torch.Tensor:
        """Per-token log-probabilities ``[B, T]`` (see the module docstring)."""
        require(temperature > 0, "temperature", temperature, "must be > 0")

        def head(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            return token_logprobs(logits, mb["input_ids"], self.ctx, temperature)

        return self._run(batch, head, "logits", micro_batch_size)

    def values(self, batch: dict[str, Any], micro_batch_size: int | None = None) -> torch.Tensor:
        """Per-token values ``[B, T]`` from the value head."""
        require(self.has_value_head, f"{self.name}.values", "no value head", "needs an engine built with value_head=True")

        def head(hidden: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            assert self.value_head is not None
            return self.value_head(hidden)

        return self._run(batch, head, "hidden", micro_batch_size)

    def rewards(self, batch: dict[str, Any], micro_batch_size: int | None = None) -> torch.Tensor:
        """A reward model's score per row ``[B]``: the value head at the last real token."""
        data = normalize_batch(batch)
        values = self.values(data, micro_batch_size)
        last = data["attention_mask"].sum(dim=1).clamp(min=1) - 1
        return values.gather(1, last.unsqueeze(1)).squeeze(1)

    def rule_rewards(self, batch: dict[str, Any], fn: str, **kwargs: Any) -> torch.Tensor:
        """Scores ``[B]`` from a rule function named by import path (no model involved)."""
        data = normalize_batch(batch)
        rule = resolve_callable(fn, "reward fn")
        scores = torch.as_tensor(rule(data["input_ids"], data["attention_mask"], data["response_mask"], **kwargs), dtype=torch.float32)
        rows = data["input_ids"].shape[0]
        require(tuple(scores.shape) == (rows,), f"reward fn {fn}", tuple(scores.shape), f"must return {rows} scores")
        return scores
