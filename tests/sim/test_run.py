"""Simulated runs: deterministic under a seed, paused and aborted time accounted as
documented, admitted plans that never overflow the ground truth, the JSON rows, and
fixed layouts that scale DP with the pool."""

from __future__ import annotations

import math

import pytest

from nereus.planner import CONSERVATIVE, LengthStats, explain, search
from nereus.sim import POLICIES, SimConfig, SimulationError, run_policies, run_policy
from nereus.sim.policies import FixedLayoutPolicy, _Ctx, make_policy
from nereus.sim.report import rows
from nereus.sim.transitions import Transitions
from tests.sim.helpers import small_scenario

# ``static`` (the planner's, TP/PP fixed) cannot finish these toy scenarios: the layout it
# is provisioned with overflows the ground truth's memory with every wave and recompute
# taken (test_static_stops_with_a_clear_error_when_no_relief_is_left); the others finish
FINISHING = tuple(p for p in POLICIES if p != "static")


@pytest.fixture(scope="module")
def volatile():
    """Every policy on a 16-device pool that shrinks (also mid-step), empties and grows
    (a tick every 15 s: the toy job's steps take seconds)."""
    scn = small_scenario(memory_gib=24, steps=24, gap_s=15.0)
    return scn, run_policies(scn, FINISHING)


@pytest.fixture(scope="module")
def pressured():
    """Every policy on a steady 16-device pool of 20 GiB devices, responses growing to the
    job's cap: memory is tight and what the planner does not model matters."""
    scn = small_scenario(memory_gib=20, steps=16, lengths="growth:1500:3000", counts=[16] * 100)
    return scn, run_policies(scn, FINISHING + ("static-restart",))


def test_every_policy_finishes_every_step_once_in_order(volatile):
    _, results = volatile
    assert [r.policy for r in results] == list(FINISHING)
    for r in results:
        assert r.steps == 24 and [s.step for s in r.records] == list(range(24))
        assert r.total_s == pytest.approx(
            r.paused_s + r.waiting_s + r.compute_s + r.transition_s + r.restart_s + r.wasted_s
        )


def test_a_run_is_deterministic_under_its_seed(volatile):
    scn, results = volatile
    again = run_policies(
        small_scenario(memory_gib=24, steps=24, gap_s=15.0), ("adaptive", "every-k")
    )
    for a, b in zip(results[:2], again, strict=True):
        assert a.to_dict() | {
            "planner_ms_per_decision": 0,
            "dag_ms_per_decision": 0,
            "planner_s": 0,
            "dag_s": 0,
        } == b.to_dict() | {
            "planner_ms_per_decision": 0,
            "dag_ms_per_decision": 0,
            "planner_s": 0,
            "dag_s": 0,
        }
        assert a.records == b.records
    other = run_policies(
        small_scenario(memory_gib=24, steps=24, seed=4, gap_s=15.0), ("adaptive",)
    )[0]
    assert other.records != results[0].records


def test_admitted_plans_never_overflow_the_ground_truth(pressured):
    scn, results = pressured
    by = {r.policy: r for r in results}
    memory = scn.cluster.device_memory_bytes
    # the scenario has memory pressure: a layout that does not predict memory runs out of it
    assert sum(by[p].memory_failures for p in ("static-restart", "colocated", "separated")) >= 1
    # the planner's admission (calibrated memory model at the cap, 10% headroom) never
    # admits a plan that overflows a device's real memory, with peaks near it
    for name in ("adaptive", "dynarl", "every-k"):
        r = by[name]
        assert r.memory_failures == 0, name
        assert all(s.peak_bytes <= memory for s in r.records), name
        assert max(s.peak_bytes for s in r.records) > 0.7 * memory, name


@pytest.fixture(scope="module")
def raised_cap():
    """A steady pool of 16 GiB devices and a cap raised in stages (1,024 to 8,192 tokens)
    as responses grow: a plan sized for the first cap stops fitting."""
    scn = small_scenario(
        memory_gib=16, steps=14, lengths="growth:400:3000", counts=[16] * 100, caps="stepped"
    )
    return scn, run_policies(
        scn, ("adaptive", "dynarl", "every-k", "static-restart", "static-max-cap")
    )


def test_a_raised_cap_moves_the_planners_policies_and_restarts_static_restart(raised_cap):
    scn, results = raised_cap
    by = {r.policy: r for r in results}
    assert [c for _, c in scn.caps.changes()] == [1024, 2048, 4096, 8192]
    memory = scn.cluster.device_memory_bytes
    for r in results:
        # the sampled maximum is cut at each step's cap
        assert all(s.max_length <= scn.caps.cap_at(s.step) for s in r.records), r.policy
    for name in ("adaptive", "dynarl", "every-k"):
        r = by[name]
        # memory planned at the next step's cap with the fixed + proportional calibration
        assert r.memory_failures == 0 and all(s.peak_bytes <= memory for s in r.records), name
        assert r.restarts == 0 and r.transitions >= 1, name
    # static-restart's first plan (sized for 1,024 tokens) does not hold the raised caps; it
    # restarts (counted) on a plan for the new cap, more often than it runs out of memory
    # (its memory model, uncalibrated until a step has run, may miss the truth's peak)
    restart = by["static-restart"]
    assert restart.restarts >= 1 and restart.restarts > restart.memory_failures
    # provisioned for the largest cap from the first step, a raised cap never makes it
    # restart (only a step that ran out of memory under the uncalibrated model it was
    # planned with)
    assert by["static-max-cap"].restarts == by["static-max-cap"].memory_failures


