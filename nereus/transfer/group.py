"""Groups made on demand: the controller side (``make_group``) and the worker side
(``get_communicator``, ``release_epoch``).

Controller side::

    group = await make_group(cluster, devices=[0, 2, 3], backend="auto", epoch=4)
    await mesh.step.call(group.group_id)   # actors look the communicator up by id
    await group.destroy()                  # or: await release_groups(cluster, epoch=4)

``make_group`` spawns (once per cluster, lazily) one ``GroupAgent`` system actor per
device, creates the rendezvous data (a TCPStore served by this process for gloo, an
NCCL unique id made by the first member for nccl), and sends each member exactly ONE
msgpack message: group id, rank, size, epoch, backend, rendezvous data, timeout. The
members build their communicators concurrently (construction is the rendezvous: a
blocking wait with a deadline, never a polling loop, run off the worker's event
loop). Ranks follow the order of ``devices``.

Refuses: repeated devices, unknown devices, ``backend="nccl"`` on non-CUDA devices
(``ConfigError``). A member that cannot join (dead, rendezvous timeout) makes
``make_group`` raise after telling the others to drop the group; when it fails while the
others still wait for it, the store is closed so that they stop waiting at once.
``GroupHandle.destroy`` removes any ``/dev/shm`` name its killed members left on this
host.

More (how it works): docs/transfer.md.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from nereus.actors import (
    Actor,
    ActorMesh,
    ActorRef,
    Cluster,
    DeviceInfo,
    endpoint,
)
from nereus.errors import ActorDied, ConfigError, TransferError
from nereus.transfer._shm import SHM_DIR, shm_name_prefix, unlink_group_names
from nereus.transfer.communicator import Communicator

__all__ = [
    "make_group",
    "release_groups",
    "GroupHandle",
    "GroupAgent",
    "get_communicator",
    "release_epoch",
    "local_groups",
]

log = logging.getLogger("nereus.transfer")

# A group's set-up takes milliseconds; one that takes seconds is named in the log.
SLOW_SETUP_S = 2.0

BACKENDS = ("auto", "gloo", "nccl")

# ------------------------------------------------------------------ worker side

_registry: dict[str, Communicator] = {}
_registry_lock = threading.Lock()


def get_communicator(group_id: str) -> Communicator:
    """This process's communicator of live group ``group_id``."""
    with _registry_lock:
        comm = _registry.get(group_id)
    if comm is None:
        raise TransferError(
            f"group {group_id!r} is not live in this process (pid {os.getpid()}); "
            f"live groups: {sorted(_registry)}"
        )
    return comm


def local_groups() -> list[tuple[str, int, int, int]]:
    """(group id, epoch, rank, size) of every live group in this process."""
    with _registry_lock:
        return sorted((g, c.epoch, c.rank, c.size) for g, c in _registry.items())


def _drop(group_id: str) -> bool:
    with _registry_lock:
        comm = _registry.pop(group_id, None)
    if comm is None:
        return False
    comm.destroy()
    return True


def release_epoch(epoch: int) -> int:
    """Destroy every communicator of ``epoch`` in this process; returns how many."""
    with _registry_lock:
        ids = [g for g, c in _registry.items() if c.epoch == epoch]
    return sum(_drop(g) for g in ids)


def _build(spec: dict[str, Any], loop: asyncio.AbstractEventLoop | None = None) -> Communicator:
    """A communicator from the one message ``make_group`` sends (runs in a thread;
    ``loop``: the worker's event loop, which watches an NCCL group's deadlines)."""
    common = dict(
        epoch=spec["epoch"],
        timeout_s=spec["timeout_s"],
        devices=spec["devices"],
        store_token=spec.get("store_token", ""),
        **spec.get("options", {}),
    )
    if spec["backend"] == "nccl":
        from nereus.transfer.nccl import NcclCommunicator  # libnccl only where it is used

        # No device index: a worker sees exactly one GPU, cuda:0, whatever the device's
        # index on its node (the engines' tensors live there too).
        return NcclCommunicator(
            spec["group_id"],
            spec["rank"],
            spec["size"],
            bytes(spec["nccl_id"]),
            store_host=spec["store_host"],
            store_port=spec["store_port"],
            loop=loop,
            **common,
        )
    from nereus.transfer.cpu import CpuCommunicator

    return CpuCommunicator(
        spec["group_id"],
        spec["rank"],
        spec["size"],
        spec["store_host"],
        spec["store_port"],
        **common,
    )


