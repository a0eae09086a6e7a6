"""CURVE on tcp sockets: a cluster that shares a key pair works as before; a peer
without it (plain, or with another key pair) never completes a connection."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from nereus.actors import Cluster
from nereus.actors._curve import generate_curve, load_curve, secure, stop_authenticators
from nereus.errors import ConfigError
from nereus.monitor import Subscriber
from tests.actors._actors import Echo
from tests.actors._raw import RawSession

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def _handshake_outcome(
    address: str, curve, server_public: bytes | None = None, kind: int = zmq.DEALER
) -> int:
    """The first handshake event of a DEALER connecting to ``address`` (``curve``: the
    key pair it presents, None for a plain socket; ``server_public``: the server key it
    expects, by default its own public key as the cluster's sockets do)."""
    ctx = zmq.asyncio.Context.shadow(zmq.Context.instance())
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        if curve is not None:
            secure(sock, curve, address, server=False)
            if server_public is not None:
                sock.curve_serverkey = server_public
        sock.connect(address)
        if kind == zmq.DEALER:
            await sock.send_multipart(RawSession(b"k" * 32).hello())
        event = await asyncio.wait_for(recv_monitor_message(monitor), 20)
        return event["event"]
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


async def test_a_curve_cluster_serves_its_own_and_refuses_strangers(tmp_path, no_leaks):
    key_file = tmp_path / "curve.key"
    mine = generate_curve(key_file)
    other = generate_curve(tmp_path / "other.key")
    try:
        async with Cluster.local(
            devices=2, transport="tcp", curve_key_file=str(key_file)
        ) as cluster:
            mesh = await cluster.spawn("curve", Echo, devices=[0, 1])
            assert await mesh.add.call(2, 3) == [5, 5]
            # actors reach each other over CURVE too
            assert await mesh.refs[0].relay.call_one(mesh.refs[1], "add", 4, 5) == 9
            tap = Subscriber(
                cluster.tap_address, cluster.key, {"test_event"}, curve=load_curve(key_file)
            )
            try:

                async def marked():
                    while True:  # PUB/SUB joins asynchronously: emit until one arrives
                        await mesh.refs[0].emit_event.call_one(7)
                        try:
                            return await tap.next(0.2)
                        except asyncio.TimeoutError:
                            continue

                assert (await asyncio.wait_for(marked(), 30))["value"] == 7
            finally:
                tap.close()
            worker = mesh.refs[0].address
            assert worker.startswith("tcp://")
            for address, kind in (
                (worker, zmq.DEALER),
                (cluster.address, zmq.DEALER),
                (cluster.tap_address, zmq.SUB),
            ):
                assert await _handshake_outcome(address, None, kind=kind) in (
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                )
                # public keys are not secret: a stranger who knows the cluster's is
                # still refused (the ZAP handler admits only the cluster's own pair)
                assert await _handshake_outcome(address, other, mine.public, kind) in (
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                )
                assert (
                    await _handshake_outcome(address, load_curve(key_file), kind=kind)
                    == zmq.EVENT_HANDSHAKE_SUCCEEDED
                )
            assert await mesh.add.call(1, 1) == [2, 2]
    finally:
        stop_authenticators()


def test_a_bad_key_file_is_named(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    with pytest.raises(ConfigError, match="bad.key.*does not hold a CURVE secret key"):
        load_curve(bad)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_curve(tmp_path / "missing.key")
    with pytest.raises(FileExistsError):
        generate_curve(bad)  # never overwrites
