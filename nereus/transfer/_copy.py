"""One copy of a tensor's bytes into another, at the memory's speed.

``copy_into(dst, src)`` has ``dst.copy_(src)``'s meaning. What it adds is how large
contiguous pairs are copied: pairs of the same dtype, both contiguous and at least
``MEMMOVE_MIN_BYTES`` long, go through the C library's ``memmove`` (the call releases
the GIL), everything else through ``torch``'s ``copy_``.

Promises: the bytes of ``src`` are in ``dst`` when a call returns; ``src`` is not
changed. Refuses what ``copy_`` refuses (shapes that do not broadcast); the memmove and
row-block paths are taken only for pairs of one shape and dtype, so they never write
outside ``dst``. ``copy_pairs`` assumes the destinations do not overlap (the order of
its copies is its own).

More (why, and how): docs/transfer.md; measured speeds in BENCHMARKS.md.
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
    if (
        nbytes >= MEMMOVE_MIN_BYTES
        and dst.dtype == src.dtype
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
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
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_size_t,
                ctypes.c_size_t,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
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
    if (
        src.dim() != 2
        or src.device.type != "cpu"
        or src.shape[0] < 2
        or src.stride(1) != 1
        or src.is_contiguous()
    ):
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
        if (
            key is None
            or dst.shape != src.shape
            or dst.dtype != src.dtype
            or dst.device.type != "cpu"
            or dst.stride(1) != 1
        ):
            rest.append((src, dst))
        else:
            groups.setdefault(key, []).append((src, dst))
    for (base, row_bytes, first, rows, item), members in groups.items():
        if len(members) < 2:
            rest.extend(members)
            continue
        k = len(members)
        start = base + first * row_bytes
        _row_blocks(
            start,
            rows,
            row_bytes,
            k,
            (ctypes.c_void_p * k)(*[d.data_ptr() for _, d in members]),
            (ctypes.c_size_t * k)(*[d.stride(0) * item for _, d in members]),
            (ctypes.c_size_t * k)(*[s.data_ptr() - start for s, _ in members]),
            (ctypes.c_size_t * k)(*[s.shape[1] * item for s, _ in members]),
        )
    for src, dst in rest:
        copy_into(dst, src)
