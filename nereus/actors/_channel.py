"""A ZeroMQ socket driven by the event loop, with signing, verification and counters.

``Channel`` wraps one non-blocking zmq socket (ROUTER or DEALER). It registers the
socket's file descriptor with the running loop (``add_reader``) instead of using
``zmq.asyncio``, so a received message costs one callback and no future or task.
ZeroMQ's descriptor is edge-triggered: every path that may consume the edge (a
receive or a send) drains the socket until it reports no more input.

Promises: every message sent is signed (``nereus.actors._wire.sign``); every message
received is checked before anything else reads it. A message that is too large, has
a bad signature or a malformed header is counted in ``Counters`` under its reason,
logged (rate-limited) and dropped; the handler is never called with it and the loop
never sees an exception from it. An exception raised by the handler is logged with
its traceback and counted as ``handler_error``; the channel keeps running.

Refuses: blocking sends. A send that would block (peer gone, high-water mark) raises
``zmq.Again`` to the caller, which decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from nereus.actors import _wire
from nereus.errors import AuthenticationError, ProtocolError

__all__ = ["Channel", "Counters", "DEFAULT_MAX_MESSAGE_BYTES"]

log = logging.getLogger("nereus.actors")

DEFAULT_MAX_MESSAGE_BYTES = 4 << 30  # 4 GiB: above any single argument we expect
_COPY_THRESHOLD = 65536  # smaller frames are cheaper to copy than to pin


class Counters:
    """Counts of rejected frames by reason, plus totals; plain dict underneath."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self._last_log = 0.0
        self._suppressed = 0

    def add(self, reason: str, n: int = 1) -> None:
        self.values[reason] = self.values.get(reason, 0) + n

    def reject(self, reason: str, detail: str) -> None:
        """Count and log (at most ~2 lines a second) one rejected message."""
        self.add("rejected")
        self.add("rejected_" + reason)
        now = time.monotonic()
        if now - self._last_log >= 0.5:
            extra = f" ({self._suppressed} more since last report)" if self._suppressed else ""
            log.warning("rejected a message (%s): %s%s", reason, detail[:300], extra)
            self._last_log = now
            self._suppressed = 0
        else:
            self._suppressed += 1

    def snapshot(self) -> dict[str, int]:
        return dict(self.values)


class Channel:
    """One zmq socket on the loop. ``handler(ident, msg, frames)`` gets verified messages:
    ``ident`` is the ROUTER identity (``None`` on a DEALER), ``msg`` the decoded header,
    ``frames`` the raw frames (for callers that need the peer's buffers)."""

    def __init__(
        self,
        sock: zmq.Socket,
        key: bytes,
        handler: Callable[[bytes | None, Any], None],
        counters: Counters,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.sock = sock
        self.key = key
        self.handler = handler
        self.counters = counters
        self.max_message_bytes = max_message_bytes
        self.is_router = sock.type == zmq.ROUTER
        self.loop = loop or asyncio.get_running_loop()
        self.closed = False
        self._fd = sock.getsockopt(zmq.FD)
        self.loop.add_reader(self._fd, self._drain)
        # Messages may already be waiting (edge already fired before add_reader).
        self.loop.call_soon(self._drain)

    # -- sending -------------------------------------------------------------------

    def send(self, obj: Any, ident: bytes | None = None) -> None:
        """Encode, sign and send ``obj``; ``ident`` routes it on a ROUTER socket."""
        header, buffers = _wire.encode(obj)
        self.send_encoded(header, buffers, ident)

    def send_encoded(self, header: bytes, buffers: Sequence[Any], ident: bytes | None = None) -> None:
        if self.closed:
            raise ProtocolError("channel is closed")
        sig = _wire.sign(self.key, header, buffers)
        sock = self.sock
        if ident is not None:
            sock.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
        if buffers:
            sock.send(sig, zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
            last = len(buffers) - 1
            for i, b in enumerate(buffers):
                big = memoryview(b).nbytes >= _COPY_THRESHOLD
                sock.send(b, (zmq.SNDMORE if i < last else 0) | zmq.NOBLOCK, copy=not big)
        else:
            sock.send_multipart((sig, header), zmq.NOBLOCK)
        # A send can swallow the descriptor's edge: look for input now.
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.loop.call_soon(self._drain)

    # -- receiving -----------------------------------------------------------------

    def _drain(self) -> None:
        sock = self.sock
        while not self.closed:
            try:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if self.closed or e.errno == zmq.ENOTSOCK:
                    return
                raise
            self._receive(frames)

    def _receive(self, frames: list[Any]) -> None:
        values = self.counters.values
        values["messages"] = values.get("messages", 0) + 1
        ident = None
        if self.is_router:
            ident = frames[0].bytes
            frames = frames[1:]
        size = 0
        for f in frames:
            size += len(f)
        if size > self.max_message_bytes:
            self.counters.reject("oversized", f"{size} bytes > limit {self.max_message_bytes}")
            return
        try:
            _wire.verify(self.key, frames)
        except AuthenticationError as e:
            self.counters.reject("signature", str(e))
            return
        except ProtocolError as e:
            self.counters.reject("short", str(e))
            return
        try:
            msg = _wire.decode(frames[1].bytes, frames[2:])
        except ProtocolError as e:
            self.counters.reject("header", str(e))
            return
        try:
            self.handler(ident, msg)
        except Exception:
            # A handler bug must not kill the channel; it is logged with its traceback.
            self.counters.add("handler_error")
            log.exception("message handler failed on a message of kind %r",
                          msg[0] if isinstance(msg, list) and msg else type(msg).__name__)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.loop.remove_reader(self._fd)
        except (ValueError, OSError, RuntimeError) as e:  # loop already closed
            log.debug("remove_reader on close: %s", e)
        self.sock.close(linger=0)
