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

Promises: the bytes of ``src`` are in ``dst`` when it returns; ``src`` is not changed.
Refuses what ``copy_`` refuses (shapes that do not broadcast); the memmove path is
taken only for pairs of one shape and dtype, so it never writes outside ``dst``.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["copy_into", "MEMMOVE_MIN_BYTES"]

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
