"""The caller side of the actor protocol in one process: connections, pending calls.

One ``Client`` per process (the driver, and every worker so actors can call actors).
It holds one connection per worker address (the controller is not on the path of
calls): a Unix stream socket for a same-host ``ipc://`` worker (``_stream``, unless
``NEREUS_STREAM=0``), a ZeroMQ DEALER otherwise; the table of pending calls, their
deadlines and streams; and a DEALER connection to the controller for control
requests, ``emit`` and notices.

Promises:
- A call is sent before ``call`` returns; the returned ``asyncio.Future`` resolves with
  the value, or fails with ``RemoteError`` (remote type, message, traceback, actor,
  device), ``ProtocolError``, ``Backpressure``, ``DeadlineExceeded`` (at the caller's
  deadline, even if the callee never answers) or ``ActorDied`` (at once when the
  controller reports the callee's worker dead; calls to a dead worker fail at once).
- A reply from another incarnation than the one called, or one that arrives after its
  call finished (deadline), is dropped and counted (``stale_replies``, ``late_replies``).
- One call in ``span_sample_every`` emits a ``call_span`` event (actor, method, latency).

Refuses: use from a thread other than the loop's (``emit`` alone is thread-safe).

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from nereus.actors import _protocol as P
from nereus.actors._channel import DEFAULT_MAX_MESSAGE_BYTES, Channel, Counters, configure
from nereus.actors._curve import CurveKey, secure
from nereus.actors._stream import StreamChannel, stream_enabled, stream_path
from nereus.errors import (
    ActorDied,
    Backpressure,
    DeadlineExceeded,
    NereusError,
    ProtocolError,
    RemoteError,
)

__all__ = ["Client", "current_client", "emit", "make_error"]

log = logging.getLogger("nereus.actors")

_CLIENT: Client | None = None
# Deadlines due this close to now expire in the same timer run: loop timers have
# millisecond resolution and may fire that much early.
_DEADLINE_SLACK_S = 0.001


def current_client() -> Client:
    if _CLIENT is None:
        raise RuntimeError(
            "no nereus cluster connection in this process: use Cluster.local(...) or "
            "Cluster.connect(...) (inside a worker this is set up for you)"
        )
    return _CLIENT


def make_error(
    kind: str, remote_type: str, message: str, tb: str, actor: str, device: int | None
) -> NereusError:
    """The caller-side exception for an ERR reply."""
    if kind == P.ERR_REMOTE:
        return RemoteError(remote_type, message, tb, actor, device)
    if kind == P.ERR_BACKPRESSURE:
        return Backpressure(message)
    if kind == P.ERR_DEADLINE:
        return DeadlineExceeded(message)
    if kind == P.ERR_DIED:
        return ActorDied(actor, device, message)
    return ProtocolError(message)


class _Pending:
    __slots__ = (
        "fut",
        "address",
        "actor",
        "inc",
        "method",
        "device",
        "timed",
        "t0",
        "stream",
        "waiter",
        "cid",
    )

    def __init__(self, fut, address, actor, inc, method, device):
        self.fut = fut
        self.address = address
        self.actor = actor
        self.inc = inc
        self.method = method
        self.device = device
        self.timed = False  # has an entry in the client's deadline heap
        self.t0 = 0.0
        self.stream: deque | None = None  # items as 1-tuples; None marks the end
        self.waiter: asyncio.Future | None = None
        self.cid = 0


class Client:
    """See the module docstring."""

    def __init__(
        self,
        key: bytes,
        *,
        source: str,
        span_sample_every: int = 100,
        curve: CurveKey | None = None,
    ) -> None:
        self.key = key
        self.curve = curve  # CURVE for tcp connections (``_curve``)
        self.source = source
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context.instance()
        self.counters = Counters()
        self.pending: dict[int, _Pending] = {}
        self.inflight: dict[tuple[str, str], int] = {}
        self.dead: dict[str, str] = {}  # worker address -> reason
        self.span_sample_every = max(0, int(span_sample_every))
        self.notice_listeners: list[Callable[[str, dict], None]] = []
        self._conns: dict[str, Channel] = {}
        self._ids = itertools.count(1)
        self._ncalls = 0
        self._controller: Channel | None = None
        self._thread = threading.get_ident()
        self.closed = False
        self._deadlines: list[tuple[float, int, float]] = []  # (when, call id, timeout_s)
        self._timed = 0  # pending calls with a deadline (live heap entries)
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_armed = 0.0

    # -- connections -----------------------------------------------------------------

    def connect_controller(self, address: str) -> None:
        self._controller = self._open(address)

    def _open(self, address: str) -> Channel:
        sock = configure(self.ctx.socket(zmq.DEALER), DEFAULT_MAX_MESSAGE_BYTES)
        secure(sock, self.curve, address, server=False)
        sock.connect(address)
        return Channel(
            sock,
            self.key,
            lambda _ident, msg: self._on_message(address, msg),
            self.counters,
            loop=self.loop,
        )

    def conn(self, address: str) -> Channel:
        ch = self._conns.get(address)
        if ch is None:
            if self.closed:
                raise ProtocolError("the cluster connection is closed")
            ch = self._open_stream(address) or self._open(address)
            self._conns[address] = ch
        return ch

    def _open_stream(self, address: str) -> StreamChannel | None:
        """The worker's same-host stream socket (``nereus.actors._stream``), or None
        when there is none to connect to (then ZeroMQ carries the calls)."""
        path = stream_path(address)
        if path is None or not stream_enabled():
            return None
        try:
            return StreamChannel.connect(
                path,
                self.key,
                lambda _ident, msg: self._on_message(address, msg),
                self.counters,
                loop=self.loop,
                on_lost=lambda ch: self._stream_lost(address, ch),
            )
        except OSError as e:
            log.debug("no stream socket for %s (%s): using ZeroMQ", address, e)
            return None

    def _stream_lost(self, address: str, ch: Channel) -> None:
        # Calls in flight wait for the controller's verdict (worker_died) or their
        # deadline, as on ZeroMQ; the next call connects again.
        if self._conns.get(address) is ch:
            del self._conns[address]

    # -- calls -----------------------------------------------------------------------

    def call(
        self,
        address: str,
        actor: str,
        inc: int,
        method: str,
        args: Any,
        kwargs: Any,
        timeout_s: float | None,
        mode: int,
        device: int | None,
    ) -> asyncio.Future:
        """Send one call; the future resolves with its result (see module docstring)."""
        fut = self.loop.create_future()
        reason = self.dead.get(address)
        if reason is not None:
            fut.set_exception(ActorDied(actor, device, reason))
            return fut
        cid = next(self._ids)
        msg = [P.CALL, cid, actor, inc, method, timeout_s, args, kwargs, mode]
        ch = self._conns.get(address) or self.conn(address)
        if mode == P.NO_REPLY:
            ch.send(msg)
            fut.set_result(None)
            return fut
        p = _Pending(fut, address, actor, inc, method, device)
        self._ncalls += 1
        if self.span_sample_every and self._ncalls % self.span_sample_every == 0:
            p.t0 = time.perf_counter()
        if timeout_s is not None:
            self._add_deadline(p, cid, timeout_s)
        key = (address, actor)
        self.pending[cid] = p
        self.inflight[key] = self.inflight.get(key, 0) + 1
        try:
            ch.send(msg)
        except BaseException:
            self._finish(cid)
            raise
        return fut

    def open_stream(
        self,
        address: str,
        actor: str,
        inc: int,
        method: str,
        args: Any,
        kwargs: Any,
        timeout_s: float | None,
        device: int | None,
    ) -> _Pending:
        """Send a STREAM call; read it with ``next_item``. Raises ActorDied for a dead worker."""
        reason = self.dead.get(address)
        if reason is not None:
            raise ActorDied(actor, device, reason)
        cid = next(self._ids)
        p = _Pending(self.loop.create_future(), address, actor, inc, method, device)
        p.cid = cid
        p.stream = deque()
        if timeout_s is not None:
            self._add_deadline(p, cid, timeout_s)
        self.pending[cid] = p
        try:
            self.conn(address).send(
                [P.CALL, cid, actor, inc, method, timeout_s, args, kwargs, P.STREAM]
            )
        except BaseException:
            self._finish(cid)
            raise
        return p

    async def next_item(self, p: _Pending) -> tuple[bool, Any]:
        """``(True, item)`` or ``(False, None)`` at the end; raises the stream's error."""
        while not p.stream:
            p.waiter = self.loop.create_future()
            await p.waiter
        item = p.stream.popleft()
        if item is None:
            p.stream.append(None)  # stay at the end
            if p.fut.done() and p.fut.exception() is not None:
                raise p.fut.exception()
            return False, None
        return True, item[0]

    def close_stream(self, p: _Pending) -> None:
        """The consumer stopped reading: forget the call (later items are dropped)."""
        self._finish(p.cid)
        if not p.fut.done():
            p.fut.cancel()
        elif not p.fut.cancelled():
            p.fut.exception()  # seen by next_item or moot: do not warn "never retrieved"

    async def request(
        self, address: str | None, op: str, body: Any, timeout_s: float | None = 30.0
    ) -> Any:
        """A control request (``CTRL``) to a worker, or to the controller if address is None."""
        cid = next(self._ids)
        fut = self.loop.create_future()
        target = address or "controller"
        if address is not None and address in self.dead:
            raise ActorDied(f"worker {address}", None, self.dead[address])
        ch = self._controller if address is None else self.conn(address)
        if ch is None:
            raise ProtocolError("this client has no controller connection")
        p = _Pending(fut, target, "", 0, op, None)
        if timeout_s is not None:
            self._add_deadline(p, cid, timeout_s)
        self.pending[cid] = p
        try:
            ch.send([P.CTRL, cid, op, body])
        except BaseException:
            self._finish(cid)
            raise
        return await fut

    def tell(self, op: str, body: Any) -> None:
        """A control message to the controller that needs no answer."""
        if self._controller is None:
            raise ProtocolError("this client has no controller connection")
        self._controller.send([P.CTRL, 0, op, body])

    def _finish(self, cid: int) -> _Pending | None:
        p = self.pending.pop(cid, None)
        if p is None:
            return None
        if p.timed:
            self._timed -= 1
            if len(self._deadlines) > 64 and len(self._deadlines) > 2 * self._timed:
                self._compact_deadlines()
        key = (p.address, p.actor)
        n = self.inflight.get(key, 0) - 1
        if n > 0:
            self.inflight[key] = n
        else:
            self.inflight.pop(key, None)
        return p

    # -- deadlines -------------------------------------------------------------------

    def _add_deadline(self, p: _Pending, cid: int, timeout_s: float) -> None:
        when = self.loop.time() + timeout_s
        heapq.heappush(self._deadlines, (when, cid, timeout_s))
        p.timed = True
        self._timed += 1
        if self._deadline_timer is None or when < self._deadline_armed:
            self._arm_deadline_timer(when)

    def _arm_deadline_timer(self, when: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_timer = self.loop.call_at(when, self._expire_due)
        self._deadline_armed = when

    def _expire_due(self) -> None:
        self._deadline_timer = None
        heap = self._deadlines
        now = self.loop.time() + _DEADLINE_SLACK_S
        while heap and heap[0][0] <= now:
            _, cid, timeout_s = heapq.heappop(heap)
            self._expire(cid, timeout_s)  # a no-op for a call that already finished
        pending = self.pending
        while heap and heap[0][1] not in pending:
            heapq.heappop(heap)  # finished: do not wake up for it
        if heap:
            self._arm_deadline_timer(heap[0][0])

    def _compact_deadlines(self) -> None:
        pending = self.pending
        # in place: _expire_due may be iterating over this very list
        self._deadlines[:] = [e for e in self._deadlines if e[1] in pending]
        heapq.heapify(self._deadlines)

    def _expire(self, cid: int, timeout_s: float) -> None:
        p = self._finish(cid)
        if p is not None and not p.fut.done():
            what = f"{p.actor}.{p.method}" if p.actor else p.method
            p.fut.set_exception(
                DeadlineExceeded(f"call {what} missed its deadline of {timeout_s} s")
            )
            if p.stream is not None:
                _end_stream(p)

    # -- replies ---------------------------------------------------------------------

    def _on_message(self, address: str, msg: Any) -> None:
        kind = msg[0] if type(msg) is list and msg else None
        if kind == P.OK:
            p = self.pending.get(msg[1])
            if p is None:
                self.counters.add("late_replies")
                return
            if msg[2] != p.inc:
                self._stale(msg[1], p, msg[2])
                return
            if p.stream is not None:  # a stream's OK never comes; treat as protocol noise
                self.counters.reject("header", f"OK reply for stream call {msg[1]}")
                return
            self._finish(msg[1])
            if p.t0:
                self._span(p, True)
            if not p.fut.done():
                p.fut.set_result(msg[3])
        elif kind == P.ERR:
            _, cid, inc, ekind, rtype, message, tb = msg
            p = self.pending.get(cid)
            if p is None:
                self.counters.add("late_replies")
                return
            if inc != p.inc:
                self._stale(cid, p, inc)
                return
            self._finish(cid)
            if p.t0:
                self._span(p, False)
            if not p.fut.done():
                p.fut.set_exception(make_error(ekind, rtype, message, tb, p.actor, p.device))
            if p.stream is not None:
                _end_stream(p)
        elif kind == P.ITEM or kind == P.END:
            p = self.pending.get(msg[1])
            if p is None or p.stream is None:
                self.counters.add("late_replies")
                return
            if msg[2] != p.inc:
                self._stale(msg[1], p, msg[2])
                return
            if kind == P.ITEM:
                p.stream.append((msg[3],))
                if p.waiter is not None and not p.waiter.done():
                    p.waiter.set_result(None)
            else:
                self._finish(msg[1])
                if not p.fut.done():
                    p.fut.set_result(None)
                _end_stream(p)
        elif kind == P.NOTE:
            self._on_notice(msg[1], msg[2])
        else:
            self.counters.reject("header", f"unexpected message kind {kind!r} from {address}")

    def _stale(self, cid: int, p: _Pending, inc: int) -> None:
        self.counters.add("stale_replies")
        self._finish(cid)
        log.warning("dropped a reply of %s from incarnation %s (called %s)", p.actor, inc, p.inc)
        if not p.fut.done():
            p.fut.set_exception(ActorDied(p.actor, p.device, f"incarnation {p.inc} is gone"))
        if p.stream is not None:
            _end_stream(p)

    def _span(self, p: _Pending, ok: bool) -> None:
        self.emit_event(
            {
                "type": "call_span",
                "actor": p.actor,
                "method": p.method,
                "device": p.device,
                "latency_seconds": time.perf_counter() - p.t0,
                "ok": ok,
            }
        )

    # -- failures --------------------------------------------------------------------

    def _on_notice(self, op: str, body: dict) -> None:
        if op in ("worker_died", "device_retired"):
            # a retired (drained, emptied) device's worker is gone as surely as a dead one
            address = body.get("address", "")
            reason = body.get("reason", "died" if op == "worker_died" else "retired")
            self.mark_dead(address, reason, body.get("device"))
        for cb in list(self.notice_listeners):
            try:
                cb(op, body)
            except Exception:
                log.exception("notice listener failed on %s", op)

    def mark_dead(self, address: str, reason: str, device: int | None) -> None:
        """Fail every pending call to ``address`` now; later calls to it fail at once."""
        self.dead[address] = reason
        for cid, p in list(self.pending.items()):
            if p.address == address:
                self._finish(cid)
                if not p.fut.done():
                    p.fut.set_exception(ActorDied(p.actor or address, device, reason))
                if p.stream is not None:
                    _end_stream(p)
        ch = self._conns.pop(address, None)
        if ch is not None:
            ch.close()

    # -- events ----------------------------------------------------------------------

    def emit_event(self, event: dict) -> None:
        """Send one tap event to the controller (thread-safe; dropped if no controller)."""
        if threading.get_ident() != self._thread:
            self.loop.call_soon_threadsafe(self.emit_event, event)
            return
        if self._controller is None or self._controller.closed:
            self.counters.add("events_dropped")
            return
        event.setdefault("time_monotonic_seconds", time.monotonic())
        event.setdefault("source", self.source)
        event.setdefault("pid", os.getpid())
        try:
            self._controller.send([P.CTRL, 0, "emit", event])
        except (zmq.ZMQError, ProtocolError) as e:
            self.counters.add("events_dropped")
            log.warning("could not emit a %r event: %s", event.get("type"), e)

    def close(self) -> None:
        self.closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        for cid, p in list(self.pending.items()):
            self._finish(cid)
            if not p.fut.done():
                p.fut.set_exception(ProtocolError("the cluster connection was closed"))
        for ch in self._conns.values():
            ch.close()
        self._conns.clear()
        if self._controller is not None:
            self._controller.close(linger_ms=200)  # let a last "bye" or "node_leave" out


def _end_stream(p: _Pending) -> None:
    p.stream.append(None)
    if p.waiter is not None and not p.waiter.done():
        p.waiter.set_result(None)


def set_current_client(client: Client | None) -> None:
    global _CLIENT
    _CLIENT = client


def emit(type: str, **fields: Any) -> None:  # noqa: A002 - the tap's field is called type
    """Publish one event on the controller's monitoring tap (schema: nereus.monitor.schema).

    Usable in the driver and inside workers, from any thread. Fields should be plain
    data with SI units in their names (``bytes``, ``seconds``, ``gbps``)."""
    if not isinstance(type, str) or not type:
        raise ValueError(f"emit(type={type!r}) needs a non-empty event type string")
    fields["type"] = type
    if _CLIENT is not None:
        _CLIENT.emit_event(fields)
    elif _LOCAL_PUBLISH is not None:  # a standalone controller process
        _LOCAL_PUBLISH(fields)
    else:
        log.debug("emit(%r) outside a cluster: dropped", type)


_LOCAL_PUBLISH: Callable[[dict], None] | None = None


def set_local_publisher(publish: Callable[[dict], None] | None) -> None:
    """Where ``emit`` goes in a process with no client (the controller's own)."""
    global _LOCAL_PUBLISH
    _LOCAL_PUBLISH = publish
