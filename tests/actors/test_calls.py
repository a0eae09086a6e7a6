"""Call styles, remote errors, devices and events against real worker processes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from nereus.actors import ActorMesh, ActorRef, Cluster, DeviceInfo
from nereus.actors._client import current_client
from nereus.errors import ConfigError, ProtocolError, RemoteError
from nereus.monitor import Subscriber
from tests.actors._actors import BadInit, Echo, Tensors

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(60),
]


async def test_devices_and_current_device(cluster: Cluster):
    assert [d.index for d in cluster.devices] == [0, 1, 2]
    assert all(isinstance(d, DeviceInfo) and d.kind == "cpu" for d in cluster.devices)
    assert all(d.memory_bytes == 256 * 2**20 for d in cluster.devices)
    mesh = await cluster.spawn("where", Echo, devices=[2, 0], args=("t",))
    try:
        got = await mesh.where.call()
        assert [g["index"] for g in got] == [2, 0]
        assert [g["rank"] for g in got] == [0, 1]
        assert all(g["same"] and g["tag"] == "t" and g["memory_bytes"] == 256 * 2**20 for g in got)
        assert got[0]["pid"] != got[1]["pid"]
        # CPU workers copy large pieces with stores that bypass the cache (nereus.node)
        assert all(
            "glibc.cpu.x86_non_temporal_threshold=0x40000" in g["glibc_tunables"] for g in got
        )
    finally:
        await cluster.stop_mesh(mesh)


async def test_call_styles(cluster: Cluster):
    mesh = await cluster.spawn("styles", Echo, devices=[0, 1, 2], kwargs={"scale": 10})
    try:
        assert isinstance(mesh, ActorMesh) and len(mesh) == 3 and mesh.axes == {"dp": 3}
        assert await mesh.add.call(1, 2) == [30, 30, 30]
        assert await mesh.add.call(a=4) == [40, 40, 40]  # kwargs
        one = mesh.slice(dp=1)
        assert one.size == 1 and one.axes == {}
        assert await one.add.call_one(5, b=1) == 60
        with pytest.raises(ConfigError, match="must be 1"):
            mesh.add.call_one(1)
        assert await one.sync_double.call_one(2.5) == 5.0
        # choose: load-balanced; with 6 slow calls in flight each actor gets 2
        futs = [mesh.where.choose() for _ in range(3)]
        ranks = sorted(r["rank"] for r in await asyncio.gather(*futs))
        assert ranks == [0, 1, 2]
        # broadcast returns None at once; sequential order is kept per actor
        for i in range(20):
            assert mesh.record.broadcast(i) is None
        assert await mesh.seen_list.call() == [list(range(20))] * 3
        assert [x async for x in one.tokens.stream(5)] == [0, 1, 2, 3, 4]
        assert [x async for x in one.tokens.stream(0)] == []
        with pytest.raises(ConfigError):
            async for _ in mesh.tokens.stream(2):
                pass
    finally:
        await cluster.stop_mesh(mesh)


async def test_axes_and_slices(cluster: Cluster):
    mesh = await cluster.spawn("grid", Echo, devices=[0, 1, 2, 0, 1, 2], axes={"dp": 3, "tp": 2})
    try:
        coords = [r["coords"] for r in await mesh.where.call()]
        assert coords == [{"dp": d, "tp": t} for d in range(3) for t in range(2)]
        tp0 = mesh.slice(tp=0)
        assert tp0.axes == {"dp": 3} and [r.rank for r in tp0.refs] == [0, 2, 4]
        sub = mesh.slice(dp=slice(1, 3))
        assert sub.axes == {"dp": 2, "tp": 2} and [r.rank for r in sub.refs] == [2, 3, 4, 5]
        assert [r["name"] for r in await tp0.where.call()] == ["grid/0", "grid/2", "grid/4"]
        with pytest.raises(ConfigError, match="not one of the mesh axes"):
            mesh.slice(pp=0)
        with pytest.raises(ConfigError, match="must be in 0..2"):
            mesh.slice(dp=3)
    finally:
        await cluster.stop_mesh(mesh)
    with pytest.raises(ConfigError, match="hold 4 positions"):
        await cluster.spawn("bad", Echo, devices=[0, 1], axes={"dp": 2, "tp": 2})


async def test_remote_error_carries_type_message_traceback(cluster: Cluster):
    both = await cluster.spawn("errs", Echo, devices=[1, 2])
    mesh = both.slice(dp=0)
    try:
        with pytest.raises(RemoteError) as info:
            await mesh.fail.call_one("the reason")
        err = info.value
        assert err.remote_type == "KeyError"
        assert "the reason" in err.remote_message
        assert "raise KeyError(message)" in err.traceback_text
        assert err.actor == "errs/0" and err.device == 1
        # the actor survives its endpoint's error
        assert await mesh.add.call_one(1, 1) == 2
        with pytest.raises(RemoteError) as info:
            # an actor calling another one (a sequential actor calling itself would wait
            # on its own mailbox: that is the documented sequential model)
            await mesh.relay.call_one(both.refs[1], "fail", "nested")
        assert info.value.remote_type == "RemoteError" and "nested" in str(info.value)
    finally:
        await cluster.stop_mesh(both)


async def test_bad_calls_are_rejected_clearly(cluster: Cluster):
    mesh = await cluster.spawn("bad_calls", Echo, devices=[0])
    try:
        with pytest.raises(ProtocolError, match="no endpoint 'nope'"):
            await mesh.nope.call_one()
        with pytest.raises(ProtocolError, match="wrong argument type .* a=.x. is a str"):
            await mesh.add.call_one("x")
        with pytest.raises(ProtocolError, match="wrong arguments"):
            await mesh.add.call_one(1, 2, 3)
        with pytest.raises(ProtocolError, match="wrong arguments"):
            await mesh.add.call_one(1, c=2)
        with pytest.raises(ProtocolError, match="is a stream"):
            await mesh.tokens.call_one(3)
        for kind in ("object", "bigint", "cycle"):
            with pytest.raises(ProtocolError, match="cannot be sent"):
                await mesh.unsendable.call_one(kind)
        got = []
        with pytest.raises(ProtocolError, match="cannot be sent"):
            async for x in mesh.unsendable_stream.stream():
                got.append(x)
        assert got == [1]
        with pytest.raises(ProtocolError, match="64-bit"):
            mesh.ping.call_one(2**70)
        cyclic: list = []
        cyclic.append(cyclic)
        with pytest.raises(ProtocolError, match="cannot encode"):
            mesh.ping.call_one(cyclic)
        with pytest.raises(ProtocolError, match="cannot send a value of type"):
            mesh.ping.call_one(object())
        assert await mesh.add.call_one(2) == 2
    finally:
        await cluster.stop_mesh(mesh)


async def test_spawn_errors(cluster: Cluster):
    with pytest.raises(RemoteError, match="constructor refused"):
        await cluster.spawn("badinit", BadInit, devices=[0])
    with pytest.raises(ConfigError, match="not a live device"):
        await cluster.spawn("nodev", Echo, devices=[7])
    mesh = await cluster.spawn("dup", Echo, devices=[0])
    with pytest.raises(ConfigError, match="already a live mesh"):
        await cluster.spawn("dup", Echo, devices=[1])
    await cluster.stop_mesh(mesh)


async def test_tensors_and_arrays_round_trip(cluster: Cluster):
    mesh = await cluster.spawn("tensors", Tensors, devices=[2])
    try:
        values = {
            "bf16": torch.randn(3, 5).to(torch.bfloat16),
            "bool": torch.tensor([[True, False], [False, True]]),
            "empty": torch.empty(0, 4, dtype=torch.int64),
            "scalar": torch.tensor(3.25),
            "strided": torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2],
            "np": np.arange(10, dtype=np.int16).reshape(2, 5),
            "big": torch.arange(1 << 20, dtype=torch.float32),
            "nested": [(torch.ones(2), b"x" * 10000), {"k": np.zeros(3)}],
        }
        back = await mesh.echo.call_one(values)
        for k in ("bf16", "bool", "empty", "scalar", "strided", "big"):
            assert back[k].dtype == values[k].dtype and torch.equal(back[k], values[k]), k
        assert np.array_equal(back["np"], values["np"]) and back["np"].dtype == np.int16
        assert isinstance(back["nested"][0], tuple) and back["nested"][0][1] == b"x" * 10000
        t = torch.zeros(4, dtype=torch.int32)
        assert torch.equal(await mesh.add_one_inplace.call_one(t), torch.ones(4, dtype=torch.int32))
        assert await mesh.checksum.call_one(torch.ones(1000)) == 1000.0
    finally:
        await cluster.stop_mesh(mesh)


async def test_refs_cross_the_wire(cluster: Cluster):
    a = await cluster.spawn("ref_a", Echo, devices=[0])
    b = await cluster.spawn("ref_b", Echo, devices=[1], kwargs={"scale": 3})
    try:
        ref = b.refs[0]
        assert isinstance(ref, ActorRef)
        assert await a.relay.call_one(ref, "add", 2, 3) == 15
        assert await a.ping.call_one(ref) == ref
    finally:
        await cluster.stop_mesh(a)
        await cluster.stop_mesh(b)


async def test_emit_reaches_the_tap(cluster: Cluster):
    mesh = await cluster.spawn("emitter", Echo, devices=[0, 1])
    sub = Subscriber(
        cluster.tap_address,
        cluster.key,
        {"test_event", "driver_event", "thread_event", "call_span", "error"},
    )
    try:
        # PUB/SUB joins asynchronously: emit until both kinds of events came through
        from nereus.actors import emit

        seen: dict[str, dict] = {}

        async def collect():
            while len(seen) < 3:
                mesh.emit_event.broadcast(7)
                mesh.emit_from_thread.broadcast(8)
                emit("driver_event", value=1)
                try:
                    ev = await sub.next(0.2)
                except asyncio.TimeoutError:
                    continue
                seen.setdefault(ev["type"], ev)

        await asyncio.wait_for(collect(), 10)
        # sampled call spans (one call in 100 by default) and broadcast errors
        await asyncio.gather(*[mesh.add.call(i) for i in range(60)])
        span = await sub.wait_for(lambda e: e["type"] == "call_span", 10)
        assert span["method"] == "add" and span["latency_seconds"] > 0 and span["ok"]
        assert span["actor"].startswith("emitter/")
        mesh.fail.broadcast("nobody waits for this")
        err = await sub.wait_for(lambda e: e["type"] == "error", 10)
        assert err["remote_type"] == "KeyError" and "nobody waits" in err["message"]
        assert "raise KeyError" in err["traceback"]
        await cluster.set_epoch(3)
        await cluster.set_epoch(3)  # idempotent
        with pytest.raises(ProtocolError, match="epoch"):
            await current_client().request(None, "set_epoch", {"epoch": 2})  # backwards
        emit("driver_event", value=2)
        ev = await sub.wait_for(lambda e: e["type"] == "driver_event" and e["value"] == 2, 10)
        assert ev["epoch"] == 3
        ev = seen["test_event"]
        assert ev["value"] == 7 and ev["device"] in (0, 1)
        assert ev["v"] == 1 and "epoch" in ev and "time_monotonic_seconds" in ev
        assert ev["source"].startswith("worker:")
        assert seen["driver_event"]["source"] == "driver"
        assert seen["thread_event"]["value"] == 8
    finally:
        sub.close()
        await cluster.stop_mesh(mesh)


async def test_a_second_driver_connects_and_says_goodbye(cluster: Cluster):
    before = len(cluster.controller.clients)
    mesh = await cluster.spawn("shared", Echo, devices=[0])
    other = Cluster.connect(cluster.address, key=cluster.key, min_devices=3)
    await other.start()
    try:
        assert len(cluster.controller.clients) == before + 1
        assert [d.index for d in other.devices] == [0, 1, 2]
    finally:
        await other.close()
        # the other driver became this process's client while it lived; ours is back
        assert await mesh.add.call_one(4) == 4
        await cluster.stop_mesh(mesh)
    for _ in range(200):  # its "bye" left before its socket closed
        if len(cluster.controller.clients) == before:
            break
        await asyncio.sleep(0.01)
    assert len(cluster.controller.clients) == before
