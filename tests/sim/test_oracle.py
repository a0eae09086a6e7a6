"""The oracle reference: the real search, told the truth, its fastest candidate under the
truth at every step, free moves, and a row that is never anyone's baseline."""

from __future__ import annotations

import pytest

import nereus.sim.oracle as oracle_module
from nereus.planner.pool import DevicePool
from nereus.sim import run_policies
from nereus.sim.oracle import Oracle, matched_compute, run_oracle
from nereus.sim.report import rows
from tests.sim.helpers import small_scenario


@pytest.fixture(scope="module")
def runs():
    # 40 GiB devices: ``static`` keeps the TP/PP it started with, and when the pool halves
    # its model-stages share one pool; on 24-32 GiB devices that runs out of memory with
    # every wave and recompute taken (tests/sim/test_run.py), and the oracle's row needs a
    # static row to be measured against
    scn = small_scenario(memory_gib=40, steps=20)
    return scn, {
        r.policy: r for r in run_policies(scn, ("adaptive", "static", "every-k", "oracle"))
    }


def test_the_oracle_runs_every_step_and_pays_only_for_steps(runs):
    _, by = runs
    o = by["oracle"]
    assert o.steps == 20 and [s.step for s in o.records] == list(range(20))
    assert o.transition_s == o.restart_s == o.wasted_s == 0
    assert o.memory_failures == o.aborted_steps == o.restarts == 0
    assert o.total_s == pytest.approx(o.paused_s + o.waiting_s + o.compute_s)
    assert o.transitions == sum(s.transition for s in o.records) >= 1


def test_an_empty_pool_pauses_the_oracle_as_it_pauses_every_policy():
    o = run_oracle(small_scenario(memory_gib=24, steps=6, counts=[16, 0, 0, 16] * 30, gap_s=10.0))
    assert o.steps == 6 and o.paused_s > 0
    assert o.mean_step_s == pytest.approx(o.compute_s / 6)


def test_the_oracle_is_ahead_of_every_policy_choosing_among_the_same_plans(runs):
    _, by = runs
    for name in ("adaptive", "static", "every-k"):
        assert by["oracle"].mean_step_s < by[name].mean_step_s, name


def test_each_step_takes_the_fastest_candidate_of_the_real_search_told_the_truth(monkeypatch):
    scn = small_scenario(memory_gib=24, steps=8)
    calls = []
    real = oracle_module.search

    def spy(work, cluster, eff, **kw):
        found = real(work, cluster, eff, **kw)
        calls.append((work, cluster, eff, found))
        return found

    monkeypatch.setattr(oracle_module, "search", spy)
    res = run_oracle(scn)
    assert len(calls) == res.decisions == len(res.records)  # this scenario never waits for a fit
    per = scn.cluster.devices_per_node
    for record, (work, cluster, eff, found) in zip(res.records, calls, strict=True):
        step = record.step
        rates = scn.truth.reference_rates(step)  # the truth's headline rates, drift applied
        assert eff.as_dict() == pytest.approx({c: min(1.5, rates[c]) for c in eff.as_dict()})
        assert eff.memory_scale == rates["memory_scale"] > 1  # the truth's fragmentation
        assert eff.memory_fixed_bytes == rates["memory_fixed_bytes"] > 0  # and workspace
        truth_lengths = scn.truth.lengths(step, scn.lengths.mean_at(step))
        assert work.lengths == truth_lengths  # the step's sampled lengths, not the previous step's
        assert work.memory_lengths is not None and work.memory_lengths.max == truth_lengths.max
        devices = tuple(
            d
            for n in sorted(scn.devices.nodes_at(record.start_s, step))
            for d in range(n * per, (n + 1) * per)
        )
        assert cluster.num_devices == len(devices)  # the pool at the step's boundary
        pool = DevicePool.of(devices)
        times = [
            scn.truth.step(pool.to_devices(p), step, scn.lengths.mean_at(step))
            for p in [found.plan] + [a.plan for a in found.alternatives]
        ]
        assert record.seconds == min(t.seconds for t in times if not t.failed)


def test_each_run_is_matched_with_the_oracle_on_its_own_steps_pools_and_draws(runs):
    scn, by = runs
    fresh = Oracle(scn)
    for name in ("adaptive", "static", "every-k"):
        r = by[name]
        assert {rec.pool for rec in r.records} and all(
            len(rec.pool) == rec.devices for rec in r.records
        )
        expected = sum(fresh.best(rec.step, rec.pool, rec.attempt)[1].seconds for rec in r.records)
        assert r.oracle_compute_s == pytest.approx(expected)
        assert r.to_dict()["plan_gap"] == pytest.approx(r.compute_s / expected - 1)
    # some step of the scenario was redone (a loss inside it), so the draw matters
    assert any(
        rec.attempt > 0 for name in ("adaptive", "static", "every-k") for rec in by[name].records
    )
    # matched with itself, the oracle is its own compute
    assert matched_compute(fresh, by["oracle"]) == pytest.approx(by["oracle"].compute_s)
    assert by["oracle"].oracle_compute_s is None


def test_the_oracle_row_is_a_reference_never_a_baseline(runs):
    scn, by = runs
    data = {d["policy"]: d for d in rows(list(by.values()))}
    assert data["oracle"]["reference"] is True
    assert data["oracle"]["reduction_vs_static"] == pytest.approx(
        1 - by["oracle"].mean_step_s / by["static"].mean_step_s
    )
    assert data["adaptive"]["best_baseline"] != "oracle"
    static, oracle, adaptive = (by[p].mean_step_s for p in ("static", "oracle", "adaptive"))
    assert data["adaptive"]["share_of_oracle_headroom"] == pytest.approx(
        (static - adaptive) / (static - oracle)
    )
    assert "reference" not in data["adaptive"]
