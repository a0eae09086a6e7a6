"""The DAG's feasibility and makespan against brute force over small DAGs (up to 8 nodes):
``build_dag`` never calls a target feasible when no order of its nodes fits the caps; how
often it calls a target infeasible that some order fits, and how far its schedule is
from the best order found, are printed (not asserted: they are what the design trades)."""

from __future__ import annotations

import random
import statistics

from nereus.errors import InfeasiblePlan, InfeasibleTransition, StateError
from nereus.planner import Plan, StagePlan
from nereus.state import DeviceSet, training_slots
from nereus.transition import LinkModel, build_dag, simulate
from tests.state.helpers import spec_for
from tests.transition._brute import best_makespan, serial_order

SPEC = spec_for(layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=64)
STAGES = ("policy_generation", "reference_inference", "policy_training")
SLOTS = {"policy_training": training_slots("float32")}
LINK = LinkModel(1e9, 2e8)


def _stage_plan(rng: random.Random, devices: int) -> StagePlan:
    tp = rng.choice([1, 2])
    dp = rng.choice([1, 2]) if 2 * tp <= devices else 1
    devs = rng.sample(range(devices), tp * dp)
    return StagePlan(tp, 1, dp, tuple(tuple(devs[i * tp : (i + 1) * tp]) for i in range(dp)))


def test_build_dag_never_calls_feasible_what_no_order_fits():
    rng = random.Random(16)
    specs = {s: SPEC for s in STAGES}
    cases = feasible = infeasible = false_infeasible = 0
    gaps: list[float] = []
    while cases < 150:
        devices = rng.choice([3, 4])
        stages = rng.sample(STAGES, rng.choice([2, 3]))
        current = Plan(tuple((s, _stage_plan(rng, devices)) for s in stages))
        target = Plan(tuple((s, _stage_plan(rng, devices)) for s in stages))
        try:
            shape = build_dag(current, target, specs, DeviceSet.single_host(devices), slots=SLOTS)
        except (InfeasiblePlan, StateError):
            continue
        if not 2 <= len(shape.nodes) <= 8:
            continue
        # a cap between what the devices hold before and after and the most they could hold
        peak = max(
            shape.initial.get(d, 0) + sum(n.alloc.get(d, 0) for n in shape.nodes)
            for d in shape.caps
        )
        floor = max(shape.initial.get(d, 0) for d in shape.caps)
        cap = int(floor + rng.uniform(0.3, 1.0) * (peak - floor))
        caps = dict.fromkeys(shape.caps, cap)
        cases += 1
        order = serial_order(shape, caps)
        try:
            dag = build_dag(
                current,
                target,
                specs,
                DeviceSet.single_host(devices, cap),
                slots=SLOTS,
                duration=LINK.seconds,
            )
        except InfeasibleTransition:
            infeasible += 1
            false_infeasible += order is not None
            continue
        assert order is not None, (current.to_dict(), target.to_dict(), cap)
        feasible += 1
        if len(dag.nodes) <= 7:
            best = best_makespan(shape, caps, LINK.seconds)
            gaps.append(simulate(dag, LINK.seconds).makespan / best - 1.0)
    assert feasible and gaps
    print(
        f"\nbrute force over {cases} DAGs of 2-8 nodes: {feasible} feasible, {infeasible} "
        "called infeasible, "
        f"{false_infeasible} of them ({false_infeasible / max(infeasible, 1):.0%}) fit in "
        "some serial order "
        f"(false-infeasible rate {false_infeasible / cases:.1%} of all); makespan gap to the "
        "best order over "
        f"{len(gaps)} DAGs: median {statistics.median(gaps):.1%}, mean "
        f"{statistics.fmean(gaps):.1%}, "
        f"max {max(gaps):.1%}"
    )
