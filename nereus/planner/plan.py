"""The plan: what the runtime executes and the simulator replays.

A ``Plan`` gives every model-stage a ``StagePlan``: tp, pp, dp and the device set of
each of its dp EMUs. Device indices are global indices of the ``ClusterSpec``
(node-major). Inside one EMU the devices are ordered pp-major: position
``pp_rank * tp + tp_rank``, so one pipeline stage's TP group is contiguous.

Promises: plain frozen dataclasses with ``to_dict``/``from_dict`` round trips through
plain data (msgpack, JSON); validation of the shape of every StagePlan.

Refuses (``ConfigError``): an EMU whose device count is not tp*pp, a dp that does not
match the number of EMUs, a device listed twice within one model-stage, negative
indices, non-power-of-two tp or pp.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nereus.config import require
from nereus.errors import ConfigError

__all__ = ["StagePlan", "Plan", "is_power_of_two"]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class StagePlan:
    """One model-stage's layout (tp x pp), its dp EMUs and their devices."""

    tp: int
    pp: int
    dp: int
    devices: tuple[tuple[int, ...], ...]
    # training: recompute activations in the backward pass (keep only layer inputs)
    recompute: bool = False
    # generation: decode each replica's sequences in this many successive batches
    # (at most ceil(sequences / dp / waves) at once: the engine's max concurrent sequences)
    waves: int = 1

    def __post_init__(self) -> None:
        require(
            isinstance(self.waves, int) and self.waves >= 1,
            "StagePlan.waves",
            self.waves,
            "must be an integer >= 1",
        )
        require(is_power_of_two(self.tp), "StagePlan.tp", self.tp, "must be a power of two")
        require(is_power_of_two(self.pp), "StagePlan.pp", self.pp, "must be a power of two")
        require(
            isinstance(self.dp, int) and self.dp >= 1,
            "StagePlan.dp",
            self.dp,
            "must be an integer >= 1",
        )
        require(
            len(self.devices) == self.dp,
            "StagePlan.devices",
            self.devices,
            f"must list dp={self.dp} EMUs",
        )
        size = self.tp * self.pp
        for emu in self.devices:
            require(
                len(emu) == size, "StagePlan.devices", emu, f"each EMU needs tp*pp={size} devices"
            )
        flat = [d for emu in self.devices for d in emu]
        if not all(isinstance(d, int) and d >= 0 for d in flat):
            bad = next(d for d in flat if not (isinstance(d, int) and d >= 0))
            require(False, "StagePlan.devices", bad, "must be a device index >= 0")
        if len(set(flat)) != len(flat):
            seen: set[int] = set()
            twice = next(d for d in flat if d in seen or seen.add(d))
            require(False, "StagePlan.devices", twice, "is listed twice")
        # not a field: what the devices say, read once (the transition DAG's regular case)
        back_to_back = bool(flat) and flat == list(range(flat[0], flat[0] + len(flat)))
        object.__setattr__(self, "_start", flat[0] if back_to_back else None)

    @property
    def start(self) -> int | None:
        """The first device when the EMUs lie back to back on consecutive devices
        (``on_range``'s placement), else None."""
        return self._start

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def device_set(self) -> frozenset[int]:
        return frozenset(d for emu in self.devices for d in emu)

    def layout(self) -> str:
        extra = ("·recompute" if self.recompute else "") + (
            f"·{self.waves} waves" if self.waves > 1 else ""
        )
        return f"tp{self.tp}·pp{self.pp}·dp{self.dp}{extra}"

    @staticmethod
    def on_range(
        tp: int, pp: int, dp: int, start: int, *, recompute: bool = False, waves: int = 1
    ) -> StagePlan:
        """EMUs laid out back to back on devices ``start .. start + tp*pp*dp - 1``."""
        size = tp * pp
        emus = tuple(tuple(range(start + r * size, start + (r + 1) * size)) for r in range(dp))
        return StagePlan(tp, pp, dp, emus, recompute, waves)


@dataclass(frozen=True)
class Plan:
    """Every model-stage's StagePlan, in the algorithm's model-stage order."""

    stages: tuple[tuple[str, StagePlan], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.stages]
        require(
            len(set(names)) == len(names), "Plan.stages", names, "must name each model-stage once"
        )

    def __getitem__(self, name: str) -> StagePlan:
        for n, sp in self.stages:
            if n == name:
                return sp
        raise ConfigError(f"model-stage {name!r} is not in the plan; it has {self.names}")

    def __iter__(self) -> Iterator[tuple[str, StagePlan]]:
        return iter(self.stages)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.stages]

    @property
    def devices(self) -> frozenset[int]:
        """Every device any model-stage uses."""
        out: set[int] = set()
        for _, sp in self.stages:
            out |= sp.device_set
        return frozenset(out)

    def describe(self) -> str:
        """One line per model-stage: its layout and device range(s)."""
        lines = []
        for n, sp in self.stages:
            devs = sorted(sp.device_set)
            span = (
                f"{devs[0]}-{devs[-1]}" if devs == list(range(devs[0], devs[-1] + 1)) else str(devs)
            )
            lines.append(f"{n}: {sp.layout()} on devices {span}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            n: {
                "tp": s.tp,
                "pp": s.pp,
                "dp": s.dp,
                "devices": [list(e) for e in s.devices],
                "recompute": s.recompute,
                "waves": s.waves,
            }
            for n, s in self.stages
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise ConfigError(
                f"plan={data!r} must be a table of model-stage -> {{tp, pp, dp, devices}}"
            )
        out = []
        for name, sp in data.items():
            keys = set(sp) if isinstance(sp, dict) else set()
            if (
                not {"tp", "pp", "dp", "devices"}
                <= keys
                <= {"tp", "pp", "dp", "devices", "recompute", "waves"}
            ):
                raise ConfigError(
                    f"plan.{name}={sp!r} must have the keys tp, pp, dp, devices "
                    "(and optionally recompute, waves)"
                )
            emus = tuple(tuple(int(d) for d in e) for e in sp["devices"])
            out.append(
                (
                    name,
                    StagePlan(
                        sp["tp"],
                        sp["pp"],
                        sp["dp"],
                        emus,
                        bool(sp.get("recompute", False)),
                        sp.get("waves", 1),
                    ),
                )
            )
        return Plan(tuple(out))
