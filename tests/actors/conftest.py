"""Fixtures for the actor tests: clusters of real worker processes, leak checks."""

from __future__ import annotations

import glob
import os
import tempfile

import psutil
import pytest
import pytest_asyncio

from nereus.actors import Cluster


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "nereus-*")))


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves child processes, ipc directories or fds behind."""
    before_children, before_dirs = _children(), _ipc_dirs()
    before_fds = psutil.Process().num_fds()
    yield
    left = _children() - before_children
    for pid in left:
        try:
            psutil.Process(pid).wait(timeout=5)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            pass
    alive = [p for p in left if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"leaked child processes {alive}"
    assert _ipc_dirs() <= before_dirs, f"leaked ipc dirs {_ipc_dirs() - before_dirs}"
    # zmq keeps a few fds in its context (shared, created once); allow that slack
    assert psutil.Process().num_fds() <= before_fds + 8, "leaked file descriptors"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster():
    """One 3-device local cluster shared by a test module (startup costs ~1 s)."""
    before = _children()
    async with Cluster.local(devices=3, memory_per_device="256MiB") as c:
        yield c
    left = _children() - before
    for pid in left:
        try:
            psutil.Process(pid).wait(timeout=5)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass
    assert not [p for p in left if psutil.pid_exists(p)
                and psutil.Process(p).status() != "zombie"], "cluster leaked workers"
