"""Adaptation in asynchronous mode: at weight syncs, move devices between generation and
training when the planner's pipeline price says it pays.

``AsyncAdapter(run).after_update(record)`` runs after every update's weight sync (the
async mode's safe boundary). Trigger: the mean response length (last few updates) or the
cap drifting past ``adapt.length_drift`` (relative) from its value at the last decision
(reset at every decision, taken or not). On a trigger it prices the split the job runs
now and the best one (``nereus.planner.async_cost.search_async``: the slower side plus
the sync, per update; the model's saving scaled by measured over predicted seconds per
update at the current split) and the change (``ClusterStages.estimate_change``: the DAG's
estimate plus engine restarts). Admission is the sync mode's rule: saving > 0 and
``change seconds / saving <= adapt.gamma * H``, H the updates left. An admitted change
pauses the producers at their next decode call (finished groups stay in the buffer;
unfinished ones restart after it, counted as ``restarted_groups``), runs
``RLJob.apply_plan`` (the same transition DAG as sync mode) and resumes the producers on
the new generation EMUs after a weight sync. A ``decision`` event goes on the tap.

Not handled here (sync mode's controller does them): device-pool changes (drain, join)
and the memory trigger.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from nereus.actors import emit
from nereus.job.adapt import job_workload
from nereus.job.config import from_planner_plan
from nereus.planner import LengthStats, local_cpu_cluster_probed
from nereus.planner.async_cost import search_async
from nereus.planner.relabel import relabel

__all__ = ["AsyncAdapter"]

log = logging.getLogger("nereus.rl")

WINDOW = 4  # updates the length signal is averaged over


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
        self.changes: list[dict[str, Any]] = []

    def _drifted(self, length: float, cap: int) -> bool:
        if self.reference is None:
            return True  # the first boundary prices the starting split
        ref_len, ref_cap = self.reference
        limit = self.cfg.adapt.length_drift
        return (
            abs(length - ref_len) > limit * max(ref_len, 1.0)
            or abs(cap - ref_cap) > limit * ref_cap
        )

    async def after_update(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Decide at this weight sync; returns the executed change's report, or None."""
        self.lengths.append(float(record["response_len_mean"]))
        self.update_s.append(float(record["update_seconds"]))
        length = statistics.fmean(self.lengths[-WINDOW:])
        step = self.job.step
        cap = self.cfg.sampling.cap_at(step)
        if not self._drifted(length, cap):
            return None
        self.reference = (length, cap)
        st = self.stages
        plan = st.plan
        devices = len(plan.devices)
        lengths = LengthStats(length, float(max(record["response_len_max"], length)), cap)
        work = job_workload(
            self.cfg,
            st.model_config,
            prompt_length=self.prompt_length,
            lengths=lengths,
            memory_lengths=LengthStats(float(cap), float(cap), cap),
        )
        budget = min((d.memory_bytes for d in st.cluster.devices), default=2**30)
        cluster = local_cpu_cluster_probed(devices, budget, headroom=self.cfg.adapt.headroom)
        eff = st.calibrator.fit()
        now_g = len(plan["policy_generation"].devices)
        current = search_async(work, cluster, eff, generation_devices=now_g)
        best = search_async(work, cluster, eff)
        decision: dict[str, Any] = {
            "step": step,
            "triggers": [{"kind": "drift", "detail": "length", "length": length, "cap": cap}],
            "current_plan": plan.to_dict(),
            "current_step_seconds": current.step_seconds,
            "target_step_seconds": best.step_seconds,
            "admitted": False,
            "target_plan": None,
            "action": "keep",
        }
        # the model's seconds against what updates take here: the saving in measured seconds
        measured = statistics.fmean(self.update_s[-WINDOW:])
        scale = measured / current.step_seconds if current.step_seconds > 0 else 1.0
        saving = (current.step_seconds - best.step_seconds) * scale
        decision["measured_step_seconds"] = measured
        if best.generation_devices == now_g or saving <= 0:
            decision["reason"] = "the current split is the planner's best"
            emit("decision", **decision)
            return None
        target = relabel(plan, from_planner_plan(best.plan), devices=devices)
        inputs = await st.change_inputs()
        seconds, nbytes = st.estimate_change(target, inputs)
        horizon = self.cfg.run.steps - step
        limit = self.cfg.adapt.gamma * horizon
        payback = seconds / saving
        admitted = payback <= limit
        decision.update(
            target_plan=target.to_dict(),
            saving_seconds=saving,
            transition_seconds=seconds,
            transition_bytes=nbytes,
            payback_steps=payback,
            limit_steps=limit,
            admitted=admitted,
            action="transition" if admitted else "keep",
            reason=f"generation {now_g} -> {best.generation_devices} devices saves "
            f"{saving:.4f} s per "
            f"update; pays back in {payback:.1f} of {limit:.1f} updates",
        )
        if not admitted:
            emit("decision", **decision)
            return None
        t0 = time.perf_counter()
        await self.run.pause()
        report = await self.job.apply_plan(target)
        await self.run.resume()
        change = {
            "step": step,
            "triggers": ["drift:length"],
            "from": plan.to_dict(),
            "to": target.to_dict(),
            "predicted_seconds": seconds,
            "measured_seconds": time.perf_counter() - t0,
            "bytes": report.get("bytes", 0),
            "generation_devices": [now_g, best.generation_devices],
        }
        decision["transition"] = change
        emit("decision", **decision)
        self.changes.append(change)
        log.info(
            "async: generation %d -> %d devices at update %d (%s)",
            now_g,
            best.generation_devices,
            step,
            decision["reason"],
        )
        return change
