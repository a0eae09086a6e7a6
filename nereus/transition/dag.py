"""The global transition DAG: every model-stage's primitives, joined (DESIGN §5).

``build_dag(current, target, specs, devices)`` takes two plans (model-stage ->
``StagePlan``), each model-stage's ``ModelSpec`` and the devices (hosts and memory caps)
and returns a ``TransitionDAG``:

- per model-stage that moves, the state layer's local structure (``nereus.state.
  transition.stage_ops``: Split -> Destroy -> Extend/Merge through T_sub, retrying with a
  smaller T_sub where a target has no source), one node per primitive -- or per set of
  identical primitives of one model-stage on device-disjoint DP replicas (``Node.ops``),
  which run at once; every device's memory effect stays exact;
- data edges by EMU (a primitive waits for the ones that create what it reads) and
  reader edges (a primitive that frees an EMU waits for every one that reads it);
- across model-stages, release before acquire and ties broken generation, inference,
  training: the priority the one list scheduler (``nereus.transition.schedule``) starts
  ready nodes in; and, when an acquisition is blocked on a device's memory, a resource
  edge from a Destroy on that device that is not reachable from the blocked node. With
  no such Destroy the target is infeasible: ``InfeasibleTransition`` names the node, the
  device, the need and the cap.

Nodes carry their devices, per-device allocation (target shards not adopted, one
transfer bucket) and release (freed sources, the bucket), bytes per link (intra- and
inter-node) and the groups they make. Bytes are analytic (``nereus.transition.analytic``),
so 1,024 devices stay cheap; the executor builds the exact reshard plans when a node
runs. Pure: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from nereus.config import require
from nereus.errors import OutOfMemory
from nereus.planner.plan import Plan, StagePlan
from nereus.state.emu import DeviceSet
from nereus.state.layout import Layout
from nereus.state.spec import ModelSpec
from nereus.state.transition import Op, Rep, stage_ops
from nereus.transition.analytic import SpecBytes

__all__ = ["Node", "TransitionDAG", "build_dag", "stage_rank", "stage_moves"]

KIND_RANK = {"generation": 0, "inference": 1, "training": 2}


def stage_rank(stage: str) -> int:
    """Tie order of a model-stage: generation, then inference, then training."""
    for kind, rank in KIND_RANK.items():
        if kind in stage:
            return rank
    return len(KIND_RANK)


def stage_moves(a: StagePlan, b: StagePlan) -> bool:
    """Whether going from ``a`` to ``b`` moves any tensor (layout, DP or devices)."""
    return (a.tp, a.pp, a.devices) != (b.tp, b.pp, b.devices)


@dataclass
class Node:
    """One primitive, or a set of identical device-disjoint ones (``ops``), of one
    model-stage. ``alloc``/``release``: bytes per device taken when it starts, given
    back when it ends. ``moved_in``: bytes each device receives."""

    id: int
    kind: str
    stage: str
    ops: tuple[Op, ...]
    devices: tuple[int, ...]
    alloc: dict[int, int]
    release: dict[int, int]
    moved_in: dict[int, int]
    bytes: int
    bytes_by_link: dict[str, int]
    groups: int
    deps: set[int] = field(default_factory=set)
    resource_deps: set[int] = field(default_factory=set)

    @property
    def count(self) -> int:
        return len(self.ops)

    @property
    def label(self) -> str:
        return f"{self.kind}[{self.stage}]#{self.id}" + (f"x{self.count}" if self.count > 1 else "")

    @property
    def releases_only(self) -> bool:
        return not any(self.alloc.values())


@dataclass
class TransitionDAG:
    """Nodes (ids are indices), every device's cap and bytes in use before the
    transition, and each moving model-stage's replicas after it (with the names they
    are built under, in target order)."""

    nodes: list[Node]
    caps: dict[int, int | None]
    initial: dict[int, int]
    current: Plan
    target: Plan
    results: dict[str, tuple[Rep, ...]]
    host_of: Callable[[int], int]

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
        return {d for n in self.nodes for d in n.devices}

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


def _reps(stage: str, sp: StagePlan, names: Sequence[str] | None) -> list[Rep]:
    layout = Layout(sp.tp, sp.pp)
    if names is not None:
        require(len(names) == sp.dp, f"names of {stage}", list(names), f"must name its {sp.dp} EMUs")
    return [Rep(names[i] if names is not None else f"{stage}.{i}", layout, tuple(devs))
            for i, devs in enumerate(sp.devices)]


@lru_cache(maxsize=64)
def _spec_bytes(spec: ModelSpec, slots: tuple[str, ...]) -> SpecBytes:
    """One ``SpecBytes`` per (model, slots): its memo of bytes per layout position is
    pure, so every DAG built for that model reuses it."""
    return SpecBytes(spec, slots)


class _Effects:
    """Per-op memory effect and traffic from analytic bytes."""

    def __init__(self, table: SpecBytes, host_of: Callable[[int], int], bucket_bytes: int) -> None:
        self.table, self.host_of, self.bucket = table, host_of, bucket_bytes

    def of(self, op: Op) -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[str, int]]:
        t = self.table
        alloc: dict[int, int] = defaultdict(int)
        release: dict[int, int] = defaultdict(int)
        moved: dict[int, int] = defaultdict(int)
        links = {"intra": 0, "inter": 0}
        at = {d: (e, e.layout.position(e.devices.index(d))) for e in op.inputs for d in e.devices}
        reuse = op.kind in ("split", "merge")  # their sources are freed: unchanged shards are adopted
        for made in op.created:
            for i, d in enumerate(made.devices):
                pos = made.layout.position(i)
                held = t.held(made.layout, pos)
                src = at.get(d)
                local = t.local(src[0].layout, src[1], made.layout, pos) if src is not None else 0
                kept = t.kept(src[0].layout, src[1], made.layout, pos) if reuse and src is not None else 0
                alloc[d] += held - kept
                if src is not None and kept:
                    release[d] -= kept  # the adopted shard stays; its source does not give it back
                moved[d] += held - local
                if held - local:
                    links[self._link(op, d)] += held - local
        for e in op.freed:
            for i, d in enumerate(e.devices):
                release[d] += t.held(e.layout, e.layout.position(i))
        traffic: dict[int, int] = defaultdict(int)
        for d, n in moved.items():
            if n:
                traffic[d] += n
        if traffic and self.bucket:
            senders = {d for e in op.inputs for d in e.devices}
            for d in set(traffic) | senders:
                b = min(self.bucket, max(traffic.get(d, 0), 1))
                alloc[d] += b
                release[d] += b
        return dict(alloc), dict(release), dict(moved), links

    def _link(self, op: Op, device: int) -> str:
        """Whether ``device``'s bytes come from its own host (all sources there) or not."""
        host = self.host_of(device)
        sources = {d for e in op.inputs for d in e.devices if d != device}
        return "intra" if all(self.host_of(s) == host for s in sources) else "inter"


