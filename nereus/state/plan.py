"""Transfer plans by box intersection: what moves where to build one target EMU.

``plan_reshard(sources, target, host_of)`` lists, for every tensor of the target EMU on
every target device, where each of its elements comes from:

- a ``Keep``: the target shard is exactly a source shard on the same device and the
  caller lets the target adopt it (``reuse=True``, the source is freed afterwards):
  nothing is copied, nothing is allocated;
- a local ``Move`` (source device == target device): a memcpy, no bytes on any link;
- a remote ``Move``: ``nbytes`` cross from the source device to the target device.

All of it is computed in global coordinates: each target piece first takes what the
sources on its own device hold; only the rest is fetched, each remaining box from
the source whose device is best by tier (same host, then another host), then
rank-aligned (the same (pp, tp) position in the same layout: Extend's pairs), then
least loaded so far (load-balanced across source replicas). So ``bytes_moved`` equals
``bytes_minimum``: the bytes of every target box not already on its device.

The plan also carries the logical state (update counter, policy version, sample
position), which all sources must agree on, to the target.

Pure: no I/O, no torch. Refuses (``StateError``): sources that disagree on logical
state, a target tensor no source holds (or holds with another shape or dtype).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from nereus.errors import StateError
from nereus.state.emu import EMU, DeviceSet, LogicalState
from nereus.state.layout import Box, Piece, box_intersect, box_numel, box_subtract
from nereus.state.spec import DTYPE_BYTES

__all__ = ["Move", "Keep", "ReshardPlan", "plan_reshard", "bytes_minimum", "common_state", "host_lookup"]

HostOf = Callable[[int], int]


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


def _source_index(sources: Sequence[EMU], keys: Iterable[str]) -> dict[str, list[tuple[EMU, int, Piece, str, tuple]]]:
    wanted = set(keys)
    index: dict[str, list[tuple[EMU, int, Piece, str, tuple]]] = defaultdict(list)
    for emu in sources:
        for i, device in enumerate(emu.devices):
            pos = emu.layout.position(i)
            for key, (shard, dtype) in emu.shards_on(device).items():
                if key in wanted:
                    for piece in shard.pieces:
                        index[key].append((emu, device, piece, dtype, (shard, pos)))
    return index


def _by_box(cands: list) -> list[tuple[Box, list]]:
    """Source pieces grouped by their global box: replicas are intersected once."""
    groups: dict[Box, list] = {}
    for c in cands:
        groups.setdefault(c[2].box, []).append(c)
    return list(groups.items())


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
    index = _source_index(sources, target.keys())
    on_device: dict[tuple[str, int], list] = defaultdict(list)
    for key, cands in index.items():
        for c in cands:
            on_device[key, c[1]].append(c)
    load: dict[int, int] = defaultdict(int)
    moves: list[Move] = []
    keeps: list[Keep] = []
    for t_index, device in enumerate(target.devices):
        t_pos = target.layout.position(t_index)
        host = host_of(device)
        for key, (shard, dtype) in target.shards_on(device).items():
            cands = index.get(key, [])
            itemsize = DTYPE_BYTES[dtype]
            local = on_device.get((key, device), [])
            if reuse:
                same = [c for c in local if c[4][0] == shard and c[3] == dtype]
                if same:
                    keeps.append(Keep(same[0][0].name, device, key, shard.numel * itemsize))
                    continue
            groups = None
            for c in cands:
                if c[3] != dtype:
                    raise StateError(f"{key}: source {c[0].name} holds dtype {c[3]}, target {target.name} needs {dtype}")
            for piece in shard.pieces:
                need = [piece.box]
                # 1. whatever the target device already holds
                for emu, _, sp, _, _ in local:
                    still: list[Box] = []
                    for box in need:
                        inter = box_intersect(box, sp.box)
                        if inter is None:
                            still.append(box)
                            continue
                        moves.append(Move(emu.name, device, device, key, inter, sp.to_local(inter),
                                          piece.to_local(inter), box_numel(inter) * itemsize))
                        still.extend(box_subtract(box, inter))
                    need = still
                # 2. the rest from the best remote source
                if need and groups is None:
                    groups = _by_box(cands)
                while need:
                    box = need.pop()
                    best = None
                    for gbox, members in groups or ():
                        inter = box_intersect(box, gbox)
                        if inter is None:
                            continue
                        for emu, src_dev, sp, _, (_, s_pos) in members:
                            if src_dev == device:
                                continue
                            aligned = s_pos == t_pos and emu.layout == target.layout
                            rank = (0 if host_of(src_dev) == host else 1, 0 if aligned else 1, load[src_dev], src_dev)
                            if best is None or rank < best[0]:
                                best = (rank, emu, src_dev, sp, inter)
                    if best is None:
                        raise StateError(
                            f"no source EMU ({', '.join(names)}) holds {key} box {list(box)} "
                            f"needed by {target.name} on device {device}"
                        )
                    _, emu, src_dev, sp, inter = best
                    nbytes = box_numel(inter) * itemsize
                    load[src_dev] += nbytes
                    moves.append(Move(emu.name, src_dev, device, key, inter, sp.to_local(inter),
                                      piece.to_local(inter), nbytes))
                    need.extend(box_subtract(box, inter))
    return ReshardPlan(tuple(sources), target, tuple(moves), tuple(keeps))


def bytes_minimum(sources: Sequence[EMU], target: EMU) -> int:
    """Analytic minimum: bytes of every target box not already held on its device by
    some source (the bytes any plan must move between devices)."""
    total = 0
    for device in target.devices:
        local = [(k, p.box) for s in sources if device in s.devices
                 for k, (sh, _) in s.shards_on(device).items() for p in sh.pieces]
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
