"""Executing plans on worker processes: the ``ShardHolder`` actor and ``execute``.

``ShardHolder`` is an actor (and a mixin: engines subclass it so weight sync and
reshard reuse it) that keeps this worker's shards: ``self.shards[emu][key]`` (parameters
and optimizer tensors) and ``self.states[emu]`` (logical state). Its endpoints:

- ``put_shards`` / ``get_shards`` / ``drop_shards`` / ``held``: fill, read, free, list;
- ``run_plan(part, group, free)``: this worker's part of a ``ReshardPlan`` in one call -- keeps,
  local copies and one exchange over the group's communicator -- stores the target's
  tensors and state, then frees the EMUs in ``free``. Between processes of one host
  the new shards are views of one arena (``nereus.transfer.arena_empty``: pooled,
  pre-faulted shared memory) that the senders copy into directly
  (``exchange_direct``, one copy per moved byte, local copies overlapping the peers');
  otherwise (or with ``direct=False``) a bucketed ``exchange`` (adopting: a target
  shard received whole keeps the received bucket as its memory, no unpack copy). The
  arena returns to this process's pool when every shard on it is dropped; the pool's
  free arenas are not counted as held. Returns stats (bytes, ``seconds``,
  ``exchange_s``, ``prepare_s``, ``cpu_s``: this process's CPU time, readable on a
  loaded machine);
- ``save_checkpoint`` / ``load_checkpoint``: the fallback, each worker writing or
  reading only its own files and slices.

Before allocating anything ``run_plan`` checks this device's budget (the held bytes +
the new shards + one bucket): a plan that does not fit raises ``OutOfMemory`` and
nothing is allocated, moved or freed. Sources are freed only after the exchange
returned, so a failed transfer loses nothing.

Freeing (``drop_shards``, ``run_plan``'s ``free``) takes the shards out of the holder at
once (``held`` and the budget stop counting them); their memory is released by the
worker's event loop right after the reply has left, so the caller does not wait for
hundreds of MiB to be unmapped (a call already waiting in the actor's mailbox may run
before the release; a message that arrives later never does).

``await execute(plan, holders, cluster)`` on the driver sends each worker of the plan
ONE message (its part) and makes the group the parts exchange over;
``execute_step`` runs a primitive ``Step`` (its plans, then its frees).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nereus.actors import Actor, ActorRef, endpoint, in_thread
from nereus.errors import OutOfMemory, StateError
from nereus.state import checkpoint as ckpt
from nereus.state.apply import TORCH_DTYPES, plan_part, run_part
from nereus.state.emu import EMU, DeviceSet, LogicalState, emu_from_plain, emu_to_plain
from nereus.state.memory import DEFAULT_BUCKET_BYTES, check_fits, memory_effect
from nereus.state.plan import ReshardPlan
from nereus.state.primitives import Step
from nereus.transfer import (
    arena_empty,
    arena_pool_stats,
    exchange,
    exchange_direct,
    get_communicator,
    make_group,
)

__all__ = ["ShardHolder", "ExecuteStats", "execute", "execute_step", "save_to_disk", "load_from_disk"]

log = logging.getLogger("nereus.state")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ShardHolder(Actor):
    """Holds this worker's shards of every EMU on its device (see module docstring)."""

    shards: dict[str, dict[str, torch.Tensor]]
    states: dict[str, LogicalState]

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, direct: bool = True) -> None:
        """``direct=False`` moves every plan through buckets, even between processes
        that could write into each other's arenas (a baseline, and for comparison)."""
        torch.set_num_threads(1)
        self.shards = {}
        self.states = {}
        self.bucket_bytes = int(bucket_bytes)
        self.direct = bool(direct)

    def held_bytes(self) -> int:
        # a tensor adopted by two EMUs (a kept shard) is counted once
        seen: dict[int, int] = {}
        for tensors in self.shards.values():
            for t in tensors.values():
                seen[id(t)] = _nbytes(t)
        return sum(seen.values())

    @endpoint
    async def put_shards(self, emu: str, tensors: dict[str, torch.Tensor], state: dict | None = None) -> int:
        """Hold ``tensors`` as ``emu``'s shards on this device; returns bytes held."""
        self.shards[emu] = {k: t.clone() if not t.is_contiguous() else t for k, t in tensors.items()}
        self.states[emu] = LogicalState(**state) if state else LogicalState()
        return self.held_bytes()

    @endpoint
    async def get_shards(self, emu: str, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        if emu not in self.shards:
            raise StateError(f"device {self.device.index} holds no shards of EMU {emu!r} (holds {sorted(self.shards)})")
        held = self.shards[emu]
        return {k: held[k] for k in (keys if keys is not None else held)}

    @endpoint
    async def get_state(self, emu: str) -> dict:
        return vars(self.states[emu]).copy() if emu in self.states else {}

    def _free(self, emus: Sequence[str]) -> None:
        """Take ``emus`` out of the holder now; release their memory after the reply."""
        dropped = [self.shards.pop(name, None) for name in emus]
        for name in emus:
            self.states.pop(name, None)
        # an endpoint's reply leaves in the same loop step as its return, so this runs after it
        asyncio.get_running_loop().call_soon(dropped.clear)

    @endpoint
    async def drop_shards(self, emus: list[str]) -> int:
        """Free ``emus``' shards on this device; returns the bytes still held."""
        self._free(emus)
        return self.held_bytes()

    @endpoint
    async def arena_stats(self) -> dict[str, int]:
        """This worker's pool of arenas (the memory peers write targets into): free and
        busy arenas and bytes. Busy bytes are shards alive now; dropped shards return
        their arena to the pool at once."""
        return arena_pool_stats()

    @endpoint
    async def held(self) -> dict[str, int]:
        return {name: sum(_nbytes(t) for t in ts.values()) for name, ts in self.shards.items()}

    def _check_budget(self, part: Mapping[str, Any]) -> None:
        budget = self.device.memory_bytes
        kept = {key for _, key in part["keeps"]}
        new = sum(torch.Size(shape).numel() * TORCH_DTYPES[dt].itemsize
                  for key, (shape, dt) in part["tensors"].items() if key not in kept)
        moving = sum(1 for _ in part["sends"]) + sum(1 for _ in part["recvs"])
        need = self.held_bytes() + new + (self.bucket_bytes if moving else 0)
        if budget and need > budget:
            raise OutOfMemory(self.device.index, need, budget, f"plan building {part['target']}")

    @endpoint
    async def run_plan(self, part: dict, group: str | None = None, group_devices: Sequence[int] = (),
                       free: Sequence[str] = (), state: dict | None = None) -> dict:
        """Run this device's ``part`` of a plan; store the target; then free ``free``.

        Raises ``OutOfMemory`` (nothing done) when the target does not fit the budget."""
        t_start, cpu_start = time.perf_counter(), time.process_time()
        self._check_budget(part)
        rank_of = {d: r for r, d in enumerate(group_devices)}
        stats: dict[str, Any] = {}

        comm = get_communicator(group) if group is not None else None
        # Same-host peers write straight into this worker's new shards (one copy per
        # byte); otherwise buckets, with whole received tensors adopted.
        direct = self.direct and bool(getattr(comm, "local_pids", None))

        def do_exchange(sends, recvs, copies=()):
            if comm is None:
                raise StateError(f"part for {part['target']} moves tensors but no group was given")
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

        sources = self.shards
        if part["sends"] or part["recvs"]:
            # the exchange blocks; run it off the event loop so the worker stays responsive
            out = await in_thread(run_part, part, sources, do_exchange,
                                   alloc=arena_empty if direct else None, local_in_exchange=direct)
        else:
            out = run_part(part, sources, None)
        if part["tensors"] or part["keeps"]:
            self.shards[part["target"]] = out
            self.states[part["target"]] = LogicalState(**state) if state else LogicalState()
        self._free(free)
        stats["held_bytes"] = self.held_bytes()
        stats["seconds"] = time.perf_counter() - t_start
        stats["cpu_s"] = time.process_time() - cpu_start
        return stats

    @endpoint
    async def save_checkpoint(self, directory: str, emu: dict, durable: bool = True) -> str:
        """Write this device's shard file of ``emu`` (plain EMU description); ``durable``:
        fsync it (see ``checkpoint.save_shards``)."""
        desc = emu_from_plain(emu)
        path = await asyncio.to_thread(ckpt.save_shards, directory, desc, self.device.index,
                                       self.shards[desc.name], durable=durable)
        return str(path)

    @endpoint
    async def load_checkpoint(self, directory: str, emu: dict) -> int:
        """Read this device's shards of ``emu`` from the checkpoint; returns bytes held."""
        desc = emu_from_plain(emu)
        tensors = await in_thread(ckpt.load_shards, directory, desc, self.device.index)
        self.shards[desc.name] = tensors
        self.states[desc.name] = LogicalState(**ckpt.read_manifest(directory)["state"])
        return self.held_bytes()


@dataclass(frozen=True)
class ExecuteStats:
    """``bytes_moved`` and ``bytes_local``: the plan's figures; ``bytes_sent`` and
    ``bytes_received``: what the workers' exchanges counted (0 when nothing moved)."""

    bytes_moved: int
    bytes_local: int
    devices: tuple[int, ...]
    bytes_sent: int = 0
    bytes_received: int = 0


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
) -> ExecuteStats:
    """Run ``plan`` on the ``ShardHolder`` of each of its devices (device -> ref), ONE
    message per worker, then free ``free`` (EMUs) on their devices.

    With ``devices`` (budgets) and ``used`` (what else is resident), the plan's memory
    effect is checked first and ``OutOfMemory`` raised before any message is sent.
    Otherwise each worker checks its own budget; a worker that refuses (or fails)
    makes the driver destroy the plan's group, so its peers fail at once instead of
    waiting for it, and nothing is freed anywhere. Raises the first worker's error."""
    if devices is not None:
        check_fits(memory_effect([plan], plan.sources, free, bucket_bytes), devices, used,
                   f"plan building {plan.target.name}")
    involved = set(plan.devices())
    frees: dict[int, list[str]] = {}
    for emu in free:
        for d in emu.devices:
            frees.setdefault(d, []).append(emu.name)
    involved |= set(frees)
    missing = sorted(d for d in involved if d not in holders)
    if missing:
        raise StateError(f"no ShardHolder on devices {missing} for plan building {plan.target.name}")
    group_devices = sorted(plan.devices()) if plan.remote_moves() else []
    group = await make_group(cluster, devices=group_devices, epoch=epoch) if group_devices else None
    state = vars(plan.state).copy()
    # Devices with the least to prepare (sends and local copies) first: receivers
    # publish where their views live before the senders are ready to write, so no
    # sender waits for a late record. Each part is built just before its message.
    work = Counter(m.src_device for m in plan.moves)
    tasks = [
        asyncio.ensure_future(holders[d].run_plan.call_one(
            plan_part(plan, d), group.group_id if group and d in group_devices else None,
            group_devices, frees.get(d, []), state))
        for d in sorted(involved, key=lambda d: (work[d], d))
    ]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    if group is not None and any(t.exception() is not None for t in done):
        # a refusing or dead worker never enters the exchange: wake its peers now
        await group.destroy()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        root = [e for e in errors if "TransferError" not in str(getattr(e, "remote_type", type(e).__name__))]
        log.warning("plan building %s failed on %d of %d workers", plan.target.name, len(errors), len(tasks))
        raise (root or errors)[0]
    return ExecuteStats(plan.bytes_moved, plan.bytes_local, tuple(sorted(involved)),
                        sum(r.get("bytes_sent", 0) for r in results),
                        sum(r.get("bytes_received", 0) for r in results))


