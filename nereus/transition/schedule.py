"""The one list scheduler of a transition DAG: the estimate, the executor's dispatch order
and the simulator's timing are all this (DESIGN §5).

``Dispatcher(dag)`` holds the state a schedule moves through: which nodes are ready
(every dependency finished), which devices are busy (a device runs one primitive at a
time: a worker's ``run_plan`` is sequential, so two primitives sharing two devices queued
in opposite orders would otherwise wait on each other), and the bytes in use on every
device. ``start_ready()`` starts, in priority order (release before acquire, then
generation, inference, training, then node id; ties shuffled when given a random
generator), every ready node whose devices are free and whose allocation fits every
device's cap counting what is in use (source buffers stay until their node ends; a
node's transfer bucket counts while it runs); ``finish(node)`` gives its devices and
its released bytes back.

``simulate(dag, duration)`` runs the dispatcher against a clock, each node taking
``duration(node)`` seconds: a ``Schedule`` of start and end times, the start order, the
makespan (the transition's estimate) and every device's peak. A node that can never
start (nothing running, nothing else startable) raises ``InfeasibleTransition``.

``LinkModel`` turns a node into seconds: per primitive, the most any device receives
over its link's bandwidth times the calibrated p2p efficiency, plus one group set-up
for a primitive that moves bytes and a fixed cost per primitive call; the primitives of
a node run at once. Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from nereus.errors import InfeasibleTransition
from nereus.transition.dag import Node, TransitionDAG, stage_rank

__all__ = ["Dispatcher", "Schedule", "simulate", "LinkModel", "Blocked"]


@dataclass
class Blocked:
    """A ready node that cannot start for memory: the device, what it would need, the
    cap, and the nodes finished so far."""

    node: int
    device: int
    need: int
    cap: int
    finished: frozenset[int]
    running: bool


class Dispatcher:
    """The state of one schedule of ``dag`` (see the module docstring)."""

    def __init__(self, dag: TransitionDAG, rng: random.Random | None = None,
                 on_blocked: Callable[[Blocked], bool] | None = None) -> None:
        self.dag = dag
        self.rng = rng
        self.on_blocked = on_blocked
        self.waiting = {n.id: len(n.deps) for n in dag.nodes}
        self.children: dict[int, list[int]] = {n.id: [] for n in dag.nodes}
        for n in dag.nodes:
            for d in n.deps:
                self.children[d].append(n.id)
        self.ready = {n.id for n in dag.nodes if not n.deps}
        self.running: set[int] = set()
        self.finished: set[int] = set()
        self.failed: set[int] = set()
        self.busy: set[int] = set()
        self.used = dict(dag.initial)
        self.peak = dict(dag.initial)
        self.blocked: Blocked | None = None

    def _priority(self, node: Node) -> tuple:
        tie = self.rng.random() if self.rng is not None else node.id
        return (0 if node.releases_only else 1, stage_rank(node.stage), tie)

    def _over(self, node: Node) -> tuple[int, int, int] | None:
        for d, extra in node.alloc.items():
            cap = self.dag.caps.get(d)
            if cap is not None and extra > 0 and self.used.get(d, 0) + extra > cap:
                return d, self.used.get(d, 0) + extra, cap
        return None

    def start_ready(self) -> list[Node]:
        """Start every ready node that can start now, in priority order; returns them.
        ``on_blocked`` (if given) hears of each memory-blocked node; returning True stops
        this round (the caller changed the DAG)."""
        started: list[Node] = []
        self.blocked = None
        for nid in sorted(self.ready, key=lambda i: self._priority(self.dag.nodes[i])):
            node = self.dag.nodes[nid]
            if not self.busy.isdisjoint(node.devices):
                continue
            over = self._over(node)
            if over is not None:
                info = Blocked(nid, over[0], over[1], over[2], frozenset(self.finished), bool(self.running))
                if self.blocked is None:
                    self.blocked = info
                if self.on_blocked is not None and self.on_blocked(info):
                    return started
                continue
            self.ready.discard(nid)
            self.running.add(nid)
            self.busy.update(node.devices)
            for d, extra in node.alloc.items():
                self.used[d] = self.used.get(d, 0) + extra
                if self.used[d] > self.peak.get(d, 0):
                    self.peak[d] = self.used[d]
            started.append(node)
        return started

    def finish(self, nid: int, ok: bool = True) -> list[int]:
        """Node ``nid`` ended; returns the nodes that became ready. A failed node
        releases nothing (its sources were not freed) and readies nothing."""
        node = self.dag.nodes[nid]
        self.running.discard(nid)
        self.busy.difference_update(node.devices)
        if not ok:
            self.failed.add(nid)
            for d, extra in node.alloc.items():  # what it allocated is dropped again
                self.used[d] = self.used.get(d, 0) - extra
            return []
        self.finished.add(nid)
        for d, freed in node.release.items():
            self.used[d] = self.used.get(d, 0) - freed
        became = []
        for c in self.children[nid]:
            self.waiting[c] -= 1
            if self.waiting[c] == 0:
                self.ready.add(c)
                became.append(c)
        return became

    @property
    def done(self) -> bool:
        return not self.ready and not self.running

    def stuck(self) -> bool:
        """Nothing runs and something ready cannot start: a deadlock."""
        return not self.running and bool(self.ready)

    def infeasible(self) -> InfeasibleTransition:
        b = self.blocked
        if b is None:  # ready but never startable without a memory reason: cannot happen
            nid = min(self.ready)
            return InfeasibleTransition(self.dag.nodes[nid].label, -1, 0, 0)
        return InfeasibleTransition(self.dag.nodes[b.node].label, b.device, b.need, b.cap)


@dataclass
class Schedule:
    """A simulated run: start and end of every node, the start order, the makespan and
    every device's peak bytes."""

    start: dict[int, float] = field(default_factory=dict)
    end: dict[int, float] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    peak: dict[int, int] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)


