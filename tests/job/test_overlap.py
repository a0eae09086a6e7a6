"""Overlap in synchronous mode: while training reshards, the next step's generation runs
on the devices the transition does not touch, from the weights the last sync left, and
the step waits only where it needs the moving model-stage. The controller loop runs a
drain's change that way by default (``[adapt] overlap = "auto"``) on devices of fixed
compute, with the same rollouts and logical state as the same job run without overlap;
"auto" keeps a change that holds generation back, or one on shared cores, out of the
step; a worker that dies inside an overlapped change fails the step at its wait.

The ordering is the job's own record: a change's report notes when each model-stage
that worked beside it began (``ran_beside``), on the clock of ``moves_ended_at``."""

from __future__ import annotations

import json
import os
import signal

import pytest

from nereus.job.loop import RLJob
from nereus.job.recovery import is_fault
from nereus.planner import Plan, StagePlan
from tests.job._jobs import job
from tests.job._state import assert_same_state, logical_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PLAN = {
    "policy_generation": {"devices": [0, 1], "dp": 2},
    "policy_training": {"devices": [2, 3], "tp": 2},
}
TARGET = Plan(
    (
        ("policy_generation", StagePlan(1, 1, 2, ((0,), (1,)))),
        ("policy_training", StagePlan(1, 2, 1, ((2, 3),))),
    )
)
KEYS = (
    "reward_mean",
    "response_len_mean",
    "tokens_generated",
    "policy_version",
    "dataset_position",
)


def _config(out: str, steps: int = 4, plan=PLAN, cluster=None, **sections):
    return job(
        out,
        steps,
        model={"hidden_size": 128, "intermediate_size": 256},
        cluster={"mode": "local", "devices": 4, "memory_per_device": "256MiB", **(cluster or {})},
        plan=plan,
        **sections,
    )


def _pid(cluster, device: int) -> int:
    return next(w.proc.pid for node in cluster.nodes for w in node.workers if w.index == device)


async def test_generation_of_the_next_step_runs_while_training_reshards(tmp_path):
    steady = RLJob(_config(str(tmp_path / "steady")))
    await steady.start()
    try:
        want = [await steady.run_step() for _ in range(3)]
    finally:
        await steady.close()

    rl = RLJob(_config(str(tmp_path / "overlap")))
    await rl.start()
    try:
        got = [await rl.run_step()]
        started = await rl.apply_plan(TARGET, overlap=True)
        assert (
            started["changed"] == ["policy_training"] and rl.stages.plan != TARGET
        )  # still running
        assert started["overlapped"] and started["held_back"] == ["policy_training"]
        got.append(await rl.run_step())
        report = rl.stages.last_transition
        got.append(await rl.run_step())
    finally:
        await rl.close()
    # generation of step 1 began before the training EMUs were done moving
    assert report is started and set(report["ran_beside"]) == {"policy_generation"}
    assert report["ran_beside"]["policy_generation"] < report["moves_ended_at"], report
    assert report["ok"] and report["bytes_measured"] == report["bytes"] > 0
    # and from the weights step 0's sync left: the same rollouts as a run that never moved
    for a, b in zip(got[:2], want[:2], strict=True):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
    assert got[1]["epoch"] == 2 and got[2]["epoch"] == 2


# two replicas of each: a drained device takes one replica of one model-stage
REPLICAS = {
    "policy_generation": {"devices": [0, 1], "dp": 2},
    "policy_training": {"devices": [2, 3], "dp": 2},
}


def _drained(device: int):
    async def hook(rl: RLJob, record: dict) -> None:
        if rl.step == 1:  # after step 0: the change runs at this boundary
            rl.stages.cluster.drain(device)

    return hook


async def _run_drained(out, device: int, steps: int = 3, **sections) -> tuple[RLJob, list, dict]:
    """A job with adaptation whose device ``device`` is drained after step 0 (the static
    policy keeps the layouts: the drained device's model-stage loses a replica)."""
    adapt = {"enabled": True, "policy": "static", **sections.pop("adapt", {})}
    rl = RLJob(_config(str(out), steps, plan=REPLICAS, adapt=adapt, **sections))
    rl.boundary_hooks.append(_drained(device))
    await rl.start()
    try:
        records = await rl._loop()
        state = await logical_state(rl.stages, rl.dataset.position)
    finally:
        await rl.close()
    return rl, records, state


