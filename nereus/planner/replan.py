"""The planner's loop at safe boundaries: triggers -> search -> admission (DESIGN §6).

``Replanner`` is what the controller and the simulator both drive, at the end of an RL
step (synchronous mode) or at a weight sync (asynchronous mode):

1. ``on_boundary(step, lengths=..., cluster=...)`` re-evaluates the current plan under
   the job as it is now (response lengths drift; the device pool may have changed), and
   asks the ``TriggerMonitor`` what fired: a device-pool change or a predicted memory
   violation (hard), or length drifting past 30% of its reference (soft).
2. If something fired, it searches the best plan and its alternatives, relabels each
   onto the devices the current plan uses (``relabel``: the search lays pools out from
   device 0), prices the move to each with ``transition_seconds(current, target)`` (the
   transition DAG's estimate, supplied by the caller; ``inf`` when impossible), and
   applies admission: the payback rule with H from the triggering signal, or the urgent
   path when the trigger is hard or the current plan can no longer run. The plan it
   adopts is the relabelled one it priced.
3. Whatever was decided, the drift references are reset to the current values.

``observe_stage_seconds`` and ``observe_memory_peaks`` feed measured model-stage times
and memory peaks to the ``Calibrator``; the refitted factors are used from the next
boundary on (a plan that no longer fits under them is a memory trigger).

Raises ``InfeasiblePlan`` when the current plan can no longer run and no plan fits.
Pure: the caller supplies steps, lengths, clusters and transition estimates; nothing
here reads a clock or does I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from nereus.errors import InfeasiblePlan
from nereus.planner.admission import DEFAULT_GAMMA, Decision, Target, choose
from nereus.planner.calibrate import Calibrator
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import CONSERVATIVE, Efficiency
from nereus.planner.explain import Explanation, explain
from nereus.planner.plan import Plan
from nereus.planner.relabel import relabel
from nereus.planner.search import search
from nereus.planner.triggers import Trigger, TriggerMonitor
from nereus.planner.workload import LengthStats, Workload

__all__ = ["Replanner", "BoundaryOutcome"]

log = logging.getLogger("nereus.planner")

TransitionEstimate = Callable[[Plan, Plan], float]


@dataclass(frozen=True)
class BoundaryOutcome:
    """What happened at one boundary: the triggers, the decision, the plan now current."""

    step: int
    triggers: tuple[Trigger, ...]
    decision: Decision
    plan: Plan
    step_seconds: float


class Replanner:
    """Holds the current plan of one job and decides, at each boundary, whether to move."""

    def __init__(
        self,
        work: Workload,
        cluster: ClusterSpec,
        *,
        eff: Efficiency = CONSERVATIVE,
        gamma: float = DEFAULT_GAMMA,
        slack: float = 0.05,
        length_threshold: float = 0.30,
        calibrator: Calibrator | None = None,
    ) -> None:
        self.work, self.cluster, self.eff = work, cluster, eff
        self.gamma, self.slack = gamma, slack
        self.monitor = TriggerMonitor({"length": length_threshold})
        self.calibrator = calibrator if calibrator is not None else Calibrator(prior=eff)
        found = search(work, cluster, eff, alternatives=False)
        self.plan = found.plan
        self.step_seconds = found.step_seconds
        self.monitor.observe(0, devices=set(range(cluster.num_devices)), values={"length": work.lengths.mean})

    def explain_current(self) -> Explanation:
        return explain(self.plan, self.work, self.cluster, self.eff)

    def observe_stage_seconds(self, measured: dict[str, float]) -> Efficiency:
        """Measured seconds per model-stage of the current plan; refits the efficiencies."""
        ex = self.explain_current()
        for name, seconds in measured.items():
            self.calibrator.observe_stage(ex.stage(name).cost, seconds)
        self.eff = self.calibrator.fit()
        return self.eff

    def observe_memory_peaks(self, measured: dict[str, int]) -> Efficiency:
        """Measured peak bytes per model-stage (on one of its devices); recalibrates the
        memory model's transient bytes (``Efficiency.memory_scale``)."""
        ex = self.explain_current()
        for name, peak in measured.items():
            self.calibrator.observe_memory(ex.stage(name).memory, peak)
        self.eff = self.calibrator.fit()
        return self.eff

    def on_boundary(
        self,
        step: int,
        *,
        lengths: LengthStats | None = None,
        cluster: ClusterSpec | None = None,
        transition_seconds: TransitionEstimate,
    ) -> BoundaryOutcome:
        """Re-evaluate, trigger, search and admit at a safe boundary (see the module doc)."""
        if lengths is not None:
            self.work = self.work.with_lengths(lengths)
        if cluster is not None:
            self.cluster = cluster
        runnable = max(self.plan.devices) < self.cluster.num_devices
        violations: list[int] = []
        current: float | None = None
        if runnable:
            ex = self.explain_current()
            violations = [m.device for m in ex.violations]
            current = ex.step_seconds if ex.fits else None
        else:
            # the plan uses devices that are gone: that is a violation on each of them
            violations = sorted(d for d in self.plan.devices if d >= self.cluster.num_devices)
        values = {"length": self.work.lengths.mean}
        triggers = tuple(self.monitor.observe(step, devices=set(range(self.cluster.num_devices)), values=values,
                                              memory_violations=violations))
        if not triggers:
            self.step_seconds = current if current is not None else math.inf
            return BoundaryOutcome(step, (), Decision("keep", None, "no trigger"), self.plan, self.step_seconds)
        decision = self._decide(triggers, current, transition_seconds)
        self.monitor.reset(step, values)  # even when the replan is rejected
        if decision.admitted and decision.target is not None:
            self.plan = decision.target.plan
            self.step_seconds = decision.target.step_seconds
        elif current is not None:
            self.step_seconds = current
        log.info("step %d: %s -> %s (%s)", step, [t.kind for t in triggers], decision.action, decision.reason)
        return BoundaryOutcome(step, triggers, decision, self.plan, self.step_seconds)

    def _decide(self, triggers: tuple[Trigger, ...], current: float | None,
                transition_seconds: TransitionEstimate) -> Decision:
        hard = any(t.hard for t in triggers)
        try:
            found = search(self.work, self.cluster, self.eff)
        except InfeasiblePlan as e:
            if current is None:
                raise  # the current plan cannot run and no plan fits: the job cannot go on
            return Decision("keep", None, f"no plan fits: {e}")
        targets = []
        for label, plan, seconds in [("best", found.plan, found.step_seconds)] + [
            (a.label, a.plan, a.step_seconds) for a in found.alternatives
        ]:
            plan = relabel(self.plan, plan, devices_per_node=self.cluster.devices_per_node,
                           devices=self.cluster.num_devices)
            cost = 0.0 if plan == self.plan else float(transition_seconds(self.plan, plan))
            targets.append(Target(plan, seconds, cost, label))
        soft = next((t for t in triggers if not t.hard), None)
        horizon = self.monitor.horizon_steps(soft) if soft is not None else None
        return choose(current, targets, horizon, gamma=self.gamma, urgent=hard, slack=self.slack)
