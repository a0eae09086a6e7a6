"""The built-in generation engine: batched sampling with a preallocated KV cache, at any
TP x PP, on CPU (and on any device torch runs the model on).

One ``GenerationEngine`` per rank of a generation EMU; every rank of the EMU is called with
the same prompts and parameters and returns the same result.

Promises:
- ``generate(prompts, params)`` runs all prompts as one batch (in chunks of ``max_batch``):
  the prompts are left-padded, prefilled in one forward, then decoded one token per
  forward for every row at once. Sampling is vectorized (``nereus.engines.sampling``):
  temperature, top-k, top-p, stop tokens, ``max_tokens``, per-token log-probabilities.
- Deterministic under ``params.seed``: the last stage's TP rank 0 draws every token from
  one generator; the tokens reach its TP group by broadcast and the other stages by the
  pipeline group, so every rank agrees and the tokens do not depend on TP or PP.
- Memory: the KV cache (``2 x local layers x batch x kv_heads_local x max_len x head_dim``)
  is reserved in the device's ledger before it is allocated, and reused across calls
  while it is large enough; a request whose cache does not fit raises ``OutOfMemory``
  naming the device, the bytes it needs and the budget, with nothing allocated.
  ``free_cache()`` gives the cache back; ``sleep()`` also frees the weights and
  ``wake_up(weights)`` rebuilds them (from the given shards or the model directory), so
  a co-resident model-stage can use the memory in between.

Refuses (``ConfigError``): empty prompts, token ids outside the vocabulary, prompts plus
``max_tokens`` longer than ``max_position_embeddings``.

Never: calls Python per row per token (one forward and a few tensor ops per step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nereus.config import require
from nereus.engines._base import EngineBase
from nereus.engines.context import EmuContext
from nereus.engines.memory import MemoryLedger
from nereus.engines.sampling import SamplingParams, make_generator, sample_next
from nereus.models.config import ModelConfig
from nereus.models.decoder import KVCache

__all__ = ["GenerationEngine", "GenerationOutput", "kv_cache_bytes"]

log = logging.getLogger("nereus.engines")


def kv_cache_bytes(config: ModelConfig, ctx: EmuContext, batch: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of the KV cache this rank holds for ``batch`` rows of ``max_len`` tokens."""
    from nereus.models.parallel import stage_layer_range

    layers = len(stage_layer_range(config.num_hidden_layers, ctx.pp_size, ctx.pp_rank, ctx.parallel.layer_cuts))
    kv_local = max(1, config.num_key_value_heads // ctx.tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * batch * kv_local * max_len * config.head_dim * elem


@dataclass
class GenerationOutput:
    """Per prompt: the generated token ids, their log-probabilities, why it stopped."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" (a stop token) or "length" (max_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "logprobs": self.logprobs, "finish_reasons": self.finish_reasons}

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


class GenerationEngine(EngineBase):
    """One rank of a generation EMU (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: EmuContext | None = None,
        *,
        model_dir: str | Path | None = None,
        dtype: str | torch.dtype = "float32",
        max_batch: int = 256,
        seed: int = 0,
        ledger: MemoryLedger | None = None,
        name: str = "generation",
    ) -> None:
        require(max_batch >= 1, "GenerationEngine.max_batch", max_batch, "must be >= 1")
        super().__init__(config, ctx, model_dir=model_dir, dtype=dtype, seed=seed, ledger=ledger, name=name)
        self.max_batch = max_batch
        self.model_dir = model_dir
        self.is_sleeping = False
        self._weight_bytes = self.ledger.held(f"{name}/weights")
        self._cache: KVCache | None = None
        self._cache_batch = 0
        self.stage.eval()

    # --- KV cache ---------------------------------------------------------------------

    def _kv_cache(self, batch: int, max_len: int) -> KVCache:
        """A cache with at least ``batch`` rows and ``max_len`` slots (reused if so)."""
        cache = self._cache
        if cache is not None and self._cache_batch >= batch and cache.max_len >= max_len:
            return cache
        rows = max(batch, self._cache_batch)
        length = max(max_len, cache.max_len if cache is not None else 0)
        need = kv_cache_bytes(self.config, self.ctx, rows, length, self.dtype)
        self._cache = None  # the old cache is dropped before the new one is counted
        self.ledger.release(f"{self.name}/kv_cache")
        self.ledger.reserve(f"{self.name}/kv_cache", need)
        self._cache = self.stage.new_kv_cache(rows, length, self.dtype)
        self._cache_batch = rows
        return self._cache

    def free_cache(self) -> int:
        """Drop the KV cache; returns the bytes given back to the device's budget."""
        self._cache = None
        self._cache_batch = 0
        return self.ledger.release(f"{self.name}/kv_cache")

    def sleep(self) -> int:
        """Free the weights and the KV cache (a co-resident model-stage needs the memory);
        returns the bytes given back to the device's budget. ``generate`` is refused until
        ``wake_up``."""
        if self.is_sleeping:
            return 0
        freed = self.free_cache()
        self.stage = None  # type: ignore[assignment]
        freed += self.ledger.release(f"{self.name}/weights")
        self.is_sleeping = True
        return freed

    def wake_up(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Re-reserve and rebuild the weights: from ``weights`` (this rank's shards by
        name, e.g. the latest policy) or else from the engine's ``model_dir``."""
        if not self.is_sleeping:
            if weights:
                self.load_named(weights)
            return
        from nereus.models.checkpoint import load_stage_weights
        from nereus.models.decoder import build_stage

        require(weights is not None or self.model_dir is not None, f"{self.name}.wake_up", None,
                "needs weights when the engine was not built from a model_dir")
        self.ledger.reserve(f"{self.name}/weights", self._weight_bytes)
        try:
            self.stage = build_stage(self.config, self.ctx.parallel, self.dtype)
            self.stage.eval()
            if weights is not None:
                self.load_named(weights, strict=True)
            else:
                load_stage_weights(self.stage, self.model_dir, self.ctx.parallel)
        except BaseException:
            self.ledger.release(f"{self.name}/weights")
            raise
        self.is_sleeping = False

    # --- generation -------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None) -> GenerationOutput:
        """Sample a continuation of every prompt. See the module docstring."""
        params = SamplingParams.from_any(params)
        require(not self.is_sleeping, f"{self.name}.generate", "sleeping", "call wake_up() first")
        require(len(prompts) >= 1, "prompts", len(prompts), "must hold at least one prompt")
        vocab = self.config.vocab_size
        for i, p in enumerate(prompts):
            require(len(p) >= 1, f"prompts[{i}]", list(p), "must not be empty")
            require(all(0 <= int(t) < vocab for t in p), f"prompts[{i}]", list(p)[:16], f"token ids must be in [0, vocab_size={vocab})")
        generator = make_generator(params.seed)
        out = GenerationOutput([], [], [])
        for start in range(0, len(prompts), self.max_batch):
            chunk = [list(map(int, p)) for p in prompts[start : start + self.max_batch]]
            part = self._generate_batch(chunk, params, generator)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs
            out.finish_reasons += part.finish_reasons
        return out

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, last: torch.Tensor,
              params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward through the pipeline and one sampling step: (tokens, logprobs) [B]."""
        ctx = self.ctx
        batch = ids.shape[0]
        if ctx.is_first_stage:
            x = ids
        else:
            x = ctx.recv_prev((batch, ids.shape[1], self.config.hidden_size), self.dtype)
        if not ctx.is_last_stage:
            ctx.send_next(self.stage(x, positions, kv_cache=cache))
            packed = torch.empty(2, batch, dtype=torch.float64)
        else:
            logits = self.stage(x, positions, kv_cache=cache, logits_index=last, gather_logits=True)
            packed = torch.empty(2, batch, dtype=torch.float64)
            if ctx.tp_rank == 0:
                tokens, logprobs = sample_next(logits, params, generator)
                packed[0] = tokens.to(torch.float64)
                packed[1] = logprobs.to(torch.float64)
            ctx.tp_broadcast(packed, src=0)
        ctx.broadcast_from_last(packed)
        return packed[0].to(torch.long), packed[1].to(torch.float32)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> GenerationOutput:
        batch = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        width = int(lengths.max())
        max_len = width + params.max_tokens
        require(max_len <= self.config.max_position_embeddings, "prompt length + max_tokens", max_len,
                f"must be <= max_position_embeddings={self.config.max_position_embeddings}")
        cache = self._kv_cache(batch, max_len)
        pad = width - lengths
        ids = torch.zeros(batch, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        cols = torch.arange(width).unsqueeze(0)
        positions = torch.where(cols >= pad.unsqueeze(1), cols - pad.unsqueeze(1), torch.full_like(cols, -1))
        if self._cache_batch > batch:
            # Rows beyond this batch exist in a reused cache; use only the first ``batch``.
            cache = KVCache({i: k[:batch] for i, k in cache.keys.items()},
                            {i: v[:batch] for i, v in cache.values.items()}, cache.max_len)
        stops = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long)
        out_tokens = torch.zeros(batch, params.max_tokens, dtype=torch.long)
        out_logprobs = torch.zeros(batch, params.max_tokens, dtype=torch.float32)
        done = torch.zeros(batch, dtype=torch.bool)
        stopped = torch.zeros(batch, dtype=torch.bool)
        n_out = torch.zeros(batch, dtype=torch.long)
        last = torch.full((batch,), width - 1, dtype=torch.long)
        first_col = torch.zeros(batch, dtype=torch.long)
        with torch.inference_mode():
            tokens, logprobs = self._step(ids, positions, cache, last, params, generator)
            cur = lengths.clone()  # position of the next token of each row
            for step in range(params.max_tokens):
                live = ~done
                out_tokens[:, step] = tokens
                out_logprobs[:, step] = logprobs
                is_stop = torch.isin(tokens, stops) & live if stops.numel() else torch.zeros_like(live)
                n_out += (live & (params.include_stop_token | ~is_stop)).long()
                stopped |= is_stop
                done |= is_stop
                if step == params.max_tokens - 1 or bool(done.all()):
                    break
                # Finished rows ride along as padding (position -1: never written or read).
                pos = torch.where(done, torch.full_like(cur, -1), cur).unsqueeze(1)
                tokens, logprobs = self._step(tokens.unsqueeze(1), pos, cache, first_col, params, generator)
                cur += 1
        counts = n_out.tolist()
        token_rows = out_tokens.tolist()
        lp_rows = out_logprobs.tolist()
        return GenerationOutput(
            token_ids=[row[:n] for row, n in zip(token_rows, counts, strict=True)],
            logprobs=[row[:n] for row, n in zip(lp_rows, counts, strict=True)],
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
        )
