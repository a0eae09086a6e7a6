"""Changing a running job's plan over the state its workers hold (``PlanChanges``, held
by ``nereus.job.cluster_stages.ClusterStages`` as ``changes``; both share one
``nereus.job.stages_state.StagesState``).

Pricing a change (``change_inputs`` once per boundary, then ``plan_change`` and
``estimate_change`` per target, pure over those inputs) is what the controller
(``nereus.job.adapt``) admits changes with; ``apply_plan`` runs one; every executed
transition's nodes feed ``Calibrator.observe_transition`` (``learn_transitions``), so
the next estimate uses them.

Refuses (before anything moves): a target plan with other model-stages, devices that
are not live or are draining (``ConfigError``); ``OutOfMemory`` / ``InfeasiblePlan``
for a change that cannot run.

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from nereus.actors import emit
from nereus.config import require
from nereus.engines import spawn_model_stage, start_model_stage
from nereus.engines.stage import stage_groups
from nereus.errors import InfeasiblePlan, OutOfMemory
from nereus.job.change import STAGE_KINDS, check_after, emu_name, stage_changed, stage_emus
from nereus.job.overlap import held_back, overlaps
from nereus.job.recovery import is_fault, salvage
from nereus.job.stages_state import StagesState
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.plan_text import plan_changes, plan_text
from nereus.state import EMU, DeviceSet
from nereus.state.memory import DEFAULT_BUCKET_BYTES
from nereus.state.spec import ModelSpec
from nereus.transfer import release_groups
from nereus.transition import LinkModel, TransitionDAG, build_dag, full_rate_seconds
from nereus.transition.execute import execute_dag
from nereus.transition.workers import WorkerRuntime

__all__ = ["PlanChanges", "emit_event"]

log = logging.getLogger("nereus.rl")


class StageWork(Protocol):
    """What a plan change asks of the stages it changes (``ClusterStages``): their specs,
    engine options and placement views, and the calls that talk to their workers."""

    def _spec(self, stage: str) -> ModelSpec: ...
    def _slots(self, stage: str) -> tuple[str, ...]: ...
    def _generation_rows(self, sp: StagePlan) -> int: ...
    def _options(self, stage: str, sp: StagePlan | None = None) -> dict[str, Any]: ...
    def _engine_bytes(self, stage: str, sp: StagePlan, emu: EMU, device: int) -> int: ...
    def _device_set(self) -> DeviceSet: ...
    def _host_of(self, device: int) -> int: ...
    def _current_plan(self, stage: str) -> StagePlan: ...
    async def _stamp_states(self, stages: list[str] | None = None) -> None: ...
    async def _ensure_hosts(self, devices: set[int]) -> None: ...
    async def _plan_syncs(self) -> None: ...
    async def _run_sync(self, target: str) -> dict[str, Any]: ...
    async def memory(self) -> dict[int, dict[str, Any]]: ...
    def fixed_compute(self, devices: list[int]) -> bool: ...


class PlanChanges:
    """Pricing, checking and running a change of the job's plan (see the module
    docstring) over ``state``, the placement it shares with ``stages``."""

    def __init__(self, state: StagesState, stages: StageWork) -> None:
        self.state = state
        self.stages = stages
        self._transition: asyncio.Future | None = None  # a change running in the background
        self._waiting: set[str] = set()  # model-stages that wait for it
        self._report: dict[str, Any] = {}  # its report, filled in as it runs
        # seconds a change spends per model-stage it restarts beyond the DAG's moves
        # (engines stopped and started, their groups, the sync plans): measured
        self._restart_s: deque[float] = deque(maxlen=4)

    @property
    def running(self) -> bool:
        """Whether a change started with ``overlap`` has not been waited for."""
        return self._transition is not None

    async def change_inputs(self) -> dict[str, Any]:
        """What pricing a change needs from the workers, read once per boundary: every
        device's ledger (what it holds besides the job's EMUs) and the generation KV
        caches' slots."""
        gen = (
            self.state.handles["policy_generation"].emus
            if "policy_generation" in self.state.handles
            else []
        )
        memory, *shapes = await asyncio.gather(
            self.stages.memory(), *(h.cache_shape() for h in gen)
        )
        return {"memory": memory, "cache_slots": max((s[1] for s in shapes), default=0)}

    def plan_change(self, target: Any, inputs: dict[str, Any]) -> tuple[Any, float]:
        """The transition DAG from the job's plan to ``target`` (device ids) and its
        predicted seconds (the scheduler's makespan under the link model); pure over
        ``inputs`` (``change_inputs``). Raises ``InfeasibleTransition`` when the DAG
        cannot keep a device under its cap and ``OutOfMemory`` when the restarted engines
        would not fit after it."""
        moving = [
            s
            for s in self.state.plan.names
            if stage_changed(self.stages._current_plan(s), target[s])
        ]
        if self.state.missing:  # the DAG moves what exists; a missing model-stage is built after it
            target = Plan(tuple((s, target[s]) for s in self.state.plan.names))
        resident = _resident(
            inputs["memory"],
            [e.name for emus in self.state.emus.values() for e in emus],
            engines=[e.name for s in moving for e in self.state.emus[s]],
        )
        one_host = len({self.stages._host_of(d) for d in self.state.hosts}) == 1
        dag = build_dag(
            self.state.plan,
            target,
            {s: es[0].spec for s, es in self.state.emus.items()},
            self.stages._device_set(),
            slots={s: es[0].slots for s, es in self.state.emus.items()},
            names={s: [e.name for e in es] for s, es in self.state.emus.items()},
            resident=resident,
            host_of=self.stages._host_of,
            bucket_bytes=0 if one_host else DEFAULT_BUCKET_BYTES,
            duration=self.state.link.seconds,
            share=self.state.link.sharing,
        )
        slots, self.state.cache_slots = (
            self.state.cache_slots,
            inputs["cache_slots"] if "policy_generation" in moving else 0,
        )
        try:
            engines: dict[int, int] = {}
            for stage in moving:
                for rep in dag.results[stage]:
                    emu = self.state.emus[stage][0].with_(
                        name=rep.name, layout=rep.layout, devices=rep.devices
                    )
                    for d in rep.devices:
                        engines[d] = engines.get(d, 0) + self.stages._engine_bytes(
                            stage, target[stage], emu, d
                        )
        finally:
            self.state.cache_slots = slots
        check_after(dag, engines)
        return dag, self.state.link.total(dag, dag.schedule.makespan)

    @property
    def restart_seconds(self) -> float:
        """What a change costs per model-stage it restarts beyond the DAG's moves: the
        mean of the last measured changes (before any: of spawning them at start, which
        also loaded the weights, an upper bound)."""
        seen = self._restart_s or self.state.spawn_s
        return sum(seen) / len(seen) if seen else 0.0

    def estimate_change(self, target: Any, inputs: dict[str, Any]) -> tuple[float, int]:
        """(predicted seconds, bytes moved) of changing to ``target``: the DAG's makespan
        plus ``restart_seconds`` per model-stage whose engines restart; ``(inf, 0)`` when
        the change cannot run (``plan_change`` refused it)."""
        try:
            dag, seconds = self.plan_change(target, inputs)
        except (InfeasiblePlan, OutOfMemory) as e:
            log.info("a change to %s cannot run: %s", plan_text(target), e)
            return math.inf, 0
        restarted = [s for s in self.state.plan.names if self.state.plan[s] != target[s]]
        return seconds + len(restarted) * self.restart_seconds, dag.bytes

    async def apply_plan(self, target: Any, *, overlap: bool | str = False) -> dict[str, Any]:
        """Change the job's plan to ``target`` at a step boundary through one transition
        DAG over every model-stage that moves (see the module docstring).

        Refused before anything moves: a target with other model-stages or devices that
        are not live or are draining (``ConfigError``), one whose DAG cannot keep every
        device under its cap (``InfeasibleTransition``) or whose engines would not fit
        after it (``OutOfMemory``). ``overlap`` (``True``, ``False`` or ``"auto"``:
        ``nereus.job.overlap.overlaps`` decides from what the change holds back): when
        it resolves true, the change runs in the background and this returns once it
        started: the model-stages it holds back (``nereus.job.overlap.held_back``) wait
        for it at their next call (``ready``), the others go on with the next step's
        work beside it; ``transition_done()`` waits for it and raises what it raised.
        Returns (with overlap, at once, filled in as the change runs; ``transition_done()``
        returns it complete) a report: ``overlapped``, ``held_back`` model-stages,
        ``changed`` model-stages, ``bytes`` the plans move between devices,
        ``bytes_measured`` (the workers' counters), ``predicted_seconds`` (the DAG's
        makespan), ``seconds`` and its parts (``plan_s``, ``engines_stop_s``, ``moves_s``,
        ``groups_s``, ``engines_s``, ``sync_plans_s``), ``nodes``, ``resource_edges``,
        the new ``epoch``, ``ok``; ``started_at``, ``moves_started_at`` and
        ``moves_ended_at`` (``time.perf_counter()``) and ``ran_beside``: for each
        model-stage that began work while the change ran, when it began (same clock)."""
        await self.transition_done()
        t0 = time.perf_counter()
        require(
            isinstance(target, Plan),
            "target",
            type(target).__name__,
            "must be a nereus.planner.Plan",
        )
        stages = set(self.state.plan.names) | self.state.missing
        require(
            set(target.names) == stages,
            "target plan",
            target.names,
            f"must place exactly the job's model-stages {sorted(stages)}",
        )
        await self.state.cluster.refresh_devices()
        live = {d.index for d in self.state.cluster.devices}
        draining = set(getattr(self.state.cluster, "draining", ()))
        bad = sorted(d for d in target.devices if d not in live or d in draining)
        require(
            not bad,
            "target plan devices",
            bad,
            f"must be live devices that are not draining (live: {sorted(live - draining)})",
        )
        report: dict[str, Any] = {
            "from": self.state.plan.to_dict(),
            "to": target.to_dict(),
            "epoch_from": self.state.epoch,
            "started_at": t0,
        }
        moving = [
            s
            for s in self.state.plan.names
            if stage_changed(self.stages._current_plan(s), target[s])
        ]
        # what the change moves, checked against every budget before anything moves; the
        # engines of model-stages that do not move stay as they are, with their groups
        await self.stages._stamp_states(moving)
        inputs = await self.change_inputs()
        dag, predicted = self.plan_change(target, inputs)
        self.state.cache_slots = inputs["cache_slots"] if "policy_generation" in moving else 0
        # model-stages that keep their EMUs but decode in other waves or (stop) recompute,
        # and those whose engines a fault stopped (nereus.job.recovery)
        retuned = [
            s
            for s in self.state.plan.names
            if s not in moving and (self.state.plan[s] != target[s] or s not in self.state.handles)
        ]
        missing = sorted(self.state.missing)
        new_epoch = max(self.state.epoch, self.state.cluster.epoch) + 1
        t_plan = time.perf_counter()
        report.update(
            changed=list(dag.results),
            retuned=retuned,
            rebuilt=missing,
            bytes=dag.bytes,
            predicted_seconds=predicted,
            nodes=len(dag.nodes),
            resource_edges=dag.resource_edges,
        )
        # the moving model-stages' engines stop (gradients, KV caches and activations
        # leave the ledgers); their groups go once nothing else uses them
        retired = []
        for stage in [*moving, *retuned]:
            handle = self.state.handles.pop(stage, None)
            if handle is not None:
                await handle.stop()
                retired += handle.groups
        t_stop = time.perf_counter()
        report.update(plan_s=t_plan - t0, engines_stop_s=t_stop - t_plan)
        await self.stages._ensure_hosts(set(target.devices))
        held = held_back(
            {s: self.stages._current_plan(s) for s in self.state.plan.names},
            dict(target),
            [*moving, *retuned, *missing],
            dag.devices(),
        )
        overlap = overlaps(
            overlap,
            held,
            self.stages.fixed_compute(sorted(self.state.plan.devices | target.devices)),
        )
        report.update(overlapped=overlap, held_back=sorted(held))
        runtime = WorkerRuntime(
            {e.name: e for es in self.state.emus.values() for e in es},
            self.state.hosts,
            self.state.cluster,
            epoch=new_epoch,
        )
        work = self._finish_change(
            dag, runtime, target, moving, retuned, retired, new_epoch, report, t0, missing
        )
        if not overlap:
            self.state.last_transition = await work
            return self.state.last_transition
        self._waiting, self._report = held, report
        self._transition = asyncio.ensure_future(work)
        return report

    async def transition_done(self) -> dict[str, Any] | None:
        """Wait for a change started with overlap; its report (None when none runs).
        Raises what the change raised, to every caller waiting for it when it ended (any
        number may wait at once); once it ended, the change is forgotten."""
        task = self._transition
        if task is None:
            return None
        try:
            # shielded: a caller cancelled while waiting does not cancel the change
            report = await asyncio.shield(task)
        finally:
            if self._transition is task and task.done():
                self._transition, self._waiting, self._report = None, set(), {}
        self.state.last_transition = report
        return report

    async def ready(self, stage: str) -> None:
        """Return once ``stage`` may work: at once, unless a change started with overlap
        holds it back (then once the change is done; raises what the change raised). A
        model-stage that works beside the change is noted in its report (``ran_beside``)."""
        task = self._transition
        if task is None:
            return
        if stage in self._waiting:
            await self.transition_done()
        elif not task.done():
            self._report.setdefault("ran_beside", {}).setdefault(stage, time.perf_counter())

    async def _finish_change(
        self,
        dag: TransitionDAG,
        runtime: WorkerRuntime,
        target: Plan,
        moving: list[str],
        retuned: list[str],
        retired: list[Any],
        new_epoch: int,
        report: dict[str, Any],
        t0: float,
        missing: list[str] = (),
    ) -> dict[str, Any]:
        t_moves0 = time.perf_counter()
        report["moves_started_at"] = t_moves0
        result = await execute_dag(
            dag, runtime, duration=self.state.link.seconds, on_node=self._node_event(t_moves0)
        )
        report["moves_ended_at"] = time.perf_counter()
        # the transition's groups are its own
        await release_groups(self.state.cluster, new_epoch, tag="transition")
        report.update(bytes_measured=result.bytes_measured, nodes_finished=len(result.finished))
        if not result.ok:
            report.update(ok=False, seconds=time.perf_counter() - t0)
            _emit_transition(report, dag)
            await salvage(self.stages, runtime)  # what the DAG left, as the job's plan
            raise (
                result.error
                if result.error is not None
                else RuntimeError("the transition stopped part way")
            )
        died: list[BaseException] = []
        for stage in moving:
            reps = dag.results[stage]
            renames = {
                rep.name: emu_name(stage, i)
                for i, rep in enumerate(reps)
                if rep.name != emu_name(stage, i)
            }
            if renames:
                devices = sorted({d for rep in reps for d in rep.devices})
                done = await asyncio.gather(
                    *(self.state.hosts[d].rename.call_one(renames) for d in devices),
                    return_exceptions=True,
                )
                for r in done:
                    if isinstance(r, BaseException):
                        if not is_fault(r):
                            raise r
                        died.append(r)
            self.state.emus[stage] = [
                runtime.live[rep.name].with_(name=emu_name(stage, i)) for i, rep in enumerate(reps)
            ]
        t_moves = (
            time.perf_counter()
        )  # the span the estimate predicts: the nodes, the groups' release, the renames
        if self.state.learn_transitions and not died:
            self._learn_transition(dag, result, t_moves - report["moves_ended_at"])
        self.state.epoch = new_epoch
        self.state.plan = target
        if died:
            # every move landed and the survivors hold the new names: the job's plan is the
            # target, and the fault is the job's to recover from there, like one mid-step
            report.update(ok=False, seconds=time.perf_counter() - t0)
            _emit_transition(report, dag)
            await self.state.cluster.set_epoch(self.state.epoch)
            raise died[0]
        await self.state.cluster.set_epoch(self.state.epoch)
        timing = await self._start_engines([*moving, *retuned])
        await self._build_missing(missing)
        t_engines = time.perf_counter()
        retired += [group for _, group in self.state.sync.values() if group is not None]
        await self.stages._plan_syncs()
        for (
            stage
        ) in missing:  # built from the model folder: the in-place syncs give them today's weights
            if stage in self.state.sync:
                await self.stages._run_sync(stage)
        await self._release_unused(retired)
        await self._retire_drained()
        t_end = time.perf_counter()
        report.update(
            ok=True,
            epoch=self.state.epoch,
            seconds=t_end - t0,
            moves_s=t_moves - t_moves0,
            groups_s=timing["groups_s"],
            engines_s=t_engines - t_moves - timing["groups_s"],
            sync_plans_s=t_end - t_engines,
            measured_seconds=t_moves - t_moves0,
        )
        if moving or retuned:
            self._restart_s.append(
                (report["seconds"] - report["measured_seconds"]) / len([*moving, *retuned])
            )
        _emit_transition(report, dag)
        moved = "; ".join(f"{n} {c}" for n, c in plan_changes(report["from"], report["to"]))
        log.info(
            "plan changed to epoch %d (%s): %d bytes moved in %.3f s (predicted %.3f s)",
            self.state.epoch,
            moved,
            report["bytes"],
            report["seconds"],
            report["predicted_seconds"],
        )
        return report

    async def _build_missing(self, missing: list[str]) -> None:
        """Model-stages a fault left without an intact EMU, built at the plan's placement
        from the model folder (a training one holds the initial weights until the job
        restores a checkpoint into it)."""
        for stage in missing:
            emus = stage_emus(
                stage, self.state.plan[stage], self.stages._spec(stage), self.stages._slots(stage)
            )
            config, folder = self.state.models[
                "reward" if stage == "reward_inference" else "policy"
            ]
            self.state.handles[stage] = await spawn_model_stage(
                self.state.cluster,
                self.state.hosts,
                stage,
                STAGE_KINDS[stage],
                emus,
                model_config=config,
                model_dir=folder,
                seed=self.state.cfg.run.seed,
                options=self.stages._options(stage),
                epoch=self.state.epoch,
            )
            self.state.emus[stage] = emus
            self.state.missing.discard(stage)

    def _node_event(self, t0: float) -> Callable[[Any, Any], None]:
        def emit_node(node: Any, result: Any) -> None:
            emit_event(
                "transition_node",
                node=node.id,
                kind=node.kind,
                model_stage=node.stage,
                count=node.count,
                devices=list(node.devices),
                bytes=node.bytes,
                predicted_seconds=self.state.link.seconds(node),
                measured_seconds=result.seconds,
                start_seconds=result.start - t0,
                end_seconds=result.end - t0,
                ok=result.ok,
            )

        return emit_node

    def _learn_transition(self, dag: TransitionDAG, result: Any, outside_s: float) -> None:
        """What a transition took teaches the next estimate: each node's time at a
        device's full rate (nodes that ran at once shared the cores), and the time
        spent outside the nodes (a fixed cost and releasing the groups the nodes made)."""
        spans = {
            n.id: (result.results[n.id].start, result.results[n.id].end, len(n.devices))
            for n in dag.nodes
        }
        alone = {
            n: max(s, 1e-6) for n, s in full_rate_seconds(spans, self.state.link.sharing).items()
        }
        outside_s = max(outside_s, 1e-6)
        whole = sum(alone.values()) + outside_s  # each equation weighs by its share of this
        for node in dag.nodes:
            self.state.calibrator.observe_transition(
                self.state.link.ideal(node), alone[node.id], whole
            )
        self.state.calibrator.observe_transition(self.state.link.outside(dag), outside_s, whole)
        self._refit_link()

    def _refit_link(self) -> None:
        self.state.link = LinkModel.of(self.state.cluster_spec, self.state.calibrator.fit())

    async def _release_unused(self, groups: list[Any]) -> None:
        """Destroy ``groups`` that no engine and no sync uses any more."""
        used = {g.group_id for h in self.state.handles.values() for g in h.groups}
        used |= {g.group_id for _, g in self.state.sync.values() if g is not None}
        gone: dict[str, Any] = {g.group_id: g for g in groups if g.group_id not in used}
        for group in gone.values():
            await group.destroy()

    async def _start_engines(self, stages: list[str]) -> dict[str, float]:
        """``stages``' engines over the EMUs the stores hold now, in this epoch."""
        t0 = time.perf_counter()
        for stage in stages:  # made one after another; start_model_stage finds them made
            await stage_groups(
                self.state.cluster,
                STAGE_KINDS[stage],
                self.state.emus[stage],
                epoch=self.state.epoch,
            )
        groups_s = time.perf_counter() - t0

        async def start(stage: str, emus: list[Any]) -> None:
            config, _ = self.state.models["reward" if stage == "reward_inference" else "policy"]
            caches = None
            if STAGE_KINDS[stage] == "generation" and self.state.cache_slots:
                rows = self.stages._generation_rows(self.state.plan[stage])
                caches = {e.name: [rows, self.state.cache_slots] for e in emus}
            self.state.handles[stage] = await start_model_stage(
                self.state.cluster,
                self.state.hosts,
                stage,
                STAGE_KINDS[stage],
                emus,
                model_config=config,
                options=self.stages._options(stage),
                epoch=self.state.epoch,
                caches=caches,
            )

        # every model-stage at once: a device's host builds its engines one after another
        await asyncio.gather(*(start(stage, self.state.emus[stage]) for stage in stages))
        return {"groups_s": groups_s}

    async def _retire_drained(self) -> None:
        """Drained devices the plan no longer uses stop."""
        retire = getattr(self.state.cluster, "retire_drained", None)
        if retire is None:
            return
        idle = [
            d
            for d in getattr(self.state.cluster, "draining", ())
            if d not in self.state.plan.devices
        ]
        for d in idle:
            host = self.state.hosts.pop(d, None)
            if host is not None:
                held = await host.held.call_one()
                require(
                    not held, f"device {d}", sorted(held), "must hold nothing before it is retired"
                )
        if idle:
            await retire(idle)


