"""A generation request decoded a few steps at a time, so weights can change between steps
and new rows can take the slots of finished ones (continuous batching).

``SteppedRollout(engine, prompts, params, seed, greedy_rows, prompt_width)`` prepares one
batch on a built-in ``GenerationEngine`` exactly as ``generate`` does (``greedy_rows``
decoded at temperature 0 beside the sampled ones: ReMax's baseline row); ``advance(steps)``
prefills on its first call, then decodes at most ``steps`` more tokens per row and returns
what is new since the previous call. The engine's weights may be rewritten in place
between calls (a weight sync): the next step reads them with the KV cache kept (a partial
rollout). ``advance(steps, refill=[Refill(slot, prompt, max_tokens, greedy), ...])`` first
puts new rows into done slots: each prompt is prefilled into its own cache row and the row
decodes in lockstep with the others at its own positions. More: docs/engines.md.

Promises: without refills, the same tokens and log-probabilities as one ``generate`` call
with the same prompts, params and seed, in any number of calls (a request never refilled
runs ``generate``'s loop); a row is ``done`` at its bound (``row_max_tokens``) or a stop
token, the request ``finished`` when every row is; every rank of the EMU calls ``advance``
together with the same arguments (TP/PP collectives and a refill's prefill run inside).
A token's noise is that of (request seed, global step, slot): a refilled row's draws
depend on the step it started at; the other rows draw what they would without refills.

Refuses (``ConfigError``): ``steps < 1``; a greedy row outside the batch; a refill of a
slot not done (or named twice), a bound above the request's cap (``max_tokens``; without
``prompt_width``, its longest first row), a prompt plus bound beyond its room (the wider of
its widest prompt and ``prompt_width``, plus the cap). One request per engine; no wavefront.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nereus.config import require
from nereus.engines.generation import GenerationEngine, _Batch, _Noise
from nereus.engines.sampling import SamplingParams

__all__ = ["Refill", "SteppedRollout"]


@dataclass(frozen=True)
class Refill:
    """A new row for a done slot: its prompt, its bound (None: the request's
    ``max_tokens``) and whether it decodes greedily."""

    slot: int
    prompt: Sequence[int]
    max_tokens: int | None = None
    greedy: bool = False

    @classmethod
    def from_any(cls, r: Refill | Mapping[str, Any]) -> Refill:
        """A ``Refill`` or its fields as a map (as it comes over the wire)."""
        if isinstance(r, Refill):
            return r
        return cls(
            int(r["slot"]),
            [int(t) for t in r["prompt"]],
            None if r.get("max_tokens") is None else int(r["max_tokens"]),
            bool(r.get("greedy", False)),
        )


class SteppedRollout:
    """One open request on ``engine`` (see the module docstring)."""

    def __init__(
        self,
        engine: GenerationEngine,
        prompts: list[list[int]],
        params: SamplingParams | dict[str, Any] | None,
        seed: int | None = None,
        greedy_rows: Sequence[int] = (),
        prompt_width: int | None = None,
    ) -> None:
        self.params = SamplingParams.from_any(params)
        require(
            not engine.is_sleeping,
            f"{engine.name}.advance_rollout",
            "sleeping",
            "call wake_up() first",
        )
        require(len(prompts) >= 1, "prompts", len(prompts), "must hold at least one prompt")
        vocab = engine.config.vocab_size
        for i, p in enumerate(prompts):
            require(
                len(p) >= 1 and all(0 <= int(t) < vocab for t in p),
                f"prompts[{i}]",
                list(p)[:16],
                f"must be non-empty token ids in [0, vocab_size={vocab})",
            )
        self.engine = engine
        self.rows = len(prompts)
        bad = [r for r in greedy_rows if not 0 <= r < self.rows]
        require(not bad, "greedy_rows", bad, f"must be rows in [0, {self.rows})")
        self.greedy: torch.Tensor | None = None
        if greedy_rows:
            self.greedy = torch.zeros(self.rows, dtype=torch.bool, device=engine.device)
            self.greedy[list(greedy_rows)] = True
        seed = (
            seed
            if seed is not None
            else (self.params.seed if self.params.seed is not None else random.getrandbits(62))
        )
        self.limits = self.params.row_limits(self.rows)
        if prompt_width is not None:
            # room for refills: any prompt up to prompt_width with any bound up to max_tokens
            width = max(prompt_width, max(len(p) for p in prompts))
            require(
                width + self.params.max_tokens <= engine.config.max_position_embeddings,
                "prompt_width + max_tokens",
                width + self.params.max_tokens,
                f"must be <= max_position_embeddings={engine.config.max_position_embeddings}",
            )
            engine._kv_cache(self.rows, width + self.params.max_tokens)
        self.b = engine._prepare([list(map(int, p)) for p in prompts], self.params, self.limits)
        # what a refilled row may use: tokens (``cap``) and cache slots, prompt included
        self.cap = self.params.max_tokens if prompt_width is not None else self.b.steps
        self.room = (self.b.width if prompt_width is None else width) + self.cap
        self.noise = _Noise(seed, 0, engine.device)
        self.step = 0  # decode steps done (the first one includes the prefill)
        self.finished = False
        self._sent = [0] * self.rows  # tokens of each row already returned
        self._slots: _Slots | None = None  # per-row state, from the first refill on

    def _counts(self) -> list[int]:
        """Tokens each row holds now (stop tokens counted as the params say)."""
        if self.b.stops.numel():
            return [int(n) for n in self.b.n_out.tolist()]
        if self._slots is not None:
            return self._slots.counts(self.step)
        if self.limits is None:
            return [min(self.step, self.params.max_tokens)] * self.rows
        return [min(self.step, n) for n in self.limits]

    def _done(self) -> list[bool]:
        """Whether each row is done (a stop token, its bound, or the whole request)."""
        if self._slots is not None and not self.b.stops.numel():
            return self._slots.done(self.step)
        if self.limits is not None and not self.b.stops.numel():
            # without stop tokens the engine marks no row: a row is done at its bound
            return [self.finished or self.step >= n for n in self.limits]
        return [self.finished or bool(d) for d in self.b.done.tolist()]

    def advance(
        self, steps: int, refill: Sequence[Refill | Mapping[str, Any]] = ()
    ) -> dict[str, Any]:
        """Decode up to ``steps`` more tokens per row, after placing ``refill``'s rows (see
        the module docstring); returns ``tokens`` and ``logprobs`` (per row, only the new
        ones: a refilled slot's are its new row's), ``done`` (per row) and ``finished``
        (every row)."""
        require(steps >= 1, "advance_rollout.steps", steps, "must be >= 1")
        if refill:
            self._refill([Refill.from_any(r) for r in refill])
        if self._slots is not None:
            self._advance_slots(steps)
        else:
            self._advance_batch(steps)
        counts = self._counts()
        done = self._done()
        b = self.b
        token_rows, logprob_rows = b.tokens.tolist(), b.logprobs.tolist()
        out_tokens, out_logprobs = [], []
        for r, n in enumerate(counts):
            out_tokens.append(token_rows[r][self._sent[r] : n])
            out_logprobs.append(logprob_rows[r][self._sent[r] : n])
            self._sent[r] = n
        return {
            "tokens": out_tokens,
            "logprobs": out_logprobs,
            "done": done,
            "finished": self.finished,
        }

    def _advance_batch(self, steps: int) -> None:
        """The request's own rows, one global step for all (``generate``'s loop)."""
        engine, b, params = self.engine, self.b, self.params
        every = slice(0, self.rows)
        with torch.inference_mode():
            for _ in range(steps):
                if self.finished:
                    break
                if self.step == 0:
                    index = torch.full(
                        (self.rows,), b.width - 1, dtype=torch.long, device=engine.device
                    )
                    logits = engine._forward(b.ids, b.positions, b.cache, index)
                else:
                    ids, pos = engine._decode_inputs(b, every, self.step)
                    index = torch.zeros(self.rows, dtype=torch.long, device=engine.device)
                    logits = engine._forward(ids, pos, b.cache, index)
                tokens, logprobs = engine._sample_and_share(
                    logits, every, self.rows, params, self.noise, self.step, self.greedy
                )
                self.finished = engine._record(b, every, self.step, tokens, logprobs, params)
                self.step += 1

    # --- refills ----------------------------------------------------------------------

    def _refill(self, refill: list[Refill]) -> None:
        """Check ``refill`` against the request's room, then make each slot its new row's
        (its prefill runs at the next step)."""
        done = self._done()
        vocab = self.engine.config.vocab_size
        seen: set[int] = set()
        for i, r in enumerate(refill):
            require(
                0 <= r.slot < self.rows and r.slot not in seen and done[r.slot],
                f"refill[{i}].slot",
                r.slot,
                f"must be a done slot in [0, {self.rows}), named once",
            )
            seen.add(r.slot)
            n = self.params.max_tokens if r.max_tokens is None else r.max_tokens
            require(
                1 <= n <= self.cap,
                f"refill[{i}].max_tokens",
                n,
                f"must be in [1, {self.cap}] (the request's max_tokens, or without "
                "prompt_width its longest first row)",
            )
            require(
                len(r.prompt) >= 1 and all(0 <= int(t) < vocab for t in r.prompt),
                f"refill[{i}].prompt",
                list(r.prompt)[:16],
                f"must be non-empty token ids in [0, vocab_size={vocab})",
            )
            require(
                len(r.prompt) + n <= self.room,
                f"refill[{i}].prompt",
                f"{len(r.prompt)} tokens + max_tokens {n}",
                f"must fit the request's room of {self.room} slots (prompt_width + max_tokens)",
            )
        if self._slots is None:
            self._slots = _Slots(self)
        self._slots.place(self, refill)
        self.finished = False

    def _advance_slots(self, steps: int) -> None:
        """Every row at its own step: rows refilled since the last call are prefilled into
        their cache rows at the first step, beside the others' decode forward."""
        engine, b, params, s = self.engine, self.b, self.params, self._slots
        assert s is not None
        every = slice(0, self.rows)
        zeros = torch.zeros(self.rows, dtype=torch.long, device=engine.device)
        with torch.inference_mode():
            for _ in range(steps):
                if self.finished:
                    break
                step = self.step
                logits = None
                if len(s.fresh) < self.rows:
                    ids, pos = s.decode_inputs(b, step)
                    logits = engine._forward(ids, pos, b.cache, zeros)
                if s.fresh:
                    logits = s.prefill(self, logits)
                tokens, logprobs = engine._sample_and_share(
                    logits, every, self.rows, params, self.noise, step, self.greedy
                )
                self.finished = s.record(b, step, tokens, logprobs, params)
                self.step += 1


