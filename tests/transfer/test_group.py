"""make_group through the actor runtime: one message per member, cache, teardown."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import time

import pytest
import pytest_asyncio

from nereus.actors import Cluster
from nereus.errors import ConfigError, NereusError, RemoteError, TransferError
from nereus.transfer import make_group, release_groups
from tests.transfer._actors import Member

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(120),
]

_PORTS: set[int] = set()


async def _make(*args, **kwargs):
    """make_group, recording the group's store port for the leak check."""
    handle = await make_group(*args, **kwargs)
    _PORTS.add(handle._store.port)
    return handle


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    async with Cluster.local(devices=3, memory_per_device="256MiB") as c:
        yield c
    # every group's store port was recorded by make_group's handles
    assert not [p for port in _PORTS for p in glob.glob(f"/dev/shm/nereus-{port}-*")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def members(cluster):
    mesh = await cluster.spawn("members", Member, devices=[0, 1, 2])
    yield mesh
    await cluster.stop_mesh(mesh)


async def test_groups_over_subsets(cluster, members):
    whole = await _make(cluster, devices=[0, 1, 2], epoch=1)
    pair = await _make(cluster, devices=[2, 0], epoch=1)
    assert whole.backend == "gloo" and pair.devices == (2, 0)
    got = await members.all_reduce.call(whole.group_id, 1.5)
    assert got == [[0, 3, 4.5], [1, 3, 4.5], [2, 3, 4.5]]
    sub = members.slice(dp=slice(0, 3, 2))  # devices 0 and 2
    got = await sub.all_reduce.call(pair.group_id, 2.0)
    # rank order follows devices=[2, 0]: device 0 is rank 1
    assert got == [[1, 2, 4.0], [0, 2, 4.0]]
    assert await members.ring.call(whole.group_id) == [[2] * 3, [0] * 3, [1] * 3]
    # the same group asked for again is the cached one
    assert await _make(cluster, devices=[0, 1, 2], epoch=1) is whole
    assert await release_groups(cluster, epoch=1) == 2
    assert await members.groups.call() == [[], [], []]
    with pytest.raises(RemoteError, match="not live"):
        await members.all_reduce.call(whole.group_id, 1.0)


async def test_create_and_destroy_repeatedly(cluster, members):
    for epoch in range(3):
        g = await _make(cluster, devices=[1, 2], epoch=10 + epoch)
        pair = members.slice(dp=slice(1, 3))
        # bucket events name cluster devices, not ranks
        assert await pair.swap_weights.call(g.group_id) == [
            [1.0 + 1.0, [[1, 2], [2, 1]]],
            [0.0 + 0.0, [[1, 2], [2, 1]]],
        ]
        await g.destroy()
        await g.destroy()  # idempotent
    assert await members.groups.call() == [[], [], []]


async def test_worker_side_release_of_an_epoch(cluster, members):
    a = await _make(cluster, devices=[0, 1, 2], epoch=20)
    b = await _make(cluster, devices=[1, 2], epoch=20)
    c = await _make(cluster, devices=[0, 2], epoch=21)
    assert await members.release.call(20) == [1, 2, 2]
    assert [[g[1] for g in gs] for gs in await members.groups.call()] == [[21], [], [21]]
    sub = members.slice(dp=slice(0, 3, 2))
    assert await sub.all_reduce.call(c.group_id, 1.0) == [[0, 2, 2.0], [1, 2, 2.0]]
    for g in (a, b, c):
        await g.destroy()
    assert await members.groups.call() == [[], [], []]


async def test_a_slow_set_up_is_named_in_the_log(cluster, members, monkeypatch, caplog):
    import nereus.transfer.group as group_module

    monkeypatch.setattr(group_module, "SLOW_SETUP_S", 0.0)  # any set-up now counts as slow
    with caplog.at_level("WARNING", logger="nereus.transfer"):
        h = await _make(cluster, devices=[1, 2], epoch=30)
        assert (
            await _make(cluster, devices=[1, 2], epoch=30) is h
        )  # the cached group: no set-up, nothing said
    said = [r.getMessage() for r in caplog.records if "to set up" in r.getMessage()]
    assert (
        len(said) == 1
        and h.group_id in said[0]
        and "[1, 2]" in said[0]
        and "reverse lookup" in said[0]
    )
    await h.destroy()


async def test_bad_requests_name_the_field(cluster):
    with pytest.raises(ConfigError, match="repeats a device"):
        await make_group(cluster, devices=[0, 0])
    with pytest.raises(ConfigError, match="not a device"):
        await make_group(cluster, devices=[0, 7])
    with pytest.raises(ConfigError, match="needs CUDA"):
        await make_group(cluster, devices=[0, 1], backend="nccl")
    with pytest.raises(ConfigError, match="backend="):
        await make_group(cluster, devices=[0, 1], backend="mpi")


async def test_a_killed_member_fails_survivors_fast_and_groups_go_on():
    async with Cluster.local(devices=3, memory_per_device="128MiB") as c:
        mesh = await c.spawn("m", Member, devices=[0, 1, 2])
        g = await _make(c, devices=[0, 1, 2], epoch=1, timeout_s=30)
        assert [r[2] for r in await mesh.all_reduce.call(g.group_id, 1.0)] == [3.0] * 3
        pids = await mesh.pid.call()
        died = asyncio.Event()
        c.on_failure(lambda f: died.set())
        os.kill(pids[2], signal.SIGKILL)
        await asyncio.wait_for(died.wait(), 10)
        survivors = mesh.slice(dp=slice(0, 2))
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as err:
            await survivors.all_reduce.call(g.group_id, 1.0)
        assert err.value.remote_type in ("TransferError", "StuckCollective")
        assert time.monotonic() - t0 < 15  # well inside the 30 s deadline
        with pytest.raises(NereusError):
            await make_group(c, devices=[0, 2], epoch=2, timeout_s=10)
        g2 = await _make(c, devices=[0, 1], epoch=2)
        assert await survivors.all_reduce.call(g2.group_id, 1.0) == [[0, 2, 2.0], [1, 2, 2.0]]
        await g.destroy()  # the dead member is skipped
        await g2.destroy()
    assert not [p for port in _PORTS for p in glob.glob(f"/dev/shm/nereus-{port}-*")]


async def test_a_member_that_dies_during_set_up_stops_the_others_waiting():
    """Device 2's worker is stopped before the set-up (its join never runs) and killed
    while the others wait for it in the rendezvous: make_group names device 2 at once,
    not at the 60 s deadline, and a group over the survivors forms after it."""
    async with Cluster.local(devices=3, memory_per_device="128MiB") as c:
        mesh = await c.spawn("m", Member, devices=[0, 1, 2])
        first = await _make(c, devices=[0, 1, 2], epoch=1)  # every device has its agent
        await first.destroy()
        pids = await mesh.pid.call()
        os.kill(pids[2], signal.SIGSTOP)
        try:
            setup = asyncio.ensure_future(make_group(c, devices=[0, 1, 2], epoch=2, timeout_s=60))
            await asyncio.sleep(1.0)  # devices 0 and 1 are in the rendezvous now
            assert not setup.done()
            t0 = time.monotonic()
            os.kill(pids[2], signal.SIGKILL)
        except BaseException:
            os.kill(pids[2], signal.SIGKILL)
            raise
        with pytest.raises(TransferError, match="device 2 could not join"):
            await asyncio.wait_for(setup, 30)
        assert time.monotonic() - t0 < 20  # well inside the 60 s deadline
        survivors = mesh.slice(dp=slice(0, 2))
        g = await _make(c, devices=[0, 1], epoch=3)
        assert await survivors.all_reduce.call(g.group_id, 1.0) == [[0, 2, 2.0], [1, 2, 2.0]]
        await g.destroy()
    assert not [p for port in _PORTS for p in glob.glob(f"/dev/shm/nereus-{port}-*")]


async def test_destroy_removes_the_names_killed_members_left_and_no_others(cluster, members):
    """A hand-off segment's name left by two killed ends (planted here: killing both ends
    at that instant is not reproducible) goes with the group; another group's stays."""
    from nereus.transfer._shm import SHM_DIR, shm_name_prefix

    group = await _make(cluster, devices=[0, 1], epoch=8)
    other = await _make(cluster, devices=[0, 1], epoch=9)
    mine = shm_name_prefix(group._store.port, group._store.host, group.group_id, 8)
    theirs = shm_name_prefix(other._store.port, other._store.host, other.group_id, 9)
    left = [f"{SHM_DIR}/{mine}-0-1.h0", f"{SHM_DIR}/{theirs}-0-1.h0"]
    for path in left:
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        await group.destroy()
        assert [os.path.exists(p) for p in left] == [False, True]
    finally:
        await other.destroy()
    assert not os.path.exists(left[1])


async def test_the_store_takes_no_new_connections_once_the_group_formed(cluster, members):
    import datetime

    from torch.distributed import TCPStore

    from nereus.transfer.group import store_token

    group = await _make(cluster, devices=[0, 1], epoch=7)
    store = group._store
    assert store.host == "127.0.0.1" and store.sealed  # one host: loopback only
    # the members' own connections still carry the watchdog's records
    assert await members.slice(dp=slice(0, 2)).all_reduce.call(group.group_id, 1.0) == [
        [0, 2, 2.0],
        [1, 2, 2.0],
    ]
    token = store_token(cluster.key, group.group_id)
    assert store.store.check([f"nereus/{token}/{group.group_id}/7/c/0"])
    assert token != store_token(b"another-key-0123456789", group.group_id)
    with pytest.raises(Exception, match="timed out|refused|connect"):
        await asyncio.to_thread(
            TCPStore,
            store.host,
            store.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=1),
        )
    # sealed, the store's server waits for its members' requests and burns no CPU: a
    # listener left in its poll set would keep one of its threads spinning on accept
    before = _store_thread_cpu_s()
    await asyncio.sleep(1.0)
    assert _store_thread_cpu_s() - before < 0.2
    await group.destroy()


