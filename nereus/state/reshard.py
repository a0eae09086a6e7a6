"""Transfer plans by box intersection: what moves where to build one target EMU.

``plan_reshard(sources, target, host_of)`` lists, for every tensor of the target EMU on
every target device, where each of its elements comes from:

- a ``Keep``: the target shard is exactly a source shard on the same device and the
  caller lets the target adopt it (``reuse=True``, the source is freed afterwards):
  nothing is copied, nothing is allocated;
- a local ``Move`` (source device == target device): a memcpy, no bytes on any link;
- a remote ``Move``: ``nbytes`` cross from the source device to the target device.

The plan also carries the logical state (update counter, policy version, sample
position), which all sources must agree on, to the target.

Pure: no I/O, no torch. Refuses (``StateError``): sources that disagree on logical
state, a target tensor no source holds (or holds with another shape or dtype).

More (how it works): docs/state.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nereus.errors import StateError
from nereus.state.emu import EMU, DeviceSet, LogicalState
from nereus.state.layout import Box, Piece, Shard, box_intersect, box_numel, box_subtract
from nereus.state.spec import DTYPE_BYTES

__all__ = [
    "Move",
    "Keep",
    "ReshardPlan",
    "plan_reshard",
    "bytes_minimum",
    "common_state",
    "host_lookup",
    "PLAN_CACHE_SIZE",
]

HostOf = Callable[[int], int]
PLAN_CACHE_SIZE = 64


def host_lookup(devices: DeviceSet | HostOf | None) -> HostOf:
    """A device -> host function from a DeviceSet, a function, or None (one host)."""
    if devices is None:
        return lambda d: 0
    if isinstance(devices, DeviceSet):
        return devices.host
    return devices


@dataclass(frozen=True)
class Move:
    """Copy global ``box`` of tensor ``key`` from ``src_emu`` on ``src_device`` into the
    target's shard on ``dst_device``; ``src_box``/``dst_box`` are the local boxes."""

    src_emu: str
    src_device: int
    dst_device: int
    key: str
    box: Box
    src_box: Box
    dst_box: Box
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src_device == self.dst_device


@dataclass(frozen=True)
class Keep:
    """The target adopts ``src_emu``'s shard of ``key`` on ``device`` as it is."""

    src_emu: str
    device: int
    key: str
    nbytes: int


@dataclass(frozen=True, eq=False)
class ReshardPlan:
    """Everything needed to build ``target`` from ``sources`` (see module docstring)."""

    sources: tuple[EMU, ...]
    target: EMU
    moves: tuple[Move, ...]
    keeps: tuple[Keep, ...]
    # device -> plain part, filled by plan_part; shared by every plan of one geometry
    parts: dict[int, Any] = field(default_factory=dict, repr=False)

    @property
    def state(self) -> LogicalState:
        return self.target.state

    @property
    def bytes_moved(self) -> int:
        """Bytes that cross between devices."""
        return sum(m.nbytes for m in self.moves if not m.is_local)

    @property
    def bytes_local(self) -> int:
        return sum(m.nbytes for m in self.moves if m.is_local)

    @property
    def bytes_kept(self) -> int:
        return sum(k.nbytes for k in self.keeps)

    def devices(self) -> tuple[int, ...]:
        """Every device that sends or receives, sorted."""
        out = set(self.target.devices)
        out.update(m.src_device for m in self.moves)
        return tuple(sorted(out))

    def remote_moves(self) -> list[Move]:
        return [m for m in self.moves if not m.is_local]


def common_state(sources: Sequence[EMU]) -> LogicalState:
    """The logical state every source agrees on."""
    if not sources:
        raise StateError("a plan needs at least one source EMU")
    states = {s.state for s in sources}
    if len(states) > 1:
        detail = ", ".join(f"{s.name}: {s.state}" for s in sources)
        raise StateError(f"source EMUs disagree on logical state ({detail}); refusing to pick one")
    return sources[0].state


# One device of one source EMU: (emu, device, (pp_rank, tp_rank)).
_Slot = tuple[EMU, int, tuple[int, int]]
# What a source slot holds of one key: (slot index, shard, dtype).
_Held = tuple[int, Shard, str]
# One copy into a target shard: (index into the key's _Held list, global box, source
# local box, target local box, elements, whether it crosses devices).
_Step = tuple[int, Box, Box, Box, int, bool]
# A load comparison a source choice rested on: (winner, its pending bytes, rival, its
# pending bytes): the winner's (load + pending, device) was below the rival's.
_Guard = tuple[int, int, int, int]


def _source_index(
    sources: Sequence[EMU], keys: Iterable[str]
) -> tuple[list[_Slot], dict[str, list[_Held]]]:
    """Every source device as a slot, and per wanted key what each slot holds of it
    (in source, then device order: the order sources are tried in)."""
    wanted = set(keys)
    slots: list[_Slot] = []
    held: dict[str, list[_Held]] = defaultdict(list)
    for emu in sources:
        for i, device in enumerate(emu.devices):
            slot = len(slots)
            slots.append((emu, device, emu.layout.position(i)))
            for key, (shard, dtype) in emu.shards_on(device).items():
                if key in wanted:
                    held[key].append((slot, shard, dtype))
    return slots, held


