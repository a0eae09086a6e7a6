"""Fuzz live workers and the controller: >= 10,000 bad frames (no crash, every frame
counted), >= 1,000 replayed captured frames and frames appended or removed (none
accepted), a 4 GiB declared frame on each socket kind (no memory taken)."""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from nereus.actors import Cluster, _wire
from nereus.actors import _protocol as P
from nereus.actors._client import current_client
from nereus.actors._stream import stream_path
from tests.actors._actors import Echo
from tests.actors._raw import RawSession, framed, zmtp_declare

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PER_KIND = 1100  # x 10 kinds > 10,000 frames


def _messages(raw: RawSession, key: bytes, name: str, inc: int, rng: random.Random):
    """(frames, expected counter, expects an ERR reply) for every kind of bad input."""
    big_ext = msgpack.ExtType(1, msgpack.packb([2, "float32", [2**40], 0, 4]))
    for i in range(PER_KIND):
        cid = 1_000_000 + i
        good = raw.call(name, inc, cid, "add", 1, 2)
        head = good[0][32:]
        # 1. random signature  2. signature of the wrong length  3. no header
        yield [os.urandom(32) + head, *good[1:]], "rejected_signature", False
        sig_len = rng.choice([1, 16, 31, 33, 64])
        first = os.urandom(sig_len) + head
        yield (
            [first, *good[1:]],
            ("rejected_signature" if len(first) > 32 else "rejected_short"),
            False,
        )
        yield [good[0][: rng.randrange(0, 33)]], "rejected_short", False
        # 4. a byte flipped anywhere (signature, envelope, header or a buffer) after signing
        frames = [bytearray(f) for f in good]
        part = rng.randrange(len(frames))
        frames[part][rng.randrange(len(frames[part]))] ^= 1 << rng.randrange(8)
        yield [bytes(f) for f in frames], "rejected_signature", False
        # 5. truncated header, correctly signed  6. garbage msgpack, correctly signed
        header = head[40:]
        yield raw.seal(header[: rng.randrange(1, len(header))]), "rejected_header", False
        yield raw.seal(b"\xc1" + os.urandom(rng.randrange(0, 64))), "rejected_header", False
        # 7. a huge declared tensor size against a 4-byte frame
        huge = msgpack.packb([P.CALL, cid, name, inc, "ping", None, [big_ext], {}, 1])
        yield raw.seal(huge, [b"1234"]), "rejected_header", False
        # 8. unknown actor / 9. unknown method / 10. wrong argument types (authenticated:
        # the sender gets an ERR naming the problem)
        yield raw.call(f"ghost{i}", 1, cid, "add", 1, 2), "rejected_unknown_actor", True
        yield raw.call(name, inc, cid, f"nope{i % 7}"), "rejected_unknown_method", True
        bad_args = rng.choice([("x", 1), (1.5,), ([1],), (1, 2, 3)])
        yield raw.call(name, inc, cid, "add", *bad_args), "rejected_arguments", True


