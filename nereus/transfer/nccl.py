"""NcclCommunicator: NCCL (through ``_libnccl``, ctypes) on torch CUDA tensors, on a
communication stream of its own.

Imported only where used (``make_group`` with CUDA devices, GPU tests): importing
nereus never loads libnccl. Built from the group id, rank, size and the NCCL unique id
as 128 raw bytes (made by ``unique_id()`` on one member, sent in msgpack), optionally a
TCPStore address (records of who entered what, to name missing ranks) and the worker's
event loop (``loop``, which watches deadlines).

Promises (beyond the Communicator contract; docs/gpu.md says why):
- Device: a worker sees one GPU, ``cuda:0``, the default; ``device=`` picks another in
  a process that sees several (tests). Tensors elsewhere are refused.
- Streams: NCCL runs on ``self.stream``, never on the caller's stream. An operation
  starts after what the caller's current stream had enqueued when it was called (an
  event recorded there, waited for on ``self.stream``); the caller's stream waits, on
  the GPU, for an event recorded after it, so later work there sees the result. The
  host does not wait: an operation returns once NCCL accepted it. Every tensor it
  touches is ``record_stream``-ed on ``self.stream`` (the allocator keeps its memory
  until NCCL is done). ``enqueue_p2p`` starts after a given event and returns the one
  marking its end without making the caller's stream wait (bucketed transfers).
- Host waits only where the host needs the data: ``synchronize``, ``barrier``,
  ``destroy``. Accepting a call never blocks past its deadline (non-blocking NCCL).
- Deadlines with no watcher thread: while operations are pending, ``loop`` (if given)
  polls their events (``Event.query``) and ``ncclCommGetAsyncError`` at growing
  intervals up to ``_POLL_MAX_S``; every later call checks them too. One not done by
  its deadline, or an NCCL error, aborts the communicator (``ncclCommAbort`` frees the
  stuck kernels, so streams waiting on them go on) and the next call raises
  ``StuckCollective`` naming the ranks that never entered (store records), after a
  ``stuck_collective`` tap event; without records, ``TransferError``. A rank that
  never joins fails the others' start the same way (op ``create``).
- Counts are ``size_t`` elements; bytes for dtypes NCCL lacks; bool reduces as uint8.

Refuses: tensors not on this device, mismatched sizes (``TransferError``); ``avg`` on
non-floating dtypes (``ConfigError``).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nereus.config import require
from nereus.errors import ConfigError, StuckCollective, TransferError
from nereus.transfer import _libnccl, _tap
from nereus.transfer.communicator import Communicator, P2POp, ReduceOp

__all__ = ["NcclCommunicator", "unique_id", "nccl_available"]

log = logging.getLogger("nereus.transfer")


def nccl_available() -> bool:
    """Whether libnccl and a CUDA device are usable in this process."""
    try:
        _libnccl.library()
    except TransferError:
        return False
    return torch.cuda.is_available()


def unique_id() -> bytes:
    """A fresh NCCL unique id as 128 raw bytes (msgpack-friendly)."""
    return _libnccl.unique_id()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_code(dtype: torch.dtype) -> int:
    code = _libnccl.DTYPES.get(_dtype_name(dtype))
    if code is None:
        raise TransferError(f"dtype {dtype} cannot be reduced by NCCL")
    return code


def _elements(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(view, count, dtype code)`` moving contiguous ``t`` as its own dtype where
    NCCL has it, else as bytes."""
    code = _libnccl.DTYPES.get(_dtype_name(t.dtype))
    if code is None or t.dtype == torch.bool:
        flat = _as_bytes(t)
        return flat, flat.numel(), _libnccl.UINT8
    return t, t.numel(), code


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass
class _Pending:
    """One enqueued operation: done once ``done`` (recorded after it on the
    communication stream) has completed."""

    op: str
    seq: int
    done: Any  # torch.cuda.Event
    t0: float
    deadline: float


