"""The one map between a cluster's device ids and the planner's device slots.

The planner plans for ``ClusterSpec.num_devices`` slots numbered from 0 (node-major);
a running cluster's device ids are whatever its controller gave (not contiguous once
devices leave and join: a drained device 3 and a joined node's device 4 leave slots
0..3 over ids 0, 1, 2, 4). ``DevicePool(ids)`` orders the live ids and maps plans both
ways: ``to_slots(plan)`` before the planner looks at a job's plan, ``to_devices(plan)``
before the runtime executes one the planner made. Nothing else converts.

Refuses (``ConfigError``): repeated ids, a plan that names a device or slot outside the
pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nereus.config import require
from nereus.errors import ConfigError
from nereus.planner.plan import Plan, StagePlan

__all__ = ["DevicePool"]


@dataclass(frozen=True)
class DevicePool:
    """Live device ids in slot order (slot ``i`` is ``ids[i]``)."""

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(sorted(self.ids)))
        require(
            len(set(self.ids)) == len(self.ids),
            "DevicePool.ids",
            self.ids,
            "must not repeat a device",
        )

    @classmethod
    def of(cls, ids: Iterable[int]) -> DevicePool:
        return cls(tuple(ids))

    def __len__(self) -> int:
        return len(self.ids)

    def slot(self, device: int) -> int:
        try:
            return self.ids.index(device)
        except ValueError:
            raise ConfigError(f"device={device} is not in the pool {list(self.ids)}") from None

    def device(self, slot: int) -> int:
        require(
            0 <= slot < len(self.ids),
            "slot",
            slot,
            f"must be in [0, {len(self.ids)}) (the pool's size)",
        )
        return self.ids[slot]

    def _map(self, plan: Plan, fn) -> Plan:
        return Plan(
            tuple(
                (
                    name,
                    StagePlan(
                        sp.tp,
                        sp.pp,
                        sp.dp,
                        tuple(tuple(fn(d) for d in emu) for emu in sp.devices),
                        sp.recompute,
                        sp.waves,
                    ),
                )
                for name, sp in plan
            )
        )

    def to_slots(self, plan: Plan, *, gone: Sequence[int] = ()) -> Plan:
        """``plan`` over device ids -> the same plan over the planner's slots. ``gone``:
        devices that left the pool, put past its last slot in that order (a plan on them
        cannot run on the pool, which is what the planner must see)."""
        past = {d: len(self.ids) + i for i, d in enumerate(gone)}
        require(
            not set(past) & set(self.ids),
            "gone",
            list(gone),
            f"must not name devices in the pool {list(self.ids)}",
        )
        slots = {d: i for i, d in enumerate(self.ids)} | past  # one lookup a device, not a scan
        return self._map(plan, lambda d: slots[d] if d in slots else self.slot(d))

    def to_devices(self, plan: Plan) -> Plan:
        """``plan`` over the planner's slots -> the same plan over device ids."""
        return self._map(plan, self.device)
