"""One copy of a tensor's bytes into another, at the memory's speed.

``copy_into(dst, src)`` has ``dst.copy_(src)``'s meaning. What it adds is how large
contiguous pairs are copied: pairs of the same dtype, both contiguous and at least
``MEMMOVE_MIN_BYTES`` long, go through the C library's ``memmove`` (the call releases
the GIL), everything else through ``torch``'s ``copy_``.

Why: torch's CPU copy kernel stores through the cache, so every destination line is
read before it is written: a copy of memory larger than the cache moves three bytes
for each byte copied. glibc's ``memmove`` uses non-temporal stores (no read of the
destination) above its ``x86_non_temporal_threshold`` tunable, which the node daemon
sets to 256 KiB for CPU workers unless the environment already sets it
(``nereus.node``): the shards a reshard writes are far larger than the cache and are
not read again soon. Measured with two workers copying at once (1-2 MiB pieces,
238 MiB each): ~7.8 GB/s per worker with ``copy_``, ~9.9 GB/s with non-temporal
``memmove`` (BENCHMARKS.md). Without the tunable (another C library, or a process not
started by a node), ``memmove`` copies at about ``copy_``'s speed.

``copy_pairs(pairs)`` copies many ``(src, dst)`` pairs. Pairs whose sources are column
blocks of the same rows of one tensor (a row-parallel weight cut for several peers:
each block alone is a strided box, and copying the blocks one after the other reads
every source row once per block at about half the contiguous rate) go through one
native pass over those rows (``nereus/transfer/_rows.c``, built at install; non-temporal
stores), which copies the blocks of one source in about the time of a contiguous copy
(24 groups of two blocks, 49 MiB: 2.9 ms against 6.5-7.2 ms). The rest go through
``copy_into``. ``source_rows(src)`` is the key that groups them. Without the native
library (no C compiler at install) or with ``NEREUS_ROW_BLOCKS=0``, every pair goes
through ``copy_into``.

Promises: the bytes of ``src`` are in ``dst`` when a call returns; ``src`` is not
changed. Refuses what ``copy_`` refuses (shapes that do not broadcast); the memmove and
row-block paths are taken only for pairs of one shape and dtype, so they never write
outside ``dst``. ``copy_pairs`` assumes the destinations do not overlap (the order of
its copies is its own).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from collections.abc import Sequence

import torch

__all__ = ["copy_into", "copy_pairs", "source_rows", "row_blocks_available", "MEMMOVE_MIN_BYTES"]

MEMMOVE_MIN_BYTES = 1 << 18

_memmove = ctypes.CDLL(None).memmove
_memmove.restype = ctypes.c_void_p
_memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (``dst.copy_(src)``); returns ``dst``."""
    nbytes = src.numel() * src.element_size()
    if (nbytes >= MEMMOVE_MIN_BYTES and dst.dtype == src.dtype and dst.device.type == "cpu"
            and src.device.type == "cpu" and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous()):
        _memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return dst
    return dst.copy_(src)


def _load_row_blocks():
    if os.environ.get("NEREUS_ROW_BLOCKS", "1") == "0":
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_rows" + suffix)
        if os.path.exists(path):
            fn = ctypes.CDLL(path).nereus_copy_row_blocks
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            return fn
    return None


_row_blocks = _load_row_blocks()


def row_blocks_available() -> bool:
    """Whether the native row-block copy was built and is on."""
    return _row_blocks is not None


def source_rows(src: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """Which rows of which tensor ``src`` is a column block of: (storage address, row
    bytes, first row, rows, item size), or None where ``src`` is not a strided 2-D CPU
    view with contiguous rows (nothing to gain from sharing its rows)."""
    if (src.dim() != 2 or src.device.type != "cpu" or src.shape[0] < 2 or src.stride(1) != 1
            or src.is_contiguous()):
        return None
    item = src.element_size()
    base = src.untyped_storage().data_ptr()
    row_bytes = src.stride(0) * item
    return base, row_bytes, (src.data_ptr() - base) // row_bytes, src.shape[0], item


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every ``(src, dst)`` pair: column blocks of one source's rows in one native
    pass, the rest with ``copy_into`` (see the module docstring)."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    rest: list[tuple[torch.Tensor, torch.Tensor]] = []
    for src, dst in pairs:
        key = source_rows(src) if _row_blocks is not None else None
        if key is None or dst.shape != src.shape or dst.dtype != src.dtype or dst.device.type != "cpu" \
                or dst.stride(1) != 1:
            rest.append((src, dst))
        else:
            groups.setdefault(key, []).append((src, dst))
    for (base, row_bytes, first, rows, item), members in groups.items():
        if len(members) < 2:
            rest.extend(members)
            continue
        k = len(members)
        start = base + first * row_bytes
        _row_blocks(start, rows, row_bytes, k,
                    (ctypes.c_void_p * k)(*[d.data_ptr() for _, d in members]),
                    (ctypes.c_size_t * k)(*[d.stride(0) * item for _, d in members]),
                    (ctypes.c_size_t * k)(*[s.data_ptr() - start for s, _ in members]),
                    (ctypes.c_size_t * k)(*[s.shape[1] * item for s, _ in members]))
    for src, dst in rest:
        copy_into(dst, src)
