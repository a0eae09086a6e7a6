"""Traces the simulator replays: device availability and response lengths.

Traces are read from the paths given (``../shared/traces/...``); nothing here copies
one into the project.

- ``device_trace``: a spot-availability file (the count of single-GPU instances at each
  tick, scaled by ``pool_scale``, or mapped onto ``pool_range`` from ``offset_ticks`` on; every
  policy sees the same nodes leave at the same time for a given seed) or ``growth:LO:HI`` devices;
  ``StepPoolTrace``: a running job's device count at each step, single devices of one node
  (a host's worker processes drained and added one by one);
- ``length_trace``: a response-length file (resampled onto the run's steps, optionally
  rescaled to ``length_range``) or ``growth:LO:HI`` tokens; with the file's per-step
  maximum where it gives one (``max``, else ``seq_len_max``: see ``length_trace``);
- ``pool_at_steps``: the same device specs as a live device count at each step (one
  tick of a spot trace a step, scaled to the cluster's devices, at least one), for a
  running job's environment (``nereus.job.traces``);
- ``cap_schedule``: the job's generation cap at every step, ``stepped`` (raised in
  powers of two as responses grow, never lowered) or ``fixed``; a step's sampled
  maximum never exceeds it.

Refuses (``ConfigError``): a spec that is neither an existing file nor ``growth:LO:HI``,
counts that are not integers in [0, 16], lengths below 1 token, bad ranges, a cap
schedule other than ``stepped`` or ``fixed``.

More (how it works): docs/simulation.md.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nereus.config import require
from nereus.errors import ConfigError
from nereus.planner.cluster import ClusterSpec, local_cpu_cluster

__all__ = [
    "DeviceTrace",
    "SpotTrace",
    "GrowthTrace",
    "StepPoolTrace",
    "LengthTrace",
    "CapSchedule",
    "device_trace",
    "length_trace",
    "cap_schedule",
    "pool_at_steps",
    "SPOT_INSTANCES",
    "CAP_SCHEDULES",
]

SPOT_INSTANCES = 16  # the spot traces count instances of a 16-node job
CAP_SCHEDULES = ("stepped", "fixed")


def _parse_growth(spec: str, field: str) -> tuple[float, float] | None:
    if not spec.startswith("growth:"):
        return None
    parts = spec.split(":")
    try:
        lo, hi = float(parts[1]), float(parts[2])
        ok = len(parts) == 3 and 0 < lo <= hi
    except (IndexError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{field}={spec!r} must be growth:LO:HI with 0 < LO <= HI")
    return lo, hi


class DeviceTrace:
    """The nodes available over a run (see the module docstring). With ``per_device``
    its "nodes" are the devices of a one-node cluster, each coming and going alone (a
    host's worker processes, as a running job's pool trace drains and adds them). With
    ``drains`` a device that leaves is drained, not lost: it keeps what it holds until
    the job's next change has moved that off it."""

    name: str
    time_based: bool
    per_device: bool = False
    drains: bool = False

    def nodes_at(self, seconds: float, step: int) -> frozenset[int]:
        raise NotImplementedError

    def first_loss(self, start: float, end: float, nodes: frozenset[int]) -> float | None:
        """The first time in (start, end] at which one of ``nodes`` is gone, or None."""
        raise NotImplementedError

    def next_available(self, seconds: float, step: int) -> float | None:
        """The first time >= ``seconds`` at which some node is available (None: never)."""
        raise NotImplementedError

    def next_change(self, seconds: float, step: int) -> float | None:
        """The first time after ``seconds`` at which the available nodes differ (None:
        they never change again at this step)."""
        raise NotImplementedError


