"""CpuCommunicator: gloo collectives plus shared-memory p2p between ranks on one host.

One instance is one rank's handle on one group for one layout epoch, built from a group
id, rank, size and the address of a TCPStore served outside the group; nothing here
calls ``torch.distributed.init_process_group`` or touches global state, so any number
of groups over any subsets of processes live side by side. Construction is the
rendezvous (blocking, with a deadline, never a polling loop).

Promises (beyond the Communicator contract):
- collectives are gloo's, with gloo's timeout set to the deadline; any dtype travels;
- ``batch_p2p`` moves same-host pairs through shared memory and other pairs through
  gloo, all progressed together; ``recv_new`` adopts a sender's hand-off segment;
- an operation that outlives its deadline raises ``StuckCollective`` naming the ranks
  that never entered it (and emits ``stuck_collective``); a dead peer raises
  ``PeerDied`` at once, at the latest at the deadline;
- no shared-memory name outlives the rendezvous; ``abort`` and ``destroy`` are
  idempotent.

Refuses: tensors that are not on the CPU, mismatched sizes (``TransferError``);
``avg`` on non-floating dtypes (``ConfigError``). Operations on one communicator are
serialized by a lock; all ranks must issue the group's operations in the same order.

More (how it works): docs/transfer.md.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from nereus.config import require
from nereus.errors import ConfigError, PeerDied, StuckCollective, TransferError
from nereus.transfer import _tap
from nereus.transfer._liveness import dead_peers
from nereus.transfer._shm import RecvNew, ShmP2P, ShmPeerExited, ShmTimeout, shm_name_prefix
from nereus.transfer.communicator import Communicator, P2POp, ReduceOp

__all__ = ["CpuCommunicator", "host_key", "DEFAULT_SLOT_BYTES", "DEFAULT_SLOTS"]

log = logging.getLogger("nereus.transfer")

# A ring of 4 x 16 MiB per directed same-host pair: pages are touched only when used,
# so a group costs at most 64 MiB of /dev/shm per pair that actually exchanges data.
DEFAULT_SLOT_BYTES = 16 * 2**20
DEFAULT_SLOTS = 4
# Extra time granted to gloo to report its own timeout before the watchdog fires.
_GRACE_S = 1.0

_REDUCE = {
    "sum": c10d.ReduceOp.SUM,
    "max": c10d.ReduceOp.MAX,
    "min": c10d.ReduceOp.MIN,
    "avg": c10d.ReduceOp.SUM,
}


def host_key() -> str:
    """What makes two processes 'on the same host' (shared /dev/shm): name + boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, bool and bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8)


