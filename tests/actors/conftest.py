"""Fixtures for the actor tests: clusters of real worker processes, leak checks.

Process checks read /proc (Linux), so the tests need no extra package."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest
import pytest_asyncio
import zmq

from nereus.actors import Cluster
from tests._leaks import children, wait_gone


def _fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listing
            pass
    return out


def _ipc_dirs() -> set[str]:
    # only this process's node daemons (other test runs may share /tmp)
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"nereus-{os.getpid()}-*")))


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves child processes, ipc directories or fds behind."""
    zmq.Context.instance().socket(zmq.PAIR).close()  # start the shared context: not a leak
    before_children, before_dirs = children(), _ipc_dirs()
    before_fds = _fds()
    yield
    alive = wait_gone(children() - before_children)
    assert not alive, f"leaked child processes {alive}"
    assert _ipc_dirs() <= before_dirs, f"leaked ipc dirs {_ipc_dirs() - before_dirs}"
    # libzmq closes sockets asynchronously (its reaper thread): wait for it, with a deadline
    deadline = time.monotonic() + 5
    while set(_fds()) - set(before_fds) and time.monotonic() < deadline:
        time.sleep(0.05)
    new = {fd: target for fd, target in _fds().items() if fd not in before_fds}
    assert not new, f"leaked file descriptors {new}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    """One 3-device local cluster shared by a test module (startup costs ~1 s)."""
    before = children()
    async with Cluster.local(devices=3, memory_per_device="256MiB") as c:
        yield c
    assert not wait_gone(children() - before), "cluster leaked workers"
