"""A device-pool trace played on a running job, as a spot market would (design §6, §9).

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
from typing import Any

from nereus.job.config import JobConfig
from nereus.sim.traces import pool_at_steps

__all__ = ["PoolTrace"]

log = logging.getLogger("nereus.rl")


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
        return cls(pool_at_steps(t.pool, cfg.cluster.devices, cfg.run.steps, offset_ticks=t.pool_offset,
                                 pool_range=lo_hi))

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
            gone = usable[want - len(usable):]
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
