"""nereus.actors: a small, fast async actor runtime (docs/design.md §3).

Processes: a controller (registry, failure fan-out, monitoring tap), one node daemon
per host, one worker process per device. Callers talk to workers directly (ZeroMQ
DEALER -> ROUTER); every message is a msgpack header plus zero-copy tensor frames,
signed with the cluster key (HMAC-SHA256). See ``actor`` (endpoints, concurrency,
supervision), ``mesh`` (call styles, slicing), ``cluster`` (local/connect, spawn,
failures), ``_wire`` (the format), ``nereus.node`` and ``nereus.controller``.

Public API: ``Actor``, ``endpoint``, ``Cluster``, ``ActorMesh``, ``ActorRef``,
``Endpoint``, ``DeviceInfo``, ``Failure``, ``current_device``, ``emit``, ``run``,
``in_thread`` (blocking work off the loop).

More: docs/actors.md; an example in README.md.
"""

from nereus.actors._client import emit
from nereus.actors._loop import in_thread, run
from nereus.actors.actor import Actor, DeviceInfo, Failure, current_device, endpoint
from nereus.actors.cluster import Cluster
from nereus.actors.mesh import ActorMesh, ActorRef, Endpoint

__all__ = [
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
