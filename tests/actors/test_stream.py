"""The same-host stream transport: used by default, frames checked, ZeroMQ as fallback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct

import pytest
import torch

from nereus.actors import Cluster
from nereus.actors import _protocol as P
from nereus.actors._client import current_client
from nereus.actors._stream import StreamChannel, stream_path
from tests.actors._actors import Echo, Tensors
from tests.actors._raw import RawSession, framed, read_frames

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(60),
]


async def _handshake(key: bytes, reader, writer) -> RawSession:
    """HELLO, WELCOME, READY on a raw stream connection."""
    raw = RawSession(key)
    writer.write(framed(raw.hello()))
    await writer.drain()
    raw.welcome(await asyncio.wait_for(read_frames(reader), 10))
    writer.write(framed(raw.ready()))
    return raw


async def _read_reply(raw: RawSession, reader: asyncio.StreamReader) -> list:
    (reply,) = raw.open(await read_frames(reader))
    return reply


async def _counters(address: str) -> dict[str, int]:
    return (await current_client().request(address, "stats", {}))["counters"]


def _delta(before: dict[str, int], after: dict[str, int], counter: str) -> int:
    return after.get(counter, 0) - before.get(counter, 0)


@contextlib.asynccontextmanager
async def _connection(address: str):
    """A raw connection to a worker's stream socket, closed on exit."""
    reader, writer = await asyncio.open_unix_connection(stream_path(address))
    try:
        yield reader, writer
    finally:
        writer.close()


async def test_calls_go_over_the_stream_by_default(cluster: Cluster):
    mesh = await cluster.spawn("st_default", Echo, devices=[0, 1])
    try:
        assert await mesh.add.call(1, 2) == [3, 3]
        client = current_client()
        assert all(type(client.conn(r.address)) is StreamChannel for r in mesh.refs)
        before = await _counters(mesh.refs[0].address)
        results = await asyncio.gather(*[mesh.refs[0].add.call_one(i) for i in range(200)])
        assert results == list(range(200))
        after = await _counters(mesh.refs[0].address)
        # 200 calls (some coalesced into batches) and the stats request itself
        assert after["stream_messages"] > before["stream_messages"]
        assert after["messages"] - before["messages"] >= 1
        # an actor calling another actor uses the stream too
        assert await mesh.refs[0].relay.call_one(mesh.refs[1], "add", 4, 5) == 9
    finally:
        await cluster.stop_mesh(mesh)


async def test_tensors_and_large_messages_round_trip(cluster: Cluster):
    mesh = await cluster.spawn("st_tensors", Tensors, devices=[2])
    try:
        ref = mesh.refs[0]
        big = torch.randn(4 * 2**20)  # 16 MiB: received straight into its own buffer
        got = await ref.echo.call_one(big)
        assert torch.equal(got, big)
        # small and large buffers interleaved in one batch keep their order and bytes
        xs = [torch.arange(n, dtype=torch.int64) for n in (0, 1, 70_000, 3, 200_000, 17)]
        outs = await asyncio.gather(*[ref.echo.call_one(x) for x in xs])
        assert all(torch.equal(a, b) for a, b in zip(outs, xs, strict=True))
        # received tensors are writable, small (copied) and large (own buffer) alike
        for n in (10, 100_000):
            assert torch.equal(
                await ref.add_one_inplace.call_one(torch.ones(n)), torch.full((n,), 2.0)
            )
        assert await ref.checksum.call_one(torch.ones(100_000)) == 100_000.0
    finally:
        await cluster.stop_mesh(mesh)


async def test_bytes_split_anywhere_still_make_messages(cluster: Cluster):
    mesh = await cluster.spawn("st_split", Echo, devices=[0])
    ref = mesh.refs[0]
    try:
        async with _connection(ref.address) as (reader, writer):
            raw = await _handshake(cluster.key, reader, writer)
            data = framed(raw.call(ref.name, ref.incarnation, 7, "add", 20, 22))
            for i in range(len(data)):  # one byte per write
                writer.write(data[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)
            reply = await asyncio.wait_for(_read_reply(raw, reader), 10)
            assert reply == [P.OK, 7, ref.incarnation, 42]
    finally:
        await cluster.stop_mesh(mesh)


async def test_oversized_declared_length_is_dropped_before_allocation(cluster: Cluster):
    mesh = await cluster.spawn("st_big", Echo, devices=[1])
    ref = mesh.refs[0]
    before = await _counters(ref.address)
    # 2**62 bytes could never be allocated: the worker must not try; then a message of
    # no frames. Each connection is dropped.
    for bad in (
        struct.pack("<IQQ", 2, 100, 2**62),
        struct.pack("<I", 0),
        struct.pack("<IQ", 1, 100_000),
    ):  # > 64 KiB before the handshake
        async with _connection(ref.address) as (reader, writer):
            writer.write(bad)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""
    after = await _counters(ref.address)
    assert _delta(before, after, "rejected_oversized") == 2
    assert _delta(before, after, "rejected_header") == 1
    assert await mesh.add.call_one(2, 3) == 5  # still serving
    await cluster.stop_mesh(mesh)


async def test_bad_signature_is_counted_and_the_connection_goes_on(cluster: Cluster):
    mesh = await cluster.spawn("st_sig", Echo, devices=[2])
    ref = mesh.refs[0]
    before = await _counters(ref.address)
    async with _connection(ref.address) as (reader, writer):
        raw = await _handshake(cluster.key, reader, writer)
        good = raw.call(ref.name, ref.incarnation, 2, "add", 1, 2)
        writer.write(framed([os.urandom(32) + good[0][32:]]))
        writer.write(framed([b"short"]))
        writer.write(framed(good))
        await writer.drain()
        # only the good call is answered, on the same connection
        assert await asyncio.wait_for(_read_reply(raw, reader), 10) == [P.OK, 2, ref.incarnation, 3]
    after = await _counters(ref.address)
    assert _delta(before, after, "rejected_signature") == 1
    assert _delta(before, after, "rejected_short") == 1
    await cluster.stop_mesh(mesh)


async def test_a_reply_to_a_closed_connection_is_counted(cluster: Cluster):
    mesh = await cluster.spawn("st_gone", Echo, devices=[0])
    ref = mesh.refs[0]
    before = await _counters(ref.address)
    async with _connection(ref.address) as (reader, writer):
        raw = await _handshake(cluster.key, reader, writer)
        writer.write(framed(raw.call(ref.name, ref.incarnation, 3, "sleep", 0.3)))
        await writer.drain()
    await asyncio.sleep(0.6)
    after = await _counters(ref.address)
    assert _delta(before, after, "send_failed") == 1
    assert await mesh.add.call_one(1, 1) == 2
    await cluster.stop_mesh(mesh)


async def test_no_stream_socket_means_zeromq(cluster: Cluster):
    client = current_client()
    assert client._open_stream("ipc:///nonexistent/nereus-w0") is None
    assert client._open_stream("tcp://127.0.0.1:1") is None