async def test_a_drain_runs_beside_the_next_steps_generation_by_default(tmp_path):
    capped = {"cores_per_device": 0.45}
    rl, records, state = await _run_drained(tmp_path / "auto", 3, cluster=capped)
    off, records_off, state_off = await _run_drained(
        tmp_path / "off", 3, cluster=capped, adapt={"overlap": False}
    )
    [change], [change_off] = rl.adapter.changes, off.adapter.changes
    report = change.report
    # "auto": training leaves device 3, generation on devices 0 and 1 is left alone
    assert change.overlapped and report["held_back"] == ["policy_training"]
    assert report["ran_beside"]["policy_generation"] < report["moves_ended_at"], report
    assert not change_off.overlapped and "ran_beside" not in change_off.report
    assert change.to_plan == change_off.to_plan and change.step == 1
    # the record of the boundary that started it says what it took, as the log does
    logged = [
        json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()
    ]
    for rec in (records[0]["transition"], logged[0]["transition"]):
        assert rec["overlapped"] and rec["ok"] and rec["measured_seconds"] > 0
    assert [r["step"] for r in logged] == [0, 1, 2]
    events = [json.loads(x) for x in (tmp_path / "auto" / "tap.jsonl").read_text().splitlines()]
    assert [e["overlapped"] for e in events if e["type"] == "transition"] == [True]
    # the same rollouts and the same logical state as the job that waited for the change
    for a, b in zip(records, records_off, strict=True):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
    assert_same_state(state_off, state)


@pytest.mark.parametrize(
    ("cores", "device"),
    [(0.45, 1), ("shared", 3)],
    ids=["generation-held-back", "shared-cores"],
)
async def test_auto_keeps_a_change_out_of_the_step_where_it_would_not_pay(tmp_path, cores, device):
    rl, records, _ = await _run_drained(tmp_path, device, 2, cluster={"cores_per_device": cores})
    [change] = rl.adapter.changes
    assert not change.overlapped and not records[0]["transition"]["overlapped"]
    assert "ran_beside" not in change.report
    assert ("policy_generation" in change.report["held_back"]) == (device == 1)


async def test_a_worker_that_dies_inside_an_overlapped_change_fails_the_step_at_its_wait(
    tmp_path,
):
    rl = RLJob(_config(str(tmp_path), plan=REPLICAS))
    await rl.start()
    try:
        await rl.run_step()
        shrink = Plan(
            (
                ("policy_generation", StagePlan(1, 1, 2, ((0,), (1,)))),
                ("policy_training", StagePlan(1, 1, 1, ((2,),))),
            )
        )
        started = await rl.apply_plan(shrink, overlap=True)
        # dead before the change sends its first move (the Destroy of its replica there)
        os.kill(_pid(rl.stages.cluster, 3), signal.SIGKILL)
        with pytest.raises(Exception) as info:
            await rl.run_step()
        assert is_fault(info.value), info.value
        # generation went on beside the change; training waited and got its failure
        assert set(started["ran_beside"]) == {"policy_generation"}
        assert started["ok"] is False and not rl.stages.changes.running
        assert await rl.stages.transition_done() is None
    finally:
        await rl.close()


async def test_a_job_recovers_from_a_death_inside_the_change_that_ran_beside_its_step(tmp_path):
    rl = RLJob(
        _config(
            str(tmp_path),
            4,
            plan=REPLICAS,
            cluster={"cores_per_device": 0.45},
            adapt={"enabled": True, "policy": "static"},
        )
    )
    rl.boundary_hooks.append(_drained(3))
    await rl.start()
    original = rl.stages.apply_plan

    async def apply_plan(target, *, overlap=False):
        report = await original(target, overlap=overlap)
        if report["overlapped"]:  # the drained device dies before the change reaches it
            os.kill(_pid(rl.stages.cluster, 3), signal.SIGKILL)
        return report

    rl.stages.apply_plan = apply_plan
    try:
        records = await rl._loop()
    finally:
        await rl.close()
    # the step beside the change got its failure at the wait, committed nothing, was redone
    [fault] = rl.faults
    assert (fault.step, fault.during, fault.devices) == (1, "step", [3])
    assert fault.redone and not fault.committed and fault.dropped == ["policy_training.1"]
    failed = records[0]["transition"]
    assert failed["overlapped"] and failed["ok"] is False
    # every step once, in order, each with one update and its own samples
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["policy_version"] for r in records] == [0, 1, 2, 3]
    assert [r["dataset_position"] for r in records] == [8, 16, 24, 32]
    logged = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [0, 1, 2, 3]
