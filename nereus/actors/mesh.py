"""Refs and meshes: how callers name actors and call their endpoints.

Call styles on ``mesh.<endpoint>`` (every one sends before it returns):

- ``call(*a, **kw)`` -> awaitable of the list of results in rank order; it fails as
  soon as one rank fails (e.g. ``ActorDied`` at once when a rank's worker dies).
- ``call_one(...)`` -> awaitable of the result; the mesh must hold exactly one actor.
- ``choose(...)`` -> awaitable of one actor's result, the actor with the fewest calls
  in flight from this process (ties rotate).
- ``broadcast(...)`` -> None, fire and forget; remote failures are logged by the worker
  and published as ``error`` events on the tap.
- ``stream(...)`` -> async iterator over the items of an async-generator endpoint; the
  mesh must hold exactly one actor (slice first, or use ``mesh.refs[i]``). There is
  no flow control: the generator runs ahead and items queue at the caller. Leaving
  the loop early drops the items still coming.
- ``options(timeout_s=2.0)`` -> the same endpoint with a per-call deadline
  (``DeadlineExceeded`` at the caller when it passes).

Arrays and tensors in arguments are sent without a copy: do not modify one until
its call has answered (or, for ``broadcast``, until the next call to that actor).

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from nereus.actors import _protocol as P
from nereus.actors import _wire
from nereus.actors._client import current_client
from nereus.errors import ActorDied, ConfigError

__all__ = ["ActorRef", "ActorMesh", "Endpoint"]

log = logging.getLogger("nereus.actors")

_REF_EXT = 10


class ActorRef:
    """One actor incarnation. ``ref.<endpoint>`` gives an ``Endpoint`` on a one-actor mesh."""

    __slots__ = ("address", "name", "incarnation", "device", "mesh", "rank", "cls")

    def __init__(
        self,
        address: str,
        name: str,
        incarnation: int,
        device: int,
        mesh: str = "",
        rank: int = 0,
        cls: str = "",
    ) -> None:
        self.address = address
        self.name = name
        self.incarnation = incarnation
        self.device = device
        self.mesh = mesh
        self.rank = rank
        self.cls = cls

    def _plain(self) -> list:
        return [
            self.address,
            self.name,
            self.incarnation,
            self.device,
            self.mesh,
            self.rank,
            self.cls,
        ]

    @classmethod
    def _from_plain(cls, plain: Any) -> ActorRef:
        if not (isinstance(plain, list) and len(plain) == 7):
            raise ValueError(f"actor ref {plain!r} must have 7 fields")
        return cls(*plain)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and self._plain() == other._plain()

    def __hash__(self) -> int:
        return hash((self.address, self.name, self.incarnation))

    def __repr__(self) -> str:
        return (
            f"ActorRef({self.name!r}, device={self.device}, "
            f"incarnation={self.incarnation}, address={self.address!r})"
        )

    def endpoint(self, method: str) -> Endpoint:
        return Endpoint((self,), method)

    def __getattr__(self, method: str) -> Endpoint:
        if method.startswith("_"):
            raise AttributeError(method)
        return Endpoint((self,), method)


_wire.register_ext(_REF_EXT, ActorRef, ActorRef._plain, ActorRef._from_plain)


def _gather(loop: asyncio.AbstractEventLoop, futs: list[asyncio.Future]) -> asyncio.Future:
    """One future of all results in rank order. It fails as soon as any call fails (a
    dead rank must not wait for the others); later failures are consumed silently."""
    outer = loop.create_future()
    left = len(futs)
    if not left:
        outer.set_result([])
        return outer

    def done(f: asyncio.Future) -> None:
        nonlocal left
        left -= 1
        exc = f.exception() if not f.cancelled() else asyncio.CancelledError()
        if outer.done():
            return
        if exc is not None:
            outer.set_exception(exc)
        elif not left:
            outer.set_result([g.result() for g in futs])

    for f in futs:
        f.add_done_callback(done)
    return outer


class Endpoint:
    """One endpoint on a set of actors; see the module docstring for the call styles."""

    __slots__ = ("refs", "method", "timeout_s")
    _rotation = itertools.count()

    def __init__(self, refs: Sequence[ActorRef], method: str, timeout_s: float | None = None):
        self.refs = refs
        self.method = method
        self.timeout_s = timeout_s

    def options(self, *, timeout_s: float | None = None) -> Endpoint:
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ConfigError(f"timeout_s={timeout_s!r} must be a number of seconds > 0")
        return Endpoint(self.refs, self.method, timeout_s)

    def _send(self, ref: ActorRef, args: tuple, kwargs: dict, mode: int) -> asyncio.Future:
        return current_client().call(
            ref.address,
            ref.name,
            ref.incarnation,
            self.method,
            list(args),
            kwargs,
            self.timeout_s,
            mode,
            ref.device,
        )

    def call(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        client = current_client()
        futs = [
            client.call(
                r.address,
                r.name,
                r.incarnation,
                self.method,
                list(args),
                kwargs,
                self.timeout_s,
                P.REPLY,
                r.device,
            )
            for r in self.refs
        ]
        return _gather(client.loop, futs)

    def _one(self, style: str) -> ActorRef:
        if len(self.refs) != 1:
            raise ConfigError(
                f"mesh size={len(self.refs)} must be 1 for .{style}() on "
                f"{self.method!r}; slice the mesh or use .call()"
            )
        return self.refs[0]

    def call_one(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        refs = self.refs
        r = refs[0] if len(refs) == 1 else self._one("call_one")  # _one raises
        return current_client().call(
            r.address,
            r.name,
            r.incarnation,
            self.method,
            list(args),
            kwargs,
            self.timeout_s,
            P.REPLY,
            r.device,
        )

    def choose(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        refs = self.refs
        if not refs:
            raise ConfigError(f"cannot choose among 0 actors for {self.method!r}")
        client = current_client()
        start = next(self._rotation) % len(refs)
        best, best_n = None, None
        for i in range(len(refs)):
            r = refs[(start + i) % len(refs)]
            if r.address in client.dead:
                continue
            n = client.inflight.get((r.address, r.name), 0)
            if best_n is None or n < best_n:
                best, best_n = r, n
                if n == 0:
                    break
        if best is None:
            r = refs[0]
            fut = client.loop.create_future()
            fut.set_exception(ActorDied(r.name, r.device, "every actor of the mesh is dead"))
            return fut
        return self._send(best, args, kwargs, P.REPLY)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        for r in self.refs:
            if r.address not in current_client().dead:
                self._send(r, args, kwargs, P.NO_REPLY)

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        ref = self._one("stream")
        client = current_client()
        p = client.open_stream(
            ref.address,
            ref.name,
            ref.incarnation,
            self.method,
            list(args),
            kwargs,
            self.timeout_s,
            ref.device,
        )
        try:
            while True:
                has, item = await client.next_item(p)
                if not has:
                    return
                yield item
        finally:
            client.close_stream(p)


class ActorMesh:
    """Actors of one spawn, shaped by named axes. ``mesh.<endpoint>`` -> ``Endpoint``."""

    def __init__(self, name: str, refs: Sequence[ActorRef], axes: dict[str, int]) -> None:
        size = 1
        for a, n in axes.items():
            if not isinstance(n, int) or n < 1:
                raise ConfigError(f"axes[{a!r}]={n!r} must be an int >= 1")
            size *= n
        if size != len(refs):
            raise ConfigError(
                f"axes={axes} hold {size} positions but the mesh has {len(refs)} actors"
            )
        self.name = name
        self.refs = list(refs)
        self.axes = dict(axes)
        self._stopped = False

    @property
    def size(self) -> int:
        return len(self.refs)

    def __len__(self) -> int:
        return len(self.refs)

    def __repr__(self) -> str:
        return f"ActorMesh({self.name!r}, axes={self.axes})"

    def coords(self, rank: int) -> dict[str, int]:
        """Position of ``rank`` on the axes (row-major)."""
        out = {}
        for axis in reversed(list(self.axes)):
            n = self.axes[axis]
            out[axis] = rank % n
            rank //= n
        return dict(reversed(list(out.items())))

    def slice(self, **selection: int | slice) -> ActorMesh:
        """Sub-mesh: an int drops the axis (fixes it), a slice keeps it, narrowed."""
        for axis, sel in selection.items():
            if axis not in self.axes:
                raise ConfigError(
                    f"slice axis {axis!r} is not one of the mesh axes {list(self.axes)}"
                )
            n = self.axes[axis]
            if isinstance(sel, bool) or not isinstance(sel, (int, slice)):
                raise ConfigError(f"slice {axis}={sel!r} must be an int or a slice")
            if isinstance(sel, int) and not 0 <= sel < n:
                raise ConfigError(f"slice {axis}={sel} must be in 0..{n - 1}")
        keep: dict[str, list[int]] = {}
        for axis, n in self.axes.items():
            sel = selection.get(axis)
            if sel is None:
                keep[axis] = list(range(n))
            elif isinstance(sel, slice):
                keep[axis] = list(range(n))[sel]
                if not keep[axis]:
                    raise ConfigError(f"slice {axis}={sel} selects no position of {n}")
        refs = [
            r
            for rank, r in enumerate(self.refs)
            if all(
                c == selection[a] if isinstance(selection.get(a), int) else c in keep[a]
                for a, c in self.coords(rank).items()
            )
        ]
        return ActorMesh(self.name, refs, {a: len(v) for a, v in keep.items()})

    def endpoint(self, method: str) -> Endpoint:
        return Endpoint(self.refs, method)

    def __getattr__(self, method: str) -> Endpoint:
        if method.startswith("_"):
            raise AttributeError(method)
        return Endpoint(self.refs, method)

    async def stop(self) -> None:
        """Stop every actor of the mesh (their workers keep running). Queued calls fail
        with ActorDied; actors on dead devices are skipped."""
        client = current_client()
        futs = [
            client.request(r.address, "stop", {"name": r.name})
            for r in self.refs
            if r.address not in client.dead
        ]
        results = await asyncio.gather(*futs, return_exceptions=True)
        for r in results:
            if isinstance(r, ActorDied):
                continue
            if isinstance(r, BaseException):
                raise r