def _by_box(cands: list[tuple[int, Piece]]) -> list[tuple[Box, list[tuple[int, Piece]]]]:
    """Source pieces grouped by their global box: replicas are intersected once."""
    groups: dict[Box, list[tuple[int, Piece]]] = {}
    for c in cands:
        groups.setdefault(c[1].box, []).append(c)
    return list(groups.items())


class _Planner:
    """The working state of one ``plan_reshard`` call.

    Most target shards repeat a geometry: every layer's ``q_proj`` is cut the same way
    and held by the same source devices. The steps of a shard (which source piece fills
    which box) follow from that geometry and the target device, except where source
    devices tie on tier and alignment: there the load so far picks one. So steps are
    computed once per geometry together with the load comparisons that picked them
    (guards), and replayed for every later shard of that geometry whose current load
    passes the same comparisons; otherwise they are computed again (another variant)."""

    def __init__(self, sources: Sequence[EMU], target: EMU, host_of: HostOf, reuse: bool):
        self.target = target
        self.host_of = host_of
        self.reuse = reuse
        self.names = [s.name for s in sources]
        self.slots, self.held = _source_index(sources, target.keys())
        self.load: dict[int, int] = defaultdict(int)
        self.source_geometry: dict[str, int] = {}
        self.geometry_ids: dict[tuple[tuple[int, Shard], ...], int] = {}
        self.memo: dict[tuple, list[tuple[list[_Guard], list[_Step]]]] = {}
        self.moves: list[Move] = []
        self.keeps: list[Keep] = []

    def plan_device(self, t_index: int, device: int) -> None:
        for key, (shard, dtype) in self.target.shards_on(device).items():
            self._plan_shard(t_index, device, key, shard, dtype)

    def _plan_shard(self, t_index: int, device: int, key: str, shard: Shard, dtype: str) -> None:
        held = self.held.get(key, [])
        itemsize = DTYPE_BYTES[dtype]
        if self.reuse:
            for slot, src_shard, src_dtype in held:
                if self.slots[slot][1] == device and src_shard == shard and src_dtype == dtype:
                    self.keeps.append(
                        Keep(self.slots[slot][0].name, device, key, shard.numel * itemsize)
                    )
                    return
        geometry = (t_index, itemsize, shard, self._source_geometry(key, dtype, held))
        variants = self.memo.setdefault(geometry, [])
        steps = next(
            (steps for guards, steps in variants if not guards or self._holds(guards)), None
        )
        if steps is None:
            guards, steps = self._steps(t_index, device, key, shard, held, itemsize)
            variants.append((guards, steps))
        for h, box, src_box, dst_box, numel, remote in steps:
            emu, src_dev, _ = self.slots[held[h][0]]
            nbytes = numel * itemsize
            if remote:
                self.load[src_dev] += nbytes
            self.moves.append(Move(emu.name, src_dev, device, key, box, src_box, dst_box, nbytes))

    def _source_geometry(self, key: str, dtype: str, held: list[_Held]) -> int:
        """An id for how the sources hold ``key`` (the same for every key cut the same
        way on the same devices); refuses a source that holds it in another dtype."""
        gid = self.source_geometry.get(key)
        if gid is None:
            for slot, _, src_dtype in held:
                if src_dtype != dtype:
                    raise StateError(
                        f"{key}: source {self.slots[slot][0].name} holds dtype {src_dtype}, "
                        f"target {self.target.name} needs {dtype}"
                    )
            shards = tuple((slot, src_shard) for slot, src_shard, _ in held)
            gid = self.source_geometry[key] = self.geometry_ids.setdefault(
                shards, len(self.geometry_ids)
            )
        return gid

    def _holds(self, guards: list[_Guard]) -> bool:
        """Whether the current load makes the same choices these guards recorded."""
        load = self.load
        return all(
            (load[w] + w_pending, w) < (load[r] + r_pending, r)
            for w, w_pending, r, r_pending in guards
        )

    def _steps(
        self, t_index: int, device: int, key: str, shard: Shard, held: list[_Held], itemsize: int
    ) -> tuple[list[_Guard], list[_Step]]:
        """The steps filling ``shard`` on ``device``, and the load comparisons they rest on."""
        target, slots = self.target, self.slots
        t_pos = target.layout.position(t_index)
        host = self.host_of(device)
        cands = [(h, sp) for h, (_, src_shard, _) in enumerate(held) for sp in src_shard.pieces]
        local = [c for c in cands if slots[held[c[0]][0]][1] == device]
        groups = None
        # this shard's own remote bytes so far: they count towards the load it is balanced on
        pending: dict[int, int] = defaultdict(int)
        guards: list[_Guard] = []
        steps: list[_Step] = []
        for piece in shard.pieces:
            need = [piece.box]
            # 1. whatever the target device already holds
            for h, sp in local:
                still: list[Box] = []
                for box in need:
                    inter = box_intersect(box, sp.box)
                    if inter is None:
                        still.append(box)
                        continue
                    steps.append(
                        (
                            h,
                            inter,
                            sp.to_local(inter),
                            piece.to_local(inter),
                            box_numel(inter),
                            False,
                        )
                    )
                    still.extend(box_subtract(box, inter))
                need = still
            # 2. the rest from the best remote source
            if need and groups is None:
                groups = _by_box(cands)
            while need:
                box = need.pop()
                best = None
                ranked: list[tuple[tuple[int, int], int]] = []
                for gbox, members in groups or ():
                    inter = box_intersect(box, gbox)
                    if inter is None:
                        continue
                    for h, sp in members:
                        emu, src_dev, s_pos = slots[held[h][0]]
                        if src_dev == device:
                            continue
                        aligned = s_pos == t_pos and emu.layout == target.layout
                        tier = (0 if self.host_of(src_dev) == host else 1, 0 if aligned else 1)
                        ranked.append((tier, src_dev))
                        rank = (*tier, self.load[src_dev] + pending[src_dev], src_dev)
                        if best is None or rank < best[0]:
                            best = (rank, h, sp, inter)
                if best is None:
                    raise StateError(
                        f"no source EMU ({', '.join(self.names)}) holds {key} box {list(box)} "
                        f"needed by {target.name} on device {device}"
                    )
                _, h, sp, inter = best
                winner = slots[held[h][0]][1]
                # devices tied with the winner on tier and alignment lost on load
                top = min(tier for tier, _ in ranked)
                rivals = sorted({d for tier, d in ranked if tier == top and d != winner})
                guards.extend((winner, pending[winner], r, pending[r]) for r in rivals)
                numel = box_numel(inter)
                pending[winner] += numel * itemsize
                steps.append((h, inter, sp.to_local(inter), piece.to_local(inter), numel, True))
                need.extend(box_subtract(box, inter))
        return guards, steps


