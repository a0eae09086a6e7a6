"""Sampling parameters and the vectorized sampler every generation engine shares.

``SamplingParams`` is the request side (validated, msgpack-able through ``to_dict`` /
``from_dict``). ``sample_next`` turns one step's logits ``[B, V]`` into the next token and
its log-probability for every row at once: no Python loop over rows.

Promises (the same in the built-in engine and the vLLM adapter):
- ``temperature == 0`` is greedy; otherwise temperature, then top-k (0 = all), then
  top-p (always at least one token), then one draw from what is left;
- the log-probability returned is under the temperature-scaled distribution *before*
  top-k/top-p filtering, the one the training engine recomputes, so PPO/GRPO ratios
  start at 1;
- rows in ``greedy`` (a per-row mask) are decoded as a temperature-0 request decodes
  them whatever ``params`` say, beside the sampled rows of the same batch (ReMax's
  baseline row in an asynchronous run);
- a step draws ``B`` uniforms, not ``B x V``; filtered tokens are never drawn; one seed
  gives the same tokens on every run whatever the layout (``step_noise``).

``row_max_tokens`` (optional) gives every row its own length bound, each in
[1, ``max_tokens``]: a row is done at its own bound (or a stop token), so with no stop
token every row is exactly that long (length benchmarks, ``[trace] lengths``).

Refuses (``ConfigError``): negative temperature, ``top_p`` outside (0, 1], negative
``top_k``, ``max_tokens < 1``, negative stop token ids, a row bound outside
[1, ``max_tokens``], and (``row_limits``) row bounds that are not one per row.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nereus.config import require

__all__ = ["SamplingParams", "sample_next", "make_generator", "step_noise"]


@dataclass(frozen=True)
class SamplingParams:
    """What to generate for every prompt of a request."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    # Rows that hit a stop token keep it as their last token (as vLLM does for EOS).
    include_stop_token: bool = True
    # Per row (prompt order): the most tokens that row generates (None: max_tokens each).
    row_max_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        require(self.max_tokens >= 1, "SamplingParams.max_tokens", self.max_tokens, "must be >= 1")
        require(
            self.temperature >= 0.0,
            "SamplingParams.temperature",
            self.temperature,
            "must be >= 0 (0 = greedy)",
        )
        require(0.0 < self.top_p <= 1.0, "SamplingParams.top_p", self.top_p, "must be in (0, 1]")
        require(self.top_k >= 0, "SamplingParams.top_k", self.top_k, "must be >= 0 (0 = off)")
        stops = tuple(int(t) for t in self.stop_token_ids)
        require(
            all(t >= 0 for t in stops),
            "SamplingParams.stop_token_ids",
            stops,
            "must be token ids >= 0",
        )
        object.__setattr__(self, "stop_token_ids", stops)
        if self.row_max_tokens is not None:
            rows = tuple(self.row_max_tokens)
            require(
                all(isinstance(n, int) and 1 <= n <= self.max_tokens for n in rows),
                "SamplingParams.row_max_tokens",
                rows[:16],
                f"must be integers in [1, max_tokens={self.max_tokens}]",
            )
            object.__setattr__(self, "row_max_tokens", rows)

    def row_limits(self, rows: int) -> list[int] | None:
        """Every row's bound for a request of ``rows`` prompts (None: ``max_tokens`` each)."""
        if self.row_max_tokens is None:
            return None
        require(
            len(self.row_max_tokens) == rows,
            "SamplingParams.row_max_tokens",
            len(self.row_max_tokens),
            f"must give one bound per row ({rows} rows)",
        )
        return list(self.row_max_tokens)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "seed": self.seed,
            "include_stop_token": self.include_stop_token,
            "row_max_tokens": None if self.row_max_tokens is None else list(self.row_max_tokens),
        }

    @classmethod
    def from_any(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Accept params as the dataclass, a plain dict (after the wire) or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        require(
            isinstance(value, dict),
            "SamplingParams",
            type(value).__name__,
            "must be SamplingParams or a dict",
        )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        require(not unknown, "SamplingParams", unknown, f"unknown keys; known: {sorted(known)}")
        data = dict(value)
        if "stop_token_ids" in data:
            data["stop_token_ids"] = tuple(data["stop_token_ids"])
        if data.get("row_max_tokens") is not None:
            data["row_max_tokens"] = tuple(data["row_max_tokens"])
        return cls(**data)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (a random seed when None)."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside top-k and outside the top-p nucleus (row-wise)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p;
        # the most likely token is always kept.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def step_noise(
    seed: int, chunk: int, step: int, rows: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The uniform noise ``[rows]`` of one decode step of one chunk of a request:
    a function of (seed, chunk, step) only, so any grouping of the rows (pipeline
    micro-batches) draws the same tokens. ``generator`` (a CPU generator) is reseeded
    and used instead of a new one: reseeding resets its whole state, so the noise is
    the same, and a step is spared building a generator."""
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + chunk * 1_000_003 + step) % (2**63 - 1)
    if generator is None:
        generator = make_generator(mixed)
    else:
        generator.manual_seed(mixed)
    return torch.rand((rows,), generator=generator, dtype=torch.float32)


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token ``[B]`` (int64) and its log-probability ``[B]`` (float32) for each row of
    ``logits`` ``[B, V]``. The draw uses ``uniform`` (``[B]`` in [0, 1)) when given,
    else fresh noise from ``generator``; rows where ``greedy`` (``[B]`` bool) is set take
    the argmax. See the module docstring for the semantics."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if not params.is_greedy and greedy is not None and bool(greedy.any()):
        tokens, chosen = sample_next(logits, params, generator, uniform)
        best, best_logprob = sample_next(logits, SamplingParams(temperature=0.0))
        return torch.where(greedy, best, tokens), torch.where(greedy, best_logprob, chosen)
    if params.is_greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
    else:
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        logprobs = torch.log_softmax(scaled, dim=-1)
        if params.top_k == 0 and params.top_p >= 1.0:
            probs = logprobs.exp()  # nothing filtered: the softmax is already at hand
        else:
            probs = torch.softmax(_filter_top_k_top_p(scaled, params.top_k, params.top_p), dim=-1)
        if uniform is None:
            uniform = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.float32)
        # float64 sums keep every bucket's width (no token is lost to rounding); the first
        # bucket ending above the target holds it, and an empty bucket never does.
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        target = cdf.narrow(1, cdf.shape[1] - 1, 1) * uniform.view(-1, 1)
        tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
        return tokens.view(-1), logprobs.gather(-1, tokens).view(-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen
