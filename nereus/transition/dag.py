"""The global transition DAG: every model-stage's primitives, joined (docs/design.md §5).

``build_dag(current, target, specs, devices)`` (``nereus.transition.build``) takes two
plans (model-stage -> ``StagePlan``), each model-stage's ``ModelSpec`` and the devices
(hosts and memory caps) and returns a ``TransitionDAG``:

Nodes carry their devices, per-device allocation (target shards not adopted, one
transfer bucket) and release (freed sources, the bucket), bytes per link (intra- and
inter-node) and the groups they make. Bytes are analytic (``nereus.transition.analytic``)
and a model-stage whose plans repeat is priced by its distinct roles, not device by
device (``_regular``); devices alike for the whole DAG form classes (``_classes``) that
the scheduler counts memory over. So 1,024 devices stay cheap: per-device views and the
ops of a node are made on first use (the executor builds the exact reshard plans when a
node runs). Pure: no I/O.

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence

from nereus.errors import OutOfMemory
from nereus.planner.plan import Plan, StagePlan
from nereus.state.transition import Op, Rep
from nereus.transition._classes import ClassEffect, DeviceClasses
from nereus.transition._stage import StagePart
from nereus.transition.rules import ALL_RULES, Rules

__all__ = ["Node", "Schedule", "TransitionDAG", "stage_rank", "stage_moves", "check_caps"]

KIND_RANK = {"generation": 0, "inference": 1, "training": 2}


def stage_rank(stage: str) -> int:
    """Tie order of a model-stage: generation, then inference, then training."""
    for kind, rank in KIND_RANK.items():
        if kind in stage:
            return rank
    return len(KIND_RANK)


def stage_moves(a: StagePlan, b: StagePlan) -> bool:
    """Whether going from ``a`` to ``b`` moves any tensor (layout, DP or devices)."""
    if a.start is not None and b.start is not None:  # back to back: the first device says where
        return (a.tp, a.pp, a.dp, a.start) != (b.tp, b.pp, b.dp, b.start)
    return (a.tp, a.pp, a.devices) != (b.tp, b.pp, b.devices)


_LAZY = ("ops", "devices", "alloc", "release", "moved_in")


class Node:
    """One primitive, or a set of identical device-disjoint ones (``ops``), of one
    model-stage. ``alloc``/``release``: bytes per device taken when it starts, given
    back when it ends. ``moved_in``: bytes each device receives. A node that ``build_dag``
    made lists its ops and per-device effects on first use."""

    def __init__(
        self,
        id: int,
        kind: str,
        stage: str,
        ops: tuple[Op, ...] | None,
        devices: tuple[int, ...] | None,
        alloc: dict[int, int] | None,
        release: dict[int, int] | None,
        moved_in: dict[int, int] | None,
        bytes: int,
        bytes_by_link: dict[str, int],
        groups: int,
        deps: set[int] | None = None,
        resource_deps: set[int] | None = None,
        rank: int | None = None,
    ) -> None:
        self.id, self.kind, self.stage, self.bytes, self.bytes_by_link, self.groups = (
            id,
            kind,
            stage,
            bytes,
            bytes_by_link,
            groups,
        )
        self._ops, self._devices, self._alloc, self._release, self._moved_in = (
            ops,
            devices,
            alloc,
            release,
            moved_in,
        )
        self.deps: set[int] = set() if deps is None else deps
        self.resource_deps: set[int] = set() if resource_deps is None else resource_deps
        self.rank = (
            stage_rank(stage) if rank is None else rank
        )  # given: the stage's, worked out once
        # made by build_dag: how many primitives, the DAG it is made from on first use, and
        # (part, node of the part) for its ops
        self._count: int | None = None
        self._lister: _Lister | None = None  # what the DAG it belongs to lists its fields from
        self._effect: ClassEffect | None = None  # looked up once per DAG it belongs to
        self._local: tuple[int, int] | None = None

    def _lazy(self, name: str):
        got = getattr(self, "_" + name)
        if got is None:
            lister = self._lister
            if lister is None:
                raise AttributeError(f"node {self.label} has no {name}")
            got = lister.expand(self, name)
            setattr(self, "_" + name, got)
        return got

    ops = property(lambda self: self._lazy("ops"), lambda self, v: setattr(self, "_ops", v))
    devices = property(
        lambda self: self._lazy("devices"), lambda self, v: setattr(self, "_devices", v)
    )
    alloc = property(lambda self: self._lazy("alloc"), lambda self, v: setattr(self, "_alloc", v))
    release = property(
        lambda self: self._lazy("release"), lambda self, v: setattr(self, "_release", v)
    )
    moved_in = property(
        lambda self: self._lazy("moved_in"), lambda self, v: setattr(self, "_moved_in", v)
    )

    @property
    def effect(self) -> ClassEffect:
        """Its effect per class of devices (what the scheduler counts)."""
        e = self._effect
        if e is None:
            assert self._lister is not None, "a node belongs to a TransitionDAG"
            e = self._effect = self._lister.classes.effects[self.id]
        return e

    @property
    def count(self) -> int:
        return self._count if self._count is not None else len(self.ops)

    @property
    def label(self) -> str:
        return f"{self.kind}[{self.stage}]#{self.id}" + (f"x{self.count}" if self.count > 1 else "")

    @property
    def releases_only(self) -> bool:
        if self._alloc is None and self._lister is not None:
            return not self.effect.acquires
        return not any(v > 0 for v in self.alloc.values())

    @property
    def max_moved_in(self) -> int:
        """The most bytes any one device receives."""
        if self._moved_in is None and self._lister is not None:
            return self.effect.max_moved
        return max(self.moved_in.values(), default=0)

    def max_host_in(self, devices_per_node: int) -> int:
        """The most bytes the devices of one host receive together."""
        per_host: dict[int, int] = {}
        for d, b in self.moved_in.items():
            per_host[d // devices_per_node] = per_host.get(d // devices_per_node, 0) + b
        return max(per_host.values(), default=0)

    @property
    def max_copied(self) -> int:
        """The most bytes any one device copies from a source it holds (target shards
        held there but not adopted; 0 for a node put together by hand)."""
        return self.effect.max_copied if self._lister is not None else 0

    def materialize(self) -> None:
        """Make every field that is made on first use now."""
        for name in _LAZY:
            self._lazy(name)

    def __repr__(self) -> str:
        return f"Node({self.label}, bytes={self.bytes}, deps={sorted(self.deps)})"


class Schedule:
    """A simulated run: start and end of every node, the start order, the makespan and
    every device's peak bytes (``peak``, made on first use)."""

    def __init__(
        self,
        start: dict[int, float] | None = None,
        end: dict[int, float] | None = None,
        order: list[int] | None = None,
        peak: Mapping[int, int] | None = None,
    ) -> None:
        self.start = start if start is not None else {}
        self.end = end if end is not None else {}
        self.order = order if order is not None else []
        self.peak: Mapping[int, int] = peak if peak is not None else {}

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)