def _reads(op: Op) -> tuple[str, ...]:
    return tuple(e.name for e in op.inputs)


def _devices(op: Op) -> set[int]:
    out = {d for e in op.inputs for d in e.devices}
    out.update(d for e in op.created for d in e.devices)
    return out


def build_dag(
    current: Plan,
    target: Plan,
    specs: Mapping[str, ModelSpec],
    devices: DeviceSet | Callable[[int], int | None] | None = None,
    *,
    slots: Mapping[str, Sequence[str]] | None = None,
    names: Mapping[str, Sequence[str]] | None = None,
    resident: Mapping[int, int] | None = None,
    host_of: Callable[[int], int] | None = None,
    bucket_bytes: int = 0,
    duration: Callable[[Node], float] | None = None,
) -> TransitionDAG:
    """The transition DAG from ``current`` to ``target`` (see the module docstring).

    ``specs``: each model-stage's ``ModelSpec``; ``slots``: each model-stage's slots
    (training EMUs hold their optimizer's; default ``("param",)``); ``names``: each
    model-stage's current EMU names (default ``<model-stage>.<replica>``); ``devices``:
    a ``DeviceSet`` (hosts and budgets) or a function device -> budget;
    ``resident``: bytes per device held besides the plans' EMUs; ``duration``: a node's
    modelled seconds for the resource-edge simulation (default: its bytes)."""
    require(set(current.names) == set(target.names), "target plan", target.names,
            f"must place the same model-stages as the current plan {current.names}")
    missing = sorted(s for s in current.names if s not in specs)
    require(not missing, "specs", sorted(specs), f"must give a ModelSpec for {missing}")
    if isinstance(devices, DeviceSet):
        ds = devices
        cap_of: Callable[[int], int | None] = ds.budget
        host_of = host_of or ds.host
    else:
        cap_of = devices if devices is not None else (lambda d: None)
    host = host_of or (lambda d: 0)
    nodes: list[Node] = []
    results: dict[str, tuple[Rep, ...]] = {}
    initial: dict[int, int] = defaultdict(int, resident or {})
    for stage, sp in current:
        table = _spec_bytes(specs[stage], tuple((slots or {}).get(stage, ("param",))))
        for e in _reps(stage, sp, (names or {}).get(stage)):
            for i, d in enumerate(e.devices):
                initial[d] += table.held(e.layout, e.layout.position(i))
    for stage in current.names:
        a, b = current[stage], target[stage]
        if not stage_moves(a, b):
            continue
        cur = _reps(stage, a, (names or {}).get(stage))
        tgt = [Rep(f"{stage}.next{i}", Layout(b.tp, b.pp), tuple(devs)) for i, devs in enumerate(b.devices)]
        planned = stage_ops(cur, tgt)
        results[stage] = planned.result
        effects = _Effects(_spec_bytes(specs[stage], tuple((slots or {}).get(stage, ("param",)))), host, bucket_bytes)
        _add_stage(nodes, stage, planned.ops, effects)
    caps = {d: cap_of(d) for d in set(initial) | {d for n in nodes for d in n.devices}}
    dag = TransitionDAG(nodes, caps, dict(initial), current, target, results, host)
    _add_resource_edges(dag, duration or (lambda n: float(n.bytes) + 1.0))
    return dag


