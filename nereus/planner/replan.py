"""The planner's loop at safe boundaries: triggers -> search -> admission (docs/design.md §6).

``Replanner`` is what the controller and the simulator both drive at the end of an RL
step. ``on_boundary(step, lengths=..., cluster=...)`` re-evaluates the current plan
under the job as it is now, asks the ``TriggerMonitor`` what fired (hard: devices lost
or drained, a predicted memory violation; soft: devices joined, length drift), and if
anything did: searches, relabels each candidate onto the current plan's devices, adds
the current layout rescaled to the pool, prices each move with the caller's
``transition_seconds`` and applies admission (payback, or the urgent path). The plan it
adopts is the relabelled one it priced; drift references are reset whatever it decided.

``observe_stage_seconds``, ``observe_memory_peaks`` and ``observe_device_peaks`` feed
the ``Calibrator``; refitted factors apply from the next boundary on.

Raises ``InfeasiblePlan`` when the current plan can no longer run and no plan fits.
Pure: the caller supplies steps, lengths, clusters and transition estimates; nothing
here reads a clock or does I/O.

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nereus.config import require
from nereus.errors import InfeasiblePlan
from nereus.planner.admission import DEFAULT_GAMMA, Decision, Target, choose
from nereus.planner.calibrate import Calibrator
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import CONSERVATIVE, Efficiency
from nereus.planner.explain import Explanation, explain
from nereus.planner.plan import Plan
from nereus.planner.relabel import relabel
from nereus.planner.rescale import rescaled
from nereus.planner.search import search
from nereus.planner.triggers import Trigger, TriggerMonitor
from nereus.planner.workload import LengthStats, Workload

__all__ = ["Replanner", "BoundaryOutcome"]

log = logging.getLogger("nereus.planner")

TransitionEstimate = Callable[[Plan, Plan], float]


@dataclass(frozen=True)
class BoundaryOutcome:
    """What happened at one boundary: the triggers, the decision, the plan now current,
    its predicted seconds per step, and the current plan's before the decision (None
    when it could no longer run)."""

    step: int
    triggers: tuple[Trigger, ...]
    decision: Decision
    plan: Plan
    step_seconds: float
    current_seconds: float | None = None
    previous_plan: Plan | None = None


class Replanner:
    """Holds the current plan of one job and decides, at each boundary, whether to move.

    ``plan``: the job's plan (over the planner's device slots) to start from; by default
    the search's best. ``join_horizon_steps``: how long a join is expected to last before
    two pool changes were seen; ``min_steps_between``: soft triggers are not acted on
    within that many steps of the last change."""

    # the current layout rescaled to the pool joins the search's targets (a policy whose
    # ``_candidates`` already decides about it turns this off)
    offers_rescaled = True

    def __init__(
        self,
        work: Workload,
        cluster: ClusterSpec,
        *,
        plan: Plan | None = None,
        eff: Efficiency = CONSERVATIVE,
        gamma: float = DEFAULT_GAMMA,
        slack: float = 0.05,
        length_threshold: float = 0.30,
        calibrator: Calibrator | None = None,
        join_horizon_steps: float = 20.0,
        min_steps_between: int = 0,
    ) -> None:
        require(gamma > 0, "gamma", gamma, "must be > 0")
        require(min_steps_between >= 0, "min_steps_between", min_steps_between, "must be >= 0")
        self.work, self.cluster, self.eff = work, cluster, eff
        self.gamma, self.slack = gamma, slack
        self.min_steps_between = min_steps_between
        self.monitor = TriggerMonitor(
            {"length": length_threshold}, join_horizon_steps=join_horizon_steps
        )
        self.calibrator = calibrator if calibrator is not None else Calibrator(prior=eff)
        if plan is None:
            found = search(work, cluster, eff, alternatives=False)
            self.plan, self.step_seconds = found.plan, found.step_seconds
        else:
            self.plan = plan
            self.step_seconds = self._seconds_of(plan) or math.inf
        self.last_change: int | None = None
        self.failed = False  # the boundary being decided follows a step that ran out of memory
        # a follow-up: the last admitted move was a compromise (a faster target could not
        # be reached from the plan then); from the new plan it may be, so the next
        # boundary searches again, as a soft trigger, even if nothing else fires
        self.pending: Trigger | None = None
        self._fastest = math.inf
        self.monitor.observe(
            0, devices=set(range(cluster.num_devices)), values={"length": work.lengths.mean}
        )

    def _seconds_of(self, plan: Plan) -> float | None:
        if plan.devices and max(plan.devices) >= self.cluster.num_devices:
            return None
        ex = explain(plan, self.work, self.cluster, self.eff)
        return ex.step_seconds if ex.fits else None

    def explain_current(self) -> Explanation:
        return explain(self.plan, self.work, self.cluster, self.eff)

    def observe_stage_seconds(self, measured: dict[str, float]) -> Efficiency:
        """Measured seconds per model-stage of the current plan; refits the efficiencies."""
        ex = self.explain_current()
        for name, seconds in measured.items():
            self.calibrator.observe_stage(ex.stage(name).cost, seconds)
        self.eff = self.calibrator.fit()
        return self.eff

    def _unscaled(self, lengths: LengthStats | None) -> Explanation:
        work = self.work if lengths is None else self.work.with_lengths(lengths)
        return explain(self.plan, work, self.cluster, self.eff.uncalibrated_memory())

    def observe_memory_peaks(
        self, measured: dict[str, int], lengths: LengthStats | None = None
    ) -> Efficiency:
        """Measured peak bytes per model-stage (on one of its devices), under ``lengths``
        (default: the workload's); recalibrates the memory model's transient bytes
        (``Efficiency.memory_scale`` and ``memory_fixed_bytes``) against the
        uncalibrated model."""
        ex = self._unscaled(lengths)
        for name, peak in measured.items():
            self.calibrator.observe_memory(ex.stage(name).memory, peak)
        self.eff = self.calibrator.fit()
        return self.eff

    def observe_device_peaks(
        self, measured: dict[int, int], lengths: LengthStats | None = None
    ) -> Efficiency:
        """Measured peak bytes per device slot of the current plan over a step run at
        ``lengths`` (the ledger's high-water marks); devices the plan leaves empty are
        skipped, and so are devices whose modelled transient bytes are under a quarter of
        their total (the ratio would measure what the model does not count, not the
        transient bytes)."""
        ex = self._unscaled(lengths)
        by_slot = {m.device: m for m in ex.memory}
        for slot, peak in measured.items():
            m = by_slot.get(slot)
            if m is None or peak <= 0 or m.transient <= 0 or m.transient < 0.25 * m.total:
                continue
            self.calibrator.observe_memory_bytes(
                m.workspace + sum(b for _, b in m.resident), m.transient, peak
            )
        self.eff = self.calibrator.fit()
        return self.eff

    def on_boundary(
        self,
        step: int,
        *,
        lengths: LengthStats | None = None,
        memory_lengths: LengthStats | None = None,
        cluster: ClusterSpec | None = None,
        plan: Plan | None = None,
        lost: Sequence[int] = (),
        drained: Sequence[int] = (),
        joined: Sequence[int] = (),
        failed: bool = False,
        transition_seconds: TransitionEstimate,
    ) -> BoundaryOutcome:
        """Re-evaluate, trigger, search and admit at a safe boundary (see the module doc).

        ``lengths``: the responses as they are now (step time, drift); ``memory_lengths``:
        the lengths the next step may reach (its cap), checked against memory (default
        ``lengths``); ``cluster``: the pool now; ``plan``: the job's plan over this pool's
        slots when the caller renumbered it (a plan on a slot the pool no longer has
        cannot run); ``lost``/``drained``/``joined``: what changed in the pool since the
        last boundary (device ids, for the triggers' details); ``failed``: the last step
        ran out of memory on the plan (a hard trigger, whatever the memory model says)."""
        if lengths is not None or memory_lengths is not None:
            # the search and the current plan's check see memory at memory_lengths
            self.work = self.work.with_lengths(lengths or self.work.lengths, memory_lengths)
        if cluster is not None:
            self.cluster = cluster
        if plan is not None:
            self.plan = plan
        previous = self.plan
        runnable = not self.plan.devices or max(self.plan.devices) < self.cluster.num_devices
        violations: list[tuple[int, int, int]] = []
        current: float | None = None
        if runnable:
            ex = self.explain_current()
            current = ex.step_seconds if ex.fits else None  # None: the next step cannot run on it
            violations = [(m.device, m.total, m.usable) for m in ex.violations]
        elif not (lost or drained):
            # the plan uses devices that are gone, and the caller did not say which left
            violations = [
                (d, 0, 0)
                for d in sorted(d for d in self.plan.devices if d >= self.cluster.num_devices)
            ]
        values = {"length": self.work.lengths.mean}
        triggers = tuple(
            self.monitor.observe(
                step,
                devices=set(range(self.cluster.num_devices)),
                values=values,
                memory_violations=violations,
                lost=lost,
                drained=drained,
                joined=joined,
            )
        )
        self.failed = failed
        if failed:
            triggers += (
                Trigger(
                    "memory",
                    "oom",
                    True,
                    step,
                    "the last step ran out of memory",
                    {"detail": "oom"},
                ),
            )
        if not triggers and self.pending is not None:
            p = self.pending
            kind = p.kind if p.kind == "drift" else "device-pool"
            triggers = (
                Trigger(
                    kind,
                    p.signal,
                    False,
                    step,
                    "follow-up",
                    {"detail": "follow-up", "after": p.detail},
                ),
            )
        self.pending = None
        triggers = self._acted_on(step, triggers)
        hard = any(t.hard for t in triggers)
        recent = self.last_change is not None and step - self.last_change < self.min_steps_between
        if not triggers or (recent and not hard):
            reason = (
                "no trigger"
                if not triggers
                else (
                    f"within min_steps_between={self.min_steps_between} of the change at step "
                    f"{self.last_change}"
                )
            )
            self.step_seconds = current if current is not None else math.inf
            return BoundaryOutcome(
                step,
                triggers,
                Decision("keep", None, reason),
                self.plan,
                self.step_seconds,
                current,
                previous,
            )
        decision = self._decide(triggers, current, transition_seconds)
        self.monitor.reset(step, values)  # even when the replan is rejected
        if decision.admitted and decision.target is not None:
            self.plan = decision.target.plan
            self.step_seconds = decision.target.step_seconds
            self.last_change = step
            if decision.action == "transition" and decision.target.step_seconds > self._fastest * (
                1 + self.slack
            ):
                self.pending = triggers[0]
        elif current is not None:
            self.step_seconds = current
        log.info(
            "step %d: %s -> %s (%s)",
            step,
            [t.kind for t in triggers],
            decision.action,
            decision.reason,
        )
        return BoundaryOutcome(
            step, triggers, decision, self.plan, self.step_seconds, current, previous
        )

    def _acted_on(self, step: int, triggers: tuple[Trigger, ...]) -> tuple[Trigger, ...]:
        """The triggers this policy acts on at ``step`` (here: every one that fired);
        a policy of ``nereus.planner.policies`` narrows or widens them."""
        return triggers

    def _relabelled(self, plan: Plan) -> Plan:
        return relabel(
            self.plan,
            plan,
            devices_per_node=self.cluster.devices_per_node,
            devices=self.cluster.num_devices,
        )

    def _candidates(self, current: float | None) -> list[tuple[str, Plan, float]]:
        """The targets to price, relabelled onto the current plan's devices: the search's
        best and alternatives, and the current layout rescaled to the pool."""
        found = search(self.work, self.cluster, self.eff)
        candidates = [("best", found.plan, found.step_seconds)] + [
            (a.label, a.plan, a.step_seconds) for a in found.alternatives
        ]
        return [(label, self._relabelled(plan), seconds) for label, plan, seconds in candidates]

    def _decide(
        self,
        triggers: tuple[Trigger, ...],
        current: float | None,
        transition_seconds: TransitionEstimate,
    ) -> Decision:
        hard = any(t.hard for t in triggers)
        try:
            candidates = self._candidates(current)
        except InfeasiblePlan as e:
            if current is None:
                raise  # the current plan cannot run and no plan fits: the job cannot go on
            return Decision("keep", None, f"no plan fits: {e}")
        # the current layout with DP following the pool: reachable by Extends and
        # Destroys alone, when the search's plans change TP or PP beyond what the
        # devices' memory allows mid-transition
        grown = rescaled(self.plan, self.work, self.cluster) if self.offers_rescaled else None
        if grown is not None:
            grown = self._relabelled(grown)
        if grown is not None and grown != self.plan and all(grown != p for _, p, _ in candidates):
            ex = explain(grown, self.work, self.cluster, self.eff)
            if ex.fits:
                candidates.append(("rescaled", grown, ex.step_seconds))
        targets = []
        for label, plan, seconds in candidates:
            cost = 0.0 if plan == self.plan else float(transition_seconds(self.plan, plan))
            targets.append(Target(plan, seconds, cost, label))
        self._fastest = min(t.step_seconds for t in targets)
        soft = next((t for t in triggers if not t.hard), None)
        horizon = self.monitor.horizon_steps(soft) if soft is not None else None
        if math.isinf(self.gamma):
            horizon = math.inf  # no payback limit: any predicted saving is admitted
        return choose(current, targets, horizon, gamma=self.gamma, urgent=hard, slack=self.slack)
