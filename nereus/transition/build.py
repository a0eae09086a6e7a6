"""``build_dag``: the global transition DAG from two plans (``nereus.transition.dag``
describes it), with the resource edges the list scheduler (``nereus.transition.schedule``)
finds while simulating it, and its schedule under the duration it was given."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from nereus.config import require
from nereus.planner.plan import Plan, StagePlan
from nereus.state.emu import DeviceSet
from nereus.state.layout import Layout
from nereus.state.spec import ModelSpec
from nereus.transition._classes import DeviceClasses, DeviceMap
from nereus.transition._regular import Hosts, regular_part
from nereus.transition._stage import Runs, StagePart, general_part, unchanged_part
from nereus.transition.analytic import SpecBytes
from nereus.transition.dag import Node, Schedule, TransitionDAG, _Results, stage_moves, stage_rank
from nereus.transition.rules import ALL_RULES, Rules
from nereus.transition.schedule import Blocked, simulate

__all__ = ["build_dag"]


def _extent(sp: StagePlan) -> int:
    return (
        sp.start + sp.num_devices if sp.start is not None else 1 + max(max(e) for e in sp.devices)
    )


_F = TypeVar("_F", bound=Callable)


def _without_cycle_collection(fn: _F) -> _F:
    """``fn`` with Python's cycle collector paused while it runs. A build allocates
    tens of thousands of short-lived containers that reference counting frees; left on,
    the collector would walk the ones still alive every 700 net allocations (about a
    tenth of a build at 1,024 devices). The few cycles a build leaves (a DAG and its
    nodes) are collected once it is back on. It is turned back on only if it was on."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return run  # type: ignore[return-value]


@_without_cycle_collection
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
    share: Callable[[int], float] | None = None,
    rules: Rules = ALL_RULES,
) -> TransitionDAG:
    """The transition DAG from ``current`` to ``target`` (see the module docstring).

    ``specs``: each model-stage's ``ModelSpec``; ``slots``: each model-stage's slots
    (training EMUs hold their optimizer's; default ``("param",)``); ``names``: each
    model-stage's current EMU names (default ``<model-stage>.<replica>``); ``devices``:
    a ``DeviceSet`` (hosts and budgets) or a function device -> budget;
    ``resident``: bytes per device held besides the plans' EMUs; ``duration``: a node's
    modelled seconds for the resource-edge simulation (default: its bytes); ``share``:
    the rate busy devices get when they share cores (``LinkModel.sharing``); ``rules``:
    the global rules it is built and scheduled under (``nereus.transition.rules``; all by
    default: without ``resource_edges`` no resource edge is added)."""
    require(
        set(current.names) == set(target.names),
        "target plan",
        target.names,
        f"must place the same model-stages as the current plan {current.names}",
    )
    missing = sorted(s for s in current.names if s not in specs)
    require(not missing, "specs", sorted(specs), f"must give a ModelSpec for {missing}")
    # plans with no model-stage (every one lost, to be rebuilt after the DAG) move nothing
    size = max(
        max((_extent(sp) for _, sp in current), default=0),
        max((_extent(sp) for _, sp in target), default=0),
        1 + max(resident or (), default=-1),
        1,
    )
    ds = devices if isinstance(devices, DeviceSet) else None
    caps: Runs = [([None], size)]
    if ds is not None:
        require(
            size <= len(ds),
            "devices",
            f"DeviceSet of {len(ds)} devices",
            f"must hold every device the plans use (up to {size - 1})",
        )
        if ds.memory_bytes:
            mem = ds.memory_bytes[:size]
            caps = [([mem[0]], size)] if mem == (mem[0],) * size else [(list(mem), 1)]
    elif devices is not None:
        caps = [([devices(d) for d in range(size)], 1)]  # type: ignore[operator]
    if host_of is not None:
        hosts = Hosts(host_of, [host_of(d) for d in range(size)], size)
    elif ds is not None:
        hosts = Hosts(ds.host, ds.hosts, size)
    else:
        hosts = Hosts(lambda d: 0, [0] * size, size)
    resident_at: Runs = [([None], size)]
    if resident:
        at: list[int | None] = [None] * size
        for d, v in resident.items():
            at[d] = v
        resident_at = [(at, 1)]
    tables: dict[int, SpecBytes] = {}
    layouts: dict[tuple[int, int], Layout] = {}  # one Layout per shape within this build

    def layout(tp: int, pp: int) -> Layout:
        got = layouts.get((tp, pp))
        if got is None:
            got = layouts[(tp, pp)] = Layout(tp, pp)
        return got

    parts: list[StagePart] = []
    for stage in current.names:
        a, b = current[stage], target[stage]
        spec, want = specs[stage], tuple((slots or {}).get(stage, ("param",)))
        base = tables.get(id(spec))
        if base is None:
            base = tables[id(spec)] = SpecBytes(spec, want)
        table = base if base.slots == want else base.with_slots(want)
        given = (names or {}).get(stage)
        if given is not None:
            require(
                len(given) == a.dp, f"names of {stage}", list(given), f"must name its {a.dp} EMUs"
            )
        if not stage_moves(a, b):
            parts.append(unchanged_part(stage, a, table, size))
            continue
        part = regular_part(stage, a, b, table, hosts, bucket_bytes, size, given, layout)
        parts.append(
            part
            if part is not None
            else general_part(stage, a, b, table, hosts.of, bucket_bytes, size, given)
        )
    classes = DeviceClasses.of_parts(parts, caps, resident_at)
    nodes: list[Node] = []
    for p, part in enumerate(parts):
        base_id, rank = len(nodes), stage_rank(part.stage)
        for li, ns in enumerate(part.nodes):
            devs = tuple(sorted(ns.devices)) if ns.devices is not None else None
            n = Node(
                len(nodes),
                ns.kind,
                part.stage,
                ns.ops,
                devs,
                ns.alloc,
                ns.release,
                ns.moved,
                ns.bytes,
                dict(ns.links),
                ns.groups,
                {base_id + d for d in ns.deps},
                rank=rank,
            )
            n._count, n._local = ns.count, (p, li)
            nodes.append(n)
    dag = TransitionDAG(
        nodes,
        DeviceMap(lambda: classes.counted_map(classes.caps)),
        DeviceMap(lambda: classes.counted_map(classes.initial)),
        current,
        target,
        _Results(parts),
        hosts.of,
        classes=classes,
        parts=parts,
        duration=duration,
        share=share,
        rules=rules,
    )
    last = (
        _add_resource_edges(dag, duration or (lambda n: float(n.bytes) + 1.0))
        if rules.resource_edges
        else None
    )
    if duration is not None:  # the list schedule under duration
        dag._schedule = last if last is not None else simulate(dag, duration, share=share)
    return dag


