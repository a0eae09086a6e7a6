"""Online adaptation: the controller loop of a running job (docs/design.md §6, §10).

The Replanner of ``[adapt] policy`` (``nereus.planner.policies``, the definition the
simulator runs too) triggers, searches and admits (the payback rule, or the urgent path for a
lost or drained device or a predicted memory overflow); an admitted target goes to
``ClusterStages.apply_plan`` at this boundary, with ``[adapt] overlap``: a change that
runs beside the next step is waited for by ``settle`` (the step calls it before it
ends), which completes its record (``Change``, and the decision's ``transition``). Every
boundary where a trigger fired puts
a ``decision`` event on the tap (each trigger with its detail, the current and target
plans as device ids, predicted seconds per step of each, the saving, the transition
estimate and bytes, payback against its limit, ``admitted`` and why); each executed
change emits its ``transition`` and ``transition_node`` events (``ClusterStages``),
whose measured times calibrate the next estimate.

The job's config becomes the planner's ``Workload`` in ``nereus.job.workload``.

Refuses (``ConfigError``): a job without a cluster (``in_process``). Raises
``InfeasiblePlan`` when the job's current plan can no longer run and no plan fits the
pool; ``StateError`` for a decision to restart (no change can reach a runnable plan).

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from nereus.actors import Cluster, emit
from nereus.config import require
from nereus.errors import StateError
from nereus.job.cluster_stages import ClusterStages
from nereus.job.config import PLANNER_NAMES, JobConfig, from_planner_plan, to_planner_plan
from nereus.job.recovery import update_counts
from nereus.job.workload import job_workload
from nereus.models import ModelConfig
from nereus.planner import (
    ClusterSpec,
    LengthStats,
    Replanner,
    Workload,
    local_cpu_cluster_probed,
)
from nereus.planner.plan import Plan
from nereus.planner.policies import PolicySpec, make_replanner
from nereus.planner.pool import DevicePool
from nereus.planner.replay import boundary_record

__all__ = ["Adapter", "Change", "usable_devices"]

log = logging.getLogger("nereus.rl")


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


@dataclass
class Change:
    """One executed change of the job's plan, for the run's summary."""

    step: int  # the step it ran before
    triggers: list[str]
    from_plan: dict[str, Any]
    to_plan: dict[str, Any]
    predicted_seconds: float
    measured_seconds: float
    bytes: int
    reason: str
    report: dict[str, Any] = field(default_factory=dict, repr=False)
    overlapped: bool = False  # it ran beside step ``step`` (``[adapt] overlap``)
    ok: bool = True

    def as_record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "triggers": self.triggers,
            "from": self.from_plan,
            "to": self.to_plan,
            "predicted_seconds": self.predicted_seconds,
            "measured_seconds": self.measured_seconds,
            "bytes": self.bytes,
            "reason": self.reason,
            "overlapped": self.overlapped,
            "held_back": list(self.report.get("held_back", [])),
            "ok": self.ok,
        }


async def usable_devices(cluster: Cluster, wait_s: float) -> tuple[set[int], set[int]]:
    """The cluster's live devices and the devices marked draining, read after the
    caller's ``refresh_devices``. A job left with no live device that is not draining (its last
    ones died or are being emptied) waits for one to join, asking the controller again
    every 0.1 s, and raises ``StateError`` naming what is live and what drains if none
    joins within ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    warned = False
    while True:
        live = {d.index for d in cluster.devices}
        draining = set(getattr(cluster, "draining", ()))
        if live - draining:
            return live, draining
        if time.monotonic() >= deadline:
            raise StateError(
                f"no usable device: live {sorted(live)}, draining {sorted(draining & live)}; "
                "none joined "
                f"within adapt.pool_wait_s={wait_s} s"
            )
        if not warned:
            log.warning(
                "no usable device (live %s, draining %s): waiting up to %.0f s for one to join",
                sorted(live),
                sorted(draining & live),
                wait_s,
            )
            warned = True
        await asyncio.sleep(0.1)
        await cluster.refresh_devices()


