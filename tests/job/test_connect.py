"""An RL job attached to a running cluster (cluster.mode = "connect"): a standalone
controller and a node daemon, the job runs its steps on their workers, and closing the
job stops its actors but leaves the cluster's workers running."""

from __future__ import annotations

import os

import pytest

from nereus.actors import Actor, Cluster, Controller, NodeDaemon, endpoint
from nereus.errors import ConfigError
from nereus.job.loop import RLJob
from tests.job._jobs import job

pytestmark = pytest.mark.integration

KEY = b"an-rl-job-connect-test-key-0123456789"


class Probe(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"


@pytest.mark.timeout(180)
async def test_grpo_on_a_running_cluster(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    controller = await Controller(KEY).start()
    node = NodeDaemon(
        controller.address, KEY, devices=2, memory_per_device="512MiB", node_id="hostA"
    )
    try:
        await node.start()
        pids = [w.proc.pid for w in node.workers]
        cfg = job(
            str(tmp_path / "run"),
            2,
            cluster={
                "mode": "connect",
                "address": controller.address,
                "key_file": str(key_file),
                "devices": 2,
            },
            plan={
                "policy_generation": {"devices": [0, 1], "dp": 2},
                "policy_training": {"devices": [1]},
            },
        )
        rl = RLJob(cfg)
        await rl.start()
        try:
            records = [await rl.run_step() for _ in range(2)]
            memory = await rl.stages.memory()
        finally:
            await rl.close()
        assert [r["step"] for r in records] == [0, 1]
        assert records[1]["policy_version"] == 1  # a weight sync between the steps
        assert "shards/policy_training.0" in memory[1]["breakdown"]
        assert "shards/policy_generation.0" in memory[0]["breakdown"]
        # The cluster outlives the job: same workers, no actors of the job left on them.
        assert [w.proc.pid for w in node.workers] == pids
        assert all(w.proc.returncode is None for w in node.workers)
        for pid in pids:
            os.kill(pid, 0)
        async with Cluster.connect(controller.address, key=KEY, min_devices=2) as again:
            assert len(again.devices) == 2
            # The job's actors are gone: their names are free again on those workers.
            mesh = await again.spawn("policy_generation-0", Probe, devices=[0, 1])
            assert await mesh.ping.call() == ["pong", "pong"]
    finally:
        await node.stop()
        await controller.close()


def test_connect_needs_an_address(tmp_path):
    with pytest.raises(ConfigError, match="cluster.address"):
        job(str(tmp_path), 1, cluster={"mode": "connect"})
