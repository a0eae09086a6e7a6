"""Classes of devices that are alike for a whole transition DAG.

Two devices are alike when they have the same memory cap, the same resident bytes and,
for every model-stage, the same role (what it holds there before the transition and what
each of its nodes allocates, releases and receives there). Every node then either
touches all devices of a class, with the same effect on each, or none of them; so the
scheduler counts bytes per class, and a device's bytes are its class's bytes. A DAG whose
model-stages repeat (``nereus.transition._regular``) has a few dozen classes over a
thousand devices; one put together node by node has a class per device.

A class is *at risk* when its bytes before the transition plus every allocation of every
node that touches it could exceed its cap; only those need counting while scheduling
(no order can break the cap of the others). Per node, ``ClassEffect`` holds the classes
it touches (a device runs one primitive at a time), its allocation and release on the
classes at risk, and the most any one device receives and copies locally. Everything else -- effects
on every class, each class's devices, bytes in use after a sequence of starts and ends --
is made on first use (the per-device views a caller asks for). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain, repeat
from math import lcm
from operator import gt
from typing import Any

__all__ = ["DeviceClasses", "ClassEffect", "DeviceMap", "joint"]

Runs = list[tuple[list, int]]  # per-device values: (pattern, repeats), in order


def joint(columns: Sequence[Runs]) -> list[tuple[list[tuple], int]]:
    """Per-device tuples of every column's value, as runs: ``[(tuples, repeats)]``.

    Where every column repeats inside a stretch of devices, one period of the tuples
    stands for the stretch (the period is the least common multiple of the patterns'
    lengths), so the work grows with the number of runs and their patterns, not with
    the devices."""
    # per column its runs as (pattern, pattern length, devices covered), empty ones dropped
    cols = [
        [(pat, len(pat), len(pat) * reps) for pat, reps in col if pat and reps] for col in columns
    ]
    ncols = len(cols)
    run = [0] * ncols  # per column: its current run
    used = [0] * ncols  # per column: devices of that run already taken
    out: list[tuple[list[tuple], int]] = []
    first = len(cols[0])
    while run[0] < first:
        heads = [col[i] for col, i in zip(cols, run, strict=True)]
        step = min([total - u for (_, _, total), u in zip(heads, used, strict=True)])
        sizes = [size for _, size, _ in heads]
        per = lcm(*sizes)
        reps = step // per if step % per == 0 else 1
        if reps == 1:
            per = step
        segs = []
        for c in range(ncols):
            pat, size, total = heads[c]
            u = used[c]
            off = u % size
            if off:
                pat = pat[off:] + pat[:off]
            segs.append(pat if per == size else pat * (per // size) + pat[: per % size])
            u += step
            if u == total:
                run[c] += 1
                u = 0
            used[c] = u
        out.append((list(zip(*segs, strict=True)), reps))
    return out


_VARIES = object()


def _constant(column: Runs) -> Any:
    """The value every device has in ``column``, or ``_VARIES``."""
    runs = [pat for pat, reps in column if pat and reps]
    return runs[0][0] if len(runs) == 1 and len(runs[0]) == 1 else _VARIES


class ClassEffect:
    """One node's effect per class (see the module docstring)."""

    __slots__ = ("touches", "alloc", "release", "max_moved", "max_copied", "acquires")

    def __init__(self, max_moved: int = 0, max_copied: int = 0, acquires: bool = False) -> None:
        self.touches: Any = []  # a frozenset once made
        self.alloc: list[tuple[int, int]] = []  # (class at risk, bytes > 0)
        self.release: dict[int, int] = {}  # class at risk -> bytes
        self.max_moved = max_moved
        self.max_copied = max_copied  # the most one device copies from a source it holds
        self.acquires = acquires  # allocates anything anywhere


