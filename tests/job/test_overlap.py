"""Overlap in synchronous mode: while training reshards, the next step's generation runs
on the devices the transition does not touch, from the weights the last sync left, and
the step waits only where it needs the moving model-stage."""

from __future__ import annotations

import time

import pytest

from nereus.job.loop import RLJob
from nereus.planner import Plan, StagePlan
from tests.job._jobs import job

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


def _config(out: str):
    return job(
        out,
        4,
        model={"hidden_size": 128, "intermediate_size": 256},
        cluster={"mode": "local", "devices": 4, "memory_per_device": "256MiB"},
        plan=PLAN,
    )


async def test_generation_of_the_next_step_runs_while_training_reshards(tmp_path):
    steady = RLJob(_config(str(tmp_path / "steady")))
    await steady.start()
    try:
        want = [await steady.run_step() for _ in range(3)]
    finally:
        await steady.close()

    rl = RLJob(_config(str(tmp_path / "overlap")))
    await rl.start()
    starts: list[float] = []
    try:
        got = [await rl.run_step()]
        gen = rl.stages.handles["policy_generation"]
        original = gen.generate

        async def timed(*args, **kwargs):
            starts.append(time.perf_counter())
            return await original(*args, **kwargs)

        gen.generate = timed
        started = await rl.apply_plan(TARGET, overlap=True)
        assert (
            started["changed"] == ["policy_training"] and rl.stages.plan != TARGET
        )  # still running
        got.append(await rl.run_step())
        report = rl.stages.last_transition
        got.append(await rl.run_step())
    finally:
        await rl.close()
    # generation of step 1 started before the training EMUs were done moving
    assert starts and starts[0] < report["moves_ended_at"], (starts, report)
    assert report["ok"] and report["bytes_measured"] == report["bytes"] > 0
    # and from the weights step 0's sync left: the same rollouts as a run that never moved
    for a, b in zip(got[:2], want[:2], strict=True):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
    assert got[1]["epoch"] == 2 and got[2]["epoch"] == 2
