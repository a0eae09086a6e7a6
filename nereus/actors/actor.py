"""Actors, endpoints and the device an actor runs on.

An ``Actor`` subclass is constructed inside a worker process (one process per
device); its ``@endpoint`` methods are what other processes call. The class is
referenced across processes by import path (``"module:QualName"``), never pickled.

Concurrency, explicitly:
- ``@endpoint`` (default) is *sequential*: calls to one actor's sequential endpoints
  run one at a time, in arrival order (an ordered mailbox per actor).
- ``@endpoint(concurrent=True)`` runs each call as soon as it arrives, concurrently
  with everything else on that actor, in the worker's single event-loop thread.
- An endpoint that is an async generator streams its items (use ``.stream``).
- Plain ``def`` endpoints are allowed; they run on the event loop (keep them short).
- Re-entrancy: a sequential endpoint that calls (directly, or through other actors)
  a sequential endpoint of its own actor waits on its own mailbox forever. Make such
  endpoints ``concurrent=True`` or give the inner call a deadline.

Supervision (``__supervise__``): when an actor of a mesh dies, the owner (the driver
that spawned the mesh) is told through ``Cluster.on_failure`` callbacks, and every
*surviving* actor of the same mesh whose class defines ``__supervise__(self, failure)``
has it called, out of band (not queued behind running calls), with the ``Failure``.
That is where a rank learns that a peer is gone, e.g. to abort a collective.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Actor", "endpoint", "DeviceInfo", "Failure", "current_device", "class_path"]

F = TypeVar("F", bound=Callable[..., Any])

_ENDPOINT_ATTR = "__nereus_endpoint__"


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device of the cluster. ``index`` is cluster-global; ``memory_bytes`` is the
    budget engines must respect: a GPU's memory less the CUDA context's and NCCL's
    reserve (``gpu_memory``), or ``--memory-per-device``."""

    index: int
    host: str
    kind: str  # "cpu" or "cuda"
    memory_bytes: int
    node_id: str
    local_index: int = 0

    @property
    def torch_device(self) -> str:
        """Where this device's tensors live inside its own worker process: ``"cuda:0"``
        for a GPU (its node makes it the worker's only visible GPU, whatever its
        ``local_index``), else ``"cpu"``."""
        return "cuda:0" if self.kind == "cuda" else "cpu"


@dataclasses.dataclass(frozen=True)
class Failure:
    """What died: ``device`` (global index), ``actor`` (its name, ``""`` for a device with
    no actor of this owner), ``incarnation``, ``reason`` (e.g. ``"SIGKILL"``,
    ``"exit code 1"``, ``"node lost"``), and the mesh and rank it belonged to."""

    device: int
    actor: str
    incarnation: int
    reason: str
    node_id: str = ""
    pid: int = 0
    mesh: str = ""
    rank: int = -1


@dataclasses.dataclass(frozen=True)
class _EndpointSpec:
    concurrent: bool


def endpoint(fn: F | None = None, *, concurrent: bool = False) -> Any:
    """Mark a method as callable from other processes (``@endpoint`` or
    ``@endpoint(concurrent=True)``); see the module docstring for the concurrency."""

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@endpoint needs a function, got {f!r}")
        setattr(f, _ENDPOINT_ATTR, _EndpointSpec(concurrent=bool(concurrent)))
        return f

    if fn is not None:
        return mark(fn)
    return mark


def endpoint_spec(fn: Any) -> _EndpointSpec | None:
    return getattr(fn, _ENDPOINT_ATTR, None)


_CURRENT_DEVICE: DeviceInfo | None = None


def current_device() -> DeviceInfo:
    """The device of this worker process. Raises RuntimeError outside a worker."""
    if _CURRENT_DEVICE is None:
        raise RuntimeError("current_device() is only defined inside a nereus worker process")
    return _CURRENT_DEVICE


def _set_current_device(device: DeviceInfo) -> None:
    global _CURRENT_DEVICE
    _CURRENT_DEVICE = device


class Actor:
    """Base class of actors. Subclass it, define ``__init__`` and ``@endpoint`` methods.

    Inside the worker each instance has ``self.device`` (``DeviceInfo``), ``self.name``
    (unique in its worker), ``self.mesh_name``, ``self.rank`` and ``self.coords``
    (its position on the mesh axes), all set before ``__init__`` runs. They are for the
    actor's own use: the runtime never reads them back, so an ``__init__`` that assigns
    ``self.name`` (a common keyword) changes nothing for the runtime."""

    device: DeviceInfo
    name: str
    mesh_name: str
    rank: int
    coords: dict[str, int]

    def __supervise__(self, failure: Failure) -> None:  # noqa: B027 - optional hook
        """Called when another actor of this actor's mesh died (default: nothing)."""


def class_path(cls: type) -> str:
    """``"module:QualName"`` of an Actor subclass, importable by a worker process."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{cls!r} is not a subclass of nereus.actors.Actor")
    module = cls.__module__
    if module == "__main__":
        import sys

        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is not None and spec.name:
            module = spec.name
        else:
            path = getattr(sys.modules["__main__"], "__file__", None)
            if not path:
                raise TypeError(
                    f"actor class {cls.__qualname__} is defined in an interactive __main__; "
                    "define it in an importable module"
                )
            import os

            module = "file:" + os.path.abspath(path)
    if "<locals>" in cls.__qualname__:
        raise TypeError(
            f"actor class {cls.__qualname__} is defined inside a function; workers import "
            "classes by module path, so define it at module level"
        )
    return f"{module}:{cls.__qualname__}"


def endpoints_of(cls: type) -> dict[str, Any]:
    """name -> function for every endpoint of ``cls`` (including inherited ones)."""
    out = {}
    for name, fn in inspect.getmembers(cls, callable):
        if endpoint_spec(fn) is not None:
            out[name] = fn
    return out
