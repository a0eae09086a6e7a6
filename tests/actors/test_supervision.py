"""A SIGKILLed worker is reported within 2 s; in-flight calls fail at once."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import pytest

from nereus.actors import Cluster, Failure
from nereus.errors import ActorDied
from nereus.monitor import Subscriber
from tests.actors._actors import Echo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


async def test_sigkilled_worker_is_reported_and_calls_fail(no_leaks):
    async with Cluster.local(devices=3, memory_per_device="128MiB") as cluster:
        failures: list[Failure] = []
        got = asyncio.Event()

        def on_failure(f: Failure) -> None:
            failures.append(f)
            got.set()

        cluster.on_failure(on_failure)
        mesh = await cluster.spawn("sup", Echo, devices=[0, 1, 2])
        await cluster.spawn("bystander", Echo, devices=[1])
        sub = Subscriber(cluster.tap_address, cluster.key, {"worker_death", "failure"})
        try:
            victim = (await mesh.where.call())[1]
            assert victim["index"] == 1
            in_flight = mesh.slice(dp=1).sleep.call_one(60)
            in_flight_all = mesh.sleep_concurrent.call(60)
            await asyncio.sleep(0)  # let the calls leave
            os.kill(victim["pid"], signal.SIGKILL)
            # reported to the owner within 2 s, with device, actor and reason
            await asyncio.wait_for(got.wait(), 2.0)
            with pytest.raises(ActorDied, match="SIGKILL"):
                await asyncio.wait_for(in_flight, 0.5)  # failed at once, not at a deadline
            with pytest.raises(ActorDied):
                await asyncio.wait_for(in_flight_all, 0.5)
            actors = sorted(f.actor for f in failures)
            assert actors == ["bystander/0", "sup/1"]
            f = next(f for f in failures if f.actor == "sup/1")
            assert (f.device, f.reason, f.mesh, f.rank, f.pid) == (
                1,
                "SIGKILL",
                "sup",
                1,
                victim["pid"],
            )
            assert f.incarnation >= 1
            # the surviving ranks' __supervise__ ran with the failure
            for rank in (0, 2):
                seen = []
                for _ in range(100):
                    seen = await mesh.slice(dp=rank).failures_seen.call_one()
                    if seen:
                        break
                    await asyncio.sleep(0.02)
                assert seen == [{"device": 1, "actor": "sup/1", "reason": "SIGKILL", "rank": 1}]
            # new calls to the dead device fail at once; the others still answer
            with pytest.raises(ActorDied):
                await mesh.slice(dp=1).add.call_one(1)
            assert [d.index for d in cluster.devices] == [0, 2]
            assert await mesh.slice(dp=0).add.call_one(1, 1) == 2
            # choose skips the dead actor
            assert {(await mesh.where.choose())["index"] for _ in range(4)} <= {0, 2}
            ev = await sub.wait_for(lambda e: e["type"] == "worker_death", 5)
            assert ev["device"] == 1 and ev["reason"] == "SIGKILL"
        finally:
            sub.close()


async def test_what_workers_leave_in_the_temporary_folder_goes_with_their_node(no_leaks):
    async with Cluster.local(devices=2, memory_per_device="128MiB") as cluster:
        died = asyncio.Event()
        cluster.on_failure(lambda f: died.set())
        mesh = await cluster.spawn("tmp", Echo, devices=[0, 1])
        left = await mesh.leave_temporary_files.call()
        # each worker's temporary folder is inside its node's scratch folder, not the host's
        host_tmp = tempfile.gettempdir()
        for got in left:
            assert os.path.dirname(os.path.dirname(got["tmpdir"])) == host_tmp
            assert os.path.basename(os.path.dirname(got["tmpdir"])).startswith(
                f"nereus-{os.getpid()}-"
            )
            assert os.path.exists(got["file"]) and os.path.exists(got["socket"])
        os.kill(left[1]["pid"], signal.SIGKILL)  # a killed worker closes nothing
        await asyncio.wait_for(died.wait(), 5.0)
    for got in left:
        assert not os.path.exists(got["file"]) and not os.path.exists(got["socket"])
        assert not os.path.exists(got["tmpdir"])


async def test_a_blocked_driver_loop_does_not_lose_embedded_nodes(no_leaks):
    async with Cluster.local(devices=1, heartbeat_timeout_s=0.4) as cluster:
        failures: list[Failure] = []
        cluster.on_failure(failures.append)
        mesh = await cluster.spawn("blocked", Echo, devices=[0])
        time.sleep(1.5)  # the driver's loop (controller and node included) is stuck
        assert await mesh.add.call_one(1) == 1
        await mesh.add.call_one(2)  # a few more loop turns for the watcher to run
        assert failures == []
        assert [d.index for d in await cluster.refresh_devices()] == [0]


async def test_silent_node_is_declared_lost(no_leaks):
    async with Cluster.local(devices=[1, 1], nodes=2, heartbeat_timeout_s=0.6) as cluster:
        lost = asyncio.Event()
        failures: list[Failure] = []
        cluster.on_failure(lambda f: (failures.append(f), lost.set()))
        mesh = await cluster.spawn("quiet", Echo, devices=[0, 1])
        pending = mesh.slice(dp=1).sleep.call_one(60)
        node = next(n for n in cluster.nodes if 1 in n.indices)
        node.kill_heartbeat()
        await asyncio.wait_for(lost.wait(), 5.0)
        assert [(f.device, f.actor, f.reason) for f in failures] == [(1, "quiet/1", "node lost")]
        with pytest.raises(ActorDied, match="node lost"):
            await asyncio.wait_for(pending, 0.5)
        assert await mesh.slice(dp=0).add.call_one(3) == 3
        # the lost node beats again: the controller fences it, it stops its workers
        node._heartbeat = asyncio.get_running_loop().create_task(node._beat())
        await asyncio.wait_for(node.fenced.wait(), 5.0)
        for w in node.workers:
            assert await asyncio.wait_for(w.proc.wait(), 10) is not None
