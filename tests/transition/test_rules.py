"""Each global rule earns its keep, on real worker processes with ledgers.

For each rule (``nereus.transition.rules``) a case that needs it: with every rule the
DAG finishes on the workers and every ledger stays within its budget; with that one rule
off, a worker's ledger refuses an allocation (``OutOfMemory`` raised in the worker) or
the dispatcher finds a deadlock. Both runs drop the dispatcher's own cap check at start
(``check_caps=False``), the safety net that would otherwise hide a missing rule. The
order rules act where the DAG runs (its resource edges are found under them), so they
are turned off in the dispatcher; resource edges are turned off in the builder.

Last, with the net off, the rules alone keep every trial of every case within budget
under random delays inside the workers (ties in the rules' own order, by node id)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from nereus.actors import Cluster
from nereus.errors import InfeasibleTransition, RemoteError
from nereus.transition import ALL_RULES
from tests._leaks import children, shm_segments, wait_gone
from tests.transition._workers import MODEL, DelayHolder, check_target, drop_all, run_case
from tests.transition.cases import CASES, RULE_CASES

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
]

BUDGET = max(c.cap() for c in [*CASES, *RULE_CASES.values()])
RULES = sorted(RULE_CASES)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def holders():
    before, segments = children(), shm_segments()
    async with Cluster.local(
        devices=4, memory_per_device=BUDGET, heartbeat_timeout_s=30.0
    ) as cluster:
        mesh = await cluster.spawn("ruled", DelayHolder, devices=[0, 1, 2, 3])
        yield cluster, {r.device: r for r in mesh.refs}
        await cluster.stop_mesh(mesh)
    assert not wait_gone(children() - before, timeout_s=10), "leaked worker processes"
    assert shm_segments() <= segments


def _without(rule: str):
    """(build keywords, dispatch rules) with ``rule`` off where it acts."""
    off = ALL_RULES.without(rule)
    return ({"rules": off}, None) if rule == "resource_edges" else ({}, off)


def _ledger_refused(error: BaseException | None) -> bool:
    return isinstance(error, RemoteError) and error.remote_type == "OutOfMemory"


@pytest.mark.parametrize("rule", RULES)
async def test_with_every_rule_the_case_finishes_within_budget_without_the_net(holders, rule):
    cluster, refs = holders
    case = RULE_CASES[rule]
    try:
        run = await run_case(
            case, refs, cluster, seed=1, epoch=300 + RULES.index(rule), check_caps=False
        )
        assert run.report.ok, run.report.error
        assert all(run.coverage)
        assert all(p <= case.cap() for p in run.peaks.values()), (run.peaks, case.cap())
        await check_target(run, refs)
    finally:
        await drop_all(refs)


@pytest.mark.parametrize("rule", RULES)
async def test_without_the_rule_a_worker_ledger_overflows_or_the_run_deadlocks(holders, rule):
    cluster, refs = holders
    case = RULE_CASES[rule]
    build, dispatch = _without(rule)
    try:
        dag = case.dag(duration=MODEL.seconds, **build)
        run = await run_case(
            case,
            refs,
            cluster,
            seed=2,
            epoch=310 + RULES.index(rule),
            dag=dag,
            rules=dispatch,
            check_caps=False,
        )
        error = run.report.error
        assert not run.report.ok
        assert _ledger_refused(error) or isinstance(error, InfeasibleTransition), repr(error)
        # a refusing ledger allocated nothing: no worker went past its budget, and what the
        # failed node read is still there (every model-stage stays covered)
        assert all(p <= case.cap() for p in run.peaks.values()), (run.peaks, case.cap())
        assert all(run.coverage)
    finally:
        await drop_all(refs)


@pytest.mark.parametrize("trial", range(8))
async def test_with_the_net_off_the_rules_alone_keep_every_trial_within_budget(holders, trial):
    cluster, refs = holders
    cases = [*CASES, RULE_CASES["stage_order"]]
    case = cases[trial % len(cases)]
    try:
        run = await run_case(case, refs, cluster, seed=trial, epoch=320 + trial, check_caps=False)
        assert run.report.ok, run.report.error
        assert all(p <= case.cap() for p in run.peaks.values()), (run.peaks, case.cap())
        await check_target(run, refs)
    finally:
        await drop_all(refs)
