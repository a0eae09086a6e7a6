"""Same-host actor calls over a Unix stream socket read and written by the event loop.

Why: with ZeroMQ a round trip between two processes crosses six threads (each side's
loop, each side's zmq I/O thread); each wake-up costs tens of microseconds on an idle
machine. Here each process's loop thread reads and writes the socket itself: two
wake-ups per round trip.

Who uses it: a worker bound to ``ipc://PATH`` also listens on ``PATH + ".s"`` (mode
0600, removed when it exits; ``stream_path``). A ``Client`` connecting to an
``ipc://`` worker address tries that socket first and falls back to a ZeroMQ DEALER
when it cannot connect (an older worker, a path too long for a Unix socket). The
controller and tcp addresses always use ZeroMQ. ``NEREUS_STREAM=0`` in the environment
turns the stream off (clients do not try it, workers do not listen).

A lost connection is not a failed call: pending calls wait for the controller's
``worker_died`` notice (as on ZeroMQ) or their deadline; the client forgets the
connection and the next call connects again (or falls back to ZeroMQ).

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from nereus.actors._channel import _HELLO, DEFAULT_MAX_MESSAGE_BYTES, Channel, Counters
from nereus.actors._wire import SIGNATURE_BYTES

__all__ = ["StreamChannel", "stream_enabled", "stream_path", "IDENT_PREFIX"]

log = logging.getLogger("nereus.actors")

ENV = "NEREUS_STREAM"
IDENT_PREFIX = b"\xff"
_READ_BYTES = 256 * 1024
_BIG = 65536  # frames this large get their own buffer instead of a copy
_CONNECT_TIMEOUT_S = 1.0
# The frame-length table is read into memory before any check of the frames: bound it
# (8 MiB). A BATCH carries one frame per buffer of its calls; none comes near this.
_MAX_FRAMES = 1 << 20
PRE_AUTH_BYTES = 64 * 1024
_PRE_AUTH_FRAMES = 16
MAX_CONNECTIONS = 4096
MAX_UNTRUSTED = 32
TRUST_DEADLINE_S = 10.0
_COUNT = struct.Struct("<I")
_ONE = struct.Struct("<IQ")  # count 1, then the one frame's length


def stream_enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def stream_path(address: str) -> str | None:
    """The stream socket path of a worker's ``ipc://`` address; None for other addresses."""
    if not address.startswith("ipc://"):
        return None
    return address[len("ipc://") :] + ".s"


