"""nereus.actors: a small, fast async actor runtime (docs/design.md §3).

Processes: a controller (registry, failure fan-out, monitoring tap), one node daemon
per host, one worker process per device. Callers talk to workers directly (ZeroMQ
DEALER -> ROUTER); every message is a msgpack header plus zero-copy tensor frames,
signed with the cluster key (HMAC-SHA256). See ``actor`` (endpoints, concurrency,
supervision), ``mesh`` (call styles, slicing), ``cluster`` (local/connect, spawn,
failures), ``_wire`` (the format), ``_node`` (the node daemon, ``python -m nereus.node``) and
``_controller`` (the controller, ``nereus controller``); ``events`` is what a reader of
the controller's monitoring tap needs.

Public API: ``Actor``, ``endpoint``, ``Cluster``, ``ActorMesh``, ``ActorRef``,
``Endpoint``, ``DeviceInfo``, ``Failure``, ``current_device``, ``emit``, ``run``,
``in_thread`` (blocking work off the loop), ``CpuLimits`` (one cgroup CPU quota per
device; ``check_cpu_limits`` says whether they can be set here), ``device_threads``
(the torch threads a worker's device gives it); the runtime's processes: ``Controller``,
``NodeDaemon``, their entries ``controller_main`` and ``node_main`` and the lines
(``CONTROLLER_READY``, ``NODE_READY``) each prints once it serves.

More: docs/actors.md; an example in README.md.
"""

from nereus.actors._client import emit
from nereus.actors._controller import READY_PREFIX as CONTROLLER_READY
from nereus.actors._controller import Controller
from nereus.actors._controller import main as controller_main
from nereus.actors._cpulimit import CpuLimits, check_cpu_limits, device_threads
from nereus.actors._loop import in_thread, run
from nereus.actors._node import READY_PREFIX as NODE_READY
from nereus.actors._node import NodeDaemon
from nereus.actors._node import main as node_main
from nereus.actors.actor import Actor, DeviceInfo, Failure, current_device, endpoint
from nereus.actors.cluster import Cluster
from nereus.actors.mesh import ActorMesh, ActorRef, Endpoint

__all__ = [
    "CONTROLLER_READY",
    "NODE_READY",
    "device_threads",
    "CpuLimits",
    "check_cpu_limits",
    "Actor",
    "ActorMesh",
    "ActorRef",
    "Cluster",
    "Controller",
    "DeviceInfo",
    "Endpoint",
    "Failure",
    "NodeDaemon",
    "controller_main",
    "current_device",
    "emit",
    "endpoint",
    "in_thread",
    "node_main",
    "run",
]
