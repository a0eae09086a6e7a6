"""Tensor-parallel building blocks, each declaring how its parameters are sharded.

Every layer here holds only this TP rank's shard and says, per parameter, which shard
rule (``column``, ``row``, ``vocab``, ``replicated``) and which fused components
(``nereus.state.spec.Component``) the *global* tensor has. ``nereus.models.spec`` walks a
model built on the meta device and reads those declarations: the shard rules the state
layer uses come from here, not from a table.

Component placement (shared with ``nereus.state``): a component of ``units`` indivisible
units is split into ``tp`` equal ranges when ``tp <= units``; when ``tp > units`` each
unit is replicated on ``tp / units`` consecutive ranks (GQA k/v heads with more TP ranks
than kv heads). Refuses (``ConfigError``) sizes that TP does not divide.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nereus.config import require
from nereus.models.parallel import ParallelContext, copy_to_tp, reduce_from_tp
from nereus.state.spec import Component, ShardRule

__all__ = [
    "ShardedModule",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "RMSNorm",
    "HeadRMSNorm",
    "ValueHead",
    "component_range",
]


def component_range(
    size: int, units: int, tp_rank: int, tp_size: int, what: str = "component"
) -> tuple[int, int]:
    """Rows ``[start, stop)`` of one component of ``size`` rows and ``units`` units that
    TP rank ``tp_rank`` holds (see the module docstring for replication)."""
    unit = size // units
    if tp_size <= units:
        require(
            units % tp_size == 0, f"{what}.units", units, f"must be divisible by tp_size={tp_size}"
        )
        per = units // tp_size
        return tp_rank * per * unit, (tp_rank + 1) * per * unit
    require(
        tp_size % units == 0,
        "tp_size",
        tp_size,
        f"must be a multiple of {what}.units={units} when larger than it",
    )
    u = tp_rank // (tp_size // units)
    return u * unit, (u + 1) * unit


def _init_normal(t: torch.Tensor, std: float) -> None:
    if t.device.type != "meta":
        with torch.no_grad():
            t.normal_(0.0, std)


class ShardedModule(nn.Module):
    """A module whose directly owned parameters each declare a shard rule.

    ``shard_rules`` maps a local parameter name (``"weight"``, ``"bias"``) to
    ``(rule, components)``; ``global_shapes`` to its unsharded shape."""

    shard_rules: dict[str, tuple[ShardRule, tuple[Component, ...]]]
    global_shapes: dict[str, tuple[int, ...]]


class ColumnParallelLinear(ShardedModule):
    """``out_features`` split over TP, per component; input replicated."""

    def __init__(
        self,
        in_features: int,
        components: tuple[Component, ...],
        pc: ParallelContext,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.pc = pc
        self.in_features = in_features
        self.components = components
        self.out_features = sum(c.size for c in components)
        self.local_ranges = [
            component_range(c.size, c.units, pc.tp_rank, pc.tp_size, c.name) for c in components
        ]
        self.local_sizes = [b - a for a, b in self.local_ranges]
        out_local = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype, device=device))
        _init_normal(self.weight, init_std)
        self.bias = (
            nn.Parameter(torch.zeros(out_local, dtype=dtype, device=device)) if bias else None
        )
        comps = (
            components if len(components) > 1 or components[0].units != components[0].size else ()
        )
        self.shard_rules = {"weight": ("column", comps)}
        self.global_shapes = {"weight": (self.out_features, in_features)}
        if bias:
            self.shard_rules["bias"] = ("column", comps)
            self.global_shapes["bias"] = (self.out_features,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.pc), self.weight, self.bias)

    def split_output(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The local output cut into its components (e.g. q, k, v)."""
        return list(torch.split(y, self.local_sizes, dim=-1))

    @property
    def has_replicated_units(self) -> bool:
        """True when some component has fewer units than TP ranks (replicated rows)."""
        return any(self.pc.tp_size > c.units for c in self.components)

    def reduce_replicated_grads(self) -> None:
        """Sum the gradients of replicated rows over the ranks that replicate them.

        A unit replicated on several TP ranks (GQA k/v heads when tp > kv heads) gets
        only a partial gradient on each rank: its queries are spread over those ranks.
        Each rank scatters its partial rows into a zero buffer of the global component,
        one TP all_reduce sums them, and each rank reads its rows back."""
        if not self.has_replicated_units or self.pc.tp_size == 1:
            return
        offset_local = 0
        for comp, (start, stop), size in zip(
            self.components, self.local_ranges, self.local_sizes, strict=True
        ):
            if self.pc.tp_size > comp.units:
                for param in (self.weight, self.bias):
                    if param is None or param.grad is None:
                        continue
                    rows = param.grad[offset_local : offset_local + size]
                    full = rows.new_zeros((comp.size, *rows.shape[1:]))
                    full[start:stop] = rows
                    self.pc.tp_comm.all_reduce(full, "sum")
                    rows.copy_(full[start:stop])
            offset_local += size


