"""The policies the simulator compares, each driving the real planner calls.

At every step boundary the simulator hands a policy a ``Boundary`` (the live devices,
what left and joined, the previous step's lengths, whether the last attempt ran out of
memory) and the job's plan; the policy answers a ``Move``: keep, transition to a target
plan, restart from a checkpoint on a target plan, wait (no plan fits the pool), or stop
(``static`` ran out of memory with no relief left: the run ends in ``SimulationError``).
Plans reach the planner through ``DevicePool`` (the one map between device ids and the
planner's slots).

``POLICIES``: ``adaptive``, ``dynarl``, ``every-k`` and ``static`` are the planner's ``payback``,
``always``, ``every-k`` and ``static`` (``nereus.planner.policies``: one definition,
which the running job uses too; each boundary is recorded for
``nereus.planner.replay``). ``colocated`` and ``separated`` are this simulator's fixed
layouts (DP follows the pool; a new layout is searched when they no longer fit).
``EXTRA_POLICIES`` (run only when named): ``static-restart`` (the same fixed-layout
rule with the search's placement: it restarts on a searched plan, possibly of another
TP/PP, when its layout no longer fits; not the paper's static), ``static-max-cap``
(``static-restart`` checked against the largest cap from the start) and the ``oracle``
reference. These are documented policies of this simulator, not claims about the
systems they are named after.

Promises: every policy plans, calibrates and restarts as the job's controller loop
does (step time at the last step's lengths, memory at the next step's cap); the truth
reaches a policy only through those measurements.

Refuses (``ConfigError``): a policy name outside ``POLICIES + EXTRA_POLICIES``.

More (how it works): docs/simulation.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from nereus.errors import InfeasiblePlan
from nereus.planner.calibrate import Calibrator
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import CONSERVATIVE, Efficiency
from nereus.planner.explain import explain
from nereus.planner.plan import Plan
from nereus.planner.policies import SIM_NAMES, PolicySpec, make_replanner, static_rescaled
from nereus.planner.pool import DevicePool
from nereus.planner.replan import BoundaryOutcome, Replanner
from nereus.planner.replay import boundary_record
from nereus.planner.rescale import Layout, layout_of, rescaled_layout
from nereus.planner.search import SearchResult, search
from nereus.planner.workload import LengthStats, Workload
from nereus.sim.traces import CapSchedule
from nereus.sim.transitions import Transitions, intact
from nereus.sim.truth import StepTruth

__all__ = [
    "Boundary",
    "Move",
    "Policy",
    "AdaptivePolicy",
    "FixedLayoutPolicy",
    "POLICIES",
    "EXTRA_POLICIES",
    "ORACLE",
    "make_policy",
]

POLICIES = ("adaptive", "static", "every-k", "dynarl", "colocated", "separated")
# run only when named (``--policies``): two fixed-layout policies that restart on a
# searched plan (a new TP/PP) when the layout no longer fits, so not the paper's
# ``static``, and the ``oracle`` reference (``nereus.sim.oracle``: not a policy, what the
# search could reach knowing the truth, with transitions free)
ORACLE = "oracle"
STATIC_RESTART = "static-restart"
EXTRA_POLICIES = (STATIC_RESTART, "static-max-cap", ORACLE)


@dataclass(frozen=True)
class Boundary:
    """What a policy knows at a step boundary."""

    step: int
    devices: tuple[int, ...]
    lost: tuple[int, ...]
    joined: tuple[int, ...]
    lengths: LengthStats
    failed: bool = False
    # devices that left since the last boundary drained, not lost: they still hold their
    # EMUs, which the next change moves off them (``DeviceTrace.drains``)
    drained: tuple[int, ...] = ()


@dataclass
class Move:
    """A policy's answer: ``action`` keep | transition | restart | wait | stop (the job
    cannot go on: ``static`` out of memory with its waves and recompute exhausted), the
    target plan (device ids) for transition and restart, why, and the wall seconds its
    planner calls (search, explain, admission) and DAG estimates took."""

    action: str
    plan: Plan | None = None
    reason: str = ""
    planner_s: float = 0.0
    dag_s: float = 0.0


@dataclass
class _Ctx:
    work: Workload
    cluster: ClusterSpec  # the whole cluster; plans name its device ids
    transitions: Transitions
    caps: CapSchedule  # the job's generation cap at every step (its config: known ahead)
    # the job's pinned first plan (device ids; None: each policy starts on its own), and
    # the calibration's prior and its weight (``Scenario``)
    initial_plan: Plan | None = None
    prior: Efficiency = CONSERVATIVE
    prior_weight: float = 1e-3

    def pool_cluster(self, devices: tuple[int, ...]) -> tuple[DevicePool, ClusterSpec]:
        """The pool's slots and the planner's cluster over it: the cluster's hardware with
        that many devices (``ClusterSpec.with_devices``, as a running job describes its
        pool)."""
        return DevicePool.of(devices), self.cluster.with_devices(len(devices))

    def cap_lengths(self, step: int) -> LengthStats:
        """Memory's lengths for step ``step``: its cap (any response may reach it)."""
        cap = self.caps.cap_at(step)
        return LengthStats(float(cap), float(cap), cap)

    def work_at(self, lengths: LengthStats, step: int) -> Workload:
        """The job at ``lengths`` (step time), memory at step ``step``'s cap."""
        return self.work.with_lengths(lengths, self.cap_lengths(step))


