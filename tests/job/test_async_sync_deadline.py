"""A weight sync to a generation EMU that cannot complete fails within its deadline with an
error naming the EMU and its devices (the transfer replaced by one that never finishes)."""

from __future__ import annotations

import asyncio
import types

import pytest

import nereus.job.async_generation as async_generation
import nereus.job.async_loop as async_loop
from nereus.errors import DeadlineExceeded
from nereus.rl.mode import RLModeConfig


@pytest.mark.timeout(30)
async def test_a_sync_that_hangs_fails_naming_the_peer(monkeypatch):
    async def never(plans, hosts, group, **kw):
        await asyncio.Event().wait()

    monkeypatch.setattr(async_generation, "execute_into", never)
    run = async_loop.AsyncRun.__new__(async_loop.AsyncRun)
    run.mode = RLModeConfig(mode="async", sync_timeout_s=0.2)
    run.stages = types.SimpleNamespace(hosts={})
    run.version = run.published = 3
    run.gate = async_generation.PublishGate()
    run.changed = asyncio.Condition()
    emu = types.SimpleNamespace(name="policy_generation.1", devices=(2, 3))
    worker = async_generation.Worker(emu, plan=None, group=None, version=2)
    with pytest.raises(DeadlineExceeded, match=r"'policy_generation.1' on devices \[2, 3\].*0.2 s"):
        await run._sync_worker(worker)
    assert worker.version == 2  # the EMU's weights are not taken as synced