async def execute_step(
    step: Step,
    holders: Mapping[int, ActorRef],
    cluster: Any,
    *,
    epoch: int = 0,
    devices: DeviceSet | None = None,
    used: Mapping[int, int] | None = None,
) -> int:
    """Run a primitive ``Step`` on the workers: its plans (one message per worker each;
    a one-plan step frees its inputs in the same message), then free what it frees.
    A Destroy only drops shards. Returns the bytes moved between devices."""
    moved = 0
    if len(step.plans) == 1:
        stats = await execute(step.plans[0], holders, cluster, free=step.freed, epoch=epoch,
                              devices=devices, used=used)
        return stats.bytes_moved
    for plan in step.plans:
        moved += (await execute(plan, holders, cluster, epoch=epoch, devices=devices, used=used)).bytes_moved
    frees: dict[int, list[str]] = {}
    for emu in step.freed:
        for d in emu.devices:
            frees.setdefault(d, []).append(emu.name)
    await asyncio.gather(*(holders[d].drop_shards.call_one(names) for d, names in frees.items()))
    return moved


async def save_to_disk(directory: str, emu: EMU, holders: Mapping[int, ActorRef], *,
                       durable: bool = True) -> None:
    """Every device of ``emu`` writes its file in parallel; then the manifest.
    ``durable``: fsync files and folder (a fallback must survive the machine)."""
    plain = emu_to_plain(emu)
    await asyncio.gather(*(holders[d].save_checkpoint.call_one(str(directory), plain, durable)
                           for d in emu.devices))
    ckpt.write_manifest(directory, emu, durable=durable)


async def load_from_disk(directory: str, target: EMU, holders: Mapping[int, ActorRef]) -> EMU:
    """Every device of ``target`` reads its slices in parallel; returns ``target`` with
    the saved logical state."""
    plain = emu_to_plain(target)
    await asyncio.gather(*(holders[d].load_checkpoint.call_one(str(directory), plain) for d in target.devices))
    return target.with_(state=LogicalState(**ckpt.read_manifest(directory)["state"]))