class RowParallelLinear(ShardedModule):
    """``in_features`` split over TP; output all-reduced, bias replicated."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        pc: ParallelContext,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.pc = pc
        require(
            in_features % pc.tp_size == 0,
            "RowParallelLinear.in_features",
            in_features,
            f"must be divisible by tp_size={pc.tp_size}",
        )
        self.in_local = in_features // pc.tp_size
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_local, dtype=dtype, device=device)
        )
        _init_normal(self.weight, init_std)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )
        self.shard_rules = {"weight": ("row", ())}
        self.global_shapes = {"weight": (out_features, in_features)}
        if bias:
            self.shard_rules["bias"] = ("replicated", ())
            self.global_shapes["bias"] = (out_features,)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x_local, self.weight), self.pc)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(ShardedModule):
    """Vocabulary rows split over TP: rank r holds ids ``[r * V/tp, (r + 1) * V/tp)``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        pc: ParallelContext,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.pc = pc
        require(
            vocab_size % pc.tp_size == 0,
            "vocab_size",
            vocab_size,
            f"must be divisible by tp_size={pc.tp_size}",
        )
        self.vocab_size = vocab_size
        self.vocab_local = vocab_size // pc.tp_size
        self.vocab_start = pc.tp_rank * self.vocab_local
        self.weight = nn.Parameter(
            torch.empty(self.vocab_local, hidden_size, dtype=dtype, device=device)
        )
        _init_normal(self.weight, init_std)
        self.shard_rules = {"weight": ("vocab", ())}
        self.global_shapes = {"weight": (vocab_size, hidden_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.pc.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        is_local = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)
        out = out * is_local.unsqueeze(-1).to(out.dtype)
        return reduce_from_tp(out, self.pc)


class ParallelLMHead(ShardedModule):
    """Vocab-parallel logits ``[..., vocab / tp]``.

    With ``tied`` the head owns no parameter and uses ``tied.weight`` (the embedding of
    the same stage, which on a pipeline's last stage is a copy of the first stage's)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        pc: ParallelContext,
        tied: VocabParallelEmbedding | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.pc = pc
        require(
            vocab_size % pc.tp_size == 0,
            "vocab_size",
            vocab_size,
            f"must be divisible by tp_size={pc.tp_size}",
        )
        # A list keeps the embedding out of this module's children, so the tied weight is
        # registered (and named, and loaded) once: as model.embed_tokens.weight.
        self._tied = [tied] if tied is not None else []
        self.shard_rules = {}
        self.global_shapes = {}
        if tied is None:
            self.weight = nn.Parameter(
                torch.empty(vocab_size // pc.tp_size, hidden_size, dtype=dtype, device=device)
            )
            _init_normal(self.weight, init_std)
            self.shard_rules["weight"] = ("vocab", ())
            self.global_shapes["weight"] = (vocab_size, hidden_size)

    @property
    def head_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(hidden, self.pc), self.head_weight)


class RMSNorm(ShardedModule):
    """``w * x / sqrt(mean(x^2) + eps)``, computed in float32 like Hugging Face's."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.shard_rules = {"weight": ("replicated", ())}
        self.global_shapes = {"weight": (hidden_size,)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel instead of six ops (the same formula).
            weight = self.weight
            return torch.rms_norm(x, weight.shape, weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class HeadRMSNorm(RMSNorm):
    """``RMSNorm`` over the last dim (``head_dim``) of ``[..., heads, head_dim]``, one weight
    shared by every head (Qwen3's ``q_norm`` and ``k_norm``). The weight is replicated
    across TP but its gradient on a rank covers only that rank's heads: see
    ``has_partial_grad``."""

    has_partial_grad = True


class ValueHead(ShardedModule):
    """A scalar head on the final-normed hidden state (critic, reward model), replicated
    on every TP rank: ``value_head.weight`` ``[1, hidden]`` and ``value_head.bias``
    ``[1]`` (a sequence classifier's ``score`` head), zeros until loaded."""

    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.shard_rules = {"weight": ("replicated", ()), "bias": ("replicated", ())}
        self.global_shapes = {"weight": (1, hidden_size), "bias": (1,)}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[...]`` float32 values."""
        return F.linear(hidden, self.weight, self.bias).squeeze(-1).float()