class _Peer(asyncio.BufferedProtocol):
    """One connection: writes frames, reassembles messages, hands them to the channel."""

    def __init__(self, channel: StreamChannel, ident: bytes | None) -> None:
        self.channel = channel
        self.ident = ident
        self.transport: asyncio.Transport | None = None
        self.lost = False
        # A client trusts the server it chose; a server trusts a connection once it
        # sent a fresh signed READY (until then messages are capped at PRE_AUTH_BYTES).
        self.trusted = ident is None
        self._expiry: asyncio.TimerHandle | None = None
        self._early: list[Any] = []  # written before the connection was made (client side)
        self._buf = bytearray(_READ_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._lens: tuple[int, ...] | None = None  # frame lengths of the message being read
        self._frames: list[Any] = []
        self._big: bytearray | None = None
        self._big_view: memoryview | None = None
        self._big_pos = 0

    # -- connection ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        early, self._early = self._early, []
        if early:
            transport.writelines(early)  # type: ignore[attr-defined]
        self.channel._made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.transport = None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._big = self._big_view = None
        self.channel._lost(self, exc)

    def write(self, chunks: Sequence[Any]) -> bool:
        t = self.transport
        if t is None:
            if self.lost:
                return False
            self._early.extend(chunks)
            return True
        if t.is_closing():
            return False
        t.writelines(chunks)
        return True

    def drop(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

    # -- reading ---------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big_view is not None:
            return self._big_view[self._big_pos :]
        if self._end == len(self._buf):
            self._make_room(len(self._buf) - self._start + 1)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.lost:
            return
        if self._big_view is not None:
            self._big_pos += nbytes
            if self._big_pos < len(self._big_view):
                return
            self._frames.append(self._big)
            self._big = self._big_view = None
        else:
            self._end += nbytes
        self._parse()

    def _make_room(self, need: int) -> None:
        """Make ``need`` bytes from ``_start`` fit in the read buffer."""
        start, end, buf = self._start, self._end, self._buf
        if start + need <= len(buf):
            return
        if need > len(buf):
            new = bytearray(max(need, 2 * len(buf)))
            new[: end - start] = self._view[start:end]
            self._view.release()
            self._buf, self._view = new, memoryview(new)
        else:
            buf[: end - start] = self._view[start:end]
        self._start, self._end = 0, end - start

    def _parse(self) -> None:
        ch = self.channel
        while not self.lost and not ch.closed:
            buf, start, end = self._buf, self._start, self._end
            lens = self._lens
            if lens is None:
                if end - start < 4:
                    break
                n = _COUNT.unpack_from(buf, start)[0]
                table = 4 + 8 * n
                limit = ch.max_message_bytes if self.trusted else PRE_AUTH_BYTES
                if (
                    n == 0
                    or n > (_MAX_FRAMES if self.trusted else _PRE_AUTH_FRAMES)
                    or table > limit
                ):
                    self._violation("header", f"message declares {n} frames")
                    return
                if end - start < table:
                    self._make_room(table)
                    return
                lens = struct.unpack_from(f"<{n}Q", buf, start + 4)
                total = sum(lens)
                if total > limit:
                    what = "" if self.trusted else " before the connection authenticated"
                    self._violation("oversized", f"{total} bytes > limit {limit}{what}")
                    return
                start += table
                self._start = start
                self._lens = lens
            frames = self._frames
            while len(frames) < len(lens):
                need = lens[len(frames)]
                avail = end - start
                if need <= avail:
                    frames.append(buf[start : start + need])  # a writable copy
                    start += need
                    continue
                if need >= _BIG:
                    # bytearray, not np.empty: numpy asks for huge pages on large
                    # arrays, and faulting those in (with compaction) made a 64 MiB
                    # receive 2-3x slower than zeroing 4 KiB pages.
                    big = bytearray(need)
                    view = memoryview(big)
                    view[:avail] = self._view[start:end]
                    self._big, self._big_view, self._big_pos = big, view, avail
                    self._start = self._end = 0
                    return
                self._start = start
                self._make_room(need)
                return
            self._start = start
            self._lens = None
            self._frames = []
            ch.counters.values["stream_messages"] = ch.counters.values.get("stream_messages", 0) + 1
            ch._receive(self.ident, frames)
        if self._start == self._end:
            self._start = self._end = 0

    def trust(self) -> None:
        self.trusted = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _violation(self, reason: str, detail: str) -> None:
        counters = self.channel.counters
        counters.add("messages")
        counters.reject(reason, detail + "; dropping the stream connection")
        self.drop()


class StreamChannel(Channel):
    """A ``Channel`` over Unix stream connections (see the module docstring). Built by
    ``connect`` (a client: one connection, ``ident`` None) or ``serve`` (a worker)."""

    def __init__(
        self,
        key: bytes,
        handler: Callable[[bytes | None, Any], None],
        counters: Counters,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        on_lost: Callable[[StreamChannel], None] | None = None,
        _connecting: bool = False,
    ) -> None:
        self._init_common(key, handler, counters, loop, max_message_bytes, serving=not _connecting)
        self.is_router = False
        self.peers: dict[bytes, _Peer] = {}
        self.on_lost = on_lost
        self._peer: _Peer | None = None  # a client's one connection
        self._server: asyncio.AbstractServer | None = None
        self._path: str | None = None
        self._connecting: asyncio.Task | None = None
        self._ids = itertools.count(1)

    @classmethod
    def connect(
        cls,
        path: str,
        key: bytes,
        handler: Callable[[bytes | None, Any], None],
        counters: Counters,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        on_lost: Callable[[StreamChannel], None] | None = None,
    ) -> StreamChannel:
        """Connect to a worker's stream socket; raises ``OSError`` if nothing listens.
        Messages sent before the loop has set the connection up wait in order."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_CONNECT_TIMEOUT_S)
            sock.connect(path)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        ch = cls(key, handler, counters, loop=loop, on_lost=on_lost, _connecting=True)
        peer = ch._peer = _Peer(ch, None)
        ch._connecting = ch.loop.create_task(
            ch.loop.create_unix_connection(lambda: peer, sock=sock)
        )
        ch._connecting.add_done_callback(ch._connected)
        ch._send_now(None, _HELLO, ())  # waits with the peer until the connection is made
        return ch

    def _connected(self, task: asyncio.Task) -> None:
        self._connecting = None
        if task.cancelled() or task.exception() is None:
            return
        log.warning("stream connection could not be set up: %s", task.exception())
        if self._peer is not None and not self._peer.lost:
            self._peer.connection_lost(task.exception())

    @classmethod
    async def serve(
        cls,
        path: str,
        key: bytes,
        handler: Callable[[bytes | None, Any], None],
        counters: Counters,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> StreamChannel:
        """Listen on ``path`` (mode 0600); every connection feeds ``handler``."""
        ch = cls(key, handler, counters, max_message_bytes=max_message_bytes)
        ch._server = await ch.loop.create_unix_server(ch._accept, path)
        ch._path = path
        os.chmod(path, 0o600)
        return ch

    def _accept(self) -> _Peer:
        return _Peer(self, IDENT_PREFIX + next(self._ids).to_bytes(8, "little"))

    def _made(self, peer: _Peer) -> None:
        if peer.ident is None:
            return
        if self.closed:
            peer.drop()
            return
        untrusted = sum(1 for p in self.peers.values() if not p.trusted)
        if len(self.peers) >= MAX_CONNECTIONS or untrusted >= MAX_UNTRUSTED:
            self.counters.add("messages")
            self.counters.reject(
                "connection",
                f"{len(self.peers)} connections, {untrusted} "
                "not yet authenticated: refusing another",
            )
            peer.drop()
            return
        self.peers[peer.ident] = peer
        peer._expiry = self.loop.call_later(TRUST_DEADLINE_S, self._expire, peer)

    def _expire(self, peer: _Peer) -> None:
        peer._expiry = None
        if not peer.trusted and not peer.lost:
            self.counters.add("messages")
            self.counters.reject("connection", f"no READY within {TRUST_DEADLINE_S} s")
            peer.drop()

    def _ready(self, ident: bytes | None) -> None:
        peer = self.peers.get(ident) if ident is not None else None
        if peer is not None:
            peer.trust()

    def _lost(self, peer: _Peer, exc: Exception | None) -> None:
        if peer.ident is not None:
            self.peers.pop(peer.ident, None)
            return
        if exc is not None:
            log.info("stream connection lost: %s", exc)
        if not self.closed:
            self.counters.add("send_failed", len(self._outbox) + len(self._held))
            self._outbox.clear()
            self._held.clear()
            self.closed = True
            if self.on_lost is not None:
                self.on_lost(self)

    # -- Channel's transport hooks -------------------------------------------------------

    def _send_now(
        self,
        ident: bytes | None,
        header: bytes,
        buffers: Sequence[Any],
        envelope: bytes | None = None,
    ) -> None:
        peer = self._peer if ident is None else self.peers.get(ident)
        if envelope is None:
            envelope = self.session.outgoing(ident)
            if envelope is None:
                self._no_route(ident)
                return
        sig = self._signer.sign(header, buffers, envelope)
        first = SIGNATURE_BYTES + len(envelope) + len(header)
        if not buffers:
            chunks = [b"".join((_ONE.pack(1, first), sig, envelope, header))]
        else:
            views = [memoryview(b).cast("B") for b in buffers]
            n = len(views) + 1
            prefix = struct.pack(f"<I{n}Q", n, first, *[v.nbytes for v in views])
            chunks = [b"".join((prefix, sig, envelope, header)), *views]
        if peer is None or not peer.write(chunks):
            self.counters.add("send_failed")

    def _drain(self, blind: bool = False, most: int = -1) -> None:
        """Nothing to look at: the loop hands over every byte as it comes."""

    def close(self, linger_ms: int = 0) -> None:
        """Close every connection; what was already written still goes out."""
        if self.closed and self._peer is None and self._server is None:
            return
        if linger_ms > 0 and self._outbox and not self.closed:
            self._flush_scheduled = False
            out, self._outbox = self._outbox, []
            for ident, header, buffers in out:
                self._send_now(ident, header, buffers)
        self.closed = True
        self._outbox.clear()
        if self._held:
            self.counters.add("send_failed", len(self._held))
            self._held.clear()
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        peers = list(self.peers.values())
        if self._peer is not None:
            peers.append(self._peer)
            self._peer = None
        for peer in peers:
            peer.lost = True
            if peer.transport is not None:
                peer.transport.close()
        self.peers.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None