class DeviceClasses:
    """Per class: cap, bytes before the transition, whether it is counted (it holds or
    receives something, or has resident bytes), whether it is at risk; per node: its
    ``ClassEffect``."""

    def __init__(
        self,
        caps: list[int | None],
        initial: list[int],
        counted: list[bool] | None,
        worst: list[int],
        effects: list[ClassEffect],
    ) -> None:
        self.caps, self.initial, self.effects = caps, initial, effects
        self._counted = counted
        # at risk: what it holds plus every allocation could pass its cap
        self.risky = (
            list(map(gt, worst, caps))
            if None not in caps
            else [cap is not None and w > cap for cap, w in zip(caps, worst, strict=True)]
        )
        self._members: list[list[int]] | None = None
        self._full: dict[int, tuple[list, list, list]] = {}
        self._chunks: list[tuple[list[tuple], int]] = []
        self._distinct: list | None = None
        self._parts: Sequence = ()
        self._node_at: list[tuple[int, int]] = []
        self._resident_of: Sequence[int | None] = ()

    @property
    def counted(self) -> list[bool]:
        """Per class, whether it is counted (see the class docstring)."""
        if self._counted is None:
            n = len(self._parts)
            self._counted = [
                any(s[:n]) or r is not None
                for s, r in zip(self._distinct, self._resident_of, strict=True)
            ]
        return self._counted

    @classmethod
    def of_parts(cls, parts: Sequence, caps: Runs, resident: Runs) -> DeviceClasses:
        """Classes of the devices from each part's role codes, the caps and the resident
        bytes, all as runs over the same devices (``StagePart``s in node order: part
        ``i``'s nodes come after part ``i-1``'s)."""
        # a cap or resident bytes alike on every device tell no devices apart: they stay
        # out of the signatures (the classes, and their order, are the same)
        nparts = len(parts)
        extra = [col for col in (caps, resident) if _constant(col) is _VARIES]
        chunks = joint([p.codes for p in parts] + extra or [caps])
        distinct = list(dict.fromkeys(chain.from_iterable([sigs for sigs, _ in chunks])))
        ncls = len(distinct)
        columns = list(
            zip(*distinct, strict=True)
        )  # per part each class's role code, then the extra columns
        cap_of = _constant(caps)
        cap_of = list(columns[nparts]) if cap_of is _VARIES else [cap_of] * ncls
        resident_of = _constant(resident)
        resident_of = columns[-1] if resident_of is _VARIES else [resident_of] * ncls
        initial = [r or 0 for r in resident_of]
        worst = list(initial)
        effects: list[ClassEffect] = []
        node_at: list[tuple[int, int]] = []
        by_stage: list[list[tuple[int, list[int]]]] = []
        bases: list[int] = []
        for k, part in enumerate(parts):
            base = len(effects)
            bases.append(base)
            mine = [ClassEffect(ns.max_moved, ns.max_copied, ns.acquires) for ns in part.nodes]
            effects += mine
            node_at += zip(repeat(k), range(len(mine)))
            roles = part.roles
            held, grows = roles.held, roles.grows
            members: list[list[int]] = [
                [] for _ in held
            ]  # the classes of each role code, ascending
            for c, code in enumerate(columns[k]):
                if code:
                    members[code].append(c)
                    initial[c] += held[code]
                    worst[c] += grows[code]
            groups = [(code, classes) for code, classes in enumerate(members) if classes]
            by_stage.append(groups)
            touch = roles.touch
            for code, classes in groups:
                for li in touch[code]:
                    mine[li].touches += classes  # a class has one code per part: no class twice
        # counted: some model-stage has a role there, or it has resident bytes (made when asked)
        out = cls(cap_of, initial, None, worst, effects)
        risky = out.risky
        if any(risky):
            for k, part in enumerate(parts):
                base, roles = bases[k], part.roles.roles
                for code, classes in by_stage[k]:
                    entries = roles[code][1]
                    at_risk = [c for c in classes if risky[c]] if entries else None
                    if not at_risk:
                        continue
                    for li, a, r, _ in entries:
                        e = effects[base + li]
                        if a:
                            e.alloc += zip(at_risk, repeat(a))
                        if r:
                            e.release.update(dict.fromkeys(at_risk, r))
        for e in effects:
            e.touches = frozenset(e.touches)
        out._chunks, out._distinct, out._parts, out._node_at = chunks, distinct, parts, node_at
        out._resident_of = resident_of
        return out

    @classmethod
    def of_nodes(
        cls, nodes: Sequence, caps: Mapping[int, int | None], initial: Mapping[int, int]
    ) -> DeviceClasses:
        """A class per device, from nodes that list ``devices``, ``alloc``, ``release``
        and ``moved_in`` per device (a DAG put together by hand)."""
        devices = sorted(set(caps) | set(initial) | {d for n in nodes for d in n.devices})
        at = {d: i for i, d in enumerate(devices)}
        worst = [initial.get(d, 0) for d in devices]
        full = {}
        for n in nodes:
            alloc = [(at[d], v) for d, v in n.alloc.items() if v]
            release = [(at[d], v) for d, v in n.release.items() if v]
            moved = [(at[d], v) for d, v in n.moved_in.items() if v]
            full[n.id] = (alloc, release, moved)
            for c, v in alloc:
                worst[c] += max(v, 0)
        effects = []
        out = cls(
            [caps.get(d) for d in devices],
            [initial.get(d, 0) for d in devices],
            [d in caps or d in initial for d in devices],
            worst,
            effects,
        )
        for n in nodes:
            alloc, release, moved = full[n.id]
            e = ClassEffect()
            e.touches = frozenset(at[d] for d in n.devices)
            e.alloc = [(c, v) for c, v in alloc if out.risky[c] and v > 0]
            e.release = {c: v for c, v in release if out.risky[c]}
            e.max_moved = max((v for _, v in moved), default=0)
            e.acquires = any(v > 0 for _, v in alloc)
            effects.append(e)
        out._members = [[d] for d in devices]
        out._full = full
        return out

    @property
    def members(self) -> list[list[int]]:
        """Each class's devices, ascending."""
        if self._members is None:
            members: list[list[int]] = [[] for _ in self.caps]
            index = {s: i for i, s in enumerate(self._distinct)}  # type: ignore[arg-type]
            d = 0
            for sigs, reps in self._chunks:
                for _ in range(reps):
                    for s in sigs:
                        members[index[s]].append(d)
                        d += 1
            self._members = members
        return self._members

    def first(self, c: int) -> int:
        """The lowest device of class ``c`` (what an error names)."""
        return self.members[c][0]

    def full(
        self, nid: int
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """Node ``nid``'s allocation, release and receipt on every class: ``(class, bytes)``."""
        got = self._full.get(nid)
        if got is None:
            k, li = self._node_at[nid]
            roles = self._parts[k].roles.roles
            alloc, release, moved = [], [], []
            for c, s in enumerate(self._distinct):  # type: ignore[arg-type]
                for i, a, r, m in roles[s[k]][1]:
                    if i == li:
                        if a:
                            alloc.append((c, a))
                        if r:
                            release.append((c, r))
                        if m:
                            moved.append((c, m))
            got = self._full[nid] = (alloc, release, moved)
        return got

    def replay(self, events: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Bytes in use per class after ``events`` -- ``(node, +1)`` it started, ``(node,
        0)`` it ended, ``(node, -1)`` it failed -- and the most each class held."""
        used, peak = list(self.initial), list(self.initial)
        for nid, what in events:
            alloc, release, _ = self.full(nid)
            if what > 0:
                for c, v in alloc:
                    used[c] += v
                    if used[c] > peak[c]:
                        peak[c] = used[c]
            else:
                for c, v in release if what == 0 else alloc:
                    used[c] -= v
        return used, peak

    def per_device(self, values) -> dict[int, int]:
        """``{device: value}`` from ``(class, value)`` pairs."""
        members = self.members
        return {d: v for c, v in values for d in members[c]}

    def counted_map(self, values: Sequence[Any]) -> dict[int, Any]:
        """``{device: values[class]}`` over the counted classes' devices."""
        members, counted = self.members, self.counted
        return dict(
            sorted((d, values[c]) for c in range(len(values)) if counted[c] for d in members[c])
        )


class DeviceMap(Mapping):
    """A read-only ``{device: value}`` made on first use (the per-device view of a
    per-class quantity)."""

    def __init__(self, make) -> None:
        self._make = make
        self._data: dict | None = None

    def _get(self) -> dict:
        if self._data is None:
            self._data = self._make()
        return self._data

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __contains__(self, key) -> bool:
        return key in self._get()

    def get(self, key, default=None):
        return self._get().get(key, default)

    def __eq__(self, other) -> bool:
        return dict(self._get()) == (dict(other) if isinstance(other, Mapping) else other)

    def __repr__(self) -> str:
        return repr(self._get())
