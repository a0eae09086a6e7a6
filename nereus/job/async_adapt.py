"""Adaptation in asynchronous mode: at weight syncs, move devices between generation and
training when the planner's pipeline price says it pays, and follow the device pool.

``AsyncAdapter(run).after_update(record)`` runs after every update's weight sync (the
async mode's safe boundary). It reads the pool (``usable_devices``: live devices less
those draining) and fires on:

- ``drain`` (hard): a device of the plan is draining; the plan must leave it.
- ``memory`` (hard): the plan's devices would not hold the next update's length cap
  (``nereus.planner.explain`` at the cap, the model's headroom; with ``[trace] lengths``
  the largest cap of the steps generation may run ahead to, ``AsyncRun.request_cap``).
- ``join`` / ``fault`` (soft): a device joined the pool, or a generation EMU died since
  the last boundary (the run went on with the EMUs left); the best split over the pool
  may rebuild the lost EMU on a spare or a joined device.
- ``drift`` (soft): the mean response length (last few updates whose batches were
  generated wholly at the current cap) or that cap drifted past ``adapt.length_drift``
  (relative) from its value at the last decision.
- ``lost`` (hard, ``after_fault``): a worker died on the training side or every
  generation EMU did; called by ``nereus.job.async_recovery`` with the producers stopped,
  it adopts the best split over the devices left and builds what has no intact EMU.

Each prices the current split and the best split over the pool (``search_async``: the
slower of generation plus the sync and training plus the publish, on the devices' CPU
cores where they have a limit; the
saving scaled by measured over predicted seconds per update at the current split) and
the change (``ClusterStages.estimate_change``). A hard trigger adopts the best split on
the usable pool; a soft one is admitted by the sync mode's rule: saving > 0 and
``change seconds / saving <= adapt.gamma * H``, H the updates left. An admitted change
pauses the producers at their next decode call (finished groups stay in the buffer;
unfinished ones restart after it, counted as ``restarted_groups``), runs
``RLJob.apply_plan`` (the same transition DAG as sync mode; a drained device's worker
stops after it) and resumes the producers on the new generation EMUs after a weight
sync. A ``decision`` event goes on the tap for every trigger.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from nereus.actors import emit
from nereus.errors import InfeasiblePlan, StateError
from nereus.job.adapt import usable_devices
from nereus.job.config import from_planner_plan, to_planner_plan
from nereus.job.workload import job_workload
from nereus.planner import LengthStats, explain, local_cpu_cluster_probed
from nereus.planner.async_cost import search_async
from nereus.planner.plan import Plan
from nereus.planner.pool import DevicePool
from nereus.planner.relabel import relabel

__all__ = ["AsyncAdapter"]

log = logging.getLogger("nereus.rl")

WINDOW = 4  # updates the length signal is averaged over
HARD = ("drain", "memory", "lost")


class AsyncAdapter:
    """See the module docstring."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.job = run.job
        self.cfg = run.cfg
        self.stages = run.stages
        self.prompt_length = self.job.max_prompt_tokens()
        self.reference: tuple[float, int] | None = None  # (mean length, cap) at the last decision
        self.lengths: list[float] = []
        self.update_s: list[float] = []
        self.window_cap: int | None = None  # the cap the updates in the window ran at
        self.measured = 0.0  # seconds per update over the window
        self.changes: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self.pool_ids: set[int] = set(self.stages.plan.devices)  # the pool at the last boundary
        self.lost_seen = 0  # generation EMUs that died, as counted at the last boundary
        self.priced: LengthStats | None = None  # the lengths the last boundary priced

    def _drifted(self, length: float, cap: int) -> bool:
        if self.reference is None:
            return True  # the first boundary prices the starting split
        ref_len, ref_cap = self.reference
        limit = self.cfg.adapt.length_drift
        return (
            abs(length - ref_len) > limit * max(ref_len, 1.0)
            or abs(cap - ref_cap) > limit * ref_cap
        )

    def _cluster(self, pool: DevicePool) -> Any:
        """The pool as the planner sees it: its devices' memory and, where they have a CPU
        limit, their cores (a pool of unlike limits priced at the smallest)."""
        st = self.stages
        budget = min((d.memory_bytes for d in st.cluster.devices), default=2**30)
        cores = st.device_cores(list(pool.ids))
        if cores is not None:
            cores = [min(cores)] * len(pool)
        return local_cpu_cluster_probed(
            len(pool), budget, headroom=self.cfg.adapt.headroom, device_cores=cores
        )

    async def _pool(self) -> tuple[DevicePool, list[Any]]:
        """The usable pool now and what fired on it since the last boundary."""
        st = self.stages
        await st.cluster.refresh_devices()
        live, draining = await usable_devices(st.cluster, self.cfg.adapt.pool_wait_s)
        pool = DevicePool.of(sorted(live - draining))
        in_plan = set(st.plan.devices)
        triggers: list[dict[str, Any]] = []
        drained = sorted(in_plan & set(draining))
        if drained:
            triggers.append({"kind": "drain", "detail": "pool", "devices": drained})
        joined = sorted(set(pool.ids) - self.pool_ids)
        if joined:
            await st.ensure_hosts(set(joined))
            triggers.append({"kind": "join", "detail": "pool", "devices": joined})
        lost = self.run.lost_workers[self.lost_seen :]
        if lost:
            self.lost_seen = len(self.run.lost_workers)
            devices = sorted({d for _, ds in lost for d in ds})
            triggers.append({"kind": "fault", "detail": "generation", "devices": devices})
        self.pool_ids = set(pool.ids)
        return pool, triggers

    async def after_update(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Decide at this weight sync; returns the executed change's report, or None."""
        step = self.job.step
        sampling = self.cfg.sampling
        ran_cap = sampling.cap_at(step - 1)
        # the window holds only batches generated wholly at one cap, the last update's: a
        # batch whose oldest tokens came under an older cap (generation runs ahead of
        # training) or lengths under an older cap would price a mix of two regimes
        if self.window_cap != ran_cap:
            self.lengths, self.update_s, self.window_cap = [], [], ran_cap
        mixed = sampling.cap_at(int(record["policy_version"])) != ran_cap
        if not mixed:
            self.lengths.append(float(record["response_len_mean"]))
            self.update_s.append(float(record["update_seconds"]))
        length = statistics.fmean(self.lengths[-WINDOW:] or [record["response_len_mean"]])
        self.measured = statistics.fmean(self.update_s[-WINDOW:] or [record["update_seconds"]])
        cap = self.run.request_cap(step)  # the longest generation may run at: memory holds it
        st = self.stages
        plan = st.plan
        pool, triggers = await self._pool()
        # priced as measured: the window's mean, its longest, and the cap it ran at (a
        # batch decodes until its longest row); a cap that rises is priced once updates
        # ran at it, with the lengths it gave
        longest = float(max(record["response_len_max"], length))
        lengths = LengthStats(length, longest, max(ran_cap, int(longest)))
        self.priced = lengths
        work = job_workload(
            self.cfg,
            st.model_config,
            prompt_length=self.prompt_length,
            lengths=lengths,
            memory_lengths=LengthStats(float(cap), float(cap), cap),
        )
        cluster = self._cluster(pool)
        gone = [d for d in sorted(plan.devices) if d not in pool.ids]
        slots = pool.to_slots(to_planner_plan(plan), gone=gone)
        if not gone:
            over = explain(slots, work, cluster).violations
            if over:
                devices = [pool.device(m.device) for m in over]
                triggers.append({"kind": "memory", "detail": f"cap {cap}", "devices": devices})
        if not mixed and self._drifted(length, ran_cap):
            triggers.append({"kind": "drift", "detail": "length", "length": length, "cap": ran_cap})
        if not triggers:
            return None
        self.reference = (length, ran_cap)
        return await self._decide(step, triggers, work, cluster, pool, slots)

    async def after_fault(self, step: int, dead: list[int], plan: Plan) -> dict[str, Any]:
        """Replan at once after workers died (``nereus.job.recovery.forget_dead`` left the
        intact EMUs; the producers are stopped, ``nereus.job.async_recovery``): ``plan``
        is the job's plan before the fault, the dead devices a hard ``lost`` trigger. The
        best split over the pool left is adopted; model-stages without an intact EMU are
        built there. Returns the change; ``StateError`` when the pool left cannot hold
        generation apart from training."""
        st = self.stages
        pool, triggers = await self._pool()
        triggers.insert(0, {"kind": "lost", "detail": "devices", "devices": sorted(dead)})
        cap = self.cfg.sampling.cap_at(step)
        at_cap = LengthStats(float(cap), float(cap), cap)
        work = job_workload(
            self.cfg,
            st.model_config,
            prompt_length=self.prompt_length,
            lengths=self.priced or at_cap,
            memory_lengths=at_cap,
        )
        gone = [d for d in sorted(plan.devices) if d not in pool.ids]
        slots = pool.to_slots(to_planner_plan(plan), gone=gone)
        try:
            change = await self._decide(
                step, triggers, work, self._cluster(pool), pool, slots, plan=plan, paused=True
            )
        except InfeasiblePlan as e:
            raise StateError(
                f"update {step}: devices {sorted(dead)} died and the devices left "
                f"{list(pool.ids)} cannot hold policy-generation apart from training: {e}"
            ) from e
        assert change is not None  # a hard trigger: adopted or raised
        return change

    async def _decide(
        self,
        step: int,
        triggers: list[dict[str, Any]],
        work: Any,
        cluster: Any,
        pool: DevicePool,
        slots: Any,
        *,
        plan: Plan | None = None,
        paused: bool = False,
    ) -> dict[str, Any] | None:
        """Price, admit and run a change from ``plan`` (default: the job's); ``paused``:
        the producers are stopped already and are resumed by the caller."""
        st = self.stages
        plan = st.plan if plan is None else plan
        eff = st.calibrator.fit()
        now_g = len(plan["policy_generation"].devices)
        now_n = len(plan.devices)
        hard = [t["kind"] for t in triggers if t["kind"] in HARD]
        best = search_async(work, cluster, eff)
        decision: dict[str, Any] = {
            "step": step,
            "triggers": triggers,
            "current_plan": plan.to_dict(),
            "target_step_seconds": best.step_seconds,
            "admitted": False,
            "target_plan": None,
            "action": "keep",
        }
        current = None
        if now_n <= len(pool) and now_g < now_n:
            current = search_async(work, cluster, eff, budget=now_n, generation_devices=now_g)
            decision["current_step_seconds"] = current.step_seconds
        # the model's seconds against what updates take here: the saving in measured seconds
        measured = self.measured
        decision["measured_step_seconds"] = measured
        if current is not None and current.step_seconds > 0:
            saving = (current.step_seconds - best.step_seconds) * measured / current.step_seconds
        else:
            saving = float("inf")  # the plan cannot be priced on the pool (it must leave)
        target = from_planner_plan(pool.to_devices(relabel(slots, best.plan, devices=len(pool))))
        if not hard and (target == plan or saving <= 0):
            decision["reason"] = "the current split is the planner's best"
            return self._keep(decision)
        inputs = await st.change_inputs()
        seconds, nbytes = st.estimate_change(target, inputs)
        horizon = self.cfg.run.steps - step
        limit = self.cfg.adapt.gamma * horizon
        payback = seconds / saving if saving > 0 else float("inf")
        admitted = bool(hard) or payback <= limit
        why = f"hard trigger(s) {hard}: the plan must change; " if hard else ""
        decision.update(
            target_plan=target.to_dict(),
            saving_seconds=saving if saving != float("inf") else None,
            transition_seconds=seconds,
            transition_bytes=nbytes,
            payback_steps=payback if payback != float("inf") else None,
            limit_steps=limit,
            admitted=admitted,
            action="transition" if admitted else "keep",
            reason=f"{why}generation {now_g} -> {best.generation_devices} devices of "
            f"{len(pool)}; saves {saving:.4f} s per update; pays back in {payback:.1f} of "
            f"{limit:.1f} updates",
        )
        if not admitted:
            return self._keep(decision)
        if seconds == float("inf"):
            raise StateError(
                f"update {step}: the change to {target.to_dict()} cannot run, and hard "
                f"trigger(s) {hard} need the plan to change"
            )
        t0 = time.perf_counter()
        if not paused:
            await self.run.pause()
        report = await self.job.apply_plan(target)
        if not paused:
            await self.run.resume()
        change = {
            "step": step,
            "triggers": [f"{t['kind']}:{t['detail']}" for t in triggers],
            "from": plan.to_dict(),
            "to": target.to_dict(),
            "predicted_seconds": seconds,
            "measured_seconds": time.perf_counter() - t0,
            "bytes": report.get("bytes", 0),
            "generation_devices": [now_g, best.generation_devices],
        }
        decision["transition"] = change
        emit("decision", **decision)
        self.decisions.append(decision)
        self.changes.append(change)
        log.info(
            "async: generation %d -> %d devices at update %d (%s)",
            now_g,
            best.generation_devices,
            step,
            decision["reason"],
        )
        return change

    def _keep(self, decision: dict[str, Any]) -> None:
        emit("decision", **decision)
        self.decisions.append(decision)
        return None
