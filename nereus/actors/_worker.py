"""``python -m nereus.actors._worker``: one worker process standing for one device.

Started by the node daemon (never by multiprocessing: nothing is pickled). It binds
one ROUTER socket (ipc or tcp; with ipc also a same-host stream socket at the ipc
path + ".s", see ``_stream``), prints ``NEREUS_WORKER_READY <address>`` on stdout,
connects to the controller for events and failure notices, and hosts actors
(``ActorHost``) until it is told to shut down (control op ``shutdown``, SIGTERM or
SIGINT) or its parent (the node daemon) dies. It sets ``OMP_NUM_THREADS=1`` and one
torch thread unless told otherwise. The cluster key comes from
``$NEREUS_CLUSTER_KEY`` (set by the node).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys

import zmq

from nereus.actors import _client, _stream
from nereus.actors._channel import DEFAULT_MAX_MESSAGE_BYTES, configure
from nereus.actors._curve import secure
from nereus.actors._host import ActorHost
from nereus.actors._keys import curve_from_env, load_key
from nereus.actors._loop import run
from nereus.actors._protocol import WORKER_READY
from nereus.actors.actor import DeviceInfo, _set_current_device

__all__ = ["main", "READY_PREFIX"]

log = logging.getLogger("nereus.actors")

READY_PREFIX = WORKER_READY
_COUNTER_EVENT_PERIOD_S = 2.0


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the node daemon dies, so no worker outlives it."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError as e:
            log.warning("cannot set the parent-death signal: %s", e)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(3)  # the parent died before prctl took effect


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m nereus.actors._worker")
    ap.add_argument("--controller", required=True)
    ap.add_argument("--bind", required=True, help="ipc://PATH or tcp://HOST:PORT (port 0: any)")
    ap.add_argument("--device-index", type=int, required=True)
    ap.add_argument("--local-index", type=int, default=0)
    ap.add_argument("--host", default="localhost")
    ap.add_argument("--kind", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--memory-bytes", type=int, required=True)
    ap.add_argument("--node-id", default="")
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    ap.add_argument("--log-level", default="WARNING")
    return ap.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    key = load_key()
    curve = curve_from_env()
    device = DeviceInfo(
        args.device_index, args.host, args.kind, args.memory_bytes, args.node_id, args.local_index
    )
    _set_current_device(device)
    loop = asyncio.get_running_loop()
    ctx = zmq.Context.instance()
    sock = configure(ctx.socket(zmq.ROUTER), args.max_message_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished caller raises, is counted
    bind = args.bind.replace(":0", ":*") if args.bind.startswith("tcp://") else args.bind
    secure(sock, curve, bind, server=True)
    sock.bind(bind)
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    client = _client.Client(key, source=f"worker:{device.index}", curve=curve)
    client.connect_controller(args.controller)
    _client.set_current_client(client)
    host = ActorHost(
        sock,
        key,
        device,
        client.counters,
        emit=client.emit_event,
        max_message_bytes=args.max_message_bytes,
    )
    stream = _stream.stream_path(address) if _stream.stream_enabled() else None
    if stream is not None:
        try:
            await host.listen_stream(stream)
        except OSError as e:  # e.g. a path too long for a Unix socket: callers use ZeroMQ
            log.warning("no same-host stream socket at %s: %s", stream, e)
    stop = loop.create_future()

    def shutdown(_body: object = None) -> dict:
        if not stop.done():
            stop.set_result(None)
        return {"shutting_down": True}

    host.extra_control["shutdown"] = shutdown
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown)
    print(READY_PREFIX + address, flush=True)
    reporter = loop.create_task(_report_counters(client, device.index))
    try:
        await stop
    finally:
        reporter.cancel()
        host.close()
        client.close()
        _client.set_current_client(None)
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://") :])
            except FileNotFoundError:
                pass
        _exit_now()


def _exit_now() -> None:
    """Leave at once. The sockets and files are closed; threads still blocked in a
    torch or gloo call (an endpoint's worker thread, gloo's own) must not keep a worker
    alive past its shutdown, and the loop's exit would join them."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _report_counters(client: _client.Client, device: int) -> None:
    """Publish the counters on the tap whenever a non-traffic one (rejections...) moves."""
    last: dict[str, int] = {}
    while True:
        await asyncio.sleep(_COUNTER_EVENT_PERIOD_S)
        now = client.counters.problems()
        if now != last:
            client.emit_event(
                {"type": "counters", "device": device, "counters": client.counters.snapshot()}
            )
            last = now


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s worker{args.device_index} %(name)s %(levelname)s %(message)s",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _die_with_parent(args.parent_pid)
    run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
