"""Actor classes the tests spawn (workers import this module by path)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import socket
import tempfile

from nereus.actors import Actor, current_device, emit, endpoint


class Echo(Actor):
    def __init__(self, tag: str = "", *, scale: int = 1) -> None:
        self.tag = tag
        self.scale = scale
        self.seen: list[int] = []
        self.failures: list[dict] = []

    @endpoint
    async def ping(self, x=None):
        return x

    @endpoint
    async def add(self, a: int, b: int = 0) -> int:
        return (a + b) * self.scale

    @endpoint
    async def where(self) -> dict:
        d = current_device()
        return {
            "index": d.index,
            "kind": d.kind,
            "memory_bytes": d.memory_bytes,
            "same": d == self.device,
            "rank": self.rank,
            "coords": self.coords,
            "tag": self.tag,
            "pid": os.getpid(),
            "name": self.name,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        }

    @endpoint
    async def fail(self, message: str):
        raise KeyError(message)

    @endpoint
    async def leave_temporary_files(self) -> dict:
        """What a library does in the temporary folder and never cleans up: a file, and a
        unix socket bound there (vLLM's engine sockets), both left open."""
        fd, path = tempfile.mkstemp()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = os.path.join(tempfile.gettempdir(), f"sock-{os.getpid()}")
        sock.bind(bound)
        self._left_open = (fd, sock)
        return {"tmpdir": tempfile.gettempdir(), "file": path, "socket": bound, "pid": os.getpid()}

    @endpoint
    def sync_double(self, x: float) -> float:
        return 2 * x

    @endpoint
    async def record(self, i: int) -> None:
        self.seen.append(i)

    @endpoint
    async def seen_list(self) -> list:
        return list(self.seen)

    @endpoint
    async def sleep(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    @endpoint(concurrent=True)
    async def sleep_concurrent(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    @endpoint
    async def tokens(self, n: int):
        for i in range(n):
            yield i

    @endpoint
    async def tokens_then_fail(self, n: int):
        for i in range(n):
            yield i
        raise ValueError("stream broke")

    @endpoint
    async def emit_event(self, value: int) -> None:
        emit("test_event", value=value, device=self.device.index)

    @endpoint
    async def emit_from_thread(self, value: int) -> None:
        """emit is thread-safe: engines call it from collective threads."""
        await asyncio.to_thread(emit, "thread_event", value=value)

    @endpoint
    async def relay(self, ref, method: str, *args):
        """Call another actor through a ref received as an argument."""
        return await getattr(ref, method).call_one(*args)

    @endpoint
    async def unsendable(self, kind: str = "object"):
        if kind == "bigint":
            return 2**70
        if kind == "cycle":
            x: list = []
            x.append(x)
            return x
        return object()

    @endpoint
    async def unsendable_stream(self):
        yield 1
        yield object()
        yield 3

    @endpoint
    async def failures_seen(self) -> list:
        return list(self.failures)

    def __supervise__(self, failure) -> None:
        self.failures.append(
            {
                "device": failure.device,
                "actor": failure.actor,
                "reason": failure.reason,
                "rank": failure.rank,
            }
        )


class Tensors(Actor):
    def __init__(self) -> None:
        import torch

        self.torch = torch

    @endpoint
    async def echo(self, x):
        return x

    @endpoint
    async def add_one_inplace(self, t):
        t += 1  # received tensors are writable
        return t

    @endpoint
    async def checksum(self, t) -> float:
        return float(t.double().sum())


class BadSupervisor(Actor):
    """Its __supervise__ raises: the failure must be logged and published, not lost."""

    @endpoint
    async def ping(self) -> int:
        return 1

    def __supervise__(self, failure) -> None:
        raise RuntimeError(f"cannot handle the loss of {failure.actor}")


class BadInit(Actor):
    def __init__(self) -> None:
        raise RuntimeError("constructor refused")


_TRACE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nereus_test_trace", default=None
)


class Sequential(Actor):
    """Sequential endpoints that finish at once or suspend (the host's idle fast path)."""

    def __init__(self) -> None:
        self.log: list = []

    @endpoint
    async def quick(self, i: int) -> int:
        self.log.append(i)
        return i

    @endpoint
    def sync_quick(self, i: int) -> int:
        self.log.append(i)
        return i

    @endpoint
    async def slow(self, i: int, seconds: float) -> int:
        self.log.append(("start", i))
        await asyncio.sleep(seconds)
        self.log.append(("end", i))
        return i

    @endpoint
    async def guarded(self, i: int) -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.log.append(("cancelled", i, id(asyncio.current_task())))
            raise
        return i

    @endpoint
    async def fail(self, message: str):
        raise ValueError(message)

    @endpoint
    async def task_ids(self) -> list:
        before = id(asyncio.current_task())
        await asyncio.sleep(0)
        return [before, id(asyncio.current_task())]

    @endpoint
    async def with_timeout(self, seconds: float) -> str:
        try:
            async with asyncio.timeout(seconds):
                await asyncio.sleep(30)
        except TimeoutError:
            return "timed out"
        return "not timed out"

    @endpoint
    async def set_trace(self, value: str) -> None:
        _TRACE.set(value)

    @endpoint
    async def get_trace(self):
        await asyncio.sleep(0)
        return _TRACE.get()

    @endpoint
    async def order(self) -> list:
        return list(self.log)


# weak references to every Cyclic instance made in this process
CYCLIC: list = []


class Cyclic(Actor):
    """An actor that keeps itself alive through a reference cycle: only the cyclic
    garbage collector can free it once it is stopped."""

    def __init__(self) -> None:
        import weakref

        self.me = self
        CYCLIC.append(weakref.ref(self))

    @endpoint
    async def ping(self) -> str:
        return "pong"