class TransitionDAG:
    """Nodes (ids are indices), every device's cap and bytes in use before the
    transition, and each moving model-stage's replicas after it (with the names they
    are built under, in target order). ``classes``: the devices alike for the DAG
    (made from the nodes' per-device effects when not given). ``schedule``: the list
    schedule of the DAG as built, under the ``duration`` ``build_dag`` was given."""

    def __init__(
        self,
        nodes: list[Node],
        caps: Mapping[int, int | None],
        initial: Mapping[int, int],
        current: Plan,
        target: Plan,
        results: Mapping[str, tuple[Rep, ...]],
        host_of: Callable[[int], int],
        *,
        classes: DeviceClasses | None = None,
        parts: Sequence[StagePart] = (),
        duration: Callable[[Node], float] | None = None,
        share: Callable[[int], float] | None = None,
        rules: Rules = ALL_RULES,
    ) -> None:
        self.nodes, self.caps, self.initial = nodes, caps, initial
        self.rules = rules
        self.current, self.target, self.results, self.host_of = current, target, results, host_of
        self._classes = classes
        self.duration, self.share = duration, share
        self._schedule: Schedule | None = None
        # a DAG put together by hand makes its classes from its nodes: its lister needs
        # the DAG (a cycle, collected as any); one build_dag made needs no way back
        lister = _Lister(classes, parts, self if classes is None else None)
        for n in nodes:
            if n._lister is not None and n._lister is not lister:
                n.materialize()
            n._lister, n._effect = lister, None

    @property
    def classes(self) -> DeviceClasses:
        if self._classes is None:
            self._classes = DeviceClasses.of_nodes(self.nodes, self.caps, self.initial)
        return self._classes

    @property
    def schedule(self) -> Schedule:
        """The list schedule under ``duration`` (see the class docstring): the resource-edge
        search's last simulation when it ran (the DAG as built is the one it simulated),
        else the one ``build_dag`` simulated when it was done. Raises ``ValueError`` when
        ``build_dag`` was given no duration."""
        if self._schedule is None:
            raise ValueError(
                "TransitionDAG.schedule needs build_dag(duration=...): a node's modelled seconds"
            )
        return self._schedule

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    @property
    def edges(self) -> int:
        return sum(len(n.deps) for n in self.nodes)

    @property
    def resource_edges(self) -> int:
        return sum(len(n.resource_deps) for n in self.nodes)

    def stages(self) -> list[str]:
        return sorted({n.stage for n in self.nodes})

    def devices(self) -> set[int]:
        c = self.classes
        return {d for e in c.effects for k in e.touches for d in c.members[k]}

    def reachable_from(self, start: int) -> set[int]:
        """Every node that (transitively) waits for ``start``."""
        children: dict[int, list[int]] = defaultdict(list)
        for n in self.nodes:
            for d in n.deps:
                children[d].append(n.id)
        seen, todo = set(), [start]
        while todo:
            for c in children[todo.pop()]:
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
        return seen