class SpotTrace(DeviceTrace):
    """A spot-availability trace over ``cluster``'s nodes."""

    time_based = True

    def __init__(
        self,
        counts: list[int],
        gap_seconds: float,
        cluster: ClusterSpec,
        pool_scale: float,
        seed: int,
        name: str = "spot",
        pool_range: tuple[int, int] | None = None,
    ) -> None:
        require(len(counts) >= 1, "spot trace data", counts, "must hold at least one count")
        for c in counts:
            require(
                isinstance(c, int) and 0 <= c <= SPOT_INSTANCES,
                "spot trace count",
                c,
                f"must be an integer in [0, {SPOT_INSTANCES}]",
            )
        require(gap_seconds > 0, "spot trace gap_seconds", gap_seconds, "must be > 0")
        require(pool_scale > 0, "pool_scale", pool_scale, "must be > 0 devices per instance")
        self.name, self.gap, self.cluster = name, float(gap_seconds), cluster
        self.counts = counts
        per = cluster.devices_per_node
        if pool_range is not None:
            lo, hi = pool_range
            require(
                per <= lo <= hi <= cluster.num_devices,
                "pool_range",
                pool_range,
                f"must be LO HI devices with {per} <= LO <= HI <= {cluster.num_devices}",
            )
            # a count of 0 is LO devices, a full count HI, whole nodes
            self.node_counts = [int(lo + (hi - lo) * c / SPOT_INSTANCES) // per for c in counts]
        else:
            self.node_counts = [min(cluster.nodes, int(c * pool_scale) // per) for c in counts]
        rng = random.Random(seed)
        live: set[int] = set()
        self.members: list[frozenset[int]] = []
        for n in self.node_counts:
            if n < len(live):
                live -= set(rng.sample(sorted(live), len(live) - n))
            elif n > len(live):
                free = [k for k in range(cluster.nodes) if k not in live]
                live |= set(free[: n - len(live)])
            self.members.append(frozenset(live))

    def _tick(self, seconds: float) -> int:
        return int(math.floor(seconds / self.gap))

    def _at_tick(self, tick: int) -> frozenset[int]:
        return self.members[tick % len(self.members)]

    def nodes_at(self, seconds: float, step: int) -> frozenset[int]:
        return self._at_tick(self._tick(seconds))

    def first_loss(self, start: float, end: float, nodes: frozenset[int]) -> float | None:
        for tick in range(self._tick(start) + 1, self._tick(end) + 1):
            if not nodes <= self._at_tick(tick):
                return tick * self.gap
        return None

    def next_available(self, seconds: float, step: int) -> float | None:
        first = self._tick(seconds)
        for tick in range(first, first + len(self.members) + 1):
            if self._at_tick(tick):
                return max(seconds, tick * self.gap)
        return None

    def next_change(self, seconds: float, step: int) -> float | None:
        first = self._tick(seconds)
        now = self._at_tick(first)
        for tick in range(first + 1, first + len(self.members) + 1):
            if self._at_tick(tick) != now:
                return tick * self.gap
        return None


class GrowthTrace(DeviceTrace):
    """``lo`` to ``hi`` devices over ``steps`` steps, whole nodes from node 0."""

    time_based = False

    def __init__(
        self, lo: float, hi: float, steps: int, cluster: ClusterSpec, name: str = "growth"
    ) -> None:
        require(
            hi <= cluster.num_devices,
            "growth HI",
            hi,
            f"must be at most {cluster.name}'s {cluster.num_devices} devices",
        )
        require(
            lo >= cluster.devices_per_node,
            "growth LO",
            lo,
            f"must be at least one node ({cluster.devices_per_node} devices)",
        )
        self.name, self.lo, self.hi, self.steps, self.cluster = name, lo, hi, steps, cluster

    def devices_at_step(self, step: int) -> int:
        frac = step / max(1, self.steps - 1)
        devices = self.lo + (self.hi - self.lo) * min(1.0, max(0.0, frac))
        per = self.cluster.devices_per_node
        return int(devices + 1e-9) // per * per

    def nodes_at(self, seconds: float, step: int) -> frozenset[int]:
        return frozenset(range(self.devices_at_step(step) // self.cluster.devices_per_node))

    def first_loss(self, start: float, end: float, nodes: frozenset[int]) -> float | None:
        return None

    def next_available(self, seconds: float, step: int) -> float | None:
        return seconds

    def next_change(self, seconds: float, step: int) -> float | None:
        return None


class StepPoolTrace(DeviceTrace):
    """A running job's pool as the simulator replays it: ``counts[s]`` devices of one
    node live for step s (devices 0 .. counts[s] - 1; past the last count, the last),
    changing only at step boundaries, as ``nereus.job.traces.PoolTrace`` drains and adds
    single devices (a device that leaves is drained: ``drains``)."""

    time_based = False
    per_device = True
    drains = True

    def __init__(self, counts: Sequence[int], name: str = "steps") -> None:
        require(
            len(counts) >= 1 and all(isinstance(c, int) and c >= 1 for c in counts),
            "counts",
            list(counts)[:8],
            "must be one integer >= 1 (devices) per step",
        )
        self.counts, self.name = tuple(counts), name

    def nodes_at(self, seconds: float, step: int) -> frozenset[int]:
        return frozenset(range(self.counts[min(step, len(self.counts) - 1)]))

    def first_loss(self, start: float, end: float, nodes: frozenset[int]) -> float | None:
        return None

    def next_available(self, seconds: float, step: int) -> float | None:
        return seconds

    def next_change(self, seconds: float, step: int) -> float | None:
        return None


def device_trace(
    spec: str,
    cluster: ClusterSpec,
    steps: int,
    *,
    pool_scale: float | None = None,
    seed: int = 0,
    pool_range: tuple[int, int] | None = None,
    offset_ticks: int = 0,
) -> DeviceTrace:
    """``growth:LO:HI`` or the path of a spot-availability JSON file (module docstring)."""
    growth = _parse_growth(spec, "--gpus-trace")
    if growth is not None:
        return GrowthTrace(growth[0], growth[1], steps, cluster, name=spec)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--gpus-trace={spec!r} must be growth:LO:HI or the path of a spot-availability "
            'JSON file ({"metadata": {"gap_seconds": ...}, "data": [...]})'
        )
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "data" not in data:
        raise ConfigError(
            f'--gpus-trace={spec!r} must hold {{"metadata": ..., "data": [count, ...]}}'
        )
    gap = float(data.get("metadata", {}).get("gap_seconds", 300))
    scale = pool_scale if pool_scale is not None else cluster.num_devices / SPOT_INSTANCES
    counts = list(data["data"])
    require(
        0 <= offset_ticks < len(counts),
        "offset_ticks",
        offset_ticks,
        f"must be in [0, {len(counts)})",
    )
    counts = counts[offset_ticks:] + counts[:offset_ticks]
    name = path.stem if not offset_ticks else f"{path.stem}+{offset_ticks}"
    return SpotTrace(counts, gap, cluster, scale, seed, name=name, pool_range=pool_range)


@dataclass(frozen=True)
class LengthTrace:
    """Mean response length (tokens) of every step of the run, and where it came from."""

    name: str
    means: tuple[float, ...]
    # the 95th percentile of every step (None: the trace gives none)
    p95s: tuple[float, ...] | None = None
    # the longest response of every step (None: the trace gives none)
    maxima: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        require(
            len(self.means) >= 1, "LengthTrace.means", self.means, "must hold at least one step"
        )
        low = min(self.means)
        require(low >= 1, "LengthTrace.means", low, "must be >= 1 token at every step")
        if self.p95s is not None:
            require(
                len(self.p95s) == len(self.means)
                and all(p >= m for p, m in zip(self.p95s, self.means, strict=True)),
                "LengthTrace.p95s",
                self.p95s[:4],
                "must give every step a 95th percentile >= its mean",
            )
        if self.maxima is not None:
            require(
                len(self.maxima) == len(self.means)
                and all(x >= m for x, m in zip(self.maxima, self.means, strict=True)),
                "LengthTrace.maxima",
                self.maxima[:4],
                "must give every step a maximum >= its mean",
            )

    def mean_at(self, step: int) -> float:
        return self.means[min(step, len(self.means) - 1)]

    def p95_ratios(self) -> tuple[float, ...] | None:
        """Every step's 95th percentile over its mean (None: the trace gives none)."""
        if self.p95s is None:
            return None
        return tuple(p / m for p, m in zip(self.p95s, self.means, strict=True))

    def default_max_length(self) -> int:
        """A job cap: twice the largest mean, rounded up to a power of two."""
        return _cap_for(max(self.means))


def _cap_for(mean: float) -> int:
    """The smallest power of two at least twice ``mean`` tokens."""
    return 1 << max(0, math.ceil(math.log2(2 * mean)))


@dataclass(frozen=True)
class CapSchedule:
    """The job's generation cap (tokens) at every step of the run (module docstring).

    ``caps[s]`` is step ``s``'s cap; steps past the end keep the last one, and the
    warm-up rollout before step 0 runs at step 0's."""

    name: str
    caps: tuple[int, ...]

    def __post_init__(self) -> None:
        require(len(self.caps) >= 1, "CapSchedule.caps", self.caps, "must hold at least one step")
        require(
            all(isinstance(c, int) and c >= 1 for c in self.caps),
            "CapSchedule.caps",
            self.caps,
            "must be integers >= 1 token",
        )
        require(
            all(a <= b for a, b in zip(self.caps, self.caps[1:], strict=False)),
            "CapSchedule.caps",
            self.caps,
            "must never decrease (a job raises its cap as responses grow)",
        )

    @classmethod
    def fixed(cls, cap: int, steps: int = 1) -> CapSchedule:
        return cls("fixed", (int(cap),) * steps)

    def cap_at(self, step: int) -> int:
        return self.caps[min(max(0, step), len(self.caps) - 1)]

    @property
    def largest(self) -> int:
        return self.caps[-1]

    def changes(self) -> list[tuple[int, int]]:
        """(step, cap) of the first step and of every step where the cap is raised."""
        return [(s, c) for s, c in enumerate(self.caps) if s == 0 or c != self.caps[s - 1]]


def cap_schedule(spec: str, lengths: LengthTrace, *, max_length: int | None = None) -> CapSchedule:
    """The job's cap at every step of ``lengths`` (``stepped`` or ``fixed``, module docstring)."""
    if spec not in CAP_SCHEDULES:
        raise ConfigError(f"--cap-schedule={spec!r} must be one of {list(CAP_SCHEDULES)}")
    require(max_length is None or max_length >= 1, "max_length", max_length, "must be >= 1 token")
    if spec == "fixed":
        return CapSchedule.fixed(max_length or lengths.default_max_length(), len(lengths.means))
    caps, cap = [], 1
    for mean in lengths.means:
        cap = max(cap, _cap_for(mean))
        caps.append(min(cap, max_length) if max_length else cap)
    return CapSchedule("stepped", tuple(caps))


def _rescale(values: np.ndarray, length_range: tuple[float, float] | None) -> np.ndarray:
    if length_range is None:
        return values
    lo, hi = length_range
    require(
        1 <= lo <= hi, "--length-range", length_range, "must be LO HI with 1 <= LO <= HI tokens"
    )
    span = float(values.max() - values.min())
    if span == 0:
        return np.full_like(values, (lo + hi) / 2)
    return lo + (values - values.min()) * (hi - lo) / span


def length_trace(
    spec: str, steps: int, *, length_range: tuple[float, float] | None = None
) -> LengthTrace:
    """``growth:LO:HI`` or the path of a response-length JSON file (module docstring).

    A file's per-step maximum is its ``max`` array, else its ``seq_len_max`` (the longest
    prompt plus response: an upper bound of the longest response, by at most the longest
    prompt), resampled onto the run's steps as the means are, rescaled with them (each
    step keeps its maximum over mean) and never below the mean; None when the file has
    neither, and for ``growth:LO:HI``."""
    require(isinstance(steps, int) and steps >= 1, "steps", steps, "must be an integer >= 1")
    growth = _parse_growth(spec, "--length-trace")
    if growth is not None:
        means = np.linspace(growth[0], growth[1], steps) if steps > 1 else np.array([growth[0]])
        return LengthTrace(spec, tuple(float(v) for v in _rescale(means, length_range)))
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--length-trace={spec!r} must be growth:LO:HI or the path of a response-length "
            "JSON file (with 'steps' and 'mean' arrays)"
        )
    data = json.loads(path.read_text())
    xs, ys = data.get("steps"), data.get("mean") if isinstance(data, dict) else None
    if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys) or len(xs) < 1:
        raise ConfigError(
            f"--length-trace={spec!r} must hold 'steps' and 'mean' arrays of one length"
        )
    tops = data.get("max") if isinstance(data.get("max"), list) else data.get("seq_len_max")
    if not isinstance(tops, list) or len(tops) != len(xs):
        tops = [None] * len(xs)
    rows = sorted(
        (float(x), float(y), None if t is None else float(t))
        for x, y, t in zip(xs, ys, tops, strict=True)
        if y is not None
    )
    x = np.array([r[0] for r in rows])
    raw = np.array([r[1] for r in rows])
    y = _rescale(raw, length_range)
    run = x[0] + (x[-1] - x[0]) * (np.arange(steps) / max(1, steps - 1))
    flat = len(x) == 1 or x[-1] == x[0]
    means = np.full(steps, y.mean()) if flat else np.interp(run, x, y)
    means = np.maximum(1.0, means)
    with_top = [
        (r[0], r[2] / r[1] * yy)
        for r, yy in zip(rows, y, strict=True)
        if r[2] is not None and r[1] > 0
    ]
    maxima = None
    if with_top:
        tx = np.array([t[0] for t in with_top])
        ty = np.array([t[1] for t in with_top])
        if flat or len(tx) == 1 or tx[-1] == tx[0]:
            tops_at = np.full(steps, ty.mean())
        else:
            tops_at = np.interp(run, tx, ty)
        maxima = tuple(float(v) for v in np.maximum(tops_at, means))
    return LengthTrace(path.stem, tuple(float(v) for v in means), maxima=maxima)


def pool_at_steps(
    spec: str,
    devices: int,
    steps: int,
    *,
    offset_ticks: int = 0,
    pool_range: tuple[int, int] | None = None,
) -> list[int]:
    """How many of ``devices`` are live at each of ``steps`` steps under ``spec``: a
    spot-availability file, one tick a step from ``offset_ticks`` on, its counts of 0 to
    ``SPOT_INSTANCES`` instances mapped onto ``pool_range`` devices (default: half the
    devices, at least one, to all of them: a live job never pauses with none); or
    ``growth:LO:HI``."""
    require(
        isinstance(devices, int) and devices >= 1, "devices", devices, "must be an integer >= 1"
    )
    shape = local_cpu_cluster(
        1, 2**30, flops_per_device=1e9, memory_bandwidth=1e9, exchange_bandwidth=1e9
    ).with_nodes(devices)
    lo_hi = pool_range if pool_range is not None else (max(1, devices // 2), devices)
    trace = device_trace(spec, shape, steps, offset_ticks=offset_ticks, pool_range=lo_hi)
    if isinstance(trace, GrowthTrace):
        return [max(1, trace.devices_at_step(s)) for s in range(steps)]
    assert isinstance(trace, SpotTrace)
    return [max(1, trace.node_counts[s % len(trace.node_counts)]) for s in range(steps)]
