"""The transition DAG on small specs: analytic bytes equal the state layer's reshard plans,
the list schedule keeps every device under its cap, and a blocked acquisition waits for
a Destroy on its device."""

from __future__ import annotations

import pytest

from nereus.errors import InfeasibleTransition
from nereus.planner import Plan, StagePlan
from nereus.state import EMU, DeviceSet, Layout, plan_stage_transition, training_slots
from nereus.transition import LinkModel, build_dag, simulate
from tests.state.helpers import spec_for

SPEC = spec_for(layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=64)
SLOTS = {"policy_training": training_slots("float32")}


def plan(**stages) -> Plan:
    return Plan(
        tuple(
            (n, StagePlan(tp, pp, len(d), tuple(tuple(x) for x in d)))
            for n, (tp, pp, d) in stages.items()
        )
    )


A = plan(
    policy_generation=(1, 1, [[0], [1], [2], [3]]),
    reference_inference=(1, 1, [[3]]),
    policy_training=(2, 1, [[0, 1]]),
)
B = plan(
    policy_generation=(2, 1, [[0, 1], [2, 3]]),
    reference_inference=(1, 2, [[0, 1]]),
    policy_training=(1, 1, [[2]]),
)


def _emus(p: Plan, stage: str, tag: str = "") -> list[EMU]:
    sp = p[stage]
    return [
        EMU(f"{stage}.{tag}{i}", stage, SPEC, Layout(sp.tp, sp.pp), d, SLOTS.get(stage, ("param",)))
        for i, d in enumerate(sp.devices)
    ]


def test_analytic_bytes_equal_the_state_layers_plans():
    dag = build_dag(A, B, {n: SPEC for n in A.names}, slots=SLOTS)
    for stage in A.names:
        exact = plan_stage_transition(_emus(A, stage), _emus(B, stage, "next"))
        assert sum(n.bytes for n in dag.nodes if n.stage == stage) == exact.bytes_moved, stage
        # the memory after every primitive is the state layer's, device by device
        after = {d: 0 for d in range(4)}
        for step in exact.steps:
            for d in step.memory.devices():
                after[d] += step.memory.after_delta(d)
        model = {d: 0 for d in range(4)}
        for n in dag.nodes:
            if n.stage == stage:
                for d in n.devices:
                    model[d] += n.alloc.get(d, 0) - n.release.get(d, 0)
        assert model == after, stage


def test_the_schedule_keeps_caps_and_a_blocked_acquisition_waits_for_a_destroy():
    weights = SPEC.nbytes
    dag = build_dag(
        A, B, {n: SPEC for n in A.names}, DeviceSet.single_host(4, int(4.2 * weights)), slots=SLOTS
    )
    s = simulate(dag, LinkModel(1e9, 1e9).seconds)
    assert set(s.end) == {n.id for n in dag.nodes}
    assert all(s.peak[d] <= int(4.2 * weights) for d in s.peak)
    for n in dag.nodes:  # every dependency ends before its dependant starts
        assert all(s.end[d] <= s.start[n.id] for d in n.deps)
    with pytest.raises(InfeasibleTransition) as info:
        build_dag(
            A,
            B,
            {n: SPEC for n in A.names},
            DeviceSet.single_host(4, int(3.1 * weights)),
            slots=SLOTS,
        )
    assert (
        info.value.cap_bytes == int(3.1 * weights) and info.value.need_bytes > info.value.cap_bytes
    )


def test_a_build_leaves_the_cycle_collector_as_it_found_it():
    import gc

    specs = {n: SPEC for n in A.names}
    assert gc.isenabled()
    try:
        build_dag(A, B, specs, slots=SLOTS)
        assert gc.isenabled()
        with pytest.raises(InfeasibleTransition):  # also when the build raises
            build_dag(A, B, specs, DeviceSet.single_host(4, int(3.1 * SPEC.nbytes)), slots=SLOTS)
        assert gc.isenabled()
        gc.disable()
        build_dag(A, B, specs, slots=SLOTS)
        assert not gc.isenabled()  # a caller that paused it keeps it paused
    finally:
        gc.enable()


def test_plans_with_no_model_stage_give_an_empty_dag():
    # a job whose every model-stage lost its last EMU rebuilds them after the DAG: it moves nothing
    empty = Plan(())
    dag = build_dag(
        empty,
        empty,
        {},
        DeviceSet((0, 0), (1 << 30, 1 << 30)),
        resident={0: 4096},
        duration=lambda n: 1.0,
    )
    assert dag.nodes == [] and dag.bytes == 0
    assert dag.schedule.makespan == 0.0


@pytest.mark.parametrize("regular", [False, True], ids=["listed", "repeating"])
def test_a_dropped_dag_is_freed_without_the_cycle_collector(regular):
    # the Replanner prices many targets a boundary: a DAG it drops must not wait for the
    # cycle collector (which would walk every one of them, often in the middle of a build)
    import gc
    import weakref

    if regular:
        current = Plan((("policy-generation", StagePlan.on_range(2, 1, 8, 0)),))
        target = Plan((("policy-generation", StagePlan.on_range(1, 2, 8, 0)),))
        specs, slots = {"policy-generation": SPEC}, None
    else:
        current, target, specs, slots = A, B, {n: SPEC for n in A.names}, SLOTS
    gc.disable()
    try:
        dag = build_dag(
            current,
            target,
            specs,
            DeviceSet.single_host(16, 1 << 40),
            slots=slots,
            duration=LinkModel(1e9, 1e9).seconds,
        )
        kept = dag.nodes[0]
        want = (kept.devices, dict(kept.alloc), kept.ops)
        kept._devices = kept._alloc = kept._ops = (
            None  # listed again below, from what the node holds
        )
        dropped = weakref.ref(dag)
        del dag
        assert dropped() is None, "a reference cycle keeps the DAG until the cycle collector runs"
        assert (
            kept.devices,
            dict(kept.alloc),
            kept.ops,
        ) == want  # a node kept still lists its fields
    finally:
        gc.enable()
