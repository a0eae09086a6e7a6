"""``oracle``: how fast the planner's own search could run the job if it knew the truth.

Not a policy a system can run: a reference that says how much any policy built on
``nereus.planner.search`` could gain on a scenario, so a policy's gap to a target can be
told apart from the scenario's headroom. At every step it knows the truth's headline
rates (training MFU, decode roofline share, bus bandwidths, drift applied) as the
planner's efficiencies and the step's sampled lengths, runs the search's best plan and
each alternative under the ground truth and takes the fastest that fits; every
transition and restart is free, and no step aborts or runs out of memory.

It is a reference, not a proof: its clock meets the device trace at other times than a
policy's, and a plan the search never proposes might run faster under the truth.
``matched_compute`` puts it on a policy's own steps and pools instead
(``PolicyResult.plan_gap``).

Deterministic under the scenario's seed (the truth draws from the step and the attempt).

More (how it works): docs/simulation.md.
"""

from __future__ import annotations

from nereus.errors import InfeasiblePlan
from nereus.planner.cost import OP_CLASSES, Efficiency
from nereus.planner.plan import Plan
from nereus.planner.pool import DevicePool
from nereus.planner.search import search
from nereus.planner.workload import LengthStats
from nereus.sim.policies import ORACLE
from nereus.sim.run import (
    PolicyResult,
    Scenario,
    StepRecord,
    devices_of,
    pause_until_available,
    wait_for_change,
)
from nereus.sim.truth import StepTruth

__all__ = ["ORACLE", "Oracle", "matched_compute", "run_oracle", "told_the_truth"]


def told_the_truth(scn: Scenario, step: int) -> Efficiency:
    """What the oracle's search plans with at ``step``: the truth's headline rates there
    as the planner's efficiencies, its fragmentation and workspace as the memory terms."""
    rates = scn.truth.reference_rates(step)
    factors = {c: float(min(1.5, max(1e-3, rates[c]))) for c in OP_CLASSES}
    return Efficiency(**factors).replace(
        memory_scale=rates["memory_scale"], memory_fixed_bytes=rates["memory_fixed_bytes"]
    )


class Oracle:
    """The oracle's choice at a step on a pool, kept: several runs meet the same pools at
    the same steps."""

    def __init__(self, scn: Scenario) -> None:
        self.scn = scn
        self._best: dict[tuple[int, tuple[int, ...], int], tuple[Plan, StepTruth] | None] = {}
        self._candidates: dict[tuple[int, tuple[int, ...]], list[Plan] | InfeasiblePlan] = {}

    def _candidates_on(self, step: int, devices: tuple[int, ...]) -> list[Plan] | InfeasiblePlan:
        """The search's best plan and its alternatives on ``devices`` (device ids), told
        the truth at ``step``; the search's error when it finds none."""
        key = (step, devices)
        found = self._candidates.get(key)
        if found is None:
            scn = self.scn
            lengths = scn.truth.lengths(step, scn.lengths.mean_at(step))
            longest = LengthStats(float(lengths.max), float(lengths.max), lengths.max)
            cluster = scn.cluster.with_devices(len(devices))
            try:
                result = search(
                    scn.work.with_lengths(lengths, longest), cluster, told_the_truth(scn, step)
                )
            except InfeasiblePlan as e:
                found = e
            else:
                pool = DevicePool.of(devices)
                found = [
                    pool.to_devices(p)
                    for p in [result.plan] + [a.plan for a in result.alternatives]
                ]
            self._candidates[key] = found
        return found

    def best(
        self, step: int, devices: tuple[int, ...], attempt: int = 0
    ) -> tuple[Plan, StepTruth] | None:
        """The fastest candidate of the search on ``devices`` at ``step`` under the truth
        (``attempt``: the straggler draw), with its truth; None when none fits. Raises
        ``InfeasiblePlan`` when the search finds no plan."""
        key = (step, devices, attempt)
        if key in self._best:
            return self._best[key]
        found = self._candidates_on(step, devices)
        if isinstance(found, InfeasiblePlan):
            raise found
        mean = self.scn.lengths.mean_at(step)
        best = None
        for plan in found:
            truth = self.scn.truth.step(plan, step, mean, attempt)
            if not truth.failed and (best is None or truth.seconds < best[1].seconds):
                best = (plan, truth)
        self._best[key] = best
        return best


def matched_compute(oracle: Oracle, result: PolicyResult) -> float | None:
    """The oracle's seconds for ``result``'s own completed steps: each step on the pool
    that run met at its boundary, with its straggler draw. Set beside the run's
    ``compute_s``, it says how far that run's plans were from the best the search
    proposes on the same pools, apart from where the clocks met the device trace. None
    when the oracle has no plan that fits for one of those steps."""
    total = 0.0
    for record in result.records:
        try:
            best = oracle.best(record.step, record.pool, record.attempt)
        except InfeasiblePlan:
            return None
        if best is None:
            return None
        total += best[1].seconds
    return total


def run_oracle(scn: Scenario, oracle: Oracle | None = None) -> PolicyResult:
    """The ``oracle`` reference over ``scn`` (see the module docstring); ``oracle``: a
    kept one to share its choices with ``matched_compute``."""
    oracle = oracle or Oracle(scn)
    per = scn.unit
    res = PolicyResult(ORACLE)
    clock, step = 0.0, 0
    previous = None
    while step < scn.steps:
        devices = devices_of(scn.devices.nodes_at(clock, step), per)
        if not devices:
            clock = pause_until_available(scn, res, clock, step)
            continue
        res.decisions += 1
        try:
            best = oracle.best(step, devices)
        except InfeasiblePlan as e:
            clock = wait_for_change(scn, res, clock, step, str(e), ORACLE)
            continue
        if best is None:
            clock = wait_for_change(
                scn, res, clock, step, "no candidate of the search fits the truth's memory", ORACLE
            )
            continue
        plan, truth = best
        moved = previous is not None and plan != previous
        res.transitions += moved
        res.records.append(
            StepRecord(
                step,
                clock,
                truth.seconds,
                devices,
                len(plan.devices),
                truth.lengths.mean,
                truth.lengths.max,
                truth.device_peak,
                moved,
                False,
            )
        )
        clock += truth.seconds
        res.compute_s += truth.seconds
        res.tokens += scn.work.sequences * truth.lengths.mean
        previous, step = plan, step + 1
    res.steps = step
    res.total_s = clock
    return res
