"""Transition DAGs on real worker processes, with random delays inside every worker's
``run_plan``: every trial finishes, every tensor ends where the target plan says with
the bytes it started with, every model-stage stays covered after every node, each
device's ledger peak stays within its budget and within the DAG's predicted peak, and
nodes on disjoint devices really run at the same time."""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio
import torch

from nereus.actors import Cluster, endpoint
from nereus.state import LogicalState
from nereus.state.holder import ShardHolder
from nereus.transition import LinkModel
from nereus.transition.execute import execute_dag
from nereus.transition.workers import WorkerRuntime
from tests._leaks import children, shm_segments, wait_gone
from tests.state.helpers import global_tensors, shard_store
from tests.transition.cases import CASES, covered

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

MODEL = LinkModel(intra_bandwidth=1e9, inter_bandwidth=1e9)
BUDGET = max(c.cap() for c in CASES)


class DelayHolder(ShardHolder):
    """A shard store that waits a random 0-40 ms before each plan part it runs."""

    @endpoint
    async def run_plan(self, part: dict, group: str | None = None, group_devices=(), free=(),
                       state: dict | None = None) -> dict:
        await asyncio.sleep(random.uniform(0.0, 0.04))
        return await super().run_plan(part, group, group_devices, free, state)

    @endpoint
    async def set_budget(self, nbytes: int) -> None:
        self.ledger.budget_bytes = nbytes


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def holders():
    before, segments = children(), shm_segments()
    async with Cluster.local(devices=4, memory_per_device=BUDGET, heartbeat_timeout_s=30.0) as cluster:
        mesh = await cluster.spawn("delayed", DelayHolder, devices=[0, 1, 2, 3])
        yield cluster, {r.device: r for r in mesh.refs}
        await cluster.stop_mesh(mesh)
    assert not wait_gone(children() - before, timeout_s=10), "leaked worker processes"
    assert shm_segments() <= segments


@pytest.mark.parametrize("trial", range(6))
async def test_random_delays_on_workers_finish_within_budgets_and_keep_everything(holders, trial):
    cluster, refs = holders
    case = CASES[trial % len(CASES)]
    for ref in refs.values():  # this case's cap is every worker's budget
        await ref.set_budget.call_one(case.cap())
    emus = case.emus(case.current)
    state = LogicalState(3, 2, 40)
    full = {}
    for stage, stage_emus in emus.items():
        full[stage] = global_tensors(stage_emus[0], seed=trial)
        for i, e in enumerate(stage_emus):
            stage_emus[i] = e = e.with_(state=state)
            for d, tensors in shard_store(e, full[stage]).items():
                await refs[d].put_shards.call_one(e.name, tensors, vars(state))
    try:
        for ref in refs.values():
            await ref.ledger_report.call_one(True)  # a new high-water mark from here
        dag = case.dag(duration=MODEL.seconds)
        runtime = WorkerRuntime({e.name: e for es in emus.values() for e in es}, refs, cluster, epoch=50 + trial)
        coverage: list[bool] = []

        def on_node(node, result) -> None:
            for stage in case.current.names:
                coverage.append(covered([e for e in runtime.live.values() if e.model_stage == stage]))

        report = await execute_dag(dag, runtime, duration=MODEL.seconds, rng=random.Random(trial), on_node=on_node)
        assert report.ok, report.error
        assert all(coverage) and len(coverage) == len(dag.nodes) * len(case.current.names)
        for d, ref in refs.items():
            peak = (await ref.ledger_report.call_one())["peak_bytes"]
            assert peak <= case.cap() and peak <= report.peak.get(d, 0), (d, peak, report.peak.get(d), case.cap())
        # every tensor is where the target says, with its bytes and logical state
        for stage, sp in case.target:
            final = [e for e in runtime.live.values() if e.model_stage == stage]
            assert sorted((e.layout.tp, e.layout.pp, e.devices) for e in final) == sorted(
                (sp.tp, sp.pp, d) for d in sp.devices)
            for e in final:
                want = shard_store(e, full[stage])
                for d in e.devices:
                    got = await refs[d].get_shards.call_one(e.name)
                    assert set(got) == set(want[d]) and all(torch.equal(got[k], want[d][k]) for k in got)
                    assert await refs[d].get_state.call_one(e.name) == vars(state)
        # in the PPO case two model-stages' nodes on disjoint devices run at the same time
        # (its reference and critic inference move at once): not a serial loop
        if case is CASES[2]:
            spans = sorted((r.start, r.end) for r in report.results.values())
            assert any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False)), spans
    finally:
        for ref in refs.values():
            held = await ref.held.call_one()
            await ref.drop_shards.call_one(list(held))
