"""Triggers and admission follow the rule on hand-made sequences."""

from __future__ import annotations

import math

import pytest

from nereus.errors import ConfigError
from nereus.planner import DriftSignal, Target, TriggerMonitor, admit, choose


def test_admit_iff_saving_positive_and_payback_within_gamma_h():
    # saving 2 s/step; transition 20 s -> payback 10 steps; H = 30 -> limit 15 steps
    d = admit(10.0, 8.0, 20.0, horizon_steps=30, gamma=0.5)
    assert (
        d.admitted and d.payback_steps == pytest.approx(10) and d.limit_steps == pytest.approx(15)
    )
    # exactly on the limit is admitted; just past it is not
    assert admit(10.0, 8.0, 30.0, 30, 0.5).admitted
    assert not admit(10.0, 8.0, 30.0001, 30, 0.5).admitted
    # no saving (or a loss) is never admitted, even for a free transition
    assert not admit(10.0, 10.0, 0.0, 30).admitted
    assert not admit(10.0, 11.0, 0.0, 30).admitted
    # a larger gamma admits a slower payback
    assert admit(10.0, 8.0, 50.0, 30, gamma=1.0).admitted
    # with no crossing history only a free move pays
    assert not admit(10.0, 8.0, 1.0, None).admitted
    assert admit(10.0, 8.0, 0.0, None).admitted
    with pytest.raises(ConfigError, match="gamma"):
        admit(10.0, 8.0, 1.0, 10, gamma=0)


def test_choose_tries_slightly_slower_cheaper_targets_before_keeping():
    fast = Target("fast", 8.0, transition_seconds=100.0, label="fast")
    near = Target("near", 8.3, transition_seconds=5.0, label="near")  # within 5% of the fastest
    far = Target("far", 9.5, transition_seconds=0.0, label="far")  # too slow to be tried
    d = choose(10.0, [far, near, fast], horizon_steps=20)
    assert d.action == "transition" and d.target is near
    d = choose(10.0, [far, fast], horizon_steps=20)
    assert d.action == "keep" and "fast" in d.reason
    d = choose(10.0, [fast], horizon_steps=200)
    assert d.target is fast


def test_an_unreachable_faster_target_does_not_hide_a_reachable_one():
    best = Target("best", 6.0, transition_seconds=math.inf, label="best")
    reachable = Target(
        "rescaled", 8.0, transition_seconds=4.0, label="rescaled"
    )  # 33% slower than best
    d = choose(10.0, [best, reachable], horizon_steps=20)
    assert d.action == "transition" and d.target is reachable
    # slack is taken from the fastest reachable target
    cheap = Target("cheap", 8.3, transition_seconds=1.0, label="cheap")
    d = choose(
        10.0, [best, reachable, cheap], horizon_steps=2
    )  # reachable pays back in 2 steps > 1
    assert d.action == "transition" and d.target is cheap
    d = choose(10.0, [best], horizon_steps=20)
    assert d.action == "keep" and "best: transition impossible" in d.reason


def test_urgent_path_skips_payback_and_restarts_as_last_resort():
    a = Target("a", 9.0, transition_seconds=1e6, label="a")
    b = Target("b", 12.0, transition_seconds=math.inf, label="b")
    d = choose(None, [b, a], horizon_steps=None)  # the current plan cannot run
    assert d.action == "transition" and d.target is a
    d = choose(10.0, [b], horizon_steps=5, urgent=True)
    assert d.action == "restart" and d.target is b
    assert choose(10.0, [], horizon_steps=5).action == "keep"


def test_drift_signal_crossings_and_horizon():
    s = DriftSignal("length", threshold=0.3)
    assert s.observe(0, 1000) is None  # first value is the reference
    assert s.observe(5, 1250) is None  # 25%: inside
    t = s.observe(10, 1400)  # 40%: first crossing, 10 steps after the start
    assert t is not None and not t.hard and t.signal == "length"
    assert s.horizon_steps == 10
    assert s.observe(11, 1450) is not None  # still beyond: triggers, but no new crossing
    assert list(s.intervals) == [10]


def test_reference_resets_after_a_rejected_replan():
    mon = TriggerMonitor()
    devices = set(range(8))
    assert mon.observe(0, devices=devices, values={"length": 1000}) == []
    fired = mon.observe(20, devices=devices, values={"length": 1400})
    assert [t.kind for t in fired] == ["drift"]
    h = mon.horizon_steps(fired[0])
    assert h == 20
    # the replan is rejected (payback too slow) ...
    assert not admit(10.0, 9.9, 50.0, h).admitted
    # ... and the reference still moves to the current value
    mon.reset(20, {"length": 1400})
    # 1700 is 21% above 1400: no trigger, though it is 70% above the old reference
    assert mon.observe(30, devices=devices, values={"length": 1700}) == []
    fired = mon.observe(50, devices=devices, values={"length": 1900})  # 36% above 1400
    assert [t.kind for t in fired] == ["drift"]
    # intervals between crossings: 0 -> 20, 20 -> 50
    assert mon.horizon_steps(fired[0]) == pytest.approx((20 + 30) / 2)
    # a drift downward crosses too
    mon.reset(50, {"length": 1900})
    assert [t.kind for t in mon.observe(60, devices=devices, values={"length": 1200})] == ["drift"]


def test_hard_triggers_for_device_pool_and_memory():
    mon = TriggerMonitor()
    assert mon.observe(0, devices={0, 1, 2, 3}, values={}) == []
    fired = mon.observe(1, devices={0, 1, 2}, values={}, memory_violations=[2])
    assert [(t.kind, t.hard) for t in fired] == [("device-pool", True), ("memory", True)]
    assert "lost [3]" in fired[0].detail and "[2]" in fired[1].detail
    with pytest.raises(ConfigError, match="values"):
        mon.observe(2, devices={0, 1, 2}, values={"reward": 1.0})


def test_a_join_horizon_counts_the_pool_the_job_started_on():
    mon = TriggerMonitor(join_horizon_steps=100)
    devices = {0, 1, 2, 3}
    assert mon.observe(0, devices=devices, values={}) == []
    fired = mon.observe(50, devices={0, 1, 2}, values={}, drained=[3])
    assert [(t.kind, t.hard) for t in fired] == [("device-pool", True)]
    assert mon.pool.horizon_steps == 100  # one change: the configured horizon
    fired = mon.observe(60, devices=devices, values={}, joined=[3])
    assert [(t.kind, t.hard) for t in fired] == [("device-pool", False)]
    # the pool lasted 50 steps from the start, then 10
    assert mon.horizon_steps(fired[0]) == pytest.approx((50 + 10) / 2)
    mon.observe(62, devices={0, 1, 2}, values={}, lost=[3])
    assert mon.pool.horizon_steps == pytest.approx((50 + 10 + 2) / 3)
