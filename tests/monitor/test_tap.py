"""The tap's schema, formatting, subscriber verification and CLI (no cluster needed)."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys

import msgpack
import pytest
import zmq

from nereus.actors import _session, _wire
from nereus.monitor import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    Subscriber,
    check_event,
    describe,
    format_event,
    to_json,
)

KEY = b"tap-test-key-0123456789"


_SENDER = b"c" * 16  # a controller's tap id
_seq = itertools.count(1)


def _frame(key: bytes, body: bytes, seq: int | None = None, sender: bytes = _SENDER) -> bytes:
    """One tap event as the controller publishes it (signature, envelope, body)."""
    env = _session.envelope(sender, _session.ANY, next(_seq) if seq is None else seq)
    return _wire.sign(key, body, (), env) + env + body


def _event(**fields):
    base = {
        "type": "worker_death",
        "v": SCHEMA_VERSION,
        "seq": 3,
        "time_monotonic_seconds": 12.5,
        "epoch": 2,
        "source": "controller",
    }
    return base | fields


def test_schema_lists_types_with_si_fields():
    assert {"worker_death", "call_span", "counters", "failure", "transfer_bucket"} <= set(
        EVENT_TYPES
    )
    assert "latency_seconds" in EVENT_TYPES["call_span"]
    assert check_event(_event(device=1)) == []
    assert check_event({"type": 3}) and check_event([1])
    assert "call_span" in describe()


def test_format_and_json():
    ev = _event(device=1, reason="SIGKILL", blob=b"\x01\x02", latency_seconds=0.000123456)
    line = format_event(ev)
    assert "worker_death" in line and "device=1" in line and "reason=SIGKILL" in line
    assert "e2" in line and "controller" in line
    back = json.loads(to_json(ev))
    assert back["blob"] == "0102" and back["device"] == 1
    # a plan reads as the job's summary writes it, not as a nested dict
    plan = {
        "policy_generation": {"tp": 1, "pp": 1, "dp": 2, "devices": [[0], [1]]},
        "policy_training": {"tp": 2, "pp": 1, "dp": 1, "devices": [[2, 3]], "recompute": True},
    }
    line = format_event(_event(to_plan=plan, step=4))
    assert "to_plan=[policy_generation tp1·pp1·dp2 [0,1]; policy_training tp2·pp1·dp1" in line
    assert "{" not in line and "step=4" in line


async def test_subscriber_drops_forged_events():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(f"tcp://127.0.0.1:{port}", KEY, {"worker_death"})
    try:
        good = msgpack.packb(_event(device=1))
        forged = msgpack.packb(_event(device=666))

        async def first():
            while True:  # PUB/SUB joins asynchronously: publish until one arrives
                pub.send(_frame(b"wrong-key-wrong-key", forged))
                pub.send_multipart([b"garbage"])
                pub.send(_frame(KEY, good))
                try:
                    return await sub.next(0.1)
                except asyncio.TimeoutError:
                    continue

        ev = await asyncio.wait_for(first(), 10)
        assert ev["device"] == 1
        assert sub.rejected >= 2
    finally:
        sub.close()
        pub.close(linger=0)


async def test_subscriber_drops_replayed_events():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(f"tcp://127.0.0.1:{port}", KEY)
    try:
        sender = b"r" * 16
        first = _frame(KEY, msgpack.packb(_event(device=1)), seq=10**9, sender=sender)

        async def joined():
            while True:  # PUB/SUB joins asynchronously: publish until one arrives
                pub.send(first)
                try:
                    return await sub.next(0.1)
                except asyncio.TimeoutError:
                    continue

        assert (await asyncio.wait_for(joined(), 10))["device"] == 1
        rejected = sub.rejected
        for _ in range(5):  # the same event again, and an older one
            pub.send(first)
            pub.send(_frame(KEY, msgpack.packb(_event(device=2)), seq=5, sender=sender))
        pub.send(_frame(KEY, msgpack.packb(_event(device=3)), seq=10**9 + 1, sender=sender))
        assert (await sub.next(10))["device"] == 3
        assert sub.rejected >= rejected + 10  # only the newer event got through
    finally:
        sub.close()
        pub.close(linger=0)


async def test_subscriber_refuses_a_replay_after_65_other_senders():
    """A bounded table that evicts its oldest sender would accept that sender's old events
    again once 64 others had spoken: the subscriber keeps every sender's last seq."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(f"tcp://127.0.0.1:{port}", KEY)
    try:
        first_sender = b"\x00" * 15 + b"\x01"
        captured = _frame(KEY, msgpack.packb(_event(device=1)), seq=7, sender=first_sender)

        async def joined():
            while True:  # PUB/SUB joins asynchronously: publish until one arrives
                pub.send(captured)
                try:
                    return await sub.next(0.1)
                except asyncio.TimeoutError:
                    continue

        assert (await asyncio.wait_for(joined(), 10))["device"] == 1
        for i in range(65):  # 65 other controllers, each with its own fresh id
            pub.send(
                _frame(KEY, msgpack.packb(_event(device=100 + i)), seq=1, sender=bytes([2, i]) * 8)
            )
            assert (await sub.next(10))["device"] == 100 + i
        rejected = sub.rejected
        pub.send(captured)  # the first sender's captured event, replayed
        pub.send(_frame(KEY, msgpack.packb(_event(device=2)), seq=8, sender=first_sender))
        assert (await sub.next(10))["device"] == 2  # its next event passes; the replay did not
        assert sub.rejected == rejected + 1
    finally:
        sub.close()
        pub.close(linger=0)


@pytest.mark.integration
def test_cli_schema_and_usage():
    out = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "tap", "--schema"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "worker_death" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "tap"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "tap address" in out.stderr


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_cli_prints_live_events(tmp_path):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    jsonl = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nereus.cli",
            "tap",
            f"tcp://127.0.0.1:{port}",
            "--key-file",
            str(key_file),
            "--count",
            "3",
            "--jsonl",
            str(jsonl),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        body = msgpack.packb(_event(device=4, reason="SIGKILL"))
        while proc.poll() is None:  # until the tap has seen 3 events and exited
            pub.send(_frame(KEY, body))
            try:
                proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        out = proc.stdout.read()
        assert proc.returncode == 0
        assert out.count("worker_death") == 3 and "reason=SIGKILL" in out
        lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
        assert len(lines) == 3 and lines[0]["device"] == 4
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        pub.close(linger=0)
