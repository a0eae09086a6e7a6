"""The built-in generation engine: batched sampling with a preallocated KV cache, at any
TP x PP, on the rank's device (``ctx.device``: the CPU, or a GPU worker's ``cuda:0``).

One ``GenerationEngine`` per rank of a generation EMU; every rank of the EMU is called with
the same prompts and parameters and returns the same result.

Promises:
- ``generate(prompts, params)`` runs all prompts as one batch (in chunks of ``max_batch``):
  one prefill forward, then one forward per decoded token for every row at once, with
  the shared vectorized sampler (``nereus.engines.sampling``);
- deterministic under ``params.seed``: the tokens do not depend on TP, PP or the
  wavefront's groups, and every rank agrees on them;
- ``params.row_max_tokens``: each row is done at its own bound (without stop tokens,
  exactly that long); a batch decodes until its longest row is done, and its KV cache
  holds the prompts plus that longest row;
- the KV cache is reserved in the device's ledger before it is allocated; a request
  whose cache does not fit raises ``OutOfMemory`` (device, bytes, budget) with nothing
  allocated; ``free_cache``, ``sleep`` and ``wake_up`` give memory back and rebuild.

Refuses (``ConfigError``): empty prompts, token ids outside the vocabulary, prompts plus
``max_tokens`` longer than ``max_position_embeddings``.

Never: calls Python per row per token (one forward and a few tensor ops per step).

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from nereus.config import require
from nereus.engines._base import EngineBase
from nereus.engines.context import EmuContext
from nereus.engines.losses import even_slices
from nereus.engines.options import EngineOptions
from nereus.engines.sampling import SamplingParams, sample_next, step_noise
from nereus.models.config import ModelConfig
from nereus.models.decoder import KVCache
from nereus.transfer.communicator import P2POp

__all__ = ["GenerationEngine", "GenerationOutput", "kv_cache_bytes"]

log = logging.getLogger("nereus.engines")


def kv_cache_bytes(
    config: ModelConfig, ctx: EmuContext, batch: int, max_len: int, dtype: torch.dtype
) -> int:
    """Bytes of the KV cache this rank holds for ``batch`` rows of ``max_len`` tokens."""
    from nereus.models.parallel import stage_layer_range

    layers = len(
        stage_layer_range(
            config.num_hidden_layers, ctx.pp_size, ctx.pp_rank, ctx.parallel.layer_cuts
        )
    )
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
        return {
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reasons": self.finish_reasons,
        }

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
        options: EngineOptions | None = None,
        max_batch: int = 256,
        wavefront: bool = False,
    ) -> None:
        require(max_batch >= 1, "GenerationEngine.max_batch", max_batch, "must be >= 1")
        options = options or EngineOptions()
        super().__init__(config, ctx, options=options, default_name="generation")
        name = self.name
        self.max_batch = max_batch
        self.wavefront = wavefront
        self.model_dir = options.model_dir
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

    def reserve_cache(self, batch: int, max_len: int) -> int:
        """Reserve and allocate a KV cache of ``batch`` rows and ``max_len`` slots now (an
        engine rebuilt after a change takes back the cache it had); returns its bytes."""
        self._kv_cache(batch, max_len)
        return self.ledger.held(f"{self.name}/kv_cache")

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(rows, slots) of the KV cache held now, (0, 0) without one."""
        return (self._cache_batch, self._cache.max_len) if self._cache is not None else (0, 0)

    def sleep(self) -> int:
        """Free the weights and the KV cache (a co-resident model-stage needs the memory);
        returns the bytes given back to the device's budget. ``generate`` is refused until
        ``wake_up``. An engine over a shard store only frees its cache: the weights are
        the store's."""
        if self.is_sleeping:
            return 0
        if not self.owns_weights:
            return self.free_cache()
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

        require(
            weights is not None or self.model_dir is not None,
            f"{self.name}.wake_up",
            None,
            "needs weights when the engine was not built from a model_dir",
        )
        self.ledger.reserve(f"{self.name}/weights", self._weight_bytes)
        try:
            self.stage = build_stage(self.config, self.ctx.parallel, self.dtype, device=self.device)
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

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None
    ) -> GenerationOutput:
        """Sample a continuation of every prompt. See the module docstring."""
        params = SamplingParams.from_any(params)
        require(not self.is_sleeping, f"{self.name}.generate", "sleeping", "call wake_up() first")
        require(len(prompts) >= 1, "prompts", len(prompts), "must hold at least one prompt")
        vocab = self.config.vocab_size
        for i, p in enumerate(prompts):
            require(len(p) >= 1, f"prompts[{i}]", list(p), "must not be empty")
            require(
                all(0 <= int(t) < vocab for t in p),
                f"prompts[{i}]",
                list(p)[:16],
                f"token ids must be in [0, vocab_size={vocab})",
            )
        # Only the sampling rank uses the seed, so an unseeded request may pick its own.
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        limits = params.row_limits(len(prompts))
        out = GenerationOutput([], [], [])
        for chunk, start in enumerate(range(0, len(prompts), self.max_batch)):
            stop = start + self.max_batch
            rows = [list(map(int, p)) for p in prompts[start:stop]]
            part_limits = None if limits is None else limits[start:stop]
            if self.wavefront and self.ctx.pp_size > 1 and len(rows) >= self.ctx.pp_size:
                part = self._generate_pipelined(rows, params, seed, chunk, part_limits)
            else:
                part = self._generate_batch(rows, params, seed, chunk, part_limits)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs
            out.finish_reasons += part.finish_reasons
        return out

    # --- shared pieces ------------------------------------------------------------------

    def _prepare(
        self, prompts: list[list[int]], params: SamplingParams, limits: list[int] | None = None
    ) -> _Batch:
        """Left-padded ids and positions, the KV cache and the output buffers (on the
        engine's device; ids and positions are built on the CPU and moved in one copy each).
        ``limits``: every row's own bound (None: ``max_tokens`` each)."""
        batch = len(prompts)
        dev = self.device
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        width = int(lengths.max())
        require(
            width + params.max_tokens <= self.config.max_position_embeddings,
            "prompt length + max_tokens",
            width + params.max_tokens,
            f"must be <= max_position_embeddings={self.config.max_position_embeddings}",
        )
        steps = params.max_tokens if limits is None else max(limits)
        cache = self._kv_cache(batch, width + steps)
        if self._cache_batch > batch:
            # Rows beyond this batch exist in a reused cache; use only the first ``batch``.
            cache = cache.rows(slice(0, batch))
        pad = width - lengths
        ids = torch.zeros(batch, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        # Without stop tokens every row runs to its bound: counted up front, not per step.
        if params.stop_token_ids:
            n_out = torch.zeros(batch, dtype=torch.long, device=dev)
        elif limits is None:
            n_out = torch.full((batch,), steps, dtype=torch.long, device=dev)
        else:
            n_out = torch.tensor(limits, dtype=torch.long, device=dev)
        cols = torch.arange(width).unsqueeze(0)
        positions = torch.where(
            cols >= pad.unsqueeze(1), cols - pad.unsqueeze(1), torch.full_like(cols, -1)
        )
        return _Batch(
            ids=ids.to(dev),
            positions=positions.to(dev),
            lengths=lengths.to(dev),
            width=width,
            cache=cache,
            stops=torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=dev),
            tokens=torch.zeros(batch, steps, dtype=torch.long, device=dev),
            logprobs=torch.zeros(batch, steps, dtype=torch.float32, device=dev),
            done=torch.zeros(batch, dtype=torch.bool, device=dev),
            stopped=torch.zeros(batch, dtype=torch.bool, device=dev),
            n_out=n_out,
            steps=steps,
            row_steps=limits,
            limits=None if limits is None else torch.tensor(limits, dtype=torch.long, device=dev),
        )

    def _sample_and_share(
        self,
        logits: torch.Tensor | None,
        rows: slice,
        batch: int,
        params: SamplingParams,
        noise: _Noise,
        step: int,
        greedy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample on the last stage's TP rank 0, then hand the tokens to every rank of the
        EMU (TP broadcast, then pipeline broadcast): (tokens, logprobs) of ``rows``
        (``greedy``: the whole batch's mask of rows decoded greedily, ``sample_next``)."""
        ctx = self.ctx
        if greedy is not None:
            greedy = greedy[rows]
        if ctx.tp_size == 1 and ctx.pp_size == 1:
            # This rank is the whole EMU: nothing to share, no packing.
            assert logits is not None
            uniform = None if params.is_greedy else noise.rows(step, batch, rows)
            return sample_next(logits, params, uniform=uniform, greedy=greedy)
        count = rows.stop - rows.start
        # on the device: the TP and pipeline groups move what lives there (NCCL on GPUs)
        packed = torch.empty(2, count, dtype=torch.float64, device=self.device)
        if ctx.is_last_stage:
            if ctx.tp_rank == 0:
                assert logits is not None
                uniform = None if params.is_greedy else noise.rows(step, batch, rows)
                tokens, logprobs = sample_next(logits, params, uniform=uniform, greedy=greedy)
                packed[0] = tokens.to(torch.float64)
                packed[1] = logprobs.to(torch.float64)
            ctx.tp_broadcast(packed, src=0)
        ctx.broadcast_from_last(packed)
        return packed[0].to(torch.long), packed[1].to(torch.float32)

    @staticmethod
    def _record(
        b: _Batch,
        rows: slice,
        step: int,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        params: SamplingParams,
    ) -> bool:
        """Store step ``step`` of ``rows``; returns whether all of them are now finished."""
        b.tokens[rows, step] = tokens
        b.logprobs[rows, step] = logprobs
        if not b.stops.numel():
            # Without stop tokens every row is live until its bound (counted up front, rows
            # past it decode on and are dropped): no masks, no sync.
            return step == b.last_step(rows)
        live = ~b.done[rows]
        is_stop = torch.isin(tokens, b.stops) & live
        b.n_out[rows] += (live & (params.include_stop_token | ~is_stop)).long()
        b.stopped[rows] |= is_stop
        b.done[rows] |= is_stop
        if b.limits is not None:
            b.done[rows] |= b.limits[rows] <= step + 1
        return step == b.last_step(rows) or bool(b.done[rows].all())

    @staticmethod
    def _output(b: _Batch) -> GenerationOutput:
        counts = b.n_out.tolist()
        return GenerationOutput(
            token_ids=[row[:n] for row, n in zip(b.tokens.tolist(), counts, strict=True)],
            logprobs=[row[:n] for row, n in zip(b.logprobs.tolist(), counts, strict=True)],
            finish_reasons=["stop" if s else "length" for s in b.stopped.tolist()],
        )

    @staticmethod
    def _decode_inputs(b: _Batch, rows: slice, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids ``[r, 1]`` and positions of the forward that samples ``step`` (> 0): the
        tokens of ``step - 1``. Finished rows keep decoding at their next positions (their
        tokens are past ``n_out`` and dropped): a step without padding takes the
        decoder's few-op path, and computing a row costs the same as masking it."""
        return b.tokens[rows, step - 1 : step], b.lengths[rows].unsqueeze(1) + (step - 1)

    # --- one batch, stage after stage ---------------------------------------------------

    def _forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, index: torch.Tensor
    ) -> torch.Tensor | None:
        """This stage's part of one forward (receiving from / sending to its neighbours);
        the full logits on the last stage, None elsewhere."""
        ctx = self.ctx
        if not ctx.is_first_stage:
            x = ctx.recv_prev(
                (positions.shape[0], positions.shape[1], self.config.hidden_size), self.dtype
            )
        if not ctx.is_last_stage:
            ctx.send_next(self.stage(x, positions, kv_cache=cache))
            return None
        return self.stage(x, positions, kv_cache=cache, logits_index=index, gather_logits=True)

    def _generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        chunk: int,
        limits: list[int] | None = None,
    ) -> GenerationOutput:
        b = self._prepare(prompts, params, limits)
        batch = len(prompts)
        every = slice(0, batch)
        noise = _Noise(seed, chunk, self.device)
        last_col = torch.full((batch,), b.width - 1, dtype=torch.long, device=self.device)
        first_col = torch.zeros(batch, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self._forward(b.ids, b.positions, b.cache, last_col)
            for step in range(b.steps):
                if step > 0:
                    ids, pos = self._decode_inputs(b, every, step)
                    logits = self._forward(ids, pos, b.cache, first_col)
                tokens, logprobs = self._sample_and_share(logits, every, batch, params, noise, step)
                if self._record(b, every, step, tokens, logprobs, params):
                    break
        return self._output(b)

    # --- one batch, pipelined over the stages -----------------------------------------

    def _generate_pipelined(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        chunk: int,
        limits: list[int] | None = None,
    ) -> GenerationOutput:
        """The batch cut into ``pp`` groups of rows that move through the pipeline as a
        wavefront: at tick ``t`` stage ``s`` runs the forward of group ``g`` for step ``k``
        where ``t - s = k * pp + g``, so every stage works on a different group at once.
        After each tick, activations move one stage on (one batch of p2p ops) and the
        group the last stage just sampled is broadcast to every stage, one tick before
        the first stage needs it. Every rank derives the same schedule from the same
        broadcasts, so no control message travels."""
        ctx = self.ctx
        pp, me = ctx.pp_size, ctx.pp_rank
        b = self._prepare(prompts, params, limits)
        batch = len(prompts)
        groups = even_slices(batch, pp)
        caches = [b.cache.rows(rows) for rows in groups]
        final: list[int | None] = [None] * pp  # the step after which a group is finished
        noise = _Noise(seed, chunk, self.device)
        dev = self.device
        hidden = self.config.hidden_size

        def work(stage: int, tick: int) -> tuple[int, int] | None:
            u = tick - stage
            if u < 0:
                return None
            step, g = divmod(u, pp)
            if step >= b.steps or (final[g] is not None and step > final[g]):
                return None
            return g, step

        inbox: torch.Tensor | None = None
        tick = 0
        with torch.inference_mode():
            while any(f is None for f in final):
                mine = work(me, tick)
                out = None
                if mine is not None:
                    g, step = mine
                    rows = groups[g]
                    count = rows.stop - rows.start
                    if step == 0:
                        ids, pos = b.ids[rows], b.positions[rows]
                        index = torch.full((count,), b.width - 1, dtype=torch.long, device=dev)
                    else:
                        ids, pos = self._decode_inputs(b, rows, step)
                        index = torch.zeros(count, dtype=torch.long, device=dev)
                    x = ids if ctx.is_first_stage else inbox
                    assert x is not None
                    if ctx.is_last_stage:
                        out = self.stage(
                            x, pos, kv_cache=caches[g], logits_index=index, gather_logits=True
                        )
                    else:
                        out = self.stage(x, pos, kv_cache=caches[g])
                ops = []
                if not ctx.is_last_stage and mine is not None:
                    assert out is not None
                    ops.append(P2POp("send", out.contiguous(), me + 1))
                prev = work(me - 1, tick) if not ctx.is_first_stage else None
                inbox = None
                if prev is not None:
                    g, step = prev
                    rows = groups[g]
                    inbox = torch.empty(
                        rows.stop - rows.start,
                        b.width if step == 0 else 1,
                        hidden,
                        dtype=self.dtype,
                        device=dev,
                    )
                    ops.append(P2POp("recv", inbox, me - 1))
                if ops:
                    assert ctx.pp_comm is not None
                    ctx.pp_comm.batch_p2p(ops, ctx.timeout_s)
                sampled = work(pp - 1, tick)
                if sampled is not None:
                    g, step = sampled
                    logits = out if ctx.is_last_stage else None
                    tokens, logprobs = self._sample_and_share(
                        logits, groups[g], batch, params, noise, step
                    )
                    if self._record(b, groups[g], step, tokens, logprobs, params):
                        final[g] = step
                tick += 1
        return self._output(b)


@dataclass
class _Batch:
    ids: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    width: int
    cache: KVCache
    stops: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    done: torch.Tensor
    stopped: torch.Tensor
    n_out: torch.Tensor
    steps: int  # decode steps the longest row needs
    row_steps: list[int] | None = None  # every row's bound (None: ``steps`` each)
    limits: torch.Tensor | None = None  # ``row_steps`` on the device
    _lasts: dict[tuple[int, int], int] = field(default_factory=dict)

    def last_step(self, rows: slice) -> int:
        """The last decode step any of ``rows`` needs (worked out once per slice: the
        decode loop asks every step)."""
        if self.row_steps is None:
            return self.steps - 1
        key = (rows.start, rows.stop)
        last = self._lasts.get(key)
        if last is None:
            last = self._lasts[key] = max(self.row_steps[rows]) - 1
        return last


class _Noise:
    """Step noise of one chunk, made once per step (on the CPU, whatever the device: the
    same seed draws the same noise everywhere), moved to ``device`` and sliced by rows."""

    def __init__(self, seed: int, chunk: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.chunk = seed, chunk
        self.device = torch.device(device)
        self._step = -1
        self._noise: torch.Tensor | None = None
        self._generator = torch.Generator(device="cpu")  # reseeded every step by step_noise

    def rows(self, step: int, batch: int, rows: slice) -> torch.Tensor:
        if step != self._step:
            noise = step_noise(self.seed, self.chunk, step, batch, self._generator)
            self._noise = noise if self.device.type == "cpu" else noise.to(self.device)
            self._step = step
        assert self._noise is not None
        # The whole batch (every step without a wavefront) needs no slice.
        return self._noise if rows.start == 0 and rows.stop == batch else self._noise[rows]
