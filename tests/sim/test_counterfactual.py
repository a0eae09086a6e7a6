"""Admission counterfactuals: the forked run is adaptive's own, each delta is what a run
that admitted at that one boundary would have taken, and no branch outlives the call."""

from __future__ import annotations

import math
import os

import pytest

from nereus.errors import ConfigError
from nereus.sim import run_policy
from nereus.sim.counterfactual import admission_counterfactuals
from nereus.sim.policies import AdaptivePolicy, _Ctx
from nereus.sim.transitions import Transitions
from tests._leaks import processes
from tests.sim.helpers import small_scenario

HORIZON = 4


class _AdmitOnce(AdaptivePolicy):
    """Adaptive, but deciding as dynarl at one boundary."""

    def __init__(self, ctx: _Ctx, at: int) -> None:
        super().__init__(ctx)
        self.at = at

    def decide(self, b, plan):
        if b.step != self.at or self.replanner is None:
            return super().decide(b, plan)
        gamma, self.replanner.gamma = self.replanner.gamma, math.inf
        try:
            return super().decide(b, plan)
        finally:
            if self.replanner is not None:
                self.replanner.gamma = gamma


def _run(policy_of) -> dict[int, float]:
    scn = small_scenario(memory_gib=24, steps=24)
    ctx = _Ctx(
        scn.work,
        scn.cluster,
        Transitions(scn.work, scn.cluster, scn.truth.link_model, scn.truth.transition_seconds),
        scn.caps,
    )
    seen: dict[int, tuple[float, float]] = {}

    def on_step(record, result):
        seen[record.step] = (
            record.start_s + record.seconds - result.paused_s,
            result.wasted_s + result.restart_s,
        )

    result = run_policy(scn, policy_of(ctx), on_step=on_step)
    return seen, result


def _children() -> set[int]:
    """This process's children, zombies included (a branch not reaped counts)."""
    return {pid for pid, (ppid, _) in processes().items() if ppid == os.getpid()}


@pytest.fixture(scope="module")
def report():
    before = set(_children())
    rep = admission_counterfactuals(small_scenario(memory_gib=24, steps=24), HORIZON)
    return rep, before


@pytest.mark.integration
def test_the_forked_run_is_the_adaptive_run(report):
    rep, _ = report
    _, plain = _run(AdaptivePolicy)
    assert rep.result.records == plain.records
    assert rep.result.mean_step_s == pytest.approx(plain.mean_step_s)


@pytest.mark.integration
def test_each_delta_is_the_run_that_admitted_at_that_boundary(report):
    rep, _ = report
    assert rep.rows, "the scenario has moves the payback test turns down"
    assert rep.failed_branches == 0
    adaptive, _ = _run(AdaptivePolicy)
    for row in rep.rows:
        assert (
            row.action == "keep" and row.payback_steps > row.limit_steps
        )  # what adaptive turned down
        admitted, _ = _run(lambda ctx, at=row.step: _AdmitOnce(ctx, at))
        end = row.step + HORIZON
        assert row.delta_s == pytest.approx(admitted[end][0] - adaptive[end][0])
        assert row.delta_lost_s == pytest.approx(admitted[end][1] - adaptive[end][1])
    assert any(row.delta_s != 0 for row in rep.rows)  # the branches did part
    assert rep.keep_better + rep.admit_better <= len(rep.rows)


@pytest.mark.integration
def test_no_branch_outlives_the_call(report):
    _, before = report
    assert set(_children()) <= before


def test_a_horizon_under_one_step_is_refused():
    with pytest.raises(ConfigError, match="horizon"):
        admission_counterfactuals(small_scenario(memory_gib=24, steps=4), 0)
