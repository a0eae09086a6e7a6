"""The controller: registry of nodes and devices, failure fan-out, monitoring tap.

``Controller`` binds a ROUTER socket (node daemons, drivers and workers connect to
it) and a PUB socket (the monitoring tap). It is *not* on the path of actor calls:
callers talk to workers directly. It promises:

- Node daemons register their devices and get cluster-global device indices in
  join order; ``workers_ready`` makes those devices visible to drivers.
- A worker death reported by its node, or every worker of a node whose heartbeats
  stopped for ``heartbeat_timeout_s`` ("node lost"; a lost node that beats again is
  told so and stops its workers: it is never silently readmitted), is published and
  sent at once as a ``worker_died`` notice to every connected driver and worker,
  which fail their in-flight calls to it and run supervision.
- Every event a process ``emit``s is stamped (schema version, sequence number, layout
  epoch) and published; see ``nereus.monitor.schema``.
- Bad frames are counted, logged and dropped (``nereus.actors._channel``).

``nereus controller --bind tcp://0.0.0.0:5555 --key-file KEY`` runs one standalone; the key may also
come from ``$NEREUS_CLUSTER_KEY``. It prints ``NEREUS_CONTROLLER_READY <address> <tap_address>``
when it is listening. ``Cluster.local`` embeds one in the driver's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any

import zmq

from nereus.actors import _client, _session, _wire
from nereus.actors import _protocol as P
from nereus.actors._channel import Channel, Counters, configure
from nereus.actors._curve import CurveKey, load_curve, secure, stop_authenticators
from nereus.actors._keys import load_key
from nereus.actors._loop import run
from nereus.actors.events import SCHEMA_VERSION
from nereus.errors import ConfigError, ProtocolError, exit_status

__all__ = ["Controller", "main", "READY_PREFIX"]

log = logging.getLogger("nereus.controller")

READY_PREFIX = "NEREUS_CONTROLLER_READY "
# Control requests and events are small: a larger frame disconnects its sender before
# the controller buffers it.
MAX_MESSAGE_BYTES = 16 << 20


def _bind(sock: zmq.Socket, address: str) -> str:
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class Controller:
    """See the module docstring."""

    def __init__(
        self,
        key: bytes,
        *,
        bind: str = "tcp://127.0.0.1:0",
        tap_bind: str = "tcp://127.0.0.1:0",
        heartbeat_timeout_s: float = 10.0,
        curve: CurveKey | None = None,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ConfigError(f"heartbeat_timeout_s={heartbeat_timeout_s!r} must be > 0")
        self.key = key
        self.curve = curve  # CURVE on the tcp sockets (``nereus.actors._curve``)
        self._bind_address = bind
        self._tap_bind = tap_bind
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.epoch = 0
        self.counters = Counters()
        self.nodes: dict[str, dict[str, Any]] = {}
        self.devices: dict[int, dict[str, Any]] = {}
        self.clients: dict[bytes, dict[str, Any]] = {}
        self.address = ""
        self.tap_address = ""
        self._next_index = 0
        self._seq = 0
        self._changed: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._channel: Channel | None = None
        self._pub: zmq.Socket | None = None
        self._tap_id = _session.Session(serving=False).id  # the tap's sender id

    async def start(self) -> Controller:
        loop = asyncio.get_running_loop()
        ctx = zmq.Context.instance()
        self._changed = asyncio.Event()
        # Subscribers send nothing but subscriptions: 1 KiB frames are plenty.
        pub = configure(ctx.socket(zmq.PUB), 1024, receive_hwm=100)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        secure(pub, self.curve, self._tap_bind, server=True)
        self.tap_address = _bind(pub, self._tap_bind)
        self._pub = pub
        sock = configure(ctx.socket(zmq.ROUTER), MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        secure(sock, self.curve, self._bind_address, server=True)
        self.address = _bind(sock, self._bind_address)
        self._channel = Channel(
            sock,
            self.key,
            self._on_message,
            self.counters,
            loop=loop,
            max_message_bytes=MAX_MESSAGE_BYTES,
        )
        self._tasks.append(loop.create_task(self._watch_heartbeats()))
        self._tasks.append(loop.create_task(self._report_counters()))
        self.publish(
            {"type": "controller_start", "address": self.address, "tap_address": self.tap_address}
        )
        log.info("controller at %s, tap at %s", self.address, self.tap_address)
        return self

    # -- tap -------------------------------------------------------------------------

    def publish(self, event: dict[str, Any]) -> None:
        """Stamp and publish one event (dropped, counted, when no subscriber keeps up)."""
        self._seq += 1
        event.setdefault("time_monotonic_seconds", time.monotonic())
        event.setdefault("source", "controller")
        event["v"] = SCHEMA_VERSION
        event["seq"] = self._seq
        event.setdefault("epoch", self.epoch)
        if self._pub is None:
            return
        try:
            header, buffers = _wire.encode(event)
            if buffers:
                raise ProtocolError("events carry plain data only (no arrays or tensors)")
        except ProtocolError as e:
            self.counters.add("events_unencodable")
            log.warning("cannot publish a %r event: %s", event.get("type"), e)
            return
        # The event's sequence number doubles as the envelope's: a subscriber refuses
        # an event that is not newer than the last one from this controller.
        envelope = _session.envelope(self._tap_id, _session.ANY, self._seq)
        try:
            self._pub.send(
                b"".join((_wire.sign(self.key, header, (), envelope), envelope, header)),
                zmq.NOBLOCK,
            )
        except zmq.Again:
            self.counters.add("events_dropped")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    # -- messages --------------------------------------------------------------------

    def _on_message(self, ident: bytes | None, msg: Any) -> None:
        if type(msg) is not list or len(msg) != 4 or msg[0] != P.CTRL or type(msg[2]) is not str:
            self.counters.reject("header", "controller takes only [10, call_id, op, body]")
            return
        _, cid, op, body = msg
        if op == "emit":
            if type(body) is dict and type(body.get("type")) is str:
                self.publish(body)
            else:
                self.counters.reject("arguments", "emit needs a map with a string 'type'")
            return
        handler = getattr(self, "_op_" + op, None)
        if handler is None:
            self.counters.reject("unknown_method", f"controller op {op!r}")
            self._answer(ident, cid, None, f"unknown controller op {op!r}")
            return
        if type(body) is not dict:
            self.counters.reject("arguments", f"{op} needs a map body")
            self._answer(ident, cid, None, f"controller op {op!r} needs a map body")
            return
        try:
            value = handler(ident, body)
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            self.counters.reject("arguments", f"{op}: {e}")
            self._answer(ident, cid, None, f"controller op {op!r} refused: {e}")
            return
        self._answer(ident, cid, value, None)

    def _answer(self, ident: bytes, cid: Any, value: Any, error: str | None) -> None:
        if type(cid) is not int or cid == 0:
            return
        msg = (
            [P.OK, cid, 0, value]
            if error is None
            else [P.ERR, cid, 0, P.ERR_PROTOCOL, "ProtocolError", error, ""]
        )
        self._send(ident, msg)

    def _send(self, ident: bytes, msg: list) -> bool:
        try:
            self._channel.send(msg, ident)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: that peer is gone
            log.info("dropping unreachable peer %r: %s", ident, e)
            self.clients.pop(ident, None)
            return False

    # -- ops -------------------------------------------------------------------------

    def _op_hello(self, ident: bytes, body: dict) -> dict:
        self.clients[ident] = {"source": str(body.get("source", "?"))}
        return self._view()

    def _op_bye(self, ident: bytes, body: dict) -> dict:
        self.clients.pop(ident, None)
        return {}

    def _op_set_epoch(self, ident: bytes, body: dict) -> dict:
        epoch = body["epoch"]
        if type(epoch) is not int or epoch < self.epoch:
            raise ValueError(f"epoch={epoch!r} must be an int >= the current {self.epoch}")
        self.epoch = epoch
        self.publish({"type": "epoch", "epoch": epoch})
        return {"epoch": epoch}

    def _op_devices(self, ident: bytes, body: dict) -> dict:
        return self._view()

    def _view(self) -> dict:
        devices = [d for d in self.devices.values() if d["alive"] and d["address"]]
        return {"devices": devices, "tap_address": self.tap_address, "epoch": self.epoch}

    def _op_node_register(self, ident: bytes, body: dict) -> dict:
        node_id = body["node_id"]
        if node_id in self.nodes and self.nodes[node_id]["alive"]:
            raise ValueError(f"node_id={node_id!r} is already registered and alive")
        indices = []
        for dev in body["devices"]:
            index = self._next_index
            self._next_index += 1
            self.devices[index] = {
                "index": index,
                "host": str(body.get("host", "")),
                "kind": dev["kind"],
                "memory_bytes": int(dev["memory_bytes"]),
                "node_id": node_id,
                "local_index": int(dev["local_index"]),
                "address": "",
                "pid": 0,
                "alive": True,
            }
            indices.append(index)
        self.nodes[node_id] = {
            "ident": ident,
            "host": body.get("host", ""),
            "alive": True,
            "last_heartbeat": time.monotonic(),
            "devices": indices,
        }
        self.publish(
            {
                "type": "node_join",
                "node_id": node_id,
                "host": body.get("host", ""),
                "devices": indices,
            }
        )
        return {"indices": indices}

    def _op_workers_ready(self, ident: bytes, body: dict) -> dict:
        node = self.nodes[body["node_id"]]
        for w in body["workers"]:
            dev = self.devices[int(w["index"])]
            if dev["node_id"] != body["node_id"]:
                raise ValueError(f"device {w['index']} does not belong to {body['node_id']!r}")
            dev["address"] = str(w["address"])
            dev["pid"] = int(w["pid"])
            self.publish(
                {
                    "type": "worker_join",
                    "device": dev["index"],
                    "node_id": dev["node_id"],
                    "pid": dev["pid"],
                    "address": dev["address"],
                    "kind": dev["kind"],
                    "memory_bytes": dev["memory_bytes"],
                }
            )
        node["last_heartbeat"] = time.monotonic()
        self._changed.set()
        return {}

    def _op_heartbeat(self, ident: bytes, body: dict) -> dict:
        node = self.nodes.get(body["node_id"])
        if node is not None and node["alive"]:
            node["last_heartbeat"] = time.monotonic()
        elif node is not None:
            # Declared lost, yet still beating (a stall or a partition): its devices are
            # already reported dead to every owner, so tell it to stop its workers.
            self._send(ident, [P.NOTE, "node_lost", {"node_id": body["node_id"]}])
        return {}

    def _op_worker_died(self, ident: bytes, body: dict) -> dict:
        self._device_died(
            int(body["index"]), str(body.get("reason", "died")), body.get("returncode")
        )
        return {}

    def _op_node_leave(self, ident: bytes, body: dict) -> dict:
        node = self.nodes.get(body["node_id"])
        if node is None or not node["alive"]:
            return {}
        node["alive"] = False
        reason = str(body.get("reason", "shutdown"))
        for index in node["devices"]:
            dev = self.devices[index]
            if dev["alive"]:
                dev["alive"] = False
                self.publish(
                    {
                        "type": "worker_leave",
                        "device": index,
                        "node_id": dev["node_id"],
                        "pid": dev["pid"],
                    }
                )
                # its owners learn it as they learn a death: work on it is gone
                self._notify_death(dev, f"node left ({reason})")
        self.publish({"type": "node_leave", "node_id": body["node_id"], "reason": reason})
        self._changed.set()
        return {}

    def _op_retire(self, ident: bytes, body: dict) -> dict:
        """A driver retires a drained device: its node stops the worker (no failure) and
        says so with ``worker_retired``, which every driver hears as ``device_retired``."""
        index = body.get("device")
        dev = self.devices.get(index) if type(index) is int else None
        if dev is None or not dev["alive"]:
            raise ValueError(f"device={index!r} is not a live device")
        node = self.nodes.get(dev["node_id"])
        dev["alive"] = False
        if node is not None and node["alive"]:
            self._send(node["ident"], [P.NOTE, "stop_worker", {"index": index}])
        else:  # nothing left to stop
            self._op_worker_retired(ident, {"index": index})
        self._changed.set()
        return {"retiring": index}

    def _op_worker_retired(self, ident: bytes, body: dict) -> dict:
        dev = self.devices[int(body["index"])]
        self.publish(
            {
                "type": "worker_retire",
                "device": dev["index"],
                "node_id": dev["node_id"],
                "pid": dev["pid"],
            }
        )
        notice = [
            P.NOTE,
            "device_retired",
            {"device": dev["index"], "address": dev["address"], "reason": "retired"},
        ]
        for client in list(self.clients):
            self._send(client, notice)
        return {}

    def _notify_death(self, dev: dict[str, Any], reason: str) -> None:
        notice = [
            P.NOTE,
            "worker_died",
            {
                "device": dev["index"],
                "address": dev["address"],
                "node_id": dev["node_id"],
                "pid": dev["pid"],
                "reason": reason,
            },
        ]
        for ident in list(self.clients):
            self._send(ident, notice)

    def _device_died(self, index: int, reason: str, returncode: Any = None) -> None:
        dev = self.devices.get(index)
        if dev is None or not dev["alive"]:
            return
        dev["alive"] = False
        log.warning(
            "device %d (pid %d on node %s) died: %s", index, dev["pid"], dev["node_id"], reason
        )
        self.publish(
            {
                "type": "worker_death",
                "device": index,
                "node_id": dev["node_id"],
                "pid": dev["pid"],
                "reason": reason,
                "returncode": returncode,
            }
        )
        self._notify_death(dev, reason)
        self._changed.set()

    # -- background ------------------------------------------------------------------

    async def _watch_heartbeats(self) -> None:
        period = self.heartbeat_timeout_s / 4
        while True:
            expected = time.monotonic() + period
            await asyncio.sleep(period)
            now = time.monotonic()
            stall = now - expected
            if stall > period:
                # This loop itself was blocked (e.g. a driver hosting an embedded controller
                # ran a long computation): heartbeats may be waiting unread, so the
                # silence is ours, not the nodes'. Credit it instead of declaring loss.
                for node in self.nodes.values():
                    node["last_heartbeat"] += stall
                continue
            for node_id, node in self.nodes.items():
                silence = now - node["last_heartbeat"]
                if node["alive"] and silence > self.heartbeat_timeout_s:
                    node["alive"] = False
                    log.warning("node %s lost: no heartbeat for %.1f s", node_id, silence)
                    self.publish(
                        {"type": "node_lost", "node_id": node_id, "silence_seconds": silence}
                    )
                    for index in node["devices"]:
                        self._device_died(index, "node lost")

    async def _report_counters(self) -> None:
        last: dict[str, int] = {}
        while True:
            await asyncio.sleep(2.0)
            now = self.counters.problems()
            if now != last:
                self.publish({"type": "counters", "counters": self.counters.snapshot()})
                last = now

    async def wait_devices(self, count: int, timeout_s: float) -> list[dict[str, Any]]:
        """The ready devices once at least ``count`` are ready (else DeadlineExceeded)."""
        from nereus.errors import DeadlineExceeded, NereusError

        deadline = time.monotonic() + timeout_s
        while True:
            devices = self._view()["devices"]
            if len(devices) >= count:
                return devices
            alive = sum(1 for d in self.devices.values() if d["alive"])
            if alive < count:
                raise NereusError(
                    f"only {alive} devices are alive; {count} were expected "
                    "(see the worker_death / node_lost events)"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(
                    f"only {len(devices)} of {count} devices became ready within {timeout_s} s"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                continue

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._channel is not None:
            self._channel.close()
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self.curve is not None:
            stop_authenticators()


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="nereus controller", description="Run a standalone nereus controller."
    )
    ap.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        help="ROUTER address nodes and drivers connect to (port 0: any free port)",
    )
    ap.add_argument(
        "--tap-bind",
        default="tcp://127.0.0.1:0",
        help="PUB address of the monitoring tap (port 0: any free port)",
    )
    ap.add_argument(
        "--key-file", default=None, help="file holding the cluster key (else $NEREUS_CLUSTER_KEY)"
    )
    ap.add_argument(
        "--curve-key-file",
        default=None,
        help="encrypt tcp sockets with this CURVE secret key (nereus curve-key)",
    )
    ap.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=10.0,
        help="declare a node lost after this long without a heartbeat",
    )
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    key = load_key(key_file=args.key_file)
    curve = load_curve(args.curve_key_file) if args.curve_key_file else None
    controller = await Controller(
        key,
        bind=args.bind,
        tap_bind=args.tap_bind,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        curve=curve,
    ).start()
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    _client.set_local_publisher(controller.publish)  # emit() in this process
    print(f"{READY_PREFIX}{controller.address} {controller.tap_address}", flush=True)
    try:
        await stop
    finally:
        await controller.close()


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s controller %(name)s %(levelname)s %(message)s",
    )
    return exit_status("nereus controller", lambda: run(_serve(args)))


if __name__ == "__main__":
    sys.exit(main())
