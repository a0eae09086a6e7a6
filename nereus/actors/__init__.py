"""nereus.actors: a small, fast async actor runtime (DESIGN.md section 3).

Public API: ``Actor``, ``endpoint``, ``Cluster``, ``ActorMesh``, ``ActorRef``,
``Endpoint``, ``DeviceInfo``, ``Failure``, ``current_device``, ``emit``.
"""

from nereus.actors._client import emit
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
]
