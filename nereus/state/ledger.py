"""Each device's memory account: the one thing memory budgets are enforced against.

Promises:
- One ledger per device per process (``device_ledger()``), shared by the shard store and
  every engine in the worker, so co-resident model-stages count against one budget.
- ``reserve(key, nbytes)`` replaces an earlier reservation under the same key (a KV cache
  that grows is re-reserved at its new size, not added twice); ``release(key)`` frees
  it; ``update(sizes, release)`` sets and frees several at once (a recount, checked
  against the budget as a whole and only when it grows).
- A high-water mark: ``peak_bytes`` is the most the device held since the ledger was made
  or since ``reset_peak()`` (which sets it to what is held now). Steps and transitions
  report it; the planner calibrates its memory model against it.
- ``used_bytes`` / ``breakdown()`` say what is held and by whom.

Refuses: negative sizes (``ConfigError``); reservations past the budget (``OutOfMemory``;
the earlier reservation under that key, if any, is kept).

Never: measures the process's real RSS (that includes the interpreter and torch's
allocator caches and is not what the planner's memory model predicts). No torch here.

More (how it works): docs/state.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

from nereus.config import require
from nereus.errors import OutOfMemory

__all__ = ["MemoryLedger", "device_ledger"]

log = logging.getLogger("nereus.state")


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
        self._used = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def peak_bytes(self) -> int:
        """The most this device held since the ledger was made or ``reset_peak``."""
        with self._lock:
            return self._peak

    def reset_peak(self) -> int:
        """Start a new high-water mark at what is held now; returns the old peak."""
        with self._lock:
            old, self._peak = self._peak, self._used
            return old

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

    def report(self) -> dict[str, object]:
        """Budget, used and peak bytes and the breakdown, as plain data (for endpoints)."""
        with self._lock:
            return {
                "device": self.device,
                "budget_bytes": self.budget_bytes,
                "used_bytes": self._used,
                "peak_bytes": self._peak,
                "breakdown": dict(self._held),
            }

    def fits(self, nbytes: int, key: str | None = None) -> bool:
        """Whether reserving ``nbytes`` under ``key`` (replacing its current size) fits."""
        if self.budget_bytes is None:
            return True
        with self._lock:
            others = self._used - self._held.get(key, 0) if key is not None else self._used
        return others + nbytes <= self.budget_bytes

    def _commit(self, need: int, what: str) -> None:
        # caller holds the lock
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise OutOfMemory(self.device, need, self.budget_bytes, what=what)

    def reserve(self, key: str, nbytes: int) -> None:
        """Hold ``nbytes`` under ``key`` (replacing what ``key`` held before).

        Raises ``OutOfMemory`` (device, bytes the device would need, budget, key) when the
        device's total would pass its budget; the ledger is then unchanged."""
        require(nbytes >= 0, f"MemoryLedger.reserve({key!r}).nbytes", nbytes, "must be >= 0")
        nbytes = int(nbytes)
        with self._lock:
            need = self._used - self._held.get(key, 0) + nbytes
            self._commit(need, key)
            self._held[key] = nbytes
            self._used = need
            self._peak = max(self._peak, need)
        log.debug("device %s: reserved %d bytes for %s (%d held)", self.device, nbytes, key, need)

    def update(self, sizes: Mapping[str, int], release: Iterable[str] = (), what: str = "") -> None:
        """Set the reservations in ``sizes`` and free those in ``release`` at once, checked
        against the budget once, as a whole (a recount of what an owner holds)."""
        bad = [k for k, v in sizes.items() if v < 0]
        require(not bad, "MemoryLedger.update.sizes", bad, "must all be >= 0")
        with self._lock:
            held = dict(self._held)
            for k in release:
                held.pop(k, None)
            held.update({k: int(v) for k, v in sizes.items()})
            need = sum(held.values())
            if need > self._used:
                self._commit(need, what or ", ".join(sorted(sizes)))
            self._held = held
            self._used = need
            self._peak = max(self._peak, need)

    def release(self, key: str) -> int:
        """Free what ``key`` held; returns the bytes freed (0 if it held nothing)."""
        with self._lock:
            freed = self._held.pop(key, 0)
            self._used -= freed
            return freed

    def release_prefix(self, prefix: str) -> int:
        """Free every reservation whose key starts with ``prefix`` (an engine closing)."""
        with self._lock:
            keys = [k for k in self._held if k.startswith(prefix)]
            freed = sum(self._held.pop(k) for k in keys)
            self._used -= freed
            return freed


_LEDGERS: dict[str, MemoryLedger] = {}
_LEDGERS_LOCK = threading.Lock()


def _current_device() -> tuple[str | int, int | None]:
    """(device index, budget) of this worker, or ("local", None) outside a worker."""
    from nereus.actors.actor import current_device

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

    ``budget_bytes`` given explicitly sets the budget of a ledger the first time it is
    made; a later call with a different budget for the same device is refused, because
    everything on one device must see one budget."""
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
