"""Subscribe to a controller's monitoring tap; ``nereus tap`` prints or records it.

    nereus tap tcp://HOST:PORT [--jsonl FILE] [--type T ...] [--key-file KEY]

``Subscriber`` is an async iterator of events (dicts; see ``nereus.monitor.schema``).
With a cluster key (``--key-file`` or ``$NEREUS_CLUSTER_KEY``) every event's signature
is checked and a forged one is counted and dropped, and so is a replayed one (each
event carries the controller's sender id and sequence number under the signature: an
event not newer than the last one from that controller is refused). It keeps every
sender's last sequence number for as long as it lives, never forgetting one: the tap
is one-way, so nothing could tell a forgotten controller's fresh start from a replay
of it (fail closed); only signed events make an entry; without a key
the events are shown unverified and the tool says so once. ``--jsonl FILE`` appends one JSON object
per event (bytes become hex strings). The printer uses rich when stdout is a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from nereus.actors.events import (
    BROADCAST,
    KEY_ENV,
    SIGNATURE_BYTES,
    CurveKey,
    Refused,
    load_curve,
    load_key,
    open_event,
    secure,
)
from nereus.errors import AuthenticationError, ConfigError, ProtocolError, exit_status
from nereus.monitor.schema import describe
from nereus.planner.plan_text import plan_text

__all__ = ["Subscriber", "TapRecorder", "format_event", "to_json", "main"]

log = logging.getLogger("nereus.monitor")


class Subscriber:
    """Async iterator over the events of the tap at ``address``.

    ``key=None`` accepts unverified events. ``types`` keeps only those event types.
    ``curve``: the cluster's CURVE key, when its tcp sockets are encrypted (a tap that
    is cannot be read without it). Call ``close()`` (or use ``async with``) to release
    the socket."""

    def __init__(
        self,
        address: str,
        key: bytes | None,
        types: set[str] | None = None,
        curve: CurveKey | None = None,
    ) -> None:
        self.address = address
        self.key = key
        self.types = set(types) if types else None
        self.rejected = 0
        self._last: dict[bytes, int] = {}  # controller's tap id -> last event seq (never evicted)
        self._ctx = zmq.asyncio.Context.shadow(zmq.Context.instance())
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        secure(self._sock, curve, address, server=False)
        self._sock.connect(address)

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            frames = await self._sock.recv_multipart()
            event = self._check(frames)
            if event is None:
                continue
            if self.types is None or event.get("type") in self.types:
                return event

    async def next(self, timeout_s: float) -> dict[str, Any]:
        """The next event within ``timeout_s`` (else ``asyncio.TimeoutError``)."""
        return await asyncio.wait_for(self.__anext__(), timeout_s)

    async def wait_for(self, predicate: Any, timeout_s: float) -> dict[str, Any]:
        """The first event for which ``predicate(event)`` is true, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError(f"no matching tap event within {timeout_s} s")
            event = await self.next(left)
            if predicate(event):
                return event

    def _check(self, frames: list[bytes]) -> dict[str, Any] | None:
        if len(frames) != 1 or len(frames[0]) <= SIGNATURE_BYTES:
            self.rejected += 1
            return None
        try:
            sender, receiver, seq, body = open_event(self.key, frames)
        except (AuthenticationError, ProtocolError, Refused) as e:
            self.rejected += 1
            log.warning("dropped a tap event: %s", e)
            return None
        if self.key is not None:
            if receiver != BROADCAST or seq <= self._last.get(sender, 0):
                self.rejected += 1
                log.warning("dropped a replayed tap event (seq %d)", seq)
                return None
            # every sender stays: a sender is a controller incarnation that signed with the
            # cluster key (a few a day), and one forgotten would accept its old events again
            self._last[sender] = seq
        try:
            event = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            self.rejected += 1
            log.warning("dropped a malformed tap event: %s", e)
            return None
        if not isinstance(event, dict):
            self.rejected += 1
            return None
        return event

    def close(self) -> None:
        self._sock.close(linger=0)


