"""Running a case's transition DAG on real worker processes (shard stores with ledgers):
the stores, loading a case's current EMUs, running the DAG and checking where every
tensor ended. Shared by the overlap trials and the tests of the global rules."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import torch

from nereus.actors import endpoint
from nereus.state import EMU, LogicalState
from nereus.state.holder import ShardHolder
from nereus.transition import LinkModel, Rules, TransitionDAG
from nereus.transition.execute import TransitionReport, execute_dag
from nereus.transition.workers import WorkerRuntime
from tests.state.helpers import global_tensors, shard_store
from tests.transition.cases import Case, covered

MODEL = LinkModel(intra_bandwidth=1e9, inter_bandwidth=1e9)


class DelayHolder(ShardHolder):
    """A shard store that waits a random 0-40 ms before each plan part it runs."""

    @endpoint
    async def run_plan(
        self,
        part: dict,
        group: str | None = None,
        group_devices=(),
        free=(),
        state: dict | None = None,
    ) -> dict:
        await asyncio.sleep(random.uniform(0.0, 0.04))
        return await super().run_plan(part, group, group_devices, free, state)

    @endpoint
    async def set_budget(self, nbytes: int) -> None:
        self.ledger.budget_bytes = nbytes


@dataclass
class Run:
    """One run of a case's DAG on the workers: the report, each device's ledger peak,
    whether every model-stage stayed covered after every node, and what was loaded."""

    case: Case
    dag: TransitionDAG
    report: TransitionReport
    runtime: WorkerRuntime
    full: dict[str, dict[str, torch.Tensor]]
    state: LogicalState
    peaks: dict[int, int] = field(default_factory=dict)
    coverage: list[bool] = field(default_factory=list)


async def run_case(
    case: Case,
    refs: dict,
    cluster,
    *,
    seed: int,
    epoch: int,
    dag: TransitionDAG | None = None,
    rng: random.Random | None = None,
    rules: Rules | None = None,
    check_caps: bool = True,
) -> Run:
    """Load ``case``'s current EMUs on the workers (budgets: the case's cap), run its DAG
    (``dag``, else built with every rule) and read every ledger's peak. The caller drops
    what the workers hold afterwards (``drop_all``), also when this raises."""
    for ref in refs.values():
        await ref.set_budget.call_one(case.cap())
    emus = case.emus(case.current)
    state = LogicalState(3, 2, 40)
    full = {}
    for stage, stage_emus in emus.items():
        full[stage] = global_tensors(stage_emus[0], seed=seed)
        for i, e in enumerate(stage_emus):
            stage_emus[i] = e = e.with_(state=state)
            for d, tensors in shard_store(e, full[stage]).items():
                await refs[d].put_shards.call_one(e.name, tensors, vars(state))
    for ref in refs.values():
        await ref.ledger_report.call_one(True)  # a new high-water mark from here
    dag = dag if dag is not None else case.dag(duration=MODEL.seconds)
    runtime = WorkerRuntime(
        {e.name: e for es in emus.values() for e in es}, refs, cluster, epoch=epoch
    )
    coverage: list[bool] = []

    def on_node(node, result) -> None:
        for stage in case.current.names:
            coverage.append(covered([e for e in runtime.live.values() if e.model_stage == stage]))

    report = await execute_dag(
        dag,
        runtime,
        duration=MODEL.seconds,
        rng=rng,
        on_node=on_node,
        rules=rules,
        check_caps=check_caps,
    )
    peaks = {d: (await ref.ledger_report.call_one())["peak_bytes"] for d, ref in refs.items()}
    return Run(case, dag, report, runtime, full, state, peaks, coverage)


async def check_target(run: Run, refs: dict) -> None:
    """Every tensor is where the case's target says, with its bytes and logical state."""
    for stage, sp in run.case.target:
        final: list[EMU] = [e for e in run.runtime.live.values() if e.model_stage == stage]
        assert sorted((e.layout.tp, e.layout.pp, e.devices) for e in final) == sorted(
            (sp.tp, sp.pp, d) for d in sp.devices
        )
        for e in final:
            want = shard_store(e, run.full[stage])
            for d in e.devices:
                got = await refs[d].get_shards.call_one(e.name)
                assert set(got) == set(want[d]) and all(
                    torch.equal(got[k], want[d][k]) for k in got
                )
                assert await refs[d].get_state.call_one(e.name) == vars(run.state)


async def drop_all(refs: dict) -> None:
    """Free everything the workers hold; their ledgers are empty again."""
    for ref in refs.values():
        held = await ref.held.call_one()
        await ref.drop_shards.call_one(list(held))
    for d, ref in refs.items():
        used = (await ref.ledger_report.call_one())["used_bytes"]
        assert used == 0, f"device {d} still accounts {used} bytes after dropping everything"