def _resident(
    memory: dict[int, dict[str, Any]], names: list[str], engines: list[str]
) -> dict[int, int]:
    """Per device, what its ledger holds besides the job's EMUs (``shards/<name>``), the
    engines that stop for the change (``<name>/...``) and transfers in flight: what a
    change must work around."""
    mine = tuple(f"shards/{n}" for n in names) + tuple(f"{n}/" for n in engines) + ("transfer/",)
    return {
        d: sum(v for k, v in m["breakdown"].items() if not k.startswith(mine))
        for d, m in memory.items()
    }


def _emit_transition(report: dict[str, Any], dag: Any) -> None:
    emit_event(
        "transition",
        from_plan=report["from"],
        to_plan=report["to"],
        changed=report.get("changed", []),
        bytes=report.get("bytes", 0),
        bytes_measured=report.get("bytes_measured", 0),
        predicted_seconds=report.get("predicted_seconds", 0.0),
        measured_seconds=report.get("seconds", 0.0),
        nodes=len(dag.nodes),
        resource_edges=dag.resource_edges,
        epoch_from=report["epoch_from"],
        ok=report.get("ok", False),
        overlapped=bool(report.get("overlapped", False)),
        moves_seconds=report.get("measured_seconds", 0.0),
        parts_seconds={k.removesuffix("_s"): report[k] for k in _PARTS if k in report},
    )


_PARTS = ("plan_s", "engines_stop_s", "moves_s", "groups_s", "engines_s", "sync_plans_s")


def emit_event(type_: str, **fields: Any) -> None:
    """An event on the tap (``nereus.actors.emit``, imported when first used)."""
    emit(type_, **fields)
