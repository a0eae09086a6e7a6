"""What a transition's estimate counts beyond bytes sent: devices that share cores (nodes
running at once slow each other down in the list schedule, ``full_rate_seconds`` undoes
it for calibration), the bytes a device copies from a source it holds, the bytes a
host's devices receive together, and the fixed cost outside the nodes."""

from __future__ import annotations

import pytest

from nereus.planner import Calibrator, Plan, StagePlan
from nereus.planner.cluster import local_cpu_cluster
from nereus.state import DeviceSet, Layout
from nereus.transition import (
    LinkModel,
    SpecBytes,
    build_dag,
    full_rate_seconds,
    simulate,
    transition_seconds,
)
from tests.state.helpers import spec_for

SPEC = spec_for(layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64, vocab=64)


def _plan(gen: tuple, train: tuple) -> Plan:
    return Plan(
        (
            ("policy_generation", StagePlan(len(gen[0]), 1, len(gen), gen)),
            ("policy_training", StagePlan(len(train[0]), 1, len(train), train)),
        )
    )


# two model-stages change layout on disjoint devices: their nodes may run at once
A = _plan(((0,), (1,)), ((2, 3),))
B = _plan(((0, 1),), ((2,), (3,)))
SPECS = {"policy_generation": SPEC, "policy_training": SPEC}


def test_nodes_at_once_share_the_cores():
    dag = build_dag(A, B, SPECS)
    alone = simulate(dag, lambda n: 1.0)
    both = [n for n in dag.nodes if alone.start[n.id] == 0.0]
    assert len({n.stage for n in both}) == 2  # at once without sharing
    busy = sum(len(n.devices) for n in both)
    shared = simulate(dag, lambda n: 1.0, share=lambda k: min(1.0, 2 / k))
    assert shared.order == alone.order
    assert shared.makespan > alone.makespan
    for n in both:  # half the rate while four devices work on two cores
        assert shared.end[n.id] - shared.start[n.id] == pytest.approx(max(1.0, busy / 2))
    # and one core each: no slower than alone
    assert simulate(dag, lambda n: 1.0, share=lambda k: 1.0).makespan == pytest.approx(
        alone.makespan
    )


def test_full_rate_seconds_inverts_the_sharing():
    share = LinkModel(1e9, 1e9, cores=2).sharing
    assert share is not None and share(4) == 0.5 and share(1) == 1.0
    # 0 and 1 run together on 2 devices each (half rate) for 2 s; then 1 alone for 1 s
    spans = {0: (0.0, 2.0, 2), 1: (0.0, 3.0, 2)}
    assert full_rate_seconds(spans, share) == pytest.approx({0: 1.0, 1: 2.0})
    assert full_rate_seconds(spans, None) == {0: 2.0, 1: 3.0}
    assert LinkModel(1e9, 1e9).sharing is None


def test_the_estimate_adds_the_calibrated_costs_outside_the_nodes():
    cal = Calibrator()
    for groups in (0, 1, 2, 3, 1):  # a fixed 0.01 s and 0.03 s per group released
        cal.observe_transition(
            {"transitions": 1.0, "groups_released": float(groups)}, 0.01 + 0.03 * groups
        )
    eff = cal.fit()
    assert eff.transition_s == pytest.approx(0.01, abs=1e-3)
    assert eff.group_release_s == pytest.approx(0.03, abs=1e-3)
    cluster = local_cpu_cluster(
        4, 1 << 30, flops_per_device=1e10, memory_bandwidth=1e10, exchange_bandwidth=1e9, cores=2
    )
    link = LinkModel.of(cluster, eff)
    assert link.transition_s == eff.transition_s and link.cores == cluster.cores == 2
    devices = DeviceSet.single_host(4, 1 << 30)
    dag = build_dag(A, B, SPECS, devices, duration=link.seconds, share=link.sharing)
    groups = sum(n.groups for n in dag.nodes)
    assert groups > 0 and link.outside(dag) == {"transitions": 1.0, "groups_released": groups}
    assert transition_seconds(A, B, SPECS, devices, link) == pytest.approx(
        dag.schedule.makespan + eff.transition_s + groups * eff.group_release_s
    )
    assert transition_seconds(A, A, SPECS, devices, link) == 0.0


def test_a_merge_of_what_each_device_holds_copies_it_locally():
    # two whole replicas -> one TP 2 replica on the same devices: nothing is sent, each
    # device slices its half out of the replica it holds
    dag = build_dag(_plan(((0,), (1,)), ((2, 3),)), _plan(((0, 1),), ((2, 3),)), SPECS)
    (merge,) = dag.nodes
    table = SpecBytes(SPEC)
    # less what it adopts whole (the replicated parameters)
    half = table.held(Layout(2, 1), (0, 0)) - table.kept(Layout(1, 1), (0, 0), Layout(2, 1), (0, 0))
    assert merge.kind == "merge" and merge.bytes == 0 and 0 < merge.max_copied == half
    link = LinkModel(1e9, 1e9, call_s=0.0, copy_s_per_gb=2.0)
    assert link.seconds(merge) == pytest.approx(half / 1e9 * 2.0)
    assert link.ideal(merge)["copy_gb"] == half / 1e9


def test_what_a_hosts_devices_receive_together_is_one_cost_the_calibrator_learns():
    # TP 2 -> PP 2 on the same two devices: each receives what the other held, at once
    dag = build_dag(_plan(((0,), (1,)), ((2, 3),)), _plan(((0,), (1,)), ((2,), (3,))), SPECS)
    both = max(dag.nodes, key=lambda n: sum(1 for b in n.moved_in.values() if b > 0))
    received = [b for b in both.moved_in.values() if b > 0]
    assert len(received) == 2
    one_host = LinkModel(1e9, 1e9, call_s=0.0, host_s_per_gb=1.0, devices_per_node=4)
    per_device = LinkModel(1e9, 1e9, call_s=0.0, host_s_per_gb=1.0, devices_per_node=1)
    assert one_host.ideal(both)["host_gb"] == pytest.approx(sum(received) / 1e9)
    assert per_device.ideal(both)["host_gb"] == pytest.approx(max(received) / 1e9)
    assert LinkModel(1e9, 1e9).ideal(both)["host_gb"] == 0.0  # no hosts given: no term
    base = LinkModel(1e9, 1e9, call_s=0.0, devices_per_node=4).seconds(both)
    assert one_host.seconds(both) == pytest.approx(base + sum(received) / 1e9)
    # nodes whose host receives more than their busiest device take longer: learned
    cal = Calibrator()
    for worst, host in ((0.1, 0.1), (0.1, 0.2), (0.2, 0.2), (0.05, 0.15), (0.2, 0.4)):
        cal.observe_transition(
            {"p2p_intra": worst, "calls": 1.0, "host_gb": host}, 2 * worst + 0.5 * host + 0.01
        )
    eff = cal.fit()
    assert eff.host_s_per_gb == pytest.approx(0.5, rel=0.05)
    assert eff.p2p_intra == pytest.approx(0.5, rel=0.05)
    assert (
        LinkModel.of(
            local_cpu_cluster(
                4,
                1 << 30,
                flops_per_device=1e10,
                memory_bandwidth=1e10,
                exchange_bandwidth=1e9,
                cores=2,
            ),
            eff,
        ).host_s_per_gb
        == eff.host_s_per_gb
    )
