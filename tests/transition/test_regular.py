"""A model-stage whose placements repeat is priced without listing its primitives; the DAG
must be the one listing them gives: the same nodes (kind, count, bytes per link, groups,
edges), the same ops, and every device's effect and every device's class the same."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nereus.transition.build as dag_module
from nereus.errors import InfeasiblePlan, StateError
from nereus.planner import Plan, StagePlan
from nereus.state import DeviceSet, training_slots
from nereus.transition import LinkModel, build_dag, simulate
from nereus.transition._regular import Hosts
from tests.state.helpers import spec_for

SPEC = spec_for(kv_heads=2, layers=4)
STAGES = ("policy-generation", "reference-inference", "policy-training")
SLOTS = {"policy-training": training_slots("float32")}


def _listed(*args, **kw):
    """build_dag with every model-stage listed op by op."""
    keep = dag_module.regular_part
    dag_module.regular_part = lambda *a, **k: None
    try:
        return build_dag(*args, **kw)
    finally:
        dag_module.regular_part = keep


def _ops(node) -> list[tuple]:
    return [
        (
            op.kind,
            [e.name for e in op.inputs],
            [(e.name, e.devices) for e in op.created],
            [e.name for e in op.freed],
        )
        for op in node.ops
    ]


def assert_same_dag(got, want) -> None:
    assert [n.label for n in got.nodes] == [n.label for n in want.nodes]
    for g, w in zip(got.nodes, want.nodes, strict=True):
        assert (g.bytes, g.groups, g.deps) == (w.bytes, w.groups, w.deps), g.label
        assert {k: v for k, v in g.bytes_by_link.items() if v} == {
            k: v for k, v in w.bytes_by_link.items() if v
        }
        assert tuple(g.devices) == tuple(w.devices), g.label
        for field in ("alloc", "release", "moved_in"):
            assert {d: v for d, v in getattr(g, field).items() if v} == {
                d: v for d, v in getattr(w, field).items() if v
            }, (g.label, field)
        assert g.max_moved_in == w.max_moved_in and g.releases_only == w.releases_only
        assert g.max_copied == w.max_copied, g.label
        assert _ops(g) == _ops(w), g.label
    assert dict(got.initial) == dict(want.initial) and dict(got.caps) == dict(want.caps)
    assert {s: [(e.name, e.layout, e.devices) for e in got.results[s]] for s in got.results} == {
        s: [(e.name, e.layout, e.devices) for e in want.results[s]] for s in want.results
    }
    link = LinkModel(1e9, 2e8)
    a, b = simulate(got, link.seconds), simulate(want, link.seconds)
    assert (
        a.order == b.order
        and a.makespan == pytest.approx(b.makespan)
        and dict(a.peak) == dict(b.peak)
    )


@st.composite
def plans(draw):
    devices = draw(st.sampled_from([16, 64]))
    cur, tgt = [], []
    for stage in STAGES:
        sizes = []
        for _ in range(2):
            tp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
            dp = draw(st.integers(1, max(1, devices // (tp * pp * 2))))
            sizes.append((tp, pp, dp))
        start = draw(st.sampled_from([0, 0, 2, 4, 8]))
        start = start if max(t * p * d for t, p, d in sizes) + start <= devices else 0
        moved = draw(st.booleans())  # the target starts elsewhere: the listed path
        cur.append((stage, StagePlan.on_range(*sizes[0], start)))
        tgt.append((stage, StagePlan.on_range(*sizes[1], 0 if moved else start)))
    per_host = draw(st.sampled_from([4, 8, devices]))
    budget = draw(st.sampled_from([None, 10**9]))
    ds = DeviceSet(
        tuple(d // per_host for d in range(devices)), (budget,) * devices if budget else ()
    )
    return Plan(tuple(cur)), Plan(tuple(tgt)), ds, draw(st.sampled_from([0, 0, 1000]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_a_repeating_model_stage_is_priced_as_if_its_ops_were_listed(case):
    current, target, devices, bucket = case
    specs = {s: SPEC for s in STAGES}
    try:
        want = _listed(current, target, specs, devices, slots=SLOTS, bucket_bytes=bucket)
    except (InfeasiblePlan, StateError):
        return
    assert_same_dag(
        build_dag(current, target, specs, devices, slots=SLOTS, bucket_bytes=bucket), want
    )


def test_a_thousand_devices_take_a_few_dozen_classes():
    current = Plan((("policy-generation", StagePlan.on_range(2, 1, 256, 0)),))
    target = Plan((("policy-generation", StagePlan.on_range(1, 1, 1024, 0)),))
    dag = build_dag(
        current, target, {"policy-generation": SPEC}, DeviceSet(tuple(d // 8 for d in range(1024)))
    )
    assert len(dag.classes.caps) < 40 and [n.kind for n in dag.nodes] == ["split"] + ["extend"] * 4
    assert sum(n.count for n in dag.nodes) == 256 + 512
    assert_same_dag(
        dag,
        _listed(
            current,
            target,
            {"policy-generation": SPEC},
            DeviceSet(tuple(d // 8 for d in range(1024))),
        ),
    )


def _per_host_by_definition(hosts: list[int]) -> int | None:
    """Every host holds ``m`` consecutive devices, hosts counting up from the first."""
    for m in range(1, len(hosts) + 1):
        if hosts == [hosts[0] + i // m for i in range(len(hosts))]:
            return m
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_hosts_repeat_exactly_when_every_host_holds_as_many_consecutive_devices(hosts):
    got = Hosts(lambda d: hosts[d], hosts, len(hosts))
    single = hosts.count(hosts[0]) == len(hosts)
    assert got.single == single
    if not single:
        assert got.per_host == _per_host_by_definition(hosts)


@st.composite
def moves(draw):
    """A model-stage that keeps its layout and moves to devices disjoint from its own
    (either side, any gap, as many EMUs or more: pools of 1 to 7 replicas, so the Extends
    group both in closed form and first fit), beside one that stays."""
    tp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
    s = tp * pp
    dp_a = draw(st.integers(1, 7))
    dp_b = draw(st.integers(dp_a, dp_a + 9))
    gap = draw(st.integers(0, 5))
    first, second = (dp_a, dp_b) if draw(st.booleans()) else (dp_b, dp_a)
    x0 = draw(st.integers(0, 3))
    x1 = x0 + first * s + gap
    xa, xb = (x0, x1) if first == dp_a else (x1, x0)
    devices = x1 + second * s + draw(st.integers(0, 4))
    per_host = draw(st.sampled_from([1, 2, 4, 8, devices]))
    budget = draw(st.sampled_from([None, 10**9]))
    ds = DeviceSet(
        tuple(d // per_host for d in range(devices)), (budget,) * devices if budget else ()
    )
    cur = (
        ("policy-training", StagePlan.on_range(tp, pp, dp_a, xa)),
        ("reference-inference", StagePlan.on_range(1, 1, 1, 0)),
    )
    tgt = (
        ("policy-training", StagePlan.on_range(tp, pp, dp_b, xb)),
        ("reference-inference", StagePlan.on_range(1, 1, 1, 0)),
    )
    return Plan(cur), Plan(tgt), ds, draw(st.sampled_from([0, 1000]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moves())
def test_a_model_stage_moved_to_other_devices_is_priced_as_if_its_ops_were_listed(case):
    current, target, devices, bucket = case
    specs = {"policy-training": SPEC, "reference-inference": SPEC}
    want = _listed(current, target, specs, devices, slots=SLOTS, bucket_bytes=bucket)
    got = build_dag(current, target, specs, devices, slots=SLOTS, bucket_bytes=bucket)
    assert_same_dag(got, want)
    last = got.nodes[-1]
    assert (last.kind, last.count) == ("destroy", current["policy-training"].dp)


def test_the_moved_path_takes_the_swap_and_leaves_the_rest_listed():
    """It prices a move to disjoint devices in the layout it has (not from the ops), and
    declines an overlapping move, a change of layout and a shrinking one."""
    table = dag_module.SpecBytes(SPEC, ("param",))
    hosts = Hosts(lambda d: d // 8, [d // 8 for d in range(64)], 64)
    taken = dag_module.regular_part(
        "policy-generation",
        StagePlan.on_range(2, 1, 8, 32),
        StagePlan.on_range(2, 1, 8, 0),
        table,
        hosts,
        0,
        64,
        None,
    )
    assert taken is not None and taken.results is None  # not listed: the ops come on first use
    declined = (
        ((2, 1, 8, 8), (2, 1, 8, 0)),
        ((2, 1, 8, 32), (1, 1, 16, 0)),
        ((2, 1, 8, 32), (2, 1, 4, 0)),
    )
    for a, b in declined:
        assert (
            dag_module.regular_part(
                "policy-generation",
                StagePlan.on_range(*a),
                StagePlan.on_range(*b),
                table,
                hosts,
                0,
                64,
                None,
            )
            is None
        )
