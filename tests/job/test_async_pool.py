"""Device-pool events in an asynchronous run, handled at weight syncs by the async adapter:
a device of the plan that drains is left at the next sync (its worker stops), a device
that joins is priced and taken when the pipeline price says it pays; over the run every
position is trained once, every token within the staleness bound, and the training
EMUs hold one update per step (logical state intact). A generation EMU killed mid-run
loses only its unfinished groups, and its capacity is rebuilt on a device that joins."""

from __future__ import annotations

import asyncio

import pytest

from nereus.job.async_loop import AsyncRun
from nereus.job.loop import RLJob
from tests.job._jobs import job
from tests.job.test_async_job import (  # noqa: F401 (fixtures)
    B,
    _check_tokens,
    kill_at_next_call,
    no_leaked_processes,
    no_leaks,
)

PLAN = {"policy_generation": {"devices": [1, 2], "dp": 2}, "policy_training": {"devices": [0]}}
CLUSTER = {"mode": "local", "devices": 3, "memory_per_device": "256MiB"}


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_a_drain_and_a_join_during_an_async_run(tmp_path, no_leaks):  # noqa: F811
    steps, k, drain_at, join_at = 30, 1, 6, 14
    cfg = job(
        str(tmp_path),
        steps,
        cluster=CLUSTER,
        plan=PLAN,
        rl={"mode": "async", "max_staleness": k, "partial_rollout": True},
        # a large gamma: any change the pipeline price says saves time is admitted, so the
        # joined device is taken if the planner prefers a plan with it
        adapt={"enabled": True, "gamma": 1000.0, "length_drift": 5.0},
        run={"steps": steps, "out_dir": str(tmp_path), "progress": False, "seed": 0},
    )
    seen: dict[str, object] = {}

    async def pool_events(rl: RLJob, record) -> None:
        cluster = rl.stages.cluster
        if record["step"] == drain_at:
            cluster.drain(2)
        elif record["step"] == join_at:
            seen["joined"] = await cluster.add_node(devices=1)
        elif record["step"] == join_at + 1:
            seen["plan_after_join"] = rl.stages.plan

    rl = RLJob(cfg)
    await rl.start()
    try:
        run = AsyncRun(rl)
        rl.async_run = run
        rl.boundary_hooks.append(pool_events)
        await run.run()
        counts = await asyncio.gather(
            *(
                rl.stages.hosts[d].get_state.call_one(e.name)
                for e in rl.stages.emus["policy_training"]
                for d in e.devices[:1]
            )
        )
        live = {d.index for d in rl.stages.cluster.devices}
    finally:
        await rl.close()
    decisions = run.adapter.decisions
    kinds = [[t["kind"] for t in d["triggers"]] for d in decisions]
    # the drain fired at the next weight sync (a decision names the update after it: the
    # hook of update n runs after that sync's decision, so update n + 1's sync sees it)
    # and the plan left device 2
    drain = next(d for d, ks in zip(decisions, kinds, strict=True) if "drain" in ks)
    assert drain["step"] == drain_at + 2 and drain["admitted"]
    assert 2 not in live, "the drained device's worker did not stop"
    # the join fired at the next weight sync and was priced on the larger pool
    assert seen["joined"] == [3]
    join = next(d for d, ks in zip(decisions, kinds, strict=True) if "join" in ks)
    assert join["step"] == join_at + 2
    after = seen["plan_after_join"]  # the plan after the join's sync
    assert 2 not in after.devices
    assert (3 in after.devices) == join["admitted"], (join, after)
    # the run as a whole: each position once, every token within k, one update per step
    records = run.records
    assert len(records) == steps and rl.step == steps
    positions = [p for r in records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * B)), "a position was trained twice or skipped"
    _check_tokens(run, k)
    assert run.summary["max_staleness_seen"] <= k and run.summary["samples_discarded"] == 0
    assert [c["update_count"] for c in counts] == [steps] * len(counts)


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_a_lost_generation_emu_is_rebuilt_on_a_replacement_device(
    tmp_path,
    no_leaked_processes,  # noqa: F811
):
    steps, k, kill_at = 20, 1, 4
    cfg = job(
        str(tmp_path),
        steps,
        # each device a fixed amount of compute: on shared cores a device more adds none,
        # and the planner rightly leaves a replacement unused
        cluster={**CLUSTER, "devices": 4, "cores_per_device": 0.45},
        plan={
            "policy_generation": {"devices": [2, 3], "dp": 2},
            "policy_training": {"devices": [0, 1], "dp": 2},
        },
        # every response runs to the cap: generation is the slower side, so the planner
        # wants generation devices and a lost one is worth rebuilding
        sampling={"max_new_tokens": 24, "ignore_eos": True},
        rl={"mode": "async", "max_staleness": k, "partial_rollout": False},
        adapt={"enabled": True, "gamma": 1000.0, "length_drift": 5.0},
        run={"steps": steps, "out_dir": str(tmp_path), "progress": False, "seed": 0},
    )
    seen: dict[str, object] = {}

    async def kill_and_replace(rl: RLJob, record) -> None:
        if record["step"] != kill_at:
            return
        workers = rl.async_run.workers
        assert len(workers) >= 2, f"the planner left {len(workers)} generation EMU(s)"
        victim = workers[-1]
        seen["device"] = device = victim.emu.devices[0]
        seen["before"] = len(rl.stages.plan.devices)
        kill_at_next_call(rl, [victim], [device], seen)
        for _ in range(4000):  # the victim was killed at a call and its producer saw it die
            if rl.async_run.lost_workers:
                break
            await asyncio.sleep(0.005)
        seen["joined"] = await rl.stages.cluster.add_node(devices=1)

    rl = RLJob(cfg)
    await rl.start()
    try:
        run = AsyncRun(rl)
        rl.async_run = run
        rl.boundary_hooks.append(kill_and_replace)
        await run.run()
        counts = await asyncio.gather(
            *(
                rl.stages.hosts[d].get_state.call_one(e.name)
                for e in rl.stages.emus["policy_training"]
                for d in e.devices[:1]
            )
        )
        plan = rl.stages.plan
    finally:
        await rl.close()
    dead = seen["device"]
    assert seen["in_flight"] and seen["joined"] == [4]
    assert run.lost_workers and run.lost_workers[0][1] == [dead]
    decision = next(
        d for d in run.adapter.decisions if {"fault", "join"} <= {t["kind"] for t in d["triggers"]}
    )
    assert decision["admitted"], decision["reason"]
    # the lost device's capacity is rebuilt on the replacement: as many devices in use as
    # before the fault
    assert 4 in plan.devices and dead not in plan.devices, plan
    assert len(plan.devices) >= seen["before"], (plan, seen["before"])
    positions = [p for r in run.records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * B)), "a position was trained twice or skipped"
    assert run.ledger.regenerated_groups >= 1 and run.summary["samples_discarded"] == 0
    _check_tokens(run, k)
    assert [c["update_count"] for c in counts] == [steps] * len(counts)


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_the_memory_trigger_moves_training_before_a_cap_it_cannot_hold(
    tmp_path,
    no_leaks,  # noqa: F811
):
    # training on one device of 12 MiB holds the cap of 6 tokens, not the cap of 12 the
    # schedule reaches at update 8 (the memory model: about 14 MB); on two it does
    steps, k, rise = 12, 1, 8
    cfg = job(
        str(tmp_path),
        steps,
        cluster={**CLUSTER, "memory_per_device": "12MiB"},
        plan={"policy_generation": {"devices": [1]}, "policy_training": {"devices": [0]}},
        sampling={"max_new_tokens": [[0, 6], [rise, 12]], "ignore_eos": True},
        rl={"mode": "async", "max_staleness": k, "partial_rollout": True},
        # a gamma so small that no soft trigger is admitted: only the hard one moves
        adapt={"enabled": True, "gamma": 1e-9, "length_drift": 5.0},
        run={"steps": steps, "out_dir": str(tmp_path), "progress": False, "seed": 0},
    )
    rl = RLJob(cfg)
    await rl.start()
    try:
        run = AsyncRun(rl)
        rl.async_run = run
        await run.run()
        counts = await asyncio.gather(
            *(
                rl.stages.hosts[d].get_state.call_one(e.name)
                for e in rl.stages.emus["policy_training"]
                for d in e.devices[:1]
            )
        )
        plan = rl.stages.plan
    finally:
        await rl.close()
    memory = [d for d in run.adapter.decisions if any(t["kind"] == "memory" for t in d["triggers"])]
    assert memory, run.adapter.decisions
    assert memory[0]["step"] == rise and memory[0]["admitted"], memory[0]
    assert [c["step"] for c in run.adapter.changes] == [rise]  # nothing soft was admitted
    assert plan["policy_training"].dp == 2, plan
    positions = [p for r in run.records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * B))
    _check_tokens(run, k)
    assert [c["update_count"] for c in counts] == [steps] * len(counts)
