"""Layouts and boxes: which part of every tensor each (pp_rank, tp_rank) holds.

Promises:
- Boxes tile the global tensor: for every parameter, the union of the shards of one
  pipeline stage's TP ranks is the whole tensor; shards of different ranks are either
  disjoint or equal (GQA replication and replicated parameters).
- ``layer_cuts`` follow ``nereus.models``: the first layer of stages 1..pp-1; the
  default gives the first ``num_layers % pp`` stages one extra layer.
- Every function here is pure: no I/O, no torch.

Refuses:
- ``ConfigError``: a malformed layout (tp or pp < 1, cuts not strictly increasing in
  (0, num_layers), wrong number of cuts).
- ``StateError`` from ``check_layout``: a layout that does not fit the model: tp must
  divide the attention heads; with GQA, tp must divide the kv heads when tp <= kv heads,
  and be a multiple of them otherwise (kv heads are then replicated); every split dim
  must divide; pp must be <= the number of layers. The message names the constraint.

More (how it works): docs/state.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from nereus.config import require
from nereus.errors import StateError
from nereus.state.spec import ModelSpec, ParamSpec

__all__ = [
    "Box",
    "Piece",
    "Shard",
    "Layout",
    "check_layout",
    "layer_bounds",
    "holds_param",
    "param_shard",
    "box_numel",
    "box_intersect",
    "box_subtract",
    "full_box",
]

Range = tuple[int, int]
Box = tuple[Range, ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, d) for d in shape)


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= max(0, hi - lo)
    return n


def box_intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    out = []
    # conditional expressions, not max()/min(): this is the planners' innermost call
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=False):
        lo = alo if alo > blo else blo
        hi = ahi if ahi < bhi else bhi
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (at most two per dim)."""
    inter = box_intersect(a, b)
    if inter is None:
        return [a]
    out: list[Box] = []
    rest = list(a)
    for dim, ((lo, hi), (ilo, ihi)) in enumerate(zip(a, inter, strict=False)):
        if lo < ilo:
            out.append(tuple(rest[:dim]) + ((lo, ilo),) + tuple(rest[dim + 1 :]))
        if ihi < hi:
            out.append(tuple(rest[:dim]) + ((ihi, hi),) + tuple(rest[dim + 1 :]))
        rest[dim] = (ilo, ihi)
    return out


@dataclass(frozen=True)
class Piece:
    """One box of a shard: ``box`` in global coordinates, ``local`` in the shard tensor."""

    box: Box
    local: Box

    def to_local(self, sub: Box) -> Box:
        """The local box of a global ``sub``-box of this piece."""
        return tuple(
            (l0 + s0 - g0, l0 + s1 - g0)
            for (s0, s1), (g0, _), (l0, _) in zip(sub, self.box, self.local, strict=False)
        )


