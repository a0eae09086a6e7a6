"""Calibration: efficiency factors per operation class from measured timings (docs/design.md §6).

``Calibrator`` keeps the last ``window`` equations and solves them by least squares on
relative error (each equation divided by its measured time, so a 2 s and a 20 ms
measurement weigh alike; a transition node's equation divided by its whole transition's
time instead, see ``observe_transition``), with a weak pull toward the prior factors so that a class
the data barely touches stays near its prior (an op class pulled at least as hard as
the op classes' mean, so one that is a small share of its timings cannot swing between
its bounds from one window to the next), and every unknown kept in its physical
range (an active set: an unknown the unconstrained fit pushes out is pinned at the bound
and the others are fitted again). A class no equation has touched keeps
its prior, which for an unseen class is conservative (``CONSERVATIVE``).

Promises: pure arithmetic, no clock; factors clamped to [0.01, 1.5].
Refuses (``ConfigError``): unknown classes, non-positive measured times, negative
ideal times.

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from nereus.config import require
from nereus.planner.cost import StageCost, StageMemory
from nereus.planner.efficiency import (
    CONSERVATIVE,
    FIXED_COSTS,
    MAX_MEMORY_FIXED_BYTES,
    OP_CLASSES,
    Efficiency,
)

__all__ = ["Calibrator"]

_MIN_EFF, _MAX_EFF = 0.01, 1.5
# transition nodes' fixed costs: column -> the Efficiency field (seconds) it fits
FIXED = FIXED_COSTS
# A slope is fitted to the memory pairs only when their modelled transient bytes span
# at least this factor (largest over smallest); below it, one ratio.
MEMORY_FIT_SPREAD = 1.5


def _clamp_scale(scale: float) -> float:
    """A memory scale within ``Efficiency.memory_scale``'s range."""
    return min(8.0, max(0.25, scale))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small dense system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-300 else 0.0 for i in range(n)]


def _bounds(c: str) -> tuple[float, float]:
    """The range of an unknown: x = 1/eff for an op class, seconds for a fixed cost."""
    return (0.0, 10.0) if c in FIXED else (1.0 / _MAX_EFF, 1.0 / _MIN_EFF)


def _bounded_solve(
    a: list[list[float]], b: list[float], bounds: list[tuple[float, float]]
) -> list[float]:
    """The normal equations ``a x = b`` with each x_i kept in its bounds: solve, pin the
    unknowns that left their range at the bound they crossed, solve for the rest, until
    none leaves (an active-set pass; with few equations whose classes move together,
    the unconstrained optimum can sit far outside any physical value)."""
    n = len(b)
    pinned: dict[int, float] = {}
    x = [0.0] * n
    for _ in range(n + 1):
        free = [i for i in range(n) if i not in pinned]
        if not free:
            break
        sub_a = [[a[i][j] for j in free] for i in free]
        sub_b = [b[i] - sum(a[i][j] * v for j, v in pinned.items()) for i in free]
        sol = _solve(sub_a, sub_b)
        out = False
        for i, v in zip(free, sol, strict=True):
            lo, hi = bounds[i]
            x[i] = v
            if v < lo or v > hi:
                pinned[i] = min(hi, max(lo, v))
                out = True
        if not out:
            break
    for i, v in pinned.items():
        x[i] = v
    return x


