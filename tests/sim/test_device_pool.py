"""A running job's pool in the simulator: single devices of one node come and go (as
``nereus.job.traces.PoolTrace`` drains and adds worker processes), the planner sees the
pool as the job describes it (one node of that many devices), and a job whose config
pins its first plan starts there with its calibration prior."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.errors import ConfigError
from nereus.planner import Plan, StagePlan
from nereus.planner.cost import CONSERVATIVE
from nereus.sim import (
    GroundTruth,
    Scenario,
    StepPoolTrace,
    length_trace,
    make_policy,
    policy_context,
    run_policies,
    run_policy,
)
from tests.sim.helpers import small_cluster, small_params, small_work

COUNTS = [4, 2, 2, 3, 3, 4, 4, 2]


def _scenario(counts=COUNTS, *, nodes: int = 1, initial: Plan | None = None, **kw) -> Scenario:
    cluster = small_cluster(memory_gib=80, nodes=nodes)
    work = small_work()
    steps = len(counts)
    truth = GroundTruth(small_params(), cluster, work, max_length=4096, seed=1)
    trace = length_trace("growth:200:400", steps)
    return Scenario(
        cluster, work, StepPoolTrace(counts), trace, steps, truth, initial_plan=initial, **kw
    )


def _on(devices: tuple[int, ...]) -> Plan:
    emus = tuple((d,) for d in devices)
    sp = StagePlan(1, 1, len(devices), emus)
    return Plan(tuple((s.name, sp) for s in small_work().stages))


def test_the_pool_follows_the_counts_device_by_device():
    for r in run_policies(_scenario(), ("adaptive", "every-k", "dynarl")):
        assert r.steps == len(COUNTS)
        assert [rec.devices for rec in r.records] == COUNTS
        assert [rec.pool for rec in r.records] == [tuple(range(c)) for c in COUNTS]
        assert all(rec.plan_devices <= rec.devices for rec in r.records)


def test_the_planner_sees_one_node_of_the_pools_size():
    scn = _scenario()
    pool, cluster = policy_context(scn).pool_cluster((0, 1, 3))
    assert pool.ids == (0, 1, 3)
    assert (cluster.nodes, cluster.devices_per_node) == (1, 3)
    assert dataclasses.replace(cluster, devices_per_node=4) == scn.cluster


def test_a_pinned_first_plan_is_where_every_policy_starts():
    first = _on((0, 1))
    scn = _scenario([4, 4, 4, 2], initial=first)
    for name in ("adaptive", "static", "every-k", "dynarl"):
        policy = make_policy(name, policy_context(scn))
        res = run_policy(scn, policy)
        assert res.records[0].plan_devices == 2, name
    # a pinned plan the first pool does not hold leaves the policy to its own start
    late = _scenario([2, 4], initial=_on((0, 1, 2, 3)))
    assert run_policies(late, ("adaptive",))[0].records[0].plan_devices <= 2


def test_the_calibration_starts_from_the_scenarios_prior():
    prior = dataclasses.replace(CONSERVATIVE, gemm=0.9, layer_pass_s=1e-3)
    policy = make_policy("adaptive", policy_context(_scenario(prior=prior, prior_weight=0.05)))
    assert policy.calibrator.prior == prior and policy.calibrator.prior_weight == 0.05
    assert policy.eff.gemm == pytest.approx(0.9) and policy.eff.layer_pass_s == 1e-3


def test_a_device_trace_needs_one_node_and_a_plan_on_the_clusters_devices():
    with pytest.raises(ConfigError, match="Scenario.devices"):
        _scenario(nodes=2)
    with pytest.raises(ConfigError, match="Scenario.initial_plan"):
        _scenario(initial=_on((0, 7)))
    with pytest.raises(ConfigError, match="counts"):
        StepPoolTrace([2, 0])


def test_a_drained_device_is_moved_off_not_lost():
    # reference inference only on device 3: the pool's shrink to 2 drains it, and the
    # job moves its EMU off (a transition), where a lost device would need a restart
    work = small_work()
    sps = {s.name: StagePlan(1, 1, 2, ((0,), (1,))) for s in work.stages}
    sps["reference-inference"] = StagePlan(1, 1, 1, ((3,),))
    first = Plan(tuple((s.name, sps[s.name]) for s in work.stages))
    scn = _scenario([4, 2, 2, 2], initial=first)
    for name in ("adaptive", "dynarl", "every-k", "static"):
        (res,) = run_policies(scn, (name,))
        assert res.restarts == 0 and res.transitions >= 1, name
        assert res.records[1].transition and res.records[1].plan_devices <= 2, name
        assert res.steps == 4, name
