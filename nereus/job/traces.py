"""Traces played on a running job: response lengths and a device pool (design §6, §9).

``with_lengths(cfg)``: ``[trace] lengths`` as the job's sampling. The log's per-step mean
and, where it gives one, per-step longest response (``nereus.sim.traces.length_trace``,
the reader the simulator uses) are scaled by one factor so the longest step bound is the
job's cap, and kept in the config (``sampling.lengths``, a ``TraceLengths``). The cap
follows the trace as a schedule: step ``s``'s cap is its bound, the scaled maximum (the
scaled mean where the log has none). Generation ignores the end-of-sequence token, and
``response_lengths`` gives each response of a step its own length, drawn by
``nereus.sim.lengths`` from the step's mean and maximum over the job's responses per
step and keyed by (run seed, sample index, row): a long-tailed spread within the step
whose mean is the log's, so a prompt's responses get the same lengths in synchronous
and asynchronous mode, under any policy or plan. A log with no maximum gives every
response of a step the step's mean (no spread is invented).

``PoolTrace`` is a boundary hook (``RLJob.boundary_hooks``): after each step it reads
the number of devices the trace leaves live for the next step (``nereus.sim.traces.
pool_at_steps``, the reader the simulator uses) and brings the cluster there through
its public API: ``drain`` the highest-numbered usable devices when the pool shrinks
(the job's next change empties them and ``retire_drained`` stops their workers), and
``add_node`` one single-device node per device when it grows. The job's controller
loop sees only the cluster: it learns of the drain and the join as it would of a real
reclaim or return, and its policy decides what to do.

``events`` lists what the trace did: ``(step, "drain" | "join", devices)``, the step
being the one the change is in force for.

Refuses (``ConfigError``, from the reader): a spec that is neither a spot-availability
file nor ``growth:LO:HI``; ``response_lengths`` on a job without a length trace.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from nereus.config import require
from nereus.job.config import JobConfig
from nereus.rl.rollout import TraceLengths
from nereus.sim.lengths import draw_length
from nereus.sim.traces import length_trace, pool_at_steps

__all__ = [
    "PoolTrace",
    "length_schedule",
    "response_lengths",
    "trace_lengths",
    "with_lengths",
]

log = logging.getLogger("nereus.rl")


def trace_lengths(spec: str, steps: int, cap: int) -> tuple[TraceLengths, list[int]]:
    """``spec``'s per-step means and maxima scaled so the longest step bound is ``cap``
    tokens, and every step's bound (its scaled maximum, else its scaled mean; at least
    one token, rounded; the mean kept at most the bound)."""
    trace = length_trace(spec, steps)
    tops = trace.maxima if trace.maxima is not None else trace.means
    scale = cap / max(tops)
    bounds = [max(1, round(t * scale)) for t in tops]
    means = [min(float(b), max(1.0, m * scale)) for m, b in zip(trace.means, bounds, strict=True)]
    maxima = None
    if trace.maxima is not None:
        maxima = [max(m, x * scale) for m, x in zip(means, trace.maxima, strict=True)]
    return TraceLengths(trace.name, means, maxima), bounds


def length_schedule(spec: str, steps: int, cap: int) -> list[list[int]]:
    """``[[step, tokens], ...]`` (from step 0, where the bound changes): every step's
    length bound of ``spec`` (``trace_lengths``), the longest ``cap`` tokens."""
    return _changes(trace_lengths(spec, steps, cap)[1])


def _changes(bounds: list[int]) -> list[list[int]]:
    """``[[step, bound], ...]`` of step 0 and of every step whose bound differs."""
    return [[s, t] for s, t in enumerate(bounds) if s == 0 or t != bounds[s - 1]]


def with_lengths(cfg: JobConfig) -> JobConfig:
    """``cfg`` with ``[trace] lengths`` turned into its sampling (module docstring)."""
    if cfg.trace.lengths is None:
        return cfg
    cap = cfg.sampling.max_new_tokens
    assert isinstance(cap, int)  # JobConfig refuses a schedule with a length trace
    lengths, bounds = trace_lengths(cfg.trace.lengths, cfg.run.steps, cap)
    return replace(
        cfg,
        sampling=replace(
            cfg.sampling, max_new_tokens=_changes(bounds), ignore_eos=True, lengths=lengths
        ),
        trace=replace(cfg.trace, lengths=None),
    )


def response_lengths(cfg: JobConfig, step: int, indices: list[int], k: int) -> list[int]:
    """The length of every response of ``step`` to the samples ``indices``, ``k`` rows
    each in order (module docstring), each in [1, the step's cap]."""
    lengths = cfg.sampling.lengths
    require(
        lengths is not None,
        "sampling.lengths",
        None,
        "must be set (a job with [trace] lengths, after with_lengths)",
    )
    assert lengths is not None
    mean, top = lengths.mean_at(step), lengths.max_at(step)
    n, cap, seed = cfg.algorithm.rollouts_per_step, cfg.sampling.cap_at(step), cfg.run.seed
    return [draw_length(mean, top, n, cap, seed, i, r) for i in indices for r in range(k)]


class PoolTrace:
    """The pool trace of ``[trace] pool``: ``counts[s]`` devices live for step ``s``."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = list(counts)
        self.events: list[tuple[int, str, list[int]]] = []

    @classmethod
    def of(cls, cfg: JobConfig) -> PoolTrace | None:
        """The trace ``cfg`` names, over its run's steps; None without ``[trace] pool``."""
        t = cfg.trace
        if t.pool is None:
            return None
        lo_hi = tuple(t.pool_range) if t.pool_range is not None else None
        return cls(
            pool_at_steps(
                t.pool,
                cfg.cluster.devices,
                cfg.run.steps,
                offset_ticks=t.pool_offset,
                pool_range=lo_hi,
            )
        )

    def live_at(self, step: int) -> int:
        return self.counts[min(step, len(self.counts) - 1)]

    async def __call__(self, job: Any, record: dict[str, Any]) -> None:
        nxt = int(record["step"]) + 1
        if nxt >= len(self.counts):
            return
        cluster = job.stages.cluster
        await cluster.refresh_devices()
        draining = set(cluster.draining)
        usable = sorted(d.index for d in cluster.devices if d.index not in draining)
        want = self.live_at(nxt)
        if want < len(usable):
            gone = usable[want - len(usable) :]
            for d in gone:
                cluster.drain(d)
            self.events.append((nxt, "drain", gone))
            log.info("pool trace: step %d has %d devices; drained %s", nxt, want, gone)
        elif want > len(usable):
            added: list[int] = []
            for _ in range(want - len(usable)):
                added += await cluster.add_node(1)
            self.events.append((nxt, "join", added))
            log.info("pool trace: step %d has %d devices; added %s", nxt, want, added)
