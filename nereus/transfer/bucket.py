"""Bucketed transfers: many tensor views to and from peers in a few large messages.

``exchange(comm, sends, recvs)`` is what the state layer (reshard execution) and the
RL weight sync call. ``sends[peer]`` and ``recvs[peer]`` are lists of tensor views
(non-contiguous allowed, any dtype, zero-size allowed); the i-th view this rank sends
to a peer lands in the i-th view that peer receives from this rank, so both sides
must list the same byte sizes in the same order (the state layer derives both lists
from the same box intersection). The transfer layer works on views only; turning
boxes into views is the state layer's job.

Promises: every received view holds the sender's bytes when ``exchange`` returns; one
``transfer_bucket`` tap event per bucket with bytes, seconds, gbps, src and dst (cluster
devices when the group was made for devices, else ranks), src_rank, dst_rank; a
``TransferStats`` summary. Errors of the communicator (``TransferError``,
``StuckCollective``) propagate unchanged; on error, received views are unspecified.
Refuses: views on different devices within one call, a peer equal to this rank
(``ConfigError``).

More (how it works): docs/transfer.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nereus.config import require
from nereus.errors import ConfigError
from nereus.transfer import _tap
from nereus.transfer.communicator import Communicator, P2POp

__all__ = [
    "exchange",
    "TransferStats",
    "bucket_layout",
    "pack_buckets",
    "DEFAULT_BUCKET_BYTES_CPU",
    "DEFAULT_BUCKET_BYTES_GPU",
]

DEFAULT_BUCKET_BYTES_CPU = 64 * 2**20
DEFAULT_BUCKET_BYTES_GPU = 256 * 2**20
_ALIGN = 16


@dataclass
class TransferStats:
    """What one ``exchange`` moved (this rank's view)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    rounds: int = 0
    seconds: float = 0.0
    per_peer_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        moved = self.bytes_sent + self.bytes_received
        return moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def add(self, other: TransferStats) -> None:
        """Count ``other``'s bytes, buckets and rounds in these (not its seconds)."""
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.buckets += other.buckets
        self.rounds += other.rounds
        for p, n in other.per_peer_bytes.items():
            self.per_peer_bytes[p] = self.per_peer_bytes.get(p, 0) + n


def check_peers(comm: Communicator, *peer_maps: dict[int, list[torch.Tensor]]) -> None:
    """Every peer of an exchange is another rank of ``comm``."""
    for peers in peer_maps:
        for peer in peers:
            if peer == comm.rank or not 0 <= peer < comm.size:
                raise ConfigError(f"exchange peer={peer} must be another rank in [0, {comm.size})")


def emit_transfer(
    comm: Communicator, src: int, dst: int, nbytes: int, seconds: float, bucket_round: int
) -> None:
    """One ``transfer_bucket`` event on the tap (ranks of ``comm``; devices when known)."""
    devices = comm.devices
    _tap.emit(
        "transfer_bucket",
        bytes=nbytes,
        seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        src=devices[src] if devices else src,
        dst=devices[dst] if devices else dst,
        src_rank=src,
        dst_rank=dst,
        group=comm.group_id,
        epoch=comm.epoch,
        round=bucket_round,
    )


@dataclass(frozen=True)
class _Piece:
    """Bytes [start, stop) of view ``index`` live at ``offset`` in bucket ``bucket``."""

    index: int
    start: int
    stop: int
    bucket: int
    offset: int


def bucket_layout(sizes: Sequence[int], bucket_bytes: int) -> tuple[list[_Piece], list[int]]:
    """Place views of ``sizes`` bytes into buckets; returns the pieces and each bucket's
    used bytes. Deterministic in ``sizes`` alone, so sender and receiver agree."""
    require(bucket_bytes >= _ALIGN, "bucket_bytes", bucket_bytes, f"must be >= {_ALIGN}")
    pieces: list[_Piece] = []
    used: list[int] = []
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        start = 0
        while start < n:
            if not used or used[-1] >= bucket_bytes:
                used.append(0)
            b = len(used) - 1
            room = bucket_bytes - used[-1]
            # A whole view that would fit in an empty bucket is not cut at a bucket's end.
            if start == 0 and n <= bucket_bytes and n > room:
                used.append(0)
                b, room = len(used) - 1, bucket_bytes
            take = min(room, n - start)
            pieces.append(_Piece(i, start, start + take, b, used[-1]))
            used[-1] = min(bucket_bytes, (used[-1] + take + _ALIGN - 1) // _ALIGN * _ALIGN)
            start += take
    return pieces, used


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Side:
    """One direction with one peer: views, their layout and contiguous staging."""

    def __init__(self, views: list[torch.Tensor], bucket_bytes: int) -> None:
        self.views = views
        self.pieces, self.used = bucket_layout([_nbytes(v) for v in views], bucket_bytes)
        # A view cut across buckets is handled as flat bytes of a contiguous copy.
        cut = {p.index for p in self.pieces if p.stop - p.start != _nbytes(views[p.index])}
        self.flat: dict[int, torch.Tensor] = {}
        for i in cut:
            v = views[i]
            self.flat[i] = (
                v
                if v.is_contiguous()
                else torch.empty_like(v, memory_format=torch.contiguous_format)
            )
        self.by_bucket: dict[int, list[_Piece]] = {}
        for p in self.pieces:
            self.by_bucket.setdefault(p.bucket, []).append(p)
        # A bucket that is one piece of contiguous memory travels from that memory
        # itself: packing it would be a copy for nothing (large views cut across
        # buckets, or a view as large as a bucket).
        self.direct: dict[int, torch.Tensor] = {}
        for k, ps in self.by_bucket.items():
            if len(ps) != 1 or ps[0].offset != 0:
                continue
            p, v = ps[0], views[ps[0].index]
            if v.is_contiguous() and p.stop - p.start == self.used[k]:
                self.direct[k] = v.reshape(-1).view(torch.uint8)[p.start : p.stop]

    def adoptable(self, i: int) -> bool:
        """Whether received view ``i`` may take a bucket's memory as its storage: a
        whole tensor (no view of another) that owns all of its storage, in one piece."""
        v = self.views[i]
        return (
            v._base is None
            and v.is_contiguous()
            and v.storage_offset() == 0
            and v.untyped_storage().nbytes() == _nbytes(v)
            and i not in self.flat
        )

    def pack(self, k: int, buf: torch.Tensor) -> None:
        if k in self.direct:
            return
        for p in self.by_bucket.get(k, []):
            v = self.views[p.index]
            if p.index in self.flat:
                if p.start == 0 and self.flat[p.index] is not v:
                    self.flat[p.index].copy_(v)
                src = self.flat[p.index].reshape(-1).view(torch.uint8)[p.start : p.stop]
                buf[p.offset : p.offset + p.stop - p.start].copy_(src)
            else:
                region = buf[p.offset : p.offset + p.stop].view(v.dtype).view(v.shape)
                region.copy_(v)

    def unpack(self, k: int, buf: torch.Tensor, adopt: bool = False) -> None:
        for p in self.by_bucket.get(k, []):
            v = self.views[p.index]
            if (
                adopt
                and self.adoptable(p.index)
                and (buf.storage_offset() + p.offset) % v.element_size() == 0
            ):
                # The received bucket becomes the tensor's storage: no copy, and the
                # bucket (a hand-off segment within a host) lives while the tensor does.
                with torch.no_grad():
                    v.set_(
                        buf.untyped_storage(),
                        (buf.storage_offset() + p.offset) // v.element_size(),
                        v.shape,
                        v.stride(),
                    )
            elif p.index in self.flat:
                dst = self.flat[p.index].reshape(-1).view(torch.uint8)[p.start : p.stop]
                dst.copy_(buf[p.offset : p.offset + p.stop - p.start])
                if p.stop == _nbytes(v) and self.flat[p.index] is not v:
                    v.copy_(self.flat[p.index])
            else:
                v.copy_(buf[p.offset : p.offset + p.stop].view(v.dtype).view(v.shape))


def pack_buckets(views: Sequence[torch.Tensor], bucket_bytes: int) -> list[torch.Tensor]:
    """``views`` laid out in contiguous uint8 buckets of ``bucket_bytes`` exactly as
    ``exchange`` sends them to one peer (``bucket_layout``), copied on the current stream
    of their device. A bucket that is one piece of a contiguous view is that view's own
    memory (``exchange`` sends it without a copy), so it is returned as a view of it."""
    require(
        isinstance(bucket_bytes, int) and bucket_bytes >= _ALIGN,
        "bucket_bytes",
        bucket_bytes,
        f"must be an int >= {_ALIGN}",
    )
    devices = {v.device for v in views}
    require(len(devices) <= 1, "views", sorted(map(str, devices)), "must be on one device")
    device = devices.pop() if devices else torch.device("cpu")
    side = _Side(list(views), bucket_bytes)
    out = []
    for k, n in enumerate(side.used):
        if k in side.direct:
            out.append(side.direct[k])
            continue
        buf = torch.empty(n, dtype=torch.uint8, device=device)
        side.pack(k, buf)
        out.append(buf)
    return out


def exchange(
    comm: Communicator,
    sends: dict[int, list[torch.Tensor]],
    recvs: dict[int, list[torch.Tensor]],
    bucket_bytes: int | None = None,
    timeout_s: float | None = None,
    adopt: bool = False,
) -> TransferStats:
    """Send ``sends[peer]`` views to each peer and receive ``recvs[peer]`` views from
    each, in contiguous double-buffered buckets (see the module docstring).

    With ``adopt``, a received view that is a whole tensor owning all of its storage
    (not a view of another tensor) and travels in one piece is not copied into: its
    storage is replaced by the received bucket's memory (``Tensor.set_``), so the
    caller must hold no other view of it."""
    views = [v for vs in [*sends.values(), *recvs.values()] for v in vs]
    devices = {v.device for v in views}
    if len(devices) > 1:
        raise ConfigError(f"exchange views are on several devices {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    if bucket_bytes is None:
        bucket_bytes = (
            DEFAULT_BUCKET_BYTES_GPU if device.type == "cuda" else DEFAULT_BUCKET_BYTES_CPU
        )
    require(
        isinstance(bucket_bytes, int) and bucket_bytes >= _ALIGN,
        "bucket_bytes",
        bucket_bytes,
        f"must be an int >= {_ALIGN}",
    )
    check_peers(comm, sends, recvs)
    out = {p: _Side(list(vs), bucket_bytes) for p, vs in sends.items() if vs}
    inn = {p: _Side(list(vs), bucket_bytes) for p, vs in recvs.items() if vs}
    rounds = max([len(s.used) for s in [*out.values(), *inn.values()]] or [0])
    stats = TransferStats(rounds=rounds)
    t_start = time.perf_counter()

    if device.type == "cuda" and comm.streamed:
        _exchange_on_streams(comm, out, inn, rounds, bucket_bytes, device, timeout_s, adopt, stats)
        stats.seconds = time.perf_counter() - t_start
        return stats

    def alloc() -> dict[int, torch.Tensor]:
        return {p: torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for p in out}

    send_sets = [alloc(), alloc()] if rounds > 1 else [alloc()]
    # Received buckets are fresh tensors from batch_p2p_new (on one host: the sender's
    # hand-off segments, adopted without a copy), kept until unpacked, then freed.
    received: dict[int, dict[int, torch.Tensor]] = {}

    def pack(k: int) -> None:
        send_bufs = send_sets[k % len(send_sets)]
        for p, side in out.items():
            side.pack(k, send_bufs[p])

    def unpack(k: int) -> None:
        got = received.pop(k, {})
        for p, side in inn.items():
            if p in got:
                side.unpack(k, got[p], adopt)

    if rounds:
        pack(0)
    for k in range(rounds):
        helper = None
        error: list[BaseException] = []
        if k + 1 < rounds or k > 0:

            def work(k: int = k, error: list[BaseException] = error) -> None:
                try:
                    if k > 0:
                        unpack(k - 1)
                    if k + 1 < rounds:
                        pack(k + 1)
                except BaseException as e:  # delivered to the caller below
                    error.append(e)

            helper = threading.Thread(target=work, name="nereus-bucket-pack", daemon=True)
            helper.start()
        send_bufs = send_sets[k % len(send_sets)]
        ops, new, events = [], [], []
        for p, side in out.items():
            if k < len(side.used):
                n = side.used[k]
                ops.append(
                    P2POp("send", side.direct[k] if k in side.direct else send_bufs[p][:n], p)
                )
                events.append((comm.rank, p, n))
                stats.bytes_sent += n
        for p, side in inn.items():
            if k < len(side.used):
                n = side.used[k]
                new.append((p, n))
                events.append((p, comm.rank, n))
                stats.bytes_received += n
        t0 = time.perf_counter()
        try:
            fresh = comm.batch_p2p_new(ops, new, timeout_s)
            received[k] = {p: t for (p, _), t in zip(new, fresh, strict=True)}
        finally:
            if helper is not None:
                helper.join()
        seconds = time.perf_counter() - t0
        if error:
            raise error[0]
        for src, dst, n in events:
            stats.buckets += 1
            peer = dst if src == comm.rank else src
            stats.per_peer_bytes[peer] = stats.per_peer_bytes.get(peer, 0) + n
            emit_transfer(comm, src, dst, n, seconds, k)
    if rounds:
        unpack(rounds - 1)
    stats.seconds = time.perf_counter() - t_start
    return stats


def _round_ops(
    comm: Communicator,
    k: int,
    out: dict[int, _Side],
    inn: dict[int, _Side],
    send_bufs: dict[int, torch.Tensor],
    stats: TransferStats,
) -> tuple[list[P2POp], list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Round ``k``'s sends, fresh receives and (src, dst, bytes) records."""
    ops, new, records = [], [], []
    for p, side in out.items():
        if k < len(side.used):
            n = side.used[k]
            ops.append(P2POp("send", side.direct[k] if k in side.direct else send_bufs[p][:n], p))
            records.append((comm.rank, p, n))
            stats.bytes_sent += n
    for p, side in inn.items():
        if k < len(side.used):
            n = side.used[k]
            new.append((p, n))
            records.append((p, comm.rank, n))
            stats.bytes_received += n
    return ops, new, records


def _exchange_on_streams(
    comm: Communicator,
    out: dict[int, _Side],
    inn: dict[int, _Side],
    rounds: int,
    bucket_bytes: int,
    device: torch.device,
    timeout_s: float | None,
    adopt: bool,
    stats: TransferStats,
) -> None:
    """The CUDA path: packing and unpacking on a side stream, NCCL on the
    communicator's stream, ordered by events only, so packing round k+1 and unpacking
    round k-1 run while round k is on the wire. The host enqueues everything, then
    waits once (deadlines enforced by ``comm.synchronize``) for the figures."""
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    start = torch.cuda.Event(enable_timing=True)
    start.record(caller)
    side.wait_event(start)  # the views' producers on the caller's stream come first
    sets = [
        {p: torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for p in out}
        for _ in range(min(rounds, 2))
    ]
    packed: list[Any] = []
    done: list[Any] = []
    fresh: dict[int, dict[int, torch.Tensor]] = {}
    records: list[list[tuple[int, int, int]]] = []

    def launch(k: int) -> None:
        if k >= 2 and done[k - 2] is not None:
            side.wait_event(done[k - 2])  # send buffers of round k-2 are free again
        with torch.cuda.stream(side):
            for p, s in out.items():
                s.pack(k, sets[k % len(sets)][p])
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(side)
        packed.append(mark)
        ops, new, recs = _round_ops(comm, k, out, inn, sets[k % len(sets)], stats)
        records.append(recs)
        bufs, event = comm.enqueue_p2p(ops, new, mark, timeout_s)  # type: ignore[attr-defined]
        done.append(event)
        fresh[k] = {p: t for (p, _), t in zip(new, bufs, strict=True)}

    def unpack(k: int) -> None:
        if done[k] is not None:
            side.wait_event(done[k])
        got = fresh.pop(k)
        with torch.cuda.stream(side):
            for p, s in inn.items():
                if p in got:
                    s.unpack(k, got[p], adopt)
        for t in got.values():
            t.record_stream(side)  # read there after this function lets go of it

    if rounds:
        launch(0)
    for k in range(rounds):
        if k + 1 < rounds:
            launch(k + 1)  # packed and queued while round k moves
        unpack(k)
    end = torch.cuda.Event()
    end.record(side)
    caller.wait_event(end)  # received views are written
    last = next((e for e in reversed(done) if e is not None), None)
    if last is not None:
        caller.wait_event(last)  # sources are not overwritten before they are sent
    comm.synchronize(timeout_s)  # the one host wait: the figures below need the times
    end_of: list[float] = []
    for k in range(rounds):
        t_done = start.elapsed_time(done[k]) / 1e3 if done[k] is not None else 0.0
        t_begin = max(start.elapsed_time(packed[k]) / 1e3, end_of[-1] if end_of else 0.0)
        end_of.append(max(t_done, end_of[-1] if end_of else 0.0))
        seconds = max(t_done - t_begin, 0.0)
        for src, dst, n in records[k]:
            stats.buckets += 1
            peer = dst if src == comm.rank else src
            stats.per_peer_bytes[peer] = stats.per_peer_bytes.get(peer, 0) + n
            emit_transfer(comm, src, dst, n, seconds, k)
