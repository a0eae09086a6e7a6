"""One model-stage's local transition: Split -> Destroy -> Extend -> Merge through T_sub.

``plan_stage_transition(current, target)`` turns the EMUs a model-stage has now into
the EMUs it should have (their layouts and device tuples; DP is how many), as an
ordered list of primitive ``Step``s (DESIGN §4):

1. Split every current EMU into T_sub replicas (``sub_layout`` of the current and
   target layouts), placed where the target wants them when they fit inside it;
2. Destroy the T_sub replicas no target needs -- except one that an Extend still
   has to copy, which is destroyed right after that Extend;
3. Extend T_sub replicas onto target devices that hold none (rank-aligned, from a
   source on disjoint devices, load-balanced across the replicas that qualify);
4. Merge the T_sub replicas inside each target's devices into the target layout.

It simulates the model-stage's memory through the steps: each step is checked against
the devices' budgets counting the other live EMUs of the model-stage plus ``used``
(everything else on the device), so an infeasible order raises ``OutOfMemory`` before
anything runs. The transition DAG joins these per-model-stage lists across stages.

Refuses: ``StateError`` for mixed layouts or model-stages, overlapping targets;
``InfeasiblePlan`` when a target replica needs an Extend but no source replica sits
on devices disjoint from it (use the checkpoint fallback).
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

__all__ = ["StageTransition", "plan_stage_transition"]


@dataclass(frozen=True, eq=False)
class StageTransition:
    """The ordered steps of one model-stage's transition and the EMUs alive after it
    (one per target, in target order; a target that needed no Merge is the T_sub EMU
    that already matched it, under that EMU's name)."""

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
    sub = sub_layout(a, b)
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
    # 1. Split
    for emu in current:
        if emu.layout == sub:
            continue
        fits = _pick_disjoint(flat_desired, set(emu.devices))
        if fits:
            # where a target wants T_sub replicas inside this EMU, put them there; cut
            # the devices left over in order
            rest = [d for d in emu.devices if all(d not in p for p in fits)]
            fits += [tuple(rest[i:i + sub.size]) for i in range(0, len(rest), sub.size)]
        run(split(emu, sub, devices, placements=fits or None,
                  used=others_used([emu]), bucket_bytes=bucket_bytes))
    # 2. Which T_sub replica goes into which target; the rest is extended.
    assigned: dict[str, int] = {}
    extends: list[tuple[int, tuple[int, ...]]] = []
    for j, t in enumerate(target):
        inside = {e.devices: e for e in live.values() if e.name not in assigned}
        order = [s for s in desired[j] if s in inside]
        order += [s for s in inside if s not in order and {*s} <= set(t.devices)]
        chosen = _pick_disjoint(order, set(t.devices))
        for s in chosen:
            assigned[inside[s].name] = j
        rest = [d for d in t.devices if all(d not in s for s in chosen)]
        if not chosen:
            slots = list(desired[j])
        else:
            slots = [tuple(rest[i:i + sub.size]) for i in range(0, len(rest), sub.size)]
        extends.extend((j, slot) for slot in slots)
    sources: dict[tuple[int, ...], EMU] = {}
    for j, slot in extends:
        cands = [e for e in live.values() if set(e.devices).isdisjoint(slot)]
        if not cands:
            raise InfeasiblePlan(
                f"{target[j].name}: no {sub} replica of {current[0].model_stage} sits on devices disjoint "
                f"from {list(slot)} to Extend from; use the checkpoint fallback"
            )
        cands.sort(key=lambda e: (e.name not in assigned, e.name))
        sources[slot] = cands[0]
    keep_for_extend = {e.name for e in sources.values()}
    # 3. Destroy what no target needs (sources of an Extend wait for it)
    for e in sorted(live.values(), key=lambda e: e.name):
        if e.name not in assigned and e.name not in keep_for_extend:
            run(destroy(e, list(live.values()), devices))
    # 4. Extend
    for i, (j, slot) in enumerate(extends):
        src = sources[slot]
        replicas = [e for e in live.values() if e is not src and e.layout == sub
                    and set(e.devices).isdisjoint(slot)]
        step = extend(src, slot, devices, name=f"{target[j].name}.x{i}", replicas=replicas,
                      used=others_used([src, *replicas]), bucket_bytes=bucket_bytes)
        run(step)
        assigned[step.created[0].name] = j
    for name in sorted(keep_for_extend):
        if name not in assigned and name in live:
            run(destroy(live[name], list(live.values()), devices))
    # 5. Merge
    result: list[EMU] = []
    for j, t in enumerate(target):
        parts = [live[n] for n, k in assigned.items() if k == j]
        if len(parts) == 1 and parts[0].layout == t.layout and parts[0].devices == t.devices:
            result.append(parts[0])
            continue
        name = t.name if t.name not in live else f"{t.name}@{len(steps)}"
        step = merge(parts, t.layout, t.devices, devices, name=name, used=others_used(parts),
                     bucket_bytes=bucket_bytes)
        run(step)
        result.append(step.created[0])
    return StageTransition(sub, tuple(steps), tuple(result))