def test_paused_time_is_left_out_of_the_mean_step_but_not_of_the_throughput(volatile):
    _, results = volatile
    paused = [r for r in results if r.paused_s > 0]
    assert paused, "the trace empties the pool once"
    for r in paused:
        assert r.mean_step_s == pytest.approx((r.total_s - r.paused_s) / r.steps)
        assert r.throughput_steps_per_hour == pytest.approx(3600 * r.steps / r.total_s)


def test_a_loss_inside_a_step_aborts_it_and_it_is_redone():
    # 16 devices, then 8 from t=30 s on: a step running across t=30 s is cut by the loss
    scn = small_scenario(memory_gib=24, steps=3, counts=[16] + [8] * 50, gap_s=30.0)
    r = run_policies(scn, ("adaptive",))[0]
    assert r.aborted_steps >= 1 and r.wasted_s > 0
    assert [s.step for s in r.records] == [0, 1, 2]
    cut = next(s for s in r.records if s.devices == 8)  # redone on the pool that is left
    assert cut.start_s >= 30.0 and cut.plan_devices <= 8


@pytest.fixture(scope="module")
def roomy():
    """Every policy on a pool that shrinks, empties and grows (a tick every 30 s), of
    40 GiB devices, where ``static`` holds its layout through every pool size."""
    scn = small_scenario(memory_gib=40, steps=24, gap_s=30.0)
    return scn, run_policies(scn)


def test_json_rows_hold_the_issue_keys_and_adaptive_reductions(roomy):
    _, results = roomy
    assert [r.policy for r in results] == list(POLICIES)
    data = rows(results, {"cluster": "sim-test"})
    by = {d["policy"]: d for d in data}
    for d in data:
        assert {
            "policy",
            "mean_step_s",
            "transitions",
            "transition_overhead_pct",
            "memory_failures",
        } <= set(d)
        assert d["simulated"] is True and d["scenario"] == {"cluster": "sim-test"}
    adaptive = by["adaptive"]
    assert adaptive["reduction_vs_static"] == pytest.approx(
        1 - adaptive["mean_step_s"] / by["static"]["mean_step_s"]
    )
    best = min((d for d in data if d["policy"] != "adaptive"), key=lambda d: d["mean_step_s"])
    assert adaptive["reduction_vs_best_baseline"] == pytest.approx(
        1 - adaptive["mean_step_s"] / best["mean_step_s"]
    )


def test_a_fixed_layout_keeps_tp_and_pp_and_scales_dp_with_the_pool():
    from nereus.sim import Boundary

    scn = small_scenario(memory_gib=24)
    ctx = _Ctx(
        scn.work,
        scn.cluster,
        Transitions(scn.work, scn.cluster, scn.truth.link_model, scn.truth.transition_seconds),
        scn.caps,
    )
    policy = FixedLayoutPolicy(ctx, name="static-restart")
    lengths = scn.truth.lengths(-1, 200)
    first = policy.start(Boundary(0, tuple(range(16)), (), (), lengths))
    assert first == search(ctx.work_at(lengths, 0), scn.cluster).plan
    assert policy.scaled(16, scn.cluster) == first
    doubled = policy.scaled(32, scn.cluster.with_nodes(8))

    def concurrency(sp):
        return math.ceil(math.ceil(scn.work.sequences / sp.dp) / sp.waves)

    for name, sp in first:
        assert (doubled[name].tp, doubled[name].pp, doubled[name].dp) == (sp.tp, sp.pp, 2 * sp.dp)
        assert doubled[name].recompute == sp.recompute
    # generation keeps its engines' concurrency: half the sequences a replica, fewer waves
    assert concurrency(doubled["policy-generation"]) <= concurrency(first["policy-generation"])
    # at half the pool each pool of the layout gets half its devices: a model-stage whose
    # replica (tp x pp) is larger than that has no DP left, and the layout cannot run
    halved = policy.scaled(8, scn.cluster.with_nodes(2))
    too_big = any(
        first[n].tp * first[n].pp > size // 2 for names, size in policy.layout.pools for n in names
    )
    assert (halved is None) == too_big
    if halved is not None:
        assert all((halved[n].tp, halved[n].pp) == (sp.tp, sp.pp) for n, sp in first)


