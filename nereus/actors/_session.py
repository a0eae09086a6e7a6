"""Replay protection for channels: channel ids, a signed handshake, sequence numbers.

Every message a channel sends carries a 40-byte envelope between its signature and its
header, inside what the HMAC covers (``nereus.actors._wire``): ``sender`` (16 bytes),
``receiver`` (16 bytes) and ``seq`` (u64). No clock is read anywhere: freshness comes
from random ids drawn when a channel is made and from counters.

So a captured message replayed to the same channel fails its ``seq``; replayed to
another channel, or to a later incarnation of the same process, it names a ticket or
an id that channel never issued. Replays are refused (``Refused``), and the channel
counts and logs them.

What resets when a process restarts: everything here (ids, ticket counters, tables)
lives in memory, so a new incarnation has new ids and honours no earlier ticket; its
peers' old connections are refused until they connect again.

Bounds: a serving channel remembers ``MAX_SESSIONS`` tickets and ``MAX_SESSIONS``
reply routes; beyond that it forgets the oldest-issued ticket and refuses every ticket
up to it from then on (fail closed: never reopens a replay).

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import os
import struct
from typing import Any

__all__ = ["ENVELOPE_BYTES", "ANY", "MAX_SESSIONS", "Refused", "Session", "envelope", "parse"]

_ENVELOPE = struct.Struct("<16s16sQ")
ENVELOPE_BYTES = _ENVELOPE.size
ANY = bytes(16)  # the receiver of a HELLO (and of a broadcast on the tap)
MAX_SESSIONS = 65_536
_TICKET_NUMBER = struct.Struct("<Q")


class Refused(Exception):
    """A signed message that the session refuses: ``reason`` is the counter's suffix."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def envelope(sender: bytes, receiver: bytes, seq: int) -> bytes:
    """The 40 bytes that precede a header."""
    return _ENVELOPE.pack(sender, receiver, seq)


def parse(head: Any) -> tuple[bytes, bytes, int, Any]:
    """``(sender, receiver, seq, header)`` of a verified head; ``Refused`` if too short."""
    if len(head) <= ENVELOPE_BYTES:
        raise Refused(
            "short",
            f"a head of {len(head)} bytes cannot hold the "
            f"{ENVELOPE_BYTES}-byte envelope and a header",
        )
    sender, receiver, seq = _ENVELOPE.unpack_from(head)
    return sender, receiver, seq, head[ENVELOPE_BYTES:]


class Session:
    """One channel's side of the protocol above (see the module docstring)."""

    __slots__ = (
        "id",
        "serving",
        "seq",
        "ticket",
        "server",
        "last",
        "_prefix",
        "_issued",
        "_floor",
        "_tickets",
        "reply_to",
    )

    def __init__(self, serving: bool) -> None:
        self.id = os.urandom(16)
        self.serving = serving
        self.seq = 0  # of the last message sent
        # connecting side: the ticket it writes as receiver, the id of the serving channel
        self.ticket: bytes | None = None
        self.server: bytes | None = None
        self.last = 0  # highest seq received (connecting side)
        # serving side
        self._prefix = self.id[:8]
        self._issued = 0  # highest ticket number issued
        self._floor = 1  # lowest ticket number still honoured
        self._tickets: dict[int, list] = {}  # number -> [sender id, highest seq]
        self.reply_to: dict[bytes, bytes] = {}  # transport identity -> the peer's id

    @property
    def bound(self) -> bool:
        """A connecting session that has its ticket (a serving one always is)."""
        return self.serving or self.ticket is not None

    # -- sending ---------------------------------------------------------------------

    def outgoing(self, ident: bytes | None) -> bytes | None:
        """The envelope of the next message to ``ident``; None on a serving channel that
        has no route to ``ident`` (it never sent an accepted message, or was forgotten)."""
        if self.serving:
            to = self.reply_to.get(ident)
            if to is None:
                return None
        else:
            to = self.ticket or ANY
        self.seq += 1
        return _ENVELOPE.pack(self.id, to, self.seq)

    def to(self, receiver: bytes) -> bytes:
        """The envelope of the next message to the channel whose id is ``receiver``."""
        self.seq += 1
        return _ENVELOPE.pack(self.id, receiver, self.seq)

    def issue(self) -> bytes:
        """A fresh ticket (serving side, answering a HELLO). Costs no memory."""
        self._issued += 1
        return self._prefix + _TICKET_NUMBER.pack(self._issued)

    # -- receiving -------------------------------------------------------------------

    def accept(self, ident: bytes | None, sender: bytes, receiver: bytes, seq: int) -> None:
        """Check the envelope of a verified message that is not a HELLO (serving side)
        or not a WELCOME (connecting side); raise ``Refused`` unless it is fresh."""
        if not self.serving:
            if receiver != self.id:
                raise Refused("receiver", "addressed to another channel")
            if self.server is None:
                raise Refused("unbound", "a message before the WELCOME")
            if sender != self.server:
                raise Refused("receiver", "from a channel other than the one that welcomed us")
            if seq <= self.last:
                raise Refused("replay", f"seq {seq} is not above the last one, {self.last}")
            self.last = seq
            return
        if receiver[:8] != self._prefix:
            raise Refused(
                "receiver", "a ticket of another channel, or of an earlier incarnation of this one"
            )
        n = _TICKET_NUMBER.unpack_from(receiver, 8)[0]
        if not self._floor <= n <= self._issued:
            raise Refused(
                "receiver",
                f"ticket {n} was never issued or was forgotten "
                f"(honoured: {self._floor}..{self._issued})",
            )
        entry = self._tickets.get(n)
        if entry is None:
            if len(self._tickets) >= MAX_SESSIONS:
                self._forget_oldest()
                if n < self._floor:
                    raise Refused("receiver", f"ticket {n} was forgotten")
            entry = self._tickets[n] = [sender, 0]
        elif entry[0] != sender:
            raise Refused("receiver", f"ticket {n} belongs to another sender")
        if seq <= entry[1]:
            raise Refused(
                "replay", f"seq {seq} under ticket {n} is not above the last one, {entry[1]}"
            )
        entry[1] = seq
        routes = self.reply_to
        if ident is not None and routes.get(ident) != sender:
            if ident not in routes and len(routes) >= MAX_SESSIONS:
                del routes[next(iter(routes))]
            routes[ident] = sender

    def welcomed(self, sender: bytes, receiver: bytes, seq: int, ticket: Any) -> None:
        """Take the WELCOME of the serving channel ``sender`` (connecting side)."""
        if self.serving or self.server is not None:
            raise Refused("unbound", "an unexpected WELCOME")
        if receiver != self.id:
            raise Refused("receiver", "a WELCOME addressed to another channel")
        if type(ticket) is not bytes or len(ticket) != 16 or ticket[:8] != sender[:8]:
            raise Refused("header", f"WELCOME carries a malformed ticket {ticket!r}")
        self.server = sender
        self.ticket = ticket
        self.last = seq

    def _forget_oldest(self) -> None:
        oldest = min(self._tickets)
        del self._tickets[oldest]
        self._floor = oldest + 1
