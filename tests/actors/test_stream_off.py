"""NEREUS_STREAM=0: clients do not try the stream socket, workers do not listen."""

from __future__ import annotations

import os

import pytest

from nereus.actors import Cluster
from nereus.actors._channel import Channel
from nereus.actors._client import current_client
from nereus.actors._stream import stream_path
from tests.actors._actors import Echo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_env_turns_the_stream_off(no_leaks, monkeypatch):
    monkeypatch.setenv("NEREUS_STREAM", "0")
    async with Cluster.local(devices=1) as cluster:
        mesh = await cluster.spawn("st_off", Echo, devices=[0])
        ref = mesh.refs[0]
        assert await mesh.add.call_one(2, 2) == 4
        assert type(current_client().conn(ref.address)) is Channel
        assert not os.path.exists(stream_path(ref.address))  # the worker did not listen
        counters = (await current_client().request(ref.address, "stats", {}))["counters"]
        assert counters.get("stream_messages", 0) == 0
