"""Transition DAGs on real worker processes, with random delays inside every worker's
``run_plan``: every trial finishes, every tensor ends where the target plan says with
the bytes it started with, every model-stage stays covered after every node, each
device's ledger peak stays within its budget and within the DAG's predicted peak, and
nodes on disjoint devices really run at the same time."""

from __future__ import annotations

import random

import pytest
import pytest_asyncio

from nereus.actors import Cluster
from tests._leaks import children, shm_segments, wait_gone
from tests.transition._workers import DelayHolder, check_target, drop_all, run_case
from tests.transition.cases import CASES, RULE_CASES

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
]

BUDGET = max(c.cap() for c in [*CASES, *RULE_CASES.values()])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def holders():
    before, segments = children(), shm_segments()
    async with Cluster.local(
        devices=4, memory_per_device=BUDGET, heartbeat_timeout_s=30.0
    ) as cluster:
        mesh = await cluster.spawn("delayed", DelayHolder, devices=[0, 1, 2, 3])
        yield cluster, {r.device: r for r in mesh.refs}
        await cluster.stop_mesh(mesh)
    assert not wait_gone(children() - before, timeout_s=10), "leaked worker processes"
    assert shm_segments() <= segments


@pytest.mark.parametrize("trial", range(6))
async def test_random_delays_on_workers_finish_within_budgets_and_keep_everything(holders, trial):
    cluster, refs = holders
    case = CASES[trial % len(CASES)]
    try:
        run = await run_case(
            case, refs, cluster, seed=trial, epoch=50 + trial, rng=random.Random(trial)
        )
        report, dag = run.report, run.dag
        assert report.ok, report.error
        assert all(run.coverage) and len(run.coverage) == len(dag.nodes) * len(case.current.names)
        for d, peak in run.peaks.items():
            assert peak <= case.cap() and peak <= report.peak.get(d, 0), (
                d,
                peak,
                report.peak.get(d),
                case.cap(),
            )
        await check_target(run, refs)
        # in the PPO case two model-stages' nodes on disjoint devices run at the same time
        # (its reference and critic inference move at once): not a serial loop
        if case is CASES[2]:
            spans = sorted((r.start, r.end) for r in report.results.values())
            assert any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False)), spans
    finally:
        await drop_all(refs)
