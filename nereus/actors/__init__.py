"""nereus.actors: a small, fast async actor runtime (DESIGN.md section 3).

    from nereus.actors import Actor, Cluster, endpoint, run

    class Counter(Actor):
        def __init__(self, start: int) -> None:
            self.n = start

        @endpoint
        async def add(self, k: int) -> int:
            self.n += k
            return self.n

    async def main():
        async with Cluster.local(devices=4) as cluster:
            mesh = await cluster.spawn("counter", Counter, args=(0,), axes={"dp": 2, "tp": 2})
            print(await mesh.add.call(1))            # [1, 1, 1, 1]

    run(main())   # uvloop where installed; scripts need `if __name__ == "__main__":`

Processes: a controller (registry, failure fan-out, monitoring tap), one node daemon
per host, one worker process per device. Callers talk to workers directly (ZeroMQ
DEALER -> ROUTER); every message is a msgpack header plus zero-copy tensor frames,
signed with the cluster key (HMAC-SHA256). See ``actor`` (endpoints, concurrency,
supervision), ``mesh`` (call styles, slicing), ``cluster`` (local/connect, spawn,
failures), ``_wire`` (the format), ``nereus.node`` and ``nereus.controller``.

Public API: ``Actor``, ``endpoint``, ``Cluster``, ``ActorMesh``, ``ActorRef``,
``Endpoint``, ``DeviceInfo``, ``Failure``, ``current_device``, ``emit``, ``run``,
``in_thread`` (blocking work off the loop), ``CpuLimits`` (one cgroup CPU quota per device; ``check_cpu_limits`` says whether
they can be set here), ``device_threads`` (the torch threads a
worker's device gives it: one, or ``ceil(cores)`` under a CPU limit).
"""

from nereus.actors._client import emit
from nereus.actors._cpulimit import CpuLimits, check_cpu_limits, device_threads
from nereus.actors._loop import in_thread, run
from nereus.actors.actor import Actor, DeviceInfo, Failure, current_device, endpoint
from nereus.actors.cluster import Cluster
from nereus.actors.mesh import ActorMesh, ActorRef, Endpoint

__all__ = [
    "device_threads",
    "CpuLimits",
    "check_cpu_limits",
    "Actor",
    "ActorMesh",
    "ActorRef",
    "Cluster",
    "DeviceInfo",
    "Endpoint",
    "Failure",
    "current_device",
    "emit",
    "endpoint",
    "in_thread",
    "run",
]
