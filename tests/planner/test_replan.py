"""The boundary loop: drift triggers with reference resets, admission, urgent device loss,
calibration."""

from __future__ import annotations

import math

import pytest

from nereus.errors import InfeasiblePlan
from nereus.planner import ClusterSpec, LengthStats, ModelShape, Replanner, Workload, explain

GiB = 2**30


def _setup(
    nodes: int = 2, memory_gib: float = 16, mean: float = 1000
) -> tuple[Workload, ClusterSpec]:
    model = ModelShape("m", 2048, 4, 16, 4, 32000, 6144)
    work = Workload.for_models(
        "grpo",
        model,
        prompts_per_step=8,
        samples_per_prompt=4,
        prompt_length=256,
        lengths=_lengths(mean),
        reward_model=False,
    )
    cluster = ClusterSpec(
        "test",
        nodes,
        4,
        int(memory_gib * GiB),
        100e12,
        1.5e12,
        300e9,
        25e9,
        workspace_bytes=GiB // 2,
    )
    return work, cluster


def _lengths(mean: float) -> LengthStats:
    return LengthStats(mean, mean * 1.8, int(mean * 2))


never = lambda cur, tgt: 1e9  # noqa: E731 - a move that never pays back
free = lambda cur, tgt: 0.0  # noqa: E731


def test_drift_without_a_better_plan_keeps_and_resets_the_reference():
    r = Replanner(*_setup())
    out = r.on_boundary(5, lengths=_lengths(1100), transition_seconds=free)
    assert out.triggers == () and out.decision.reason == "no trigger"
    out = r.on_boundary(10, lengths=_lengths(1500), transition_seconds=free)
    assert [t.kind for t in out.triggers] == ["drift"]
    assert out.decision.action == "keep" and "no saving" in out.decision.reason


def test_shrinking_lengths_free_memory_rejected_then_reset_then_admitted():
    # 3 GiB devices: at 2200 tokens reference-inference needs tp4; at 1000 tp2 fits and is faster
    r = Replanner(*_setup(memory_gib=3, mean=2200))
    first = r.plan
    out = r.on_boundary(10, lengths=_lengths(1500), transition_seconds=never)
    assert [t.kind for t in out.triggers] == ["drift"]
    assert (
        out.decision.action == "keep" and "payback" in out.decision.reason
    )  # saving > 0, too slow to repay
    assert out.decision.saving_seconds > 0 and out.decision.limit_steps == pytest.approx(0.5 * 10)
    assert r.plan == first
    # the reference moved to 1500 although the replan was rejected: 1600 is no drift
    assert r.on_boundary(12, lengths=_lengths(1600), transition_seconds=free).triggers == ()
    out = r.on_boundary(20, lengths=_lengths(1000), transition_seconds=free)  # 33% below 1500
    assert [t.kind for t in out.triggers] == ["drift"]
    assert out.decision.action == "transition" and r.plan == out.decision.target.plan != first
    assert r.step_seconds == pytest.approx(explain(r.plan, r.work, r.cluster).step_seconds)
    assert r.step_seconds < explain(first, r.work, r.cluster).step_seconds


def test_growing_lengths_that_break_memory_take_the_urgent_path():
    r = Replanner(*_setup(memory_gib=3, mean=1000))
    first = r.plan
    r.on_boundary(10, lengths=_lengths(1500), transition_seconds=never)
    out = r.on_boundary(20, lengths=_lengths(2200), transition_seconds=never)
    assert [t.kind for t in out.triggers] == ["memory", "drift"]
    assert not explain(first, r.work, r.cluster).fits
    # urgent: no payback test, even for a transition that never pays back
    assert out.decision.action == "transition" and out.decision.reason.startswith("urgent")
    assert explain(r.plan, r.work, r.cluster).fits


def test_losing_a_node_is_urgent_and_restarts_when_no_transition_is_possible():
    work, cluster = _setup(nodes=2)
    r = Replanner(work, cluster)
    assert max(r.plan.devices) >= 4  # the plan uses the second node
    out = r.on_boundary(3, cluster=cluster.with_nodes(1), transition_seconds=lambda c, t: math.inf)
    assert any(t.kind == "device-pool" and t.hard for t in out.triggers)
    assert out.decision.action == "restart"
    assert max(r.plan.devices) < 4 and explain(r.plan, r.work, r.cluster).fits
    # the node is back: a join is soft, taken up when the move pays back within gamma * H,
    # H the mean interval between pool changes, the first from the start (3 and 37 steps)
    out = r.on_boundary(40, cluster=cluster, transition_seconds=lambda c, t: 1.0)
    assert [(t.kind, t.hard, t.info["detail"]) for t in out.triggers] == [
        ("device-pool", False, "joined")
    ]
    assert out.decision.action == "transition" and max(r.plan.devices) >= 4
    assert out.decision.limit_steps == pytest.approx(0.5 * (3 + 37) / 2)


