"""The resource-edge rule: an acquisition blocked on a device's memory waits for a Destroy
on that device that does not depend on it; with none, the target is infeasible
(``InfeasibleTransition`` naming the node, the device, the need and the cap) and
``transition_seconds`` prices it at infinity."""

from __future__ import annotations

import math
import random

import pytest

from nereus.errors import InfeasiblePlan, InfeasibleTransition, StateError
from nereus.planner import Plan, StagePlan
from nereus.state import DeviceSet, training_slots
from nereus.transition import LinkModel, build_dag, simulate, transition_seconds
from tests.state.helpers import spec_for

SPEC = spec_for(layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=64)
STAGES = ("policy_generation", "reference_inference", "policy_training")
SPECS = {s: SPEC for s in STAGES}
SLOTS = {"policy_training": training_slots("float32")}
LINK = LinkModel(1e9, 2e8)


def plan(**stages) -> Plan:
    return Plan(
        tuple(
            (n, StagePlan(tp, 1, len(d), tuple(tuple(x) for x in d)))
            for n, (tp, d) in stages.items()
        )
    )


# generation doubles onto devices 2 and 3; reference inference moves from 2 and 0 onto a
# TP 2 replica on 1 and 0; training grows from device 3 to TP 2 on 1 and 2
CURRENT = plan(
    policy_generation=(1, [[0]]), reference_inference=(1, [[2], [0]]), policy_training=(1, [[3]])
)
TARGET = plan(
    policy_generation=(1, [[2], [3]]),
    reference_inference=(2, [[1, 0]]),
    policy_training=(2, [[1, 2]]),
)
CAP = int(3.95 * SPEC.nbytes)


def _acyclic(dag) -> bool:
    left = {n.id: set(n.deps) for n in dag.nodes}
    while left:
        free = [i for i, d in left.items() if not d & set(left)]
        if not free:
            return False
        for i in free:
            del left[i]
    return True


def _check_edges(dag, cap: int) -> None:
    assert _acyclic(dag)
    for n in dag.nodes:
        for m in n.resource_deps:
            src = dag.nodes[m]
            assert src.kind == "destroy" and m in n.deps
            # it frees bytes on a device the blocked node acquires bytes on
            assert any(src.release.get(d, 0) > 0 and n.alloc.get(d, 0) > 0 for d in n.devices), (
                n.label,
                src.label,
            )
    s = simulate(dag, LINK.seconds)
    # no start takes a device over its cap (one may start over it: a current plan that no longer
    # fits)
    assert all(v <= max(cap, dag.initial.get(d, 0)) for d, v in s.peak.items())
    for n in dag.nodes:
        assert all(s.end[m] <= s.start[n.id] for m in n.deps)


def test_a_blocked_acquisition_waits_for_a_destroy_on_its_device():
    dag = build_dag(CURRENT, TARGET, SPECS, DeviceSet.single_host(4, CAP), slots=SLOTS)
    waiting = [n for n in dag.nodes if n.resource_deps]
    assert waiting and dag.resource_edges == sum(len(n.resource_deps) for n in waiting)
    _check_edges(dag, CAP)
    # without the cap nothing waits on memory
    assert (
        build_dag(CURRENT, TARGET, SPECS, DeviceSet.single_host(4), slots=SLOTS).resource_edges == 0
    )


def test_with_no_destroy_to_wait_for_the_target_is_infeasible_and_priced_at_infinity():
    cap = int(2.2 * SPEC.nbytes)
    with pytest.raises(InfeasibleTransition) as info:
        build_dag(CURRENT, TARGET, SPECS, DeviceSet.single_host(4, cap), slots=SLOTS)
    e = info.value
    node = next(
        n for n in build_dag(CURRENT, TARGET, SPECS, slots=SLOTS).nodes if n.label == e.node
    )
    assert node.alloc.get(e.device, 0) > 0  # the node named acquires on the device named
    assert e.cap_bytes == cap and e.need_bytes > cap
    assert str(e.device) in str(e) and e.node in str(e)
    assert isinstance(e, InfeasiblePlan)
    assert (
        transition_seconds(CURRENT, TARGET, SPECS, DeviceSet.single_host(4, cap), LINK, slots=SLOTS)
        == math.inf
    )
    seconds = transition_seconds(
        CURRENT, TARGET, SPECS, DeviceSet.single_host(4, CAP), LINK, slots=SLOTS
    )
    assert 0 < seconds < math.inf
    assert (
        transition_seconds(
            CURRENT, CURRENT, SPECS, DeviceSet.single_host(4, cap), LINK, slots=SLOTS
        )
        == 0.0
    )


def test_resource_edges_keep_the_dag_acyclic_and_every_cap():
    rng = random.Random(5)
    seen = 0
    for _ in range(400):
        devices = rng.choice([4, 6])

        def stage_plan(devices: int = devices) -> StagePlan:
            tp, dp = rng.choice([1, 2]), rng.choice([1, 2])
            devs = rng.sample(range(devices), tp * dp)
            return StagePlan(
                tp, 1, dp, tuple(tuple(devs[i * tp : (i + 1) * tp]) for i in range(dp))
            )

        current = Plan(tuple((s, stage_plan()) for s in STAGES))
        target = Plan(tuple((s, stage_plan()) for s in STAGES))
        cap = int(rng.uniform(2.5, 5.0) * SPEC.nbytes)
        try:
            dag = build_dag(
                current,
                target,
                SPECS,
                DeviceSet.single_host(devices, cap),
                slots=SLOTS,
                duration=LINK.seconds,
            )
        except (InfeasiblePlan, StateError):
            continue
        seen += dag.resource_edges > 0
        _check_edges(dag, cap)
    assert seen >= 3
