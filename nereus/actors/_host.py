"""The callee side: the actors living in one worker process and their mailboxes.

``ActorHost`` owns a ROUTER channel (and, in a worker bound to ipc, a same-host
stream channel, ``_stream``; replies leave on the channel their call came in on) and
a table of actors. For every verified message it checks, in order: the message shape,
the actor name, the incarnation, the method, the arguments against the endpoint's
signature (and simple annotations: int, float, str, bytes, bool, list, dict, tuple;
``nereus.actors._endpoint``), and the actor's cap on pending calls. Any failure is
answered to the (authenticated) sender with an ERR naming what was wrong, and counted;
nothing a caller sends can raise out of it.

Ordering: sequential endpoints of one actor run one at a time in arrival order
(one mailbox consumer task per actor, no task per call); concurrent endpoints start
a task per call. A call whose deadline passed before it started is not run
(answered with ``deadline``); a running call is never interrupted by its deadline.

Back-pressure: ``pending`` counts queued and running calls of an actor; a call that
would exceed ``max_pending`` is refused with ``Backpressure`` at once.

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import sys
import traceback
import types
from collections import deque
from collections.abc import Coroutine, Generator
from typing import Any

import zmq

from nereus.actors import _protocol as P
from nereus.actors._channel import DEFAULT_MAX_MESSAGE_BYTES, Channel, Counters
from nereus.actors._cpulimit import device_threads
from nereus.actors._endpoint import EP_AGEN, EP_CORO, Endpoint, import_actor_class
from nereus.actors._stream import IDENT_PREFIX, StreamChannel
from nereus.actors.actor import Actor, DeviceInfo, Failure, endpoint_spec, endpoints_of
from nereus.errors import ProtocolError

__all__ = ["ActorHost", "DEFAULT_MAX_PENDING"]

log = logging.getLogger("nereus.actors")

DEFAULT_MAX_PENDING = 10_000
# The idle fast path needs create_task(context=...) to give the consumer a context
# that a call started outside it can run in.
_START_IDLE_CALLS_AT_ONCE = sys.version_info >= (3, 11)
# Private but stable since Python 3.7 (3.12's eager tasks rely on the same pair): they
# make a task current while its coroutine is stepped outside the task's own callback.
_enter_task = asyncio.tasks._enter_task
_leave_task = asyncio.tasks._leave_task


class _Slot:
    __slots__ = (
        "name",
        "instance",
        "incarnation",
        "endpoints",
        "mailbox",
        "wake",
        "pending",
        "max_pending",
        "consumer",
        "tasks",
        "cls",
        "context",
        "idle",
        "resume",
    )

    def __init__(self, name: str, instance: Actor, incarnation: int, max_pending: int) -> None:
        self.name = name
        self.instance = instance
        self.cls = type(instance)
        self.incarnation = incarnation
        self.endpoints: dict[str, Endpoint] = {}
        for ep_name, fn in endpoints_of(type(instance)).items():
            spec = endpoint_spec(fn)
            self.endpoints[ep_name] = Endpoint(
                getattr(instance, ep_name),
                spec.concurrent,
                f"{type(instance).__qualname__}.{ep_name}",
            )
        self.mailbox: deque = deque()
        self.wake: asyncio.Future | None = None
        self.pending = 0
        self.max_pending = max_pending
        self.consumer: asyncio.Task | None = None
        self.tasks: set[asyncio.Task] = set()
        self.context = contextvars.copy_context()  # the consumer task's context
        # True while the consumer waits on an empty mailbox with nothing to resume
        self.idle = False
        # (call, its coroutine, what it yielded): a call started at once that suspended
        self.resume: tuple[tuple, Coroutine, Any] | None = None


class ActorHost:
    """See the module docstring. Control ops: spawn, stop, supervise, stats, plus those
    the owner adds to ``extra_control`` (op -> ``handler(body) -> reply``; the worker
    adds shutdown)."""

    def __init__(
        self,
        sock: zmq.Socket,
        key: bytes,
        device: DeviceInfo,
        counters: Counters,
        emit: Any = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.device = device
        self.counters = counters
        self.emit = emit or (lambda event: None)
        self.actors: dict[str, _Slot] = {}
        self.incarnations: dict[str, int] = {}
        self.extra_control: dict[str, Any] = {}
        self.channel = Channel(
            sock,
            key,
            self._on_message,
            counters,
            loop=self.loop,
            max_message_bytes=max_message_bytes,
        )
        self.stream: StreamChannel | None = None
        self._key = key
        self._max_message_bytes = max_message_bytes

    async def listen_stream(self, path: str) -> None:
        """Also take calls on a same-host stream socket at ``path`` (``_stream``)."""
        self.stream = await StreamChannel.serve(
            path,
            self._key,
            self._on_message,
            self.counters,
            max_message_bytes=self._max_message_bytes,
        )

    def _out(self, ident: bytes) -> Channel:
        """The channel a reply to ``ident`` leaves on: the one its call came in on."""
        if self.stream is not None and ident[:1] == IDENT_PREFIX:
            return self.stream
        return self.channel

    # -- dispatch --------------------------------------------------------------------

    def _on_message(self, ident: bytes | None, msg: Any) -> None:
        if type(msg) is not list or not msg:
            self.counters.reject("header", f"message is a {type(msg).__name__}, not a list")
            return
        kind = msg[0]
        if kind == P.CALL:
            if len(msg) != 9 or type(msg[1]) is not int:
                self._bad_shape(ident, msg, "CALL needs 9 fields")
                return
            self._on_call(ident, msg)
        elif kind == P.CTRL:
            if len(msg) != 4 or type(msg[1]) is not int or type(msg[2]) is not str:
                self._bad_shape(ident, msg, "CTRL needs [10, call_id, op, body]")
                return
            self._on_control(ident, msg[1], msg[2], msg[3])
        else:
            self._bad_shape(ident, msg, f"unknown message kind {kind!r}")

    def _bad_shape(self, ident: bytes, msg: list, what: str) -> None:
        self.counters.reject("header", what)
        cid = msg[1] if len(msg) > 1 and type(msg[1]) is int else None
        if cid is not None:
            self._reply_err(ident, cid, 0, P.ERR_PROTOCOL, "ProtocolError", what, "")

    def _on_call(self, ident: bytes, msg: list) -> None:
        _, cid, name, inc, method, timeout_s, args, kwargs, mode = msg
        slot = self.actors.get(name) if type(name) is str else None
        if slot is None:
            self.counters.reject("unknown_actor", f"{name!r}")
            self._reply_err(
                ident,
                cid,
                inc,
                P.ERR_PROTOCOL,
                "ProtocolError",
                f"no actor {name!r} on device {self.device.index}",
                "",
            )
            return
        if inc != slot.incarnation:
            self.counters.add("stale_calls")
            self._reply_err(
                ident,
                cid,
                inc,
                P.ERR_DIED,
                "ActorDied",
                f"incarnation {inc!r} of {name!r} is gone (now {slot.incarnation})",
                "",
            )
            return
        ep = slot.endpoints.get(method) if type(method) is str else None
        if ep is None:
            self.counters.reject("unknown_method", f"{name}.{method!r}")
            self._reply_err(
                ident,
                cid,
                inc,
                P.ERR_PROTOCOL,
                "ProtocolError",
                f"actor {name!r} ({slot.cls.__qualname__}) has no endpoint "
                f"{method!r}; endpoints: {sorted(slot.endpoints)}",
                "",
            )
            return
        if (
            type(args) is not list
            or type(kwargs) is not dict
            or mode not in (0, 1, 2)
            or not (timeout_s is None or type(timeout_s) in (int, float))
        ):
            self.counters.reject("header", "CALL args/kwargs/mode/timeout of the wrong type")
            self._reply_err(
                ident,
                cid,
                inc,
                P.ERR_PROTOCOL,
                "ProtocolError",
                "CALL needs args as a list, kwargs as a map, mode 0-2, timeout_s a number or nil",
                "",
            )
            return
        if kwargs and not all(type(k) is str for k in kwargs):
            self.counters.reject("arguments", "non-string keyword")
            self._reply_err(
                ident,
                cid,
                inc,
                P.ERR_PROTOCOL,
                "ProtocolError",
                "keyword argument names must be strings",
                "",
            )
            return
        problem = ep.check(args, kwargs)
        if problem is not None:
            self.counters.reject("arguments", problem)
            self._reply_err(ident, cid, inc, P.ERR_PROTOCOL, "ProtocolError", problem, "")
            return
        if (mode == P.STREAM) != (ep.kind == EP_AGEN):
            what = (
                "is not a stream: use call"
                if ep.kind != EP_AGEN
                else "is a stream (async generator): use .stream(...)"
            )
            self.counters.reject("arguments", f"{ep.qualname} {what}")
            self._reply_err(
                ident, cid, inc, P.ERR_PROTOCOL, "ProtocolError", f"{ep.qualname} {what}", ""
            )
            return
        if slot.pending >= slot.max_pending:
            self.counters.add("backpressure")
            self._reply_err(
                ident,
                cid,
                inc,
                P.ERR_BACKPRESSURE,
                "Backpressure",
                f"actor {name!r} has {slot.pending} pending calls (cap {slot.max_pending})",
                "",
            )
            return
        slot.pending += 1
        deadline = None if timeout_s is None else self.loop.time() + timeout_s
        item = (slot, ep, ident, cid, args, kwargs, deadline, mode)
        if ep.concurrent:
            task = self.loop.create_task(self._run(*item))
            slot.tasks.add(task)
            task.add_done_callback(slot.tasks.discard)
        elif slot.idle:
            self._start_now(slot, item)
        else:
            slot.mailbox.append(item)
            self._wake(slot)

    def _wake(self, slot: _Slot) -> None:
        slot.idle = False
        w = slot.wake
        if w is not None and not w.done():
            w.set_result(None)

    def _start_now(self, slot: _Slot, item: tuple) -> None:
        """Run ``item`` as the idle consumer task up to its first suspension."""
        consumer = slot.consumer
        try:
            _enter_task(self.loop, consumer)
        except RuntimeError:  # called inside another task, not a message callback
            slot.mailbox.append(item)
            self._wake(slot)
            return
        try:
            coro = self._run(*item)
            yielded = slot.context.run(coro.send, None)
        except (StopIteration, asyncio.CancelledError):
            return  # answered inside _run
        except Exception:
            self._runtime_bug(slot, item)
            return
        finally:
            _leave_task(self.loop, consumer)
        slot.resume = (item, coro, yielded)
        self._wake(slot)

    async def _consume(self, slot: _Slot) -> None:
        mailbox = slot.mailbox
        try:
            while True:
                if slot.resume is not None:
                    item, coro, yielded = slot.resume
                    slot.resume = None
                    call = _drive(coro, yielded)
                elif mailbox:
                    item = mailbox.popleft()
                    call = self._run(*item)
                else:
                    slot.wake = self.loop.create_future()
                    slot.idle = _START_IDLE_CALLS_AT_ONCE
                    await slot.wake
                    continue
                try:
                    await call
                except Exception:
                    self._runtime_bug(slot, item)
        finally:
            if slot.resume is not None:
                # Stopped between a call's start and its hand-over: cancel it here, as
                # if it had been running in this task (_run answers ActorDied).
                coro = slot.resume[1]
                slot.resume = None
                try:
                    coro.throw(asyncio.CancelledError())
                except (asyncio.CancelledError, StopIteration):
                    pass
                except Exception:
                    log.exception("actor %r: a call failed while stopping", slot.name)
                coro.close()

    def _runtime_bug(self, slot: _Slot, item: tuple) -> None:
        # Never let one call kill the mailbox: user errors are answered inside _run,
        # so this is a runtime bug; log it, answer, and keep serving.
        self.counters.add("handler_error")
        log.exception("actor %r: failure outside the endpoint", slot.name)
        _, ep, ident, cid, _, _, _, mode = item
        if mode != P.NO_REPLY:
            self._reply_err(
                ident,
                cid,
                slot.incarnation,
                P.ERR_PROTOCOL,
                "ProtocolError",
                "internal error while serving the call (see the worker's log)",
                "",
            )

    async def _run(
        self,
        slot: _Slot,
        ep: Endpoint,
        ident: bytes,
        cid: int,
        args: list,
        kwargs: dict,
        deadline: float | None,
        mode: int,
    ) -> None:
        inc = slot.incarnation
        try:
            if deadline is not None and self.loop.time() > deadline:
                self.counters.add("expired_calls")
                if mode != P.NO_REPLY:
                    self._reply_err(
                        ident,
                        cid,
                        inc,
                        P.ERR_DEADLINE,
                        "DeadlineExceeded",
                        f"{ep.qualname} was not started before its deadline",
                        "",
                    )
                return
            if ep.kind == EP_CORO:
                value = await ep.fn(*args, **kwargs)
            elif ep.kind == EP_AGEN:
                gen = ep.fn(*args, **kwargs)
                try:
                    async for item in gen:
                        if not self._send(ident, [P.ITEM, cid, inc, item], ep):
                            return  # the caller got an ERR; stop producing
                finally:
                    await gen.aclose()
                self._send(ident, [P.END, cid, inc], ep)
                return
            else:
                value = ep.fn(*args, **kwargs)
        except asyncio.CancelledError:
            if mode != P.NO_REPLY:
                self._reply_err(
                    ident, cid, inc, P.ERR_DIED, "ActorDied", f"actor {slot.name!r} was stopped", ""
                )
            raise
        except Exception as e:
            self._remote_error(slot, ep, ident, cid, inc, mode, e)
            return
        finally:
            slot.pending -= 1
        if mode == P.REPLY:
            self._send(ident, [P.OK, cid, inc, value], ep)

    def _remote_error(
        self, slot: _Slot, ep: Endpoint, ident: bytes, cid: int, inc: int, mode: int, e: Exception
    ) -> None:
        tb = traceback.format_exc()
        rtype = type(e).__qualname__
        if mode == P.NO_REPLY:
            log.error("broadcast call %s on %r failed:\n%s", ep.qualname, slot.name, tb)
            self.emit(
                {
                    "type": "error",
                    "actor": slot.name,
                    "method": ep.qualname,
                    "device": self.device.index,
                    "remote_type": rtype,
                    "message": str(e),
                    "traceback": tb,
                }
            )
            return
        self._reply_err(ident, cid, inc, P.ERR_REMOTE, rtype, str(e), tb)

    def _send(self, ident: bytes, msg: list, ep: Endpoint) -> bool:
        """Send a reply; False if it could not go (the caller was told why, if possible)."""
        try:
            self._out(ident).send(msg, ident)
            return True
        except ProtocolError as e:  # the value cannot cross the wire
            self._reply_err(
                ident,
                msg[1],
                msg[2],
                P.ERR_PROTOCOL,
                "ProtocolError",
                f"result of {ep.qualname} cannot be sent: {e}",
                "",
            )
        except zmq.ZMQError as e:
            self.counters.add("reply_send_failed")
            log.warning("could not send a reply of %s: %s", ep.qualname, e)
        return False

    def _reply_err(
        self, ident: bytes, cid: int, inc: Any, kind: str, rtype: str, message: str, tb: str
    ) -> None:
        if self.channel.closed:  # shutting down: the callers learn from the controller
            return
        try:
            self._out(ident).send([P.ERR, cid, inc, kind, rtype, message, tb], ident)
        except (zmq.ZMQError, ProtocolError) as e:
            self.counters.add("reply_send_failed")
            log.warning("could not send an error reply (%s): %s", message[:100], e)

    # -- control ---------------------------------------------------------------------

    def _on_control(self, ident: bytes, cid: int, op: str, body: Any) -> None:
        handler = {
            "spawn": self._spawn,
            "stop": self._stop,
            "supervise": self._supervise,
            "stats": self._stats,
        }.get(op) or self.extra_control.get(op)
        if handler is None:
            self.counters.reject("unknown_method", f"control op {op!r}")
            self._reply_err(
                ident, cid, 0, P.ERR_PROTOCOL, "ProtocolError", f"unknown control op {op!r}", ""
            )
            return
        try:
            value = handler(body)
        except ProtocolError as e:
            self.counters.reject("arguments", str(e))
            self._reply_err(ident, cid, 0, P.ERR_PROTOCOL, "ProtocolError", str(e), "")
            return
        except Exception as e:
            self._reply_err(
                ident, cid, 0, P.ERR_REMOTE, type(e).__qualname__, str(e), traceback.format_exc()
            )
            return
        try:
            self._out(ident).send([P.OK, cid, 0, value], ident)
        except zmq.ZMQError as e:
            self.counters.add("reply_send_failed")
            log.warning("could not answer control op %s: %s", op, e)

    def _spawn(self, body: Any) -> dict:
        if type(body) is not dict:
            raise ProtocolError("spawn needs a map body")
        name = body.get("name")
        if type(name) is not str or not name:
            raise ProtocolError(f"spawn: name={name!r} must be a non-empty string")
        if name in self.actors:
            raise ProtocolError(
                f"spawn: an actor named {name!r} already lives on device "
                f"{self.device.index}; stop it first"
            )
        cls = import_actor_class(body.get("cls", ""))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(body.get("torch_threads", device_threads()))
        args = body.get("args") or []
        kwargs = body.get("kwargs") or {}
        max_pending = body.get("max_pending", DEFAULT_MAX_PENDING)
        if type(max_pending) is not int or max_pending < 1:
            raise ProtocolError(f"spawn: max_pending={max_pending!r} must be an int >= 1")
        instance = cls.__new__(cls)
        instance.device = self.device
        instance.name = name
        instance.mesh_name = body.get("mesh", name)
        instance.rank = body.get("rank", 0)
        instance.coords = body.get("coords", {})
        instance.__init__(*args, **kwargs)
        inc = self.incarnations.get(name, 0) + 1
        self.incarnations[name] = inc
        slot = _Slot(name, instance, inc, max_pending)
        if _START_IDLE_CALLS_AT_ONCE:
            slot.consumer = self.loop.create_task(self._consume(slot), context=slot.context)
        else:
            slot.consumer = self.loop.create_task(self._consume(slot))
        self.actors[name] = slot
        # The actor's imports (torch: ~150k objects) would otherwise be rescanned by every
        # full cyclic collection, which costs more than the call path itself.
        gc.freeze()
        self.emit(
            {
                "type": "actor_spawn",
                "actor": name,
                "device": self.device.index,
                "incarnation": inc,
                "class": body.get("cls", ""),
            }
        )
        return {"incarnation": inc, "endpoints": sorted(slot.endpoints)}

    def _stop(self, body: Any) -> dict:
        name = body.get("name") if type(body) is dict else None
        slot = self.actors.pop(name, None) if type(name) is str else None
        if slot is None:
            raise ProtocolError(f"stop: no actor {name!r} on device {self.device.index}")
        self.stop_slot(slot, "stopped")
        # A stopped actor may have been frozen by a later spawn's gc.freeze(): its
        # reference cycles would never be collected. Collect once the reply has left.
        self.loop.call_soon(_collect_frozen)
        return {"stopped": name}

    def stop_slot(self, slot: _Slot, reason: str) -> None:
        slot.idle = False
        if slot.consumer is not None:
            slot.consumer.cancel()
        for t in list(slot.tasks):
            t.cancel()
        while slot.mailbox:
            _, ep, ident, cid, _, _, _, mode = slot.mailbox.popleft()
            slot.pending -= 1
            if mode != P.NO_REPLY:
                self._reply_err(
                    ident,
                    cid,
                    slot.incarnation,
                    P.ERR_DIED,
                    "ActorDied",
                    f"actor {slot.name!r} was {reason}",
                    "",
                )

    def _supervise(self, body: Any) -> dict:
        name = body.get("name") if type(body) is dict else None
        slot = self.actors.get(name) if type(name) is str else None
        if slot is None:
            raise ProtocolError(f"supervise: no actor {name!r} on device {self.device.index}")
        failure = Failure(**body.get("failure", {}))
        hook = getattr(slot.instance, "__supervise__", None)
        if hook is None or slot.cls.__supervise__ is Actor.__supervise__:
            return {"handled": False}
        hook(failure)
        return {"handled": True}

    def _stats(self, body: Any) -> dict:
        return {
            "counters": self.counters.snapshot(),
            "actors": {
                n: {"incarnation": s.incarnation, "pending": s.pending}
                for n, s in self.actors.items()
            },
        }

    def close(self) -> None:
        for slot in list(self.actors.values()):
            self.stop_slot(slot, "shut down")
        self.actors.clear()
        self.channel.close()
        if self.stream is not None:
            self.stream.close()


def _collect_frozen() -> None:
    """Give frozen objects back to the cyclic collector, collect, and freeze what lives."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@types.coroutine
def _drive(coro: Coroutine, yielded: Any) -> Generator[Any, Any, Any]:
    """Go on running ``coro``, which was started outside this task and suspended on
    ``yielded``: hand that to the task first, then relay every value and exception
    (cancellation included) between the task and ``coro``, as ``await`` does."""
    while True:
        try:
            sent = yield yielded
        except BaseException as e:
            try:
                yielded = coro.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value
