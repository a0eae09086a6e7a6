"""Memory accounting against a device's budget: what makes memory pressure real on CPU.

On a GPU the allocator fails when memory runs out; on a CPU-only machine a "device" is a
worker process with a configured budget (``--memory-per-device``), and nothing fails by
itself. So every engine reserves, before it allocates, the bytes of what it is about to
hold (weights, KV cache, gradients, optimizer moments, activations of a step) in the
process's ``MemoryLedger`` for its device. A reservation that would take the device past
its budget raises ``nereus.errors.OutOfMemory`` naming the device, the bytes the device
would then need and the budget, before anything is allocated.

Promises:
- One ledger per device per process (``device_ledger()``), shared by every engine in the
  worker, so co-resident model-stages (policy-generation and policy-training on the same
  device) count against the same budget.
- ``reserve(key, nbytes)`` replaces an earlier reservation under the same key (a KV cache
  that grows is re-reserved at its new size, not added twice); ``release(key)`` frees it.
- ``used_bytes`` / ``breakdown()`` say what is held and by whom, for the tap and the
  planner's calibration.

Refuses: negative sizes (``ConfigError``); reservations past the budget (``OutOfMemory``;
the earlier reservation under that key, if any, is kept).

Never: measures the process's real RSS (that includes the interpreter and torch's
allocator caches and is not what the planner's memory model predicts).
"""

from __future__ import annotations

import logging
import threading

import torch

from nereus.config import require
from nereus.errors import OutOfMemory

__all__ = ["MemoryLedger", "device_ledger", "tensor_bytes", "tensors_bytes"]

log = logging.getLogger("nereus.engines")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (not of its storage: views count what they show)."""
    return t.numel() * t.element_size()


def tensors_bytes(tensors) -> int:
    """Bytes of every tensor in an iterable (parameters, buffers, a state dict's values)."""
    return sum(tensor_bytes(t) for t in tensors)


class MemoryLedger:
    """Reservations held on one device against its budget (``None`` = unlimited)."""

    def __init__(self, device: str | int, budget_bytes: int | None) -> None:
        require(
            budget_bytes is None or budget_bytes > 0,
            "MemoryLedger.budget_bytes",
            budget_bytes,
            "must be > 0 or None (unlimited)",
        )
        self.device = device
        self.budget_bytes = budget_bytes
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    @property
    def free_bytes(self) -> int | None:
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.used_bytes

    def held(self, key: str) -> int:
        with self._lock:
            return self._held.get(key, 0)

    def breakdown(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)

    def fits(self, nbytes: int, key: str | None = None) -> bool:
        """Whether reserving ``nbytes`` under ``key`` (replacing its current size) fits."""
        if self.budget_bytes is None:
            return True
        with self._lock:
            others = sum(v for k, v in self._held.items() if k != key)
        return others + nbytes <= self.budget_bytes

    def reserve(self, key: str, nbytes: int) -> None:
        """Hold ``nbytes`` under ``key`` (replacing what ``key`` held before).

        Raises ``OutOfMemory`` (device, bytes the device would need, budget, key) when the
        device's total would pass its budget; the ledger is then unchanged."""
        require(nbytes >= 0, f"MemoryLedger.reserve({key!r}).nbytes", nbytes, "must be >= 0")
        with self._lock:
            others = sum(v for k, v in self._held.items() if k != key)
            need = others + int(nbytes)
            if self.budget_bytes is not None and need > self.budget_bytes:
                raise OutOfMemory(self.device, need, self.budget_bytes, what=key)
            self._held[key] = int(nbytes)
        log.debug("device %s: reserved %d bytes for %s (%d held)", self.device, nbytes, key, need)

    def release(self, key: str) -> int:
        """Free what ``key`` held; returns the bytes freed (0 if it held nothing)."""
        with self._lock:
            return self._held.pop(key, 0)

    def release_prefix(self, prefix: str) -> int:
        """Free every reservation whose key starts with ``prefix`` (an engine closing)."""
        with self._lock:
            keys = [k for k in self._held if k.startswith(prefix)]
            return sum(self._held.pop(k) for k in keys)


_LEDGERS: dict[str, MemoryLedger] = {}
_LEDGERS_LOCK = threading.Lock()


def _current_device() -> tuple[str | int, int | None]:
    """(device index, budget) of this worker, or ("local", None) outside a worker."""
    try:
        from nereus.actors import current_device
    except ImportError:
        return "local", None
    try:
        dev = current_device()
    except Exception as e:  # outside a worker process there is no device: unlimited budget
        log.debug("no current device (%s): unlimited memory budget", e)
        return "local", None
    if dev is None:
        return "local", None
    budget = getattr(dev, "memory_bytes", None)
    return getattr(dev, "index", "local"), (int(budget) if budget else None)


def device_ledger(device: str | int | None = None, budget_bytes: int | None = None) -> MemoryLedger:
    """The process's ledger for ``device`` (default: this worker's current device, whose
    ``memory_bytes`` is the budget; outside a worker, an unlimited "local" device).

    ``budget_bytes`` given explicitly sets (or tightens) the budget of a ledger the first
    time it is made; a later call with a different budget for the same device is refused,
    because two engines on one device must see one budget."""
    if device is None:
        device, found = _current_device()
        if budget_bytes is None:
            budget_bytes = found
    key = str(device)
    with _LEDGERS_LOCK:
        ledger = _LEDGERS.get(key)
        if ledger is None:
            ledger = MemoryLedger(device, budget_bytes)
            _LEDGERS[key] = ledger
        else:
            require(
                budget_bytes is None or budget_bytes == ledger.budget_bytes,
                f"device_ledger({device!r}).budget_bytes",
                budget_bytes,
                f"must match the device's existing budget {ledger.budget_bytes}",
            )
        return ledger