def test_a_join_that_does_not_pay_back_soon_enough_is_kept_out():
    work, cluster = _setup(nodes=2)
    r = Replanner(work, cluster.with_nodes(1), join_horizon_steps=4)
    first = r.plan
    out = r.on_boundary(
        2, cluster=cluster, joined=[4, 5, 6, 7], transition_seconds=lambda c, t: 1e6
    )
    assert (
        out.triggers[0].info == {"detail": "joined", "devices": [4, 5, 6, 7]}
        and not out.triggers[0].hard
    )
    assert out.decision.action == "keep" and r.plan == first
    assert out.decision.limit_steps == pytest.approx(
        0.5 * 4
    )  # the initial horizon: one change seen


def test_the_replanner_starts_from_the_jobs_plan_and_drained_devices_are_urgent():
    from nereus.planner import Plan, StagePlan

    work, cluster = _setup(nodes=1)
    mine = Plan(tuple((s.name, StagePlan(1, 1, 1, ((i,),))) for i, s in enumerate(work.stages)))
    r = Replanner(work, cluster, plan=mine, min_steps_between=5)
    assert r.plan == mine
    # device 2 is drained: the caller renumbers the plan onto the 3 devices left, the
    # drained one beyond them
    shrunk = Plan(
        tuple(
            (n, StagePlan(1, 1, 1, ((3,),) if sp.devices == ((2,),) else sp.devices))
            for n, sp in mine
        )
    )
    small = ClusterSpec(
        "three",
        1,
        3,
        cluster.device_memory_bytes,
        100e12,
        1.5e12,
        300e9,
        25e9,
        workspace_bytes=GiB // 2,
    )
    out = r.on_boundary(1, cluster=small, plan=shrunk, drained=[2], transition_seconds=free)
    assert [(t.kind, t.hard, t.info["detail"]) for t in out.triggers][0] == (
        "device-pool",
        True,
        "drained",
    )
    assert out.decision.action == "transition" and max(r.plan.devices) < 3
    # a soft trigger right after is left alone: min_steps_between
    out = r.on_boundary(2, lengths=_lengths(2000), transition_seconds=free)
    assert [t.kind for t in out.triggers] == [
        "drift"
    ] and "min_steps_between" in out.decision.reason


def test_no_plan_left_raises():
    work, cluster = _setup(nodes=1)
    r = Replanner(work, cluster)
    tiny = ClusterSpec("tiny", 1, 1, GiB, 100e12, 1.5e12, 300e9, 25e9, workspace_bytes=GiB // 2)
    with pytest.raises(InfeasiblePlan):
        r.on_boundary(1, cluster=tiny, transition_seconds=lambda c, t: 0.0)


def test_measured_stage_times_recalibrate_the_prediction():
    work, cluster = _setup()
    r = Replanner(work, cluster)
    ex = r.explain_current()
    slower = {
        s.name: 2.0 * s.cost.seconds for s in ex.stages
    }  # everything runs at half the assumed efficiency
    for _ in range(3):
        r.observe_stage_seconds(slower)
    assert r.explain_current().step_seconds == pytest.approx(2.0 * ex.step_seconds, rel=0.02)


def test_measured_memory_peaks_recalibrate_and_trigger_a_memory_replan():
    r = Replanner(*_setup(memory_gib=3, mean=1000))
    ex = r.explain_current()
    peaks = {s.name: int(s.memory.resident + 3 * s.memory.transient) for s in ex.stages}
    assert r.observe_memory_peaks(peaks).memory_scale == pytest.approx(3.0, rel=1e-6)
    out = r.on_boundary(1, transition_seconds=never)
    assert [t.kind for t in out.triggers] == ["memory"]
    assert out.decision.action == "transition" and out.decision.reason.startswith("urgent")
    assert explain(r.plan, r.work, r.cluster, r.eff).fits


def test_repeated_memory_peaks_keep_the_scale_they_measure():
    # the same measured peaks, observed again and again, must keep the same scale: each
    # observation is compared with the unscaled model, not with the model already scaled
    r = Replanner(*_setup(memory_gib=16, mean=1000))
    ex = r.explain_current()
    peaks = {s.name: int(s.memory.resident + 2 * s.memory.transient) for s in ex.stages}
    scales = [r.observe_memory_peaks(peaks).memory_scale for _ in range(300)]
    assert scales == pytest.approx([2.0] * 300, rel=1e-6)
