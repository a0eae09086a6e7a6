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


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process we can see."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:  # it exited while we looked
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry)] = (int(fields[1]), fields[0])
    return out


def _children() -> set[int]:
    """Live (not zombie) descendants of this process."""
    procs = _processes()
    found, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _state) in procs.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return {pid for pid in found if procs[pid][1] != "Z"}


def _wait_gone(pids: set[int], timeout_s: float = 5.0) -> set[int]:
    """The pids still alive after waiting up to ``timeout_s`` for them to exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = pids & _children()
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


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
    before_children, before_dirs = _children(), _ipc_dirs()
    before_fds = _fds()
    yield
    alive = _wait_gone(_children() - before_children)
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
    before = _children()
    async with Cluster.local(devices=3, memory_per_device="256MiB") as c:
        yield c
    assert not _wait_gone(_children() - before), "cluster leaked workers"
