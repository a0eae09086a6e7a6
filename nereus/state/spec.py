"""Model spec: what every parameter is, as the state layer needs to shard and move it.

A ``ModelSpec`` lists every parameter of a model with its global shape, dtype, shard
rule and pipeline position. It is produced by the model definition
(``nereus.models``), never written by hand, and it is all nereus.state knows about a
model: layouts, boxes, reshard plans and memory effects are computed from it.

Shard rules (weights use torch's ``[out_features, in_features]`` convention):

- ``column``: split along dim 0 (output features); its bias too.
- ``row``: split along dim 1 (input features); its bias is replicated.
- ``vocab``: split along dim 0 (the vocabulary) of an embedding or LM head.
- ``replicated``: every TP rank holds all of it (norms, row-parallel biases).

Refuses (``ConfigError``): shapes that are empty or negative, a rule that does not
match the rank of the tensor, components whose sizes do not add up to the split dim.

More (how it works): docs/state.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from nereus.config import require

__all__ = [
    "ShardRule",
    "Stage",
    "Component",
    "ParamSpec",
    "ModelSpec",
    "DTYPE_BYTES",
    "MOMENT_SLOTS",
    "SLOT_DTYPE",
    "optimizer_slots",
    "training_slots",
    "optimizer_bytes_per_param",
    "grad_bytes_per_param",
]

ShardRule = Literal["column", "row", "vocab", "replicated"]
Stage = Literal["embed", "layer", "head"]

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

MOMENT_SLOTS: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
# Optimizer slots are float32 whatever the parameter dtype.
SLOT_DTYPE: dict[str, str] = {"exp_avg": "float32", "exp_avg_sq": "float32", "master": "float32"}


def _check_dtype(dtype: str) -> str:
    require(dtype in DTYPE_BYTES, "dtype", dtype, f"must be one of {sorted(DTYPE_BYTES)}")
    return dtype


def optimizer_slots(dtype: str) -> tuple[str, ...]:
    """The optimizer slots of a parameter trained in ``dtype``: the two AdamW moments,
    plus a float32 ``master`` copy when ``dtype`` is not float32."""
    return MOMENT_SLOTS if _check_dtype(dtype) == "float32" else (*MOMENT_SLOTS, "master")


def training_slots(dtype: str) -> tuple[str, ...]:
    """Every slot a training EMU holds per parameter: ``param`` then the optimizer's."""
    return ("param", *optimizer_slots(dtype))


def optimizer_bytes_per_param(dtype: str) -> int:
    """Bytes of optimizer state per trained parameter of ``dtype`` (its slots)."""
    return sum(DTYPE_BYTES[SLOT_DTYPE[s]] for s in optimizer_slots(dtype))


def grad_bytes_per_param(dtype: str) -> int:
    """Gradient bytes per trained parameter: one in the parameter's dtype, and one in
    float32 for the master copy when there is one."""
    return DTYPE_BYTES[_check_dtype(dtype)] + (4 if "master" in optimizer_slots(dtype) else 0)


@dataclass(frozen=True)
class Component:
    """A contiguous range of a fused parameter along its split dim.

    ``size`` is the extent along the split dim; ``units`` the number of indivisible
    pieces it is made of (heads for q/k/v; ``size`` itself for gate/up rows)."""

    name: str
    size: int
    units: int

    def __post_init__(self) -> None:
        require(self.size > 0, f"Component({self.name}).size", self.size, "must be > 0")
        require(self.units > 0, f"Component({self.name}).units", self.units, "must be > 0")
        require(
            self.size % self.units == 0,
            f"Component({self.name}).units",
            self.units,
            f"must divide size={self.size}",
        )


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: global shape, dtype, shard rule, pipeline position, components."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    rule: ShardRule
    stage: Stage
    layer: int | None = None
    components: tuple[Component, ...] = ()
    tied_head: bool = False

    def __post_init__(self) -> None:
        require(
            len(self.shape) >= 1, f"ParamSpec({self.name}).shape", self.shape, "must have >= 1 dim"
        )
        require(
            all(d >= 0 for d in self.shape),
            f"ParamSpec({self.name}).shape",
            self.shape,
            "must be >= 0",
        )
        require(
            self.dtype in DTYPE_BYTES,
            f"ParamSpec({self.name}).dtype",
            self.dtype,
            f"must be one of {sorted(DTYPE_BYTES)}",
        )
        require(
            self.rule in ("column", "row", "vocab", "replicated"),
            f"ParamSpec({self.name}).rule",
            self.rule,
            "must be column, row, vocab or replicated",
        )
        require(
            self.stage in ("embed", "layer", "head"),
            f"ParamSpec({self.name}).stage",
            self.stage,
            "must be embed, layer or head",
        )
        require(
            (self.stage == "layer") == (self.layer is not None),
            f"ParamSpec({self.name}).layer",
            self.layer,
            "must be set exactly when stage='layer'",
        )
        if self.rule == "row":
            require(
                len(self.shape) == 2,
                f"ParamSpec({self.name}).rule",
                self.rule,
                f"needs a 2-d weight, shape is {self.shape}",
            )
        if self.components:
            require(
                self.rule == "column",
                f"ParamSpec({self.name}).components",
                [c.name for c in self.components],
                "are only allowed on column-parallel parameters",
            )
            total = sum(c.size for c in self.components)
            require(
                total == self.shape[0],
                f"ParamSpec({self.name}).components",
                [c.size for c in self.components],
                f"must add up to shape[0]={self.shape[0]}",
            )
        require(
            not self.tied_head or self.stage == "embed",
            f"ParamSpec({self.name}).tied_head",
            self.tied_head,
            "is only allowed on the embedding",
        )

    @property
    def split_dim(self) -> int | None:
        """The dim TP splits, or None for replicated parameters."""
        if self.rule in ("column", "vocab"):
            return 0
        if self.rule == "row":
            return 1
        return None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def effective_components(self) -> tuple[Component, ...]:
        """Components along the split dim; a plain split parameter is one component
        whose units are its rows (so any TP that divides it is valid)."""
        if self.components:
            return self.components
        dim = self.split_dim
        if dim is None:
            return ()
        return (
            (Component(self.name, self.shape[dim], self.shape[dim] or 1),)
            if self.shape[dim]
            else ()
        )


@dataclass(frozen=True)
class ModelSpec:
    """Every parameter of one model plus the numbers layouts are checked against."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    hidden_size: int
    params: tuple[ParamSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        require(self.num_layers >= 1, "ModelSpec.num_layers", self.num_layers, "must be >= 1")
        require(
            self.num_attention_heads >= 1,
            "ModelSpec.num_attention_heads",
            self.num_attention_heads,
            "must be >= 1",
        )
        require(
            self.num_kv_heads >= 1 and self.num_attention_heads % self.num_kv_heads == 0,
            "ModelSpec.num_kv_heads",
            self.num_kv_heads,
            f"must be >= 1 and divide num_attention_heads={self.num_attention_heads}",
        )
        names = [p.name for p in self.params]
        dupes = sorted({n for n in names if names.count(n) > 1})
        require(not dupes, "ModelSpec.params", dupes, "must have unique names")
        for p in self.params:
            if p.layer is not None:
                require(
                    0 <= p.layer < self.num_layers,
                    f"ParamSpec({p.name}).layer",
                    p.layer,
                    f"must be in [0, {self.num_layers})",
                )

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.params)

    def __getitem__(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"ModelSpec {self.name!r} has no parameter {name!r}")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def is_tied(self) -> bool:
        return any(p.tied_head for p in self.params)
