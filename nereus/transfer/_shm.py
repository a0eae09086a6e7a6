"""Intra-host point-to-point through shared memory: a ring of slots per directed pair,
plus hand-off segments the receiver adopts.

A ``ShmP2P`` belongs to one rank of one group and holds two channels (a ring segment
plus two FIFOs) per same-host peer. A receive goes into a given tensor (``recv``: the
sender fills slots while the receiver empties earlier ones) or into a fresh tensor
(``recv_new``: one copy by the sender into a pooled hand-off segment the receiver
wraps as its tensor).

Promises:
- ``run(sends, recvs, deadline)`` progresses a whole batch in one loop that never
  blocks on a single peer: no deadlock whatever order the ranks listed their
  transfers in; transfers between one ordered pair keep list order;
- waiting is ``select`` on FIFOs, an abort pipe and the peers' pidfds: no polling, and a
  peer that exits or an abort wakes the waiter at once;
- ring names are unlinked after the rendezvous; only two ends killed mid-hand-off
  leave a segment's name, and the group's owner removes it when it destroys the group
  (``nereus.transfer.group``: the names of one group incarnation share a prefix).

Refuses: a record whose total size differs from the receiver's tensor
(``TransferError``); use after ``close``. Sizes that disagree about being larger
than one slot are only detected at the deadline.

More (how it works): docs/transfer.md.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import mmap
import os
import select
import struct
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from nereus.errors import TransferError

__all__ = [
    "ShmP2P",
    "ShmTimeout",
    "ShmPeerExited",
    "RecvNew",
    "shm_name_prefix",
    "unlink_group_names",
    "unlink_paths",
]

log = logging.getLogger("nereus.transfer")

SHM_DIR = "/dev/shm"
_RECORD = struct.Struct("<QQqQ")  # total, chunk bytes, hand-off segment (-1: ring), capacity
_BACK = struct.Struct("<II")  # kind, value
_CREDIT, _MODE, _RELEASE = 1, 2, 3
_RING, _ADOPT = 0, 1
_SEGMENT_ROUND = 2**20


def shm_name_prefix(store_port: int, *parts: object) -> str:
    """A short, filesystem-safe prefix unique to one group incarnation. It starts with
    the store's port so the owner of a store can find (and count) its groups' names."""
    digest = hashlib.sha1("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]
    return f"nereus-{store_port}-{digest}"


def unlink_paths(paths: list[str]) -> int:
    """Remove these names from ``/dev/shm`` (one already gone is skipped: its other end
    took it); returns how many this call removed."""
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def unlink_group_names(prefix: str) -> int:
    """Remove every name left under one group incarnation's ``prefix`` (what only ends
    killed mid-hand-off leave behind); returns how many."""
    return unlink_paths(glob.glob(f"{SHM_DIR}/{glob.escape(prefix)}-*"))


class ShmTimeout(Exception):
    """Internal: the deadline passed with transfers still pending with ``peers``."""

    def __init__(self, peers: list[int]) -> None:
        super().__init__(f"pending with peers {peers}")
        self.peers = peers


class ShmPeerExited(Exception):
    """Internal: a peer's process exited while transfers with it were pending."""

    def __init__(self, peer: int) -> None:
        super().__init__(f"peer {peer} exited")
        self.peer = peer