class _EdgeAdded(Exception):
    """The simulation found a blocked acquisition and gave it a resource edge."""


def _add_resource_edges(dag: TransitionDAG, duration: Callable[[Node], float]) -> Schedule | None:
    """Simulate the list schedule; whenever an acquisition is blocked on a device's
    memory and a Destroy on that device is pending that it does not reach, make it wait
    for that Destroy (the one freeing the most there) and simulate again. A node blocked
    with nothing running and no such Destroy makes the target infeasible. Returns the
    last simulation (the schedule of the DAG as it leaves here), None when none ran."""
    if not any(dag.classes.risky):
        return None  # no order of the nodes can exceed a cap: nothing is ever blocked on memory
    effects = dag.classes.effects

    def blocked(b: Blocked) -> bool:
        node = dag.nodes[b.node]
        cands = [
            n
            for n in dag.nodes
            if n.kind == "destroy"
            and n.id not in b.finished
            and n.id not in node.deps
            and effects[n.id].release.get(b.cls, 0) > 0
        ]
        if not cands:  # most blocked acquisitions wait for nothing but what is running
            return False
        below = dag.reachable_from(node.id)
        below.add(node.id)
        cands = [n for n in cands if n.id not in below]
        if not cands:
            return False
        best = max(cands, key=lambda n: (effects[n.id].release.get(b.cls, 0), -n.id))
        node.deps.add(best.id)
        node.resource_deps.add(best.id)
        raise _EdgeAdded

    for _ in range(len(dag.nodes) ** 2 + 1):
        try:
            return simulate(dag, duration, on_blocked=blocked, share=dag.share)
        except _EdgeAdded:
            continue
    raise AssertionError(
        "resource edges did not converge"
    )  # each round adds an edge of a finite DAG
