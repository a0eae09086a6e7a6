"""Analytic bytes of EMUs and primitives: what the transition DAG prices, at any scale.

``SpecBytes(spec, slots)`` answers, without building a reshard plan, the questions a
primitive's memory effect and traffic depend on, for one position of one layout
(``(pp_rank, tp_rank)``) against another on the same device:

- ``held(layout, pos)``: bytes that position holds (every slot: a training EMU's
  parameters and float32 optimizer slots);
- ``local(a, pos_a, b, pos_b)``: bytes of ``b``'s shards at ``pos_b`` already held by
  ``a``'s shards at ``pos_a`` (the part a target need not receive);
- ``kept(a, pos_a, b, pos_b)``: bytes of ``b``'s shards identical to ``a``'s (a target
  adopts those when its source is freed: nothing is allocated for them).

Pure: no torch, no I/O.

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from operator import itemgetter

from nereus.state.layout import Layout, layer_bounds
from nereus.state.spec import DTYPE_BYTES, SLOT_DTYPE, ModelSpec, ParamSpec

__all__ = ["SpecBytes", "Pos"]

Pos = tuple[int, int]  # (pp_rank, tp_rank)


class _Class:
    """Parameters alike but for their layer: shard geometry and dtype."""

    __slots__ = ("numel", "other", "comps", "dtype")

    def __init__(self, p: ParamSpec) -> None:
        shape = p.shape
        numel = 1
        for n in shape:
            numel *= n
        self.numel = numel
        self.dtype = p.dtype
        dim = 1 if p.rule == "row" else None if p.rule == "replicated" else 0  # ParamSpec.split_dim
        if dim is None or not shape[dim]:
            self.comps: tuple[tuple[int, int], ...] = ()  # every rank holds all of it
            self.other = numel
        else:
            self.other = numel // shape[dim]
            # ParamSpec.effective_components: a plain split parameter's units are its rows
            self.comps = (
                tuple((c.size, c.units) for c in p.components)
                if p.components
                else ((shape[dim], shape[dim]),)
            )

    def intervals(self, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
        """The interval of each component that rank ``rank`` of ``tp`` holds."""
        out = []
        for size, units in self.comps:
            t = tp if tp < units else units
            per = size // t
            lo = (rank // (tp // t)) * per
            out.append((lo, lo + per))
        return tuple(out)

    def shard_numel(self, tp: int) -> int:
        if not self.comps or tp == 1:
            return self.numel
        return sum(size // (tp if tp < units else units) for size, units in self.comps) * self.other


class _Group:
    """Classes held by the same pipeline positions: the embedding, the head, or the
    layers ``layers`` (every layer once when ``every_layer``)."""

    __slots__ = ("stage", "tied_head", "layers", "every_layer", "classes", "units")

    def __init__(
        self, stage: str, tied_head: bool, layers: tuple[int, ...], num_layers: int
    ) -> None:
        self.stage, self.tied_head, self.layers = stage, tied_head, layers
        self.every_layer = layers == tuple(range(num_layers))
        self.classes: list[_Class] = []
        self.units = 0  # the fewest units of any component: up to this TP, shards nest

    def add(self, c: _Class, times: int) -> None:
        self.classes.extend([c] * times)
        if c.comps:
            least = min([u for _, u in c.comps])
            if least and (not self.units or least < self.units):
                self.units = least


class _Shape:
    """What every ``SpecBytes`` of one spec shares, whatever its slots: the groups and
    the elements a position holds per group (by dtype), memoized."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.groups = _group(spec)
        self.num_layers = spec.num_layers
        # up to this TP every group's shards nest
        self.units = min((g.units for g in self.groups if g.units), default=1 << 62)
        self.numel: dict[tuple, dict[str, int]] = {}
        self.bounds: dict[tuple, tuple[int, ...]] = {}

    def group_numel(self, g: _Group, tp: int, whole_only: bool = False) -> dict[str, int]:
        """Elements per dtype one position holds of ``g``'s classes at ``tp`` (with
        ``whole_only``: of the classes every rank holds whole)."""
        key = (id(g), tp, whole_only)
        got = self.numel.get(key)
        if got is None:
            got = self.numel[key] = {}
            for c in g.classes:
                if not (whole_only and c.comps):
                    got[c.dtype] = got.get(c.dtype, 0) + c.shard_numel(tp)
        return got

    def layer_range(self, pp: int, cuts: tuple[int, ...], pp_rank: int) -> tuple[int, int]:
        bounds = self.bounds.get((pp, cuts))
        if bounds is None:
            bounds = self.bounds[(pp, cuts)] = layer_bounds(Layout(1, pp, cuts), self.num_layers)
        return bounds[pp_rank], bounds[pp_rank + 1]


