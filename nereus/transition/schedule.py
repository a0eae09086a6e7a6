"""The one list scheduler of a transition DAG: the estimate, the executor's dispatch order
and the simulator's timing are all this (docs/design.md §5).

``Dispatcher(dag)`` holds the state a schedule moves through: which nodes are ready
(every dependency finished), which devices are busy (a device runs one primitive at a
time: a worker's ``run_plan`` is sequential, so two primitives sharing two devices queued
in opposite orders would otherwise wait on each other), and the bytes in use on every
device. ``start_ready()`` starts, in priority order (release before acquire, then
generation, inference, training, then node id; with a random generator, ties drawn at
random once per node), every ready node whose devices are free and whose allocation
fits every device's cap counting what is in use (source buffers stay until their node
ends; a node's transfer bucket counts while it runs); ``finish(node)`` gives its devices
and its released bytes back (it orders by the DAG's global rules, ``nereus.transition.
rules``, unless given others; ``check_caps=False`` drops its cap check at start, so only
the rules and the workers' ledgers keep memory within budget). It counts per class of alike devices
(``dag.classes``), and only the classes whose cap some order could break; ``used``, ``peak`` and
``busy`` are
per-device views made when asked for (from the sequence of starts and ends).

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

import heapq
import random
from bisect import insort
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import compress
from operator import itemgetter

from nereus.errors import InfeasibleTransition
from nereus.planner.cluster import core_share
from nereus.transition._classes import DeviceClasses, DeviceMap
from nereus.transition.dag import Node, Schedule, TransitionDAG
from nereus.transition.rules import Rules

__all__ = ["Dispatcher", "Schedule", "simulate", "full_rate_seconds", "LinkModel", "Blocked"]

_TOUCHES = itemgetter(2)


class Blocked:
    """A ready node that cannot start for memory: the class of devices, what it would
    need, the cap, the nodes finished so far, whether anything runs, and ``device`` (the
    lowest of the class, looked up when asked: only an error names it)."""

    __slots__ = ("node", "cls", "need", "cap", "finished", "running", "_classes")

    def __init__(
        self,
        node: int,
        cls: int,
        need: int,
        cap: int,
        finished: frozenset[int],
        running: bool,
        classes: DeviceClasses,
    ) -> None:
        self.node, self.cls, self.need, self.cap, self.finished, self.running = (
            node,
            cls,
            need,
            cap,
            finished,
            running,
        )
        self._classes = classes

    @property
    def device(self) -> int:
        return self._classes.first(self.cls)


class Dispatcher:
    """The state of one schedule of ``dag`` (see the module docstring). Bytes and
    exclusivity are counted per class of alike devices (``dag.classes``); ``used``,
    ``peak`` and ``busy`` are the per-device views."""

    def __init__(
        self,
        dag: TransitionDAG,
        rng: random.Random | None = None,
        on_blocked: Callable[[Blocked], bool] | None = None,
        *,
        rules: Rules | None = None,
        check_caps: bool = True,
    ) -> None:
        self.dag = dag
        self.rng = rng
        self.on_blocked = on_blocked
        rules = dag.rules if rules is None else rules
        # the safety net: a node whose allocation would pass a cap waits (off: it starts,
        # and only the rules keep it within budget)
        self.check_caps = check_caps
        classes = dag.classes
        self._classes = classes
        self._effects = classes.effects
        self._caps = classes.caps
        nodes, effects = dag.nodes, self._effects
        self.waiting = {n.id: len(n.deps) for n in nodes}
        children: dict[int, list[int]] = {n.id: [] for n in nodes}
        for n in nodes:
            for d in n.deps:
                children[d].append(n.id)
        self.children = children
        # release before acquire (a node that allocates nowhere), then generation,
        # inference, training, then node id (or a random tie, drawn once per node and schedule)
        # queue entries: (priority, node, the classes it touches); a rule that is off ranks all
        # alike
        first, order = rules.release_first, rules.stage_order
        self._item = {
            n.id: (
                (
                    1 if (e := effects[n.id]).acquires and first else 0,
                    n.rank if order else 0,
                    rng.random() if rng is not None else n.id,
                ),
                n.id,
                e.touches,
            )
            for n in nodes
        }
        self.ready = {n.id for n in nodes if not n.deps}
        self._queue = sorted(
            self._item[i] for i in self.ready
        )  # the ready nodes, in priority order
        self.running: set[int] = set()
        self.finished: set[int] = set()
        self.failed: set[int] = set()
        self._busy: set[int] = set()
        self._used = list(classes.initial)  # counted on the classes at risk only
        self.events: list[tuple[int, int]] = []  # (node, +1 started / 0 ended / -1 failed)
        self.blocked: Blocked | None = None

    @property
    def used(self) -> dict[int, int]:
        """Bytes in use on every device now."""
        return self._classes.counted_map(self._classes.replay(self.events)[0])

    @property
    def peak(self) -> dict[int, int]:
        """The most bytes every device has held so far."""
        return self._classes.counted_map(self._classes.replay(self.events)[1])

    @property
    def busy(self) -> set[int]:
        """Devices running a primitive now."""
        members = self._classes.members
        return {d for c in self._busy for d in members[c]}

    def _over(self, nid: int) -> tuple[int, int, int] | None:
        used, caps = self._used, self._caps
        for c, extra in self._effects[nid].alloc:
            cap = caps[c]
            if cap is not None and extra > 0 and used[c] + extra > cap:
                return c, used[c] + extra, cap
        return None

    def start_ready(self) -> list[Node]:
        """Start every ready node that can start now, in priority order; returns them.
        ``on_blocked`` (if given) hears of each memory-blocked node; returning True stops
        this round (the caller changed the DAG)."""
        started: list[Node] = []
        self.blocked = None
        busy, queue = self._busy, self._queue
        # the others wait for a device (filtered without a Python loop: this runs at every event)
        free = (
            list(compress(queue, map(busy.isdisjoint, map(_TOUCHES, queue))))
            if busy
            else list(queue)
        )
        while free:
            item = free[0]
            nid = item[1]
            e = self._effects[nid]
            over = self._over(nid) if e.alloc and self.check_caps else None
            if over is not None:
                c, need, cap = over
                info = Blocked(
                    nid, c, need, cap, frozenset(self.finished), bool(self.running), self._classes
                )
                if self.blocked is None:
                    self.blocked = info
                if self.on_blocked is not None and self.on_blocked(info):
                    break
                del free[0]
                continue
            self.ready.discard(nid)
            self.running.add(nid)
            busy.update(item[2])
            for c, extra in e.alloc:
                self._used[c] += extra
            self.events.append((nid, 1))
            started.append(self.dag.nodes[nid])
            queue.remove(item)
            free = list(compress(free, map(busy.isdisjoint, map(_TOUCHES, free))))
        return started

    def finish(self, nid: int, ok: bool = True) -> list[int]:
        """Node ``nid`` ended; returns the nodes that became ready. A failed node
        releases nothing (its sources were not freed) and readies nothing."""
        e = self._effects[nid]
        self.running.discard(nid)
        self._busy.difference_update(e.touches)
        used = self._used
        if not ok:
            self.failed.add(nid)
            self.events.append((nid, -1))
            for c, extra in e.alloc:  # what it allocated is dropped again
                used[c] -= extra
            return []
        self.finished.add(nid)
        self.events.append((nid, 0))
        for c, freed in e.release.items():
            used[c] -= freed
        became = []
        waiting = self.waiting
        for c in self.children[nid]:
            waiting[c] -= 1
            if not waiting[c]:
                self.ready.add(c)
                insort(self._queue, self._item[c])
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


def simulate(
    dag: TransitionDAG,
    duration: Callable[[Node], float],
    *,
    rng: random.Random | None = None,
    on_blocked: Callable[[Blocked], bool] | None = None,
    share: Callable[[int], float] | None = None,
) -> Schedule:
    """Run ``dag``'s list schedule against a clock (see the module docstring). With
    ``share`` (devices that share cores: ``LinkModel.sharing``), ``duration`` is a node's
    seconds at a device's full rate and every running node progresses at
    ``share(devices busy)`` of it, so nodes that run at once slow each other down."""
    if share is not None:
        return _simulate_shared(dag, duration, share, rng, on_blocked)
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
    classes, events = dag.classes, disp.events
    out.peak = DeviceMap(lambda: classes.counted_map(classes.replay(events)[1]))
    return out


def _simulate_shared(
    dag: TransitionDAG,
    duration: Callable[[Node], float],
    share: Callable[[int], float],
    rng: random.Random | None,
    on_blocked: Callable[[Blocked], bool] | None,
) -> Schedule:
    """``simulate`` where running nodes share cores: between two events every running
    node does ``share(busy devices)`` seconds of its full-rate work per second."""
    disp = Dispatcher(dag, rng, on_blocked)
    out = Schedule()
    clock = 0.0
    left: dict[int, float] = {}  # running node -> full-rate seconds of work left
    width: dict[int, int] = {}  # running node -> its devices
    while not disp.done:
        for node in disp.start_ready():
            out.start[node.id] = clock
            out.order.append(node.id)
            left[node.id] = max(0.0, float(duration(node)))
            width[node.id] = len(node.devices)
        if not left:
            if disp.stuck():
                raise disp.infeasible()
            break
        rate = share(sum(width.values()))
        nid = min(left, key=lambda i: (left[i], i))  # the heap's order: earliest end, then node id
        done = left.pop(nid)
        del width[nid]
        clock += done / rate
        for i in left:
            left[i] = max(0.0, left[i] - done)
        out.end[nid] = clock
        disp.finish(nid)
    classes, events = dag.classes, disp.events
    out.peak = DeviceMap(lambda: classes.counted_map(classes.replay(events)[1]))
    return out


def full_rate_seconds(
    spans: Mapping[int, tuple[float, float, int]], share: Callable[[int], float] | None
) -> dict[int, float]:
    """What each measured node would have taken at a device's full rate (what
    ``LinkModel.seconds`` models and calibration learns from): ``spans`` maps a node to
    its measured start, end and device count; over its span it ran at ``share`` of the
    devices busy at each moment (every node then running). Without ``share``: its span."""
    if share is None:
        return {n: end - start for n, (start, end, _) in spans.items()}
    times = sorted({t for start, end, _ in spans.values() for t in (start, end)})
    # the rate in each stretch between two consecutive starts or ends
    rates = [
        share(sum(w for s, e, w in spans.values() if s <= lo and e >= hi))
        for lo, hi in zip(times, times[1:], strict=False)
    ]
    out = {}
    for n, (start, end, _) in spans.items():
        out[n] = sum(
            r * (hi - lo)
            for lo, hi, r in zip(times, times[1:], rates, strict=False)
            if lo >= start and hi <= end
        )
    return out


@dataclass(frozen=True)
class LinkModel:
    """Seconds of a node from its bytes: ``intra_bandwidth`` / ``inter_bandwidth`` bytes
    per second a device receives within / across hosts, the calibrated p2p efficiency of
    each, ``group_setup_s`` when its primitives make groups, ``call_s`` per node;
    ``transition_s`` per transition beyond its nodes (releasing its groups, renaming
    EMUs); ``cores`` the devices share (None: each device has its own);
    ``copy_s_per_gb`` per GB the busiest device copies from a source it holds;
    ``group_release_s`` per group the transition made, released when it ends;
    ``host_s_per_gb`` per GB the devices of one host (``devices_per_node`` of them;
    None: no host term) receive together, what they share beyond their own links."""

    intra_bandwidth: float
    inter_bandwidth: float
    intra_efficiency: float = 0.5
    inter_efficiency: float = 0.4
    group_setup_s: float = 0.02
    call_s: float = 0.005
    transition_s: float = 0.0
    cores: int | None = None
    copy_s_per_gb: float = 0.0
    group_release_s: float = 0.0
    host_s_per_gb: float = 0.0
    devices_per_node: int | None = None

    def _host_gb(self, node: Node) -> float:
        return node.max_host_in(self.devices_per_node) / 1e9 if self.devices_per_node else 0.0

    def ideal(self, node: Node) -> dict[str, float]:
        """Seconds at efficiency 1 per class (``p2p_intra``, ``p2p_inter``: the most any
        device receives, split by link, over the link's bandwidth; the primitives of a
        node run at once) and the counts of fixed costs (``groups``, ``calls``; ``copy_gb``:
        GB the busiest device copies from a source it holds; ``host_gb``: GB the busiest
        host's devices receive together)."""
        worst, links = node.max_moved_in, node.bytes_by_link
        total = links.get("intra", 0) + links.get("inter", 0)
        intra = links.get("intra", 0) / total if total else 0.0
        return {
            "p2p_intra": worst * intra / self.intra_bandwidth,
            "p2p_inter": worst * (1.0 - intra) / self.inter_bandwidth if total else 0.0,
            "groups": 1.0 if node.groups else 0.0,
            "calls": 1.0,
            "copy_gb": node.max_copied / 1e9,
            "host_gb": self._host_gb(node),
        }

    def seconds(self, node: Node) -> float:
        """A node's seconds at a device's full rate (alone on its cores)."""
        worst, links = node.max_moved_in, node.bytes_by_link
        within = links.get("intra", 0)
        total = within + links.get("inter", 0)
        intra = within / total if total else 0.0
        return (
            worst * intra / self.intra_bandwidth / self.intra_efficiency
            + (
                worst * (1.0 - intra) / self.inter_bandwidth / self.inter_efficiency
                if total
                else 0.0
            )
            + (self.group_setup_s if node.groups else 0.0)
            + self.call_s
            + node.max_copied / 1e9 * self.copy_s_per_gb
            + (self._host_gb(node) * self.host_s_per_gb if self.host_s_per_gb else 0.0)
        )

    @property
    def sharing(self) -> Callable[[int], float] | None:
        """The rate each busy device gets when devices share ``cores`` (``simulate``'s
        ``share``), None when each device has its own."""
        cores = self.cores
        return None if cores is None else partial(core_share, cores)

    def outside(self, dag: TransitionDAG) -> dict[str, float]:
        """The counts of a transition's costs outside its nodes (``Calibrator``
        classes): one transition, and the groups its nodes make (released at its end)."""
        return {"transitions": 1.0, "groups_released": float(sum(n.groups for n in dag.nodes))}

    def total(self, dag: TransitionDAG, makespan: float) -> float:
        """A transition's seconds: its DAG's makespan plus what it costs outside the
        nodes (a fixed cost, and releasing the groups they made)."""
        out = self.outside(dag)
        return (
            makespan
            + self.transition_s * out["transitions"]
            + self.group_release_s * out["groups_released"]
        )

    @classmethod
    def of(cls, cluster, eff=None) -> LinkModel:
        """The link model of a ``ClusterSpec`` under calibrated efficiencies (a planner
        ``Efficiency``; None: its conservative defaults): a device's bandwidth within its
        node, its share of its node's NICs across nodes (every device of a node sends at
        once during a transition), the cores its devices share, its local copy cost,
        what a host's devices share. Devices of a fixed CPU capacity move bytes at their
        cores' worth of one core's rates (the slowest device's)."""
        if eff is None:
            from nereus.planner.cost import CONSERVATIVE as eff
        q = cluster.capacity() if getattr(cluster, "device_cores", None) is not None else 1.0
        return cls(
            cluster.intra_node_bandwidth * q,
            cluster.device_share_of_inter_node() * q,
            eff.p2p_intra,
            eff.p2p_inter,
            eff.group_setup_s,
            eff.transition_call_s,
            eff.transition_s,
            cluster.cores,
            eff.copy_s_per_gb,
            eff.group_release_s,
            eff.host_s_per_gb,
            cluster.devices_per_node,
        )
