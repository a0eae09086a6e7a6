"""Asynchronous RL: generation runs continuously while training consumes finished entries.

``AsyncRun(job).run()`` drives a started ``RLJob`` on a cluster (``[rl] mode = "async"``),
for GRPO, ReMax and PPO. A buffer entry is a GRPO group, a ReMax group with its greedy
baseline row, or one PPO sample (``nereus.job.async_update``); the rules below are in
entries.

- Generation and weight syncs: one producer task per policy-generation EMU, started with
  ``asyncio.create_task`` and never awaited by the training loop; the trainer publishes
  each version into a snapshot and goes on, each EMU takes it itself
  (``nereus.job.async_generation``).
- Training: for update u it waits only for a batch (``AsyncLedger.batch_for``): B finished
  entries in order, plus any entry whose staleness deadline is u. It trains them
  (``nereus.job.async_update``: proximal log-probs, the algorithm's advantages, the
  decoupled objective, PPO's critic) and advances the version.
- A generation worker that dies loses only its unfinished groups: they are issued again
  from the same positions (``regenerated_groups`` on the tap); the run goes on with the
  EMUs left, and with ``[adapt]`` the next weight sync prices rebuilding it on a spare or
  joined device (``nereus.job.async_adapt``: also drains, joins and the memory trigger).
  Checkpoints hold the ledger, so a resumed run trains the same positions.
- With ``[adapt]``, a death on the training side (an update, its proximal log-probs, a
  weight sync, a checkpoint) or of every generation EMU is recovered from as in sync mode
  (``nereus.job.async_recovery``); without it the run stops (``GenerationLost`` when
  generation is gone).

Generation runs on the built-in engine or on vLLM (``sampling.engine = "vllm"``), which
runs a request whole: its weights change only between requests, so it takes
``partial_rollout = false`` and no refill.

Refuses (``ConfigError``, checked by the job config): generation sharing a device with
another model-stage, a reward model, the in-process backend, vLLM with partial rollouts
or refill.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nereus.actors import emit
from nereus.job.async_adapt import AsyncAdapter
from nereus.job.async_generation import Generation, PublishGate, Worker
from nereus.job.async_recovery import AsyncRecovery, GenerationLost, ledger_state
from nereus.job.async_update import EntryShape, train_entries, update_record
from nereus.job.export import latest_checkpoint
from nereus.job.recovery import is_fault
from nereus.planner.plan import Plan, StagePlan
from nereus.rl.async_buffer import AsyncLedger, Group

__all__ = ["AsyncRun"]

log = logging.getLogger("nereus.rl")


class AsyncRun(Generation):
    """See the module docstring."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.cfg = job.cfg
        self.stages = job.stages
        self.mode = job.cfg.rl
        a = job.cfg.algorithm
        self.shape = EntryShape.of(a)
        # B entries per update; K sampled rows per entry
        self.B, self.K = a.prompts_per_step * self.shape.per_prompt, self.shape.samples
        start = job.dataset.position * self.shape.per_prompt
        self.ledger = AsyncLedger(
            self.B,
            self.mode.max_staleness,
            start,
            start + (job.cfg.run.steps - job.step) * self.B,
            origin=start - job.step * self.B,
        )
        self.version = job.step
        self.published = -1  # the version the training devices' snapshots hold
        self.gate = PublishGate()
        self.snapshots: dict[int, list[str]] = {}  # device -> snapshot stores on it
        self.changed = asyncio.Condition()
        self.train_lock = asyncio.Lock()
        self.workers: list[Worker] = []
        self.tasks: list[asyncio.Task] = []
        self.records: list[dict[str, Any]] = []
        self.regenerated_rows = 0
        self.decode_calls = 0  # advance_rollout calls of every producer
        self.refilled_entries = 0  # entries placed into an open request's done slots
        self._prompt_width: int | None = None  # room a refilling request keeps for prompts
        self.lost_workers: list[tuple[str, list[int]]] = []  # (EMU, devices) of dead producers
        # per trained entry: (update version, entry, sample index, token versions of every row
        # the update used: the trained rows, then ReMax's baseline row)
        self.trained_log: list[tuple[int, int, int, list[list[int]]]] = []
        self.t0 = time.perf_counter()
        self.pausing = False  # producers stop at their next decode call (a plan change)
        self.adapter: Any = None  # nereus.job.async_adapt.AsyncAdapter with [adapt] enabled
        self.recovery: AsyncRecovery | None = None  # with [adapt] enabled, as in sync mode
        self.training: list[Group] = []  # the batch of the update in flight
        self._resume_ledger()

    def _resume_ledger(self) -> None:
        if not self.cfg.run.resume:
            return
        ckpt = latest_checkpoint(self.job.out_dir)
        if ckpt is None:
            return
        state = ledger_state(
            json.loads((ckpt / "job.json").read_text()),
            self.B,
            self.cfg.run.steps,
            self.shape.per_prompt,
        )
        self.ledger.end = int(state["end"])
        self.ledger.load_state_dict(state)

    # --- training ---------------------------------------------------------------------

    async def _batch(self) -> list[Group]:
        async with self.changed:
            while True:
                for t in self.tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                batch = self.ledger.batch_for(self.version)
                if batch is not None:
                    return batch
                if not any(w.alive for w in self.workers):
                    raise GenerationLost(
                        "every policy-generation EMU died; the async run cannot go on "
                        "(with [adapt] enabled it rebuilds generation on the devices left)"
                    )
                try:
                    await asyncio.wait_for(self.changed.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass  # look at the producers again

    async def _update(self, groups: list[Group]) -> dict[str, Any]:
        st = self.stages
        async with self.train_lock:
            rollouts, record = await train_entries(
                st,
                self.cfg.algorithm,
                groups,
                self.job.codec.pad_id,
                self.mode.importance_cap,
            )
            record["staleness_histogram"] = await self.commit(groups)
            publish = await self._publish()
            record["publish_seconds"], record["publish_bytes"] = (
                publish["seconds"],
                publish["bytes"],
            )
        record.update(update_record(rollouts, groups))
        record["max_staleness_seen"] = max(int(s) for s in record["staleness_histogram"])
        return record

    async def commit(self, groups: list[Group]) -> dict[str, int]:
        """``groups`` were trained by update ``self.version``: the ledger says so and the
        version advances. Returns their staleness histogram (tokens per staleness)."""
        async with self.changed:
            hist = self.ledger.commit(groups, self.version)
            self.trained_log += [
                (self.version, g.position, g.sample_index, g.used_versions) for g in groups
            ]
            self.version += 1
            self.stages.policy_version = self.version
            self.changed.notify_all()
        return {str(s): n for s, n in hist.items()}

    async def _checkpoint(self) -> None:
        job = self.job
        folder = job.out_dir / "checkpoints" / f"step_{job.step}"
        # the dataset's position counts prompts; the ledger's, entries
        position = self.shape.prompts_before(self.ledger.next_new)
        self.stages.sample_position = position
        await self.stages.save(folder)
        state = {
            "step": job.step,
            "dataset": {**job.dataset.state_dict(), "position": position},
            "policy_version": self.version,
            "async": self.ledger.state_dict(),
        }
        (folder / "job.json").write_text(json.dumps(state))
        job._checkpoints.append(folder)

    def _drop_dead(self) -> None:
        """Forget generation EMUs whose worker died (their devices' hosts too), so the
        stages' own calls (checkpoints, close) skip them."""
        st = self.stages
        dead = [w for w in self.workers if not w.alive]
        if not dead or len(dead) == len(self.workers):
            return  # every one died: the model-stage is rebuilt (GenerationLost) or the run ends
        names = {w.name for w in dead}
        st.emus["policy_generation"] = [
            e for e in st.emus["policy_generation"] if e.name not in names
        ]
        handle = st.handles["policy_generation"]
        handle.emus = [e for e in handle.emus if e.name not in names]
        for w in dead:
            for d in w.emu.devices:
                st.hosts.pop(d, None)
        emus = st.emus["policy_generation"]
        sp = StagePlan(
            emus[0].layout.tp, emus[0].layout.pp, len(emus), tuple(e.devices for e in emus)
        )
        st._plan = Plan(tuple((n, sp if n == "policy_generation" else p) for n, p in st.plan))
        self.workers = [w for w in self.workers if w.alive]

    async def pause(self, *, after_fault: bool = False) -> None:
        """Stop every producer at its next decode call (unfinished groups go back to the
        ledger, finished ones stay in the buffer); ``resume`` starts them again.
        ``after_fault``: a producer that a worker's death stopped is not an error, and
        what it had in flight is issued again (``regenerated_groups``)."""
        self.pausing = True
        async with self.changed:
            self.changed.notify_all()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for t in self.tasks:
            e = None if t.cancelled() else t.exception()
            if e is not None and not (after_fault and is_fault(e)):
                raise e
            if e is not None:
                log.warning("producer %s stopped by a worker's death: %s", t.get_name(), e)
        if after_fault:
            async with self.changed:
                self.regenerated_rows += len(self.ledger.in_flight) * self.K
                self.ledger.lose(sorted(self.ledger.in_flight))
        for w in self.workers:
            if w.group is not None:
                await w.group.destroy()
        self.workers, self.tasks = [], []
        await self._drop_snapshots(after_fault=after_fault)

    async def resume(self) -> None:
        """Producers over the generation EMUs the job has now, each first given the
        newest weights (published again: policy-training may have moved)."""
        self.pausing = False
        await self._publish()
        await self._make_workers()
        async with self.train_lock:
            for w in self.workers:
                async with w.lock:
                    await self._sync_worker(w)
        self.tasks = [
            asyncio.create_task(self._produce(w), name=f"generate-{w.name}") for w in self.workers
        ]

    async def _next_update(self) -> dict[str, Any]:
        """Wait for the next batch and train it (its weight sync too); the update's record."""
        job = self.job
        t0 = time.perf_counter()
        self.training = []
        groups = await self._batch()
        waited = time.perf_counter() - t0
        self.training = groups
        record = await self._update(groups)
        self.training = []
        record.update(
            {
                "step": job.step,
                "wait_seconds": waited,
                "update_seconds": time.perf_counter() - t0,
                "wall_seconds": time.perf_counter() - self.t0,
                "regenerated_groups": self.ledger.regenerated_groups,
                "generation_busy_seconds": {w.name: round(w.busy_s, 4) for w in self.workers},
            }
        )
        job.step += 1
        self._drop_dead()
        return record

    async def _adapt(self, record: dict[str, Any]) -> None:
        """The adapter at this weight sync. With every generation EMU dead, first
        ``GenerationLost``: the recovery rebuilds them, or (without ``[adapt]``) the run
        ends here."""
        if not any(w.alive for w in self.workers):
            raise GenerationLost(
                f"every policy-generation EMU died by update {record['step']}; the async run "
                "cannot go on (with [adapt] enabled it rebuilds generation on the devices left)"
            )
        if self.job.step < self.cfg.run.steps:
            change = await self.adapter.after_update(record)
            if change is not None:
                record["transition"] = change

    async def _after(self, record: dict[str, Any]) -> None:
        """The job's boundary hooks, then a checkpoint when one is due."""
        job, every = self.job, self.cfg.run.checkpoint_every
        for hook in job.boundary_hooks:
            await hook(job, record)
        if (every and job.step % every == 0) or job.step == self.cfg.run.steps:
            await self._checkpoint()

    async def run(
        self, on_record: Callable[[dict[str, Any]], Any] = lambda r: None
    ) -> list[dict[str, Any]]:
        """The remaining updates (each record also to ``on_record`` and the job's
        records); returns their records. With ``[adapt]`` a worker's death is recovered
        from (``nereus.job.async_recovery``): an update it stopped is redone or kept."""
        job, cfg = self.job, self.cfg
        await self._publish()
        await self._make_workers()
        self.tasks = [
            asyncio.create_task(self._produce(w), name=f"generate-{w.name}") for w in self.workers
        ]
        if cfg.adapt.enabled:
            self.adapter = AsyncAdapter(self)
            self.recovery = AsyncRecovery(self)
        guarded = self.recovery.guarded if self.recovery is not None else _unguarded
        try:
            while job.step < cfg.run.steps:
                record = await guarded(self._next_update, "update")
                if record is None:
                    continue  # a worker died: the update was redone or kept, or the run rewound
                if self.adapter is not None or not any(w.alive for w in self.workers):
                    await guarded(lambda r=record: self._adapt(r), "boundary")
                    if record["step"] >= job.step:
                        continue  # a checkpoint before this update was restored: it is redone
                emit(
                    "step",
                    step=record["step"],
                    stage_seconds={
                        "train": record["train_seconds"],
                        "wait": record["wait_seconds"],
                    },
                    tokens=record["tokens_generated"],
                    reward=record["reward_mean"],
                    response_length_tokens=record["response_len_mean"],
                    max_new_tokens=cfg.sampling.cap_at(job.step),
                    policy_version=record["policy_version"],
                    staleness_histogram=record["staleness_histogram"],
                    importance_weight_mean=record.get("importance_weight_mean", 1.0),
                    importance_clipped_frac=record.get("importance_clipped_frac", 0.0),
                    behaviour_kl=record.get("behaviour_kl", 0.0),
                    regenerated_groups=self.ledger.regenerated_groups,
                )
                self.records.append(record)
                job.records.append(record)
                on_record(record)
                await guarded(lambda r=record: self._after(r), "boundary")
        finally:
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for w in self.workers:
                if w.group is not None:
                    await w.group.destroy()
            await self._drop_snapshots(after_fault=True)
        return self.records

    @property
    def summary(self) -> dict[str, Any]:
        """What the run did as a whole: staleness histogram, discarded and regenerated work,
        generation's decode calls and the entries refilled into open requests."""
        trained = len(self.ledger.trained)
        return {
            "staleness_histogram": {str(k): v for k, v in sorted(self.ledger.staleness.items())},
            "max_staleness_seen": max(self.ledger.staleness, default=0),
            "samples_trained": trained * self.K,
            "samples_discarded": len(self.ledger.finished) * self.K,
            "regenerated_groups": self.ledger.regenerated_groups,
            "regenerated_samples": self.regenerated_rows,
            "restarted_groups": self.ledger.restarted_groups,
            "rewound_groups": self.recovery.rewound_groups if self.recovery is not None else 0,
            "plan_changes": len(self.adapter.changes) if self.adapter is not None else 0,
            "decode_calls": self.decode_calls,
            "weight_syncs": sum(w.syncs for w in self.workers),
            "weight_sync_seconds": round(sum(w.sync_s for w in self.workers), 4),
            "refilled_entries": self.refilled_entries,
        }


async def _unguarded(work: Callable[[], Awaitable[Any]], during: str) -> Any:
    """``work`` as it is: without ``[adapt]`` a worker's death ends the run."""
    return await work()
