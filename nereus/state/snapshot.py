"""Published snapshots of an EMU's parameters, read by weight syncs while that EMU trains.

Asynchronous RL moves policy-training's weights into each generation EMU while the next
update already runs on the training workers. A sync that read the live parameters would
have to stop that update (its optimizer step rewrites them while they are sent), so
training would wait for every sync. Instead the trainer publishes each version once:

- ``snapshot(emu, name, version)`` copies the ``param`` slot of ``emu``'s shards on this
  device into the store's EMU ``name`` (allocated on the first call, reserved in the
  device's ledger as ``shards/<name>`` like any EMU's shards, written in place after);
- ``send_snapshot(parts, ...)`` runs a weight sync's parts that only read such snapshots
  (``ShardHolder.run_into``'s exchange, the same plans and groups), as a *concurrent*
  endpoint: it runs while a sequential call, the next training step, is in flight.

Promises: on one device a send and a snapshot never overlap (one lock), so a send reads
one version whole; both return the version the snapshot holds (its logical state's
``policy_version``, dropped with it; the caller tags what the receiver computes with it).
The copy is this device's parameter bytes, on the device.

Refuses (``StateError``): a snapshot of an EMU this device does not hold; a send whose
parts write, keep or receive on this device, or read anything but a snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from nereus.actors import endpoint
from nereus.errors import StateError
from nereus.state.emu import LogicalState, split_key

__all__ = ["SnapshotHolder", "snapshot_name"]


_SUFFIX = "@published"


def snapshot_name(emu: str) -> str:
    """The store name of ``emu``'s published snapshot."""
    return f"{emu}{_SUFFIX}"


class SnapshotHolder:
    """The snapshot endpoints of ``ShardHolder`` (see the module docstring)."""

    shards: dict[str, dict[str, torch.Tensor]]
    states: dict[str, LogicalState]

    def _snapshot_lock(self) -> asyncio.Lock:
        """The lock a snapshot and a send hold (made on first use, in the worker's loop)."""
        if not hasattr(self, "_snapshot_lock_"):
            self._snapshot_lock_ = asyncio.Lock()
        return self._snapshot_lock_

    @endpoint
    async def snapshot(self, emu: str, name: str, version: int) -> dict[str, int]:
        """Copy ``emu``'s parameters on this device into the snapshot ``name``, which then
        holds ``version``. Returns the bytes copied and the version."""
        held = self._held_of(emu)  # type: ignore[attr-defined]
        params = {k: t for k, t in held.items() if split_key(k)[0] == "param"}
        async with self._snapshot_lock():
            dst = self.shards.get(name)
            if dst is None or not _same_shapes(dst, params):
                if dst is not None:
                    self._free([name])  # type: ignore[attr-defined]
                # reserved before allocating: OutOfMemory leaves the store as it was
                self._reserve_new(name, sum(t.nbytes for t in params.values()))  # type: ignore[attr-defined]
                dst = {k: torch.empty_like(t) for k, t in params.items()}
                self.shards[name] = dst
                self._account()  # type: ignore[attr-defined]
            with torch.no_grad():
                for k, t in params.items():
                    dst[k].copy_(t)
            if any(t.is_cuda for t in dst.values()):
                torch.cuda.current_stream().synchronize()  # the send reads it from another call
            self.states[name] = LogicalState(policy_version=int(version))
        return {"bytes": sum(t.nbytes for t in dst.values()), "version": int(version)}

    @endpoint(concurrent=True)
    async def send_snapshot(
        self,
        parts: list[dict],
        group: str | None = None,
        group_devices: Sequence[int] = (),
        bucket_bytes: int | None = None,
    ) -> dict[str, Any]:
        """This device's sends of a weight sync that reads only snapshots, concurrently
        with whatever sequential call runs (``run_into``'s exchange). Returns its stats
        with the version the snapshots held."""
        device = self.device.index  # type: ignore[attr-defined]
        read: set[str] = set()
        for part in parts:
            for field in ("tensors", "keeps", "copies", "recvs"):
                if part[field]:
                    raise StateError(
                        f"device {device}: a snapshot send for {part['target']!r} has "
                        f"{field} here; it may only send"
                    )
            read |= {src for _, src, _, _ in part["sends"]}
        held_here = sorted(n for n in self.shards if n.endswith(_SUFFIX))
        unknown = sorted(read - set(held_here))
        if unknown:
            raise StateError(
                f"device {device}: a snapshot send reads {unknown}, which are not snapshots "
                f"here (snapshots: {held_here})"
            )
        async with self._snapshot_lock():
            held = {self.states[s].policy_version for s in read}
            if len(held) > 1:
                raise StateError(
                    f"device {device}: the snapshots {sorted(read)} hold versions "
                    f"{sorted(held)}; a sync must read one version"
                )
            stats = await self._run_into(parts, group, group_devices, bucket_bytes)  # type: ignore[attr-defined]
        stats["version"] = held.pop() if held else -1
        return stats


def _same_shapes(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> bool:
    return set(dst) == set(src) and all(
        dst[k].shape == t.shape and dst[k].dtype == t.dtype and dst[k].device == t.device
        for k, t in src.items()
    )