def _add_stage(nodes: list[Node], stage: str, ops: Sequence[Op], effects: _Effects) -> None:
    """Nodes of one model-stage's ops, grouped: consecutive ops of one kind on disjoint
    devices share a node. Edges by data and by readers."""
    made_by: dict[str, int] = {}  # EMU name -> node that creates it
    readers: dict[str, set[int]] = defaultdict(set)  # EMU name -> nodes that read it
    groups: list[tuple[int, set[int]]] = []  # open groups of the current run: (node id, devices)
    run_kind = None
    for op in ops:
        if op.kind != run_kind:
            groups, run_kind = [], op.kind
        devs = _devices(op)
        deps = {made_by[n] for n in _reads(op) if n in made_by}
        if op.freed:
            for e in op.freed:
                deps |= readers.get(e.name, set())
        # join the first open group of this run on other devices that no dependency forbids
        target_node = None
        for node_id, used in groups:
            if used.isdisjoint(devs) and node_id not in deps:
                target_node = node_id
                break
        alloc, release, moved, links = effects.of(op)
        moves = any(moved.values())
        if target_node is None:
            node = Node(len(nodes), op.kind, stage, (op,), tuple(sorted(devs)), dict(alloc), dict(release),
                        dict(moved), sum(moved.values()), dict(links), 1 if moves else 0, set(deps))
            nodes.append(node)
            groups.append((node.id, set(devs)))
        else:
            node = nodes[target_node]
            node.ops = (*node.ops, op)
            node.devices = tuple(sorted(set(node.devices) | devs))
            for src, dst in ((alloc, node.alloc), (release, node.release), (moved, node.moved_in)):
                for d, v in src.items():
                    dst[d] = dst.get(d, 0) + v
            node.bytes += sum(moved.values())
            for k, v in links.items():
                node.bytes_by_link[k] = node.bytes_by_link.get(k, 0) + v
            node.groups += 1 if moves else 0
            node.deps |= deps
            for i, (nid, used) in enumerate(groups):
                if nid == target_node:
                    groups[i] = (nid, used | devs)
        node.deps.discard(node.id)
        for e in op.created:
            made_by[e.name] = node.id
        for n in _reads(op):
            readers[n].add(node.id)


class _EdgeAdded(Exception):
    """The simulation found a blocked acquisition and gave it a resource edge."""


def _add_resource_edges(dag: TransitionDAG, duration: Callable[[Node], float]) -> None:
    """Simulate the list schedule; whenever an acquisition is blocked on a device's
    memory and a Destroy on that device is pending that it does not reach, make it wait
    for that Destroy (the one freeing the most there) and simulate again. A node blocked
    with nothing running and no such Destroy makes the target infeasible."""
    from nereus.transition.schedule import Blocked, simulate

    def blocked(b: Blocked) -> bool:
        node = dag.nodes[b.node]
        below = dag.reachable_from(node.id) | {node.id}
        cands = [n for n in dag.nodes if n.kind == "destroy" and n.id not in below and n.id not in b.finished
                 and n.id not in node.deps and n.release.get(b.device, 0) > 0]
        if not cands:
            return False
        best = max(cands, key=lambda n: (n.release.get(b.device, 0), -n.id))
        node.deps.add(best.id)
        node.resource_deps.add(best.id)
        raise _EdgeAdded

    for _ in range(len(dag.nodes) ** 2 + 1):
        try:
            simulate(dag, duration, on_blocked=blocked)
            return
        except _EdgeAdded:
            continue
    raise AssertionError("resource edges did not converge")  # each round adds an edge of a finite DAG


def check_caps(dag: TransitionDAG) -> None:
    """``OutOfMemory`` if a device starts over its cap before anything runs."""
    for d, used in dag.initial.items():
        cap = dag.caps.get(d)
        if cap is not None and used > cap:
            raise OutOfMemory(d, used, cap, "the EMUs resident before the transition")

