"""Deadlines, back-pressure, ordering and incarnations against real workers."""

from __future__ import annotations

import asyncio

import pytest

from nereus.actors import Cluster
from nereus.actors._client import current_client
from nereus.actors._protocol import OK
from nereus.errors import ActorDied, Backpressure, ConfigError, DeadlineExceeded
from tests.actors._actors import Echo

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(60),
]


async def _stats(ref) -> dict:
    return await current_client().request(ref.address, "stats", {})


async def test_deadline_at_the_caller(cluster: Cluster):
    mesh = await cluster.spawn("deadline", Echo, devices=[0])
    try:
        with pytest.raises(DeadlineExceeded, match="deadline of 0.2 s"):
            await mesh.sleep_concurrent.options(timeout_s=0.2).call_one(30)
        # the actor is still usable and a generous deadline passes
        assert await mesh.add.options(timeout_s=10).call_one(1, 2) == 3
        with pytest.raises(ConfigError):
            mesh.add.options(timeout_s=-1)
    finally:
        await cluster.stop_mesh(mesh)


async def test_expired_calls_are_not_started(cluster: Cluster):
    mesh = await cluster.spawn("expire", Echo, devices=[1])
    try:
        busy = mesh.sleep.call_one(0.5)  # sequential: what follows waits behind it
        with pytest.raises(DeadlineExceeded):
            await mesh.record.options(timeout_s=0.1).call_one(1)
        await busy
        assert await mesh.seen_list.call_one() == []  # record(1) never ran
        stats = await _stats(mesh.refs[0])
        assert stats["counters"]["expired_calls"] >= 1
    finally:
        await cluster.stop_mesh(mesh)


async def test_backpressure_cap(cluster: Cluster):
    mesh = await cluster.spawn("cap", Echo, devices=[2], max_pending=2)
    try:
        futs = [mesh.sleep.call_one(0.3) for _ in range(5)]
        results = await asyncio.gather(*futs, return_exceptions=True)
        ok = [r for r in results if r == 0.3]
        refused = [r for r in results if isinstance(r, Backpressure)]
        assert len(ok) == 2 and len(refused) == 3, results
        assert "cap 2" in str(refused[0])
        assert await mesh.add.call_one(1) == 1  # room again once drained
    finally:
        await cluster.stop_mesh(mesh)


async def test_sequential_order_and_concurrent_overlap(cluster: Cluster):
    mesh = await cluster.spawn("order", Echo, devices=[0])
    try:
        futs = [mesh.record.call_one(i) for i in range(200)]
        await asyncio.gather(*futs)
        assert await mesh.seen_list.call_one() == list(range(200))
        # concurrent endpoints overlap: 5 x 0.3 s finish well before 5 x 0.3 s in a row;
        # the check is on order of completion, not on wall time
        done: list[int] = []
        futs = [mesh.sleep_concurrent.call_one(0.3 - 0.05 * i) for i in range(5)]
        for i, f in enumerate(futs):
            f.add_done_callback(lambda _f, i=i: done.append(i))
        await asyncio.gather(*futs)
        assert done == [4, 3, 2, 1, 0]  # shortest first: they ran at the same time
    finally:
        await cluster.stop_mesh(mesh)


async def test_incarnations(cluster: Cluster):
    first = await cluster.spawn("inc", Echo, devices=[1])
    old = first.refs[0]
    assert old.incarnation >= 1
    pending = first.sleep.call_one(5)
    await cluster.stop_mesh(first)
    with pytest.raises(ActorDied, match="stopped"):
        await pending  # queued/running calls of a stopped actor fail
    second = await cluster.spawn("inc", Echo, devices=[1])
    try:
        new = second.refs[0]
        assert new.name == old.name and new.incarnation == old.incarnation + 1
        with pytest.raises(ActorDied, match=f"incarnation {old.incarnation}"):
            await old.add.call_one(1)
        assert await new.add.call_one(2) == 2
        # a reply that claims another incarnation is dropped and counted
        client = current_client()
        slow = second.sleep.call_one(0.5)
        cid = max(client.pending)
        before = client.counters.values.get("stale_replies", 0)
        client._on_message(new.address, [OK, cid, old.incarnation, "forged"])
        with pytest.raises(ActorDied):
            await slow
        assert client.counters.values["stale_replies"] == before + 1
    finally:
        await cluster.stop_mesh(second)
