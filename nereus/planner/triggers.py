"""Triggers: when to consider a new plan (docs/design.md §6).

Hard triggers (``hard=True``) demand a replan now: devices lost or drained from the
pool, or a predicted memory violation of the current plan (the caller passes the
devices that ``explain`` found over their memory, with the need and the budget). Soft
triggers: devices that joined the pool, and signals that drift: a ``DriftSignal``
remembers its reference value (set at the last replan) and fires when the signal moves
more than ``threshold`` (30% for length) away from it.

A trigger names its ``kind`` (``device-pool``, ``memory``, ``drift``) and carries
``info``: ``detail`` (``lost``, ``drained``, ``joined``, ``length``, ``over-budget``, and
``follow-up`` from the Replanner after a compromise move)
and the devices, the predicted need and the budget where they apply.

Each time a signal goes from inside its threshold to beyond it counts as a *crossing*;
``horizon_steps`` is the moving average of the intervals between crossings (the first
interval runs from the step the signal was first seen), which admission uses as the
number of steps a new plan can expect to stay good. The controller calls ``reset`` on
every signal after every replan decision, admitted or rejected: the reference becomes
the current value, so a rejected replan is not re-triggered by the same drift.

Pure: steps are integers the caller supplies; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from nereus.config import require

__all__ = ["Trigger", "DriftSignal", "TriggerMonitor"]


@dataclass(frozen=True)
class Trigger:
    """Why a replan is being considered."""

    kind: str  # "device-pool" | "memory" | "drift"
    signal: str
    hard: bool
    step: int
    detail: str
    info: dict = field(default_factory=dict, compare=False)


class DriftSignal:
    """One signal (e.g. mean response length) against its reference at the last replan."""

    def __init__(self, name: str, threshold: float = 0.30, window: int = 8) -> None:
        require(threshold > 0, f"DriftSignal({name}).threshold", threshold, "must be > 0")
        require(window >= 1, f"DriftSignal({name}).window", window, "must be >= 1")
        self.name = name
        self.threshold = threshold
        self.reference: float | None = None
        self.reference_step: int | None = None
        self._first_step: int | None = None
        self._last_crossing: int | None = None
        self._beyond = False
        self.intervals: deque[int] = deque(maxlen=window)

    def drift(self, value: float) -> float:
        """Relative distance of ``value`` from the reference (0 before any reference)."""
        if self.reference is None:
            return 0.0
        return abs(value - self.reference) / max(abs(self.reference), 1e-12)

    def observe(self, step: int, value: float) -> Trigger | None:
        """Record the signal at ``step``; a Trigger when it is beyond the threshold.

        The first value seen becomes the reference. Only the step where the signal
        leaves the threshold band counts as a crossing (for the horizon); it keeps
        triggering while beyond, until ``reset``."""
        if self.reference is None:
            self.reference, self.reference_step, self._first_step = value, step, step
            return None
        d = self.drift(value)
        if d <= self.threshold:
            self._beyond = False
            return None
        if not self._beyond:
            self._beyond = True
            since = self._last_crossing if self._last_crossing is not None else self._first_step
            self.intervals.append(max(1, step - since))
            self._last_crossing = step
        return Trigger(
            "drift",
            self.name,
            False,
            step,
            f"{self.name}={value:.4g} drifted {d:.0%} from its reference {self.reference:.4g} "
            f"(step {self.reference_step}); threshold {self.threshold:.0%}",
            {
                "detail": self.name,
                "value": value,
                "reference": self.reference,
                "drift": d,
                "threshold": self.threshold,
            },
        )

    def reset(self, step: int, value: float) -> None:
        """After a replan decision (admitted or not): the reference becomes ``value``."""
        self.reference, self.reference_step = value, step
        self._beyond = False

    @property
    def horizon_steps(self) -> float | None:
        """Moving average of the intervals between crossings, or None before the first."""
        if not self.intervals:
            return None
        return sum(self.intervals) / len(self.intervals)


class PoolSignal:
    """Changes of the device pool, for the horizon of a join: the moving average of the
    intervals between changes, the first running from the step the pool was first seen
    (as a drift signal's first interval does: the pool the job started on lasted that
    long), and ``initial`` steps until two changes have been seen."""

    def __init__(self, initial: float, window: int = 8) -> None:
        require(initial > 0, "join_horizon_steps", initial, "must be > 0")
        self.initial = initial
        self.last: int | None = None  # the last change, or the step the pool was first seen
        self.intervals: deque[int] = deque(maxlen=max(2, window))

    def seen(self, step: int) -> None:
        """The pool was observed at ``step`` (the first call starts the first interval)."""
        if self.last is None:
            self.last = step

    def change(self, step: int) -> None:
        if self.last is None:
            self.last = step  # never seen before: this change starts the first interval
        elif step != self.last:
            self.intervals.append(max(1, step - self.last))
            self.last = step

    @property
    def horizon_steps(self) -> float:
        # one interval per change (the first from the step the pool was first seen)
        if len(self.intervals) < 2:
            return self.initial
        return sum(self.intervals) / len(self.intervals)


class TriggerMonitor:
    """The triggers of one job: the device pool, memory, and drifting signals."""

    def __init__(
        self,
        signals: dict[str, float] | None = None,
        window: int = 8,
        join_horizon_steps: float = 20.0,
    ) -> None:
        """``signals`` maps signal name -> relative threshold (default: length at 30%);
        ``join_horizon_steps``: the horizon of a join before two pool changes were seen."""
        thresholds = signals if signals is not None else {"length": 0.30}
        self.signals = {name: DriftSignal(name, t, window) for name, t in thresholds.items()}
        self.pool = PoolSignal(join_horizon_steps, window)
        self.devices: frozenset[int] | None = None

    def observe(
        self,
        step: int,
        *,
        devices: frozenset[int] | set[int],
        values: dict[str, float],
        memory_violations: Sequence[int | tuple[int, int, int]] = (),
        lost: Sequence[int] = (),
        drained: Sequence[int] = (),
        joined: Sequence[int] = (),
    ) -> list[Trigger]:
        """Everything that fires at ``step``: hard triggers first, then soft ones.

        ``lost``/``drained``/``joined`` name the devices that changed since the last
        boundary (a caller that knows them); without them a change of ``devices`` is
        read as losses and gains. ``memory_violations``: devices, or (device, need,
        budget) tuples, the current plan would break."""
        out: list[Trigger] = []
        pool = frozenset(devices)
        if not (lost or drained or joined) and self.devices is not None and pool != self.devices:
            lost, joined = sorted(self.devices - pool), sorted(pool - self.devices)
        self.devices = pool
        self.pool.seen(step)
        if lost or drained or joined:
            self.pool.change(step)
        for detail, devs in (("lost", lost), ("drained", drained)):
            if devs:
                out.append(
                    Trigger(
                        "device-pool",
                        "devices",
                        True,
                        step,
                        f"devices {detail} {sorted(devs)}",
                        {"detail": detail, "devices": sorted(devs)},
                    )
                )
        if memory_violations:
            items = [v if isinstance(v, tuple) else (v, 0, 0) for v in memory_violations]
            worst = max(items, key=lambda v: v[1] - v[2])
            out.append(
                Trigger(
                    "memory",
                    "memory",
                    True,
                    step,
                    f"the current plan exceeds memory on devices {sorted(v[0] for v in items)}",
                    {
                        "detail": "over-budget",
                        "devices": sorted(v[0] for v in items),
                        "device": worst[0],
                        "need_bytes": worst[1],
                        "budget_bytes": worst[2],
                    },
                )
            )
        if joined:
            out.append(
                Trigger(
                    "device-pool",
                    "devices",
                    False,
                    step,
                    f"devices joined {sorted(joined)}",
                    {"detail": "joined", "devices": sorted(joined)},
                )
            )
        unknown = sorted(set(values) - set(self.signals))
        require(not unknown, "values", unknown, f"are not monitored signals {sorted(self.signals)}")
        for name, value in values.items():
            t = self.signals[name].observe(step, value)
            if t is not None:
                out.append(t)
        return out

    def reset(self, step: int, values: dict[str, float]) -> None:
        """Reset every signal's reference after a replan decision, admitted or rejected."""
        for name, value in values.items():
            self.signals[name].reset(step, value)

    def horizon_steps(self, trigger: Trigger) -> float | None:
        """H for admission: the moving interval between crossings of the triggering
        signal (for a join: between changes of the pool)."""
        if trigger.kind == "device-pool":
            return self.pool.horizon_steps
        sig = self.signals.get(trigger.signal)
        return sig.horizon_steps if sig is not None else None