class GroupAgent(Actor):
    """System actor, one per worker: builds and drops this process's communicators."""

    @endpoint(concurrent=True)
    async def join(self, spec: dict) -> dict:
        comm = await asyncio.to_thread(_build, spec, asyncio.get_running_loop())
        with _registry_lock:
            old = _registry.pop(comm.group_id, None)
            _registry[comm.group_id] = comm
        if old is not None:  # a retried make_group: the new incarnation wins
            await asyncio.to_thread(old.destroy)
        return {"group_id": comm.group_id, "rank": comm.rank, "pid": os.getpid()}

    @endpoint(concurrent=True)
    async def leave(self, group_id: str) -> bool:
        return await asyncio.to_thread(_drop, group_id)

    @endpoint(concurrent=True)
    async def release_epoch(self, epoch: int) -> int:
        return await asyncio.to_thread(release_epoch, epoch)

    @endpoint(concurrent=True)
    async def nccl_unique_id(self) -> bytes:
        from nereus.transfer.nccl import unique_id

        return unique_id()

    @endpoint
    async def groups(self) -> list:
        return [list(g) for g in local_groups()]


# ------------------------------------------------------------------ controller side


@dataclass
class GroupHandle:
    """The controller's handle on one group (ranks follow ``devices``)."""

    group_id: str
    devices: tuple[int, ...]
    backend: str
    epoch: int
    _agents: list[ActorRef] = field(repr=False, default_factory=list)
    _owner: _Groups | None = field(repr=False, default=None)
    _store: Any = field(repr=False, default=None)
    destroyed: bool = False
    tag: str = ""
    # when its members were asked to join and when the last one had (driver's clock)
    setup_span: tuple[float, float] = (0.0, 0.0)

    def rank_of(self, device: int) -> int:
        return self.devices.index(device)

    async def destroy(self) -> None:
        """Drop the group on every member (idempotent). Dead members are skipped."""
        if self.destroyed:
            return
        self.destroyed = True
        if self._owner is not None:
            self._owner.forget(self)
        results = await asyncio.gather(
            *(a.leave.call_one(self.group_id) for a in self._agents), return_exceptions=True
        )
        if self._store is not None:
            _sweep_names(self._store, self.group_id, self.epoch)
        self._store = None
        errors = [r for r in results if isinstance(r, BaseException)]
        for e in errors:
            log.warning("group %s: a member could not drop it: %s", self.group_id, e)


def _sweep_names(store: _Rendezvous, group_id: str, epoch: int) -> int:
    """Unlink what a destroyed group's members on this host left in ``/dev/shm``; returns
    how many. The names of one group incarnation share a prefix no other group has."""
    swept = unlink_group_names(shm_name_prefix(store.port, store.host, group_id, epoch))
    if swept:
        log.warning(
            "group %s: removed %d name(s) its killed members left in %s", group_id, swept, SHM_DIR
        )
    return swept


class _Groups:
    """Per-cluster state on the controller: agents per device and the group cache."""

    def __init__(self) -> None:
        self.agents: dict[int, ActorRef] = {}
        self.cache: dict[tuple, GroupHandle] = {}
        self.lock = asyncio.Lock()
        self.spawned = 0
        # one set-up at a time per device: rendezvous of groups over shared devices that
        # overlap in time can stall for seconds
        self.device_locks: dict[int, asyncio.Lock] = {}

    def forget(self, handle: GroupHandle) -> None:
        for key, h in list(self.cache.items()):
            if h is handle:
                del self.cache[key]

    async def agents_for(self, cluster: Cluster, devices: list[int]) -> list[ActorRef]:
        missing = [d for d in devices if d not in self.agents]
        if missing:
            self.spawned += 1
            mesh = await cluster.spawn(
                f"nereus-transfer-{uuid.uuid4().hex[:8]}", GroupAgent, devices=missing
            )
            for d, ref in zip(missing, mesh.refs, strict=True):
                self.agents[d] = ref
        return [self.agents[d] for d in devices]


