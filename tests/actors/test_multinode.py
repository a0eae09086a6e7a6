"""A standalone controller, two node daemons on loopback, the tap CLI, bad keys."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from nereus.actors import CONTROLLER_READY, NODE_READY, Cluster, emit
from nereus.actors._client import Client, current_client
from nereus.errors import ConfigError, DeadlineExceeded
from nereus.monitor import Subscriber
from tests.actors._actors import BadSupervisor, Echo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = "multinode-test-key-0123456789abcdef"


async def _start(*args: str, ready: str | None, env: dict | None = None):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.PIPE, env=env or os.environ.copy()
    )
    if ready is None:
        return proc, ""
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            raise AssertionError(f"{args[:2]} exited before it was ready: {await proc.wait()}")
        text = line.decode().strip()
        if text.startswith(ready):
            return proc, text[len(ready) :]


async def _stop(proc) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    rc = await asyncio.wait_for(proc.wait(), 20)
    if proc.stdout is not None:
        proc._transport.close()
    return rc


async def test_two_nodes_on_loopback(tmp_path, no_leaks):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    jsonl = tmp_path / "tap.jsonl"
    procs = []
    try:
        controller, ready = await _start(
            "-m",
            "nereus.cli",
            "controller",
            "--bind",
            "tcp://127.0.0.1:0",
            "--key-file",
            str(key_file),
            "--heartbeat-timeout-s",
            "2",
            ready=CONTROLLER_READY,
        )
        procs.append(controller)
        address, tap_address = ready.split()
        tap, _ = await _start(
            "-m",
            "nereus.cli",
            "tap",
            tap_address,
            "--jsonl",
            str(jsonl),
            "--quiet",
            "--key-file",
            str(key_file),
            ready=None,
        )
        procs.append(tap)

        # PUB/SUB joins asynchronously: probe until the tap records, so it sees every join
        async def tap_is_live():
            async with Cluster.connect(address, key=KEY, min_devices=0):
                while not (jsonl.exists() and "tap_probe" in jsonl.read_text()):
                    emit("tap_probe")
                    await asyncio.sleep(0.05)

        await asyncio.wait_for(tap_is_live(), 30)
        env = os.environ | {"NEREUS_CLUSTER_KEY": KEY}  # the other way to give the key
        node_a, ready_a = await _start(
            "-m",
            "nereus.node",
            "--controller",
            address,
            "--devices",
            "2",
            "--memory-per-device",
            "64MiB",
            "--node-id",
            "a",
            ready=NODE_READY,
            env=env,
        )
        procs.append(node_a)
        node_b, ready_b = await _start(
            "-m",
            "nereus.node",
            "--controller",
            address,
            "--devices",
            "3",
            "--node-id",
            "b",
            "--key-file",
            str(key_file),
            ready=NODE_READY,
        )
        procs.append(node_b)
        assert ready_a.split()[0] == "a" and ready_b.split()[0] == "b"

        async with Cluster.connect(address, key_file=str(key_file), min_devices=5) as cluster:
            by_node = {}
            for d in cluster.devices:
                by_node.setdefault(d.node_id, []).append(d)
            assert sorted(len(v) for v in by_node.values()) == [2, 3]
            assert {d.memory_bytes for d in by_node["a"]} == {64 * 2**20}
            assert {d.memory_bytes for d in by_node["b"]} == {2**30}
            mesh = await cluster.spawn("spread", Echo, axes={"dp": 5})
            got = await mesh.where.call()
            assert [g["index"] for g in got] == [d.index for d in cluster.devices]
            assert len({g["pid"] for g in got}) == 5
            assert await mesh.add.call(1, 2) == [3] * 5

            # a client holding the wrong key gets nothing from a worker: its frames are
            # counted as bad signatures and dropped
            real = current_client()
            impostor = Client(b"wrong-key-wrong-key-wrong", source="impostor")
            ref = mesh.refs[0]
            try:
                with pytest.raises(DeadlineExceeded):
                    await impostor.call(
                        ref.address, ref.name, ref.incarnation, "add", [1], {}, 0.5, 1, ref.device
                    )
            finally:
                impostor.close()
            stats = await real.request(ref.address, "stats", {})
            assert stats["counters"]["rejected_signature"] >= 1
            assert await mesh.slice(dp=0).add.call_one(5) == 5
            kept = await cluster.spawn("kept", Echo, devices=[cluster.devices[0]])
            await cluster.stop_mesh(mesh)

        # closing a connected driver stops the meshes it spawned, not the workers
        async with Cluster.connect(address, key=KEY, min_devices=5) as again:
            stats = await current_client().request(kept.refs[0].address, "stats", {})
            assert stats["actors"] == {}
            assert len(again.devices) == 5

        with pytest.raises((DeadlineExceeded, ConfigError)):
            async with Cluster.connect(address, key="not-the-cluster-key-at-all", timeout_s=1):
                pass
        assert await _stop(node_a) == 0
        assert await _stop(node_b) == 0
    finally:
        for p in reversed(procs):
            if p.returncode is None:
                await _stop(p)
    events = [json.loads(line) for line in jsonl.read_text().splitlines()]
    types = [e["type"] for e in events]
    assert types.count("node_join") == 2 and types.count("worker_join") == 5
    assert types.count("node_leave") == 2
    assert all(e["v"] == 1 and "epoch" in e and "seq" in e for e in events)


async def test_node_refuses_bad_arguments(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("short")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nereus.node",
        "--controller",
        "tcp://127.0.0.1:1",
        "--devices",
        "2",
        "--key-file",
        str(key_file),
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"at least 16" in err
    # a controller that never answers (nothing listens there)
    key_file.write_text(KEY)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nereus.node",
        "--controller",
        "tcp://127.0.0.1:9",
        "--devices",
        "1",
        "--key-file",
        str(key_file),
        "--start-timeout-s",
        "0.5",
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and b"did not answer" in err


async def test_local_cluster_over_tcp_with_two_nodes(no_leaks):
    async with Cluster.local(devices=[1, 2], nodes=2, transport="tcp") as cluster:
        assert [d.node_id for d in cluster.devices] == ["local0", "local1", "local1"]
        sub = Subscriber(cluster.tap_address, cluster.key, {"error"})
        try:
            mesh = await cluster.spawn("tcp", BadSupervisor)
            assert all(r.address.startswith("tcp://127.0.0.1:") for r in mesh.refs)
            assert sorted(await mesh.ping.call()) == [1, 1, 1]
            stats = await current_client().request(mesh.refs[2].address, "stats", {})
            assert stats["actors"] == {"tcp/2": {"incarnation": 1, "pending": 0}}
            # a __supervise__ that raises is reported on the tap, not swallowed
            victim = cluster.nodes[1].workers[1].proc.pid
            os.kill(victim, signal.SIGKILL)
            ev = await sub.wait_for(lambda e: e.get("method") == "__supervise__", 10)
            assert ev["remote_type"] == "RemoteError" and "cannot handle the loss" in ev["message"]
        finally:
            sub.close()
