"""Memory effect of running plans: bytes per device before, at peak, and after.

A primitive's memory effect counts, per device, the shards of the EMUs it touches:

- ``before``: every shard of the EMUs present when it starts;
- ``peak``: ``before`` + every target shard it allocates (a kept shard is adopted, not
  allocated) + one transfer bucket on each device that sends or receives (the data
  plane stages bytes through at most one bucket per device); source buffers stay alive
  until every transfer has finished, so nothing is subtracted before the peak;
- ``after``: ``before`` - the shards of the EMUs it frees + its target shards.

``check_fits`` compares a peak with each device's budget (``DeviceSet.memory_bytes``)
given what else is resident there, and raises ``OutOfMemory`` naming the device, the
bytes needed and the budget. Pure: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nereus.errors import OutOfMemory
from nereus.state.emu import EMU, DeviceSet
from nereus.state.reshard import ReshardPlan

__all__ = ["DEFAULT_BUCKET_BYTES", "MemoryEffect", "memory_effect", "check_fits"]

# Measured on 4 CPU workers over shared memory (buckets handed off within a host): a
# 236 MiB Extend takes ~0.10-0.17 s with 32 MiB buckets, ~0.17-0.2 s with 8 or 16 MiB
# and ~0.13-0.3 s with 64-128 MiB. GPU callers pass the transfer layer's GPU bucket.
DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class MemoryEffect:
    """Bytes per device of the EMUs a primitive touches: before, peak during, after."""

    before: Mapping[int, int]
    peak: Mapping[int, int]
    after: Mapping[int, int]

    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.before) | set(self.peak) | set(self.after)))

    def peak_delta(self, device: int) -> int:
        """Extra bytes on ``device`` at the peak, over what was there before."""
        return self.peak.get(device, 0) - self.before.get(device, 0)

    def after_delta(self, device: int) -> int:
        """Bytes gained (positive) or freed (negative) on ``device`` once done."""
        return self.after.get(device, 0) - self.before.get(device, 0)


def memory_effect(
    plans: Sequence[ReshardPlan],
    present: Sequence[EMU],
    freed: Sequence[EMU],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> MemoryEffect:
    """The effect of running ``plans`` while ``present`` EMUs exist, then freeing
    ``freed`` (a subset of ``present``)."""
    before: dict[int, int] = defaultdict(int)
    for emu in present:
        for d in emu.devices:
            before[d] += emu.bytes_on(d)
    alloc: dict[int, int] = defaultdict(int)
    created: dict[int, int] = defaultdict(int)
    traffic: dict[int, int] = defaultdict(int)
    for plan in plans:
        for d in plan.target.devices:
            created[d] += plan.target.bytes_on(d)
            alloc[d] += plan.target.bytes_on(d)
        for k in plan.keeps:
            alloc[k.device] -= k.nbytes
        for m in plan.remote_moves():
            traffic[m.src_device] += m.nbytes
            traffic[m.dst_device] += m.nbytes
    gone: dict[int, int] = defaultdict(int)
    for emu in freed:
        for d in emu.devices:
            gone[d] += emu.bytes_on(d)
    devices = set(before) | set(created)
    peak = {d: before[d] + alloc[d] + min(bucket_bytes, traffic[d]) for d in devices}
    after = {d: before[d] - gone[d] + created[d] for d in devices}
    return MemoryEffect(dict(before), peak, after)


def check_fits(
    effect: MemoryEffect,
    devices: DeviceSet | None,
    used: Mapping[int, int] | None = None,
    what: str = "",
) -> None:
    """Raise ``OutOfMemory`` if ``used[d] + peak[d]`` exceeds device ``d``'s budget.

    ``used`` is what else is resident on each device (other model-stages, caches)."""
    if devices is None or not devices.memory_bytes:
        return
    used = used or {}
    for d in effect.devices():
        budget = devices.budget(d)
        need = used.get(d, 0) + effect.peak.get(d, 0)
        if budget is not None and need > budget:
            raise OutOfMemory(d, need, budget, what)