def _store_thread_cpu_s() -> float:
    """CPU seconds used so far by this process's TCPStore server threads."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                if not f.read().startswith("pt_tcpstore"):
                    continue
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


async def test_a_multi_host_store_listens_on_the_route_to_the_members():
    from nereus.actors import DeviceInfo
    from nereus.transfer.group import _store_host

    here = DeviceInfo(0, "localhost", "cpu", 1, "n0", 0)
    assert _store_host([here]) == "127.0.0.1"
    # a member on another host (an address on the loopback network stands for it): the
    # store binds the address of the interface that routes there, never 0.0.0.0
    there = DeviceInfo(1, "127.0.0.2", "cpu", 1, "n1", 0)
    assert _store_host([here, there]) == "127.0.0.1"


async def test_concurrent_groups_over_shared_devices_set_up_one_after_another(cluster, members):
    """Groups made at once over overlapping devices: every one forms and works, and no two
    set-ups that share a device overlap in time (the per-device lock)."""
    for trial in range(5):
        devsets = [[0, 1], [1, 2], [0, 2], [2, 1, 0]]
        handles = await asyncio.gather(
            *(_make(cluster, devices=d, epoch=100 + trial) for d in devsets)
        )
        for a, b in ((a, b) for i, a in enumerate(handles) for b in handles[i + 1 :]):
            if set(a.devices) & set(b.devices):
                (a0, a1), (b0, b1) = a.setup_span, b.setup_span
                assert a1 <= b0 or b1 <= a0, (a.devices, a.setup_span, b.devices, b.setup_span)
        assert await release_groups(cluster, epoch=100 + trial) == len(devsets)
