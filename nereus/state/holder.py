"""Executing plans on worker processes: the shard store (``ShardHolder``) and ``execute``.

``ShardHolder`` is the actor that owns a worker's EMU state: ``self.shards[emu][key]``
(every EMU's parameters and optimizer slots on this device) and ``self.states[emu]``
(logical state). Engines are built over its tensors (``nereus.engines.EngineHost`` is a
``ShardHolder``), so what a reshard writes is what they compute with. Its endpoints:

Memory: the store reserves every EMU's bytes in the device's ``MemoryLedger``
(``nereus.state.ledger``; keys ``shards/<emu>``, a tensor two EMUs share counted once)
*before* allocating them, and, while it exchanges through buckets, one bucket (no
larger than what the part moves; peers of one host write straight into the new shards
and need none). A plan that does not fit raises ``OutOfMemory`` naming the device,
the need and the budget, and nothing is allocated, moved or freed. Sources are freed
only after the exchange returned, so a failed transfer loses nothing.

Freeing (``drop_shards``, ``run_plan``'s ``free``) takes the shards out of the holder at
once (``held`` and the ledger stop counting them); their memory is released by the
worker's event loop right after the reply has left, so the caller does not wait for
hundreds of MiB to be unmapped (a call already waiting in the actor's mailbox may run
before the release; a message that arrives later never does).

More (how it works): docs/state.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nereus.actors import Actor, ActorRef, device_threads, endpoint, in_thread
from nereus.errors import StateError
from nereus.state import checkpoint as ckpt
from nereus.state.apply import TORCH_DTYPES, plan_part, run_part
from nereus.state.emu import EMU, DeviceSet, LogicalState, emu_from_plain, emu_to_plain
from nereus.state.ledger import device_ledger
from nereus.state.memory import DEFAULT_BUCKET_BYTES, check_fits, memory_effect
from nereus.state.primitives import Step
from nereus.state.reshard import ReshardPlan
from nereus.state.snapshot import SnapshotHolder
from nereus.transfer import (
    arena_empty,
    arena_pool_stats,
    exchange,
    exchange_direct,
    get_communicator,
    make_group,
)

__all__ = [
    "ShardHolder",
    "ExecuteStats",
    "execute",
    "execute_step",
    "execute_into",
    "save_to_disk",
    "load_from_disk",
]

log = logging.getLogger("nereus.state")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _part_traffic(
    part: Mapping[str, Any], sources: Mapping[str, Mapping[str, torch.Tensor]]
) -> int:
    """Bytes a plan part sends and receives (each box times its tensor's element size)."""
    sizes = {key: TORCH_DTYPES[dt].itemsize for key, (_, dt) in part["tensors"].items()}
    total = 0
    for _, key, box in part["recvs"]:
        total += sizes[key] * math.prod(hi - lo for lo, hi in box)
    for _, src_emu, key, box in part["sends"]:
        held = sources.get(src_emu, {}).get(key)
        total += (held.element_size() if held is not None else 4) * math.prod(
            hi - lo for lo, hi in box
        )
    return total


class ShardHolder(SnapshotHolder, Actor):
    """This worker's shard store: every EMU's tensors on its device (see module docstring)."""

    shards: dict[str, dict[str, torch.Tensor]]
    states: dict[str, LogicalState]

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, direct: bool = True) -> None:
        """``direct=False`` moves every plan through buckets, even between processes
        that could write into each other's arenas (a baseline, and for comparison)."""
        torch.set_num_threads(device_threads())
        self.shards = {}
        self.states = {}
        self.bucket_bytes = int(bucket_bytes)
        self.direct = bool(direct)
        self.ledger = device_ledger()
        self._accounted: set[str] = set()
        # where this worker's tensors live (a worker sees exactly one GPU, cuda:0)
        self.tensor_device = torch.device(self.device.torch_device)

    # --- accounting ---------------------------------------------------------------

    def held_bytes(self) -> int:
        # a tensor adopted by two EMUs (a kept shard) is counted once
        seen: dict[int, int] = {}
        for tensors in self.shards.values():
            for t in tensors.values():
                seen[id(t)] = _nbytes(t)
        return sum(seen.values())

    def _account(self) -> None:
        """Make the ledger's ``shards/<emu>`` reservations what the store holds now (a
        tensor two EMUs share counts once, for the first that holds it)."""
        seen: set[int] = set()
        sizes: dict[str, int] = {}
        for name, tensors in self.shards.items():
            total = 0
            for t in tensors.values():
                if id(t) not in seen:
                    seen.add(id(t))
                    total += _nbytes(t)
            sizes[f"shards/{name}"] = total
        self.ledger.update(sizes, release=self._accounted - set(sizes), what="the shard store")
        self._accounted = set(sizes)

    def _reserve_new(self, emu: str, nbytes: int) -> None:
        """Reserve ``nbytes`` more for ``emu`` before allocating them (``OutOfMemory``,
        with nothing changed, when the device's budget cannot take them)."""
        key = f"shards/{emu}"
        self.ledger.reserve(key, self.ledger.held(key) + nbytes)
        self._accounted.add(key)

    # --- filling, reading, freeing ---------------------------------------------------

    @endpoint
    async def put_shards(
        self, emu: str, tensors: dict[str, torch.Tensor], state: dict | None = None
    ) -> int:
        """Hold ``tensors`` as ``emu``'s shards on this device; returns bytes held.

        Raises ``OutOfMemory`` (nothing held) when they do not fit the device's budget."""
        old = self.shards.get(emu, {})
        self._reserve_new(
            emu, sum(_nbytes(t) for t in tensors.values()) - sum(_nbytes(t) for t in old.values())
        )
        dev = self.tensor_device
        self.shards[emu] = {
            k: t.to(dev).contiguous()
            if t.device != dev
            else t.clone()
            if not t.is_contiguous()
            else t
            for k, t in tensors.items()
        }
        self.states[emu] = LogicalState(**state) if state else LogicalState()
        self._account()
        return self.held_bytes()

    @endpoint
    async def get_shards(self, emu: str, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        held = self._held_of(emu)
        # the wire carries CPU tensors only: a GPU worker answers with copies
        return {k: held[k].cpu() for k in (keys if keys is not None else held)}

    def _held_of(self, emu: str) -> dict[str, torch.Tensor]:
        if emu not in self.shards:
            raise StateError(
                f"device {self.device.index} holds no shards of EMU {emu!r} (holds "
                f"{sorted(self.shards)})"
            )
        return self.shards[emu]

    @endpoint
    async def get_state(self, emu: str) -> dict:
        return vars(self.states[emu]).copy() if emu in self.states else {}

    @endpoint
    async def set_state(self, emu: str, state: dict) -> None:
        """Record ``emu``'s logical state (update counter, policy version, sample position)."""
        self._held_of(emu)
        self.states[emu] = LogicalState(**state)

    @endpoint
    async def stamp_states(self, emus: list[str], fields: dict) -> None:
        """Set some fields of several EMUs' logical state (the others stay)."""
        for emu in emus:
            self._held_of(emu)
            self.states[emu] = LogicalState(
                **{**vars(self.states.get(emu, LogicalState())), **fields}
            )

    def _free(self, emus: Sequence[str]) -> None:
        """Take ``emus`` out of the holder now; release their memory after the reply."""
        dropped = [self.shards.pop(name, None) for name in emus]
        for name in emus:
            self.states.pop(name, None)
        self._account()
        # an endpoint's reply leaves in the same loop step as its return, so this runs after it
        asyncio.get_running_loop().call_soon(dropped.clear)

    @endpoint
    async def drop_shards(self, emus: list[str]) -> int:
        """Free ``emus``' shards on this device; returns the bytes still held."""
        self._free(emus)
        return self.held_bytes()

    @endpoint
    async def rename(self, renames: dict[str, str]) -> None:
        """Give EMUs new names (old -> new; tensors and state move with the name)."""
        clash = sorted(set(renames.values()) & (set(self.shards) - set(renames)))
        if clash:
            raise StateError(f"device {self.device.index}: cannot rename onto held EMUs {clash}")
        moved = {new: self.shards.pop(old) for old, new in renames.items() if old in self.shards}
        states = {new: self.states.pop(old) for old, new in renames.items() if old in self.states}
        self.shards.update(moved)
        self.states.update(states)
        self._account()

    @endpoint
    async def arena_stats(self) -> dict[str, int]:
        """This worker's pool of arenas (the memory peers write targets into): free and
        busy arenas and bytes. Busy bytes are shards alive now; dropped shards return
        their arena to the pool at once."""
        return arena_pool_stats()

    @endpoint(concurrent=True)
    async def held(self) -> dict[str, int]:
        return {name: sum(_nbytes(t) for t in ts.values()) for name, ts in self.shards.items()}

    @endpoint(concurrent=True)
    async def ledger_report(self, reset_peak: bool = False) -> dict[str, Any]:
        """This device's memory account: budget, used and peak bytes, breakdown by key;
        with ``reset_peak`` a new high-water mark starts after the report."""
        report = self.ledger.report()
        if reset_peak:
            self.ledger.reset_peak()
        return report

    # --- running plans -------------------------------------------------------------

    @endpoint
    async def run_plan(
        self,
        part: dict,
        group: str | None = None,
        group_devices: Sequence[int] = (),
        free: Sequence[str] = (),
        state: dict | None = None,
    ) -> dict:
        """Run this device's ``part`` of a plan; store the target; then free ``free``.

        Raises ``OutOfMemory`` (nothing done) when the target does not fit the budget."""
        t_start, cpu_start = time.perf_counter(), time.process_time()
        kept = {key for _, key in part["keeps"]}
        new = sum(
            torch.Size(shape).numel() * TORCH_DTYPES[dt].itemsize
            for key, (shape, dt) in part["tensors"].items()
            if key not in kept
        )
        moving = bool(part["sends"] or part["recvs"])
        target, bucket_key = part["target"], f"transfer/{part['target']}"
        comm = get_communicator(group) if group is not None else None
        # Same-host peers write straight into this worker's new shards (one copy per
        # byte); otherwise buckets, with whole received tensors adopted.
        direct = self.direct and bool(getattr(comm, "local_pids", None))
        # the device's budget is checked (and the bytes reserved) before anything is
        # allocated: the new shards and, unless peers write straight into them, one
        # bucket (no larger than what moves: the memory model's rule, nereus.state.memory)
        peers = {p for p, *_ in part["sends"]} | {p for p, *_ in part["recvs"]}
        local = getattr(comm, "local_pids", None) or {}
        all_direct = direct and all(
            rank_of_peer in local
            for rank_of_peer in (list(group_devices).index(p) for p in peers if p in group_devices)
        )
        bucket = (
            0
            if all_direct or not moving
            else min(self.bucket_bytes, _part_traffic(part, self.shards))
        )
        self.ledger.reserve(bucket_key, bucket)
        try:
            self._reserve_new(target, new)
        except BaseException:
            self.ledger.release(bucket_key)
            raise
        rank_of = {d: r for r, d in enumerate(group_devices)}
        stats: dict[str, Any] = {}

        def do_exchange(sends, recvs, copies=()):
            if comm is None:
                raise StateError(f"part for {target} moves tensors but no group was given")
            sends = {rank_of[p]: ts for p, ts in sends.items()}
            recvs = {rank_of[p]: ts for p, ts in recvs.items()}
            if direct:
                result = exchange_direct(comm, sends, recvs, copies, bucket_bytes=self.bucket_bytes)
            else:
                result = exchange(comm, sends, recvs, bucket_bytes=self.bucket_bytes, adopt=True)
            stats["bytes_sent"] = result.bytes_sent
            stats["bytes_received"] = result.bytes_received
            stats["exchange_s"] = result.seconds
            stats["prepare_s"] = time.perf_counter() - t_start - result.seconds

        try:
            if moving:
                # the exchange blocks; run it off the event loop so the worker stays responsive
                out = await in_thread(
                    run_part,
                    part,
                    self.shards,
                    do_exchange,
                    alloc=arena_empty if direct else None,
                    local_in_exchange=direct,
                    tensor_device=self.tensor_device,
                )
            else:
                out = run_part(part, self.shards, None, tensor_device=self.tensor_device)
        except BaseException:
            self.ledger.release(bucket_key)
            self._account()
            raise
        self.ledger.release(bucket_key)
        if part["tensors"] or part["keeps"]:
            self.shards[target] = out
            self.states[target] = LogicalState(**state) if state else LogicalState()
        self._free(free)
        stats["held_bytes"] = self.held_bytes()
        stats["seconds"] = time.perf_counter() - t_start
        stats["cpu_s"] = time.process_time() - cpu_start
        return stats

    @endpoint
    async def run_into(
        self,
        parts: list[dict],
        group: str | None = None,
        group_devices: Sequence[int] = (),
        bucket_bytes: int | None = None,
    ) -> dict:
        """Run this device's ``parts`` of several plans whose targets already exist,
        writing into the targets' tensors in place (a weight sync: engines that adopted
        those tensors see the new values). Every send and receive of every part moves in
        ONE bucketed exchange over ``group``, part after part in the order given (every
        device must list the plans in the same order). Returns bytes and seconds."""
        return await self._run_into(parts, group, group_devices, bucket_bytes)

    async def _run_into(
        self,
        parts: list[dict],
        group: str | None,
        group_devices: Sequence[int],
        bucket_bytes: int | None,
    ) -> dict:
        """``run_into``'s work (``send_snapshot`` runs it too, concurrently)."""
        t0 = time.perf_counter()
        rank_of = {d: r for r, d in enumerate(group_devices)}
        sends: dict[int, list[torch.Tensor]] = defaultdict(list)
        recvs: dict[int, list[torch.Tensor]] = defaultdict(list)

        def collect(s, r):
            for peer, views in s.items():
                sends[rank_of[int(peer)]] += views
            for peer, views in r.items():
                recvs[rank_of[int(peer)]] += views

        written = 0
        for part in parts:
            into = self.shards.get(part["target"]) if part["tensors"] else None
            if part["tensors"] and into is None:
                raise StateError(
                    f"device {self.device.index} holds no EMU {part['target']!r} to write into"
                )
            run_part(part, self.shards, collect, into=into)
            written += sum(
                torch.Size(shape).numel() * TORCH_DTYPES[dt].itemsize
                for shape, dt in part["tensors"].values()
            )
        stats = {"bytes_written": written, "bytes_sent": 0, "bytes_received": 0}
        if sends or recvs:
            if group is None:
                raise StateError(
                    f"device {self.device.index}: a sync part moves tensors but no group was given"
                )
            largest = max(
                sum(_nbytes(v) + 64 for v in vs) for vs in [*sends.values(), *recvs.values()]
            )
            # buckets no larger than what moves: a tiny model must not reserve 32 MiB per sync
            bucket = max(4096, min(bucket_bytes or self.bucket_bytes, largest))
            self.ledger.reserve("transfer/sync", bucket)
            try:
                result = await in_thread(
                    exchange, get_communicator(group), dict(sends), dict(recvs), bucket_bytes=bucket
                )
            finally:
                self.ledger.release("transfer/sync")
            stats["bytes_sent"], stats["bytes_received"] = result.bytes_sent, result.bytes_received
        stats["seconds"] = time.perf_counter() - t0
        return stats

    # --- checkpoints ---------------------------------------------------------------

    @endpoint
    async def save_checkpoint(self, directory: str, emu: dict, durable: bool = True) -> str:
        """Write this device's shard file of ``emu`` (plain EMU description); ``durable``:
        fsync it (see ``checkpoint.save_shards``)."""
        desc = emu_from_plain(emu)
        path = await asyncio.to_thread(
            ckpt.save_shards,
            directory,
            desc,
            self.device.index,
            self._held_of(desc.name),
            durable=durable,
        )
        return str(path)

    @endpoint
    async def load_checkpoint(self, directory: str, emu: dict) -> int:
        """Read this device's shards of ``emu`` from the checkpoint (any saved layout);
        returns bytes held. Raises ``OutOfMemory`` before reading when they do not fit."""
        desc = emu_from_plain(emu)
        old = self.shards.get(desc.name, {})
        self._reserve_new(
            desc.name, desc.bytes_on(self.device.index) - sum(_nbytes(t) for t in old.values())
        )
        try:
            tensors = await in_thread(ckpt.load_shards, directory, desc, self.device.index)
            if self.tensor_device.type != "cpu":
                tensors = {k: t.to(self.tensor_device) for k, t in tensors.items()}
        except BaseException:
            self._account()
            raise
        self.shards[desc.name] = tensors
        self.states[desc.name] = LogicalState(**ckpt.read_manifest(directory)["state"])
        self._account()
        return self.held_bytes()


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
