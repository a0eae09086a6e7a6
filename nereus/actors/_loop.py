"""The event loop every nereus process runs on: uvloop where it is installed.

``run(coro)`` is ``uvloop.run`` when uvloop imports (Linux, macOS) and ``asyncio.run``
otherwise (Windows); it returns the coroutine's result. Drivers, the controller, node
daemons and workers all start through it, so they share one choice of loop.

``in_thread(fn, *args)`` runs blocking work off the loop, as ``asyncio.to_thread``, and
hands its result over without leaving it on the thread's future: the loop may keep a
finished future alive past the call, and a result held there (new tensors, a pooled
arena under them) would not be freed when its owner drops it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run", "in_thread"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh event loop (uvloop where available)."""
    try:
        import uvloop
    except ImportError:  # uvloop is optional (Windows)
        return asyncio.run(main)
    return uvloop.run(main)


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a worker thread (see the module docstring)."""
    box: list[T] = []
    await asyncio.to_thread(lambda: box.append(fn(*args, **kwargs)))
    return box.pop()
