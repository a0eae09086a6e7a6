"""A restored run's record says each step once: three workers killed one after another
at step boundaries, the last of them holding both model-stages' last EMUs, make the job
restore its checkpoint at a later step and redo the steps after it. metrics.jsonl,
TensorBoard, W&B and MLflow then hold every step once (the redone one), the tap has a
``rewind`` event naming the dropped steps, and the job's records count its steps."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from nereus.job.loop import RLJob
from nereus.job.report import read_metrics
from tests.job._jobs import job
from tests.job.test_loggers import read_mlflow, read_tensorboard, read_wandb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 9
PROMPTS = 6
KILLS = {5: 0, 6: 1, 7: 2}  # next step -> device whose worker dies at that boundary


def _pid(cluster, device: int) -> int:
    return next(w.proc.pid for node in cluster.nodes for w in node.workers if w.index == device)


async def test_a_restore_after_the_last_copy_died_records_each_step_once(tmp_path):
    cfg = job(
        str(tmp_path),
        STEPS,
        algorithm={"prompts_per_step": PROMPTS, "samples_per_prompt": 8},
        sampling={"max_new_tokens": 8},
        cluster={"mode": "local", "devices": 3, "memory_per_device": "256MiB"},
        plan={
            "policy_generation": {"devices": [0, 1, 2], "dp": 3},
            "policy_training": {"devices": [0, 1], "dp": 2},
        },
        adapt={"enabled": True, "pool_wait_s": 60, "join_horizon_steps": 1000},
        run={
            "steps": STEPS,
            "out_dir": str(tmp_path),
            "progress": False,
            "seed": 0,
            "checkpoint_every": 4,
            "loggers": ["jsonl", "tensorboard", "wandb", "mlflow"],
            "experiment": "rewind",
        },
    )
    rl = RLJob(cfg)
    killed: list[tuple[int, int, list[int]]] = []  # (next step, device, devices of the plan then)

    async def join_later() -> None:
        await asyncio.sleep(1.0)
        await rl.stages.cluster.add_node(1)

    async def harness(job_: RLJob, record: dict) -> None:
        device = KILLS.get(job_.step)
        if device is None or any(k[0] == job_.step for k in killed):
            return
        plan = sorted(job_.stages.plan.devices)
        killed.append((job_.step, device, plan))
        os.kill(_pid(job_.stages.cluster, device), signal.SIGKILL)
        if len(killed) == len(KILLS):  # the last worker is gone: a fresh node joins later
            asyncio.ensure_future(join_later())

    rl.boundary_hooks.append(harness)
    await rl.start()
    try:
        records = await asyncio.wait_for(rl._loop(), 300)
    finally:
        await rl.close()
    assert [k[1] for k in killed] == [0, 1, 2]
    assert killed[-1][2] == [2], (
        killed
    )  # the last victim was the only device left, holding both model-stages
    restores = [f for f in rl.faults if f.restored_from]
    assert [f.restored_from for f in restores] == ["step_4"], [f.as_record() for f in rl.faults]
    redone = [r["step"] for r in records]
    assert redone == list(range(STEPS))  # the job's records: each step once
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows == [
        json.loads(json.dumps(r)) for r in records
    ]  # the redone steps' records, not the lost ones
    want = [(r["step"], pytest.approx(r["reward_mean"])) for r in records]
    assert read_tensorboard(tmp_path / "tensorboard")["reward_mean"] == want
    assert read_wandb(tmp_path / "wandb")[0]["reward_mean"] == want
    assert read_mlflow(tmp_path / "mlflow.db", "rewind")[0]["reward_mean"] == want
    events = [json.loads(line) for line in (tmp_path / "tap.jsonl").read_text().splitlines()]
    rewinds = [e for e in events if e["type"] == "rewind"]
    assert len(rewinds) == 1 and rewinds[0]["step"] == 4 and rewinds[0]["checkpoint"] == "step_4"
    assert rewinds[0]["discarded_steps"] == list(range(4, restores[0].step)), (
        rewinds,
        restores[0].step,
    )
    assert rewinds[0]["discarded_steps"], "the restore dropped no step: the test did not rewind"
