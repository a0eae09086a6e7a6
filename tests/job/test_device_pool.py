"""Devices that leave and join a running job: a drained device is emptied by the next change
and its worker stops; a node added mid-job takes work at the next change; a node that
leaves and a worker that is killed reach ``on_failure`` with their device."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from nereus.errors import ConfigError
from nereus.job.loop import RLJob
from nereus.planner import Plan, StagePlan
from tests._leaks import children, wait_gone
from tests.job._jobs import job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _plan(gen: list[list[int]], train: list[list[int]]) -> Plan:
    return Plan(
        (
            ("policy_generation", StagePlan(1, 1, len(gen), tuple(tuple(d) for d in gen))),
            ("policy_training", StagePlan(1, 1, len(train), tuple(tuple(d) for d in train))),
        )
    )


def _pid(cluster, device: int) -> int:
    return next(w.proc.pid for node in cluster.nodes for w in node.workers if w.index == device)


async def _failure(stages, device: int, timeout_s: float = 30.0):
    """The first failure reported for ``device``, waited for on the event with a deadline."""

    async def wait() -> object:
        while True:
            hit = next((f for f in stages.failures if f.device == device), None)
            if hit is not None:
                return hit
            stages.failure_event.clear()
            await stages.failure_event.wait()

    return await asyncio.wait_for(wait(), timeout_s)


async def test_drain_join_leave_and_a_killed_worker_in_a_running_job(tmp_path):
    before = children()
    plan = {
        "policy_generation": {"devices": [0, 1, 2, 3], "dp": 4},
        "policy_training": {"devices": [0]},
    }
    rl = RLJob(
        job(
            str(tmp_path),
            4,
            cluster={"mode": "local", "devices": 4, "memory_per_device": "256MiB"},
            plan=plan,
        )
    )
    await rl.start()
    try:
        records = [await rl.run_step()]
        stages, cluster = rl.stages, rl.stages.cluster
        drained = _pid(cluster, 3)

        cluster.drain(3)
        with pytest.raises(ConfigError, match="draining"):
            await rl.apply_plan(_plan([[0], [1], [2], [3]], [[1]]))
        report = await rl.apply_plan(_plan([[0], [1]], [[1]]))
        assert report["bytes"] > 0  # training moved to device 1
        assert 3 not in {d.index for d in cluster.devices} and 3 not in cluster.draining
        assert drained not in children(), "the drained device's worker did not stop"
        assert stages.failures == []  # a retired device is no failure
        records.append(await rl.run_step())

        joined = await cluster.add_node(devices=1)
        assert joined == [4]
        await rl.apply_plan(_plan([[0], [1], [2], [4]], [[4]]))
        records.append(await rl.run_step())
        assert [r["epoch"] for r in records] == [1, 2, 3]
        assert set(records[-1]["device_peak_bytes"]) == {"0", "1", "2", "4"}

        # a node that leaves gracefully, and a worker that is killed, reach on_failure
        await cluster.nodes[-1].stop()
        left = await _failure(stages, 4)
        assert "node left" in left.reason
        os.kill(_pid(cluster, 2), signal.SIGKILL)
        killed = await _failure(stages, 2)
        assert killed.reason == "SIGKILL" and killed.device == 2
    finally:
        await rl.close()
    assert not wait_gone(children() - before, timeout_s=10), "leaked worker processes"