@dataclass(frozen=True)
class Shard:
    """What one rank holds of one parameter: its pieces and the local tensor shape."""

    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """TP x PP shape of one replica. ``cuts``: first layer of stages 1..pp-1, or () for
    the default even cut."""

    tp: int = 1
    pp: int = 1
    cuts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require(
            isinstance(self.tp, int) and self.tp >= 1,
            "Layout.tp",
            self.tp,
            "must be an integer >= 1",
        )
        require(
            isinstance(self.pp, int) and self.pp >= 1,
            "Layout.pp",
            self.pp,
            "must be an integer >= 1",
        )
        object.__setattr__(self, "cuts", tuple(self.cuts))
        if self.cuts:
            require(
                len(self.cuts) == self.pp - 1,
                "Layout.cuts",
                self.cuts,
                f"must list pp-1={self.pp - 1} layer indices",
            )
            require(
                self.cuts[0] > 0
                and all(a < b for a, b in zip(self.cuts, self.cuts[1:], strict=False)),
                "Layout.cuts",
                self.cuts,
                "must be strictly increasing and > 0",
            )

    @property
    def size(self) -> int:
        """Devices of one replica: tp * pp."""
        return self.tp * self.pp

    def position(self, index: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of the ``index``-th device of a replica (TP innermost)."""
        return divmod(index, self.tp)

    def index(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def __str__(self) -> str:
        cut = f" cuts={list(self.cuts)}" if self.cuts else ""
        return f"tp{self.tp}pp{self.pp}{cut}"


@lru_cache(maxsize=4096)
def layer_bounds(layout: Layout, num_layers: int) -> tuple[int, ...]:
    """``pp + 1`` bounds: stage s holds layers ``[bounds[s], bounds[s+1])``.

    Cached: transition DAGs ask it for every shard class of every position."""
    if layout.cuts:
        if layout.cuts[-1] >= num_layers:
            raise StateError(
                f"layout {layout}: cuts={list(layout.cuts)} must all be < num_layers={num_layers}"
            )
        return (0, *layout.cuts, num_layers)
    base, extra = divmod(num_layers, layout.pp)
    bounds = [0]
    for s in range(layout.pp):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return tuple(bounds)


def check_layout(spec: ModelSpec, layout: Layout) -> None:
    """Raise ``StateError`` naming the broken constraint if ``layout`` cannot hold ``spec``."""
    tp, heads, kv = layout.tp, spec.num_attention_heads, spec.num_kv_heads
    if heads % tp:
        raise StateError(
            f"layout {layout} for {spec.name}: tp={tp} must divide num_attention_heads={heads}"
        )
    if tp <= kv and kv % tp:
        raise StateError(
            f"layout {layout} for {spec.name}: tp={tp} must divide num_kv_heads={kv} (tp <= "
            "kv heads)"
        )
    if tp > kv and tp % kv:
        raise StateError(
            f"layout {layout} for {spec.name}: tp={tp} must be a multiple of num_kv_heads={kv} "
            "(kv heads are replicated when tp > kv heads)"
        )
    if layout.pp > spec.num_layers:
        raise StateError(
            f"layout {layout} for {spec.name}: pp={layout.pp} must be <= "
            f"num_layers={spec.num_layers}"
        )
    layer_bounds(layout, spec.num_layers)
    for p in spec.params:
        for c in p.effective_components():
            if (c.units % tp if tp <= c.units else tp % c.units) or (
                not p.components and c.units % tp
            ):
                raise StateError(
                    f"layout {layout} for {spec.name}: tp={tp} must divide {p.name} component "
                    f"{c.name!r} units={c.units} (or be a multiple of them for replicated kv heads)"
                )


def holds_param(spec: ModelSpec, layout: Layout, param: ParamSpec, pp_rank: int) -> bool:
    """Whether pipeline stage ``pp_rank`` holds ``param`` (a tied embedding is held by
    the first and the last stage)."""
    if param.stage == "embed":
        return pp_rank == 0 or (param.tied_head and pp_rank == layout.pp - 1)
    if param.stage == "head":
        return pp_rank == layout.pp - 1
    bounds = layer_bounds(layout, spec.num_layers)
    return bounds[pp_rank] <= param.layer < bounds[pp_rank + 1]  # type: ignore[operator]


@lru_cache(maxsize=65536)
def param_shard(param: ParamSpec, tp: int, tp_rank: int) -> Shard:
    """The shard of ``param`` that TP rank ``tp_rank`` of ``tp`` holds (layout checked
    beforehand by ``check_layout``)."""
    dim = param.split_dim
    if dim is None or tp == 1:
        box = full_box(param.shape)
        return Shard((Piece(box, box),), tuple(param.shape))
    ranges: list[Range] = []
    offset = 0
    for c in param.effective_components():
        unit = c.size // c.units
        if tp <= c.units:
            per = c.units // tp * unit
            lo = tp_rank * per
        else:
            per = unit
            lo = (tp_rank // (tp // c.units)) * unit
        rng = (offset + lo, offset + lo + per)
        if ranges and ranges[-1][1] == rng[0]:
            ranges[-1] = (ranges[-1][0], rng[1])
        else:
            ranges.append(rng)
        offset += c.size
    pieces = []
    local_at = 0
    for lo, hi in ranges:
        box = tuple((lo, hi) if d == dim else (0, n) for d, n in enumerate(param.shape))
        local = tuple(
            (local_at, local_at + hi - lo) if d == dim else (0, n)
            for d, n in enumerate(param.shape)
        )
        pieces.append(Piece(box, local))
        local_at += hi - lo
    shape = tuple(local_at if d == dim else n for d, n in enumerate(param.shape))
    return Shard(tuple(pieces), shape)
