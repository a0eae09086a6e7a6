"""Headless Chromium driven over the DevTools protocol (aiohttp's WebSocket client).

Debian's ``chromium`` (``/usr/bin/chromium``) is what the tests use: ``make test``
installs it where it is missing (``make browser``); browser downloads do not work on the
project's machines. ``Chromium.start`` runs it headless with its own empty profile and
no background traffic, reads the DevTools address it prints, and opens pages on which
the tests evaluate JavaScript, wait for a condition (on the page's own render event,
not by sleeping) and take screenshots. Console errors and exceptions of every page are
collected (``Page.errors``). ``close`` ends the browser and every process it started.

Fails (``BrowserError``) with what Chromium printed when it cannot start: a test that
needs the browser fails, it does not skip.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

BINARY = "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-port=0",
    "--remote-debugging-address=127.0.0.1",
)


class BrowserError(AssertionError):
    """Chromium is missing, did not start, or a DevTools command failed."""


class Chromium:
    def __init__(self, proc: asyncio.subprocess.Process, profile: str) -> None:
        self.proc = proc
        self.profile = profile
        self.stderr: list[str] = []
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._pages: dict[str, Page] = {}
        self._http: aiohttp.ClientSession | None = None
        self._ws: Any = None
        self._reader: asyncio.Task | None = None
        self._drain: asyncio.Task | None = None

    @classmethod
    async def start(cls, binary: str = BINARY, timeout_s: float = 60.0) -> Chromium:
        if not os.access(binary, os.X_OK):
            raise BrowserError(
                f"{binary} is missing: the dashboard tests drive Debian's chromium; `make test` "
                "installs it (`make browser`: apt-get install chromium)"
            )
        profile = tempfile.mkdtemp(prefix="nereus-chromium-")
        proc = await asyncio.create_subprocess_exec(
            binary,
            *FLAGS,
            f"--user-data-dir={profile}",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self = cls(proc, profile)
        try:
            url = await asyncio.wait_for(self._devtools_url(), timeout_s)
            self._drain = asyncio.get_running_loop().create_task(self._read_stderr())
            self._http = aiohttp.ClientSession()
            self._ws = await self._http.ws_connect(url, max_msg_size=0)
            self._reader = asyncio.get_running_loop().create_task(self._read())
        except BaseException as e:
            await self.close()
            if isinstance(e, asyncio.TimeoutError):
                raise BrowserError(
                    f"chromium printed no DevTools address within {timeout_s} s:\n"
                    + "".join(self.stderr[-30:])
                ) from None
            raise
        return self

    async def _devtools_url(self) -> str:
        while True:
            line = (await self.proc.stderr.readline()).decode(errors="replace")
            if not line:
                rc = await self.proc.wait()
                raise BrowserError(
                    f"chromium exited ({rc}) before it was ready:\n" + "".join(self.stderr[-30:])
                )
            self.stderr.append(line)
            if line.startswith("DevTools listening on "):
                return line.split(" on ", 1)[1].strip()

    async def _read_stderr(self) -> None:
        while line := await self.proc.stderr.readline():
            self.stderr = self.stderr[-200:] + [line.decode(errors="replace")]

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._waiting.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif data.get("sessionId") in self._pages:
                self._pages[data["sessionId"]].on_event(data["method"], data.get("params", {}))
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(
                    BrowserError("the DevTools connection closed:\n" + "".join(self.stderr[-30:]))
                )

    async def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout_s: float = 30.0,
    ) -> dict[str, Any]:
        if self._ws is None or self._ws.closed:
            raise BrowserError(f"{method}: the DevTools connection is closed")
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = fut
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        await self._ws.send_str(json.dumps(msg))
        reply = await asyncio.wait_for(fut, timeout_s)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def new_page(self, width: int = 1400, height: int = 1000) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        self._pages[page.session] = page
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            await page.send(method)
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page

    async def close(self) -> None:
        """End the browser (politely, then by its process group) and remove its profile."""
        if self._ws is not None and not self._ws.closed:
            try:
                await self.send("Browser.close", timeout_s=5)
            except (BrowserError, asyncio.TimeoutError, ConnectionError):
                pass
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        for task in (self._reader, self._drain):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab: navigate, evaluate, wait for a condition, screenshot."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session
        self.errors: list[str] = []
        self._loaded = asyncio.Event()

    def on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.exceptionThrown":
            self.errors.append(
                params["exceptionDetails"].get("exception", {}).get("description")
                or params["exceptionDetails"].get("text", "?")
            )
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(
                " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            )
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(params["entry"].get("text", "?"))

    async def send(
        self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0
    ) -> dict[str, Any]:
        return await self.browser.send(method, params, self.session, timeout_s)

    async def goto(self, url: str, timeout_s: float = 30.0) -> None:
        self._loaded.clear()
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"navigating to {url}: {result['errorText']}")
        await asyncio.wait_for(self._loaded.wait(), timeout_s)

    async def evaluate(self, expression: str, timeout_s: float = 30.0) -> Any:
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            timeout_s=timeout_s + 5,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(
                f"{expression[:200]}: {details.get('exception', {}).get('description') or details}"
            )
        return result["result"].get("value")

    async def wait_for(self, condition: str, timeout_s: float = 30.0) -> Any:
        """The first truthy value of the JavaScript expression ``condition``, checked now and
        after every render of the dashboard (its ``nereus:rendered`` event)."""
        expression = f"""new Promise((resolve) => {{
            const check = () => {{ let v; try {{ v = ({condition}); }} catch (e) {{ v = null; }}
                                   if (v) {{ document.removeEventListener("nereus:rendered", check);
                                             resolve(v); }} }};
            document.addEventListener("nereus:rendered", check); check(); }})"""
        try:
            return await asyncio.wait_for(self.evaluate(expression, timeout_s), timeout_s)
        except asyncio.TimeoutError:
            raise BrowserError(
                f"within {timeout_s} s the page never showed: {condition}\n"
                f"page errors: {self.errors}"
            ) from None

    async def screenshot(self, path: str | Path) -> bytes:
        """A PNG of the whole page (the viewport grows to the document's height)."""
        height = await self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        width = await self.evaluate("Math.ceil(document.documentElement.clientWidth)")
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        data = base64.b64decode(
            (await self.send("Page.captureScreenshot", {"format": "png"}))["data"]
        )
        Path(path).write_bytes(data)
        return data
