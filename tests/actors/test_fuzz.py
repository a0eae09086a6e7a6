"""Fuzz a live worker with >= 10,000 bad frames: no crash, every frame counted."""

from __future__ import annotations

import asyncio
import os
import random

import msgpack
import pytest
import zmq
import zmq.asyncio

from nereus.actors import Cluster, _wire
from nereus.actors import _protocol as P
from nereus.actors._client import current_client
from tests.actors._actors import Echo

pytestmark = pytest.mark.timeout(120)

PER_KIND = 1100  # x 10 kinds > 10,000 frames


def _valid(key: bytes, name: str, inc: int, cid: int, method: str = "add", args=(1, 2)):
    header, buffers = _wire.encode([P.CALL, cid, name, inc, method, None, list(args), {}, 1])
    return _wire.message(key, header, [bytes(b) for b in buffers])


def _signed(key: bytes, header: bytes, *buffers: bytes) -> list[bytes]:
    return _wire.message(key, header, buffers)


def _messages(key: bytes, name: str, inc: int, rng: random.Random):
    """(frames, expected counter, expects an ERR reply) for every kind of bad input."""
    big_ext = msgpack.ExtType(1, msgpack.packb([2, "float32", [2**40], 0, 4]))
    for i in range(PER_KIND):
        cid = 1_000_000 + i
        good = _valid(key, name, inc, cid)
        header = good[0][32:]
        # 1. random signature  2. signature of the wrong length  3. no header
        yield [os.urandom(32) + header, *good[1:]], "rejected_signature", False
        sig_len = rng.choice([1, 16, 31, 33, 64])
        first = os.urandom(sig_len) + header
        yield [first, *good[1:]], ("rejected_signature" if len(first) > 32
                                   else "rejected_short"), False
        yield [good[0][: rng.randrange(0, 33)]], "rejected_short", False
        # 4. a byte flipped anywhere (signature, header or a buffer) after signing
        frames = [bytearray(f) for f in good]
        part = rng.randrange(len(frames))
        frames[part][rng.randrange(len(frames[part]))] ^= 1 << rng.randrange(8)
        yield [bytes(f) for f in frames], "rejected_signature", False
        # 5. truncated header, correctly signed  6. garbage msgpack, correctly signed
        yield _signed(key, header[: rng.randrange(1, len(header))]), "rejected_header", False
        yield _signed(key, b"\xc1" + os.urandom(rng.randrange(0, 64))), "rejected_header", False
        # 7. a huge declared tensor size against a 4-byte frame
        huge = msgpack.packb([P.CALL, cid, name, inc, "ping", None, [big_ext], {}, 1])
        yield _signed(key, huge, b"1234"), "rejected_header", False
        # 8. unknown actor / 9. unknown method / 10. wrong argument types (authenticated:
        # the sender gets an ERR naming the problem)
        yield _valid(key, f"ghost{i}", 1, cid), "rejected_unknown_actor", True
        yield _valid(key, name, inc, cid, method=f"nope{i % 7}"), "rejected_unknown_method", True
        bad_args = rng.choice([("x", 1), (1.5,), ([1],), (1, 2, 3)])
        yield _valid(key, name, inc, cid, args=bad_args), "rejected_arguments", True


async def test_fuzzed_frames_never_crash_a_worker(no_leaks):
    async with Cluster.local(devices=1, max_message_bytes="1MiB") as cluster:
        mesh = await cluster.spawn("target", Echo, devices=[0])
        ref = mesh.refs[0]
        pid = (await mesh.where.call_one())["pid"]
        client = current_client()
        before = (await client.request(ref.address, "stats", {}))["counters"]

        rng = random.Random(1234)
        expected: dict[str, int] = {}
        replies_expected = 0
        sent = 0
        # an asyncio socket: the driver's loop also runs the controller and the node's
        # heartbeats, so the test must never block it
        sock = zmq.asyncio.Context.shadow(zmq.Context.instance()).socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(ref.address)
        try:
            # oversized messages first (the worker's limit is 1 MiB): one socket keeps
            # order, so once the last reply is back every frame before it was handled
            for _ in range(5):
                await sock.send_multipart(_signed(cluster.key, b"\x90", os.urandom(2 << 20)))
                expected["rejected_oversized"] = expected.get("rejected_oversized", 0) + 1
                sent += 1
            for frames, counter, replied in _messages(cluster.key, ref.name, ref.incarnation, rng):
                await sock.send_multipart(frames)
                expected[counter] = expected.get(counter, 0) + 1
                replies_expected += replied
                sent += 1
            assert sent >= 10_000
            # every authenticated bad call is answered with a ProtocolError ERR
            replies = 0
            while replies < replies_expected:
                msg = await asyncio.wait_for(sock.recv_multipart(), 30)
                decoded = _wire.decode(_wire.verify(cluster.key, msg), msg[1:])
                # replies sent in one loop iteration come as one BATCH message
                subs = ([_wire.decode(h) for h in decoded[1]] if decoded[0] == P.BATCH
                        else [decoded])
                for sub in subs:
                    assert sub[0] == P.ERR and sub[3] == P.ERR_PROTOCOL
                    replies += 1
            assert replies == replies_expected
        finally:
            sock.close(linger=0)

        after = (await client.request(ref.address, "stats", {}))["counters"]
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        for counter, n in expected.items():
            assert delta.get(counter, 0) == n, f"{counter}: {delta} vs {expected}"
        assert delta["rejected"] == sent
        # the fuzz frames plus the one stats request that read them
        assert delta["messages"] == sent + 1
        # the worker is alive, the same process, and still answers
        os.kill(pid, 0)  # raises if the worker process is gone
        assert await mesh.add.call_one(2, 3) == 5
        assert (await mesh.where.call_one())["pid"] == pid