def simulate(dag: TransitionDAG, duration: Callable[[Node], float], *, rng: random.Random | None = None,
             on_blocked: Callable[[Blocked], bool] | None = None) -> Schedule:
    """Run ``dag``'s list schedule against a clock (see the module docstring)."""
    disp = Dispatcher(dag, rng, on_blocked)
    out = Schedule()
    clock = 0.0
    events: list[tuple[float, int]] = []
    while not disp.done:
        for node in disp.start_ready():
            out.start[node.id] = clock
            out.order.append(node.id)
            heapq.heappush(events, (clock + max(0.0, float(duration(node))), node.id))
        if not events:
            if disp.stuck():
                raise disp.infeasible()
            break
        clock, nid = heapq.heappop(events)
        out.end[nid] = clock
        disp.finish(nid)
    out.peak = disp.peak
    return out


@dataclass(frozen=True)
class LinkModel:
    """Seconds of a node from its bytes: ``intra_bandwidth`` / ``inter_bandwidth`` bytes
    per second a device receives within / across hosts, the calibrated p2p efficiency of
    each, ``group_setup_s`` when its primitives make groups, ``call_s`` per node."""

    intra_bandwidth: float
    inter_bandwidth: float
    intra_efficiency: float = 0.5
    inter_efficiency: float = 0.4
    group_setup_s: float = 0.02
    call_s: float = 0.005

    def ideal(self, node: Node) -> dict[str, float]:
        """Seconds at efficiency 1 per class (``p2p_intra``, ``p2p_inter``: the most any
        device receives, split by link, over the link's bandwidth; the primitives of a
        node run at once) and the counts of fixed costs (``groups``, ``calls``)."""
        worst = max(node.moved_in.values(), default=0)
        total = sum(node.bytes_by_link.values())
        intra = node.bytes_by_link.get("intra", 0) / total if total else 0.0
        return {"p2p_intra": worst * intra / self.intra_bandwidth,
                "p2p_inter": worst * (1.0 - intra) / self.inter_bandwidth if total else 0.0,
                "groups": 1.0 if node.groups else 0.0, "calls": 1.0}

    def seconds(self, node: Node) -> float:
        i = self.ideal(node)
        return (i["p2p_intra"] / self.intra_efficiency + i["p2p_inter"] / self.inter_efficiency
                + i["groups"] * self.group_setup_s + i["calls"] * self.call_s)

    @classmethod
    def of(cls, cluster, eff) -> LinkModel:
        """The link model of a ``ClusterSpec`` under calibrated efficiencies: a device's
        bandwidth within its node, its share of its node's NICs across nodes."""
        return cls(cluster.intra_node_bandwidth, cluster.device_share_of_inter_node(), eff.p2p_intra,
                   eff.p2p_inter, eff.group_setup_s, eff.transition_call_s)