class RecvNew:
    """A receive into a fresh tensor of ``nbytes``; ``result`` is set by ``run``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.result: torch.Tensor | None = None


class _Channel:
    """One directed pair: the ring, the two FIFOs, and hand-off segments."""

    def __init__(self, base: str, slot_bytes: int, slots: int) -> None:
        self.base = base
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.paths = [base + ".seg", base + ".full", base + ".back"]
        size = slot_bytes * slots
        fd = os.open(self.paths[0], os.O_CREAT | os.O_RDWR, 0o600)
        try:
            # Both ends may create the file; truncating to the same size is idempotent.
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        for path in self.paths[1:]:
            try:
                os.mkfifo(path, 0o600)
            except FileExistsError:
                pass
        # O_RDWR keeps a FIFO open without waiting for the other end (Linux).
        self.full_fd = os.open(self.paths[1], os.O_RDWR | os.O_NONBLOCK)
        self.back_fd = os.open(self.paths[2], os.O_RDWR | os.O_NONBLOCK)
        self.seg = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.next_slot = 0  # the slot the next ring record uses (both ends advance alike)
        self.inbox = bytearray()  # bytes read from a FIFO but not parsed yet
        # sender side
        self.credits = slots
        self.modes: deque[int] = deque()
        self.free_segments: dict[int, int] = {}  # id -> capacity, released by the receiver
        self.own_segments: dict[int, tuple[mmap.mmap, int, str]] = {}
        self.in_flight: set[int] = set()  # handed off, not yet released by the receiver
        # receiver side
        self.adopted: dict[int, mmap.mmap] = {}
        # Guards back_fd against finalizers after close; re-entrant because a finalizer
        # can run (garbage collection) inside a send_back of the same thread.
        self.lock = threading.RLock()
        self.closed = False

    def slot(self, nbytes: int) -> torch.Tensor:
        start = self.next_slot * self.slot_bytes
        return self.seg[start : start + nbytes]

    def send_back(self, kind: int, value: int = 0) -> None:
        with self.lock:
            if not self.closed:
                os.write(self.back_fd, _BACK.pack(kind, value))

    def read_back(self) -> bool:
        """Sender side: apply the receiver's messages; True if any arrived."""
        try:
            self.inbox += os.read(self.back_fd, 65536)
        except BlockingIOError:
            return False
        while len(self.inbox) >= _BACK.size:
            kind, value = _BACK.unpack_from(self.inbox)
            del self.inbox[: _BACK.size]
            if kind == _CREDIT:
                self.credits += 1
            elif kind == _MODE:
                self.modes.append(value)
            elif kind == _RELEASE:
                self.free_segments[value] = self.own_segments[value][1]
                self.in_flight.discard(value)
        return True

    def take_segment(self, nbytes: int) -> tuple[int, mmap.mmap, int]:
        """Sender side: a hand-off segment of at least ``nbytes`` (best fit, else new)."""
        fits = [(cap, i) for i, cap in self.free_segments.items() if cap >= nbytes]
        if fits:
            cap, i = min(fits)
            del self.free_segments[i]
            self.in_flight.add(i)
            return i, self.own_segments[i][0], cap
        i = len(self.own_segments)
        cap = max(_SEGMENT_ROUND, -(-nbytes // _SEGMENT_ROUND) * _SEGMENT_ROUND)
        path = f"{self.base}.h{i}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, cap)
            mm = mmap.mmap(fd, cap)
        finally:
            os.close(fd)
        self.own_segments[i] = (mm, cap, path)
        self.in_flight.add(i)
        return i, mm, cap

    def adopt(self, seg: int, cap: int, nbytes: int) -> torch.Tensor:
        """Receiver side: the hand-off segment as a tensor; released when it is freed."""
        mm = self.adopted.get(seg)
        if mm is None:
            path = f"{self.base}.h{seg}"
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, cap)
            finally:
                os.close(fd)
            os.unlink(path)  # mapped on both ends now: the name is no longer needed
            self.adopted[seg] = mm
        view = memoryview(mm)[:nbytes]
        weakref.finalize(view, self.send_back, _RELEASE, seg)
        return (
            torch.frombuffer(view, dtype=torch.uint8)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )

    def unlink(self, peer_alive: bool) -> None:
        """Remove this channel's names. A hand-off segment the receiver has not mapped
        yet keeps its name while the receiver lives: it unlinks it when it maps it, or
        at its own close (``unlink_unclaimed``)."""
        paths = list(self.paths)
        for i, (_, _, path) in self.own_segments.items():
            if i not in self.in_flight or not peer_alive:
                paths.append(path)
        unlink_paths(paths)

    def unlink_unclaimed(self) -> None:
        """Receiver side: remove names of hand-off segments this rank never mapped."""
        unlink_paths(glob.glob(glob.escape(self.base) + ".h*"))

    def close(self, peer_alive: bool, receiver: bool) -> None:
        with self.lock:
            self.closed = True
            for fd in (self.full_fd, self.back_fd):
                os.close(fd)
        self.unlink(peer_alive)
        if receiver:
            self.unlink_unclaimed()
        del self.seg
        self._mm.close()
        for mm, _, _ in self.own_segments.values():
            mm.close()
        self.own_segments.clear()
        # Adopted mappings stay alive as long as the tensors made from them.
        self.adopted.clear()


@dataclass
class _Stream:
    """The ordered transfers of one batch with one peer in one direction."""

    peer: int
    channel: _Channel
    queue: deque  # sends: uint8 tensors; receives: uint8 tensors or RecvNew
    offset: int = 0  # bytes done of queue[0]
    mode: int = -1  # queue[0]'s mode once agreed (-1: not yet)
    target: torch.Tensor | None = None  # receiver: where queue[0]'s ring chunks land


def _nbytes(item: torch.Tensor | RecvNew) -> int:
    return item.nbytes if isinstance(item, RecvNew) else item.numel()


class ShmP2P:
    """Shared-memory p2p of one rank with its same-host peers (see module docstring)."""

    def __init__(
        self, prefix: str, rank: int, peers: dict[int, int], slot_bytes: int, slots: int
    ) -> None:
        """``peers`` maps peer rank -> its pid (for the exit watch)."""
        self.prefix = prefix
        self.rank = rank
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._out: dict[int, _Channel] = {}
        self._in: dict[int, _Channel] = {}
        self._pidfds: dict[int, int] = {}
        self._abort_r, self._abort_w = os.pipe()
        os.set_blocking(self._abort_r, False)
        os.set_blocking(self._abort_w, False)
        self._closed = False
        try:
            for peer, pid in sorted(peers.items()):
                self._out[peer] = _Channel(self._base(rank, peer), slot_bytes, slots)
                self._in[peer] = _Channel(self._base(peer, rank), slot_bytes, slots)
                self._pidfds[peer] = self._open_pidfd(peer, pid)
        except BaseException:
            self.unlink_names()
            self.close()
            raise

    @property
    def peers(self) -> list[int]:
        return sorted(self._out)

    def _base(self, src: int, dst: int) -> str:
        return f"{SHM_DIR}/{self.prefix}-{src}-{dst}"

    @staticmethod
    def _open_pidfd(peer: int, pid: int) -> int:
        try:
            return os.pidfd_open(pid)
        except ProcessLookupError:
            raise TransferError(f"peer rank {peer} (pid {pid}) is not running") from None
        except OSError as e:  # e.g. a seccomp filter; the deadline still bounds every wait
            log.warning("pidfd_open(%d) for rank %d failed (%s); exit watch off", pid, peer, e)
            return -1

    def _is_alive(self, peer: int) -> bool:
        fd = self._pidfds.get(peer, -1)
        return fd < 0 or not select.select([fd], [], [], 0)[0]

    def unlink_names(self) -> None:
        """Remove the ring names of this rank's channels (mappings and fds stay valid)."""
        unlink_paths([p for ch in [*self._out.values(), *self._in.values()] for p in ch.paths])

    def abort(self) -> None:
        """Wake any ``run`` in progress; it raises ``TransferError``."""
        if not self._closed:
            try:
                os.write(self._abort_w, b"x")
            except BlockingIOError:  # the pipe is already full of wake-ups
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer, ch in self._out.items():
            ch.close(self._is_alive(peer), receiver=False)
        for peer, ch in self._in.items():
            ch.close(self._is_alive(peer), receiver=True)
        for fd in self._pidfds.values():
            if fd >= 0:
                os.close(fd)
        os.close(self._abort_r)
        os.close(self._abort_w)
        self._out.clear()
        self._in.clear()

    def run(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor | RecvNew]],
        deadline: float,
    ) -> None:
        """Move every (peer, contiguous uint8 tensor or RecvNew) pair; returns when this
        rank's part is done (its sends are in the peers' slots or segments, its
        receives are copied out or adopted).

        Raises ``ShmTimeout`` at ``deadline``, ``ShmPeerExited`` if a pending peer's
        process exits, ``TransferError`` on abort or a size mismatch."""
        if self._closed:
            raise TransferError("shared-memory channels are closed")
        out: dict[int, _Stream] = {}
        inn: dict[int, _Stream] = {}
        for peer, t in sends:
            out.setdefault(peer, _Stream(peer, self._out[peer], deque())).queue.append(t)
        for peer, r in recvs:
            inn.setdefault(peer, _Stream(peer, self._in[peer], deque())).queue.append(r)
        while out or inn:
            moved = False
            for peer in list(out):
                moved |= self._pump_send(out[peer])
                if not out[peer].queue:
                    del out[peer]
            for peer in list(inn):
                moved |= self._pump_recv(inn[peer])
                if not inn[peer].queue:
                    del inn[peer]
            if moved or not (out or inn):
                continue
            self._wait(out, inn, deadline)

    # ------------------------------------------------------------ sender

    def _pump_send(self, s: _Stream) -> bool:
        ch = s.channel
        moved = ch.read_back()
        while s.queue:
            t = s.queue[0]
            total = t.numel()
            if s.mode < 0:
                if total <= ch.slot_bytes:
                    s.mode = _RING
                elif ch.modes:
                    s.mode = ch.modes.popleft()
                else:
                    return moved  # waiting for the receiver to choose
            if s.mode == _ADOPT:
                seg, mm, cap = ch.take_segment(total)
                dst = torch.frombuffer(mm, dtype=torch.uint8, count=total)
                dst.copy_(t)
                del dst  # no export may outlive the copy (close() unmaps)
                os.write(ch.full_fd, _RECORD.pack(total, total, seg, cap))
            else:
                while s.offset < total or (total == 0 and s.offset == 0):
                    if ch.credits <= 0:
                        return moved
                    n = min(ch.slot_bytes, total - s.offset)
                    if n:
                        ch.slot(n).copy_(t[s.offset : s.offset + n])
                    os.write(ch.full_fd, _RECORD.pack(total, n, -1, 0))
                    ch.credits -= 1
                    ch.next_slot = (ch.next_slot + 1) % ch.slots
                    s.offset += n
                    if total == 0:
                        break
            s.queue.popleft()
            s.offset, s.mode = 0, -1
            moved = True
        return moved

    # ------------------------------------------------------------ receiver

    def _pump_recv(self, s: _Stream) -> bool:
        ch = s.channel
        moved = False
        try:
            ch.inbox += os.read(ch.full_fd, 65536)
        except BlockingIOError:
            pass
        while s.queue:
            item = s.queue[0]
            expected = _nbytes(item)
            if s.mode < 0:
                # Announce the mode of a large transfer before its data can arrive.
                want = _RING if isinstance(item, torch.Tensor) else _ADOPT
                if expected > ch.slot_bytes:
                    ch.send_back(_MODE, want)
                s.mode = want
                s.target = item if isinstance(item, torch.Tensor) else None
            if len(ch.inbox) < _RECORD.size:
                break
            total, n, seg, cap = _RECORD.unpack_from(ch.inbox)
            del ch.inbox[: _RECORD.size]
            if total != expected or s.offset + n > total:
                raise TransferError(
                    f"rank {self.rank} expected {expected} bytes from rank {s.peer} "
                    f"but the sender's tensor has {total} bytes"
                )
            moved = True
            if seg >= 0:
                if not isinstance(item, RecvNew):
                    raise TransferError(
                        f"rank {self.rank}: rank {s.peer} handed off a "
                        "segment for a receive into a tensor"
                    )
                item.result = ch.adopt(seg, cap, total)
                s.offset = total
            else:
                if s.target is None:
                    s.target = torch.empty(total, dtype=torch.uint8)
                if n:
                    s.target[s.offset : s.offset + n].copy_(ch.slot(n))
                ch.next_slot = (ch.next_slot + 1) % ch.slots
                ch.send_back(_CREDIT)
                s.offset += n
            if s.offset >= total:
                if isinstance(item, RecvNew) and item.result is None:
                    item.result = s.target
                s.queue.popleft()
                s.offset, s.mode, s.target = 0, -1, None
        return moved

    # ------------------------------------------------------------ waiting

    def _wait(self, out: dict[int, _Stream], inn: dict[int, _Stream], deadline: float) -> None:
        watch = {self._abort_r: ("abort", -1)}
        for peer in out:
            watch[self._out[peer].back_fd] = ("io", peer)
        for peer in inn:
            watch[self._in[peer].full_fd] = ("io", peer)
        for peer in {*out, *inn}:
            if self._pidfds[peer] >= 0:
                watch[self._pidfds[peer]] = ("exit", peer)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ShmTimeout(sorted({*out, *inn}))
        try:
            ready, _, _ = select.select(list(watch), [], [], left)
        except OSError as e:
            if e.errno == errno.EINTR:
                return
            raise
        if not ready:
            raise ShmTimeout(sorted({*out, *inn}))
        for fd in ready:
            kind, peer = watch[fd]
            if kind == "abort":
                raise TransferError(f"rank {self.rank}: the group was aborted")
            if kind == "exit":
                # Data the peer wrote before exiting is still drained first.
                if not self._has_pending_input(inn.get(peer)):
                    raise ShmPeerExited(peer)

    @staticmethod
    def _has_pending_input(s: _Stream | None) -> bool:
        if s is None:
            return False
        ch = s.channel
        return len(ch.inbox) >= _RECORD.size or bool(select.select([ch.full_fd], [], [], 0)[0])
