"""A ZeroMQ socket driven by the event loop, with signing, verification and counters.

Promises: every message sent is signed (``nereus.actors._wire.Signer``) and carries
the session envelope (``nereus.actors._session``: sender, receiver, sequence number);
every message received is checked before anything else reads it. A message that is
too large, has a bad signature, is a replay or is addressed elsewhere
(``rejected_replay``, ``rejected_receiver``), or has a malformed header is counted in
``Counters`` under its reason, logged (rate-limited) and dropped; the handler is never
called with it and the loop never sees an exception from it. An exception raised by
the handler is logged with its traceback and counted as ``handler_error``; the channel
keeps running.

Handshake: a DEALER channel sends HELLO when it is made and holds what it is asked to
send until the WELCOME arrives (then READY, then the held messages, in order); a
ROUTER channel answers every HELLO. Handlers never see the handshake.

Refuses: blocking sends. A direct send that would block raises ``zmq.ZMQError`` to
the caller; a queued one that fails is logged and counted (``send_failed``).

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
from zmq.backend import Socket as _RawSocket

from nereus.actors import _session, _wire
from nereus.actors._protocol import BATCH, HELLO, READY, WELCOME
from nereus.actors._session import ANY, Refused, Session
from nereus.errors import AuthenticationError, ProtocolError

__all__ = ["Channel", "Counters", "DEFAULT_MAX_MESSAGE_BYTES", "RECEIVE_HWM", "configure"]

log = logging.getLogger("nereus.actors")

DEFAULT_MAX_MESSAGE_BYTES = 4 << 30  # 4 GiB: above any single argument we expect
_COPY_THRESHOLD = 65536  # smaller frames are cheaper to copy than to pin
_BATCH_PREFIX = msgpack.packb([BATCH, [], []])[:2]  # fixarray(3), then the kind
_HELLO = msgpack.packb([HELLO])
_READY = msgpack.packb([READY])
RECEIVE_HWM = 10_000  # messages queued per peer before libzmq stops reading from it
# Plain ints and the Cython methods: pyzmq's enum flags and Python wrappers cost more
# than the send itself on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_raw_send = _RawSocket.send
_raw_recv = _RawSocket.recv
_raw_get = _RawSocket.get


# handshakes: HELLOs a serving channel answered; welcomes: WELCOMEs a connecting one took
_TRAFFIC = frozenset({"messages", "batches", "stream_messages", "handshakes", "welcomes"})


def configure(
    sock: zmq.Socket, max_message_bytes: int, receive_hwm: int = RECEIVE_HWM
) -> zmq.Socket:
    """Bound what ``sock`` buffers for its peers before anything is verified: frames
    up to ``max_message_bytes`` (a larger one disconnects its sender) and ``receive_hwm``
    messages per peer. Sends stay unbounded (our own messages, never refused)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
    sock.setsockopt(zmq.RCVHWM, int(receive_hwm))
    sock.setsockopt(zmq.SNDHWM, 0)
    return sock


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

    def problems(self) -> dict[str, int]:
        """The counters that are not plain traffic (what is worth an event when it moves)."""
        return {k: v for k, v in self.values.items() if k not in _TRAFFIC}


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
        self.is_router = sock.type == zmq.ROUTER
        self._init_common(key, handler, counters, loop, max_message_bytes, serving=self.is_router)
        self._fd = sock.getsockopt(zmq.FD)
        self.loop.add_reader(self._fd, self._on_readable)
        if not self.is_router:
            self._send_now(None, _HELLO, ())
        # Messages may already be waiting (edge already fired before add_reader).
        self.loop.call_soon(self._drain)

    def _init_common(
        self,
        key: bytes,
        handler: Callable[[bytes | None, Any], None],
        counters: Counters,
        loop: asyncio.AbstractEventLoop | None,
        max_message_bytes: int,
        serving: bool,
    ) -> None:
        """The state every channel has, whatever carries its bytes (``_stream`` too)."""
        self.session = Session(serving)
        self._held: list[tuple[bytes | None, bytes, Sequence[Any]]] = []  # before WELCOME
        self.key = key
        self.handler = handler
        self.counters = counters
        self.max_message_bytes = max_message_bytes
        self.loop = loop or asyncio.get_running_loop()
        self.closed = False
        self._outbox: list[tuple[bytes | None, bytes, Sequence[Any]]] = []
        self._flush_scheduled = False  # the end-of-iteration callback is scheduled
        self._sent_at_once = False  # a message left directly since the last flush
        self._unchecked = False  # a send or receive happened since a look saw no input
        self._encoder = _wire.Encoder()  # used on the loop's thread only
        self._signer = _wire.Signer(key)

    # -- sending -------------------------------------------------------------------

    def send(self, obj: Any, ident: bytes | None = None) -> None:
        """Encode, sign and send ``obj``; ``ident`` routes it on a ROUTER socket."""
        header, buffers = self._encoder.encode(obj)
        self.send_encoded(header, buffers, ident)

    def send_encoded(
        self, header: bytes, buffers: Sequence[Any], ident: bytes | None = None
    ) -> None:
        if self.closed:
            raise ProtocolError("channel is closed")
        if not self.session.bound:
            self._held.append((ident, header, buffers))
            return
        if self._sent_at_once:
            self._outbox.append((ident, header, buffers))
            return
        self._sent_at_once = True
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)
        self._send_now(ident, header, buffers)

    def _send_now(
        self,
        ident: bytes | None,
        header: bytes,
        buffers: Sequence[Any],
        envelope: bytes | None = None,
    ) -> None:
        if envelope is None:
            envelope = self.session.outgoing(ident)
            if envelope is None:
                self._no_route(ident)
                return
        first = b"".join((self._signer.sign(header, buffers, envelope), envelope, header))
        sock = self.sock
        self._unchecked = True
        if ident is not None:
            _raw_send(sock, ident, _MORE_NOBLOCK, True, False)
        if not buffers:
            _raw_send(sock, first, _NOBLOCK, True, False)
            return
        _raw_send(sock, first, _MORE_NOBLOCK, True, False)
        last = len(buffers) - 1
        for i, b in enumerate(buffers):
            big = memoryview(b).nbytes >= _COPY_THRESHOLD
            _raw_send(sock, b, _MORE_NOBLOCK if i < last else _NOBLOCK, not big, False)

    def _no_route(self, ident: bytes | None) -> None:
        # A serving channel only answers peers whose messages it accepted.
        self.counters.add("send_failed")
        log.warning("no session with peer %r: message dropped", ident)

    def _flush(self) -> None:
        """End of a loop iteration: send what queued up, one BATCH per destination, then
        drain the input if a send or receive may have consumed the descriptor's edge."""
        self._flush_scheduled = False
        self._sent_at_once = False
        out = self._outbox
        if not out or self.closed:
            out.clear()
            if self._unchecked:
                self._drain()
            return
        self._outbox = []
        groups: dict[bytes | None, list] = {}
        for item in out:
            groups.setdefault(item[0], []).append(item)
        for ident, items in groups.items():
            try:
                if len(items) == 1:
                    self._send_now(ident, items[0][1], items[0][2])
                    continue
                headers = [h for _, h, _ in items]
                counts = [len(b) for _, _, b in items]
                buffers = [b for _, _, bufs in items for b in bufs]
                self._send_now(ident, msgpack.packb([BATCH, headers, counts]), buffers)
            except zmq.ZMQError as e:  # e.g. a caller that vanished (ROUTER_MANDATORY)
                self.counters.add("send_failed", len(items))
                log.warning("could not send %d queued message(s): %s", len(items), e)
        self._drain()

    # -- receiving -----------------------------------------------------------------

    def _on_readable(self) -> None:
        # A message is most likely waiting: receive and handle it, and leave the rest to
        # the end of the iteration (module docstring). A DEALER (one peer) receives
        # without asking ZMQ_EVENTS first. A ROUTER asks first: that makes libzmq take
        # in every pending peer before choosing whose message comes out, which keeps
        # the order between peers that register at once (Cluster.local numbers its
        # devices by the order its nodes register).
        self._drain(blind=not self.is_router, most=1)
        if not self._flush_scheduled and not self.closed:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _drain(self, blind: bool = False, most: int = -1) -> None:
        """Receive and handle messages until ZMQ_EVENTS shows no input, or ``most`` of
        them (then the socket stays unchecked). ``blind``: try a receive first."""
        sock = self.sock
        router = self.is_router
        while not self.closed:
            try:
                if blind:
                    blind = False
                    tried_blind = True
                elif not _raw_get(sock, _EVENTS) & _POLLIN:
                    self._unchecked = False
                    return
                else:
                    tried_blind = False
                # A ROUTER always prepends the sender's identity, so more frames follow it.
                ident = _raw_recv(sock, _NOBLOCK, True, False) if router else None
                frame = _raw_recv(sock, _NOBLOCK, False, False)
                frames = [frame]
                while frame.more:
                    frame = _raw_recv(sock, _NOBLOCK, False, False)
                    frames.append(frame)
            except zmq.Again:
                if tried_blind:  # the descriptor fired for a command, not a message
                    continue
                return
            except zmq.ZMQError as e:
                if self.closed or e.errno == zmq.ENOTSOCK:
                    return
                raise
            self._unchecked = True
            self._receive(ident, frames)
            most -= 1
            if not most:
                return

    def _receive(self, ident: bytes | None, frames: list[Any]) -> None:
        values = self.counters.values
        values["messages"] = values.get("messages", 0) + 1
        size = 0
        for f in frames:
            size += len(f)
        if size > self.max_message_bytes:
            self.counters.reject("oversized", f"{size} bytes > limit {self.max_message_bytes}")
            return
        try:
            head = self._signer.verify(frames)
        except AuthenticationError as e:
            self.counters.reject("signature", str(e))
            return
        except ProtocolError as e:
            self.counters.reject("short", str(e))
            return
        try:
            header = self._admit(ident, head)
        except Refused as e:
            self.counters.reject(e.reason, str(e))
            return
        if header is None:  # the handshake, handled here
            return
        if header[:2] == _BATCH_PREFIX:
            self._receive_batch(ident, header, frames[1:])
            return
        try:
            msg = _wire.decode(header, frames[1:])
        except ProtocolError as e:
            self.counters.reject("header", str(e))
            return
        self._handle(ident, msg)

    def _admit(self, ident: bytes | None, head: memoryview) -> memoryview | None:
        """The header of a fresh message, None for a handshake message (answered here);
        raises ``Refused`` for a replayed, misaddressed or out-of-turn one."""
        sender, receiver, seq, header = _session.parse(head)
        session = self.session
        if session.serving:
            if receiver == ANY:
                if header != _HELLO:
                    raise Refused("unbound", "only a HELLO may come without a ticket")
                self.counters.add("handshakes")
                welcome = msgpack.packb([WELCOME, session.issue()])
                try:
                    self._send_now(ident, welcome, (), session.to(sender))
                except zmq.ZMQError as e:  # the peer left again
                    self.counters.add("send_failed")
                    log.info("could not answer a HELLO: %s", e)
                return None
            session.accept(ident, sender, receiver, seq)
            if header == _READY:
                self._ready(ident)
                return None
            return header
        if session.server is None:
            try:
                welcome = msgpack.unpackb(header, raw=False)
            except (
                ValueError,
                TypeError,
                msgpack.ExtraData,
                msgpack.FormatError,
                msgpack.StackError,
            ) as e:
                raise Refused("header", f"malformed WELCOME: {e}") from None
            if type(welcome) is not list or len(welcome) != 2 or welcome[0] != WELCOME:
                raise Refused("unbound", "a message before the WELCOME")
            session.welcomed(sender, receiver, seq, welcome[1])
            self.counters.add("welcomes")
            self._send_now(None, _READY, ())
            held, self._held = self._held, []
            for item in held:
                self.send_encoded(item[1], item[2], item[0])
            return None
        session.accept(None, sender, receiver, seq)
        return header

    def _ready(self, ident: bytes | None) -> None:
        """A peer's READY was accepted (its first message under its ticket)."""

    def _receive_batch(self, ident: bytes | None, header: bytes, buffers: list[Any]) -> None:
        try:
            batch = msgpack.unpackb(header, raw=False)
            _, headers, counts = batch
            if (
                len(headers) != len(counts)
                or sum(counts) != len(buffers)
                or not all(type(h) is bytes for h in headers)
                or not all(type(c) is int and c >= 0 for c in counts)
            ):
                raise ValueError("batch headers, counts and buffers do not line up")
        except (
            ValueError,
            TypeError,
            msgpack.ExtraData,
            msgpack.FormatError,
            msgpack.StackError,
        ) as e:
            self.counters.reject("header", f"malformed batch: {e}")
            return
        self.counters.add("batches")
        start = 0
        for sub, n in zip(headers, counts, strict=True):
            try:
                msg = _wire.decode(sub, buffers[start : start + n])
            except ProtocolError as e:
                self.counters.reject("header", str(e))
                msg = None
            start += n
            if msg is not None:
                self._handle(ident, msg)

    def _handle(self, ident: bytes | None, msg: Any) -> None:
        try:
            self.handler(ident, msg)
        except Exception:
            # A handler bug must not kill the channel; it is logged with its traceback.
            self.counters.add("handler_error")
            log.exception(
                "message handler failed on a message of kind %r",
                msg[0] if isinstance(msg, list) and msg else type(msg).__name__,
            )

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket. With ``linger_ms`` > 0, what was sent or queued still goes
        out (for up to that long, in libzmq's background; this never blocks)."""
        if self.closed:
            return
        if self._held:
            self.counters.add("send_failed", len(self._held))
            self._held.clear()
        if linger_ms > 0 and self._outbox:
            self._flush_scheduled = False
            out, self._outbox = self._outbox, []
            for ident, header, buffers in out:
                try:
                    self._send_now(ident, header, buffers)
                except zmq.ZMQError as e:
                    self.counters.add("send_failed")
                    log.debug("dropped a queued message on close: %s", e)
        self.closed = True
        try:
            self.loop.remove_reader(self._fd)
        except (ValueError, OSError, RuntimeError) as e:  # loop already closed
            log.debug("remove_reader on close: %s", e)
        self.sock.close(linger=linger_ms)