def _dealer(address: str):
    # an asyncio socket: the driver's loop also runs the controller and the node's
    # heartbeats, so the test must never block it
    sock = zmq.asyncio.Context.shadow(zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    return sock


async def _handshake(sock, key: bytes) -> RawSession:
    raw = RawSession(key)
    await sock.send_multipart(raw.hello())
    raw.welcome(await asyncio.wait_for(sock.recv_multipart(), 30))
    await sock.send_multipart(raw.ready())
    return raw


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
        sock = _dealer(ref.address)
        try:
            raw = await _handshake(sock, cluster.key)
            sent += 2  # HELLO and READY
            # a frame over the worker's limit (1 MiB) is refused by libzmq (MAXMSGSIZE),
            # which drops that connection: try it on a socket of its own
            big = _dealer(ref.address)
            try:
                await big.send_multipart(raw.seal(b"\x90", [os.urandom(2 << 20)]))
            finally:
                big.close(linger=0)
            for frames, counter, replied in _messages(
                raw, cluster.key, ref.name, ref.incarnation, rng
            ):
                await sock.send_multipart(frames)
                expected[counter] = expected.get(counter, 0) + 1
                replies_expected += replied
                sent += 1
            assert sent >= 10_000
            # every authenticated bad call is answered with a ProtocolError ERR
            replies = 0
            while replies < replies_expected:
                msg = await asyncio.wait_for(sock.recv_multipart(), 30)
                # replies sent in one loop iteration come as one BATCH message
                for sub in raw.open(msg):
                    assert sub[0] == P.ERR and sub[3] == P.ERR_PROTOCOL
                    replies += 1
            assert replies == replies_expected
        finally:
            sock.close(linger=0)

        after = (await client.request(ref.address, "stats", {}))["counters"]
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        for counter, n in expected.items():
            assert delta.get(counter, 0) == n, f"{counter}: {delta} vs {expected}"
        assert delta["rejected"] == sent - 2
        assert delta["handshakes"] == 1
        # the fuzz frames, the handshake and the one stats request that read them (the
        # worker's own client shares these counters: a WELCOME it took from the
        # controller meanwhile is a message too)
        assert delta["messages"] - delta.get("welcomes", 0) == sent + 1
        # the worker is alive, the same process, and still answers
        os.kill(pid, 0)  # raises if the worker process is gone
        assert await mesh.add.call_one(2, 3) == 5
        assert (await mesh.where.call_one())["pid"] == pid


async def _counter_reaches(counters: dict, name: str, target: int, timeout_s: float = 30) -> None:
    """Wait (with a deadline) until an in-process counter reaches ``target``."""
    deadline = time.monotonic() + timeout_s
    while counters.get(name, 0) < target:
        assert time.monotonic() < deadline, f"{name}={counters.get(name, 0)}, wanted {target}"
        await asyncio.sleep(0.01)


CAPTURED = 250  # replayed five ways: >= 1,000 replays in all


async def test_replayed_extended_and_truncated_messages_are_never_accepted(no_leaks):
    async with Cluster.local(devices=2) as cluster:
        mesh = await cluster.spawn("replay", Echo, devices=[0, 1])
        ref, other = mesh.refs
        client = current_client()
        before = [(await client.request(r.address, "stats", {}))["counters"] for r in mesh.refs]
        sock = _dealer(ref.address)
        socks = [sock]
        try:
            raw = await _handshake(sock, cluster.key)
            hello = RawSession(cluster.key)
            hello.session = raw.session  # the HELLO as it went out, to replay it
            captured = [
                raw.call(ref.name, ref.incarnation, i, "record", i) for i in range(CAPTURED)
            ]
            for frames in captured:
                await sock.send_multipart(frames)
            replies = 0
            while replies < CAPTURED:
                replies += len(raw.open(await asyncio.wait_for(sock.recv_multipart(), 30)))
            assert await ref.seen_list.call_one() == list(range(CAPTURED))

            # 1. on the same connection  2. on a new connection with no handshake
            # 3. after a replayed HELLO (its WELCOME's ticket is of no use to a replayer)
            # 4. to another worker  5. over the worker's same-host stream socket (whose
            # channel never issued that ticket)
            for frames in captured:
                await sock.send_multipart(frames)
            fresh = _dealer(ref.address)
            socks.append(fresh)
            for frames in captured:
                await fresh.send_multipart(frames)
            rehello = _dealer(ref.address)
            socks.append(rehello)
            await rehello.send_multipart(RawSession(cluster.key).hello())
            await asyncio.wait_for(rehello.recv_multipart(), 30)  # a WELCOME, unusable
            for frames in captured:
                await rehello.send_multipart(frames)
            elsewhere = _dealer(other.address)
            socks.append(elsewhere)
            for frames in captured:
                await elsewhere.send_multipart(frames)
            reader, writer = await asyncio.open_unix_connection(stream_path(ref.address))
            try:
                writer.write(b"".join(framed(f) for f in captured))
                await writer.drain()
                # the frames count as they are refused; wait for all of them
                deadline = time.monotonic() + 30
                while True:
                    now = (await client.request(ref.address, "stats", {}))["counters"]
                    if now.get("rejected", 0) - before[0].get("rejected", 0) >= 4 * CAPTURED:
                        break
                    assert time.monotonic() < deadline, {k: v for k, v in now.items() if "rej" in k}
                    await asyncio.sleep(0.05)
            finally:
                writer.close()

            # appended and removed frames on messages never seen before: one more
            # (empty or not) frame, a frame dropped, a buffer split in two
            import torch

            extended = 0
            for i in range(100):
                frames = raw.call(
                    ref.name,
                    ref.incarnation,
                    10_000 + i,
                    "record",
                    torch.arange(i + 1, dtype=torch.int64),
                )
                assert len(frames) == 2
                for bad in (
                    frames + [b""],
                    frames + [b"x"],
                    frames[:1],
                    [frames[0], frames[1][:3], frames[1][3:]],
                ):
                    await sock.send_multipart(bad)
                    extended += 1
            assert await ref.ping.call_one(1) == 1
            # the call may come over another connection than the bad frames (the
            # same-host stream socket), so it says nothing of their order: wait until
            # every one of them was counted (refused or, wrongly, run)
            deadline = time.monotonic() + 30
            while True:
                after = [
                    (await client.request(r.address, "stats", {}))["counters"] for r in mesh.refs
                ]
                delta = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in after[0]}
                if (
                    delta.get("rejected", 0) >= 4 * CAPTURED + extended
                    or time.monotonic() > deadline
                ):
                    break
                await asyncio.sleep(0.05)
            assert delta["rejected_replay"] == 3 * CAPTURED, delta
            assert delta["rejected_receiver"] == CAPTURED, delta
            assert delta["rejected_signature"] == extended, delta
            assert delta["rejected"] == 4 * CAPTURED + extended, delta
            assert (
                after[1].get("rejected_receiver", 0) - before[1].get("rejected_receiver", 0)
                == CAPTURED
            )
            # not one of them ran again
            assert await ref.seen_list.call_one() == list(range(CAPTURED))
        finally:
            for s in socks:
                s.close(linger=0)


