"""The callee's mailbox and the caller's deadlines in one process (host and caller
over inproc, no workers): ordering, the idle fast path, that a call started at once
behaves as if it ran in the actor's consumer task, and the deadline heap."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import pytest
import pytest_asyncio
import zmq

from nereus.actors import _protocol as P
from nereus.actors._channel import Counters
from nereus.actors._client import Client
from nereus.actors._host import _START_IDLE_CALLS_AT_ONCE, ActorHost
from nereus.actors.actor import DeviceInfo
from nereus.errors import ActorDied, DeadlineExceeded, RemoteError

pytestmark = pytest.mark.timeout(30)

KEY = b"host-test-key-0123456789"
_names = itertools.count()


class _Local:
    def __init__(self, host: ActorHost, client: Client, address: str, inc: int) -> None:
        self.host, self.client, self.address, self.inc = host, client, address, inc
        self.slot = host.actors["seq"]

    def call(self, method: str, *args, timeout_s: float | None = None) -> asyncio.Future:
        return self.client.call(
            self.address, "seq", self.inc, method, list(args), {}, timeout_s, P.REPLY, 0
        )


@pytest_asyncio.fixture
async def local(no_leaks):
    address = f"inproc://nereus-host-test-{next(_names)}"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    host = ActorHost(sock, KEY, DeviceInfo(0, "localhost", "cpu", 2**30, "", 0), Counters())
    client = Client(KEY, source="test", span_sample_every=0)
    try:
        inc = host._spawn({"name": "seq", "cls": "tests.actors._actors:Sequential"})["incarnation"]
        yield _Local(host, client, address, inc)
    finally:
        client.close()
        host.close()
        await asyncio.sleep(0)  # let the cancelled consumer task finish


async def test_calls_keep_arrival_order_across_suspensions(local):
    futs = [
        local.call("slow", 1, 0.05),
        local.call("quick", 2),
        local.call("sync_quick", 3),
        local.call("slow", 4, 0.0),
        local.call("quick", 5),
    ]
    assert await asyncio.gather(*futs) == [1, 2, 3, 4, 5]
    assert await local.call("order") == [
        ("start", 1),
        ("end", 1),
        2,
        3,
        ("start", 4),
        ("end", 4),
        5,
    ]
    assert local.slot.pending == 0 and not local.slot.mailbox and local.slot.resume is None


async def test_idle_calls_start_in_the_message_callback(local, monkeypatch):
    started = []
    start_now = local.host._start_now
    monkeypatch.setattr(
        local.host,
        "_start_now",
        lambda slot, item: (started.append(item[1].qualname), start_now(slot, item)),
    )
    for i in range(5):
        assert await local.call("quick", i) == i
    assert await local.call("slow", 9, 0.0) == 9
    expected = 6 if _START_IDLE_CALLS_AT_ONCE else 0
    assert len(started) == expected
    with pytest.raises(RemoteError, match="ValueError: boom"):
        await local.call("fail", "boom")  # user errors are answered from the fast path too
    assert await local.call("quick", 10) == 10


async def test_a_call_runs_as_the_consumer_task_before_and_after_suspending(local):
    first = await local.call("task_ids")
    second = await local.call("task_ids")
    assert first[0] == first[1] == second[0] == second[1] == id(local.slot.consumer)


async def test_contextvars_live_in_the_consumer_context(local):
    await local.call("set_trace", "set by a call")
    assert await local.call("get_trace") == "set by a call"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout needs Python 3.11")
async def test_asyncio_timeout_works_in_a_call_started_at_once(local):
    assert await local.call("with_timeout", 0.05) == "timed out"
    assert await local.call("quick", 1) == 1  # the consumer survived the cancellation


async def test_stop_fails_a_started_call_that_is_suspended(local):
    fut = local.call("slow", 1, 30.0)
    while ("start", 1) not in local.slot.instance.log:
        await asyncio.sleep(0.001)
    queued = local.call("quick", 2)
    await asyncio.sleep(0.01)
    local.host._stop({"name": "seq"})
    for f in (fut, queued):
        with pytest.raises(ActorDied, match="stopped"):
            await f
    assert local.slot.pending == 0


@pytest.mark.skipif(not _START_IDLE_CALLS_AT_ONCE, reason="no idle fast path before 3.11")
async def test_stop_cancels_a_started_call_before_the_consumer_takes_it_over(local):
    assert await local.call("quick", 0) == 0  # the consumer waits: the actor is idle
    slot = local.slot
    slot.pending += 1  # as _on_call does
    item = (slot, slot.endpoints["guarded"], b"", 0, [7], {}, None, P.NO_REPLY)
    seen = []
    loop = asyncio.get_running_loop()
    # both in one loop iteration, as from message callbacks: the call suspends in
    # asyncio.sleep and is stopped before the consumer task takes it over
    loop.call_soon(local.host._start_now, slot, item)
    loop.call_soon(
        lambda: (seen.append(slot.resume is not None), local.host._stop({"name": "seq"}))
    )
    deadline = time.monotonic() + 5
    while slot.pending and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert seen == [True] and slot.pending == 0 and slot.resume is None
    assert ("cancelled", 7, id(slot.consumer)) in slot.instance.log  # inside the consumer


async def test_each_call_fails_at_its_own_deadline(local):
    t0 = time.monotonic()
    done: dict[str, float] = {}

    async def timed(label: str, fut: asyncio.Future) -> None:
        with pytest.raises(DeadlineExceeded, match=label):
            await fut
        done[label] = time.monotonic() - t0

    # the later deadlines are earlier than the one the timer is armed for first
    await asyncio.gather(
        timed("1.5 s", local.call("slow", 1, 3.0, timeout_s=1.5)),
        timed("0.1 s", local.call("quick", 2, timeout_s=0.1)),
        timed("0.2 s", local.call("quick", 3, timeout_s=0.2)),
    )
    assert sorted(done, key=done.get) == ["0.1 s", "0.2 s", "1.5 s"]
    assert 0.1 - 0.002 <= done["0.1 s"] < 1.0 and done["1.5 s"] >= 1.5 - 0.002
    assert not local.client.pending and local.client._timed == 0


async def test_finished_calls_do_not_pile_up_in_the_deadline_heap(local):
    for i in range(400):
        assert await local.call("quick", i, timeout_s=60.0) == i
    assert len(local.client._deadlines) <= 65  # dead entries are dropped, not kept 60 s
    fut = local.call("slow", 1, 1.0, timeout_s=0.05)  # a live deadline still fires
    with pytest.raises(DeadlineExceeded):
        await fut


async def test_a_stopped_actor_is_collected_even_after_a_later_spawn_froze_it(local):
    import gc

    from tests.actors import _actors

    local.host._spawn({"name": "cyclic", "cls": "tests.actors._actors:Cyclic"})
    ref = _actors.CYCLIC[-1]
    # another spawn freezes everything alive, the cyclic actor included
    local.host._spawn({"name": "later", "cls": "tests.actors._actors:Cyclic"})
    assert gc.get_freeze_count() > 0 and ref() is not None
    local.host._stop({"name": "cyclic"})
    await asyncio.sleep(0)  # one loop turn: the collection is scheduled right after the reply
    assert ref() is None, "the stopped actor's cycle was never collected"
    assert _actors.CYCLIC[-1]() is not None  # the live one stays
    local.host._stop({"name": "later"})
