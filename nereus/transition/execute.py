"""Executing a transition DAG on a runtime: real workers or a simulated clock.

``await execute_dag(dag, runtime)`` drives the one list scheduler (``Dispatcher``) with
a runtime: it starts every node the dispatcher says may start (ready, devices free,
memory under every cap) with ``runtime.start(node)``, waits for the next one to end
(``await runtime.next_done()``), frees what it released, and goes on until every node
ended. Nodes on disjoint devices run at once. Its dispatch order is the estimate's
(``nereus.transition.schedule.simulate``), so ``SimulatedRuntime`` with the modelled
durations reproduces the estimate exactly.

A node that fails (the runtime reports ``ok=False``) starts nothing more: the nodes
running end, and the report says which finished, which failed and which never started.
Since a Destroy only ever frees a redundant copy and a primitive frees its sources only
after its target exists, what is left is a valid collection: every model-stage's live
EMUs still cover every tensor unless its last copy died; a replan starts from there.

``SimulatedRuntime(duration, fail=...)``: a clock with injected durations and failures
(the tests' and the simulator's runtime). ``nereus.transition.workers.WorkerRuntime``
runs nodes on the workers' shard stores.

``TransitionReport``: per node, predicted and measured seconds, start and end, bytes;
which finished, failed, never started; the makespan predicted and measured.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nereus.errors import InfeasibleTransition
from nereus.transition.dag import Node, TransitionDAG
from nereus.transition.rules import Rules
from nereus.transition.schedule import Dispatcher

__all__ = ["NodeResult", "Runtime", "SimulatedRuntime", "TransitionReport", "execute_dag"]


@dataclass
class NodeResult:
    """How one node ended: ``ok``, its start and end on the runtime's clock (seconds),
    the bytes its workers measured moving, and the error when it failed."""

    node: int
    ok: bool
    start: float
    end: float
    bytes_measured: int = 0
    error: BaseException | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Runtime(Protocol):
    def start(self, node: Node) -> None: ...

    async def next_done(self) -> NodeResult: ...


@dataclass
class TransitionReport:
    """What a run of a DAG did (see the module docstring)."""

    results: dict[int, NodeResult] = field(default_factory=dict)
    predicted: dict[int, float] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    not_started: list[int] = field(default_factory=list)
    peak: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: BaseException | None = None

    @property
    def finished(self) -> list[int]:
        return [n for n, r in self.results.items() if r.ok]

    @property
    def failed(self) -> list[int]:
        return [n for n, r in self.results.items() if not r.ok]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failed and not self.not_started

    @property
    def bytes_measured(self) -> int:
        return sum(r.bytes_measured for r in self.results.values())


async def execute_dag(
    dag: TransitionDAG,
    runtime: Runtime,
    *,
    duration: Callable[[Node], float] | None = None,
    rng: random.Random | None = None,
    on_node: Callable[[Node, NodeResult], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    rules: Rules | None = None,
    check_caps: bool = True,
) -> TransitionReport:
    """Run ``dag`` on ``runtime`` (see the module docstring). ``duration``: the modelled
    seconds recorded as each node's prediction; ``rng`` shuffles ties (tests);
    ``on_node(node, result)`` hears of every node as it ends; ``rules``: the global
    rules it dispatches under (None: the DAG's); ``check_caps=False`` drops the
    dispatcher's own cap check at start, leaving the workers' ledgers the only check."""
    disp = Dispatcher(dag, rng, rules=rules, check_caps=check_caps)
    report = TransitionReport()
    t0 = clock()
    stop = False
    while True:
        if not stop:
            for node in disp.start_ready():
                report.order.append(node.id)
                if duration is not None:
                    report.predicted[node.id] = float(duration(node))
                runtime.start(node)
        if not disp.running:
            if not stop and disp.stuck():
                report.error = disp.infeasible()
            break
        result = await runtime.next_done()
        disp.finish(result.node, result.ok)
        report.results[result.node] = result
        if on_node is not None:
            on_node(dag.nodes[result.node], result)
        if not result.ok:
            stop = True
            report.error = report.error or result.error
    started = set(report.results)
    report.not_started = [n.id for n in dag.nodes if n.id not in started]
    report.peak = disp.peak
    report.seconds = clock() - t0
    return report


class SimulatedRuntime:
    """A clock with injected durations and failures: ``duration(node)`` seconds each,
    and ``fail(node)`` (optional) saying which nodes fail."""

    def __init__(
        self, duration: Callable[[Node], float], fail: Callable[[Node], bool] | None = None
    ) -> None:
        self.duration = duration
        self.fail = fail
        self.now = 0.0
        self._events: list[tuple[float, int, float, bool]] = []

    def start(self, node: Node) -> None:
        ok = not (self.fail is not None and self.fail(node))
        heapq.heappush(
            self._events, (self.now + max(0.0, float(self.duration(node))), node.id, self.now, ok)
        )

    async def next_done(self) -> NodeResult:
        if not self._events:
            raise InfeasibleTransition("(nothing running)", -1, 0, 0)
        end, nid, start, ok = heapq.heappop(self._events)
        self.now = end
        return NodeResult(
            nid, ok, start, end, 0, None if ok else RuntimeError(f"node {nid} failed (injected)")
        )
