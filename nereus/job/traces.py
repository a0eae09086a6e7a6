"""Traces played on a running job: response lengths and a device pool (design §6, §9).

``with_lengths(cfg)``: ``[trace] lengths`` as the job's sampling: each step's length is
the log's mean at that point of its run (``nereus.sim.traces.length_trace``, the reader
the simulator uses) scaled so the longest step is the job's cap; the cap follows it as
a schedule and generation ignores the end-of-sequence token (every response of a step
is that long: the per-step mean, not the log's spread within a step).

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
file nor ``growth:LO:HI``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from nereus.job.config import JobConfig
from nereus.sim.traces import length_trace, pool_at_steps

__all__ = ["PoolTrace", "length_schedule", "with_lengths"]

log = logging.getLogger("nereus.rl")


def length_schedule(spec: str, steps: int, cap: int) -> list[list[int]]:
    """``[[step, tokens], ...]`` (from step 0, where the length changes): ``spec``'s mean
    per step scaled so its longest step is ``cap`` tokens, at least one."""
    means = length_trace(spec, steps).means
    top = max(means)
    tokens = [max(1, round(m * cap / top)) for m in means]
    return [[s, t] for s, t in enumerate(tokens) if s == 0 or t != tokens[s - 1]]


def with_lengths(cfg: JobConfig) -> JobConfig:
    """``cfg`` with ``[trace] lengths`` turned into its sampling (module docstring)."""
    if cfg.trace.lengths is None:
        return cfg
    cap = cfg.sampling.max_new_tokens
    assert isinstance(cap, int)  # JobConfig refuses a schedule with a length trace
    schedule = length_schedule(cfg.trace.lengths, cfg.run.steps, cap)
    return replace(
        cfg,
        sampling=replace(cfg.sampling, max_new_tokens=schedule, ignore_eos=True),
        trace=replace(cfg.trace, lengths=None),
    )


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
