"""A connecting session driven by hand, for tests that write raw frames to a worker:
the handshake (HELLO, WELCOME, READY), sealing messages and opening replies."""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

from nereus.actors import _protocol as P
from nereus.actors import _session, _wire


class RawSession:
    """The client half of ``nereus.actors._session`` over frames the test sends itself."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.session = _session.Session(serving=False)

    def hello(self) -> list[bytes]:
        return self._frames(msgpack.packb([P.HELLO]), [], self.session.outgoing(None))

    def welcome(self, frames: list[Any]) -> None:
        """Take the WELCOME among ``frames`` (raises on anything else)."""
        sender, receiver, seq, header = _session.parse(_wire.verify(self.key, frames))
        kind, ticket = msgpack.unpackb(header)
        assert kind == P.WELCOME, kind
        self.session.welcomed(sender, receiver, seq, ticket)

    def ready(self) -> list[bytes]:
        return self.seal(msgpack.packb([P.READY]))

    def seal(self, header: bytes, buffers: list[bytes] = ()) -> list[bytes]:
        """The frames of the next message under the ticket."""
        return self._frames(header, list(buffers), self.session.outgoing(None))

    def call(self, name: str, inc: int, cid: int, method: str, *args: Any) -> list[bytes]:
        header, buffers = _wire.encode(
            [P.CALL, cid, name, inc, method, None, list(args), {}, P.REPLY]
        )
        return self.seal(header, [bytes(b) for b in buffers])

    def open(self, frames: list[Any]) -> list[Any]:
        """The replies in ``frames`` (a BATCH unpacked), after every check a channel makes."""
        sender, receiver, seq, header = _session.parse(_wire.verify(self.key, frames))
        self.session.accept(None, sender, receiver, seq)
        msg = _wire.decode(header, frames[1:])
        if msg[0] == P.BATCH:
            return [_wire.decode(h) for h in msg[1]]
        return [msg]

    def _frames(self, header: bytes, buffers: list[bytes], envelope: bytes) -> list[bytes]:
        return _wire.message(self.key, header, buffers, prefix=envelope)


def framed(frames: list[bytes]) -> bytes:
    """``frames`` as one message of the stream socket."""
    return struct.pack(f"<I{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)


async def read_frames(reader: Any) -> list[bytes]:
    """One message from a stream socket."""
    (n,) = struct.unpack("<I", await reader.readexactly(4))
    lens = struct.unpack(f"<{n}Q", await reader.readexactly(8 * n))
    return [await reader.readexactly(size) for size in lens]


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def zmtp_declare(address: str, size: int, payload: int, timeout_s: float = 10.0) -> socket.socket:
    """Open a raw ZMTP 3.0 connection (NULL mechanism, as a DEALER) to a ZeroMQ socket
    at ``address`` (ipc:// or tcp://) and start one frame that declares ``size`` bytes,
    sending ``payload`` of them. Returns the open socket (the caller closes it)."""
    if address.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(address[len("ipc://") :])
    else:
        host, port = address[len("tcp://") :].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    try:
        return _declare_on(sock, size, payload)
    except ConnectionError:
        sock.close()  # the peer dropped the frame while it was being sent: no fd left behind
        raise


def _declare_on(sock: socket.socket, size: int, payload: int) -> socket.socket:
    greeting = (
        b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
    )
    sock.sendall(greeting)
    _recv_exactly(sock, 64)
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    flags = _recv_exactly(sock, 1)[0]  # the peer's READY command
    length = (
        struct.unpack(">Q", _recv_exactly(sock, 8))[0]
        if flags & 0x02
        else _recv_exactly(sock, 1)[0]
    )
    _recv_exactly(sock, length)
    sock.sendall(bytes([0x02]) + struct.pack(">Q", size) + bytes(payload))
    return sock
