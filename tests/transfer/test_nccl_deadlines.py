"""The nccl backend's deadline watch, on CPU: how pending operations are reaped, how one
past its deadline (or an NCCL error) aborts the group and which error the next call
raises, and that the event loop (not a thread) notices a stuck operation by itself.

The CUDA events and the libnccl communicator are stood in for by small fakes with the
two calls the watch makes (``Event.query``, ``ncclCommGetAsyncError``); the GPU tier
runs the same code on real ones (tests/transfer/test_nccl.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import pytest

from nereus.errors import StuckCollective, TransferError
from nereus.transfer import _libnccl
from nereus.transfer.nccl import NcclCommunicator, _Pending


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class FakeComm:
    def __init__(self) -> None:
        self.aborted = False
        self.error = _libnccl.SUCCESS

    def async_error(self) -> int:
        return self.error

    def error_text(self, code: int) -> str:
        return "remote process exited or there was a network error"

    def abort(self) -> None:
        self.aborted = True


class FakeStore:
    def __init__(self, entered: dict[int, int]) -> None:
        self.entered = entered

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [str(self.entered[int(k.split("/")[1])]).encode() for k in keys]


def communicator(loop: asyncio.AbstractEventLoop | None = None, kv=None) -> NcclCommunicator:
    """A communicator with everything the watch reads, and fakes below it."""
    comm = object.__new__(NcclCommunicator)
    comm.group_id, comm.rank, comm.size, comm.epoch = "g", 0, 3, 1
    comm.timeout_s = 5.0
    comm._lock = threading.Lock()
    comm._aborted = comm._destroyed = False
    comm._seq = 0
    comm._kv = kv
    comm._loop = loop
    comm._pending = deque()
    comm._pending_lock = threading.Lock()
    comm._polling = False
    comm._failure = None
    comm._comm = FakeComm()
    return comm


def pending(op: str, seq: int, done: bool, deadline_in: float) -> _Pending:
    now = time.monotonic()
    return _Pending(op, seq, FakeEvent(done), now, now + deadline_in)


def test_completed_operations_are_forgotten_in_order():
    comm = communicator()
    first, second = pending("all_reduce", 1, True, 5), pending("broadcast", 2, False, 5)
    third = pending("barrier", 3, True, 5)  # not reaped before the one ahead of it
    comm._pending.extend([first, second, third])
    comm._reap(time.monotonic())
    assert list(comm._pending) == [second, third]
    second.done.done = True
    comm.synchronize()
    assert not comm._pending and not comm._comm.aborted


def test_an_operation_past_its_deadline_aborts_and_names_the_missing_rank():
    comm = communicator(kv=FakeStore({0: 4, 1: 4, 2: 3}))
    comm._pending.append(pending("all_reduce", 4, False, 0.05))
    t0 = time.monotonic()
    with pytest.raises(StuckCollective) as info:
        comm.synchronize()
    assert info.value.missing_ranks == [2] and info.value.op == "all_reduce"
    assert time.monotonic() - t0 < 5 and comm._comm.aborted
    with pytest.raises(TransferError, match="aborted"):  # raised once; then the group is gone
        comm.synchronize()


def test_without_store_records_the_error_says_ranks_are_unknown():
    comm = communicator()
    comm._pending.append(pending("broadcast", 1, False, 0.0))
    with pytest.raises(TransferError, match="broadcast did not complete"):
        comm.synchronize()
    assert comm._comm.aborted


def test_a_synchronize_cap_shorter_than_the_deadline_fails_the_operation():
    comm = communicator()
    comm._pending.append(pending("batch_p2p", 1, False, 60.0))
    with pytest.raises(TransferError, match="batch_p2p"):
        comm.synchronize(timeout_s=0.05)


def test_an_nccl_asynchronous_error_fails_the_group_at_once():
    comm = communicator(kv=FakeStore({0: 1, 1: 1, 2: 1}))
    comm._pending.append(pending("all_gather", 1, False, 60.0))
    comm._comm.error = 6  # ncclRemoteError
    with pytest.raises(TransferError, match="NCCL error 6"):
        comm.synchronize()
    assert comm._comm.aborted


def test_a_caller_inside_an_nccl_call_is_never_aborted_under():
    comm = communicator()
    comm._pending.append(pending("all_reduce", 1, False, 0.0))
    with comm._lock:  # an operation is being enqueued
        comm._reap(time.monotonic())
        assert comm._failure is not None and not comm._comm.aborted
    with pytest.raises(TransferError):
        comm.synchronize()  # the next call aborts and raises
    assert comm._comm.aborted


def test_the_event_loop_notices_a_stuck_operation_without_any_call():
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        comm = communicator(loop)
        threads = threading.active_count()
        comm._track(pending("all_reduce", 1, False, 0.1))
        deadline = time.monotonic() + 10
        while not comm._comm.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert comm._comm.aborted, "the loop did not abort the stuck operation"
        assert threading.active_count() == threads  # no watcher thread
        while comm._polling and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not comm._polling  # the poll stops once the group failed
        with pytest.raises(TransferError, match="all_reduce"):
            comm.synchronize()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_the_loop_stops_polling_once_nothing_is_pending():
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        comm = communicator(loop)
        op = pending("broadcast", 1, False, 30.0)
        comm._track(op)
        time.sleep(0.05)
        assert comm._polling
        op.done.done = True
        deadline = time.monotonic() + 5
        while comm._polling and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not comm._polling and not comm._pending and not comm._comm.aborted
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_synchronize_on_a_group_aborted_from_outside_raises_at_once():
    comm = communicator()
    comm._pending.append(pending("all_reduce", 1, False, 60.0))
    comm.abort()
    with pytest.raises(TransferError, match="aborted with all_reduce pending"):
        comm.synchronize()
