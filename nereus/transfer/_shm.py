"""Intra-host point-to-point through shared memory: one ring of slots per directed pair.

A ``ShmP2P`` belongs to one rank of one group. For every peer on the same host it
holds two channels (to the peer, from the peer). A channel is a shared-memory
segment of ``slots * slot_bytes`` bytes plus two FIFOs: ``full`` carries 16-byte
records (total bytes of the tensor, bytes in this chunk) from sender to receiver,
``free`` carries one byte per slot the receiver has drained. The sender copies a
chunk into the next slot when it has a credit; the receiver copies it out into the
destination and returns the credit. Sender and receiver copy in different
processes at the same time, so a large tensor costs about one memcpy, not two.

Promises:
- ``run(sends, recvs, deadline)`` progresses every send and receive of one batch in
  one loop that never blocks on a single peer, so any set of pairwise transfers
  completes without deadlock whatever order the ranks listed them in. Transfers
  between one ordered pair happen in list order on both sides.
- Waiting is ``select`` on the FIFOs, an abort pipe and the peers' pidfds: no polling;
  a peer that exits wakes the waiter at once, an abort wakes it at once.
- Names exist only while the group is being built: ``open_all`` creates or opens
  every channel, the caller rendezvouses (gloo's group construction), then
  ``unlink_names`` removes the names, so a killed process leaks nothing.

Refuses: a record whose total size differs from the receiver's tensor
(``TransferError``); use after ``close``.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import select
import struct
import time
from collections import deque
from dataclasses import dataclass

import torch

from nereus.errors import TransferError

__all__ = ["ShmP2P", "ShmTimeout", "shm_name_prefix"]

log = logging.getLogger("nereus.transfer")

SHM_DIR = "/dev/shm"
_RECORD = struct.Struct("<QQ")


def shm_name_prefix(*parts: object) -> str:
    """A short, filesystem-safe prefix unique to one group incarnation."""
    digest = hashlib.sha1("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]
    return f"nereus-{digest}"


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


class _Channel:
    """One directed pair: a ring of slots in a segment plus the two FIFOs."""

    def __init__(self, base: str, slot_bytes: int, slots: int) -> None:
        self.base = base
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.paths = [base + ".seg", base + ".full", base + ".free"]
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
        self.free_fd = os.open(self.paths[2], os.O_RDWR | os.O_NONBLOCK)
        self.seg = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.next_slot = 0  # the slot the next record uses (both ends advance alike)
        self.credits = slots  # sender side: slots it may fill
        self.inbox = bytearray()  # receiver side: record bytes read but not parsed

    def slot(self, nbytes: int) -> torch.Tensor:
        start = self.next_slot * self.slot_bytes
        return self.seg[start : start + nbytes]

    def unlink(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for fd in (self.full_fd, self.free_fd):
            os.close(fd)
        del self.seg
        self._mm.close()


@dataclass
class _Stream:
    """The ordered transfers of one batch with one peer in one direction."""

    peer: int
    channel: _Channel
    queue: deque  # of uint8 tensors (contiguous views)
    offset: int = 0  # bytes done of queue[0]
    started: bool = False  # a record for queue[0] has been sent or received


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

    def unlink_names(self) -> None:
        """Remove every name of this rank's channels (mappings and fds stay valid)."""
        for ch in [*self._out.values(), *self._in.values()]:
            ch.unlink()

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
        for ch in [*self._out.values(), *self._in.values()]:
            ch.close()
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
        recvs: list[tuple[int, torch.Tensor]],
        deadline: float,
    ) -> None:
        """Move every (peer, contiguous uint8 tensor) pair; returns when this rank's part
        is done (its sends are in the peers' slots, its receives are copied out).

        Raises ``ShmTimeout`` at ``deadline``, ``ShmPeerExited`` if a pending peer's
        process exits, ``TransferError`` on abort or a size mismatch."""
        if self._closed:
            raise TransferError("shared-memory channels are closed")
        out: dict[int, _Stream] = {}
        inn: dict[int, _Stream] = {}
        for peer, t in sends:
            out.setdefault(peer, _Stream(peer, self._out[peer], deque())).queue.append(t)
        for peer, t in recvs:
            inn.setdefault(peer, _Stream(peer, self._in[peer], deque())).queue.append(t)
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

    def _pump_send(self, s: _Stream) -> bool:
        ch = s.channel
        self._take_credits(ch)
        moved = False
        while s.queue and ch.credits > 0:
            t = s.queue[0]
            total = t.numel()
            n = min(ch.slot_bytes, total - s.offset)
            if n:
                ch.slot(n).copy_(t[s.offset : s.offset + n])
            os.write(ch.full_fd, _RECORD.pack(total, n))
            ch.credits -= 1
            ch.next_slot = (ch.next_slot + 1) % ch.slots
            s.offset += n
            moved = True
            if s.offset >= total:
                s.queue.popleft()
                s.offset = 0
        return moved

    @staticmethod
    def _take_credits(ch: _Channel) -> None:
        try:
            ch.credits += len(os.read(ch.free_fd, 4096))
        except BlockingIOError:
            pass

    def _pump_recv(self, s: _Stream) -> bool:
        ch = s.channel
        try:
            ch.inbox += os.read(ch.full_fd, 4096)
        except BlockingIOError:
            pass
        moved = False
        while s.queue and len(ch.inbox) >= _RECORD.size:
            total, n = _RECORD.unpack_from(ch.inbox)
            del ch.inbox[: _RECORD.size]
            t = s.queue[0]
            if total != t.numel() or s.offset + n > total:
                raise TransferError(
                    f"rank {self.rank} expected {t.numel()} bytes from rank {s.peer} "
                    f"but the sender's tensor has {total} bytes"
                )
            if n:
                t[s.offset : s.offset + n].copy_(ch.slot(n))
            ch.next_slot = (ch.next_slot + 1) % ch.slots
            os.write(ch.free_fd, b"\1")
            s.offset += n
            moved = True
            if s.offset >= total:
                s.queue.popleft()
                s.offset = 0
        return moved

    def _wait(self, out: dict[int, _Stream], inn: dict[int, _Stream], deadline: float) -> None:
        watch = {self._abort_r: ("abort", -1)}
        for peer in out:
            watch[self._out[peer].free_fd] = ("io", peer)
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
