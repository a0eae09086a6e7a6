"""Direct transfers: senders copy straight into the receivers' memory, one copy per byte.

``exchange_direct(comm, sends, recvs, local)`` has ``exchange``'s contract (the i-th
view this rank sends to a peer lands in the i-th view that peer receives from this
rank; same byte sizes on both sides) and moves the bytes differently: a receive view
that lives on an arena (``arena_empty``: shared memory of the receiving process)
is written by the sender itself, from its source view (strided on both sides if need
be) into the receiver's memory, through a mapping the sender keeps for reuse. No
bucket, no hand-off segment, no unpack: each moved byte is copied once
(``copy_into``: large contiguous pieces with stores that bypass the cache).

Promises: when ``exchange_direct`` returns, every receive view holds the sender's
bytes and every local pair is copied; a ``transfer_bucket`` tap event per pair and
direction that moved bytes directly (``round`` -1), and the bucketed exchange's own
events for the rest; a ``TransferStats`` summary of both. Errors of the communicator
propagate unchanged (on error, receive views are unspecified). Refuses what
``exchange`` refuses, a view record that points outside its arena or a byte size that
disagrees with the sender's view (``TransferError``).

More (how it works): docs/transfer.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from nereus.errors import TransferError
from nereus.transfer import _arena
from nereus.transfer._copy import copy_pairs, row_blocks_available, source_rows
from nereus.transfer.bucket import TransferStats, check_peers, emit_transfer, exchange
from nereus.transfer.communicator import Communicator, P2POp

__all__ = ["exchange_direct", "arena_empty"]

log = logging.getLogger("nereus.transfer")

arena_empty = _arena.arena_empty

_MAX_DIM = 4
# token, serial, fd, arena bytes, byte offset, itemsize, ndim, shape[4], strides[4], numel
_FIELDS = 7 + 2 * _MAX_DIM + 1
_OFF_ARENA, _EMPTY = -1, -2  # serial values: not on an arena / nothing to move


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(view: torch.Tensor) -> list[int]:
    row = [0] * _FIELDS
    if view.numel() == 0:
        row[1] = _EMPTY
        return row
    ref = _arena.describe(view)
    if ref is None or view.dim() > _MAX_DIM:
        row[1] = _OFF_ARENA
        return row
    row[:7] = [
        ref.token,
        ref.serial,
        ref.fd,
        ref.nbytes,
        ref.offset,
        view.element_size(),
        view.dim(),
    ]
    row[7 : 7 + view.dim()] = list(view.shape)
    row[7 + _MAX_DIM : 7 + _MAX_DIM + view.dim()] = list(view.stride())
    row[-1] = view.numel()
    return row


def _is_contiguous(shape: list[int], stride: list[int]) -> bool:
    expect = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


class _Writer:
    """Sender side: copies views into one peer's arenas."""

    def __init__(self, peer: int, pid: int) -> None:
        self.peer = peer
        self.pid = pid
        self.typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.can_map = True

    def target(self, row: list[int], src: torch.Tensor) -> torch.Tensor | None:
        """The receiver's memory for ``src`` as a tensor, or None (use the fallback)."""
        token, serial, fd, nbytes, offset, itemsize, ndim = row[:7]
        shape = row[7 : 7 + ndim]
        stride = row[7 + _MAX_DIM : 7 + _MAX_DIM + ndim]
        if row[-1] * itemsize != _nbytes(src):
            raise TransferError(
                f"rank {self.peer} receives {row[-1] * itemsize} bytes where this "
                f"rank sends {_nbytes(src)}"
            )
        if itemsize != src.element_size() or not self.can_map:
            return None
        extent = (
            offset + (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * itemsize
        )
        if offset < 0 or offset % itemsize or min(stride, default=0) < 0 or extent > nbytes:
            raise TransferError(
                f"rank {self.peer}'s view record points outside its arena "
                f"(offset {offset}, extent {extent}, arena {nbytes} bytes)"
            )
        if list(src.shape) != shape and not (src.is_contiguous() and _is_contiguous(shape, stride)):
            return None
        key = (serial, src.dtype)
        base = self.typed.get(key)
        if base is None:
            try:
                mapped = _arena.map_peer(_arena.ArenaRef(self.pid, token, serial, fd, nbytes, 0))
            except OSError as e:
                log.warning(
                    "cannot map rank %d's arena (pid %d): %s; using buckets", self.peer, self.pid, e
                )
                self.can_map = False
                return None
            base = self.typed[key] = mapped[: nbytes - nbytes % itemsize].view(src.dtype)
        dst = base.as_strided(shape, stride, offset // itemsize)
        return dst if list(src.shape) == shape else dst.view(src.shape)


def exchange_direct(
    comm: Communicator,
    sends: dict[int, list[torch.Tensor]],
    recvs: dict[int, list[torch.Tensor]],
    local: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    bucket_bytes: int | None = None,
    timeout_s: float | None = None,
) -> TransferStats:
    """Move ``sends``/``recvs`` (``exchange``'s contract) by direct copies into the
    receivers' arenas, copy each ``local`` (src, dst) pair here, and fall back to the
    bucketed ``exchange`` for what cannot go directly (see the module docstring)."""
    check_peers(comm, sends, recvs)
    t_start = time.perf_counter()
    pids: dict[int, int] = getattr(comm, "local_pids", {}) or {}
    out = {p: list(vs) for p, vs in sends.items() if vs and p in pids}
    inn = {p: list(vs) for p, vs in recvs.items() if vs and p in pids}
    stats = TransferStats()
    # 1. where each receive view lives, to each sender; the local copies run while
    # the senders' records are on their way when posting ours does not wait for the
    # peers (each fits a ring slot), else records go both ways first
    mine = [
        P2POp("send", torch.tensor([_record(v) for v in vs], dtype=torch.int64), p)
        for p, vs in inn.items()
    ]
    records = {p: torch.empty((len(vs), _FIELDS), dtype=torch.int64) for p, vs in out.items()}
    theirs = [P2POp("recv", r, p) for p, r in records.items()]
    eager = all(_nbytes(op.tensor) <= getattr(comm, "eager_bytes", 0) for op in mine)
    first, after = (mine, theirs) if eager else (mine + theirs, [])
    # a local pair that reads the same source rows as a view going out waits for the
    # writes, so that one pass over those rows serves both (copy_pairs)
    shared = (
        ({source_rows(v) for vs in out.values() for v in vs} - {None})
        if row_blocks_available()
        else set()
    )
    now: list[tuple[torch.Tensor, torch.Tensor]] = []
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    for pair in local:
        (later if shared and source_rows(pair[0]) in shared else now).append(pair)
    if first:
        comm.batch_p2p(first, timeout_s)
    copy_pairs(now)
    if after:
        comm.batch_p2p(after, timeout_s)
    # 2. copy into each receiver's memory, then tell it which views are done
    flags_out: dict[int, torch.Tensor] = {}
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    moved: dict[int, int] = {}
    try:
        for p, vs in out.items():
            flags_out[p], moved[p] = _targets(comm, p, pids[p], vs, records[p].tolist(), writes)
        t0 = time.perf_counter()
        copy_pairs(writes + later)
    except BaseException:
        comm.abort()  # the receivers wait for our flags: wake them instead of letting them time out
        raise
    for p, nbytes in moved.items():
        _count(stats, comm, comm.rank, p, nbytes, time.perf_counter() - t0)
    if flags_out:
        comm.batch_p2p([P2POp("send", f, p) for p, f in flags_out.items()], timeout_s)
    flags_in = {p: torch.empty(len(vs), dtype=torch.uint8) for p, vs in inn.items()}
    if flags_in:
        comm.batch_p2p([P2POp("recv", f, p) for p, f in flags_in.items()], timeout_s)
    for p, vs in inn.items():
        done = sum(_nbytes(v) for v, f in zip(vs, flags_in[p].tolist(), strict=True) if f)
        _count(stats, comm, p, comm.rank, done, time.perf_counter() - t_start)
    # 3. the rest through buckets, pairs and order the same on both sides
    rest_out = {
        p: [v for v, f in zip(vs, flags_out[p].tolist(), strict=True) if not f]
        if p in out
        else list(vs)
        for p, vs in sends.items()
    }
    rest_in = {
        p: [v for v, f in zip(vs, flags_in[p].tolist(), strict=True) if not f]
        if p in inn
        else list(vs)
        for p, vs in recvs.items()
    }
    rest_out = {p: vs for p, vs in rest_out.items() if vs}
    rest_in = {p: vs for p, vs in rest_in.items() if vs}
    if rest_out or rest_in:
        stats.add(exchange(comm, rest_out, rest_in, bucket_bytes=bucket_bytes, timeout_s=timeout_s))
    stats.seconds = time.perf_counter() - t_start
    return stats


def _targets(
    comm: Communicator,
    peer: int,
    pid: int,
    views: list[torch.Tensor],
    rows: list[list[int]],
    writes: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, int]:
    """Add to ``writes`` the (view, receiver memory) pairs that can go directly into
    ``peer``'s memory; returns one flag per view (set: copied by ``writes``) and their bytes."""
    writer = _Writer(peer, pid)
    flags = torch.zeros(len(views), dtype=torch.uint8)
    moved = 0
    for i, (src, row) in enumerate(zip(views, rows, strict=True)):
        if row[1] == _EMPTY:
            if src.numel():
                raise TransferError(
                    f"rank {peer} receives 0 bytes where rank {comm.rank} sends {_nbytes(src)}"
                )
            flags[i] = 1
            continue
        if row[1] == _OFF_ARENA:
            continue
        dst = writer.target(row, src)
        if dst is not None:
            writes.append((src, dst))
            flags[i] = 1
            moved += _nbytes(src)
    return flags, moved


def _count(
    stats: TransferStats, comm: Communicator, src: int, dst: int, nbytes: int, seconds: float
) -> None:
    if not nbytes:
        return
    mine = src == comm.rank
    if mine:
        stats.bytes_sent += nbytes
    else:
        stats.bytes_received += nbytes
    peer = dst if mine else src
    stats.per_peer_bytes[peer] = stats.per_peer_bytes.get(peer, 0) + nbytes
    emit_transfer(comm, src, dst, nbytes, seconds, -1)
