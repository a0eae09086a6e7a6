"""A generation request decoded a few steps at a time, so weights can change between steps.

``SteppedRollout(engine, prompts, params, seed, greedy_rows)`` prepares one batch on a
built-in ``GenerationEngine`` (left-padded prompts, the engine's KV cache) exactly as
``GenerationEngine.generate`` does, rows in ``greedy_rows`` decoded as a temperature-0
request would beside the sampled ones (ReMax's baseline row in asynchronous RL);
``advance(steps)`` prefills on its first call and then decodes at most ``steps`` more
tokens for every row, returning only what is new since the previous call. Between two
``advance`` calls the engine's weights may be rewritten in place (a weight sync into the
shard store the engine adopts): the next decode step reads the new weights while the KV
cache of the tokens already produced is kept, which is what a partial rollout is. The
caller tags each call's tokens with the policy version the weights held during that call.

Promises: the tokens and log-probabilities of a request decoded in any number of
``advance`` calls with unchanged weights equal those of one ``generate`` call with the
same prompts, params and seed (same noise per step and row); a row with its own bound
(``params.row_max_tokens``) is ``done`` once it holds that many tokens (or a stop token),
and the request is ``finished`` when every row is; every rank of the EMU must call
``advance`` together (the engine's TP/PP collectives run inside).

Refuses: ``steps < 1``; a greedy row outside the batch; another request on the same
engine while one is open (the engine has one KV cache). Never runs the wavefront
schedule (one batch, stage after stage).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from nereus.config import require
from nereus.engines.generation import GenerationEngine, _Noise
from nereus.engines.sampling import SamplingParams

__all__ = ["SteppedRollout"]


class SteppedRollout:
    """One open request on ``engine`` (see the module docstring)."""

    def __init__(
        self,
        engine: GenerationEngine,
        prompts: list[list[int]],
        params: SamplingParams | dict[str, Any] | None,
        seed: int | None = None,
        greedy_rows: Sequence[int] = (),
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
        self.b = engine._prepare([list(map(int, p)) for p in prompts], self.params, self.limits)
        self.noise = _Noise(seed, 0, engine.device)
        self.step = 0  # decode steps done (the first one includes the prefill)
        self.finished = False
        self._sent = [0] * self.rows  # tokens of each row already returned

    def _counts(self) -> list[int]:
        """Tokens each row holds now (stop tokens counted as the params say)."""
        if self.b.stops.numel():
            return [int(n) for n in self.b.n_out.tolist()]
        if self.limits is None:
            return [min(self.step, self.params.max_tokens)] * self.rows
        return [min(self.step, n) for n in self.limits]

    def _done(self) -> list[bool]:
        """Whether each row is done (a stop token, its bound, or the whole request)."""
        if self.limits is not None and not self.b.stops.numel():
            # without stop tokens the engine marks no row: a row is done at its bound
            return [self.finished or self.step >= n for n in self.limits]
        return [self.finished or bool(d) for d in self.b.done.tolist()]

    def advance(self, steps: int) -> dict[str, Any]:
        """Decode up to ``steps`` more tokens per row; returns ``tokens`` and ``logprobs``
        (per row, only the new ones), ``done`` (per row) and ``finished`` (every row)."""
        require(steps >= 1, "advance_rollout.steps", steps, "must be >= 1")
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
        counts = self._counts()
        done = self._done()
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
