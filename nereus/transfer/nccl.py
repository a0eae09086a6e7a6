"""NcclCommunicator: NCCL (through ``_libnccl``, ctypes) on torch CUDA tensors.

Imported only where used (``make_group`` with CUDA devices, GPU tests): importing
nereus never loads libnccl. Built from the group id, rank, size and the NCCL unique id
as 128 raw bytes (made by ``unique_id()`` on one member and sent in msgpack), plus
optionally a TCPStore address used only for the watchdog's records.

Promises (beyond the Communicator contract):
- the device is the worker's one GPU, ``cuda:0``, unless ``device=`` says otherwise;
- deadlines cover everything (creation, enqueueing, group end): a rank that never joins
  or an operation that never completes makes the others raise ``StuckCollective``
  naming it, after ``ncclCommAbort``, and emit a ``stuck_collective`` tap event;
- operations run on torch's current CUDA stream and return once their work completed;
  callers run them from worker threads, never on an event loop thread.

Refuses: tensors not on this communicator's CUDA device, mismatched sizes
(``TransferError``); ``avg`` on non-floating dtypes (``ConfigError``).

More (how it works): docs/transfer.md.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
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


class _Watcher:
    """One thread that waits for CUDA events, so a caller can wait with a deadline."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="nereus-nccl-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            event, done, errors = item
            try:
                event.synchronize()
            except RuntimeError as e:  # a CUDA error: delivered to the waiting caller
                errors.append(e)
            done.set()

    def wait(self, event: Any, timeout: float) -> bool:
        """True once ``event`` completed, False at ``timeout``; raises a CUDA error."""
        done = threading.Event()
        errors: list[BaseException] = []
        self._q.put((event, done, errors))
        finished = done.wait(timeout)
        if errors:
            raise TransferError(f"CUDA error while waiting for an NCCL operation: {errors[0]}")
        return finished

    def stop(self, timeout: float = 5.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)


