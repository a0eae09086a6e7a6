"""The DAG's analytic bytes against the state layer's exact plans, over random layouts, DP
degrees and devices: per node and per model-stage the bytes moved equal
``plan_reshard``'s (through ``plan_stage_transition``), every device receives what the
plans send it, and every device's memory at a node's peak and after the whole DAG is
what the state layer's memory effects say."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nereus.errors import InfeasiblePlan, StateError
from nereus.planner import Plan, StagePlan
from nereus.state import EMU, Layout, plan_stage_transition, training_slots
from nereus.transition import SpecBytes, build_dag
from tests.state.helpers import spec_for

STAGES = ("policy_generation", "reference_inference", "policy_training")


def _slots(stage: str, dtype: str) -> tuple[str, ...]:
    return training_slots(dtype) if "training" in stage else ("param",)


def _emus(plan: Plan, stage: str, spec, dtype: str, tag: str = "") -> list[EMU]:
    sp = plan[stage]
    return [
        EMU(f"{stage}.{tag}{i}", stage, spec, Layout(sp.tp, sp.pp), d, _slots(stage, dtype))
        for i, d in enumerate(sp.devices)
    ]


@st.composite
def cases(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    spec = spec_for(
        kv_heads=kv,
        tied=draw(st.booleans()),
        layers=draw(st.sampled_from([3, 4])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
    )
    devices = draw(st.sampled_from([4, 8]))
    plans = []
    for _ in range(2):
        stages = []
        for stage in STAGES:
            tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= devices]))
            pp = draw(st.sampled_from([p for p in (1, 2) if tp * p <= devices]))
            dp = draw(st.integers(1, devices // (tp * pp)))
            if draw(st.booleans()):  # back to back from a start
                start = draw(st.integers(0, devices - tp * pp * dp))
                stages.append((stage, StagePlan.on_range(tp, pp, dp, start)))
            else:  # anywhere
                devs = draw(st.permutations(range(devices)))[: tp * pp * dp]
                stages.append(
                    (
                        stage,
                        StagePlan(
                            tp,
                            pp,
                            dp,
                            tuple(tuple(devs[i * tp * pp : (i + 1) * tp * pp]) for i in range(dp)),
                        ),
                    )
                )
        plans.append(Plan(tuple(stages)))
    return spec, plans[0], plans[1], devices


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_analytic_bytes_and_memory_equal_the_state_layers(case):
    spec, current, target, devices = case
    dtype = spec.params[0].dtype
    slots = {s: _slots(s, dtype) for s in STAGES}
    try:
        dag = build_dag(current, target, {s: spec for s in STAGES}, slots=slots)
    except (InfeasiblePlan, StateError):
        event("refused")
        return  # a layout the model does not divide into, or no source to Extend from
    event(f"{sum(n.count for n in dag.nodes) // 4 * 4}+ primitives")
    initial: dict[int, int] = defaultdict(int)
    after: dict[int, int] = defaultdict(int)
    for stage in STAGES:
        cur = _emus(current, stage, spec, dtype)
        for e in cur:
            for d in e.devices:
                initial[d] += e.bytes_on(d)
        nodes = [n for n in dag.nodes if n.stage == stage]
        if not nodes:
            continue
        exact = plan_stage_transition(
            cur, _emus(target, stage, spec, dtype, "next"), bucket_bytes=0
        )
        assert sum(n.bytes for n in nodes) == exact.bytes_moved, stage
        step_of = {
            (s.kind, tuple(e.name for e in s.created), tuple(e.name for e in s.freed)): s
            for s in exact.steps
        }
        assert len(step_of) == len(exact.steps) == sum(n.count for n in nodes)
        for n in nodes:
            steps = [
                step_of[
                    (op.kind, tuple(e.name for e in op.created), tuple(e.name for e in op.freed))
                ]
                for op in n.ops
            ]
            assert n.bytes == sum(s.bytes_moved for s in steps), n.label
            received: dict[int, int] = defaultdict(int)
            peak: dict[int, int] = defaultdict(int)
            net: dict[int, int] = defaultdict(int)
            for s in steps:
                for p in s.plans:
                    for m in p.remote_moves():
                        received[m.dst_device] += m.nbytes
                for d in s.memory.devices():
                    peak[d] += s.memory.peak_delta(d)
                    net[d] += s.memory.after_delta(d)
            assert {d: v for d, v in n.moved_in.items() if v} == dict(received), n.label
            assert {d: v for d, v in n.alloc.items() if v} == {
                d: v for d, v in peak.items() if v
            }, n.label
            assert {d: n.alloc.get(d, 0) - n.release.get(d, 0) for d in n.devices} == {
                d: net.get(d, 0) for d in n.devices
            }, n.label
        for s in exact.steps:
            for d in s.memory.devices():
                after[d] += s.memory.after_delta(d)
    assert {d: v for d, v in dag.initial.items() if v} == {d: v for d, v in initial.items() if v}
    for d in set(initial) | set(after):
        dag_after = dag.initial.get(d, 0) + sum(
            n.alloc.get(d, 0) - n.release.get(d, 0) for n in dag.nodes
        )
        assert dag_after == initial[d] + after[d], d


def test_spec_bytes_of_a_position_add_up_to_the_model():
    spec = spec_for(kv_heads=2, tied=True, layers=5)
    table = SpecBytes(spec, training_slots("float32"))
    for tp, pp in ((1, 1), (2, 1), (4, 2), (8, 2)):
        layout = Layout(tp, pp)
        total = sum(table.held(layout, (p, r)) for p in range(pp) for r in range(tp))
        emu = EMU(
            "e", "policy_training", spec, layout, tuple(range(tp * pp)), training_slots("float32")
        )
        assert total == sum(emu.bytes_on(d) for d in emu.devices)


def _answers(table: SpecBytes) -> list[int]:
    out = []
    for tp, pp in ((1, 1), (2, 1), (4, 2), (1, 3)):
        a = Layout(tp, pp)
        for p in range(pp):
            for r in range(tp):
                out.append(table.held(a, (p, r)))
                b = Layout(max(1, tp // 2), pp)
                out.append(table.local(a, (p, r), b, (p, r // 2)))
                out.append(table.kept(a, (p, r), b, (p, r // 2)))
    return out


def test_layers_read_off_the_first_layer_give_every_answer_the_parameter_by_parameter_grouping_gives(  # noqa: E501
    monkeypatch,
):
    import nereus.transition.analytic as analytic

    spec = spec_for(kv_heads=2, tied=True, layers=6)
    assert analytic._repeating(spec) is not None
    fast = _answers(SpecBytes(spec, training_slots("float32")))
    with monkeypatch.context() as m:
        m.setattr(analytic, "_repeating", lambda spec: None)
        assert _answers(SpecBytes(spec, training_slots("float32"))) == fast
    # two layers' parameters swapped in the list: layers no longer come one after another
    params = list(spec.params)
    i = next(i for i, p in enumerate(params) if p.layer == 1)
    j = next(j for j, p in enumerate(params) if p.layer == 2)
    params[i], params[j] = params[j], params[i]
    shuffled = replace(spec, params=tuple(params))
    assert analytic._repeating(shuffled) is None
    assert _answers(SpecBytes(shuffled, training_slots("float32"))) == fast