class Policy:
    """One policy (see the module docstring)."""

    name = "policy"

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx = ctx
        self.calibrator = Calibrator(prior=ctx.prior, prior_weight=ctx.prior_weight)
        self.eff: Efficiency = self.calibrator.fit()
        # the planner's state of the job: its plan, workload and pool, and the observers
        # that calibrate ``eff`` (fixed layouts and every-k never call ``on_boundary``)
        self.replanner: Replanner | None = None

    def start(self, b: Boundary) -> Plan:
        """The first plan (device ids); raises ``InfeasiblePlan`` when none fits."""
        raise NotImplementedError

    def decide(self, b: Boundary, plan: Plan | None) -> Move:
        raise NotImplementedError

    # --- calibration from what the simulated cluster measured -----------------------------

    def _track(self, plan: Plan, b: Boundary) -> None:
        """A Replanner holding ``plan`` over ``b``'s pool, for the observers."""
        pool, cluster = self.ctx.pool_cluster(b.devices)
        self.replanner = Replanner(
            self.ctx.work_at(b.lengths, b.step),
            cluster,
            plan=pool.to_slots(plan),
            eff=self.eff,
            calibrator=self.calibrator,
        )

    def observe(
        self,
        plan: Plan,
        devices: tuple[int, ...],
        lengths: LengthStats,
        truth: StepTruth,
        step: int,
    ) -> None:
        """Step ``step`` ran (or failed) on ``plan`` over the live ``devices``; the policy
        had planned it at ``lengths``: its model-stage seconds and device peaks."""
        rp = self.replanner
        if rp is None:
            return
        pool, cluster = self.ctx.pool_cluster(devices)
        rp.plan, rp.cluster, rp.work = pool.to_slots(plan), cluster, self.ctx.work_at(lengths, step)
        if not truth.failed:
            rp.observe_stage_seconds(truth.stage_seconds)
        longest = truth.lengths.max
        ran = LengthStats(float(longest), float(longest), longest)
        rp.observe_device_peaks(
            {pool.slot(d): peak for d, peak in truth.device_peaks.items()}, lengths=ran
        )
        if truth.failed:
            # a device that ran out of memory is learned from whatever its share of
            # transient bytes (the observers skip devices where that share is small)
            ex = explain(
                rp.plan, self.ctx.work.with_lengths(ran), cluster, rp.eff.uncalibrated_memory()
            )
            by_slot = {m.device: m for m in ex.memory}
            for device, need, _ in truth.overflow:
                m = by_slot.get(pool.slot(device))
                if m is not None and m.transient > 0:
                    self.calibrator.observe_memory_bytes(
                        m.workspace + sum(b for _, b in m.resident), m.transient, need
                    )
            rp.eff = self.calibrator.fit()
        self.eff = rp.eff

    def observe_transition(self, nodes: list[tuple[dict[str, float], float]]) -> None:
        for ideal, seconds in nodes:
            if seconds > 0:
                self.calibrator.observe_transition(ideal, seconds)
        self.eff = self.calibrator.fit()
        if self.replanner is not None:
            self.replanner.eff = self.eff

    # --- helpers ---------------------------------------------------------------------------

    def _estimate(self, pool: DevicePool, eff: Efficiency, current: Plan):
        """The transition estimate in the planner's slots: the real DAG between the
        plans' devices, under the planner's link model at ``eff``."""

        def seconds(cur: Plan, target: Plan) -> float:
            return self.ctx.transitions.estimate(current, pool.to_devices(target), eff)

        return seconds

    def _search(self, work: Workload, cluster: ClusterSpec) -> SearchResult:
        return search(work, cluster, self.eff)


