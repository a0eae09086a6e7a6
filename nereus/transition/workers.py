"""The runtime that runs transition DAG nodes on real workers' shard stores.

``WorkerRuntime(emus, holders, cluster, epoch=...)`` is ``execute_dag``'s runtime for a
running job or any set of ``ShardHolder`` actors: ``start(node)`` runs the node's
primitives as a task -- each op becomes its ``Step`` with exact reshard plans built now
(``nereus.state.transition.op_step`` over the EMUs alive at that moment) and runs on the
workers (``nereus.state.execute_step``: one message per worker and plan, a group of the
given epoch per plan that moves bytes); the ops of one node sit on disjoint devices and
run at once; their groups are of the given epoch and tag ``"transition"``, so they are
released apart from the engines' -- and ``next_done()`` waits for the next node to end. ``live`` is
the set of EMUs after every node that finished (created ones in, freed ones out); a node that
fails leaves it as it was (a primitive frees its sources only after its target exists).

This is the shell around the pure DAG: it makes actor calls; it never decides what runs
when (the dispatcher does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from nereus.state.emu import EMU
from nereus.state.executor import execute_step
from nereus.state.transition import op_step
from nereus.transition.dag import Node
from nereus.transition.execute import NodeResult

__all__ = ["WorkerRuntime"]


class WorkerRuntime:
    """Runs nodes on shard stores (see the module docstring). ``emus``: every EMU the
    DAG's ops name as inputs, by name (with spec, slots and logical state)."""

    def __init__(
        self,
        emus: Mapping[str, EMU],
        holders: Mapping[int, Any],
        cluster: Any,
        *,
        epoch: int = 0,
        group_tag: str = "transition",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.live: dict[str, EMU] = dict(emus)
        self.holders = holders
        self.cluster = cluster
        self.epoch = epoch
        self.group_tag = group_tag
        self.clock = clock
        self._tasks: set[asyncio.Task] = set()

    def start(self, node: Node) -> None:
        task = asyncio.ensure_future(self._run(node))
        self._tasks.add(task)

    async def next_done(self) -> NodeResult:
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        task = min(
            done, key=lambda t: t.result().end
        )  # the earliest first, as the dispatcher counts
        self._tasks.discard(task)
        return task.result()

    async def _run(self, node: Node) -> NodeResult:
        t0 = self.clock()
        try:
            steps = [op_step(op, self.live) for op in node.ops]
            stats = await asyncio.gather(
                *(
                    execute_step(
                        step, self.holders, self.cluster, epoch=self.epoch, group_tag=self.group_tag
                    )
                    for step in steps
                )
            )
        except Exception as e:  # reported to the dispatcher: nothing more starts
            return NodeResult(node.id, False, t0, self.clock(), 0, e)
        for step in steps:
            for e in step.freed:
                self.live.pop(e.name, None)
            for e in step.created:
                self.live[e.name] = e
        return NodeResult(
            node.id, True, t0, self.clock(), sum(s.bytes_sent_measured for s in stats)
        )