class _Lister:
    """What the nodes of one DAG make their fields from on first use: the DAG's device
    classes, its model-stage parts and the ops listed so far. It refers to no node and,
    for a DAG that ``build_dag`` made, not to the DAG, so nothing refers back from a node
    to what holds it: a DAG that is dropped (the Replanner prices many a boundary) is
    freed at once by reference counting, with nothing left for the cycle collector."""

    __slots__ = ("_classes", "_dag", "parts", "made")

    def __init__(
        self, classes: DeviceClasses | None, parts: Sequence[StagePart], dag: TransitionDAG | None
    ) -> None:
        self._classes, self._dag = classes, dag
        self.parts = list(parts)
        self.made: dict[int, list[tuple[Op, ...]]] = {}

    @property
    def classes(self) -> DeviceClasses:
        if self._classes is None:
            assert self._dag is not None, "a DAG made without classes keeps its lister's way back"
            return self._dag.classes
        return self._classes

    def expand(self, node: Node, name: str):
        c = self.classes
        e = c.effects[node.id]
        if name == "devices":
            return tuple(sorted(d for k in e.touches for d in c.members[k]))
        if name in ("alloc", "release", "moved_in"):
            return c.per_device(c.full(node.id)[("alloc", "release", "moved_in").index(name)])
        assert node._local is not None
        p, li = node._local
        if p not in self.made:
            part = self.parts[p]
            ops, results = part.materialize()  # type: ignore[misc]
            self.made[p] = ops
            part.results = results
        return self.made[p][li]


class _Results(Mapping):
    """Each moving model-stage's replicas after the transition, listed on first use."""

    def __init__(self, parts: Sequence[StagePart]) -> None:
        self._parts = {p.stage: p for p in parts if p.nodes}

    def __getitem__(self, stage: str) -> tuple[Rep, ...]:
        part = self._parts[stage]
        if part.results is None:
            _, part.results = part.materialize()  # type: ignore[misc]
        return part.results  # type: ignore[return-value]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


def check_caps(dag: TransitionDAG) -> None:
    """``OutOfMemory`` if a device starts over its cap before anything runs."""
    for d, used in dag.initial.items():
        cap = dag.caps.get(d)
        if cap is not None and used > cap:
            raise OutOfMemory(d, used, cap, "the EMUs resident before the transition")
