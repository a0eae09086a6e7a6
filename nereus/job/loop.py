"""The RL job: the step loop the controller drives, with metrics, checkpoints and resume.

``run_job(cfg)`` (or ``await RLJob(cfg).run()``) builds the task (a synthetic one, or the
rows of ``[data]``'s file scored by ``[reward] rule``), its dataset (one global sample
order), the tokenizer, the initial model and the model-stages the plan places,
then runs ``run.steps`` steps of the configured algorithm. Each step takes the next
``prompts_per_step`` samples of the global order, runs the algorithm's step
(``nereus.rl.algorithms``) and writes one record to ``metrics.jsonl`` and the other
loggers ``run.loggers`` names (``nereus.job.loggers``); the progress bar
shows stage times, reward and lengths; the end prints a summary table and writes
``plot.png``.

Checkpoints (``run.checkpoint_every`` steps, and after the last step) hold all logical
state: policy and critic parameters, AdamW moments and update counters, the policy
version, the dataset position and the step number. Sampling seeds derive from
``(run.seed, step)``, so no RNG state needs saving. With ``run.resume`` the job starts
from the newest checkpoint in ``out_dir/checkpoints`` and takes exactly the steps the
uninterrupted job would have taken (same samples, same rollouts, same updates). A
running job that restores a checkpoint after a fault rewinds its record with it: every
step is recorded once (the redone one), and a ``rewind`` tap event names the dropped steps.

Every record carries ``boundary_seconds`` (the wall time of the boundary after its
step). A change of plan that runs beside the next step (``[adapt] overlap``) ends
within that step; the record of the boundary that started it is logged once it ended.

With ``[rl] mode = "async"`` the steps are updates of ``nereus.job.async_loop.AsyncRun``
(generation and training at once; its records carry the staleness histogram).

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nereus.actors import Cluster, emit
from nereus.config import to_dict
from nereus.data.filedata import FileTask
from nereus.data.prompts import PromptDataset
from nereus.data.rewards import load_reward
from nereus.data.tasks import Task, make_task
from nereus.data.vocab import Codec
from nereus.errors import StateError
from nereus.job.adapt import Adapter
from nereus.job.async_loop import AsyncRun
from nereus.job.cluster_stages import ClusterStages
from nereus.job.config import JobConfig
from nereus.job.export import export_checkpoint, latest_checkpoint
from nereus.job.local_stages import InProcessStages, prepare_model
from nereus.job.loggers import StepLoggers, check_loggers, make_loggers
from nereus.job.recovery import (
    Fault,
    dead_devices,
    forget_dead,
    is_fault,
    settle_updates,
    update_counts,
)
from nereus.job.report import (
    StepProgress,
    changes_summary,
    faults_table,
    plot_metrics,
    read_metrics,
    summary_table,
)
from nereus.job.traces import PoolTrace, response_lengths, with_lengths
from nereus.monitor.tap import TapRecorder
from nereus.rl.algorithms import ALGORITHMS, StepContext
from nereus.rl.stages import ModelStages

__all__ = ["RLJob", "run_job", "latest_checkpoint"]

log = logging.getLogger("nereus.rl")


class RLJob:
    """One RL job (see the module docstring)."""

    def __init__(self, cfg: JobConfig) -> None:
        cfg = with_lengths(cfg)  # [trace] lengths: the cap follows the trace
        self.cfg = cfg
        self.out_dir = Path(cfg.run.out_dir)
        check_loggers(cfg.run.loggers)
        self.task: Task
        if cfg.data is not None:
            task = FileTask.load(cfg.data, load_reward(cfg.reward.rule))
            self.task = task
            self.dataset = PromptDataset(
                task,
                size=len(task),
                seed=cfg.run.seed,
                shuffle=cfg.data.shuffle,
                fingerprint=task.fingerprint,
            )
        else:
            self.task = make_task(cfg.task.name, **cfg.task.options)
            self.dataset = PromptDataset(self.task, size=cfg.task.dataset_size, seed=cfg.run.seed)
        self.codec: Codec | None = (
            Codec.for_alphabet(self.task.alphabet) if cfg.model.kind == "tiny" else None
        )
        self.stages: ModelStages | None = None
        self.adapter: Any = None  # nereus.job.adapt.Adapter with [adapt] enabled
        self.tap: Any = None  # the run's tap recorder (tap.jsonl) on a cluster
        self.step = 0
        self.records: list[dict[str, Any]] = []
        self._loggers: StepLoggers | None = None  # while the step loop runs
        self.faults: list[Any] = []  # nereus.job.recovery.Fault, one per recovered fault
        self.async_run: AsyncRun | None = None  # [rl] mode = "async": the run that drives the steps
        self._checkpoints: list[Path] = []  # saved or loaded by this run (a restore uses no other)
        # called as ``await hook(job, record)`` after each step, before the controller loop
        # looks at the boundary (the environment: devices reclaimed or returned, faults)
        self.boundary_hooks: list[Callable[[RLJob, dict[str, Any]], Awaitable[None]]] = []
        self.pool_trace: PoolTrace | None = None  # [trace] pool, played at the boundaries

    async def start(self, cluster: Any = None) -> None:
        """Prepare the model, start the model-stages (on ``cluster`` if given, a started
        ``nereus.Cluster`` the job does not own; else as ``[cluster]`` says), resume if asked."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=2))
        self.model_config, self.model_dir, self.codec = prepare_model(
            self.cfg, self.codec, self.out_dir
        )
        if self.cfg.cluster.mode == "in_process":
            self.stages = InProcessStages(self.cfg, self.model_config, self.model_dir)
        else:
            try:
                self.stages = await ClusterStages.start(
                    self.cfg,
                    self.model_config,
                    self.model_dir,
                    cluster=cluster,
                    on_cluster=self._record_tap,
                )
            except BaseException:
                if self.tap is not None:  # the cluster is gone: nothing more reaches the file
                    tap, self.tap = self.tap, None
                    await tap.stop(flush=False)
                raise
        resolved = getattr(self.stages, "cfg", self.cfg)
        if resolved is not self.cfg:  # model.dtype "auto" resolved for the devices
            self.cfg = resolved
            (self.out_dir / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=2))
        if self.cfg.cluster.mode != "in_process":
            pool_trace = PoolTrace.of(self.cfg)
            if pool_trace is not None:  # the environment: devices drained and returned on the trace
                self.pool_trace = pool_trace
                self.boundary_hooks.insert(0, pool_trace)
            if self.cfg.adapt.enabled:
                reward = self.stages._models.get("reward", (None,))[0]
                self.adapter = Adapter(
                    self.cfg, self.stages, self.model_config, reward_config=reward
                )
        if self.cfg.run.resume:
            ckpt = latest_checkpoint(self.out_dir)
            if ckpt is not None:
                await self.load_checkpoint(ckpt)
        if self.adapter is not None and not self._checkpoints:
            await (
                self.save_checkpoint()
            )  # what a training state that loses its last copy comes back to

    def max_prompt_tokens(self, samples: int = 512) -> int:
        """The longest prompt, in tokens, among the first ``samples`` of the global order."""
        assert self.codec is not None
        n = min(samples, self.dataset.size)
        return max(len(self.task.prompt_ids(self.dataset.at(i), self.codec)) for i in range(n))

    async def _record_tap(self, cluster: Cluster) -> None:
        """Every tap event of the run into ``out_dir/tap.jsonl`` (next to metrics.jsonl),
        from before the first model-stage starts."""
        address = getattr(cluster, "tap_address", "")
        if not address:
            return
        path = self.out_dir / "tap.jsonl"
        if not self.cfg.run.resume:
            path.write_text("")
        self.tap = await TapRecorder(
            address, cluster.key, str(path), emit, curve=getattr(cluster, "curve", None)
        ).start()

    async def save_checkpoint(self) -> Path:
        assert self.stages is not None
        folder = self.out_dir / "checkpoints" / f"step_{self.step}"
        await self.stages.save(folder)
        job = {
            "step": self.step,
            "dataset": self.dataset.state_dict(),
            "policy_version": self.stages.policy_version,
        }
        # job.json last: a folder without it is an interrupted save and is never resumed.
        (folder / "job.json").write_text(json.dumps(job))
        self._checkpoints.append(folder)
        return folder

    async def load_checkpoint(self, folder: str | Path) -> None:
        assert self.stages is not None
        job_file = Path(folder) / "job.json"
        if not job_file.is_file():
            raise StateError(f"checkpoint {str(folder)!r} is incomplete (no job.json)")
        job = json.loads(job_file.read_text())
        await self.stages.load(folder)
        self.dataset.load_state_dict(job["dataset"])
        self.step = int(job["step"])
        self._checkpoints.append(Path(folder))
        log.info(
            "resumed from %s at step %d (policy version %d)",
            folder,
            self.step,
            self.stages.policy_version,
        )

    def _lengths(self, step: int, indices: list[int], k: int) -> list[int]:
        """Every response's drawn length under ``[trace] lengths`` (``nereus.job.traces``)."""
        return response_lengths(self.cfg, step, indices, k)

    async def run_step(self) -> dict[str, Any]:
        """One step of the algorithm over the next samples of the global order.

        The record carries, besides the algorithm's figures, what the planner needs:
        ``model_stage_seconds`` (seconds each model-stage worked), ``max_new_tokens`` (the
        length cap this step used), ``device_peak_bytes`` (each device's ledger
        high-water mark during the step) and the layout ``epoch``. A change of plan
        started with overlap at the boundary before ends within the step."""
        assert self.stages is not None and self.codec is not None
        a = self.cfg.algorithm
        t0 = time.perf_counter()
        self.stages.take_stage_seconds()
        samples = self.dataset.take(a.prompts_per_step)
        self.stages.sample_position = self.dataset.position
        ctx = StepContext(
            self.cfg.algorithm,
            self.cfg.sampling,
            self.cfg.run.seed,
            self.cfg.reward.kind == "model",
            self.task,
            self.codec,
            self.stages,
            self.step,
            lengths=self._lengths if self.cfg.sampling.lengths is not None else None,
        )
        record = await ALGORITHMS[a.name](ctx, samples)
        # a change that ran beside this step ends within it (the step's ledger peaks,
        # read below, see all it did; its failure is the step's)
        if self.adapter is not None:
            await self.adapter.settle()
        else:
            await self.stages.transition_done()
        record["step_seconds"] = time.perf_counter() - t0
        record["dataset_position"] = self.dataset.position
        record["max_new_tokens"] = self.cfg.sampling.cap_at(self.step)
        record["model_stage_seconds"] = self.stages.take_stage_seconds()
        peaks = await self.stages.memory_peaks()
        record["device_peak_bytes"] = {str(d): n for d, n in sorted(peaks.items())}
        record["epoch"] = getattr(self.stages, "epoch", 0)
        self.step += 1
        if self.cfg.cluster.mode != "in_process":
            emit(
                "step",
                step=record["step"],
                stage_seconds={
                    k.removesuffix("_seconds"): v
                    for k, v in record.items()
                    if k.endswith("_seconds") and isinstance(v, float)
                },
                model_stage_seconds=record["model_stage_seconds"],
                tokens=record["tokens_generated"],
                reward=record["reward_mean"],
                response_length_tokens=record["response_len_mean"],
                max_new_tokens=record["max_new_tokens"],
                device_peak_bytes=record["device_peak_bytes"],
                policy_version=record["policy_version"],
            )
        return record

    async def apply_plan(self, target: Any, *, overlap: bool | str = False) -> dict[str, Any]:
        """Change the job's plan at this step boundary (``ModelStages.apply_plan``; with
        ``overlap``, ``True`` or ``"auto"`` (``nereus.job.overlap``), the next step's work
        on devices the change leaves alone may start while it runs: the step waits for
        it before it ends)."""
        assert self.stages is not None
        self.stages.sample_position = self.dataset.position
        if overlap is not False:
            return await self.stages.apply_plan(target, overlap=overlap)
        return await self.stages.apply_plan(target)

    async def run(self) -> list[dict[str, Any]]:
        """Run the remaining steps; returns the records of this run's steps."""
        await self.start()
        try:
            return await self._loop()
        finally:
            await self.close()

    async def _loop(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        resumed = self.step > 0
        loggers = make_loggers(
            cfg.run, self.out_dir, to_dict(cfg), resume_from_step=self.step if resumed else None
        )
        self._loggers = loggers
        progress = StepProgress(
            cfg.run.steps,
            start=self.step,
            enabled=cfg.run.progress,
            title=cfg.algorithm.name.upper(),
        )
        # the record of a step whose boundary started a change beside the next step: it is
        # logged once that change ended (within the next step) and its record is complete
        held: dict[str, Any] | None = None

        def release_held() -> None:
            nonlocal held
            if held is not None and not (self.adapter and self.adapter.overlapping):
                if held["step"] < self.step:  # not rewound past by a restored checkpoint
                    loggers.log(held)
                    progress.update(held)
                held = None

        try:
            if cfg.rl.is_async:
                self.async_run = AsyncRun(self)
                await self.async_run.run(lambda r: (loggers.log(r), progress.update(r)))
            while self.step < cfg.run.steps:
                record = await self._guarded(self.run_step, "step")
                release_held()
                if record is None:
                    continue  # a fault: the step was redone or its committed update kept
                await self._guarded(lambda record=record: self._boundary(record), "boundary")
                if record["step"] >= self.step:
                    # the boundary's fault restored a checkpoint before this step: it is redone
                    continue
                self.records.append(record)
                every = cfg.run.checkpoint_every
                due = (every and self.step % every == 0) or self.step == cfg.run.steps
                if due and self.adapter is not None and self.adapter.overlapping:
                    # a checkpoint waits for a change started here: it runs in the boundary
                    t0 = time.perf_counter()
                    await self._guarded(self.adapter.settle, "boundary")
                    record["boundary_seconds"] += time.perf_counter() - t0
                held = record
                release_held()
                if due:
                    saved_at = self.step
                    await self._guarded(self.save_checkpoint, "boundary")
                    if (self.out_dir / "checkpoints" / f"step_{saved_at}" / "job.json").is_file():
                        loggers.commit(
                            saved_at
                        )  # no restore goes back past it: W&B and MLflow get them
        finally:
            progress.close()
            self._loggers = None
            loggers.close()
        if cfg.run.export_hf:
            self.export_hf()
        history = read_metrics(self.out_dir / "metrics.jsonl")
        what = Path(cfg.data.path).name if cfg.data is not None else cfg.task.name
        if history:
            plot_metrics(
                history, self.out_dir / "plot.png", title=f"{cfg.algorithm.name.upper()} on {what}"
            )
            if cfg.run.progress:
                from rich.console import Console

                console = Console()
                console.print(
                    summary_table(
                        history, title=f"{cfg.algorithm.name.upper()} on {what}: {self.out_dir}"
                    )
                )
                if cfg.adapt.enabled:
                    title = (
                        f"plan changes: {sum(1 for r in history if r.get('transition'))} "
                        f"(every decision is on the tap: {self.out_dir / 'tap.jsonl'})"
                    )
                    summary = changes_summary(history, title=title, width=console.width)
                    console.print(summary, markup=False, highlight=False)
                if self.faults:
                    console.print(faults_table([f.as_record() for f in self.faults]))
        return self.records

    async def _boundary(self, record: dict[str, Any]) -> None:
        """After a step: the environment's hooks, then the controller loop.
        ``record["boundary_seconds"]``: the wall time spent here (a change run here, or
        the part of one started here before it runs beside the next step, included)."""
        t0 = time.perf_counter()
        try:
            await self._boundary_work(record)
        finally:
            record["boundary_seconds"] = time.perf_counter() - t0

    async def _boundary_work(self, record: dict[str, Any]) -> None:
        for hook in self.boundary_hooks:
            await hook(self, record)
        if self.adapter is not None and self.step < self.cfg.run.steps:
            decision = await self.adapter.after_step(record)
            if decision is not None:
                record["decision"] = {k: decision[k] for k in ("action", "admitted", "reason")}
                record["decision"]["triggers"] = [
                    f"{t['kind']}:{t['detail']}" for t in decision["triggers"]
                ]
                if "transition" in decision:
                    record["transition"] = decision["transition"]

    async def _guarded(self, work: Callable[[], Awaitable[Any]], during: str) -> Any:
        """``await work()``; with ``[adapt]`` on, a worker's death inside it is recovered
        from (``recover``) and None returned; anything else is raised."""
        if self.adapter is None:
            return await work()

        assert self.stages is not None
        counts: dict[str, list[int]] = {}  # a death before they are read: no update was committed
        start = (self.step, self.dataset.state_dict(), self.stages.policy_version, counts)
        try:
            if during == "step":
                kept = (
                    self.adapter.take_counts()
                )  # read at the boundary just before, with its other reads
                counts.update(kept if kept is not None else await update_counts(self.stages))
            return await work()
        except Exception as e:
            if not is_fault(e):
                raise
            await self.recover(e, during, start)
            return None

    async def recover(
        self,
        error: BaseException,
        during: str,
        start: tuple[int, dict[str, Any], int, dict[str, list[int]]],
        *,
        replan: Callable[[int, list[int]], Awaitable[Any]] | None = None,
        restored: Callable[[Path], Awaitable[None]] | None = None,
        settle: Callable[[Fault], Awaitable[dict[str, Any]]] | None = None,
    ) -> Fault:
        """Back to a runnable plan after workers died (``nereus.job.recovery``): drop what
        died, keep the intact EMUs, replan on the devices left, build what was lost;
        restore the newest checkpoint if a training state lost its last copy; otherwise
        redo the step if its update was not committed, or go on from the committed one.

        ``start`` is (step, dataset state, policy version, update counters) when the work
        began; ``during`` is "step" or "boundary" (a boundary's update stands), or the
        asynchronous run's "update". The asynchronous run (``nereus.job.async_recovery``)
        passes its own ``replan`` (``await replan(step, dead)``: the async adapter's split
        instead of the controller loop's), ``restored`` (called with the checkpoint
        loaded: its ledger rewinds with it) and ``settle`` (its update kept or redone, its
        producers resumed; returns extra fields for the ``fault`` event); all three run
        again if another worker dies before the job is runnable. Returns the fault, also
        appended to ``faults`` and put on the tap."""
        assert self.stages is not None and self.adapter is not None
        step0, dataset0, version0, counts0 = start
        replan = replan if replan is not None else self.adapter.after_fault
        t0 = time.perf_counter()
        fault = Fault(step0, [], during, f"{type(error).__name__}: {error}"[:400])
        extra: dict[str, Any] = {}
        for attempt in range(4):
            try:
                dead = await dead_devices(self.stages)
                if not dead and attempt == 0:
                    raise error
                lost = await forget_dead(self.stages, dead)
                fault.devices = sorted(set(fault.devices) | set(lost.dead))
                fault.dropped += lost.dropped
                fault.missing = sorted(set(fault.missing) | set(lost.missing))
                counts = await settle_updates(self.stages, lost)
                if during == "boundary":
                    fault.committed = True
                else:
                    fault.committed = any(c > max(counts0.get(s, [c])) for s, c in counts.items())
                await replan(self.step, lost.dead)
                if any(s in fault.missing for s in ("policy_training", "critic_training")):
                    done = [c for c in self._checkpoints if (c / "job.json").is_file()]
                    if not done:
                        raise StateError(
                            "a training state lost its last copy and there is no checkpoint "
                            "to restore"
                        )
                    ckpt = max(done, key=lambda c: int(c.name.split("_")[1]))
                    reached = self.step
                    await self.load_checkpoint(ckpt)
                    fault.restored_from = ckpt.name
                    self._rewind_record(ckpt.name, reached)
                    if restored is not None:
                        await restored(ckpt)
                elif during == "step" and not fault.committed:
                    self.dataset.load_state_dict(dataset0)
                    self.step = step0
                    fault.redone = True
                elif during == "step":
                    # the update stands (its record went with the fault): go on after it
                    self.step = max(self.step, step0 + 1)
                    if self.stages.policy_version == version0:
                        self.stages.sample_position = self.dataset.position
                        await self.stages.sync_policy()
                if settle is not None:
                    extra = await settle(fault)
                break
            except Exception as e:
                if attempt == 3 or not is_fault(e):
                    raise
                log.warning("another fault during recovery: %s", e)
                fault.during = "recovery"
        fault.recover_seconds = time.perf_counter() - t0
        self.faults.append(fault)
        emit("fault", **fault.as_record(), **extra)
        log.warning(
            "recovered from the death of devices %s in %.2f s (%s)",
            fault.devices,
            fault.recover_seconds,
            "checkpoint " + fault.restored_from
            if fault.restored_from
            else "step redone"
            if fault.redone
            else "update kept"
            if fault.committed
            else "no update in flight",
        )
        return fault

    def _rewind_record(self, checkpoint: str, reached: int) -> None:
        """The job went back from step ``reached`` to ``checkpoint`` (now at ``self.step``):
        its record goes back too, so each step the job redoes is recorded once
        (``StepLoggers.rewind``); the tap says which steps' records were dropped."""
        discarded = list(range(self.step, reached))
        self.records = [r for r in self.records if r["step"] < self.step]
        if self._loggers is not None:
            self._loggers.rewind(self.step)
        emit("rewind", step=self.step, checkpoint=checkpoint, discarded_steps=discarded)

    def export_hf(self, out: str | Path | None = None) -> Path:
        """Write the policy of the newest checkpoint as a Hugging Face folder (``out_dir/hf``
        by default); see ``nereus.job.export``."""

        ckpt = latest_checkpoint(self.out_dir)
        if ckpt is None:
            raise StateError(f"{str(self.out_dir)!r} has no complete checkpoint to export")
        return export_checkpoint(
            ckpt, self.cfg, self.model_config, self.model_dir, out or self.out_dir / "hf"
        )

    async def close(self) -> None:
        if self.tap is not None:
            tap, self.tap = self.tap, None
            await tap.stop()
        if self.stages is not None:
            await self.stages.close()
            self.stages = None


async def run_job(cfg: JobConfig) -> list[dict[str, Any]]:
    """Run ``cfg`` to the end (see ``RLJob``)."""
    return await RLJob(cfg).run()