class TapRecorder:
    """Appends every tap event to a JSONL file (one ``to_json`` line each) from a
    background task, until ``stop()``.

    ``await start()`` returns once the subscription is live (a marker event the recorder
    emits itself has come back), so what is emitted afterwards is recorded; ``stop()``
    first waits, up to ``timeout_s``, for a second marker, so events emitted before it
    are in the file (``stop(flush=False)`` does not: for a cluster that is already gone).
    ``emit`` is the cluster's emit function (``nereus.actors.emit``)."""

    def __init__(
        self,
        address: str,
        key: bytes | None,
        path: str,
        emit: Any,
        timeout_s: float = 10.0,
        curve: CurveKey | None = None,
    ) -> None:
        self.path = path
        self._emit = emit
        self._timeout_s = timeout_s
        self._sub = Subscriber(address, key, curve=curve)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self._seen: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task | None = None
        self.events = 0

    async def _run(self) -> None:
        async for event in self._sub:
            marker = event.get("marker") if event.get("type") == "tap_recorder" else None
            if marker is not None:
                self._seen.setdefault(marker, asyncio.Event()).set()
                continue
            self._file.write(to_json(event) + "\n")
            self.events += 1

    async def _mark(self, name: str) -> bool:
        """Emit marker ``name`` until it comes back (a new subscription drops the first
        messages until it has joined); True once seen."""
        seen = self._seen.setdefault(name, asyncio.Event())
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            self._emit("tap_recorder", marker=name)
            try:
                await asyncio.wait_for(seen.wait(), 0.2)
                return True
            except asyncio.TimeoutError:
                continue
        log.warning(
            "the tap recorder's marker %r did not come back within %.0f s", name, self._timeout_s
        )
        return False

    async def start(self) -> TapRecorder:
        self._task = asyncio.ensure_future(self._run())
        await self._mark("start")
        return self

    async def stop(self, *, flush: bool = True) -> None:
        try:
            if flush and self._task is not None and not self._task.done():
                await self._mark("stop")
        finally:
            if self._task is not None:
                self._task.cancel()
                try:
                    await self._task
                except asyncio.CancelledError:
                    pass
            self._sub.close()
            self._file.close()


def _plain(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, msgpack.ExtType):
        return {"ext": value.code, "hex": value.data.hex()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def to_json(event: dict[str, Any]) -> str:
    """One JSON line for ``event`` (bytes as hex)."""
    return json.dumps(_plain(event), sort_keys=False, default=str)


_COMMON = ("type", "v", "seq", "time_monotonic_seconds", "epoch", "source", "pid")


def _is_plan(value: Any) -> bool:
    """A plan as tap events carry it: model-stage -> {tp, pp, devices, ...}."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(sp, dict) and "devices" in sp and "tp" in sp for sp in value.values())
    )


def format_event(event: dict[str, Any]) -> str:
    """One readable line: time, epoch, source, type, then the type's fields."""
    t = event.get("time_monotonic_seconds", 0.0)
    fields = []
    for k, v in event.items():
        if k in _COMMON:
            continue
        if k == "traceback":
            v = str(v).strip().splitlines()[-1:] if v else ""
        elif _is_plan(v):
            v = f"[{plan_text(v)}]"
        if isinstance(v, float):
            v = f"{v:.6g}"
        fields.append(f"{k}={v}")
    return (
        f"{t:14.3f} e{event.get('epoch', '?')} {str(event.get('source', '?')):<10} "
        f"{str(event.get('type', '?')):<16} " + " ".join(fields)
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="nereus tap", description="Print a controller's monitoring tap."
    )
    ap.add_argument("address", nargs="?", help="tcp://HOST:PORT of the tap (PUB socket)")
    ap.add_argument("--jsonl", default=None, help="append every event to FILE as JSON lines")
    ap.add_argument("--type", action="append", default=None, help="only these event types")
    ap.add_argument(
        "--key-file",
        default=None,
        help=f"cluster key to verify events (else ${KEY_ENV}; without: unverified)",
    )
    ap.add_argument(
        "--curve-key-file",
        default=None,
        help="the cluster's CURVE secret key, when its tcp sockets are encrypted",
    )
    ap.add_argument("--count", type=int, default=0, help="stop after N events (0: never)")
    ap.add_argument("--quiet", action="store_true", help="do not print (with --jsonl)")
    ap.add_argument("--schema", action="store_true", help="print the event schema and exit")
    return ap.parse_args(argv)


async def _run(args: argparse.Namespace) -> int:
    try:
        key = load_key(key_file=args.key_file)
    except ConfigError:
        if args.key_file:
            raise
        key = None
        print("nereus tap: no cluster key: events are NOT verified", file=sys.stderr)
    console = None
    if sys.stdout.isatty() and not args.quiet:
        from rich.console import Console

        console = Console(highlight=False)
    out = open(args.jsonl, "a", encoding="utf-8") if args.jsonl else None  # noqa: SIM115
    curve = load_curve(args.curve_key_file) if args.curve_key_file else None
    sub = Subscriber(args.address, key, set(args.type) if args.type else None, curve=curve)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main_task.cancel)
    n = 0
    try:
        async for event in sub:
            n += 1
            if out is not None:
                out.write(to_json(event) + "\n")
                out.flush()
            if not args.quiet:
                line = format_event(event)
                if console is not None:
                    style = {
                        "worker_death": "bold red",
                        "failure": "bold red",
                        "error": "red",
                        "node_lost": "bold red",
                        "counters": "yellow",
                    }.get(event.get("type"))
                    console.print(line, style=style, markup=False)
                else:
                    print(line, flush=True)
            if args.count and n >= args.count:
                break
    except asyncio.CancelledError:
        pass
    finally:
        sub.close()
        if out is not None:
            out.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.schema:
        print(describe())
        return 0
    if not args.address:
        print("nereus tap: give the tap address, e.g. tcp://127.0.0.1:5556", file=sys.stderr)
        return 2
    return exit_status("nereus tap", lambda: asyncio.run(_run(args)))


if __name__ == "__main__":
    sys.exit(main())
