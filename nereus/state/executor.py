"""Executing plans on worker processes, the controller's side: ``execute`` runs a
``ReshardPlan`` on the ``ShardHolder`` of each of its devices, ``execute_step`` a
primitive ``Step``, ``execute_into`` several plans into one exchange, and
``save_to_disk`` / ``load_from_disk`` an EMU's shards to and from a checkpoint folder.

Promises: each worker gets ONE message per plan (its ``plan_part``); the bytes move
between the workers (``nereus.transfer``), never through this process. With the
devices' budgets (``devices``, ``used``) a plan that does not fit raises ``OutOfMemory``
before any message is sent; without them each holder checks its own ledger. A worker
that refuses or dies wakes its peers at once (the plan's group is destroyed) instead of
leaving them at the exchange's deadline, and nothing is freed anywhere.

Refuses (``StateError``): a plan with a device that has no holder; a snapshot sync
whose senders read snapshots of different versions.

More (how it works): docs/state.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nereus.actors import ActorRef
from nereus.errors import StateError
from nereus.state import checkpoint as ckpt
from nereus.state.apply import plan_part
from nereus.state.emu import EMU, DeviceSet, LogicalState, emu_to_plain
from nereus.state.memory import DEFAULT_BUCKET_BYTES, check_fits, memory_effect
from nereus.state.primitives import Step
from nereus.state.reshard import ReshardPlan
from nereus.transfer import make_group

__all__ = [
    "ExecuteStats",
    "execute",
    "execute_step",
    "execute_into",
    "save_to_disk",
    "load_from_disk",
]

log = logging.getLogger("nereus.state")


@dataclass(frozen=True)
class ExecuteStats:
    """What a plan did: its bytes between devices and local copies (the plan's figures),
    the bytes the workers' transfer counters measured leaving them, its devices."""

    bytes_moved: int
    bytes_local: int
    devices: tuple[int, ...]
    bytes_sent_measured: int = 0
    snapshot_version: int | None = None  # the version the snapshots read held (from_snapshots)


async def execute(
    plan: ReshardPlan,
    holders: Mapping[int, ActorRef],
    cluster: Any,
    *,
    free: Sequence[EMU] = (),
    epoch: int = 0,
    devices: DeviceSet | None = None,
    used: Mapping[int, int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group_tag: str = "",
) -> ExecuteStats:
    """Run ``plan`` on the ``ShardHolder`` of each of its devices (device -> ref), ONE
    message per worker, then free ``free`` (EMUs) on their devices. The group the parts
    exchange over is of ``epoch`` and ``group_tag`` (``nereus.transfer.make_group``).

    With ``devices`` (budgets) and ``used`` (what else is resident), the plan's memory
    effect is checked first and ``OutOfMemory`` raised before any message is sent.
    Otherwise each worker checks its own budget; a worker that refuses (or fails)
    makes the driver destroy the plan's group, so its peers fail at once instead of
    waiting for it, and nothing is freed anywhere. Raises the first worker's error."""
    if devices is not None:
        check_fits(
            memory_effect([plan], plan.sources, free, bucket_bytes),
            devices,
            used,
            f"plan building {plan.target.name}",
        )
    involved = set(plan.devices())
    frees: dict[int, list[str]] = {}
    for emu in free:
        for d in emu.devices:
            frees.setdefault(d, []).append(emu.name)
    involved |= set(frees)
    missing = sorted(d for d in involved if d not in holders)
    if missing:
        raise StateError(
            f"no ShardHolder on devices {missing} for plan building {plan.target.name}"
        )
    group_devices = sorted(plan.devices()) if plan.remote_moves() else []
    group = (
        await make_group(cluster, devices=group_devices, epoch=epoch, tag=group_tag)
        if group_devices
        else None
    )
    state = vars(plan.state).copy()
    # Devices with the least to prepare (sends and local copies) first: receivers
    # publish where their views live before the senders are ready to write, so no
    # sender waits for a late record. Each part is built just before its message.
    work = Counter(m.src_device for m in plan.moves)
    tasks = [
        asyncio.ensure_future(
            holders[d].run_plan.call_one(
                plan_part(plan, d),
                group.group_id if group and d in group_devices else None,
                group_devices,
                frees.get(d, []),
                state,
            )
        )
        for d in sorted(involved, key=lambda d: (work[d], d))
    ]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    if group is not None and any(t.exception() is not None for t in done):
        # a refusing or dead worker never enters the exchange: wake its peers now
        await group.destroy()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        root = [
            e
            for e in errors
            if "TransferError" not in str(getattr(e, "remote_type", type(e).__name__))
        ]
        log.warning(
            "plan building %s failed on %d of %d workers", plan.target.name, len(errors), len(tasks)
        )
        raise (root or errors)[0]
    measured = sum(int(r.get("bytes_sent", 0)) for r in results)
    return ExecuteStats(plan.bytes_moved, plan.bytes_local, tuple(sorted(involved)), measured)


async def execute_step(
    step: Step,
    holders: Mapping[int, ActorRef],
    cluster: Any,
    *,
    epoch: int = 0,
    devices: DeviceSet | None = None,
    used: Mapping[int, int] | None = None,
    group_tag: str = "",
) -> ExecuteStats:
    """Run a primitive ``Step`` on the workers: its plans (one message per worker each;
    a one-plan step frees its inputs in the same message), then free what it frees.
    A Destroy only drops shards. Returns the plans' bytes and the measured ones."""
    if len(step.plans) == 1:
        return await execute(
            step.plans[0],
            holders,
            cluster,
            free=step.freed,
            epoch=epoch,
            devices=devices,
            used=used,
            group_tag=group_tag,
        )
    moved = local = measured = 0
    involved: set[int] = set()
    for plan in step.plans:
        stats = await execute(
            plan, holders, cluster, epoch=epoch, devices=devices, used=used, group_tag=group_tag
        )
        moved, local = moved + stats.bytes_moved, local + stats.bytes_local
        measured += stats.bytes_sent_measured
        involved |= set(stats.devices)
    frees: dict[int, list[str]] = {}
    for emu in step.freed:
        for d in emu.devices:
            frees.setdefault(d, []).append(emu.name)
    await asyncio.gather(*(holders[d].drop_shards.call_one(names) for d, names in frees.items()))
    return ExecuteStats(moved, local, tuple(sorted(involved | set(frees))), measured)


async def execute_into(
    plans: Sequence[ReshardPlan],
    holders: Mapping[int, ActorRef],
    group: Any = None,
    *,
    from_snapshots: bool = False,
) -> ExecuteStats:
    """Run ``plans`` whose targets already exist on their devices, in place (weight
    and critic syncs): every device gets its parts of every plan in ONE message
    (``ShardHolder.run_into``) and moves all its bytes in one exchange over ``group``
    (a ``GroupHandle`` over every device of the plans, or None when nothing crosses
    devices). Returns the plans' bytes and the bytes the workers measured sending.

    ``from_snapshots``: the plans' sources are published snapshots
    (``nereus.state.snapshot``): devices that only send run ``send_snapshot``, beside
    whatever their workers are doing, and the stats carry the version they held."""
    parts: dict[int, list[dict]] = {}
    for plan in plans:
        for d in plan.devices():
            parts.setdefault(d, []).append(plan_part(plan, d))
    group_devices = list(group.devices) if group is not None else []
    missing = sorted(d for d in parts if d not in holders)
    if missing:
        raise StateError(
            f"no ShardHolder on devices {missing} for {[p.target.name for p in plans]}"
        )
    targets = {d for plan in plans for d in plan.target.devices}
    gid = group.group_id if group is not None else None
    senders = {d for d in parts if from_snapshots and d not in targets}
    results = await asyncio.gather(
        *(
            (holders[d].send_snapshot if d in senders else holders[d].run_into).call_one(
                ps, gid, group_devices
            )
            for d, ps in parts.items()
        )
    )
    versions = {int(r["version"]) for d, r in zip(parts, results, strict=True) if d in senders}
    if len(versions) > 1:
        raise StateError(
            f"a sync into {[p.target.name for p in plans]} read snapshots of versions "
            f"{sorted(versions)}; they must hold one"
        )
    return ExecuteStats(
        sum(p.bytes_moved for p in plans),
        sum(p.bytes_local for p in plans),
        tuple(sorted(parts)),
        sum(int(r["bytes_sent"]) for r in results),
        versions.pop() if versions else None,
    )


async def save_to_disk(
    directory: str, emu: EMU, holders: Mapping[int, ActorRef], *, durable: bool = True
) -> None:
    """Every device of ``emu`` writes its file in parallel; then the manifest.
    ``durable``: fsync files and folder (a fallback must survive the machine)."""
    plain = emu_to_plain(emu)
    await asyncio.gather(
        *(holders[d].save_checkpoint.call_one(str(directory), plain, durable) for d in emu.devices)
    )
    ckpt.write_manifest(directory, emu, durable=durable)


async def load_from_disk(directory: str, target: EMU, holders: Mapping[int, ActorRef]) -> EMU:
    """Every device of ``target`` reads its slices in parallel; returns ``target`` with
    the saved logical state."""
    plain = emu_to_plain(target)
    await asyncio.gather(
        *(holders[d].load_checkpoint.call_one(str(directory), plain) for d in target.devices)
    )
    return target.with_(state=LogicalState(**ckpt.read_manifest(directory)["state"]))