_state: weakref.WeakKeyDictionary[Cluster, _Groups] = weakref.WeakKeyDictionary()


def _device_list(cluster: Cluster, devices: Any) -> list[DeviceInfo]:
    if isinstance(devices, ActorMesh):
        devices = [r.device for r in devices.refs]
    if devices is None:
        raise ConfigError("make_group needs devices=[...] (device indices, DeviceInfo or a mesh)")
    by_index = {d.index: d for d in cluster.devices}
    out = []
    for d in devices:
        i = d.index if isinstance(d, DeviceInfo) else d
        if isinstance(i, bool) or not isinstance(i, int) or i not in by_index:
            raise ConfigError(
                f"devices contains {d!r}, which is not a device of the cluster {sorted(by_index)}"
            )
        out.append(by_index[i])
    if not out:
        raise ConfigError("devices=[] must name at least one device")
    idx = [d.index for d in out]
    if len(set(idx)) != len(idx):
        raise ConfigError(f"devices={idx} repeats a device; a group has one rank per device")
    return out


def _store_host(devices: list[DeviceInfo]) -> str:
    """The address of this host's interface that the members reach it by: loopback
    when they all live here, else the source address of the route to a remote member
    (a UDP ``connect`` only picks the route; nothing is sent)."""
    me = socket.gethostname()
    remote = [d.host for d in devices if d.host not in (me, "localhost", "127.0.0.1")]
    if not remote:
        return "127.0.0.1"
    try:
        peer = socket.gethostbyname(remote[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))
            return probe.getsockname()[0]
    except OSError as e:
        log.warning(
            "no route to member host %r (%s); the store listens on %s's address", remote[0], e, me
        )
        return socket.gethostbyname(me)


def store_token(key: bytes, group_id: str) -> str:
    """The prefix of a group's store entries, derived from the cluster key."""
    return hmac.new(key, f"nereus-store/{group_id}".encode(), hashlib.sha256).hexdigest()[:32]


