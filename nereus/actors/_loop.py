"""The event loop every nereus process runs on: uvloop where it is installed.

``run(coro)`` is ``uvloop.run`` when uvloop imports (Linux, macOS) and ``asyncio.run``
otherwise (Windows); it returns the coroutine's result. Drivers, the controller, node
daemons and workers all start through it, so they share one choice of loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh event loop (uvloop where available)."""
    try:
        import uvloop
    except ImportError:  # uvloop is optional (Windows)
        return asyncio.run(main)
    return uvloop.run(main)
