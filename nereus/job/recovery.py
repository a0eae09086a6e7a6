"""Faults in a running job: what survives a dead worker, and the way back (docs/design.md §10).

A worker that dies takes its device's shard store with it. ``forget_dead(stages, dead)``
brings ``ClusterStages`` to what is left: every model-stage's engines and the
weight-sync groups stop; an EMU none of whose devices died is *intact* and stays with
its shards and logical state; an EMU that lost a device is dropped; a model-stage with
no intact EMU is *missing* and is rebuilt by the next ``apply_plan`` (a missing training
model-stage lost its last copy: the job restores the newest checkpoint). The job's plan
becomes the intact EMUs' plan, which the controller loop replans from.

``salvage(stages, runtime)`` does the same for a change that stopped part way (a worker
died inside a transition DAG). ``Fault`` is what the job reports for each fault.

Refuses nothing; raises what the surviving workers raise (a fault during recovery is the
job's to handle again).

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from nereus.errors import ActorDied, NereusError, RemoteError
from nereus.job.change import STAGE_KINDS
from nereus.planner.plan import Plan, StagePlan

__all__ = [
    "Fault",
    "Lost",
    "forget_dead",
    "salvage",
    "settle_updates",
    "update_counts",
    "is_fault",
    "dead_devices",
]

# exception groups (Python 3.11+) that gather several workers' deaths
_EXCEPTION_GROUPS: tuple[type, ...] = tuple(
    t for t in (getattr(builtins, "BaseExceptionGroup", None),) if t
)

log = logging.getLogger("nereus.rl")

# what a worker's death looks like from the driver
_FAULT_TYPES = ("ActorDied", "PeerDied", "StuckCollective", "TransferError", "ConnectionError")


def is_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a worker's death seen from the driver (directly, or raised on a
    surviving worker whose peer died)."""
    if isinstance(exc, ActorDied):
        return True
    if isinstance(exc, RemoteError):
        return exc.remote_type in _FAULT_TYPES
    if isinstance(exc, NereusError):
        return type(exc).__name__ in _FAULT_TYPES
    if isinstance(exc, _EXCEPTION_GROUPS):
        return any(is_fault(e) for e in exc.exceptions)
    return False


@dataclass
class Lost:
    """What a fault took: the dead devices, the EMUs dropped, the model-stages left
    without an intact EMU."""

    dead: list[int]
    dropped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def training_lost(self) -> bool:
        return any(STAGE_KINDS[s] == "training" for s in self.missing)


@dataclass
class Fault:
    """One fault as the job reports it."""

    step: int
    devices: list[int]
    during: str  # "step", "boundary" (a change or a checkpoint) or "recovery"
    error: str
    committed: bool = False  # the step's update had been committed when it happened
    restored_from: str = ""  # the checkpoint loaded when a training state's last copy died
    redone: bool = False  # the step ran again
    recover_seconds: float = 0.0
    dropped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def as_record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "devices": self.devices,
            "during": self.during,
            "error": self.error,
            "committed": self.committed,
            "restored_from": self.restored_from,
            "redone": self.redone,
            "recover_seconds": self.recover_seconds,
            "dropped": self.dropped,
            "missing": self.missing,
        }


