"""Analytic bytes of EMUs and primitives: what the transition DAG prices, at any scale.

``SpecBytes(spec, slots)`` answers, without building a reshard plan, the questions a
primitive's memory effect and traffic depend on, for one position of one layout
(``(pp_rank, tp_rank)``) against another on the same device:

- ``held(layout, pos)``: bytes that position holds (every slot: a training EMU's
  parameters and float32 optimizer slots);
- ``local(a, pos_a, b, pos_b)``: bytes of ``b``'s shards at ``pos_b`` already held by
  ``a``'s shards at ``pos_a`` (box intersection per parameter): the part a target need
  not receive;
- ``kept(a, pos_a, b, pos_b)``: bytes of ``b``'s shards identical to ``a``'s (a target
  adopts those when its source is freed: nothing is allocated for them).

Parameters are grouped into classes (a decoder layer's ``q_proj`` is one class over
every layer that holds it), so a question costs one pass over a dozen classes rather
than over every parameter, and answers are memoized per (layout, position) pair within
one ``SpecBytes``. The answers equal ``nereus.state.plan_reshard``'s ``bytes_moved`` and
the state layer's memory effects (a property test holds them to it).

Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nereus.state.layout import Layout, box_intersect, box_numel, layer_bounds, param_shard
from nereus.state.spec import DTYPE_BYTES, SLOT_DTYPE, ModelSpec, ParamSpec

__all__ = ["SpecBytes", "Pos"]

Pos = tuple[int, int]  # (pp_rank, tp_rank)


@dataclass(frozen=True)
class _Class:
    """Parameters alike but for their layer: a representative and where they sit."""

    param: ParamSpec
    stage: str  # embed, layer, head
    layers: tuple[int, ...]  # for stage == "layer": the layers holding one
    tied_head: bool


class SpecBytes:
    """Bytes per layout position of one model's EMUs with ``slots`` (see module doc)."""

    def __init__(self, spec: ModelSpec, slots: Sequence[str] = ("param",)) -> None:
        self.spec = spec
        self.slots = tuple(slots)
        classes: dict[tuple, list[ParamSpec]] = {}
        for p in spec.params:
            local = p.name.split(".", 3)[-1] if p.stage == "layer" else p.name
            key = (p.stage, local, p.shape, p.rule, p.components, p.tied_head, p.dtype)
            classes.setdefault(key, []).append(p)
        self.classes = [
            _Class(ps[0], ps[0].stage, tuple(sorted(p.layer for p in ps if p.layer is not None)), ps[0].tied_head)
            for ps in classes.values()]
        self._memo: dict[tuple, int] = {}

    def _itemsize(self, p: ParamSpec) -> int:
        return sum(DTYPE_BYTES[p.dtype if s == "param" else SLOT_DTYPE[s]] for s in self.slots)

    def _count(self, c: _Class, layout: Layout, pp_rank: int) -> int:
        """How many parameters of class ``c`` pipeline stage ``pp_rank`` holds."""
        if c.stage == "embed":
            return 1 if pp_rank == 0 or (c.tied_head and pp_rank == layout.pp - 1) else 0
        if c.stage == "head":
            return 1 if pp_rank == layout.pp - 1 else 0
        lo, hi = layer_bounds(layout, self.spec.num_layers)[pp_rank:pp_rank + 2]
        return sum(1 for layer in c.layers if lo <= layer < hi)

    def _both(self, c: _Class, a: Layout, pa: int, b: Layout, pb: int) -> int:
        """How many parameters of class ``c`` both stage ``pa`` of ``a`` and ``pb`` of ``b`` hold."""
        if c.stage != "layer":
            return min(self._count(c, a, pa), self._count(c, b, pb))
        alo, ahi = layer_bounds(a, self.spec.num_layers)[pa:pa + 2]
        blo, bhi = layer_bounds(b, self.spec.num_layers)[pb:pb + 2]
        lo, hi = max(alo, blo), min(ahi, bhi)
        return sum(1 for layer in c.layers if lo <= layer < hi)

    def held(self, layout: Layout, pos: Pos) -> int:
        """Bytes position ``pos`` of ``layout`` holds."""
        key = ("held", layout, pos)
        got = self._memo.get(key)
        if got is None:
            pp_rank, tp_rank = pos
            got = 0
            for c in self.classes:
                n = self._count(c, layout, pp_rank)
                if n:
                    got += n * param_shard(c.param, layout.tp, tp_rank).numel * self._itemsize(c.param)
            self._memo[key] = got
        return got

    def local(self, a: Layout, pos_a: Pos, b: Layout, pos_b: Pos) -> int:
        """Bytes of ``b``'s shards at ``pos_b`` that ``a``'s shards at ``pos_a`` hold."""
        key = ("local", a, pos_a, b, pos_b)
        got = self._memo.get(key)
        if got is None:
            got = 0
            for c in self.classes:
                n = self._both(c, a, pos_a[0], b, pos_b[0])
                if n:
                    sa = param_shard(c.param, a.tp, pos_a[1])
                    sb = param_shard(c.param, b.tp, pos_b[1])
                    common = 0
                    for pb in sb.pieces:
                        for pa in sa.pieces:
                            inter = box_intersect(pb.box, pa.box)
                            if inter is not None:
                                common += box_numel(inter)
                    got += n * common * self._itemsize(c.param)
            self._memo[key] = got
        return got

    def kept(self, a: Layout, pos_a: Pos, b: Layout, pos_b: Pos) -> int:
        """Bytes of ``b``'s shards at ``pos_b`` identical to ``a``'s shards at ``pos_a``."""
        key = ("kept", a, pos_a, b, pos_b)
        got = self._memo.get(key)
        if got is None:
            got = 0
            for c in self.classes:
                n = self._both(c, a, pos_a[0], b, pos_b[0])
                if n:
                    sb = param_shard(c.param, b.tp, pos_b[1])
                    if param_shard(c.param, a.tp, pos_a[1]) == sb:
                        got += n * sb.numel * self._itemsize(c.param)
            self._memo[key] = got
        return got
