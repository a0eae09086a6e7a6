"""Arenas: this process's memory that same-host peers may write into directly.

An arena is an anonymous shared-memory file (``memfd``) of this process, mapped here
with its pages populated. A peer process of the same user maps it through
``/proc/<pid>/fd/<fd>`` and copies straight into it: one copy per moved byte, no
hand-off segment, no name in ``/dev/shm`` (nothing can leak: the memory goes away
with the last mapping or descriptor).

Promises: an arena is never handed out twice while a tensor on it lives; serials
are unique within the process, so a cached mapping is never of the wrong arena.
The pool keeps at most ``keep_free_bytes`` of free arenas (1 GiB unless
``set_keep_free_bytes`` says otherwise); that memory is the pool's, not counted in any
holder's shards. A writer's kept mappings hold their arenas' memory alive after the
owner dropped them, at most ``_MAPS_PER_PEER`` per peer.
Refuses: nothing; ``map_peer`` raises ``OSError`` when the peer's arena cannot be
opened (another user, a sandbox without ``/proc`` access): callers fall back.

More (how it works): docs/transfer.md.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = [
    "ArenaRef",
    "arena_empty",
    "describe",
    "map_peer",
    "forget_peer",
    "set_keep_free_bytes",
    "pool_stats",
]

_ROUND = 2**21  # arenas come in whole 2 MiB units so that best-fit reuse finds a home
_MAPS_PER_PEER = 4
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@dataclass(frozen=True)
class ArenaRef:
    """Where a view lives: arena ``serial`` (descriptor ``fd`` of process ``pid``,
    whose random ``token`` tells it from a later process with the same pid),
    ``nbytes`` long, at byte ``offset``."""

    pid: int
    token: int
    serial: int
    fd: int
    nbytes: int
    offset: int


class _Arena:
    def __init__(self, serial: int, nbytes: int) -> None:
        self.serial = serial
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"nereus-arena-{serial}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.mm = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8).data_ptr()

    def close(self) -> None:
        os.close(self.fd)
        try:
            self.mm.close()
        except BufferError:  # a tensor on it still lives: the mapping goes with it
            pass


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.serial = 0
        self.free: dict[int, _Arena] = {}
        self.busy: dict[int, _Arena] = {}  # base address -> arena handed out
        self.keep_free_bytes = 2**30

    def take(self, nbytes: int) -> torch.Tensor:
        want = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        with self.lock:
            fits = [(a.nbytes, s) for s, a in self.free.items() if a.nbytes >= want]
            arena = self.free.pop(min(fits)[1]) if fits else None
            if arena is None:
                self.serial += 1
                serial = self.serial
        if arena is None:
            arena = _Arena(serial, want)
        view = memoryview(arena.mm)[:nbytes]
        with self.lock:
            self.busy[arena.base] = arena
        # Runs in whichever thread frees the last view: hence the lock.
        weakref.finalize(view, self._give_back, arena)
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(view, dtype=torch.uint8)

    def _give_back(self, arena: _Arena) -> None:
        drop: list[_Arena] = []
        with self.lock:
            self.busy.pop(arena.base, None)
            self.free[arena.serial] = arena
            total = sum(a.nbytes for a in self.free.values())
            # Keep the largest arenas: they fit the most requests.
            for a in sorted(self.free.values(), key=lambda a: a.nbytes):
                if total <= self.keep_free_bytes:
                    break
                del self.free[a.serial]
                total -= a.nbytes
                drop.append(a)
        for a in drop:
            a.close()

    def describe(self, view: torch.Tensor) -> ArenaRef | None:
        base = view.untyped_storage().data_ptr()
        with self.lock:
            arena = self.busy.get(base)
        if arena is None:
            return None
        return ArenaRef(
            os.getpid(), _token, arena.serial, arena.fd, arena.nbytes, view.data_ptr() - base
        )


_pool = _Pool()
_token = int.from_bytes(os.urandom(7), "little")
_maps: dict[tuple[int, int], OrderedDict[int, torch.Tensor]] = {}  # (pid, token) -> serial -> map
_maps_lock = threading.Lock()


def _after_fork() -> None:
    # A forked child owns none of the parent's arenas and is another process.
    global _pool, _token
    _pool = _Pool()
    _token = int.from_bytes(os.urandom(7), "little")
    _maps.clear()


os.register_at_fork(after_in_child=_after_fork)


def arena_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` on a pooled arena (see the module docstring)."""
    return _pool.take(int(nbytes))


def describe(view: torch.Tensor) -> ArenaRef | None:
    """Where ``view`` lives, if it is a view of a tensor from ``arena_empty``."""
    if view.device.type != "cpu":
        return None
    return _pool.describe(view)


def set_keep_free_bytes(nbytes: int) -> None:
    """Keep at most ``nbytes`` of free arenas in the pool (the rest is unmapped)."""
    with _pool.lock:
        _pool.keep_free_bytes = int(nbytes)


def pool_stats() -> dict[str, int]:
    with _pool.lock:
        return {
            "free_arenas": len(_pool.free),
            "free_bytes": sum(a.nbytes for a in _pool.free.values()),
            "busy_arenas": len(_pool.busy),
            "busy_bytes": sum(a.nbytes for a in _pool.busy.values()),
        }


def map_peer(ref: ArenaRef) -> torch.Tensor:
    """The whole arena ``ref`` names (a peer's) as a uint8 tensor, cached (see the
    module docstring). Raises ``OSError`` when it cannot be opened or mapped."""
    pid, serial, fd, nbytes = ref.pid, ref.serial, ref.fd, ref.nbytes
    with _maps_lock:
        cache = _maps.setdefault((pid, ref.token), OrderedDict())
        t = cache.get(serial)
        if t is not None:
            cache.move_to_end(serial)
            return t
    fd_here = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        if os.fstat(fd_here).st_size < nbytes:
            raise OSError(f"arena {serial} of pid {pid} is smaller than {nbytes} bytes")
        mm = mmap.mmap(fd_here, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd_here)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    with _maps_lock:
        cache = _maps.setdefault((pid, ref.token), OrderedDict())
        cache[serial] = t
        while len(cache) > _MAPS_PER_PEER:
            cache.popitem(last=False)
    return t


def forget_peer(pid: int) -> None:
    """Drop every cached mapping of ``pid``'s arenas (the peer exited or left)."""
    with _maps_lock:
        for key in [k for k in _maps if k[0] == pid]:
            del _maps[key]
