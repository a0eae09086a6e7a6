"""One model-stage's local transition: Split -> Destroy -> Extend/Merge through T_sub.

``plan_stage_transition(current, target)`` turns the EMUs a model-stage has now into
the EMUs it should have (their layouts and device tuples; DP is how many), as an
ordered list of primitive ``Step``s (DESIGN §4), through T_sub (``sub_layout`` of the
current and target layouts):

1. Split every current EMU that is larger than T_sub into the T_sub replicas a target
   wants inside its devices (placed where the target wants them); replicas nobody
   needs are never built: the split frees the EMU once they exist;
2. Destroy the EMUs no target needs -- except one that a target still has to be built
   from, which is destroyed once that target exists;
3. build every target with one primitive from the replicas it may use:
   - the replica that already is it: nothing moves;
   - the T_sub replicas inside its devices: Merge them into its layout, fetching what
     its other devices lack from them (freed once it exists);
   - none inside: Extend from an EMU on disjoint devices (a replica or a current EMU of
     any layout) onto its devices, in its layout (rank-aligned when the layouts are
     equal), load-balanced across every disjoint EMU.

Every plan moves only the bytes its target lacks on each device (box intersection), so
the whole transition moves what a target does not already hold where it needs it.
Where a target has no replica inside it and no EMU sits on devices disjoint from it, the
transition retries with a smaller T_sub (halving tp, then pp: more, smaller replicas
fit inside a target) before declaring it infeasible.

It simulates the model-stage's memory through the steps: each step is checked against
the devices' budgets counting the other live EMUs of the model-stage plus ``used``
(everything else on the device), so an infeasible order raises ``OutOfMemory`` before
anything runs. The transition DAG joins these per-model-stage lists across stages.

Refuses: ``StateError`` for mixed layouts or model-stages, overlapping targets;
``InfeasiblePlan`` when no T_sub leaves a target a source (use the checkpoint fallback).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nereus.errors import InfeasiblePlan, StateError
from nereus.state.emu import EMU, DeviceSet
from nereus.state.layout import Layout
from nereus.state.memory import DEFAULT_BUCKET_BYTES
from nereus.state.primitives import Step, destroy, extend, merge, split, sub_layout, sub_placements

__all__ = ["StageTransition", "plan_stage_transition", "smaller_subs"]


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


def _same(emus: Sequence[EMU], what: str) -> Layout:
    if not emus:
        raise StateError(f"{what} EMUs must not be empty")
    layouts = {e.layout for e in emus}
    stages = {e.model_stage for e in emus}
    if len(layouts) > 1 or len(stages) > 1:
        raise StateError(f"{what} EMUs must share one model-stage and one layout: {list(emus)}")
    used: set[int] = set()
    for e in emus:
        if used & set(e.devices):
            raise StateError(f"{what} EMUs overlap on devices {sorted(used & set(e.devices))}")
        used |= set(e.devices)
    return emus[0].layout


def _pick_disjoint(cands: Sequence[tuple[int, ...]], within: set[int]) -> list[tuple[int, ...]]:
    chosen, taken = [], set()
    for c in cands:
        if set(c) <= within and taken.isdisjoint(c):
            chosen.append(c)
            taken |= set(c)
    return chosen


def smaller_subs(sub: Layout) -> list[Layout]:
    """``sub`` and the T_subs to retry with after it: tp halved, then pp halved."""
    out = [sub]
    tp, pp = sub.tp, sub.pp
    while tp > 1:
        tp //= 2
        out.append(Layout(tp, pp, sub.cuts))
    cuts = sub.cuts
    while pp > 1:
        pp //= 2
        cuts = cuts[1::2]  # adjacent stages pair up: every other cut stays
        out.append(Layout(tp, pp, cuts))
    return out


def plan_stage_transition(
    current: Sequence[EMU],
    target: Sequence[EMU],
    devices: DeviceSet | None = None,
    *,
    used: Mapping[int, int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> StageTransition:
    """Plan the transition of one model-stage from ``current`` to ``target`` EMUs
    (targets give layout, devices, name; tensors and logical state come from current)."""
    a, b = _same(current, "current"), _same(target, "target")
    if current[0].model_stage != target[0].model_stage:
        raise StateError(f"current model-stage {current[0].model_stage} != target {target[0].model_stage}")
    first = sub_layout(a, b)
    for sub in smaller_subs(first):
        try:
            return _through(current, target, sub, devices, used, bucket_bytes)
        except InfeasiblePlan:
            if sub.size == 1:
                raise
    raise AssertionError("unreachable: the 1 x 1 T_sub either returns or raises")


def _through(current: Sequence[EMU], target: Sequence[EMU], sub: Layout, devices: DeviceSet | None,
             used: Mapping[int, int] | None, bucket_bytes: int) -> StageTransition:
    b = target[0].layout
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

    def run(step: Step) -> None:
        steps.append(step)
        for e in step.freed:
            live.pop(e.name)
        for e in step.created:
            live[e.name] = e

    desired = [[t.devices] if b == sub else sub_placements(b, t.devices, sub) for t in target]
    flat_desired = [slot for slots in desired for slot in slots]
    # Which T_sub replicas will exist: current EMUs of layout T_sub, and what each larger
    # EMU is split into (the slots a target wants inside its devices).
    fits: dict[str, list[tuple[int, ...]]] = {
        e.name: _pick_disjoint(flat_desired, set(e.devices)) for e in current if e.layout != sub}
    slots = [e.devices for e in current if e.layout == sub] + [p for ps in fits.values() for p in ps]
    inside: dict[int, list[tuple[int, ...]]] = {}
    taken: set[tuple[int, ...]] = set()
    for j, t in enumerate(target):
        order = [x for x in desired[j] if x in slots and x not in taken]
        order += [x for x in slots if x not in order and x not in taken and {*x} <= set(t.devices)]
        inside[j] = _pick_disjoint(order, set(t.devices))
        taken |= set(inside[j])
    # A target with no replica inside it is built by Extend from an EMU on disjoint
    # devices, in its layout (a current EMU, or a replica split out of one).
    for j, t in enumerate(target):
        if not inside[j] and not any(set(e.devices).isdisjoint(t.devices) for e in current):
            raise InfeasiblePlan(
                f"{t.name}: no {sub} replica of {current[0].model_stage} sits inside its devices "
                f"{list(t.devices)} and no EMU on devices disjoint from them to Extend from; "
                "use the checkpoint fallback"
            )
    # 1. Split (the EMUs no replica comes from are destroyed below, once no target needs them)
    for emu in current:
        if emu.layout != sub and fits[emu.name]:
            run(split(emu, sub, devices, placements=fits[emu.name], used=others_used([emu]),
                      bucket_bytes=bucket_bytes))
    by_slot = {e.devices: e for e in live.values() if e.layout == sub}
    assigned = {by_slot[x].name: j for j, xs in inside.items() for x in xs}
    donors: dict[int, list[EMU]] = {}
    for j, t in enumerate(target):
        if not inside[j]:
            cands = [e for e in live.values() if set(e.devices).isdisjoint(t.devices)]
            # unassigned ones first, then those of the target's own layout (rank-aligned)
            cands.sort(key=lambda e: (e.name in assigned, e.layout != t.layout, e.name))
            donors[j] = cands
    keep = {cands[0].name for cands in donors.values()}
    # 2. Destroy what no target needs (a donor waits for the targets built from it)
    for e in sorted(live.values(), key=lambda e: e.name):
        if e.name not in assigned and e.name not in keep:
            run(destroy(e, list(live.values()), devices))
    # 3. Build every target: Extends first (their sources may be merged into other
    # targets), then the donors nobody keeps go, then Merges; a target that already
    # exists stays as it is
    built: dict[int, EMU] = {}

    def build(j: int) -> None:
        t = target[j]
        parts = [live[n] for n, k in assigned.items() if k == j]
        if len(parts) == 1 and parts[0].layout == t.layout and parts[0].devices == t.devices:
            built[j] = parts[0]
            return
        name = t.name if t.name not in live else f"{t.name}@{len(steps)}"
        if parts:
            step = merge(parts, t.layout, t.devices, devices, name=name, used=others_used(parts),
                         bucket_bytes=bucket_bytes)
        else:
            src, *rest = [e for e in donors[j] if e.name in live]
            step = extend(src, t.devices, devices, name=name, layout=t.layout, replicas=rest,
                          used=others_used([src, *rest]), bucket_bytes=bucket_bytes)
        run(step)
        built[j] = step.created[0]

    for j in donors:
        build(j)
    for name in sorted(keep):
        if name in live and name not in assigned:
            run(destroy(live[name], list(live.values()), devices))
    for j in range(len(target)):
        if j not in donors:
            build(j)
    result = [built[j] for j in range(len(target))]
    return StageTransition(sub, tuple(steps), tuple(result))