async def dead_devices(stages: Any, timeout_s: float = 10.0) -> set[int]:
    """The devices the job used that died: failures the cluster reported, and devices
    with an engine host that are no longer live. Waits up to ``timeout_s`` for the first
    failure notice (a call can fail before the notice arrives)."""
    cluster = stages.cluster
    if not stages.failures:
        try:
            await asyncio.wait_for(stages.failure_event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
    await cluster.refresh_devices()
    live = {d.index for d in cluster.devices}
    used = set(stages.hosts) | set(stages.plan.devices)
    dead = {f.device for f in stages.failures if f.device is not None and f.device not in live}
    dead |= {d for d in used if d not in live}
    stages.failures.clear()
    stages.failure_event.clear()
    return dead


async def forget_dead(stages: Any, dead: set[int]) -> Lost:
    """Bring ``stages`` to what survives ``dead`` (see the module docstring)."""
    lost = Lost(sorted(dead))
    try:
        await stages.transition_done()
    except Exception as e:
        if not is_fault(e):  # not a death: the job has no way back from it
            raise
        # a change that died with the worker: salvaged there
        log.info("the change in flight ended with the fault: %s", e)
    for d in dead:
        stages.hosts.pop(d, None)
    retired = []
    for stage, handle in list(stages.handles.items()):
        try:
            await handle.stop()
        except Exception as e:  # noqa: BLE001 - an engine on a survivor that cannot stop is dropped with its EMU below
            log.warning("stopping %s's engines after the fault: %s", stage, e)
        retired += handle.groups
    stages.handles.clear()
    retired += [group for _, group in stages._sync.values() if group is not None]
    stages._sync = {}
    for group in {g.group_id: g for g in retired}.values():
        await group.destroy()
    kept: list[tuple[str, StagePlan]] = []
    for stage, emus in list(stages.emus.items()):
        intact = [e for e in emus if not set(e.devices) & dead]
        for e in emus:
            if e in intact:
                continue
            lost.dropped.append(e.name)
            alive = [d for d in e.devices if d not in dead and d in stages.hosts]
            await asyncio.gather(*(stages.hosts[d].drop_shards.call_one([e.name]) for d in alive))
        stages.emus[stage] = intact
        if intact:
            layout = intact[0].layout
            kept.append(
                (
                    stage,
                    StagePlan(layout.tp, layout.pp, len(intact), tuple(e.devices for e in intact)),
                )
            )
        else:
            lost.missing.append(stage)
            del stages.emus[stage]
    stages._missing = set(lost.missing)
    stages._plan = Plan(tuple(kept))
    log.warning(
        "devices %s died: dropped %s; model-stages without an intact EMU: %s",
        lost.dead,
        lost.dropped,
        lost.missing,
    )
    return lost


async def update_counts(stages: Any) -> dict[str, list[int]]:
    """Per training model-stage, the update counter each of its EMUs' first worker holds."""
    out: dict[str, list[int]] = {}
    for stage, emus in stages.emus.items():
        if STAGE_KINDS[stage] != "training":
            continue
        states = await asyncio.gather(
            *(stages.hosts[e.devices[0]].get_state.call_one(e.name) for e in emus)
        )
        out[stage] = [int(st.get("update_count", 0)) for st in states]
    return out


async def settle_updates(stages: Any, lost: Lost) -> dict[str, int]:
    """After ``forget_dead``: the update counter of every training model-stage. Replicas
    that a death mid-reduction left one update behind the others are dropped (the ones
    ahead finished the reduction over every contribution)."""
    counts = await update_counts(stages)
    out: dict[str, int] = {}
    changed = False
    for stage, values in counts.items():
        top = max(values)
        out[stage] = top
        behind = [e for e, c in zip(stages.emus[stage], values, strict=True) if c < top]
        for e in behind:
            lost.dropped.append(e.name)
            await asyncio.gather(
                *(stages.hosts[d].drop_shards.call_one([e.name]) for d in e.devices)
            )
        if behind:
            stages.emus[stage] = [e for e in stages.emus[stage] if e not in behind]
            changed = True
    if changed:
        plan = []
        for stage, sp in stages.plan:
            emus = stages.emus[stage]
            plan.append(
                (
                    stage,
                    sp
                    if len(emus) == sp.dp
                    else StagePlan(sp.tp, sp.pp, len(emus), tuple(e.devices for e in emus)),
                )
            )
        stages._plan = Plan(tuple(plan))
    return out


async def salvage(stages: Any, runtime: Any) -> None:
    """After a change that stopped part way: keep, per model-stage, the complete EMUs the
    DAG left that share the most common layout, free the others (see the module doc)."""
    by_stage: dict[str, list[Any]] = {}
    for e in runtime.live.values():
        by_stage.setdefault(e.model_stage, []).append(e)
    kept: list[tuple[str, StagePlan]] = []
    for stage in list(stages.emus):
        emus = sorted(by_stage.get(stage, []), key=lambda e: e.name)
        if not emus:
            del stages.emus[stage]
            stages._missing.add(stage)
            continue
        layout = Counter(e.layout for e in emus).most_common(1)[0][0]
        keep = [e for e in emus if e.layout == layout]
        # replicas may not share a device: the first of any overlapping ones stays
        used: set[int] = set()
        chosen = []
        for e in keep:
            if used.isdisjoint(e.devices):
                chosen.append(e)
                used |= set(e.devices)
        for e in emus:
            if e not in chosen:
                alive = [d for d in e.devices if d in stages.hosts]
                results = await asyncio.gather(
                    *(stages.hosts[d].drop_shards.call_one([e.name]) for d in alive),
                    return_exceptions=True,
                )
                for r in results:
                    if isinstance(r, BaseException) and not is_fault(r):
                        raise r
        stages.emus[stage] = chosen
        kept.append(
            (stage, StagePlan(layout.tp, layout.pp, len(chosen), tuple(e.devices for e in chosen)))
        )
    stages._plan = Plan(tuple(kept))