def plan_reshard(
    sources: Sequence[EMU],
    target: EMU,
    devices: DeviceSet | HostOf | None = None,
    *,
    reuse: bool = False,
) -> ReshardPlan:
    """Plan building ``target`` from ``sources`` with the fewest bytes between devices.

    ``devices`` gives each device's host (a DeviceSet or a function; None: one host).
    ``reuse`` lets a target adopt a source shard that is identical and on the same
    device (only when that source is freed after the plan runs). The returned plan's
    ``target`` carries the sources' logical state."""
    host_of = host_lookup(devices)
    state = common_state(sources)
    target = target.with_(state=state) if target.state != state else target
    names = [s.name for s in sources]
    if target.name in names or len(set(names)) != len(names):
        raise StateError(f"EMU names must be distinct: target {target.name!r}, sources {names}")
    key = _geometry_key(sources, target, host_of, reuse)
    hit = _plans.pop(key, None)
    if hit is None:
        planner = _Planner(sources, target, host_of, reuse)
        for t_index, device in enumerate(target.devices):
            planner.plan_device(t_index, device)
        hit = (tuple(planner.moves), tuple(planner.keeps), {})
    _plans[key] = hit  # most recent last
    while len(_plans) > PLAN_CACHE_SIZE:
        _plans.pop(next(iter(_plans)), None)
    moves, keeps, parts = hit
    return ReshardPlan(tuple(sources), target, moves, keeps, parts)


_plans: dict[tuple, tuple[tuple[Move, ...], tuple[Keep, ...], dict[int, Any]]] = {}


def _geometry_key(sources: Sequence[EMU], target: EMU, host_of: HostOf, reuse: bool) -> tuple:
    """Everything a plan depends on: the EMUs without their logical state, the host
    of every device involved, and ``reuse``."""
    emus = (*sources, target)
    devices = sorted({d for e in emus for d in e.devices})
    return (
        tuple((e.name, e.spec, e.layout, e.devices, e.slots) for e in emus),
        tuple(host_of(d) for d in devices),
        reuse,
    )


def bytes_minimum(sources: Sequence[EMU], target: EMU) -> int:
    """Analytic minimum: bytes of every target box not already held on its device by
    some source (the bytes any plan must move between devices)."""
    total = 0
    for device in target.devices:
        local = [
            (k, p.box)
            for s in sources
            if device in s.devices
            for k, (sh, _) in s.shards_on(device).items()
            for p in sh.pieces
        ]
        held: dict[str, list[Box]] = defaultdict(list)
        for k, b in local:
            held[k].append(b)
        for key, (shard, dtype) in target.shards_on(device).items():
            for piece in shard.pieces:
                rest = [piece.box]
                for b in held.get(key, ()):
                    rest = [r for x in rest for r in box_subtract(x, b)]
                total += sum(box_numel(r) for r in rest) * DTYPE_BYTES[dtype]
    return total