class CpuCommunicator(Communicator):
    """gloo + shared-memory communicator for CPU tensors (see the module docstring)."""

    backend = "gloo"

    def __init__(
        self,
        group_id: str,
        rank: int,
        size: int,
        store_host: str,
        store_port: int,
        *,
        epoch: int = 0,
        timeout_s: float = 60.0,
        use_shm: bool = True,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        slots: int = DEFAULT_SLOTS,
        devices: tuple[int, ...] | list[int] | None = None,
        store_token: str = "",
    ) -> None:
        require(
            isinstance(group_id, str) and group_id != "" and "/" not in group_id,
            "group_id",
            group_id,
            "must be a non-empty string without '/'",
        )
        require(isinstance(size, int) and size >= 1, "size", size, "must be an int >= 1")
        require(isinstance(rank, int) and 0 <= rank < size, "rank", rank, f"must be in [0, {size})")
        require(
            isinstance(store_port, int) and 0 < store_port < 65536,
            "store_port",
            store_port,
            "must be a TCP port in 1..65535",
        )
        require(isinstance(epoch, int) and epoch >= 0, "epoch", epoch, "must be an int >= 0")
        require(timeout_s > 0, "timeout_s", timeout_s, "must be > 0 seconds")
        require(
            isinstance(store_token, str) and "/" not in store_token,
            "store_token",
            store_token,
            "must be a string without '/'",
        )
        require(
            isinstance(slot_bytes, int) and slot_bytes >= 4096,
            "slot_bytes",
            slot_bytes,
            "must be an int >= 4096",
        )
        require(isinstance(slots, int) and slots >= 2, "slots", slots, "must be an int >= 2")
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
        self._lock = threading.Lock()
        self._pending: set[threading.Event] = set()
        self._pending_lock = threading.Lock()
        self._orphans: list[Any] = []  # gloo work abandoned at abort: keeps its tensors alive
        self._aborted = False
        self._destroyed = False
        self._seq = 0  # collectives entered
        self._p2p_seq: dict[int, int] = {}  # batches entered with each peer
        self._shm: ShmP2P | None = None
        self._pg: ProcessGroupGloo | None = None
        self.local_pids: dict[int, int] = {}  # same-host peers with shared memory: rank -> pid
        self._host_pids: dict[int, int] = {}  # every same-host peer: rank -> pid
        self.eager_bytes = 0
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self._store = TCPStore(
                store_host, store_port, is_master=False, timeout=timeout, wait_for_workers=False
            )
        except (RuntimeError, OSError) as e:
            raise TransferError(
                f"group {group_id!r} rank {rank}: cannot reach the store at "
                f"{store_host}:{store_port}: {e}"
            ) from e
        self._kv = PrefixStore(f"nereus/{store_token}/{group_id}/{epoch}", self._store)
        try:
            self._rendezvous(store_host, store_port, use_shm, slot_bytes, slots, timeout)
        except BaseException:
            self._release()
            raise

    # ---------------------------------------------------------------- set-up

    def _rendezvous(
        self,
        store_host: str,
        store_port: int,
        use_shm: bool,
        slot_bytes: int,
        slots: int,
        timeout: datetime.timedelta,
    ) -> None:
        me = f"{host_key()}|{os.getpid()}"
        # Watchdog entries start at 0 so a stuck caller can always read them.
        others = [p for p in range(self.size) if p != self.rank]
        self._kv.multi_set(
            [f"c/{self.rank}"] + [f"p/{self.rank}/{p}" for p in others], ["0"] * (1 + len(others))
        )
        self._kv.set(f"host/{self.rank}", me)
        keys = [f"host/{r}" for r in range(self.size)]
        try:
            self._kv.wait(keys, timeout)
        except RuntimeError:
            missing = [r for r in range(self.size) if not self._kv.check([f"host/{r}"])]
            raise StuckCollective(self.group_id, "create", missing, self.timeout_s) from None
        hosts = [v.decode().rsplit("|", 1) for v in self._kv.multi_get(keys)]
        mine = hosts[self.rank][0]
        self.local_peers = [r for r, (h, _) in enumerate(hosts) if h == mine and r != self.rank]
        self._host_pids = {r: int(hosts[r][1]) for r in self.local_peers}
        if use_shm and self.local_peers:
            prefix = shm_name_prefix(store_port, store_host, self.group_id, self.epoch)
            peers = {r: int(hosts[r][1]) for r in self.local_peers}
            self._shm = ShmP2P(prefix, self.rank, peers, slot_bytes, slots)
            self.local_pids = peers
            self.eager_bytes = slot_bytes
        try:
            self._pg = ProcessGroupGloo(
                PrefixStore("gloo", self._kv), self.rank, self.size, timeout
            )
        except RuntimeError as e:
            raise TransferError(
                f"group {self.group_id!r} rank {self.rank}: gloo rendezvous failed: {e}"
            ) from e
        finally:
            # Every rank opened its channels before joining gloo's mesh, so once the mesh
            # is up (or has failed) the names are no longer needed.
            if self._shm is not None:
                self._shm.unlink_names()

    # ---------------------------------------------------------------- plumbing

    def _check(self, *tensors: torch.Tensor) -> None:
        if self._destroyed:
            raise TransferError(f"group {self.group_id!r}: used after destroy()")
        if self._aborted:
            raise TransferError(f"group {self.group_id!r}: the group was aborted")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TransferError(f"expected a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise TransferError(
                    f"group {self.group_id!r} is a CPU group; tensor is on {t.device}"
                )

    def _deadline(self, timeout_s: float | None) -> float:
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        require(t > 0, "timeout_s", timeout_s, "must be > 0 seconds")
        return t

    def _wait_work(
        self,
        work: Any,
        op: str,
        timeout: float,
        missing: Callable[[], list[int] | None],
        peers: list[int] | None = None,
    ) -> None:
        """Wait for gloo ``work`` until ``timeout`` (+grace); classify any failure
        (``peers``: the ranks the work involves, None for all)."""
        t0 = time.monotonic()
        try:
            fut = work.get_future()
        except RuntimeError:
            # gloo's send, recv and reduce_scatter work has no future: a bounded blocking
            # wait (gloo honours the timeout), which abort() cannot cut short.
            try:
                work.wait(datetime.timedelta(seconds=max(timeout, 1e-3)))
            except RuntimeError as e:
                if self._aborted:
                    raise TransferError(f"group {self.group_id!r}: {op} aborted") from e
                self._orphans.append(work)
                self._fail(op, time.monotonic() - t0, missing(), str(e).splitlines()[0], peers)
            return
        ev = threading.Event()
        fut.add_done_callback(lambda _f: ev.set())
        with self._pending_lock:
            self._pending.add(ev)
        try:
            ev.wait(timeout + _GRACE_S)
        finally:
            with self._pending_lock:
                self._pending.discard(ev)
        if not fut.done():
            self._orphans.append(work)
            if self._aborted:
                raise TransferError(f"group {self.group_id!r}: {op} aborted")
            self._fail(op, time.monotonic() - t0, missing(), "no answer from gloo", peers)
        try:
            work.wait()
        except RuntimeError as e:
            if self._aborted:
                raise TransferError(f"group {self.group_id!r}: {op} aborted") from e
            self._fail(op, time.monotonic() - t0, missing(), str(e).splitlines()[0], peers)

    def _fail(
        self,
        op: str,
        seconds: float,
        missing: list[int] | None,
        cause: str,
        peers: list[int] | None = None,
    ) -> None:
        """Abort the group and raise StuckCollective (ranks missing), PeerDied (ranks
        that died in it; ``peers``: the ranks it involved, None for all) or
        TransferError."""
        self.abort()
        if missing:
            log.error(
                "group %s rank %d: %s stuck %.2f s; missing ranks %s (%s)",
                self.group_id,
                self.rank,
                op,
                seconds,
                missing,
                cause,
            )
            _tap.emit(
                "stuck_collective",
                group=self.group_id,
                op=op,
                missing_ranks=missing,
                seconds=seconds,
                rank=self.rank,
                epoch=self.epoch,
            )
            raise StuckCollective(self.group_id, op, missing, seconds)
        self._raise_dead(op, seconds, peers, cause)

    def _raise_dead(self, op: str, seconds: float, peers: list[int] | None, cause: str) -> None:
        """Every rank entered ``op`` and it failed: name the peers that died in it."""
        candidates = [p for p in range(self.size) if p != self.rank] if peers is None else peers
        dead, silent = (
            ([], [])
            if self._kv is None
            else dead_peers(self._kv, self.rank, candidates, self._host_pids)
        )
        if dead or silent:
            err = PeerDied(self.group_id, op, dead, silent, self.devices, seconds)
            log.error("group %s rank %d: %s", self.group_id, self.rank, err)
            _tap.emit(
                "peer_died",
                group=self.group_id,
                op=op,
                dead_ranks=dead,
                silent_ranks=silent,
                rank=self.rank,
                epoch=self.epoch,
                seconds=seconds,
            )
            raise err
        raise TransferError(
            f"group {self.group_id!r} rank {self.rank}: {op} failed after {seconds:.2f} s "
            f"with every rank entered and alive (a peer aborted mid-operation): {cause}"
        )

    def _missing_collective(self, seq: int) -> list[int] | None:
        try:
            vals = self._kv.multi_get([f"c/{r}" for r in range(self.size)])
        except RuntimeError as e:
            log.error("group %s: cannot read watchdog entries: %s", self.group_id, e)
            return None
        return [r for r, v in enumerate(vals) if int(v) < seq]

    def _collective(
        self, op: str, timeout_s: float | None, issue: Callable[[datetime.timedelta], Any]
    ) -> None:
        timeout = self._deadline(timeout_s)
        self._seq += 1
        seq = self._seq
        self._kv.set(f"c/{self.rank}", str(seq))
        assert self._pg is not None
        try:
            work = issue(datetime.timedelta(seconds=timeout))
        except RuntimeError as e:  # gloo refused the arguments: the peers would wait on us
            self.abort()
            raise TransferError(
                f"group {self.group_id!r} rank {self.rank}: {op} refused by "
                f"gloo: {str(e).splitlines()[0]}"
            ) from e
        self._wait_work(work, op, timeout, lambda: self._missing_collective(seq))

    # ---------------------------------------------------------------- collectives

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        require(
            isinstance(src, int) and 0 <= src < self.size,
            "src",
            src,
            f"must be a rank in [0, {self.size})",
        )
        with self._lock:
            self._check(tensor)
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()

            def issue(td: datetime.timedelta) -> Any:
                opts = c10d.BroadcastOptions()
                opts.rootRank, opts.rootTensor, opts.timeout = src, 0, td
                return self._pg.broadcast([_as_bytes(buf)], opts)

            self._collective("broadcast", timeout_s, issue)
            if buf is not tensor and self.rank != src:
                tensor.copy_(buf)

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", timeout_s: float | None = None
    ) -> None:
        self._check_op(op, tensor.dtype)
        with self._lock:
            self._check(tensor)
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()

            def issue(td: datetime.timedelta) -> Any:
                opts = c10d.AllreduceOptions()
                opts.reduceOp, opts.timeout = _REDUCE[op], td
                return self._pg.allreduce([buf.reshape(-1)], opts)

            self._collective("all_reduce", timeout_s, issue)
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
            src = input if input.is_contiguous() else input.contiguous()
            out = output if output.is_contiguous() else output.contiguous()

            def issue(td: datetime.timedelta) -> Any:
                opts = c10d.AllgatherOptions()
                opts.timeout = td
                return self._pg._allgather_base(_as_bytes(out), _as_bytes(src), opts)

            self._collective("all_gather", timeout_s, issue)
            if out is not output:
                output.copy_(out)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = "sum",
        timeout_s: float | None = None,
    ) -> None:
        self._check_op(op, input.dtype)
        with self._lock:
            self._check(output, input)
            self._check_reduce_scatter_sizes(output, input)
            src = input if input.is_contiguous() else input.contiguous()
            out = output if output.is_contiguous() else output.contiguous()

            def issue(td: datetime.timedelta) -> Any:
                opts = c10d.ReduceScatterOptions()
                opts.reduceOp, opts.timeout = _REDUCE[op], td
                return self._pg._reduce_scatter_base(out.reshape(-1), src.reshape(-1), opts)

            self._collective("reduce_scatter", timeout_s, issue)
            if op == "avg":
                out.div_(self.size)
            if out is not output:
                output.copy_(out)

    def barrier(self, timeout_s: float | None = None) -> None:
        with self._lock:
            self._check()

            def issue(td: datetime.timedelta) -> Any:
                opts = c10d.BarrierOptions()
                opts.timeout = td
                return self._pg.barrier(opts)

            self._collective("barrier", timeout_s, issue)

    @staticmethod
    def _check_op(op: str, dtype: torch.dtype) -> None:
        if op not in _REDUCE:
            raise ConfigError(f"op={op!r} must be one of {sorted(_REDUCE)}")
        if op == "avg" and not dtype.is_floating_point:
            raise ConfigError(f"op='avg' needs a floating dtype; the tensor is {dtype}")

    # ---------------------------------------------------------------- p2p

    def batch_p2p(self, ops: Sequence[P2POp], timeout_s: float | None = None) -> None:
        """Run this rank's sends and receives as one group (see the module docstring).

        Between one ordered pair of ranks, the i-th send of the sender matches the i-th
        receive of the receiver; sizes must agree (else ``TransferError``)."""
        timeout = self._deadline(timeout_s)
        with self._lock:
            self._check(*(o.tensor for o in ops))
            self._validate_ops(ops)
            if not ops:
                return
            self._run_p2p(list(ops), timeout)

    def _validate_ops(self, ops: Sequence[P2POp]) -> None:
        for o in ops:
            if o.kind not in ("send", "recv"):
                raise ConfigError(f"P2POp.kind={o.kind!r} must be 'send' or 'recv'")
            if not (isinstance(o.peer, int) and 0 <= o.peer < self.size and o.peer != self.rank):
                raise ConfigError(f"P2POp.peer={o.peer!r} must be another rank in [0, {self.size})")

    def recv_new(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, timeout_s: float | None = None
    ) -> torch.Tensor:
        """Receive from ``src`` into a fresh tensor. From a same-host peer, a transfer
        larger than one slot is handed off: the tensor IS the sender's copy in shared
        memory (no copy here); its segment returns to the sender's pool once the
        tensor and all its views are freed. Other peers: a plain receive."""
        shape = tuple(int(d) for d in shape)
        if self._shm is None or src not in self._shm.peers:
            return super().recv_new(shape, dtype, src, timeout_s)
        timeout = self._deadline(timeout_s)
        require(
            isinstance(src, int) and 0 <= src < self.size and src != self.rank,
            "src",
            src,
            f"must be another rank in [0, {self.size})",
        )
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        with self._lock:
            self._check()
            want = RecvNew(nbytes)
            self._run_p2p([], timeout, new=[(src, want)])
            assert want.result is not None
            return want.result.view(dtype).view(shape)

    def batch_p2p_new(
        self, ops: Sequence[P2POp], new: Sequence[tuple[int, int]], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        """``batch_p2p`` plus receives into fresh tensors; from same-host peers, those
        larger than one slot are hand-offs (see ``recv_new``)."""
        shm_peers = set(self._shm.peers) if self._shm is not None else set()
        if any(p not in shm_peers for p, _ in new):
            return super().batch_p2p_new(ops, new, timeout_s)
        timeout = self._deadline(timeout_s)
        with self._lock:
            self._check(*(o.tensor for o in ops))
            self._validate_ops(ops)
            for p, n in new:
                require(isinstance(n, int) and n >= 0, "bytes", n, "must be an int >= 0")
                require(
                    isinstance(p, int) and 0 <= p < self.size and p != self.rank,
                    "peer",
                    p,
                    f"must be another rank in [0, {self.size})",
                )
            wants = [(p, RecvNew(n)) for p, n in new]
            if ops or wants:
                self._run_p2p(list(ops), timeout, new=wants)
            return [w.result for _, w in wants]

    def _run_p2p(
        self, ops: list[P2POp], timeout: float, new: list[tuple[int, RecvNew]] = ()
    ) -> None:
        peers = sorted({o.peer for o in ops} | {p for p, _ in new})
        for p in peers:
            self._p2p_seq[p] = self._p2p_seq.get(p, 0) + 1
        self._kv.multi_set(
            [f"p/{self.rank}/{p}" for p in peers], [str(self._p2p_seq[p]) for p in peers]
        )
        shm_peers = set(self._shm.peers) if self._shm is not None else set()
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (user tensor, contiguous buf)
        shm_sends, shm_recvs, gloo = [], list(new), []
        for o in ops:
            buf = o.tensor if o.tensor.is_contiguous() else o.tensor.contiguous()
            if o.kind == "recv" and buf is not o.tensor:
                staged.append((o.tensor, buf))
            data = _as_bytes(buf)
            if o.peer in shm_peers:
                (shm_sends if o.kind == "send" else shm_recvs).append((o.peer, data))
            else:
                gloo.append((o.kind, o.peer, data))
        t0 = time.monotonic()
        deadline = t0 + timeout
        works = self._post_gloo_p2p(gloo, deadline)
        if shm_sends or shm_recvs:
            assert self._shm is not None
            try:
                self._shm.run(shm_sends, shm_recvs, deadline)
            except ShmTimeout as e:
                self._orphans.extend(w for _, w in works)
                self._fail(
                    "batch_p2p",
                    time.monotonic() - t0,
                    self._missing_p2p(e.peers),
                    f"transfers with ranks {e.peers} still pending",
                    list(e.peers),
                )
            except ShmPeerExited as e:
                self._orphans.extend(w for _, w in works)
                self.abort()
                raise PeerDied(
                    self.group_id, "batch_p2p", [e.peer], [], self.devices, time.monotonic() - t0
                ) from None
            except TransferError:
                self._orphans.extend(w for _, w in works)
                self.abort()
                raise
        for i, (peer, work) in enumerate(works):
            left = max(deadline - time.monotonic(), 0.0)
            try:
                self._wait_work(
                    work, "batch_p2p", left, lambda p=peer: self._missing_p2p([p]), [peer]
                )
            except BaseException:
                self._orphans.extend(w for _, w in works[i + 1 :])
                raise
        for tensor, buf in staged:
            tensor.copy_(buf)

    def _post_gloo_p2p(
        self, ops: list[tuple[str, int, torch.Tensor]], deadline: float
    ) -> list[tuple[int, Any]]:
        """Post gloo sends and receives; returns the work still to wait for.

        gloo lets a short message land in a longer buffer without a word, so every
        transfer is preceded by a size header; receives of data are posted only once
        their header has arrived and matched."""
        works: list[tuple[int, Any]] = []
        pending_recvs = []
        count: dict[tuple[str, int], int] = {}
        for kind, peer, data in ops:
            i = count.get((kind, peer), 0)
            count[(kind, peer)] = i + 1
            if kind == "send":
                works.append((peer, self._pg.send([torch.tensor([data.numel()])], peer, 2 * i)))
                if data.numel():
                    works.append((peer, self._pg.send([data], peer, 2 * i + 1)))
            else:
                header = torch.tensor([-1], dtype=torch.int64)
                pending_recvs.append((peer, data, header, i, self._pg.recv([header], peer, 2 * i)))
        for n, (peer, data, header, i, work) in enumerate(pending_recvs):
            try:
                self._wait_work(
                    work,
                    "batch_p2p",
                    max(deadline - time.monotonic(), 0.0),
                    lambda p=peer: self._missing_p2p([p]),
                    [peer],
                )
            except BaseException:
                self._orphans.extend([w for _, w in works] + [r[4] for r in pending_recvs[n:]])
                raise
            if int(header[0]) != data.numel():
                self._orphans.extend(w for _, w in works)
                self.abort()
                raise TransferError(
                    f"rank {self.rank} expected {data.numel()} bytes from rank {peer} "
                    f"but the sender's tensor has {int(header[0])} bytes"
                )
            if data.numel():
                works.append((peer, self._pg.recv([data], peer, 2 * i + 1)))
        return works

    def _missing_p2p(self, peers: list[int]) -> list[int] | None:
        try:
            vals = self._kv.multi_get([f"p/{p}/{self.rank}" for p in peers])
        except RuntimeError as e:
            log.error("group %s: cannot read watchdog entries: %s", self.group_id, e)
            return None
        return [p for p, v in zip(peers, vals, strict=True) if int(v) < self._p2p_seq[p]]

    # ---------------------------------------------------------------- teardown

    def abort(self) -> None:
        self._aborted = True
        if self._shm is not None:
            self._shm.abort()
        with self._pending_lock:
            for ev in self._pending:
                ev.set()

    def destroy(self) -> None:
        if self._destroyed:
            return
        self.abort()
        with self._lock:
            self._destroyed = True
            self._release()

    def _release(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._pg = None
        self._orphans.clear()
        self._kv = None
        self._store = None

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else "aborted" if self._aborted else "ready"
        return (
            f"CpuCommunicator(group={self.group_id!r}, rank={self.rank}/{self.size}, "
            f"epoch={self.epoch}, shm_peers={self.local_peers if self._shm else []}, {state})"
        )