class SpecBytes:
    """Bytes per layout position of one model's EMUs with ``slots`` (see module doc)."""

    def __init__(
        self, spec: ModelSpec, slots: Sequence[str] = ("param",), *, _shape: _Shape | None = None
    ) -> None:
        self.spec = spec
        self.slots = tuple(slots)
        self.shape = _shape if _shape is not None else _Shape(spec)
        self.groups = self.shape.groups
        self._itemsize: dict[str, int] = {}
        self._memo: dict[tuple, int] = {}
        self._gbytes: dict[tuple, int] = {}

    def with_slots(self, slots: Sequence[str]) -> SpecBytes:
        """The same spec's bytes for other slots (the classes are shared)."""
        return SpecBytes(self.spec, slots, _shape=self.shape)

    def itemsize(self, dtype: str) -> int:
        got = self._itemsize.get(dtype)
        if got is None:
            got = self._itemsize[dtype] = sum(
                DTYPE_BYTES[dtype if s == "param" else SLOT_DTYPE[s]] for s in self.slots
            )
        return got

    def _group_bytes(self, g: _Group, tp: int, whole_only: bool = False) -> int:
        """Bytes one position holds of ``g``'s classes at ``tp`` (``_Shape.group_numel``)."""
        key = (id(g), tp, whole_only)
        got = self._gbytes.get(key)
        if got is None:
            got = self._gbytes[key] = sum(
                n * self.itemsize(d) for d, n in self.shape.group_numel(g, tp, whole_only).items()
            )
        return got

    def _count(
        self,
        g: _Group,
        pa: int,
        ppa: int,
        cutsa: tuple,
        pb: int = -1,
        ppb: int = 0,
        cutsb: tuple = (),
    ) -> int:
        """How many of ``g``'s positions stage ``pa`` of a layout with ``ppa`` stages (and
        stage ``pb`` of one with ``ppb``) hold."""
        if g.stage != "layer":
            first = g.stage == "embed"
            if first:
                a = pa == 0 or (g.tied_head and pa == ppa - 1)
                b = pb < 0 or pb == 0 or (g.tied_head and pb == ppb - 1)
            else:
                a, b = pa == ppa - 1, pb < 0 or pb == ppb - 1
            return 1 if a and b else 0
        lo, hi = self.shape.layer_range(ppa, cutsa, pa)
        if pb >= 0:
            blo, bhi = self.shape.layer_range(ppb, cutsb, pb)
            lo, hi = (lo if lo > blo else blo), (hi if hi < bhi else bhi)
        if hi <= lo:
            return 0
        if g.every_layer:
            return hi - lo
        return bisect_left(g.layers, hi) - bisect_left(g.layers, lo)

    def _per_group(self, kind: str, g: _Group, ta: int, ra: int, tb: int, rb: int) -> int:
        if ta == tb and ra == rb:  # the same shards: all of it is there, and kept
            return self._group_bytes(g, tb)
        if not g.units or max(ta, tb) <= g.units:
            # every rank holds an interval of tp equal parts of each component (nested
            # across powers of two): the finer shard lies inside the coarser one or they do
            # not meet, and shards of two TP degrees are never identical
            if kind == "local" and (ra // (ta // tb) == rb if ta >= tb else rb // (tb // ta) == ra):
                return self._group_bytes(g, max(ta, tb))
            return self._group_bytes(g, 1, True)
        key = (kind, id(g), ta, ra, tb, rb)
        got = self._memo.get(key)
        if got is not None:
            return got
        got = 0
        for c in g.classes:
            size = self.itemsize(c.dtype)
            if not c.comps or (ta == 1 and tb == 1):
                got += c.numel * size
            elif kind == "kept":
                if c.intervals(ta, ra) == c.intervals(tb, rb):
                    got += c.shard_numel(tb) * size
            else:  # local: the intersection of the two shards
                common = 0
                for (alo, ahi), (blo, bhi) in zip(
                    c.intervals(ta, ra), c.intervals(tb, rb), strict=True
                ):
                    lo, hi = (alo if alo > blo else blo), (ahi if ahi < bhi else bhi)
                    if hi > lo:
                        common += hi - lo
                got += common * c.other * size
        self._memo[key] = got
        return got

    def held(self, layout: Layout, pos: Pos) -> int:
        """Bytes position ``pos`` of ``layout`` holds (the same for every TP rank)."""
        return self.held_ranks(layout.tp, layout.pp, layout.cuts)[pos[0]]

    def held_ranks(self, tp: int, pp: int, cuts: tuple[int, ...]) -> tuple[int, ...]:
        """``held`` of every pipeline stage of a ``tp`` x ``pp`` layout cut at ``cuts``."""
        key = (tp, pp, cuts)
        got = self._memo.get(key)
        if got is None:
            per_group = [(g, self._group_bytes(g, tp)) for g in self.groups]
            got = self._memo[key] = tuple(
                sum(n * b for g, b in per_group if (n := self._count(g, r, pp, cuts)))
                for r in range(pp)
            )
        return got

    def local_kept(self, a: Layout, pos_a: Pos, b: Layout, pos_b: Pos) -> tuple[int, int]:
        """``(local, kept)``: the bytes of ``b``'s shards at ``pos_b`` that ``a``'s shards
        at ``pos_a`` hold, and those identical to them."""
        ta, ra, tb, rb = a.tp, pos_a[1], b.tp, pos_b[1]
        if ta == tb and ra == rb:
            ranks: tuple = ()
        elif max(ta, tb) <= self.shape.units:  # see _per_group: only whether the shards nest counts
            ranks = (ra // (ta // tb) == rb if ta >= tb else rb // (tb // ta) == ra,)
        else:
            ranks = (ra, rb)
        ppa, ppb, ca, cb = a.pp, b.pp, a.cuts, b.cuts
        key = (ta, ppa, ca, pos_a[0], tb, ppb, cb, pos_b[0], ranks)
        got = self._memo.get(key)
        if got is None:
            local = kept = 0
            for g in self.groups:
                n = self._count(g, pos_a[0], ppa, ca, pos_b[0], ppb, cb)
                if n:
                    local += n * self._per_group("local", g, ta, ra, tb, rb)
                    kept += n * self._per_group("kept", g, ta, ra, tb, rb)
            got = self._memo[key] = (local, kept)
        return got

    def local(self, a: Layout, pos_a: Pos, b: Layout, pos_b: Pos) -> int:
        """Bytes of ``b``'s shards at ``pos_b`` that ``a``'s shards at ``pos_a`` hold."""
        return self.local_kept(a, pos_a, b, pos_b)[0]

    def kept(self, a: Layout, pos_a: Pos, b: Layout, pos_b: Pos) -> int:
        """Bytes of ``b``'s shards at ``pos_b`` identical to ``a``'s shards at ``pos_a``."""
        return self.local_kept(a, pos_a, b, pos_b)[1]


def _group(spec: ModelSpec) -> list[_Group]:
    """Classes of ``spec``'s parameters, grouped by the positions that hold them."""
    fast = _repeating(spec)
    if fast is not None:
        return fast
    params = spec.params
    keys = [(p.stage, p.rule, p.shape, p.dtype, p.tied_head) for p in params]
    by_key: dict[tuple, list[tuple[ParamSpec, list[int | None]]]] = {}
    for key, p in zip(keys, params, strict=True):
        found = by_key.get(key)
        if found is None:
            by_key[key] = [(p, [p.layer])]
            continue
        for rep, layers in found:  # components decide the shard too
            if rep.components == p.components:
                layers.append(p.layer)
                break
        else:
            found.append((p, [p.layer]))
    groups: dict[tuple, _Group] = {}
    for (stage, _, _, _, tied), members in by_key.items():
        for rep, layers in members:
            times = len(layers)  # an embedding or head parameter listed n times counts n times
            at: tuple[int, ...] = ()
            if stage == "layer":
                at = tuple(sorted(layers))  # type: ignore[type-var]
                n = spec.num_layers
                if len(at) % n == 0 and at == tuple(
                    x for x in range(n) for _ in range(len(at) // n)
                ):
                    at, times = tuple(range(n)), len(at) // n  # k alike parameters in every layer
                else:
                    times = 1
            _group_of(groups, stage, tied, at, spec.num_layers).add(_Class(rep), times)
    return list(groups.values())


# what sets a decoder layer parameter's shard and bytes besides its layer (its stage is
# "layer" exactly when it has a layer, and only an embedding is a tied head: ParamSpec)
_KEY = itemgetter("rule", "shape", "dtype", "components")
_LAYER = itemgetter("layer")


def _repeating(spec: ModelSpec) -> list[_Group] | None:
    """``_group``'s answer read off the first layer, when the layers are listed one
    after another and every layer's parameters are alike (the decoders of
    ``nereus.models``); else None. Checked by comparing lists of the parameters'
    fields (their ``__dict__``s), not parameter by parameter (``nereus.models`` shares
    one components tuple between a config's layers, so those compare at once)."""
    params, n = spec.params, spec.num_layers
    fields = list(map(vars, params))
    layers = list(map(_LAYER, fields))
    first = next((i for i, layer in enumerate(layers) if layer is not None), None)
    if first is None:
        return None
    end = len(params)
    while layers[end - 1] is None:
        end -= 1
    count = end - first
    if count % n:
        return None
    q = count // n
    block, every = layers[first:end], list(range(n))
    if any(
        block[j::q] != every for j in range(q)
    ):  # the j-th parameter of every layer, in layer order
        return None
    rows = list(map(_KEY, fields[first:end]))
    if rows[q:] != rows[:-q]:
        return None
    # here a group is known by its stage and tie alone (every layer parameter sits in
    # every layer): keyed so, not by the layers as _group_of does
    groups: dict[tuple, _Group] = {}
    every_layer = tuple(every)
    for p in (*params[:first], *params[first : first + q], *params[first + count :]):
        stage, tied = p.stage, p.tied_head
        g = groups.get((stage, tied))
        if g is None:
            g = groups[(stage, tied)] = _Group(
                stage, tied, every_layer if stage == "layer" else (), n
            )
        g.add(_Class(p), 1)
    return list(groups.values())


def _group_of(
    groups: dict[tuple, _Group], stage: str, tied: bool, layers: tuple[int, ...], num_layers: int
) -> _Group:
    key = (stage, tied, layers)
    g = groups.get(key)
    if g is None:
        g = groups[key] = _Group(stage, tied, layers, num_layers)
    return g