async def test_the_controller_refuses_replayed_requests_and_heartbeats(no_leaks):
    async with Cluster.local(devices=1, heartbeat_timeout_s=1.0) as cluster:
        controller = cluster.controller
        counters = controller.counters.values
        sock, attacker = _dealer(cluster.address), _dealer(cluster.address)
        try:
            raw = await _handshake(sock, cluster.key)
            header, _ = _wire.encode([P.CTRL, 7, "hello", {"source": "raw"}])
            hello = raw.seal(header)
            await sock.send_multipart(hello)
            (reply,) = raw.open(await asyncio.wait_for(sock.recv_multipart(), 30))
            assert reply[0] == P.OK and reply[3]["devices"]
            clients = len(controller.clients)
            seen = counters.get("rejected_replay", 0)
            for _ in range(10):  # a peer without the key replays the captured hello
                await attacker.send_multipart(hello)
            await _counter_reaches(counters, "rejected_replay", seen + 10)
            assert len(controller.clients) == clients  # never answered, never registered

            # a node that registered and beat, then stopped: replayed beats keep it from
            # nothing, it is declared lost
            header, _ = _wire.encode(
                [
                    P.CTRL,
                    8,
                    "node_register",
                    {
                        "node_id": "ghost",
                        "host": "h",
                        "devices": [{"local_index": 0, "kind": "cpu", "memory_bytes": 1}],
                    },
                ]
            )
            await sock.send_multipart(raw.seal(header))
            raw.open(await asyncio.wait_for(sock.recv_multipart(), 30))
            beat, _ = _wire.encode([P.CTRL, 0, "heartbeat", {"node_id": "ghost"}])
            beats = [raw.seal(beat) for _ in range(20)]
            for frames in beats:
                await sock.send_multipart(frames)
            seen = counters.get("rejected_replay", 0)
            deadline = time.monotonic() + 20
            while controller.nodes["ghost"]["alive"]:
                assert time.monotonic() < deadline, "replayed heartbeats kept the node alive"
                for frames in beats:
                    await attacker.send_multipart(frames)
                await asyncio.sleep(0.05)
            assert counters["rejected_replay"] > seen
        finally:
            sock.close(linger=0)
            attacker.close(linger=0)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_a_4gib_declared_frame_costs_no_memory_on_any_socket(no_leaks):
    async with Cluster.local(devices=1) as cluster:  # the default 4 GiB message limit
        mesh = await cluster.spawn("big", Echo, devices=[0])
        ref = mesh.refs[0]
        pid = (await mesh.where.call_one())["pid"]
        size = 4 << 30
        targets = [
            ("worker, zeromq", pid, ref.address),
            ("controller, zeromq", os.getpid(), cluster.address),
        ]
        for what, owner, address in targets:
            rss = _rss(owner)
            try:
                sock = await asyncio.to_thread(zmtp_declare, address, size, 1 << 20)
            except ConnectionError:
                sock = None  # dropped while we were still sending: refused as well
            try:
                assert await mesh.add.call_one(2, 3) == 5, what
                grew = _rss(owner) - rss
                assert grew < 64 << 20, f"{what}: RSS grew by {grew} bytes"
            finally:
                if sock is not None:
                    sock.close()
        rss = _rss(pid)
        for declared in (struct.pack("<IQ", 1, size), struct.pack("<IQQ", 2, 100, size)):
            reader, writer = await asyncio.open_unix_connection(stream_path(ref.address))
            try:
                writer.write(declared + bytes(1 << 20))
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 10) == b""  # dropped
            except ConnectionError:
                pass  # dropped while we were still writing
            finally:
                writer.close()
            assert await mesh.add.call_one(2, 3) == 5
            assert _rss(pid) - rss < 64 << 20
