"""``nereus dashboard``: a local web page that follows a run's tap live.

    nereus dashboard --tap tcp://HOST:PORT --key-file KEY [--host 127.0.0.1] [--port 8470]
    nereus dashboard --jsonl tap.jsonl [--follow]      # a recorded stream, or metrics.jsonl

``Dashboard`` is an aiohttp server (``pip install 'nereus[dashboard]'``) over one
``DashboardView`` (``nereus.monitor.view``): every event from the source is folded into
the view, and the updates it makes go to every open page as Server-Sent Events. A page
that connects (or reconnects: the browser does so by itself) gets ``reset``, then every
update so far, then the live ones; the page is one self-contained file
(``dashboard.html``: inline script and SVG, nothing fetched from anywhere else), so it
works offline. Routes: ``/`` the page, ``/events`` the stream, ``/api/updates`` and
``/api/status`` the same as JSON.

Promises: binds 127.0.0.1 unless told otherwise; on a loopback address it answers only
requests whose ``Host`` names that address (a web page elsewhere cannot read the run
through DNS rebinding); the page runs under a Content-Security-Policy that allows only
its own inline script (by hash) and connections back to this server. Never prints or
serves the key. A page that falls too far behind is disconnected and catches up from
the start when the browser reconnects.

More (how it works): docs/monitoring.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import ipaddress
import json
import logging
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError, exit_status
from nereus.monitor.view import DashboardView

__all__ = ["Dashboard", "DEFAULT_PORT", "READY_PREFIX", "events_from_jsonl", "main"]

log = logging.getLogger("nereus.monitor")

DEFAULT_PORT = 8470
READY_PREFIX = "NEREUS_DASHBOARD_READY "
INSTALL = "pip install 'nereus[dashboard]'"
PAGE = Path(__file__).with_name("dashboard.html")
_CHUNK = 500  # updates per SSE message when a page catches up
_QUEUE = 20_000  # updates a page may fall behind before it is disconnected
_HEARTBEAT_S = 15.0


def _page_and_policy() -> tuple[bytes, str]:
    """The page's bytes and a Content-Security-Policy that admits its one inline script."""
    html = PAGE.read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    if len(scripts) != 1:
        raise RuntimeError(f"{PAGE} must hold exactly one inline <script>; it holds {len(scripts)}")
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    policy = (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return html.encode(), policy


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Dashboard:
    """The server: one view, any number of pages (see the module docstring).

    ``source`` and ``verified`` are shown in the page's header. ``add(event)`` folds an
    event in and sends its updates; ``set_state(text)`` changes the source's state line."""

    def __init__(
        self,
        *,
        source: str,
        verified: bool | None,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        view: DashboardView | None = None,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port={port!r} must be an integer in 0..65535 (0: any free port)")
        self.view = view or DashboardView()
        self.source = source
        self.verified = verified
        self.host = host
        self.port = port
        self.state = "starting"
        self.rejected_by_source = 0
        self.url = ""
        self._queues: set[asyncio.Queue] = set()
        self._runner: Any = None
        self._last_event_unix: float | None = None
        self._page, self._policy = _page_and_policy()
        self._allowed_hosts: set[str] | None = None

    # --- the view ------------------------------------------------------------------

    def add(self, event: Any) -> None:
        updates = self.view.add(event)
        self._last_event_unix = time.time()
        self._send(updates)

    def set_state(self, state: str, *, force: bool = False) -> None:
        """Show ``state`` as the source's state line (pages get a status update when it
        changes, or with ``force``)."""
        if force or state != self.state:
            self.state = state
            self._send([])

    def status(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "verified": self.verified,
            "state": self.state,
            "rejected_by_source": self.rejected_by_source,
            "last_event_unix": self._last_event_unix,
            **self.view.status(),
        }

    def _send(self, updates: list[dict[str, Any]]) -> None:
        for q in list(self._queues):
            if q.qsize() + len(updates) > _QUEUE:  # too far behind: it reconnects and catches up
                self._queues.discard(q)
                q.put_nowait(None)
                continue
            q.put_nowait(updates)

    # --- the server ------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve; returns the page's URL."""
        try:
            from aiohttp import web
        except ImportError:
            raise ConfigError(f"the dashboard needs aiohttp: {INSTALL}") from None

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            return await self._guard(request, handler)

        app = web.Application(middlewares=[guard])
        app.router.add_get("/", self._index)
        app.router.add_get("/events", self._events)
        app.router.add_get("/api/updates", self._updates)
        app.router.add_get("/api/status", self._status)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise ConfigError(
                f"host={self.host!r} port={self.port}: cannot listen there ({e.strerror})"
            ) from None
        port = site._server.sockets[0].getsockname()[1]  # the port the OS gave for port 0
        shown = f"[{self.host}]" if ":" in self.host else self.host
        if _is_loopback(self.host):
            self._allowed_hosts = {
                f"{shown}:{port}",
                f"localhost:{port}",
                f"127.0.0.1:{port}",
                f"[::1]:{port}",
            }
        self.url = f"http://{shown}:{port}/"
        return self.url

    async def close(self) -> None:
        for q in list(self._queues):
            q.put_nowait(None)
        self._queues.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _guard(self, request: Any, handler: Any) -> Any:
        from aiohttp import web

        if self._allowed_hosts is not None and request.host not in self._allowed_hosts:
            return web.Response(
                status=403, text=f"Host {request.host!r} is not this dashboard's address\n"
            )
        response = await handler(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        return response

    async def _index(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(
            body=self._page,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": self._policy, "Cache-Control": "no-store"},
        )

    async def _updates(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {"status": self.status(), "updates": self.view.updates}, dumps=_dumps
        )

    async def _status(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(self.status(), dumps=_dumps)

    async def _events(self, request: Any) -> Any:
        from aiohttp import web

        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        # the history and the live queue are taken together (no await between): no gap, no repeat
        history = list(self.view.updates)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.add(queue)
        try:
            await response.write(_sse("reset", self.status()))
            for i in range(0, len(history), _CHUNK):
                await response.write(_sse("updates", history[i : i + _CHUNK]))
            await response.write(_sse("status", self.status()))
            ended = False
            while not ended:
                try:
                    item = await asyncio.wait_for(queue.get(), _HEARTBEAT_S)
                except asyncio.TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if item is None:  # the server closes, or this page fell too far behind
                    break
                batch = list(item)
                while not queue.empty():  # whatever else is waiting goes in the same message
                    more = queue.get_nowait()
                    if more is None:
                        ended = True
                        break
                    batch += more
                for i in range(0, len(batch), _CHUNK):
                    await response.write(_sse("updates", batch[i : i + _CHUNK]))
                await response.write(_sse("status", self.status()))
        except ConnectionResetError:  # the page went away
            pass
        finally:
            self._queues.discard(queue)
        return response


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


def _sse(name: str, data: Any) -> bytes:
    return f"event: {name}\ndata: {_dumps(data)}\n\n".encode()


# --- sources -------------------------------------------------------------------------


def events_from_jsonl(line: str, where: str, clock: list[float]) -> dict[str, Any] | None:
    """The event one JSONL line holds: a tap event as ``nereus tap --jsonl`` wrote it, or a
    ``metrics.jsonl`` record made into a ``step`` event (its time is the sum of the
    steps' seconds so far, kept in ``clock``). None for a blank line; ``ValueError``
    naming ``where`` (file and line) for anything else."""
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a {type(obj).__name__}, not a JSON object")
    if "type" in obj:
        return obj
    if "step" in obj and "step_seconds" in obj:  # a metrics.jsonl record
        seconds = obj["step_seconds"] if isinstance(obj["step_seconds"], (int, float)) else 0.0
        clock[0] += seconds
        stages = {
            k.removesuffix("_seconds"): v
            for k, v in obj.items()
            if k.endswith("_seconds") and isinstance(v, float)
        }
        return {
            "type": "step",
            "step": obj["step"],
            "time_monotonic_seconds": clock[0],
            "epoch": obj.get("epoch", 0),
            "stage_seconds": stages,
            "model_stage_seconds": obj.get("model_stage_seconds") or {},
            "reward": obj.get("reward_mean"),
            "response_length_tokens": obj.get("response_len_mean"),
            "max_new_tokens": obj.get("max_new_tokens"),
            "tokens": obj.get("tokens_generated"),
            "device_peak_bytes": obj.get("device_peak_bytes") or {},
            "policy_version": obj.get("policy_version"),
        }
    raise ValueError(
        f"{where}: neither a tap event (no 'type') nor a metrics record ('step', 'step_seconds')"
    )


async def read_jsonl(
    dashboard: Dashboard, path: str, *, follow: bool = False, poll_s: float = 0.5
) -> None:
    """Fold every line of ``path`` into ``dashboard``; with ``follow``, then the lines
    appended later, until cancelled."""
    clock = [0.0]
    number = 0
    try:
        fh = open(path, encoding="utf-8")  # noqa: SIM115 - kept open while following
    except OSError as e:
        raise ConfigError(f"--jsonl {path!r} cannot be read: {e.strerror}") from None
    dashboard.set_state(f"reading {path}")
    with fh:
        pending = ""
        while True:
            chunk = fh.readline()
            if chunk:
                pending += chunk
                if not pending.endswith("\n") and follow:
                    continue  # a line being written: wait for its end
                number += 1
                line, pending = pending, ""
                try:
                    event = events_from_jsonl(line, f"{path}:{number}", clock)
                except ValueError as e:
                    dashboard.rejected_by_source += 1
                    log.warning("%s", e)
                    continue
                if event is not None:
                    dashboard.add(event)
                continue
            if not follow:
                break
            dashboard.set_state(f"following {path}")
            await asyncio.sleep(poll_s)  # a file has no change notification we can rely on
    dashboard.set_state(f"read {path}: {number} lines")


async def follow_tap(dashboard: Dashboard, address: str, key: bytes | None) -> None:
    """Fold every event of the tap at ``address`` into ``dashboard`` until cancelled."""
    from nereus.monitor.tap import Subscriber

    sub = Subscriber(address, key)
    dashboard.set_state(f"listening to {address}")
    try:
        while True:
            try:
                event = await sub.next(_HEARTBEAT_S / 3)
            except asyncio.TimeoutError:  # nothing good arrived: forged ones may have
                event = None
            if sub.rejected != dashboard.rejected_by_source:
                dashboard.rejected_by_source = sub.rejected
                if event is None:
                    dashboard.set_state(dashboard.state, force=True)
            if event is not None:
                dashboard.add(event)
    finally:
        sub.close()


# --- the command ---------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="nereus dashboard", description="Serve a local web page that follows a run live."
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tap", metavar="ADDRESS", help="tcp://HOST:PORT of a controller's tap")
    src.add_argument(
        "--jsonl", metavar="FILE", help="a stream written by `nereus tap --jsonl`, or metrics.jsonl"
    )
    ap.add_argument(
        "--key-file",
        default=None,
        help="cluster key that verifies the tap's events (else $NEREUS_CLUSTER_KEY)",
    )
    ap.add_argument(
        "--follow", action="store_true", help="with --jsonl: read lines appended later too"
    )
    ap.add_argument(
        "--host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1)"
    )
    ap.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0: any free port)",
    )
    return ap.parse_args(argv)


async def _run(args: argparse.Namespace) -> int:
    if args.tap:
        from nereus.actors.events import load_key

        if "://" not in args.tap:
            raise ConfigError(f"--tap={args.tap!r} must look like 'tcp://HOST:PORT'")
        try:
            key: bytes | None = load_key(key_file=args.key_file)
        except ConfigError:
            if args.key_file:
                raise
            key = None
            print("nereus dashboard: no cluster key: events are NOT verified", file=sys.stderr)
        dashboard = Dashboard(
            source=f"tap {args.tap}", verified=key is not None, host=args.host, port=args.port
        )
        feed = follow_tap(dashboard, args.tap, key)
    else:
        if args.key_file:
            raise ConfigError(
                "--key-file verifies a live tap; a --jsonl file carries no signatures"
            )
        if not Path(args.jsonl).is_file():
            raise ConfigError(f"--jsonl={args.jsonl!r} is not a file")
        dashboard = Dashboard(
            source=f"file {args.jsonl}", verified=None, host=args.host, port=args.port
        )
        feed = read_jsonl(dashboard, args.jsonl, follow=args.follow)
    url = await dashboard.start()
    if not _is_loopback(args.host):
        print(
            f"nereus dashboard: serving on {args.host}: anyone who reaches it can read the run",
            file=sys.stderr,
        )
    print(f"nereus dashboard: {url} ({dashboard.source})", file=sys.stderr)
    print(f"{READY_PREFIX}{url}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = loop.create_task(feed)
    waiter = loop.create_task(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and task.exception() is not None:
            raise task.exception()
        await waiter  # a finished file stays on the page until interrupted
    finally:
        for t in (task, waiter):
            t.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)
        await dashboard.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    return exit_status("nereus dashboard", lambda: asyncio.run(_run(args)))


if __name__ == "__main__":
    sys.exit(main())
