"""A device with ``cores_per_device`` is a fixed amount of compute, kernel-enforced.

Needs a writable cgroup CPU controller (root here and on CI); a host without one runs
the refusal test only, and the others fail with the refusal rather than skipping."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from nereus.actors import (
    NODE_READY,
    Actor,
    Cluster,
    Controller,
    NodeDaemon,
    current_device,
    device_threads,
    endpoint,
)
from nereus.actors._cpulimit import find_controller, worker_threads
from nereus.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

KEY = "cpulimit-test-key-0123456789abcdef"


class Spinner(Actor):
    """Counts iterations of a fixed loop for a fixed wall window."""

    @endpoint
    async def spin(self, seconds: float) -> dict:
        cpu0, end, count = time.process_time(), time.monotonic() + seconds, 0
        while time.monotonic() < end:
            x = 0
            for i in range(2000):
                x += i * i
            count += 1
        own = Path(f"/proc/{os.getpid()}/cgroup").read_text()
        return {
            "count": count,
            "cpu_s": time.process_time() - cpu0,
            "pid": os.getpid(),
            "cgroup": own,
            "threads": device_threads(),
            "device": current_device().index,
        }


def _groups(parent: Path, pid: int) -> list[str]:
    return sorted(p.name for p in parent.glob(f"nereus-{pid}-*"))


@pytest.mark.integration
async def test_quarter_core_does_less_work_than_a_full_core_and_groups_go_on_close(no_leaks):
    kind, parent = find_controller()
    async with Cluster.local(
        devices=2, memory_per_device="64MiB", cores_per_device=[0.25, 1.0]
    ) as cluster:
        assert [cluster.cores_of(d.index) for d in cluster.devices] == [0.25, 1.0]
        groups = _groups(parent, os.getpid())
        assert len(groups) == 2
        mesh = await cluster.spawn("spin", Spinner, axes={"dp": 2})
        await mesh.spin.call(0.2)  # warm-up: imports, first calls
        limits = cluster.nodes[0].limits
        before = [limits.cpu_seconds(i) for i in range(2)]
        slow, fast = await mesh.spin.call(2.0)
        used = [limits.cpu_seconds(i) - b for i, b in zip(range(2), before, strict=True)]
        # each worker sits in its own group, named after this driver's nodes
        assert f"nereus-{os.getpid()}-" in slow["cgroup"] and slow["cgroup"] != fast["cgroup"]
        assert slow["threads"] == fast["threads"] == 1
        # the quota bounds the CPU time: 0.25 core over 2 s is 0.5 s (plus a period)
        assert slow["cpu_s"] <= 0.25 * 2.0 + 0.15, slow
        # the work a quarter core allows, with the full-core worker's work per CPU second
        # as the yardstick: holds however busy the shared machine is
        per_cpu_s = fast["count"] / fast["cpu_s"]
        assert slow["count"] <= 1.3 * per_cpu_s * 0.25 * 2.0, (slow, fast)
        # 4x by the quotas on an idle machine and by the groups' weights on a busy one;
        # a wide margin, as other processes may leave the full-core worker less than a core
        assert fast["count"] >= 2 * slow["count"], (slow, fast)
        # the cluster's view of a device reads the same accounting
        assert cluster.cpu_seconds(cluster.devices[0].index) >= before[0] + used[0]
        # the kernel's accounting of each group sees what each worker measured itself
        # (its loop's CPU time; the group's also holds the call's own handling)
        assert slow["cpu_s"] * 0.8 <= used[0] <= 0.25 * 2.0 + 0.3, (used, slow)
        assert fast["cpu_s"] * 0.8 <= used[1] <= fast["cpu_s"] + 0.3, (used, fast)
        # the quota is live: the kernel counts the group's periods (it throttles the group
        # when it reaches its quota; on a busy host its weight may hold it below that)
        stat = cluster.nodes[0].limits.throttled(0)
        assert stat["nr_periods"] > 0, stat
    assert _groups(parent, os.getpid()) == []


@pytest.mark.integration
async def test_groups_of_a_killed_node_are_swept_by_the_next_one(no_leaks):
    _, parent = find_controller()
    controller = await Controller(KEY.encode(), heartbeat_timeout_s=5.0).start()
    node = None
    try:
        env = os.environ | {"NEREUS_CLUSTER_KEY": KEY}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nereus.node",
            "--controller",
            controller.address,
            "--devices",
            "1",
            "--memory-per-device",
            "64MiB",
            "--cores-per-device",
            "0.5",
            "--node-id",
            "killed",
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            while True:
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                assert line, f"the node exited before it was ready: {await proc.wait()}"
                if line.decode().startswith(NODE_READY):
                    break
            left = _groups(parent, proc.pid)
            assert len(left) == 1
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            proc._transport.close()
        assert _groups(parent, proc.pid) == left  # a killed node removes nothing
        node = NodeDaemon(
            controller.address,
            KEY.encode(),
            devices=1,
            cores_per_device=0.5,
            memory_per_device="64MiB",
            node_id="next",
        )
        await node.start()
        assert _groups(parent, proc.pid) == []
        assert len(_groups(parent, os.getpid())) == 1
    finally:
        if node is not None:
            await node.stop()
        await controller.close()
    assert _groups(parent, os.getpid()) == []


@pytest.mark.integration
@pytest.mark.parametrize("root", ["missing", "readonly"])
async def test_a_limit_that_cannot_be_set_is_refused_naming_the_field(tmp_path, root, no_leaks):
    if root == "missing":
        where = tmp_path / "no-such-cgroup"
    else:
        where = tmp_path / "ro"
        where.mkdir()
        (where / "cpu.cfs_quota_us").write_text("-1")
        os.chmod(where, 0o555)
        if os.access(where, os.W_OK):  # root ignores the mode bits: a read-only bind
            where = Path("/proc/sys")  # a read-only folder even for root
    with pytest.raises(ConfigError, match="cores_per_device") as info:
        async with Cluster.local(
            devices=1, memory_per_device="64MiB", cores_per_device=0.5, cgroup_root=str(where)
        ):
            pass
    assert '"shared"' in str(info.value)


def test_cores_per_device_is_checked_and_threads_follow_it():
    assert [worker_threads(c) for c in (None, 0.25, 1.0, 1.5, 2.0)] == [1, 1, 1, 2, 2]
    with pytest.raises(ConfigError, match="cores_per_device"):
        Cluster.local(devices=2, cores_per_device=[0.5])
    with pytest.raises(ConfigError, match="cores_per_device"):
        Cluster.local(devices=2, cores_per_device=0)
    with pytest.raises(ConfigError, match="cores_per_device"):
        Cluster.local(devices=2, cores_per_device="half")