def test_config_errors_name_the_field():
    from nereus.errors import ConfigError

    with pytest.raises(ConfigError, match="policies"):
        SimConfig("a100-256", "llama-8b", "ppo", "growth:1:2", "growth:1:2", 10, policies=("nope",))
    with pytest.raises(ConfigError, match="gamma=0"):
        SimConfig("a100-256", "llama-8b", "ppo", "growth:1:2", "growth:1:2", 10, gamma=0)
    with pytest.raises(ConfigError, match="cap_schedule='doubling'"):
        SimConfig(
            "a100-256", "llama-8b", "ppo", "growth:1:2", "growth:1:2", 10, cap_schedule="doubling"
        )


def test_on_step_sees_every_completed_step_and_the_counters_so_far(volatile):
    scn, results = volatile
    seen = []
    transitions = Transitions(
        scn.work, scn.cluster, scn.truth.link_model, scn.truth.transition_seconds
    )
    policy = make_policy("adaptive", _Ctx(scn.work, scn.cluster, transitions, scn.caps))

    def on_step(record, result):
        seen.append((record, result.compute_s, result.paused_s))

    r = run_policy(small_scenario(memory_gib=24, steps=24, gap_s=15.0), policy, on_step=on_step)
    assert [rec for rec, _, _ in seen] == r.records
    # the counters include the step just done: compute sums the steps' seconds so far
    for i, (_, compute_s, _) in enumerate(seen):
        assert compute_s == pytest.approx(sum(rec.seconds for rec in r.records[: i + 1]))
    last, _, paused_s = seen[-1]
    assert r.paused_s > 0 and last.start_s + last.seconds - paused_s == pytest.approx(r.run_s)
    assert r.records == results[0].records  # the callback changes nothing


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(memory_gib=20, steps=16, lengths="growth:1500:3000", counts=[16] * 100),
        dict(memory_gib=16, steps=14, lengths="growth:400:3000", counts=[16] * 100, caps="stepped"),
    ],
    ids=["pressured", "raised-cap"],
)
def test_static_stops_with_a_clear_error_when_no_relief_is_left(kwargs):
    """The planner's ``static`` starts on the search's pick among plans the memory model
    says hold the largest cap; where the ground truth overflows it anyway, each failure is
    counted and relieved by more decode waves, then recompute, never a TP/PP change, and
    when none is left the run ends in ``SimulationError`` instead of retrying."""
    scn = small_scenario(**kwargs)
    transitions = Transitions(
        scn.work, scn.cluster, scn.truth.link_model, scn.truth.transition_seconds
    )
    policy = make_policy("static", _Ctx(scn.work, scn.cluster, transitions, scn.caps))
    starts = []
    start = policy.start
    policy.start = lambda b: starts.append(start(b)) or starts[-1]
    with pytest.raises(SimulationError, match=r"static: step \d+ cannot go on after \d+ memory"):
        run_policy(scn, policy)
    first, last = starts[0], policy.replanner.plan
    cap = scn.caps.largest
    at_cap = scn.work.with_lengths(scn.work.lengths, LengthStats(float(cap), float(cap), cap))
    assert explain(first, at_cap, scn.cluster, CONSERVATIVE).fits
    assert {n: (s.tp, s.pp) for n, s in first} == {n: (s.tp, s.pp) for n, s in last}
    kinds = {s.name: s.kind for s in scn.work.stages}
    for name, sp in last:
        if kinds[name] == "generation":
            assert sp.waves == -(-scn.work.sequences // sp.dp), name  # one sequence a wave
        else:
            assert sp.recompute or kinds[name] != "training", name
    assert len(policy.boundaries) >= 2  # each failure went through the planner's static


def test_static_never_loops_on_a_layout_the_pool_cannot_hold():
    """On the volatile pool the shared ``static`` ends in ``SimulationError`` (the same
    fixed TP/PP, its model-stages in one pool when the pool shrinks, overflows)."""
    with pytest.raises(SimulationError, match="static: step"):
        run_policies(small_scenario(memory_gib=24, steps=24, gap_s=15.0), ("static",))


def test_a_stopped_policy_is_reported_up_to_there_and_is_no_baseline():
    scn = small_scenario(memory_gib=20, steps=16, lengths="growth:1500:3000", counts=[16] * 100)
    results = run_policies(scn, ("adaptive", "static"), keep_stopped=True)
    by = {r.policy: r for r in results}
    assert by["adaptive"].stopped is None and by["adaptive"].steps == 16
    st = by["static"]
    assert st.stopped is not None and "no relief left" in st.stopped
    assert st.memory_failures >= 1 and st.steps == len(st.records) < 16
    assert st.total_s == pytest.approx(
        st.paused_s + st.waiting_s + st.compute_s + st.transition_s + st.restart_s + st.wasted_s
    )
    data = {d["policy"]: d for d in rows(results)}
    assert data["static"]["stopped"] == st.stopped and "stopped" not in data["adaptive"]
    # a run that did not finish is no baseline
    assert "reduction_vs_static" not in data["adaptive"]
    assert "best_baseline" not in data["adaptive"]
