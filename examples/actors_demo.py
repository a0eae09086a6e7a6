"""The actor runtime in one screen: `python -m examples.actors_demo`.

Starts an embedded cluster of 4 CPU devices (a controller, a node daemon, 4 worker
processes), spawns a 2 x 2 mesh (axes dp, tp), uses every call style, shows a
remote error with its traceback, a deadline, a worker killed with SIGKILL and its
supervision, and prints the monitoring-tap events the run produced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from nereus.actors import Actor, Cluster, Failure, current_device, emit, endpoint, run
from nereus.errors import ActorDied, DeadlineExceeded, RemoteError
from nereus.monitor import Subscriber, format_event


class Worker(Actor):
    """A toy actor: a counter, a slow endpoint, a stream and a failing endpoint."""

    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.total = 0
        self.peers_lost: list[str] = []

    @endpoint
    async def add(self, x: int) -> int:
        self.total += x * self.scale
        return self.total

    @endpoint
    async def whoami(self) -> dict:
        d = current_device()
        return {"device": d.index, "rank": self.rank, "coords": self.coords, "pid": os.getpid()}

    @endpoint(concurrent=True)
    async def slow(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return f"slept {seconds} s on device {self.device.index}"

    @endpoint
    async def countdown(self, n: int):
        for i in range(n, 0, -1):
            yield i

    @endpoint
    async def divide(self, a: float, b: float) -> float:
        return a / b

    @endpoint
    async def report(self) -> None:
        emit("demo_progress", device=self.device.index, total=self.total)

    @endpoint
    async def lost(self) -> list:
        return self.peers_lost

    def __supervise__(self, failure: Failure) -> None:
        self.peers_lost.append(f"{failure.actor} on device {failure.device}: {failure.reason}")


async def main() -> int:
    async with Cluster.local(devices=4, memory_per_device="512MiB") as cluster:
        print(
            f"devices: {[(d.index, d.kind, d.memory_bytes >> 20) for d in cluster.devices]} "
            f"(index, kind, MiB); tap at {cluster.tap_address}"
        )
        tap = Subscriber(cluster.tap_address, cluster.key)
        events: list[dict] = []

        async def record() -> None:
            async for ev in tap:
                events.append(ev)

        recorder = asyncio.create_task(record())
        failures: list[Failure] = []
        cluster.on_failure(failures.append)

        mesh = await cluster.spawn(
            "workers", Worker, devices=[0, 1, 2, 3], args=(10,), axes={"dp": 2, "tp": 2}
        )
        print("call      ->", await mesh.add.call(1))
        print("slice     ->", [w["coords"] for w in await mesh.slice(tp=0).whoami.call()])
        print("call_one  ->", await mesh.slice(dp=1, tp=1).add.call_one(x=2))
        print("choose    ->", await mesh.slow.choose(0.01))
        mesh.report.broadcast()
        print("stream    ->", [i async for i in mesh.slice(dp=0, tp=0).countdown.stream(5)])
        try:
            await mesh.slice(dp=0, tp=1).divide.call_one(1.0, 0.0)
        except RemoteError as e:
            print(
                f"error     -> {e.remote_type}: {e.remote_message} (actor {e.actor}, "
                f"device {e.device}); remote traceback has "
                f"{len(e.traceback_text.splitlines())} lines"
            )
        try:
            await mesh.slice(dp=0, tp=0).slow.options(timeout_s=0.1).call_one(5.0)
        except DeadlineExceeded as e:
            print(f"deadline  -> {e}")

        victim = await mesh.slice(dp=1, tp=0).whoami.call_one()
        in_flight = mesh.slice(dp=1, tp=0).slow.call_one(60.0)
        os.kill(victim["pid"], signal.SIGKILL)
        try:
            await in_flight
        except ActorDied as e:
            print(f"SIGKILL   -> in-flight call failed at once: {e}")
        while not failures:
            await asyncio.sleep(0.01)
        print(f"owner     -> on_failure got {failures[0]}")
        await asyncio.sleep(0.1)  # let __supervise__ reach the survivors
        print("survivors ->", await mesh.slice(dp=0).lost.call())
        await asyncio.sleep(0.2)  # let the last events arrive
        recorder.cancel()
        tap.close()
        print(f"\n{len(events)} tap events (the subscriber joined after the workers):")
        for ev in events:
            print("  " + format_event(ev))
    return 0


if __name__ == "__main__":
    sys.exit(run(main()))
