"""A chaos run: GRPO on 4 CPU devices while a harness kills workers (one in the middle of
a step, one inside a transition DAG, one more at random), adds a fresh node in place of
each, drains a device and adds one back. Every step finishes, no call hangs, the logical
state is intact (every replica bitwise equal, one committed update per step), no sample
is in two committed updates and none is skipped; the job reports the faults it
recovered from, the checkpoints it restored and how long recovery took."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import pytest

from nereus.job.loop import RLJob
from tests.job._jobs import job
from tests.job._state import logical_state

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(420),
]  # ~30 s alone; once past 240 s at load 18

STEPS = 14
PROMPTS = 8


def _pid(cluster, device: int) -> int:
    return next(w.proc.pid for node in cluster.nodes for w in node.workers if w.index == device)


async def test_grpo_survives_killed_workers_a_drain_and_returning_devices(tmp_path):
    rng = random.Random(7)
    cfg = job(
        str(tmp_path),
        STEPS,
        algorithm={"prompts_per_step": PROMPTS, "samples_per_prompt": 8},
        sampling={"max_new_tokens": 8},
        cluster={"mode": "local", "devices": 4, "memory_per_device": "256MiB"},
        plan={
            "policy_generation": {"devices": [0, 1, 2, 3], "dp": 4},
            "policy_training": {"devices": [0, 1], "dp": 2},
        },
        adapt={"enabled": True, "join_horizon_steps": 1000},
        run={
            "steps": STEPS,
            "out_dir": str(tmp_path),
            "progress": False,
            "seed": 0,
            "checkpoint_every": 4,
        },
    )
    rl = RLJob(cfg)
    injected: list[tuple[str, int, int]] = []  # (when, step, device)
    kill_in_transition = asyncio.Event()
    last_kill_done = (
        asyncio.Event()
    )  # the job waits for it before its last steps, so it lands inside the run

    async def kill(device: int, when: str) -> None:
        injected.append((when, rl.step, device))
        os.kill(_pid(rl.stages.cluster, device), signal.SIGKILL)

    async def replace_later() -> None:
        await asyncio.sleep(0.5)
        await rl.stages.cluster.add_node(1)

    async def harness(job_: RLJob, record: dict) -> None:
        step = job_.step
        cluster = job_.stages.cluster
        if step == 3:  # a drain: the next boundary empties the device, DP goes down
            cluster.drain(max(job_.stages.plan.devices))
        elif step == 5:  # ... and a device comes back
            await cluster.add_node(1)
        elif step == 7:  # the next change gets a worker killed inside its DAG
            kill_in_transition.set()
            cluster.drain(max(job_.stages.plan.devices))
        elif step == STEPS - 2:
            await asyncio.wait_for(last_kill_done.wait(), 60)

    async def mid_step_kills() -> None:
        while rl.stages is None or rl.step < 1:
            await asyncio.sleep(0.02)
        await asyncio.sleep(rng.uniform(0.1, 0.4))
        await kill(rng.choice(sorted(rl.stages.plan.devices)), "step")
        await replace_later()
        while rl.step < 10:
            await asyncio.sleep(0.02)
        await asyncio.sleep(rng.uniform(0.1, 0.4))
        await kill(rng.choice(sorted(rl.stages.plan.devices)), "step")
        last_kill_done.set()
        await replace_later()

    rl.boundary_hooks.append(harness)
    await rl.start()
    original = rl.stages.apply_plan

    async def apply_plan(target, *, overlap=False):
        if kill_in_transition.is_set():
            kill_in_transition.clear()
            victim = sorted(set(target.devices) & set(rl.stages.plan.devices))[0]

            async def during() -> None:
                await asyncio.sleep(0.05)
                await kill(victim, "transition")

            asyncio.ensure_future(during())
            asyncio.ensure_future(replace_later())
        return await original(target, overlap=overlap)

    rl.stages.apply_plan = apply_plan
    chaos = asyncio.ensure_future(mid_step_kills())
    t0 = time.perf_counter()
    try:
        records = await asyncio.wait_for(rl._loop(), 200)
        final = await logical_state(rl.stages, rl.dataset.position)
    finally:
        chaos.cancel()
        await rl.close()
    wall = time.perf_counter() - t0

    assert len(injected) == 3 and {w for w, _, _ in injected} == {"step", "transition"}
    assert len(rl.faults) >= 3 - 1  # two kills may land in one recovery
    report = {
        "faults_injected": len(injected),
        "recovered": len(rl.faults),
        "checkpoint_restores": sum(bool(f.restored_from) for f in rl.faults),
        "recover_seconds": [round(f.recover_seconds, 2) for f in rl.faults],
        "wall_seconds": round(wall, 1),
    }
    print("chaos report:", json.dumps(report))
    # every step finished, in order, once (a redone step is recorded once, when it commits)
    done = sorted(
        {r["step"] for r in records}
        | {f.step for f in rl.faults if f.committed and f.during == "step"}
    )
    assert done == list(range(STEPS))
    # one committed update per step and every sample once: the counters and the position agree
    (full, states), *others = final["policy_training"]
    assert {s["update_count"] for s in states} == {STEPS}
    assert final["position"] == STEPS * PROMPTS
    for r in records:
        assert r["dataset_position"] == (r["step"] + 1) * PROMPTS
    for other, other_states in others:  # replicas agree bitwise
        assert all(full[k].equal(other[k]) for k in full)
        assert {s["update_count"] for s in other_states} == {STEPS}
    events = [json.loads(line) for line in (tmp_path / "tap.jsonl").read_text().splitlines()]
    assert sum(e["type"] == "fault" for e in events) == len(rl.faults)


async def test_a_job_whose_every_worker_died_waits_for_a_node_and_restores_its_checkpoint(tmp_path):
    # one device: a kill mid-step leaves the job no device at all until a node joins
    steps = 4
    cfg = job(
        str(tmp_path),
        steps,
        algorithm={"prompts_per_step": PROMPTS, "samples_per_prompt": 8},
        sampling={"max_new_tokens": 8},
        cluster={"mode": "local", "devices": 1, "memory_per_device": "256MiB"},
        plan={"policy_generation": {"devices": [0]}, "policy_training": {"devices": [0]}},
        adapt={"enabled": True, "pool_wait_s": 60},
        run={
            "steps": steps,
            "out_dir": str(tmp_path),
            "progress": False,
            "seed": 0,
            "checkpoint_every": 1,
        },
    )
    rl = RLJob(cfg)

    async def join_later() -> None:
        await asyncio.sleep(1.0)
        await rl.stages.cluster.add_node(1)

    killed: list[int] = []

    async def harness(job_: RLJob, record: dict) -> None:
        if job_.step == 2 and not killed:  # the next step finds its only worker dead
            killed.append(job_.step)
            os.kill(_pid(job_.stages.cluster, 0), signal.SIGKILL)
            asyncio.ensure_future(join_later())

    rl.boundary_hooks.append(harness)
    await rl.start()
    try:
        records = await asyncio.wait_for(rl._loop(), 200)
        final = await logical_state(rl.stages, rl.dataset.position)
        devices = sorted(rl.stages.plan.devices)
    finally:
        await rl.close()
    assert (
        len(rl.faults) == 1 and rl.faults[0].restored_from
    )  # the last copy died: from the checkpoint
    assert devices == [1]  # on the node that joined
    done = sorted(
        {r["step"] for r in records}
        | {f.step for f in rl.faults if f.committed and f.during == "step"}
    )
    assert done == list(range(steps))
    (_, states), *_ = final["policy_training"]
    assert {s["update_count"] for s in states} == {steps}
    assert final["position"] == steps * PROMPTS