class AdaptivePolicy(Policy):
    """``adaptive``, ``dynarl``, ``every-k`` and ``static``: the planner's policies
    (``nereus.planner.policies``), each a Replanner built by ``make_replanner``, the one
    definition the running job uses too."""

    def __init__(
        self,
        ctx: _Ctx,
        *,
        name: str = "adaptive",
        gamma: float = 0.5,
        k: int = 3,
        join_horizon_steps: float = 20.0,
        min_steps_between: int = 0,
    ) -> None:
        super().__init__(ctx)
        self.name = name
        self.spec = PolicySpec(SIM_NAMES[name], gamma=gamma, every_k=k)
        self.gamma = self.spec.admission_gamma
        self.join_horizon_steps, self.min_steps_between = join_horizon_steps, min_steps_between
        self.replanner: Replanner | None = None
        self.outcome: BoundaryOutcome | None = None  # the last boundary's, for reports
        self.layout: Layout | None = None  # static: the layout a restart keeps
        self.boundaries: list[dict] = []  # every boundary report (nereus.planner.replay)
        self._initial: tuple | None = None

    def _fresh(self, b: Boundary) -> Plan:
        """A (re)started job: a new Replanner on the pool, keeping what calibration learned
        (``static`` keeps its layout: DP follows the pool)."""
        pool, cluster = self.ctx.pool_cluster(b.devices)
        work = self.ctx.work_at(b.lengths, b.step)
        plan = None
        if self.layout is not None:
            plan = static_rescaled(self.layout, self.ctx.work, cluster)
            if plan is None:
                raise InfeasiblePlan(f"the static layout fits no DP of {len(b.devices)} devices")
        self.replanner = make_replanner(
            self.spec,
            work,
            cluster,
            plan=plan,
            eff=self.eff,
            calibrator=self.calibrator,
            join_horizon_steps=self.join_horizon_steps,
            min_steps_between=self.min_steps_between,
            largest_cap=self.ctx.caps.largest,
        )
        if self.spec.name == "static" and self.layout is None:
            self.layout = layout_of(self.replanner.plan, self.ctx.work)
        self._initial = (work, cluster, self.replanner.plan, self.eff)
        self.boundaries = []
        return pool.to_devices(self.replanner.plan)

    def start(self, b: Boundary) -> Plan:
        first = self.ctx.initial_plan
        if first is not None and first.devices <= set(b.devices):
            return self._pinned(b, first)
        return self._fresh(b)

    def _pinned(self, b: Boundary, first: Plan) -> Plan:
        """The job starts on its config's plan (device ids), as a running job does: its
        Replanner holds that plan, and ``static`` keeps its layout."""
        pool, cluster = self.ctx.pool_cluster(b.devices)
        work = self.ctx.work_at(b.lengths, b.step)
        slots = pool.to_slots(first)
        self.replanner = make_replanner(
            self.spec,
            work,
            cluster,
            plan=slots,
            eff=self.eff,
            calibrator=self.calibrator,
            join_horizon_steps=self.join_horizon_steps,
            min_steps_between=self.min_steps_between,
        )
        if self.spec.name == "static":
            self.layout = layout_of(slots, self.ctx.work)
        self._initial = (work, cluster, slots, self.eff)
        self.boundaries = []
        return first

    def decide(self, b: Boundary, plan: Plan | None) -> Move:
        t0 = time.perf_counter()
        dag0 = self.ctx.transitions.dag_seconds
        current = intact(plan, b.devices + b.drained) if plan is not None else None
        try:
            if current is None or self.replanner is None:
                target = self._fresh(b)
                return self._timed(
                    Move("restart", target, "a model-stage lost every EMU"), t0, dag0
                )
            pool, cluster = self.ctx.pool_cluster(b.devices)
            rp, eff = self.replanner, self.replanner.eff
            priced: dict[Plan, float] = {}
            estimate = self._estimate(pool, rp.eff, current)

            def price(cur: Plan, target: Plan) -> float:
                priced[target] = estimate(cur, target)
                return priced[target]

            # a plan on drained devices, as the running job shows it to the planner: those
            # devices past the pool's last slot (it cannot run there; a change must move)
            gone = [d for d in sorted(current.devices) if d not in pool.ids]
            outcome = rp.on_boundary(
                b.step,
                lengths=b.lengths,
                memory_lengths=self.ctx.cap_lengths(b.step),
                cluster=cluster,
                plan=pool.to_slots(current, gone=gone),
                lost=b.lost,
                drained=b.drained,
                joined=b.joined,
                failed=b.failed,
                transition_seconds=price,
            )
            self.boundaries.append(
                boundary_record(
                    rp,
                    outcome,
                    eff=eff,
                    lost=b.lost,
                    drained=b.drained,
                    joined=b.joined,
                    priced=priced,
                    first=not self.boundaries,
                    initial=self._initial,
                )
            )
        except InfeasiblePlan as e:
            self.replanner = None
            return self._timed(Move("wait", None, str(e)), t0, dag0)
        self.eff = self.replanner.eff
        self.outcome = outcome
        if (
            self.spec.name == "static"
            and b.failed
            and outcome.plan == pool.to_slots(current, gone=gone)
        ):
            # the step ran out of memory and no more waves or recompute are left to take;
            # its TP/PP is fixed, so nothing this policy may do lets the job go on
            return self._timed(
                Move("stop", None, f"out of memory with no relief left: {outcome.decision.reason}"),
                t0,
                dag0,
            )
        if self.layout is not None:  # static: a restart keeps the layout it runs now
            self.layout = layout_of(outcome.plan, self.ctx.work)
        d = outcome.decision
        target = pool.to_devices(outcome.plan)
        if d.action == "keep":
            return self._timed(Move("keep", None, d.reason), t0, dag0)
        if d.action == "restart":
            return self._timed(Move("restart", target, d.reason), t0, dag0)
        return self._timed(
            Move("transition" if target != current else "keep", target, d.reason), t0, dag0
        )

    def _timed(self, move: Move, t0: float, dag0: float) -> Move:
        move.dag_s = self.ctx.transitions.dag_seconds - dag0
        move.planner_s = max(0.0, time.perf_counter() - t0 - move.dag_s)
        return move