class Calibrator:
    """Accumulates timing equations and fits an ``Efficiency``.

    ``prior_weight`` is the weight of the pull toward the prior, relative to one
    equation with relative error: small, so data wins as soon as it exists."""

    def __init__(
        self, prior: Efficiency = CONSERVATIVE, window: int = 256, prior_weight: float = 1e-3
    ) -> None:
        require(window >= 1, "Calibrator.window", window, "must be >= 1")
        require(prior_weight > 0, "Calibrator.prior_weight", prior_weight, "must be > 0")
        self.prior = prior
        self.prior_weight = prior_weight
        # (ideal per class, measured seconds, the seconds the equation is divided by)
        self._rows: deque[tuple[dict[str, float], float, float]] = deque(maxlen=window)
        self._memory: deque[tuple[float, float]] = deque(
            maxlen=window
        )  # (t, y): modelled transient, measured

    def __len__(self) -> int:
        return len(self._rows)

    def observe(self, ideal_by_class: Mapping[str, float], measured_seconds: float) -> None:
        """One timing: ideal seconds per op class (at efficiency 1) and what it took."""
        require(measured_seconds > 0, "measured_seconds", measured_seconds, "must be > 0")
        row: dict[str, float] = {}
        for c, t in ideal_by_class.items():
            require(
                c in OP_CLASSES or c in FIXED,
                "op class",
                c,
                f"must be one of {list(OP_CLASSES) + list(FIXED)}",
            )
            require(t >= 0, f"ideal seconds of {c}", t, "must be >= 0")
            if t > 0:
                row[c] = float(t)
        require(
            bool(row), "ideal_by_class", dict(ideal_by_class), "must have some positive ideal time"
        )
        self._rows.append((row, float(measured_seconds), float(measured_seconds)))

    def observe_stage(self, cost: StageCost, measured_seconds: float) -> None:
        """A model-stage's measured time against the terms the cost model predicted."""
        self.observe(cost.ideal_by_class(), measured_seconds)

    def observe_transition(
        self, ideal: Mapping[str, float], measured_seconds: float, of_seconds: float | None = None
    ) -> None:
        """One transition node: ``ideal`` holds its p2p seconds at efficiency 1
        (``p2p_intra``, ``p2p_inter``) and its fixed-cost counts (``groups``: 1 when it
        makes groups, ``calls``: 1, ``copy_gb``: GB copied locally, ``host_gb``: GB its
        busiest host receives), as ``nereus.transition.LinkModel.ideal`` gives them;
        ``measured_seconds``: what it took at a device's full rate
        (``nereus.transition.full_rate_seconds``). Or a transition's time outside its
        nodes: ``LinkModel.outside``'s counts (``transitions``, ``groups_released``).

        ``of_seconds``: the measured seconds of the whole transition the node belongs to
        (its nodes at full rate and its time outside them); its equation is divided by
        that rather than by its own time. What is predicted is a transition's total, a
        sum over its nodes: divided by its own time, a 1 ms node that only calls would
        weigh as much as a 200 ms one that moves the bytes, and a class both share would
        be fitted to the small nodes' overheads, which the model does not describe and
        the total barely holds. None: its own time (an equation of its own)."""
        require(measured_seconds > 0, "measured_seconds", measured_seconds, "must be > 0")
        scale = float(measured_seconds if of_seconds is None else of_seconds)
        require(
            scale >= measured_seconds,
            "of_seconds",
            of_seconds,
            f"must be >= the node's measured_seconds {measured_seconds}",
        )
        row: dict[str, float] = {}
        for c, t in ideal.items():
            require(
                c in OP_CLASSES or c in FIXED,
                "transition class",
                c,
                f"must be one of {list(OP_CLASSES) + list(FIXED)}",
            )
            require(t >= 0, f"ideal {c}", t, "must be >= 0")
            if t > 0:
                row[c] = float(t)
        require(bool(row), "ideal", dict(ideal), "must have some positive term")
        self._rows.append((row, float(measured_seconds), scale))

    def observe_op(self, op_class: str, ideal_seconds: float, measured_seconds: float) -> None:
        """One operation of one class (a timed GEMM, all-reduce, p2p send, decode step)."""
        self.observe({op_class: ideal_seconds}, measured_seconds)

    def observe_memory(self, modelled: StageMemory, measured_peak_bytes: int) -> None:
        """A measured peak of one model-stage on one device against the memory model.

        The resident bytes (parameters, gradients, optimizer) are exact; what the peak
        holds beyond them, against the modelled transient bytes, is one pair of the
        fixed-plus-proportional fit (``memory_fit``)."""
        self.observe_memory_bytes(modelled.resident, modelled.transient, measured_peak_bytes)

    def observe_memory_bytes(self, resident: int, transient: int, measured_peak_bytes: int) -> None:
        """A measured peak against modelled resident and (unscaled) transient bytes: one
        model-stage's, or a whole device's (its resident bytes and its largest transient)."""
        require(measured_peak_bytes > 0, "measured_peak_bytes", measured_peak_bytes, "must be > 0")
        require(
            transient > 0, "modelled transient bytes", transient, "must be > 0 to calibrate against"
        )
        self._memory.append((float(transient), max(0.0, float(measured_peak_bytes - resident))))

    def memory_fit(self) -> tuple[float, float]:
        """(scale, fixed bytes) of the window's memory pairs (see the module docstring),
        or the prior's when there are none. The scale stays in [0.25, 8] and the fixed
        term in [0, 1 TiB]; after clamping, the fixed term is raised again so that no
        pair lies above the line."""
        pairs = self._memory
        if not pairs:
            return self.prior.memory_scale, self.prior.memory_fixed_bytes
        ratio_only = _clamp_scale(max(y / t for t, y in pairs)), 0.0
        ts = [t for t, _ in pairs]
        if min(ts) <= 0 or max(ts) < MEMORY_FIT_SPREAD * min(ts):
            return ratio_only
        n = len(ts)
        mean_t = sum(ts) / n
        mean_y = sum(y for _, y in pairs) / n
        var = sum((t - mean_t) ** 2 for t in ts) / n
        scale = _clamp_scale(sum((t - mean_t) * (y - mean_y) for t, y in pairs) / (n * var))
        fixed = max(0.0, max(y - scale * t for t, y in pairs))
        # a fixed term beyond any device: the ratio alone is the safer reading
        return ratio_only if fixed > MAX_MEMORY_FIXED_BYTES else (scale, fixed)

    def memory_scale(self) -> float:
        """The fitted proportional term (``memory_fit``), or the prior's."""
        return self.memory_fit()[0]

    def memory_fixed_bytes(self) -> float:
        """The fitted fixed term in bytes (``memory_fit``), or the prior's."""
        return self.memory_fit()[1]

    def seen(self) -> set[str]:
        """The classes some equation in the window touches."""
        return {c for row, _, _ in self._rows for c in row}

    def fit(self) -> Efficiency:
        """The efficiency factors that best explain the window (prior for unseen classes)."""
        order = [*OP_CLASSES, *FIXED]
        seen = sorted(self.seen(), key=order.index)
        if not seen:
            scale, fixed = self.memory_fit()
            return self.prior.replace(memory_scale=scale, memory_fixed_bytes=fixed)
        idx = {c: i for i, c in enumerate(seen)}
        n = len(seen)
        ata = [[0.0] * n for _ in range(n)]
        atb = [0.0] * n
        for row, measured, scale in self._rows:
            coeffs = [(idx[c], t / scale) for c, t in row.items()]
            for i, ai in coeffs:
                atb[i] += ai * measured / scale  # 1 for an equation divided by its own time
                for j, aj in coeffs:
                    ata[i][j] += ai * aj
        # Pull toward the prior: w · (x_c - prior_c)^2, scaled to the equations' size
        # (prior_c is 1/eff_c for an efficiency, the seconds themselves for a fixed cost).
        # An op class is pulled at least as hard as the op classes' mean: scaled to its own
        # size alone, a class that is a small share of every timing it is in (attention
        # beside GEMMs, an inter-node all-reduce in a few steps) is barely held, takes up
        # whatever the model does not describe, and swings between its bounds as the
        # window moves.
        ops = [i for c, i in idx.items() if c not in FIXED]
        floor = sum(ata[i][i] for i in ops) / len(ops) if ops else 0.0
        for c, i in idx.items():
            scale = max(ata[i][i], 1e-12 if c in FIXED else floor, 1e-12)
            w = self.prior_weight * scale
            ata[i][i] += w
            atb[i] += w * (getattr(self.prior, FIXED[c]) if c in FIXED else 1.0 / self.prior[c])
        x = _bounded_solve(ata, atb, [_bounds(c) for c in seen])
        factors: dict[str, float] = {}
        for c, i in idx.items():
            if c in FIXED:
                factors[FIXED[c]] = min(10.0, max(0.0, x[i]))
                continue
            eff = 1.0 / x[i] if x[i] > 0 else _MAX_EFF
            factors[c] = min(_MAX_EFF, max(_MIN_EFF, eff))
        scale, fixed = self.memory_fit()
        return self.prior.replace(memory_scale=scale, memory_fixed_bytes=fixed, **factors)