@dataclass
class _Failure:
    """What went wrong with an operation; turned into the error raised at the next call
    (reading the store to name the missing ranks may block: never on the event loop)."""

    op: str
    seq: int
    seconds: float
    nccl_error: str = ""


_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.02


class NcclCommunicator(Communicator):
    """NCCL communicator for CUDA tensors (see the module docstring)."""

    backend = "nccl"
    streamed = True

    def __init__(
        self,
        group_id: str,
        rank: int,
        size: int,
        nccl_id: bytes,
        *,
        epoch: int = 0,
        timeout_s: float = 60.0,
        device: int | None = None,
        store_host: str | None = None,
        store_port: int | None = None,
        devices: tuple[int, ...] | list[int] | None = None,
        store_token: str = "",
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        require(isinstance(size, int) and size >= 1, "size", size, "must be an int >= 1")
        require(isinstance(rank, int) and 0 <= rank < size, "rank", rank, f"must be in [0, {size})")
        require(
            isinstance(nccl_id, (bytes, bytearray)) and len(nccl_id) == 128,
            "nccl_id",
            f"<{len(nccl_id)} bytes>" if isinstance(nccl_id, (bytes, bytearray)) else nccl_id,
            "must be the 128 bytes of an NCCL unique id",
        )
        require(timeout_s > 0, "timeout_s", timeout_s, "must be > 0 seconds")
        if not torch.cuda.is_available():
            raise TransferError("the nccl backend needs a CUDA device; torch sees none")
        _libnccl.library()
        self.group_id = group_id
        self.rank = rank
        self.size = size
        self.epoch = epoch
        require(
            devices is None or len(devices) == size,
            "devices",
            devices,
            f"must list one device per rank ({size})",
        )
        self.devices = tuple(devices) if devices is not None else None
        self.timeout_s = float(timeout_s)
        # A worker sees one GPU: cuda:0 (module docstring).
        self.device = torch.device("cuda", 0 if device is None else device)
        self._lock = threading.Lock()  # one caller enqueues at a time
        self._aborted = False
        self._destroyed = False
        self._seq = 0
        self._kv = None
        self._loop = loop
        self._pending: deque[_Pending] = deque()
        self._pending_lock = threading.Lock()
        self._polling = False
        self._failure: _Failure | BaseException | None = None
        if store_host is not None and store_port is not None:
            from torch.distributed import PrefixStore, TCPStore

            store = TCPStore(
                store_host,
                store_port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
            self._kv = PrefixStore(f"nereus/{store_token}/{group_id}/{epoch}", store)
            self._kv.multi_set([f"c/{rank}", f"joined/{rank}"], ["0", "1"])
        t0 = time.monotonic()
        try:
            with torch.cuda.device(self.device):
                # NCCL's own rendezvous on the unique id, with a deadline (non-blocking).
                self._comm = _libnccl.Comm(size, bytes(nccl_id), rank, t0 + self.timeout_s)
        except _libnccl.Timeout:
            missing = self._never_joined()
            seconds = time.monotonic() - t0
            if missing:
                _tap.emit(
                    "stuck_collective",
                    group=group_id,
                    op="create",
                    missing_ranks=missing,
                    seconds=seconds,
                    rank=rank,
                    epoch=epoch,
                )
                raise StuckCollective(group_id, "create", missing, seconds) from None
            raise TransferError(
                f"group {group_id!r} rank {rank}: NCCL could not form the "
                f"group within {self.timeout_s} s"
            ) from None
        # The communication stream: NCCL's kernels never queue behind the caller's work
        # (nor the caller's behind them) except where an event orders them.
        self.stream = torch.cuda.Stream(device=self.device)

    def _never_joined(self) -> list[int]:
        if self._kv is None:
            return []
        try:
            return [r for r in range(self.size) if not self._kv.check([f"joined/{r}"])]
        except RuntimeError as e:
            log.error("group %s: cannot read who joined: %s", self.group_id, e)
            return []

    # ---------------------------------------------------------------- deadlines

    def _track(self, pending: _Pending) -> None:
        with self._pending_lock:
            self._pending.append(pending)
            arm = not self._polling and self._loop is not None and not self._loop.is_closed()
            if arm:
                self._polling = True
        if arm:
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._poll, _POLL_MIN_S)
            except RuntimeError:  # the loop closed meanwhile: later calls check instead
                with self._pending_lock:
                    self._polling = False

    def _poll(self, interval: float) -> None:
        """On the event loop: look at the pending operations, then again later while
        any is left (no thread, no blocking call)."""
        self._reap(time.monotonic())
        with self._pending_lock:
            if not self._pending or self._failure is not None or self._destroyed:
                self._polling = False
                return
        self._loop.call_later(interval, self._poll, min(interval * 2, _POLL_MAX_S))  # type: ignore[union-attr]

    def _reap(self, now: float) -> None:
        """Forget operations that completed; record a failure for one past its deadline
        or an NCCL error, and abort (never blocks)."""
        with self._pending_lock:
            try:
                # one stream: operations complete in the order they were enqueued
                while self._pending and self._pending[0].done.query():
                    self._pending.popleft()
            except RuntimeError as e:  # a CUDA error: the next call raises it
                if self._failure is None:
                    self._failure = TransferError(
                        f"group {self.group_id!r}: CUDA error while "
                        f"NCCL operations were pending: {e}"
                    )
                self._pending.clear()
                return
            if not self._pending or self._failure is not None or self._aborted:
                return
            late = next((p for p in self._pending if now >= p.deadline), None)
            head = self._pending[0]
        code = self._comm.async_error()
        if code not in (_libnccl.SUCCESS, _libnccl.IN_PROGRESS):
            self._fail(
                _Failure(
                    head.op,
                    head.seq,
                    now - head.t0,
                    f"NCCL error {code} ({self._comm.error_text(code)})",
                )
            )
        elif late is not None:
            self._fail(_Failure(late.op, late.seq, now - late.t0))

    def _fail(self, failure: _Failure) -> None:
        with self._pending_lock:
            if self._failure is not None:
                return
            self._failure = failure
        log.error(
            "group %s rank %d: %s %s after %.2f s; aborting",
            self.group_id,
            self.rank,
            failure.op,
            failure.nccl_error or "not done by its deadline",
            failure.seconds,
        )
        # A caller inside an NCCL call holds the lock and aborts itself when it sees the
        # failure (right after that call); never free the handle under it.
        if self._lock.acquire(blocking=False):
            try:
                self.abort()
            finally:
                self._lock.release()

    def _raise_failure(self) -> None:
        failure = self._failure
        if failure is None:
            return
        if isinstance(failure, BaseException):
            raise failure
        self.abort()
        missing = self._missing(failure.seq) if not failure.nccl_error else []
        error: BaseException
        if missing:
            _tap.emit(
                "stuck_collective",
                group=self.group_id,
                op=failure.op,
                missing_ranks=missing,
                seconds=failure.seconds,
                rank=self.rank,
                epoch=self.epoch,
            )
            error = StuckCollective(self.group_id, failure.op, missing, failure.seconds)
        else:
            why = failure.nccl_error or (
                "did not complete (no store records: ranks unknown, or a peer died)"
            )
            error = TransferError(
                f"group {self.group_id!r} rank {self.rank}: {failure.op} "
                f"{why} in {failure.seconds:.2f} s"
            )
        # Raised once; later calls find the group aborted (the Communicator contract).
        self._failure = TransferError(
            f"group {self.group_id!r}: the group was aborted after {failure.op} failed"
        )
        raise error

    def _missing(self, seq: int) -> list[int]:
        if self._kv is None:
            return []
        vals = self._kv.multi_get([f"c/{r}" for r in range(self.size)])
        return [r for r, v in enumerate(vals) if int(v) < seq]

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait on the host until every operation enqueued so far is done (each within
        its own deadline, and within ``timeout_s`` when given); raises what a failed
        operation raises (``StuckCollective``, ``TransferError``)."""
        cap = None if timeout_s is None else time.monotonic() + float(timeout_s)
        pause = 1e-4
        while True:
            now = time.monotonic()
            self._reap(now)
            self._raise_failure()
            with self._pending_lock:
                if not self._pending:
                    return
                head = self._pending[0]
            if self._aborted:  # aborted from outside: what is pending may never end
                raise TransferError(
                    f"group {self.group_id!r}: the group was aborted with {head.op} pending"
                )
            if cap is not None and now >= cap:
                self._fail(_Failure(head.op, head.seq, now - head.t0))
                continue
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    # ---------------------------------------------------------------- plumbing

    def _check(self, *tensors: torch.Tensor) -> None:
        if self._destroyed:
            raise TransferError(f"group {self.group_id!r}: used after destroy()")
        self._reap(time.monotonic())
        self._raise_failure()
        if self._aborted or self._comm.aborted:
            raise TransferError(f"group {self.group_id!r}: the group was aborted")
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise TransferError(f"group {self.group_id!r} works on {self.device}; got {where}")

    def _launch(
        self,
        op: str,
        timeout_s: float | None,
        enqueue: Callable[[int, float], None],
        touched: Sequence[torch.Tensor],
        *,
        group: bool = False,
        after: Any = None,
        join_caller: bool = True,
    ) -> Any:
        """Enqueue ``op`` (``enqueue(stream, deadline)``) on the communication stream
        after ``after`` (default: the caller's current stream as it is now); returns the
        event recorded after it. ``join_caller``: the caller's stream waits for that."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        require(timeout > 0, "timeout_s", timeout_s, "must be > 0 seconds")
        t0 = time.monotonic()
        deadline = t0 + timeout
        self._seq += 1
        seq = self._seq
        if self._kv is not None:
            self._kv.set(f"c/{self.rank}", str(seq))
        caller = torch.cuda.current_stream(self.device)
        if after is None:
            after = torch.cuda.Event()
            after.record(caller)
        self.stream.wait_event(after)
        try:
            with torch.cuda.device(self.device):
                if group:
                    with _libnccl.group(self._comm, deadline):
                        enqueue(self.stream.cuda_stream, deadline)
                else:
                    enqueue(self.stream.cuda_stream, deadline)
        except _libnccl.Timeout:  # NCCL did not even accept it in time (aborted already)
            self._aborted = True
            self._failure = _Failure(op, seq, time.monotonic() - t0)
            self._raise_failure()
        except TransferError:
            self._aborted = True  # NCCL refused the call; the communicator is gone
            raise
        done = torch.cuda.Event(enable_timing=True)  # bucketed transfers time rounds by it
        done.record(self.stream)
        for t in touched:
            if t.numel():
                t.record_stream(self.stream)
        if join_caller:
            caller.wait_event(done)
        self._track(_Pending(op, seq, done, t0, deadline))
        if self._failure is not None:  # the loop saw a failure while we held the lock
            self._raise_failure()
        return done

    @staticmethod
    def _contig(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()

    @staticmethod
    def _reduce(op: str, dtype: torch.dtype) -> int:
        ops = _libnccl.OPS
        if op == "avg" and not dtype.is_floating_point:
            raise ConfigError(f"op='avg' needs a floating dtype; the tensor is {dtype}")
        if dtype == torch.bool:
            return ops["min"] if op == "min" else ops["max"]
        if op not in ("sum", "avg", "max", "min"):
            raise ConfigError(f"op={op!r} must be one of ['avg', 'max', 'min', 'sum']")
        return ops["sum"] if op == "avg" else ops[op]  # avg: sum, then divide

    # ---------------------------------------------------------------- operations

    def _p2p(
        self,
        ops: Sequence[P2POp],
        new: Sequence[tuple[int, int]],
        timeout_s: float | None,
        after: Any,
        join_caller: bool,
    ) -> tuple[list[torch.Tensor], Any, list[tuple[P2POp, torch.Tensor]]]:
        for o in ops:
            if o.kind not in ("send", "recv"):
                raise ConfigError(f"P2POp.kind={o.kind!r} must be 'send' or 'recv'")
        peers = [o.peer for o in ops] + [p for p, _ in new]
        for peer in peers:
            if not (isinstance(peer, int) and 0 <= peer < self.size and peer != self.rank):
                raise ConfigError(f"P2POp.peer={peer!r} must be another rank in [0, {self.size})")
        with self._lock:
            self._check(*(o.tensor for o in ops))
            fresh = [torch.empty(n, dtype=torch.uint8, device=self.device) for _, n in new]
            staged = [(o, self._contig(o.tensor)) for o in ops]
            staged += [(P2POp("recv", t, p), t) for (p, _), t in zip(new, fresh, strict=True)]
            if not staged:
                return fresh, None, []
            comm = self._comm
            u8 = _libnccl.UINT8

            def enqueue(stream: int, deadline: float) -> None:
                for o, buf in staged:
                    data = _as_bytes(buf)
                    name = "ncclSend" if o.kind == "send" else "ncclRecv"
                    comm.call(
                        name,
                        data.data_ptr(),
                        data.numel(),
                        u8,
                        o.peer,
                        comm.handle,
                        stream,
                        deadline=deadline,
                    )

            done = self._launch(
                "batch_p2p",
                timeout_s,
                enqueue,
                [b for _, b in staged],
                group=True,
                after=after,
                join_caller=join_caller,
            )
        return fresh, done, staged

    def batch_p2p(self, ops: Sequence[P2POp], timeout_s: float | None = None) -> None:
        _, _, staged = self._p2p(ops, (), timeout_s, None, True)
        for o, buf in staged:
            if o.kind == "recv" and buf is not o.tensor:
                o.tensor.copy_(buf)  # on the caller's stream, after it waited for NCCL

    def batch_p2p_new(
        self, ops: Sequence[P2POp], new: Sequence[tuple[int, int]], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        fresh, _, staged = self._p2p(ops, new, timeout_s, None, True)
        for o, buf in staged:
            if o.kind == "recv" and buf is not o.tensor:
                o.tensor.copy_(buf)
        return fresh

    def enqueue_p2p(
        self,
        ops: Sequence[P2POp],
        new: Sequence[tuple[int, int]],
        after: Any,
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], Any]:
        """``batch_p2p_new`` on the communication stream after event ``after`` (None: the
        caller's current stream as it is now), without making the caller's stream wait:
        returns the fresh receive buffers and the event marking the end (None when there
        was nothing to do). Every tensor must be contiguous (no staging copies here)."""
        bad = [o.peer for o in ops if not o.tensor.is_contiguous()]
        require(not bad, "enqueue_p2p.ops", bad, "must hold contiguous tensors only")
        fresh, done, _ = self._p2p(ops, new, timeout_s, after, False)
        return fresh, done

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        require(
            isinstance(src, int) and 0 <= src < self.size,
            "src",
            src,
            f"must be a rank in [0, {self.size})",
        )
        with self._lock:
            self._check(tensor)
            buf = self._contig(tensor)
            data, count, code = _elements(buf)
            comm = self._comm
            self._launch(
                "broadcast",
                timeout_s,
                lambda s, d: comm.call(
                    "ncclBroadcast",
                    data.data_ptr(),
                    data.data_ptr(),
                    count,
                    code,
                    src,
                    comm.handle,
                    s,
                    deadline=d,
                ),
                [buf],
            )
            if buf is not tensor and self.rank != src:
                tensor.copy_(buf)

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", timeout_s: float | None = None
    ) -> None:
        code = self._reduce(op, tensor.dtype)
        with self._lock:
            self._check(tensor)
            buf = self._contig(tensor)
            flat = buf.reshape(-1).view(torch.uint8) if buf.dtype == torch.bool else buf.reshape(-1)
            dt = _dtype_code(buf.dtype)
            comm = self._comm
            self._launch(
                "all_reduce",
                timeout_s,
                lambda s, d: comm.call(
                    "ncclAllReduce",
                    flat.data_ptr(),
                    flat.data_ptr(),
                    flat.numel(),
                    dt,
                    code,
                    comm.handle,
                    s,
                    deadline=d,
                ),
                [buf],
            )
            if op == "avg":
                buf.div_(self.size)
            if buf is not tensor:
                tensor.copy_(buf)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        with self._lock:
            self._check(output, input)
            self._check_all_gather_sizes(output, input)
            src, count, code = _elements(self._contig(input))
            out = self._contig(output)
            dst = _elements(out)[0]
            comm = self._comm
            self._launch(
                "all_gather",
                timeout_s,
                lambda s, d: comm.call(
                    "ncclAllGather",
                    src.data_ptr(),
                    dst.data_ptr(),
                    count,
                    code,
                    comm.handle,
                    s,
                    deadline=d,
                ),
                [src, out],
            )
            if out is not output:
                output.copy_(out)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = "sum",
        timeout_s: float | None = None,
    ) -> None:
        code = self._reduce(op, input.dtype)
        with self._lock:
            self._check(output, input)
            self._check_reduce_scatter_sizes(output, input)
            src = self._contig(input)
            out = self._contig(output)
            fsrc, fout = (
                (src.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8))
                if src.dtype == torch.bool
                else (src.reshape(-1), out.reshape(-1))
            )
            dt = _dtype_code(src.dtype)
            comm = self._comm
            self._launch(
                "reduce_scatter",
                timeout_s,
                lambda s, d: comm.call(
                    "ncclReduceScatter",
                    fsrc.data_ptr(),
                    fout.data_ptr(),
                    fout.numel(),
                    dt,
                    code,
                    comm.handle,
                    s,
                    deadline=d,
                ),
                [src, out],
            )
            if op == "avg":
                out.div_(self.size)
            if out is not output:
                output.copy_(out)

    def barrier(self, timeout_s: float | None = None) -> None:
        # NCCL has no barrier: a one-element all-reduce is the usual stand-in, waited for
        # on the host (a barrier is for the host).
        with self._lock:
            self._check()
            one = torch.zeros(1, dtype=torch.float32, device=self.device)
            comm = self._comm
            self._launch(
                "barrier",
                timeout_s,
                lambda s, d: comm.call(
                    "ncclAllReduce",
                    one.data_ptr(),
                    one.data_ptr(),
                    1,
                    _libnccl.FLOAT32,
                    _libnccl.OPS["sum"],
                    comm.handle,
                    s,
                    deadline=d,
                ),
                [one],
            )
        self.synchronize()

    # ---------------------------------------------------------------- teardown

    def abort(self) -> None:
        if self._aborted or self._destroyed:
            return
        self._aborted = True
        self._comm.abort()  # frees kernels stuck waiting for peers

    def destroy(self) -> None:
        if self._destroyed:
            return
        if not self._aborted:
            try:
                self.synchronize()  # what is in flight finishes (or fails) first
            except (TransferError, StuckCollective) as e:  # aborted: nothing to flush
                log.warning(
                    "group %s rank %d: destroyed after a failed operation: %s",
                    self.group_id,
                    self.rank,
                    e,
                )
        with self._lock:
            if not self._aborted:
                try:
                    self._comm.destroy(time.monotonic() + self.timeout_s)
                except TransferError as e:  # aborted instead: nothing is left to free
                    log.warning("group %s: %s", self.group_id, e)
            self._destroyed = True
            with self._pending_lock:
                self._pending.clear()
            self._kv = None
