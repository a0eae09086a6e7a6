"""Tap events of the data plane: one function, ``emit``, and local listeners.

Events go to the controller's monitoring tap through ``nereus.actors.emit`` when the
actor runtime provides it (inside a cluster); outside a cluster they are logged at
debug level. ``add_listener`` lets a process observe its own events (tests, the
benchmark) without a cluster. Event types and fields follow nereus.monitor's schema
by name: ``transfer_bucket`` (bytes, seconds, gbps, src, dst) and
``stuck_collective`` (group, op, missing_ranks, seconds).

Never raises because no one listens; a listener that raises is a bug and propagates.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["emit", "add_listener", "remove_listener"]

log = logging.getLogger("nereus.transfer")

_listeners: list[Callable[[dict[str, Any]], None]] = []
_lock = threading.Lock()


def add_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    """Call ``fn(event)`` for every data-plane event this process emits."""
    with _lock:
        _listeners.append(fn)


def remove_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)


def emit(type: str, **fields: Any) -> None:  # noqa: A002 - the tap's field is called type
    """Publish one event (see the module docstring)."""
    event = {"type": type, **fields}
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        fn(dict(event))
    import nereus.actors as actors  # the layer below; resolved late as it may grow

    runtime_emit = getattr(actors, "emit", None)
    if runtime_emit is not None:
        runtime_emit(type, **fields)
    else:
        log.debug("tap event %s (no actor runtime): %s", type, fields)
