"""Executing plans on worker processes, the workers' side: the shard store (``ShardHolder``).
The controller's side (``execute`` and its kin) is ``nereus.state.executor``.

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
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nereus.actors import Actor, device_threads, endpoint, in_thread
from nereus.errors import StateError
from nereus.state import checkpoint as ckpt
from nereus.state.apply import TORCH_DTYPES, run_part
from nereus.state.emu import LogicalState, emu_from_plain
from nereus.state.ledger import device_ledger
from nereus.state.memory import DEFAULT_BUCKET_BYTES
from nereus.state.snapshot import SnapshotHolder
from nereus.transfer import (
    arena_empty,
    arena_pool_stats,
    exchange,
    exchange_direct,
    get_communicator,
)

__all__ = ["ShardHolder"]

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