class FixedLayoutPolicy(Policy):
    """``static-restart``, ``static-max-cap``, ``colocated`` and ``separated`` (see the
    module docstring)."""

    def __init__(self, ctx: _Ctx, *, name: str) -> None:
        super().__init__(ctx)
        self.name = name
        self.placement = "static" if name.startswith("static") else name
        self.layout: Layout | None = None
        self.cap = 0  # the cap its plan was last checked against

    def _placement(
        self, work: Workload, cluster: ClusterSpec
    ) -> tuple[Plan, tuple[tuple[str, ...], ...]]:
        found = self._search(work, cluster)
        if self.placement == "static":
            return found.plan, found.pools
        names = work.stages
        wanted = (
            [tuple(s.name for s in names)]
            if self.placement == "colocated"
            else [(s.name,) for s in names]
        )
        if sorted(map(sorted, found.pools)) == sorted(map(sorted, wanted)):
            return found.plan, found.pools
        for alt in found.alternatives:
            if alt.label == self.placement:
                return alt.plan, tuple(wanted)
        return (
            found.plan,
            found.pools,
        )  # the placement does not fit this pool: the best plan instead

    def _relayout(self, b: Boundary) -> Plan:
        pool, cluster = self.ctx.pool_cluster(b.devices)
        plan, pools = self._placement(self.ctx.work_at(b.lengths, b.step), cluster)
        self.layout = layout_of(plan, self.ctx.work, pools, devices=len(b.devices))
        return pool.to_devices(plan)

    def start(self, b: Boundary) -> Plan:
        plan = self._relayout(b)
        self._track(plan, b)
        self.cap = self.ctx.caps.cap_at(b.step)
        return plan

    def scaled(self, devices: int, cluster: ClusterSpec) -> Plan | None:
        """The layout with each pool at the largest valid size up to its share of
        ``devices`` (planner slots from 0, largest pool first); None when a pool gets none."""
        assert self.layout is not None
        return rescaled_layout(self.layout, self.ctx.work, cluster, devices)

    def decide(self, b: Boundary, plan: Plan | None) -> Move:
        t0 = time.perf_counter()
        dag0 = self.ctx.transitions.dag_seconds
        try:
            move = self._decide(b, plan)
        except InfeasiblePlan as e:
            move = Move("wait", None, str(e))
        move.dag_s = self.ctx.transitions.dag_seconds - dag0
        move.planner_s = max(0.0, time.perf_counter() - t0 - move.dag_s)
        return move

    def _decide(self, b: Boundary, plan: Plan | None) -> Move:
        pool, cluster = self.ctx.pool_cluster(b.devices)
        work = self.ctx.work_at(b.lengths, b.step)
        current = intact(plan, b.devices) if plan is not None else None
        cap = self.ctx.caps.cap_at(b.step)
        raised, self.cap = cap > self.cap, cap
        if self.layout is None:
            return Move("restart", self._relayout(b), "no layout yet")
        if b.failed:
            return Move("restart", self._relayout(b), "a step ran out of memory")
        if current is not None and not b.lost and not b.drained and not b.joined and not raised:
            return Move("keep", None, "the pool and the cap are unchanged")
        target = self.scaled(len(b.devices), cluster)
        if target is None or not explain(target, work, cluster, self.eff).fits:
            why = (
                "no DP of the layout fits the pool"
                if target is None
                else "the rescaled layout does not fit memory"
            )
            return Move("restart", self._relayout(b), why)
        target_devices = pool.to_devices(target)
        if current is None:
            return Move("restart", target_devices, "a model-stage lost every EMU")
        if target_devices == current:
            return Move("keep", None, "the layout fits")
        cost = self.ctx.transitions.estimate(current, target_devices, self.eff)
        if not math.isfinite(cost):
            return Move(
                "restart", target_devices, "no transition to the rescaled layout is possible"
            )
        return Move("transition", target_devices, "DP follows the pool")


def make_policy(
    name: str,
    ctx: _Ctx,
    *,
    gamma: float = 0.5,
    k: int = 3,
    join_horizon_steps: float = 20.0,
    min_steps_between: int = 0,
) -> Policy:
    """The policy called ``name`` (one of ``POLICIES`` or ``EXTRA_POLICIES``)."""
    if name in SIM_NAMES:
        return AdaptivePolicy(
            ctx,
            name=name,
            gamma=gamma,
            k=k,
            join_horizon_steps=join_horizon_steps,
            min_steps_between=min_steps_between,
        )
    if name in (STATIC_RESTART, "colocated", "separated"):
        return FixedLayoutPolicy(ctx, name=name)
    if name == "static-max-cap":
        return FixedLayoutPolicy(replace(ctx, caps=CapSchedule.fixed(ctx.caps.largest)), name=name)
    from nereus.errors import ConfigError

    raise ConfigError(
        f"policy={name!r} is not known; expected one of {list(POLICIES + EXTRA_POLICIES)}"
    )