class _Slots:
    """Per-row state of a request that has been refilled: each row's first step, bound and
    prompt length, on the host and the device, and the rows still to prefill."""

    def __init__(self, r: SteppedRollout) -> None:
        b, dev = r.b, r.engine.device
        self.start = [0] * r.rows  # the global step of each row's first token
        self.limit = list(r.limits) if r.limits is not None else [r.params.max_tokens] * r.rows
        self.fresh: list[Refill] = []  # placed, prefill at the next step
        self.cap = r.cap
        # one scratch column past the cap: where rows past their bound write
        tokens = torch.zeros(r.rows, r.cap + 1, dtype=torch.long, device=dev)
        logprobs = torch.zeros(r.rows, r.cap + 1, dtype=torch.float32, device=dev)
        tokens[:, : b.tokens.shape[1]] = b.tokens
        logprobs[:, : b.logprobs.shape[1]] = b.logprobs
        b.tokens, b.logprobs = tokens, logprobs
        self._device_rows(b)
        if b.stops.numel():
            # a row at its bound without a stop token is done (the batch path counts it
            # only when the whole request ends)
            b.done |= self.limit_t <= r.step

    def _device_rows(self, b: _Batch) -> None:
        """The device tensors the steps read, from ``start``, ``limit`` and the lengths."""
        dev = b.lengths.device
        start = torch.tensor(self.start, dtype=torch.long, device=dev)
        self.start_t = start
        self.limit_t = torch.tensor(self.limit, dtype=torch.long, device=dev)
        # decode at step t feeds token t - start - 1 at position length + t - start - 1,
        # for t in [start + 1, start + limit - 1]; other rows park at slot 0 (never read
        # by them: a done row's output is dropped, a new row's prefill rewrites slot 0)
        self.col_base = -1 - start
        self.pos_base = b.lengths - 1 - start
        self.first = start + 1
        self.last = start + self.limit_t - 1
        self.end = max(st + n for st, n in zip(self.start, self.limit, strict=True))

    def counts(self, step: int) -> list[int]:
        return [min(step - st, n) for st, n in zip(self.start, self.limit, strict=True)]

    def done(self, step: int) -> list[bool]:
        return [step - st >= n for st, n in zip(self.start, self.limit, strict=True)]

    def place(self, r: SteppedRollout, refill: list[Refill]) -> None:
        b, step = r.b, r.step
        slots = [x.slot for x in refill]
        dev = b.lengths.device
        index = torch.tensor(slots, dtype=torch.long, device=dev)
        for x in refill:
            self.start[x.slot] = step
            self.limit[x.slot] = r.params.max_tokens if x.max_tokens is None else x.max_tokens
            r._sent[x.slot] = 0
        b.lengths[index] = torch.tensor([len(x.prompt) for x in refill], device=dev)
        if b.stops.numel():
            b.done[index] = False
            b.stopped[index] = False
            b.n_out[index] = 0
        greedy = [x.slot for x in refill if x.greedy]
        if greedy and r.greedy is None:
            r.greedy = torch.zeros(r.rows, dtype=torch.bool, device=dev)
        if r.greedy is not None:
            r.greedy[index] = torch.tensor([x.greedy for x in refill], device=dev)
        self.fresh = list(refill)  # a fresh row is not done: none is refilled twice
        self._device_rows(b)

    def decode_inputs(self, b: _Batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids ``[R, 1]`` and positions ``[R, 1]`` of the decode forward of ``step``."""
        col = (self.col_base + step).clamp_(0, self.cap)
        ids = b.tokens.gather(1, col.unsqueeze(1))
        active = (self.first <= step) & (self.last >= step)
        pos = torch.where(active, self.pos_base + step, 0)
        return ids, pos.unsqueeze(1)

    def prefill(self, r: SteppedRollout, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Prefill the fresh rows into their cache rows (a forward over just them, in a
        cache of their own, copied in); returns every row's logits of this step with
        theirs in place (None off the sampling rank)."""
        engine, b = r.engine, r.b
        fresh, self.fresh = self.fresh, []
        n, width = len(fresh), max(len(x.prompt) for x in fresh)
        ids = torch.zeros(n, width, dtype=torch.long)
        positions = torch.full((n, width), -1, dtype=torch.long)
        for i, x in enumerate(fresh):
            ids[i, width - len(x.prompt) :] = torch.tensor(list(x.prompt), dtype=torch.long)
            positions[i, width - len(x.prompt) :] = torch.arange(len(x.prompt))
        dev = engine.device
        cache = engine.stage.new_kv_cache(n, width, engine.dtype)
        last = torch.full((n,), width - 1, dtype=torch.long, device=dev)
        new = engine._forward(ids.to(dev), positions.to(dev), cache, last)
        rows = torch.tensor([x.slot for x in fresh], dtype=torch.long, device=dev)
        if b.cache.pairs is not None and cache.pairs is not None:
            for i, pair in cache.pairs.items():
                b.cache.pairs[i][:, rows, :, :width] = pair
        else:
            for i in cache.keys:
                b.cache.keys[i][rows, :, :width] = cache.keys[i]
                b.cache.values[i][rows, :, :width] = cache.values[i]
        if new is None:
            return None
        if logits is None:  # every row is new: no decode forward ran
            logits = new.new_empty(r.rows, new.shape[-1])
        return logits.index_copy_(0, rows, new)

    def record(
        self,
        b: _Batch,
        step: int,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        params: SamplingParams,
    ) -> bool:
        """Store ``step``'s token of every row at its own column; returns whether every
        row is now done."""
        local = step - self.start_t
        col = local.clamp(max=self.cap).unsqueeze(1)
        b.tokens.scatter_(1, col, tokens.unsqueeze(1))
        b.logprobs.scatter_(1, col, logprobs.unsqueeze(1))
        if not b.stops.numel():
            return step + 1 >= self.end
        live = ~b.done
        is_stop = torch.isin(tokens, b.stops) & live
        b.n_out += (live & (params.include_stop_token | ~is_stop)).long()
        b.stopped |= is_stop
        b.done |= is_stop
        b.done |= self.limit_t <= local + 1
        return bool(b.done.all())
