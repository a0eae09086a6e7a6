"""One model-stage's local transition: Split -> Destroy -> Extend/Merge through T_sub.

``stage_ops(current, target)`` turns the replicas a model-stage has now into the
replicas it should have (layouts and device tuples; DP is how many) as an ordered list
of primitive ``Op``s (docs/design.md §4), through T_sub (``sub_layout`` of the current and
target layouts). It looks only at names, layouts and devices, so the runtime (which
turns every op into a ``Step`` with its exact reshard plans: ``plan_stage_transition``)
and the transition DAG (which prices ops analytically at any scale: ``nereus.transition``)
share one structure:

``plan_stage_transition`` also simulates the model-stage's memory through the steps:
each is checked against the devices' budgets counting the other live EMUs of the
model-stage plus ``used`` (everything else on the device), so an infeasible order raises
``OutOfMemory`` before anything runs. The transition DAG joins model-stages' ops.

Refuses: ``StateError`` for mixed layouts or model-stages, overlapping targets;
``InfeasiblePlan`` when no T_sub leaves a target a source (use the checkpoint fallback).

More (how it works): docs/state.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from nereus.errors import InfeasiblePlan, StateError
from nereus.state.emu import EMU, DeviceSet
from nereus.state.layout import Layout
from nereus.state.memory import DEFAULT_BUCKET_BYTES
from nereus.state.primitives import Step, destroy, extend, merge, split, sub_layout, sub_placements

__all__ = [
    "Rep",
    "Op",
    "StageOps",
    "StageTransition",
    "stage_ops",
    "op_step",
    "plan_stage_transition",
    "smaller_subs",
    "DONORS",
]

# at most this many disjoint EMUs an Extend balances its reads across
DONORS = 4


class Replica(Protocol):
    name: str
    layout: Layout
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Rep:
    """A replica as the structure sees it: a name, a layout and its devices."""

    name: str
    layout: Layout
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Op:
    """One primitive: ``inputs`` read (a Split's EMU, a Merge's parts, an Extend's
    source then the EMUs it balances across, a Destroy's EMU), ``created`` made,
    ``freed`` dropped once it is done."""

    kind: Literal["split", "destroy", "extend", "merge"]
    inputs: tuple[Replica, ...]
    created: tuple[Rep, ...]
    freed: tuple[Replica, ...]


@dataclass(frozen=True)
class StageOps:
    """A model-stage's ops in order, its T_sub, and the replica that becomes each target
    (in target order; a target that needed no op keeps its current replica's name)."""

    sub: Layout
    ops: tuple[Op, ...]
    result: tuple[Replica, ...]


@dataclass(frozen=True, eq=False)
class StageTransition:
    """The ordered steps of one model-stage's transition and the EMUs alive after it
    (one per target, in target order; a target that needed no step is the EMU that
    already matched it, under that EMU's name)."""

    sub: Layout
    steps: tuple[Step, ...]
    result: tuple[EMU, ...]

    @property
    def bytes_moved(self) -> int:
        return sum(s.bytes_moved for s in self.steps)


def _same(reps: Sequence[Replica], what: str) -> Layout:
    if not reps:
        raise StateError(f"{what} EMUs must not be empty")
    layouts = {e.layout for e in reps}
    if len(layouts) > 1:
        raise StateError(f"{what} EMUs must share one layout: {list(reps)}")
    seen: set[int] = set()
    for e in reps:
        if not seen.isdisjoint(e.devices):
            raise StateError(f"{what} EMUs overlap on devices {sorted(seen & set(e.devices))}")
        seen.update(e.devices)
    return reps[0].layout


def smaller_subs(sub: Layout) -> list[Layout]:
    """``sub`` and the T_subs to retry with after it: tp halved, then pp halved."""
    return list(_smaller(sub))


def _smaller(sub: Layout) -> Iterator[Layout]:
    yield sub
    tp, pp = sub.tp, sub.pp
    while tp > 1:
        tp //= 2
        yield Layout(tp, pp, sub.cuts)
    cuts = sub.cuts
    while pp > 1:
        pp //= 2
        cuts = cuts[1::2]  # adjacent stages pair up: every other cut stays
        yield Layout(tp, pp, cuts)


def stage_ops(current: Sequence[Replica], target: Sequence[Replica]) -> StageOps:
    """The ops that turn ``current`` into ``target`` (see the module docstring)."""
    a, b = _same(current, "current"), _same(target, "target")
    for sub in _smaller(sub_layout(a, b)):
        try:
            return _ops_through(current, target, sub)
        except InfeasiblePlan:
            if sub.size == 1:
                raise
    raise AssertionError("unreachable: the 1 x 1 T_sub either returns or raises")


def _ops_through(current: Sequence[Replica], target: Sequence[Replica], sub: Layout) -> StageOps:
    b = target[0].layout
    ops: list[Op] = []
    live: dict[str, Replica] = {e.name: e for e in current}
    owner = {d: e for e in current for d in e.devices}  # device -> current EMU

    def run(op: Op) -> None:
        ops.append(op)
        for e in op.freed:
            live.pop(e.name)
        for e in op.created:
            live[e.name] = e

    desired = [[t.devices] if b == sub else sub_placements(b, t.devices, sub) for t in target]
    # Which T_sub replicas will exist: current EMUs of layout T_sub, and what each larger
    # EMU is split into (the slots a target wants inside its devices; they are disjoint).
    fits: dict[str, list[tuple[int, ...]]] = {e.name: [] for e in current if e.layout != sub}
    for slots in desired:
        for x in slots:
            e = owner.get(x[0])
            if e is not None and e.layout != sub and all(owner.get(d) is e for d in x):
                fits[e.name].append(x)
    slot_at: dict[int, tuple[int, ...]] = {
        e.devices[0]: e.devices for e in current if e.layout == sub
    }
    for xs in fits.values():
        slot_at.update({x[0]: x for x in xs})
    taken: set[tuple[int, ...]] = set()
    inside: dict[int, list[tuple[int, ...]]] = {}
    for j, t in enumerate(target):
        within = set(t.devices)
        mine = [x for x in desired[j] if slot_at.get(x[0]) == x and x not in taken]
        mine += [
            x
            for d in t.devices
            if (x := slot_at.get(d)) is not None
            and x not in taken
            and x not in mine
            and within.issuperset(x)
        ]
        inside[j] = mine
        taken.update(mine)
    needs_donor = [j for j in range(len(target)) if not inside[j]]
    for j in needs_donor:
        t = set(target[j].devices)
        if all(not t.isdisjoint(e.devices) for e in current):
            raise InfeasiblePlan(
                f"{target[j].name}: no {sub} replica sits inside its devices "
                f"{list(target[j].devices)} and no "
                "EMU on devices disjoint from them to Extend from; use the checkpoint fallback"
            )
    # 1. Split (the EMUs no replica comes from are destroyed below, once no target needs them)
    for e in current:
        if e.layout != sub and fits[e.name]:
            run(
                Op(
                    "split",
                    (e,),
                    tuple(Rep(f"{e.name}.{i}", sub, x) for i, x in enumerate(fits[e.name])),
                    (e,),
                )
            )
    by_slot = {e.devices: e for e in live.values() if e.layout == sub}
    assigned = {by_slot[x].name: j for j, xs in inside.items() for x in xs}
    donors: dict[int, list[Replica]] = {}
    if needs_donor:
        # unassigned EMUs first, then those of the targets' layout (rank-aligned), each in
        # the order they came to exist, taken round robin so the targets' reads spread over
        # every candidate (and neighbouring targets read from neighbouring replicas)
        pool = sorted(live.values(), key=lambda e: (e.name in assigned, e.layout != b))
        for k, j in enumerate(needs_donor):
            t = set(target[j].devices)
            found: list[Replica] = []
            for i in range(len(pool)):
                e = pool[(k + i) % len(pool)]
                if t.isdisjoint(e.devices):
                    found.append(e)
                    if len(found) == DONORS:
                        break
            donors[j] = found
    keep = {cands[0].name for cands in donors.values()}
    # 2. Destroy what no target needs (a donor waits for the targets built from it)
    for e in list(live.values()):
        if e.name not in assigned and e.name not in keep:
            run(Op("destroy", (e,), (), (e,)))
    # 3. Build every target: Extends first (their sources may be merged into other
    # targets), then the donors nobody keeps go, then Merges; a target that already
    # exists stays as it is
    parts_of: dict[int, list[Replica]] = defaultdict(list)
    for n, j in assigned.items():
        parts_of[j].append(live[n])
    built: dict[int, Replica] = {}

    def build(j: int) -> None:
        t = target[j]
        parts = parts_of.get(j, [])
        if len(parts) == 1 and parts[0].layout == t.layout and parts[0].devices == tuple(t.devices):
            built[j] = parts[0]
            return
        made = Rep(
            t.name if t.name not in live else f"{t.name}@{len(ops)}", t.layout, tuple(t.devices)
        )
        if parts:
            run(Op("merge", tuple(parts), (made,), tuple(parts)))
        else:
            run(Op("extend", tuple(e for e in donors[j] if e.name in live), (made,), ()))
        built[j] = made

    for j in donors:
        build(j)
    for e in [e for e in live.values() if e.name in keep and e.name not in assigned]:
        run(Op("destroy", (e,), (), (e,)))
    for j in range(len(target)):
        if j not in donors:
            build(j)
    return StageOps(sub, tuple(ops), tuple(built[j] for j in range(len(target))))


def op_step(
    op: Op,
    live: Mapping[str, EMU],
    devices: DeviceSet | None = None,
    *,
    used: Mapping[int, int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Step:
    """The ``Step`` (with its exact reshard plans) of ``op`` over the EMUs alive now
    (``live``: name -> EMU, the op's inputs among them), checked against the budgets
    in ``devices`` counting ``used`` when given."""
    ins = [live[e.name] for e in op.inputs]
    if op.kind == "split":
        step = split(
            ins[0],
            op.created[0].layout,
            devices,
            placements=[r.devices for r in op.created],
            used=used,
            bucket_bytes=bucket_bytes,
        )
    elif op.kind == "destroy":
        step = destroy(ins[0], list(live.values()), devices)
    elif op.kind == "merge":
        made = op.created[0]
        step = merge(
            ins,
            made.layout,
            made.devices,
            devices,
            name=made.name,
            used=used,
            bucket_bytes=bucket_bytes,
        )
    else:
        made = op.created[0]
        step = extend(
            ins[0],
            made.devices,
            devices,
            name=made.name,
            layout=made.layout,
            replicas=ins[1:],
            used=used,
            bucket_bytes=bucket_bytes,
        )
    if [e.name for e in step.created] != [r.name for r in op.created]:
        raise AssertionError(
            f"{op.kind} made {[e.name for e in step.created]}, its op says "
            f"{[r.name for r in op.created]}"
        )
    return step


def plan_stage_transition(
    current: Sequence[EMU],
    target: Sequence[EMU],
    devices: DeviceSet | None = None,
    *,
    used: Mapping[int, int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> StageTransition:
    """Plan the transition of one model-stage from ``current`` to ``target`` EMUs
    (targets give layout, devices, name; tensors and logical state come from current):
    ``stage_ops`` made into ``Step``s with their reshard plans, checked against the
    budgets step after step."""
    _same(current, "current")
    _same(target, "target")
    stages = {e.model_stage for e in current} | {t.model_stage for t in target}
    if len(stages) > 1:
        raise StateError(
            f"current and target EMUs must be of one model-stage, not {sorted(stages)}"
        )
    planned = stage_ops(current, target)
    live: dict[str, EMU] = {e.name: e for e in current}
    steps: list[Step] = []

    def others_used(step_inputs: Sequence[EMU]) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int, used or {})
        names = {e.name for e in step_inputs}
        for e in live.values():
            if e.name not in names:
                for d in e.devices:
                    out[d] += e.bytes_on(d)
        return out

    for op in planned.ops:
        ins = [live[e.name] for e in op.inputs]
        step = op_step(op, live, devices, used=others_used(ins), bucket_bytes=bucket_bytes)
        steps.append(step)
        for e in step.freed:
            live.pop(e.name)
        for e in step.created:
            live[e.name] = e
    return StageTransition(planned.sub, tuple(steps), tuple(live[r.name] for r in planned.result))