class NcclCommunicator(Communicator):
    """NCCL communicator for CUDA tensors (see the module docstring)."""

    backend = "nccl"

    def __init__(self, group_id: str, rank: int, size: int, nccl_id: bytes, *,
                 epoch: int = 0, timeout_s: float = 60.0, device: int | None = None,
                 store_host: str | None = None, store_port: int | None = None,
                 devices: tuple[int, ...] | list[int] | None = None,
                 store_token: str = "") -> None:
        require(isinstance(size, int) and size >= 1, "size", size, "must be an int >= 1")
        require(isinstance(rank, int) and 0 <= rank < size, "rank", rank, f"must be in [0, {size})")
        require(isinstance(nccl_id, (bytes, bytearray)) and len(nccl_id) == 128, "nccl_id",
                f"<{len(nccl_id)} bytes>" if isinstance(nccl_id, (bytes, bytearray)) else nccl_id,
                "must be the 128 bytes of an NCCL unique id")
        require(timeout_s > 0, "timeout_s", timeout_s, "must be > 0 seconds")
        if not torch.cuda.is_available():
            raise TransferError("the nccl backend needs a CUDA device; torch sees none")
        _libnccl.library()
        self.group_id = group_id
        self.rank = rank
        self.size = size
        self.epoch = epoch
        require(devices is None or len(devices) == size, "devices", devices,
                f"must list one device per rank ({size})")
        self.devices = tuple(devices) if devices is not None else None
        self.timeout_s = float(timeout_s)
        # A worker sees one GPU: cuda:0 (module docstring).
        self.device = torch.device("cuda", 0 if device is None else device)
        self._lock = threading.Lock()
        self._aborted = False
        self._destroyed = False
        self._seq = 0
        self._kv = None
        if store_host is not None and store_port is not None:
            from torch.distributed import PrefixStore, TCPStore

            store = TCPStore(store_host, store_port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=self.timeout_s))
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
                _tap.emit("stuck_collective", group=group_id, op="create",
                          missing_ranks=missing, seconds=seconds, rank=rank, epoch=epoch)
                raise StuckCollective(group_id, "create", missing, seconds) from None
            raise TransferError(f"group {group_id!r} rank {rank}: NCCL could not form the "
                                f"group within {self.timeout_s} s") from None
        self._watch = _Watcher()

    def _never_joined(self) -> list[int]:
        if self._kv is None:
            return []
        try:
            return [r for r in range(self.size) if not self._kv.check([f"joined/{r}"])]
        except RuntimeError as e:
            log.error("group %s: cannot read who joined: %s", self.group_id, e)
            return []

    # ---------------------------------------------------------------- plumbing

    def _check(self, *tensors: torch.Tensor) -> None:
        if self._destroyed:
            raise TransferError(f"group {self.group_id!r}: used after destroy()")
        if self._aborted or self._comm.aborted:
            raise TransferError(f"group {self.group_id!r}: the group was aborted")
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise TransferError(f"group {self.group_id!r} works on {self.device}; got {where}")

    def _run(self, op: str, timeout_s: float | None,
             enqueue: Callable[[int, float], None], group: bool = False) -> None:
        """Enqueue ``op`` (``enqueue(stream, deadline)``) and wait for it, all within
        one deadline that starts before anything can block."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        require(timeout > 0, "timeout_s", timeout_s, "must be > 0 seconds")
        t0 = time.monotonic()
        deadline = t0 + timeout
        self._seq += 1
        if self._kv is not None:
            self._kv.set(f"c/{self.rank}", str(self._seq))
        stream = torch.cuda.current_stream(self.device)
        try:
            if group:
                with _libnccl.group(self._comm, deadline):
                    enqueue(stream.cuda_stream, deadline)
            else:
                enqueue(stream.cuda_stream, deadline)
        except _libnccl.Timeout:
            self._stuck(op, t0)
        except TransferError:
            self._aborted = True  # NCCL refused the call; the communicator is gone
            raise
        event = torch.cuda.Event()
        event.record(stream)
        if self._watch.wait(event, max(deadline - time.monotonic(), 0.0)):
            return
        self._stuck(op, t0)

    def _stuck(self, op: str, t0: float) -> None:
        """``op`` outlived its deadline: abort, then name the ranks that never entered."""
        seconds = time.monotonic() - t0
        missing = self._missing(self._seq)
        self.abort()
        if missing:
            _tap.emit("stuck_collective", group=self.group_id, op=op, missing_ranks=missing,
                      seconds=seconds, rank=self.rank, epoch=self.epoch)
            raise StuckCollective(self.group_id, op, missing, seconds)
        raise TransferError(f"group {self.group_id!r} rank {self.rank}: {op} did not complete "
                            f"in {seconds:.2f} s (no store records: ranks unknown, or a peer died)")

    def _missing(self, seq: int) -> list[int]:
        if self._kv is None:
            return []
        vals = self._kv.multi_get([f"c/{r}" for r in range(self.size)])
        return [r for r, v in enumerate(vals) if int(v) < seq]

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

    def batch_p2p(self, ops: Sequence[P2POp], timeout_s: float | None = None) -> None:
        with self._lock:
            self._check(*(o.tensor for o in ops))
            for o in ops:
                if o.kind not in ("send", "recv"):
                    raise ConfigError(f"P2POp.kind={o.kind!r} must be 'send' or 'recv'")
                if not (isinstance(o.peer, int) and 0 <= o.peer < self.size and o.peer != self.rank):
                    raise ConfigError(f"P2POp.peer={o.peer!r} must be another rank in "
                                      f"[0, {self.size})")
            if not ops:
                return
            staged = [(o, self._contig(o.tensor)) for o in ops]
            comm = self._comm
            u8 = _libnccl.UINT8

            def enqueue(stream: int, deadline: float) -> None:
                for o, buf in staged:
                    data = _as_bytes(buf)
                    name = "ncclSend" if o.kind == "send" else "ncclRecv"
                    comm.call(name, data.data_ptr(), data.numel(), u8, o.peer, comm.handle,
                              stream, deadline=deadline)

            self._run("batch_p2p", timeout_s, enqueue, group=True)
            for o, buf in staged:
                if o.kind == "recv" and buf is not o.tensor:
                    o.tensor.copy_(buf)

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        require(isinstance(src, int) and 0 <= src < self.size, "src", src,
                f"must be a rank in [0, {self.size})")
        with self._lock:
            self._check(tensor)
            buf = self._contig(tensor)
            data, count, code = _elements(buf)
            comm = self._comm
            self._run("broadcast", timeout_s, lambda s, d: comm.call(
                "ncclBroadcast", data.data_ptr(), data.data_ptr(), count, code, src,
                comm.handle, s, deadline=d))
            if buf is not tensor and self.rank != src:
                tensor.copy_(buf)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum",
                   timeout_s: float | None = None) -> None:
        code = self._reduce(op, tensor.dtype)
        with self._lock:
            self._check(tensor)
            buf = self._contig(tensor)
            flat = buf.reshape(-1).view(torch.uint8) if buf.dtype == torch.bool else buf.reshape(-1)
            dt = _dtype_code(buf.dtype)
            comm = self._comm
            self._run("all_reduce", timeout_s, lambda s, d: comm.call(
                "ncclAllReduce", flat.data_ptr(), flat.data_ptr(), flat.numel(), dt, code,
                comm.handle, s, deadline=d))
            if op == "avg":
                buf.div_(self.size)
            if buf is not tensor:
                tensor.copy_(buf)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   timeout_s: float | None = None) -> None:
        with self._lock:
            self._check(output, input)
            self._check_all_gather_sizes(output, input)
            src, count, code = _elements(self._contig(input))
            out = self._contig(output)
            dst = _elements(out)[0]
            comm = self._comm
            self._run("all_gather", timeout_s, lambda s, d: comm.call(
                "ncclAllGather", src.data_ptr(), dst.data_ptr(), count, code, comm.handle, s,
                deadline=d))
            if out is not output:
                output.copy_(out)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = "sum",
                       timeout_s: float | None = None) -> None:
        code = self._reduce(op, input.dtype)
        with self._lock:
            self._check(output, input)
            self._check_reduce_scatter_sizes(output, input)
            src = self._contig(input)
            out = self._contig(output)
            fsrc, fout = ((src.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8))
                          if src.dtype == torch.bool else (src.reshape(-1), out.reshape(-1)))
            dt = _dtype_code(src.dtype)
            comm = self._comm
            self._run("reduce_scatter", timeout_s, lambda s, d: comm.call(
                "ncclReduceScatter", fsrc.data_ptr(), fout.data_ptr(), fout.numel(), dt, code,
                comm.handle, s, deadline=d))
            if op == "avg":
                out.div_(self.size)
            if out is not output:
                output.copy_(out)

    def barrier(self, timeout_s: float | None = None) -> None:
        # NCCL has no barrier: a one-element all-reduce is the usual stand-in.
        with self._lock:
            self._check()
            one = torch.zeros(1, dtype=torch.float32, device=self.device)
            comm = self._comm
            self._run("barrier", timeout_s, lambda s, d: comm.call(
                "ncclAllReduce", one.data_ptr(), one.data_ptr(), 1, _libnccl.FLOAT32,
                _libnccl.OPS["sum"], comm.handle, s, deadline=d))

    # ---------------------------------------------------------------- teardown

    def abort(self) -> None:
        if self._aborted or self._destroyed:
            return
        self._aborted = True
        self._comm.abort()  # frees kernels stuck waiting for peers

    def destroy(self) -> None:
        if self._destroyed:
            return
        with self._lock:
            if not self._aborted:
                torch.cuda.current_stream(self.device).synchronize()
                try:
                    self._comm.destroy(time.monotonic() + self.timeout_s)
                except TransferError as e:  # aborted instead: nothing is left to free
                    log.warning("group %s: %s", self.group_id, e)
            self._destroyed = True
            self._watch.stop()
            self._kv = None