class _Rendezvous:
    """A group's TCPStore on one interface, its listening socket owned here so that
    ``seal`` can stop new connections while the members' own go on."""

    def __init__(self, host: str, timeout_s: float) -> None:
        from torch.distributed import TCPStore

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(128)
            self.host = host
            self.port = listener.getsockname()[1]
            self.store = TCPStore(
                host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        self._fd = listener.detach()  # the store's server owns (and closes) it now
        self.sealed = False

    def close(self) -> None:
        """Stop serving: the server goes with its connections, so every member waiting on
        the store (the rendezvous) fails at once with an error naming the ranks it
        missed, instead of at its deadline."""
        self.store = None

    def seal(self) -> None:
        """Accept no more connections (existing ones are served as before).

        The listening socket is replaced, under its own descriptor number, by a fresh
        socket that neither listens nor is watched: the kernel drops the listener (and
        its port) from the server's poll set, and new connections are refused. Shutting
        the listener down instead leaves it in the poll set reporting an error that the
        server's accept loop retries forever, one core spinning for the life of the
        group."""
        if self.sealed:
            return
        self.sealed = True
        blank = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            os.dup2(blank.fileno(), self._fd)
        except OSError as e:
            log.warning("could not stop the store on port %d accepting: %s", self.port, e)
        finally:
            blank.close()


async def make_group(
    cluster: Cluster,
    devices: Any = None,
    *,
    backend: str = "auto",
    epoch: int = 0,
    timeout_s: float = 60.0,
    options: dict[str, Any] | None = None,
    tag: str = "",
) -> GroupHandle:
    """A live group over ``devices`` (indices, DeviceInfo or an ActorMesh, in rank
    order); see the module docstring. ``options`` go to the backend's constructor (e.g.
    ``{"use_shm": False}`` for CpuCommunicator); ``tag`` sets groups of one epoch apart
    (a transition's own groups beside the engines'): it is part of the cache key and
    ``release_groups`` can release one tag alone."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} must be one of {list(BACKENDS)}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ConfigError(f"epoch={epoch!r} must be an int >= 0")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ConfigError(f"timeout_s={timeout_s!r} must be a number of seconds > 0")
    infos = _device_list(cluster, devices)
    kinds = {d.kind for d in infos}
    if backend == "auto":
        backend = "nccl" if kinds == {"cuda"} else "gloo"
    if backend == "nccl" and kinds != {"cuda"}:
        raise ConfigError(
            f"backend='nccl' needs CUDA devices; devices are of kinds {sorted(kinds)}"
        )
    state = _state.setdefault(cluster, _Groups())
    key = (
        tuple(d.index for d in infos),
        backend,
        epoch,
        repr(sorted((options or {}).items())),
        tag,
    )
    async with state.lock:
        cached = state.cache.get(key)
        if cached is not None and not cached.destroyed:
            return cached
        agents = await state.agents_for(cluster, [d.index for d in infos])
    group_id = f"e{epoch}-{uuid.uuid4().hex[:12]}"
    spec: dict[str, Any] = {
        "group_id": group_id,
        "size": len(infos),
        "epoch": epoch,
        "backend": backend,
        "timeout_s": float(timeout_s),
        "devices": [d.index for d in infos],
    }
    # The store is gloo's rendezvous, and for both backends the watchdog's record of
    # which ranks entered each operation. It lives as long as the handle.
    store = _Rendezvous(_store_host(infos), timeout_s)
    spec.update(
        store_host=store.host,
        store_port=store.port,
        options=dict(options or {}),
        store_token=store_token(cluster.key, group_id),
    )
    if backend == "nccl":
        spec["nccl_id"] = await agents[0].nccl_unique_id.call_one()
    handle = GroupHandle(
        group_id, tuple(d.index for d in infos), backend, epoch, agents, state, store, tag=tag
    )
    # set-ups over a shared device go one after another (locks taken in device order,
    # so two set-ups never wait on each other)
    locks = [
        state.device_locks.setdefault(d.index, asyncio.Lock())
        for d in sorted(infos, key=lambda d: d.index)
    ]
    for lock in locks:
        await lock.acquire()
    try:
        t_setup = time.monotonic()
        calls = [
            asyncio.ensure_future(
                a.join.options(timeout_s=timeout_s + 30).call_one({**spec, "rank": r})
            )
            for r, a in enumerate(agents)
        ]
        try:
            done, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            first = {calls.index(t) for t in done if t.cancelled() or t.exception() is not None}
            if pending:
                # a member failed (died, or refused) while the others wait for it in the
                # rendezvous: without the store their waits fail now, not at timeout_s
                store.close()
            results = await asyncio.gather(*calls, return_exceptions=True)
        except BaseException:
            for c in calls:
                c.cancel()
            raise
        handle.setup_span = (t_setup, time.monotonic())
    finally:
        for lock in locks:
            lock.release()
    failed = [(infos[r].index, e) for r, e in enumerate(results) if isinstance(e, BaseException)]
    # the members that failed first are the cause (named in the error); the others failed
    # for want of them
    causes = {infos[r].index for r in first}
    failed.sort(key=lambda f: f[0] not in causes)
    for device, err in failed:
        if isinstance(err, ActorDied):  # a later make_group spawns a fresh agent there
            state.agents.pop(device, None)
    if failed:
        handle.destroyed = False
        await handle.destroy()
        device, err = failed[0]
        raise TransferError(
            f"make_group over devices {list(handle.devices)}: device {device} could not join: {err}"
        ) from err
    store.seal()  # every member holds its connection: nobody else may connect now
    took = handle.setup_span[1] - handle.setup_span[0]
    if took > SLOW_SETUP_S:
        log.warning(
            "group %s over devices %s took %.1f s to set up (at 5 s: a member's resolver dropped "
            "the reverse lookup of the store's address; docs/clusters.md, 'Group set-ups "
            "that take 5 s')",
            group_id,
            list(handle.devices),
            took,
        )
    state.cache[key] = handle
    return handle


async def release_groups(cluster: Cluster, epoch: int, tag: str | None = None) -> int:
    """Destroy every cached group of ``epoch`` (of ``tag`` alone, when given) made through
    ``cluster``; returns how many."""
    state = _state.get(cluster)
    if state is None:
        return 0
    handles = [
        h for h in list(state.cache.values()) if h.epoch == epoch and (tag is None or h.tag == tag)
    ]
    for h in handles:
        await h.destroy()
    return len(handles)