class Adapter:
    """The controller loop of one job on ``stages`` (a started ``ClusterStages``)."""

    def __init__(
        self,
        cfg: JobConfig,
        stages: ClusterStages,
        model_config: ModelConfig,
        reward_config: ModelConfig | None = None,
    ) -> None:
        require(
            cfg.cluster.mode != "in_process",
            "cluster.mode",
            cfg.cluster.mode,
            "must be 'local' or 'connect' to adapt",
        )
        self.cfg = cfg
        self.stages = stages
        self.model_config = model_config
        self.reward_config = reward_config
        self.pool = DevicePool.of(self._usable())
        self.replanner: Replanner | None = None
        self.prompt_length = 1
        self.changes: list[Change] = []
        self.decisions: list[dict[str, Any]] = []
        self._calibrate_next = False  # the next step ran on a settled plan
        self._gone: list[int] = []
        self._full_plan = stages.plan  # the last plan with every model-stage (device ids)
        self._lengths: LengthStats | None = None  # the last step's
        self.boundaries: list[dict[str, Any]] = []  # every boundary report (nereus.planner.replay)
        self._initial: tuple[Any, ...] | None = None  # how the Replanner was built
        self._counts: dict[str, list[int]] | None = (
            None  # the training EMUs' update counters at the last boundary
        )
        # a change running beside the next step, and the record its boundary carries
        self._overlapped: tuple[Change, dict[str, Any]] | None = None

    # --- the pool and the planner's view ------------------------------------------------

    def _usable(self) -> list[int]:
        cluster = self.stages.cluster
        draining = set(getattr(cluster, "draining", ()))
        return sorted(d.index for d in cluster.devices if d.index not in draining)

    def _cluster_spec(self, devices: int) -> ClusterSpec:
        budget = min((d.memory_bytes for d in self.stages.cluster.devices), default=2**30)
        # the pool's slots in order: each slot's CPU cores (None: shared cores)
        cores = self.stages.device_cores(list(self.pool.ids))
        if cores is not None and len(cores) != devices:
            cores = [min(cores)] * devices
        return local_cpu_cluster_probed(
            max(1, devices), budget, headroom=self.cfg.adapt.headroom, device_cores=cores
        )

    def _workload(
        self, lengths: LengthStats, memory_lengths: LengthStats | None = None
    ) -> Workload:
        return job_workload(
            self.cfg,
            self.model_config,
            prompt_length=self.prompt_length,
            lengths=lengths,
            memory_lengths=memory_lengths,
            reward_config=self.reward_config,
        )

    def _slots(self, plan: Any, pool: DevicePool) -> Any:
        """``plan`` (device ids) over ``pool``'s slots; devices that left it sit past the
        last slot, in ``self._gone``'s order."""
        self._gone = [d for d in sorted(plan.devices) if d not in pool.ids]
        return pool.to_slots(to_planner_plan(plan), gone=self._gone)

    def _new_replanner(self, work: Workload, cluster: ClusterSpec, plan: Plan) -> None:
        eff = self.stages.calibrator.fit()
        a = self.cfg.adapt
        self.replanner = make_replanner(
            PolicySpec(a.policy, a.gamma, a.every_k),
            work,
            cluster,
            plan=plan,
            eff=eff,
            length_threshold=a.length_drift,
            calibrator=self.stages.calibrator,
            join_horizon_steps=a.join_horizon_steps,
            min_steps_between=a.min_steps_between,
        )
        self._initial = (work, cluster, plan, eff)

    def _on_boundary(self, step: int, priced: dict[Any, tuple[float, int]], **given: Any) -> Any:
        """``Replanner.on_boundary``, and the boundary's report on the tap (a ``boundary``
        event: ``nereus.planner.replay`` runs the decisions again from these)."""
        rp = self.replanner
        assert rp is not None
        eff = rp.eff
        outcome = rp.on_boundary(step, **given)
        record = boundary_record(
            rp,
            outcome,
            eff=eff,
            lost=given.get("lost", ()),
            drained=given.get("drained", ()),
            joined=given.get("joined", ()),
            priced={p: s for p, (s, _) in priced.items()},
            first=not self.boundaries,
            initial=self._initial,
        )
        self.boundaries.append(record)
        _emit("boundary", **record)
        return outcome

    def _cap_lengths(self, step: int) -> LengthStats:
        cap = self.cfg.sampling.cap_at(step)
        return LengthStats(float(cap), float(cap), cap)

    def take_counts(self) -> dict[str, list[int]] | None:
        """The update counters read at the last boundary (what the next step starts
        from), once; None when none are kept (no boundary yet, or a fault since)."""
        counts, self._counts = self._counts, None
        return counts

    # --- the boundary -----------------------------------------------------------------

    async def after_step(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The boundary after the step of ``record``: calibrate, trigger, search, admit,
        and execute an admitted change before the next step. Returns the decision (a
        dict, as on the tap) when a trigger fired, else None."""
        stages = self.stages
        step = int(record["step"])
        nxt = step + 1
        self._counts = None
        await self.settle()
        self.prompt_length = max(self.prompt_length, int(record.get("prompt_len_max", 1)))
        mean = float(record["response_len_mean"])
        longest = int(record["response_len_max"])
        p95 = min(max(float(record.get("response_len_p95", longest)), mean), longest)
        ran = LengthStats(mean, p95, max(1, longest))
        self._lengths = ran
        pool_before = self.pool
        if self.replanner is None:
            self._new_replanner(
                self._workload(ran),
                self._cluster_spec(len(pool_before)),
                self._slots(stages.plan, pool_before),
            )
        rp = self.replanner
        if self._calibrate_next:
            self._calibrate(record, ran, pool_before)
        self._calibrate_next = True
        # the pool now, what pricing a change needs and the update counters, read at once
        # (independent reads; the counters are the next step's, as a change keeps them)
        _, inputs, self._counts = await asyncio.gather(
            stages.cluster.refresh_devices(), stages.change_inputs(), update_counts(stages)
        )
        live, draining = await usable_devices(stages.cluster, self.cfg.adapt.pool_wait_s)
        lost = sorted(set(pool_before.ids) - live)
        drained = sorted(set(pool_before.ids) & draining)
        self.pool = DevicePool.of(sorted(live - draining))
        joined = sorted(set(self.pool.ids) - set(pool_before.ids))
        if joined:
            await stages.ensure_hosts(set(joined))
            inputs = await stages.change_inputs()  # the new hosts' ledgers too
        cap = self._cap_lengths(nxt)
        rp.work = self._workload(ran, cap)
        priced: dict[Any, tuple[float, int]] = {}

        def price(current: Any, target: Any) -> float:
            seconds, nbytes = stages.estimate_change(
                from_planner_plan(self.pool.to_devices(target)), inputs
            )
            priced[target] = (seconds, nbytes)
            return seconds

        outcome = self._on_boundary(
            nxt,
            priced,
            lengths=ran,
            memory_lengths=cap,
            cluster=self._cluster_spec(len(self.pool)),
            plan=self._slots(stages.plan, self.pool),
            lost=lost,
            drained=drained,
            joined=joined,
            transition_seconds=price,
        )
        if not outcome.triggers:
            return None
        return await self._act(nxt, outcome, priced)

    async def after_fault(self, step: int, dead: list[int]) -> dict[str, Any]:
        """Replan at once after workers died (``nereus.job.recovery.forget_dead`` brought
        the job to its intact EMUs): the dead devices are a hard trigger, the target is
        searched on the pool that is left and reached from what survived; model-stages
        without an intact EMU are built at their target placement. Returns the decision."""
        stages = self.stages
        self._counts = None
        # a change that ran beside the step: ended before this (``forget_dead`` waited)
        await self.settle()
        await stages.cluster.refresh_devices()
        live, draining = await usable_devices(stages.cluster, self.cfg.adapt.pool_wait_s)
        self.pool = DevicePool.of(sorted(live - draining))
        # the job's plan as the planner sees it: what survived, and where the lost
        # model-stages were (on devices that are gone: the plan cannot run)

        current = Plan(
            tuple(
                (name, stages.plan[name] if name in stages.plan.names else sp)
                for name, sp in self._full_plan
            )
        )
        lengths = self._lengths or self._cap_lengths(step)
        cap = self._cap_lengths(step)
        if self.replanner is None:
            self._new_replanner(
                self._workload(lengths),
                self._cluster_spec(len(self.pool)),
                self._slots(current, self.pool),
            )
        rp = self.replanner
        rp.work = self._workload(lengths, cap)
        inputs = await stages.change_inputs()
        priced: dict[Any, tuple[float, int]] = {}

        def price(_: Any, target: Any) -> float:
            seconds, nbytes = stages.estimate_change(
                from_planner_plan(self.pool.to_devices(target)), inputs
            )
            priced[target] = (seconds, nbytes)
            return seconds

        outcome = self._on_boundary(
            step,
            priced,
            lengths=lengths,
            memory_lengths=cap,
            cluster=self._cluster_spec(len(self.pool)),
            plan=self._slots(current, self.pool),
            lost=sorted(dead),
            transition_seconds=price,
        )
        self._calibrate_next = False
        decision = await self._act(step, outcome, priced)
        require(
            decision is not None and decision.get("admitted"),
            "recovery",
            decision and decision.get("reason"),
            "must reach a runnable plan after the fault",
        )
        return decision

    async def _act(
        self, nxt: int, outcome: Any, priced: dict[Any, tuple[float, int]]
    ) -> dict[str, Any]:
        """The decision event of a boundary where something fired, and the change when admitted."""
        stages = self.stages
        decision = self._decision_event(nxt, outcome, priced)
        self.decisions.append(decision)
        _emit("decision", **decision)
        d = outcome.decision
        if d.action == "restart":
            raise StateError(f"step {nxt}: no change reaches a runnable plan ({d.reason})")
        if d.admitted and d.target is not None:
            target = from_planner_plan(self.pool.to_devices(d.target.plan))
            report = await stages.apply_plan(target, overlap=self.cfg.adapt.overlap)
            self._calibrate_next = False  # the next step ran beside it or after it: not settled
            predicted = priced.get(d.target.plan, (float(report.get("predicted_seconds", 0.0)), 0))[
                0
            ]
            change = Change(
                nxt,
                [f"{t['kind']}:{t['detail']}" for t in decision["triggers"]],
                report["from"],
                report["to"],
                float(predicted),
                float(report.get("seconds", 0.0)),
                int(report.get("bytes", 0)),
                d.reason,
                report,
                overlapped=bool(report.get("overlapped", False)),
            )
            decision["transition"] = change.as_record()
            if change.overlapped:
                # it runs beside step nxt; ``settle`` completes the record once it ended
                self._overlapped = (change, decision["transition"])
            else:
                self._changed(change)
        return decision

    @property
    def overlapping(self) -> bool:
        """Whether a change started at a boundary runs beside the next step (its record,
        ``decision["transition"]``, is complete once ``settle`` returned)."""
        return self._overlapped is not None

    async def settle(self) -> None:
        """Wait for a change that runs beside the step (none: return at once) and complete
        its record: measured seconds, ``ok``. Raises what the change raised (its record
        says ``ok: false``); a change already waited for elsewhere (``forget_dead``
        after a fault) is completed from its report."""
        if self._overlapped is None:
            return
        change, record = self._overlapped
        try:
            await self.stages.transition_done()
        finally:
            self._overlapped = None
            report = change.report
            change.ok = bool(report.get("ok", False))
            change.measured_seconds = float(report.get("seconds", 0.0))
            record.update(change.as_record())
            if change.ok:
                self._changed(change)
            else:
                log.warning("step %d: the change that ran beside it failed", change.step)

    def _changed(self, change: Change) -> None:
        self.changes.append(change)
        log.info(
            "step %d: %s -> changed the plan (%d bytes, %.3f s%s; predicted %.3f s)",
            change.step,
            change.triggers,
            change.bytes,
            change.measured_seconds,
            ", beside the step" if change.overlapped else "",
            change.predicted_seconds,
        )
        self._full_plan = self.stages.plan

    def _calibrate(self, record: dict[str, Any], ran: LengthStats, pool: DevicePool) -> None:
        """What the step measured, against the model of the plan it ran on."""
        rp = self.replanner
        assert rp is not None
        measured = {
            PLANNER_NAMES[s]: float(v)
            for s, v in (record.get("model_stage_seconds") or {}).items()
            if s in PLANNER_NAMES and PLANNER_NAMES[s] in rp.plan.names and v > 0
        }
        if measured:
            rp.observe_stage_seconds(measured)
        peaks = {
            pool.slot(int(d)): int(b)
            for d, b in (record.get("device_peak_bytes") or {}).items()
            if int(d) in pool.ids
        }
        if peaks:
            # the KV cache is as long as the step's cap; training pads to the longest response
            cap = int(record.get("max_new_tokens", ran.max))
            shapes = LengthStats(float(ran.max), float(ran.max), max(cap, ran.max))
            rp.observe_device_peaks(peaks, lengths=shapes)

    def _decision_event(
        self, step: int, outcome: Any, priced: dict[Any, tuple[float, int]]
    ) -> dict[str, Any]:
        d = outcome.decision
        considered = d.target if d.target is not None else d.candidate
        seconds, nbytes = (
            priced.get(considered.plan, (math.inf, 0)) if considered is not None else (math.inf, 0)
        )
        triggers = []
        for t in outcome.triggers:
            info = {k: (list(v) if isinstance(v, tuple) else v) for k, v in t.info.items()}
            if (
                t.kind == "memory"
            ):  # the planner's slots -> device ids (pool changes name ids already)
                info["devices"] = [self._device_of(s) for s in info.get("devices", [])]
                info["device"] = self._device_of(info.get("device"))
            triggers.append(
                {"kind": t.kind, "signal": t.signal, "hard": t.hard, "text": t.detail, **info}
            )
        return {
            "step": step,
            "triggers": triggers,
            "current_plan": self.stages.plan.to_dict(),
            "target_plan": self._plan_dict(considered.plan) if considered is not None else None,
            "current_step_seconds": _finite(outcome.current_seconds),
            "target_step_seconds": _finite(considered.step_seconds)
            if considered is not None
            else None,
            "saving_seconds": _finite(d.saving_seconds)
            if d.saving_seconds
            else (
                _finite(outcome.current_seconds - considered.step_seconds)
                if considered is not None and outcome.current_seconds is not None
                else None
            ),
            "transition_seconds": _finite(seconds),
            "transition_bytes": int(nbytes),
            "payback_steps": _finite(d.payback_steps),
            "limit_steps": _finite(d.limit_steps),
            "admitted": d.admitted,
            "action": d.action,
            "reason": d.reason,
        }

    def _device_of(self, slot: Any) -> Any:
        slot = int(slot)
        return (
            self.pool.device(slot) if slot < len(self.pool) else self._gone[slot - len(self.pool)]
        )

    def _plan_dict(self, plan: Any) -> dict[str, Any] | None:
        return None if plan is None else from_planner_plan(self.pool.to_devices(plan)).to_dict()


def _emit(type_: str, **fields: Any) -> None:
    emit(type_, **fields)
