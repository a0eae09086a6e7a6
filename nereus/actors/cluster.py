"""``Cluster``: the driver's handle on a controller, its devices, and spawning.

    async with Cluster.local(devices=4, memory_per_device="1GiB") as cluster:
        mesh = await cluster.spawn("trainer", Trainer, devices=[0, 1, 2, 3],
                                   args=(1e-3,), axes={"dp": 2, "tp": 2})

Promises:
- ``Cluster.local`` embeds a controller and node daemons in the driver's event loop
  (workers are real processes) with a fresh random key; ``cores_per_device=q`` (a
  number, or one per device) caps each worker at ``q`` CPU cores by a cgroup quota
  (``"shared"``, the default: no limit; ``cores_of(device)`` says a device's cap);
  ``Cluster.connect`` attaches to a running controller, and ``close`` stops only the
  meshes this driver spawned.
- A device that dies is reported to its owner: in-flight calls to it fail with
  ``ActorDied``, every ``on_failure`` callback gets one ``Failure`` per actor this
  driver had there, every surviving actor of an affected mesh gets ``__supervise__``,
  and a ``failure`` event goes on the tap.
- The pool may change while it runs: ``drain`` marks a device to be emptied by the next
  change of plan, ``retire_drained`` stops its worker (no failure), ``add_node`` starts
  another node daemon of a local cluster (fresh, non-contiguous device indices).

Refuses: two live meshes with the same name, devices that are not in the cluster,
axes whose product is not the number of devices.

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from nereus.actors import _client
from nereus.actors._channel import DEFAULT_MAX_MESSAGE_BYTES
from nereus.actors._controller import Controller
from nereus.actors._cpulimit import parse_cores
from nereus.actors._curve import CurveKey, load_curve
from nereus.actors._host import DEFAULT_MAX_PENDING
from nereus.actors._keys import generate_key, load_key
from nereus.actors._node import NodeDaemon
from nereus.actors.actor import Actor, DeviceInfo, Failure, class_path
from nereus.actors.mesh import ActorMesh, ActorRef
from nereus.config import parse_size
from nereus.errors import ActorDied, ConfigError, DeadlineExceeded, NereusError, RemoteError

__all__ = ["Cluster"]

log = logging.getLogger("nereus.actors")


class Cluster:
    """See the module docstring. Build with ``Cluster.local`` or ``Cluster.connect``."""

    def __init__(
        self,
        *,
        key: bytes,
        address: str | None = None,
        local_devices: Sequence[int] = (),
        memory_per_device: int | str = "1GiB",
        min_devices: int = 1,
        timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 10.0,
        transport: str = "ipc",
        span_sample_every: int = 100,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        curve: CurveKey | None = None,
        cores_per_device: float | str | Sequence[float] = "shared",
        cgroup_root: str | None = None,
    ) -> None:
        self.key = key
        self._cores = cores_per_device
        self._cgroup_root = cgroup_root
        self.curve = curve
        self._max_message_bytes = max_message_bytes
        self.address = address or ""
        self._local_devices = list(local_devices)
        self._memory_per_device = memory_per_device
        self._min_devices = min_devices
        self._timeout_s = timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._transport = transport
        self._span_sample_every = span_sample_every
        self.controller: Any = None
        self.nodes: list[Any] = []
        self.devices: list[DeviceInfo] = []
        self.tap_address = ""
        self.epoch = 0  # the controller's layout epoch when the view was last read
        self._addresses: dict[int, str] = {}
        self._client: _client.Client | None = None
        self._previous_client: _client.Client | None = None
        self._callbacks: list[Callable[[Failure], Any]] = []
        self._meshes: dict[str, tuple[ActorMesh, str]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._started = False
        self._draining: set[int] = set()
        self._retiring: dict[int, asyncio.Future] = {}

    # -- construction ----------------------------------------------------------------

    @classmethod
    def local(
        cls,
        devices: int | Sequence[int] = 4,
        memory_per_device: int | str = "1GiB",
        *,
        nodes: int = 1,
        key: str | bytes | None = None,
        timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 10.0,
        transport: str = "ipc",
        span_sample_every: int = 100,
        max_message_bytes: int | str = DEFAULT_MAX_MESSAGE_BYTES,
        curve_key_file: str | None = None,
        cores_per_device: float | str | Sequence[float] = "shared",
        cgroup_root: str | None = None,
    ) -> Cluster:
        """A controller and node daemon(s) in this event loop, ``devices`` workers in all.
        ``curve_key_file``: encrypt the tcp sockets (``nereus curve-key FILE``).
        ``cores_per_device``: each worker's CPU cap in cores (a number, one per device in
        device order, or ``"shared"``: no cap); ``cgroup_root``: where to make the groups
        (default: found; refused with ``ConfigError`` where none is writable)."""
        if isinstance(devices, int):
            if devices < 1 or nodes < 1 or devices < nodes:
                raise ConfigError(f"devices={devices}, nodes={nodes}: need 1 <= nodes <= devices")
            per_node = [devices // nodes + (1 if i < devices % nodes else 0) for i in range(nodes)]
        else:
            per_node = list(devices)
            if not per_node or any(not isinstance(n, int) or n < 1 for n in per_node):
                raise ConfigError(f"devices={devices!r} must be an int or a list of ints >= 1")
        if transport not in ("ipc", "tcp"):
            raise ConfigError(f"transport={transport!r} must be 'ipc' or 'tcp'")
        return cls(
            key=load_key(key) if key is not None else generate_key(),
            local_devices=per_node,
            memory_per_device=memory_per_device,
            min_devices=sum(per_node),
            timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            transport=transport,
            span_sample_every=span_sample_every,
            max_message_bytes=parse_size(max_message_bytes, "max_message_bytes"),
            curve=load_curve(curve_key_file) if curve_key_file else None,
            cores_per_device=_check_cores(cores_per_device, sum(per_node)),
            cgroup_root=cgroup_root,
        )

    @classmethod
    def connect(
        cls,
        address: str,
        key: str | bytes | None = None,
        *,
        key_file: str | None = None,
        min_devices: int = 1,
        timeout_s: float = 30.0,
        span_sample_every: int = 100,
        curve_key_file: str | None = None,
    ) -> Cluster:
        """Attach to the controller at ``address``; waits for ``min_devices`` devices.
        ``curve_key_file``: the cluster's CURVE key, when its tcp sockets are encrypted."""
        if not isinstance(address, str) or "://" not in address:
            raise ConfigError(f"address={address!r} must look like 'tcp://HOST:PORT'")
        return cls(
            key=load_key(key, key_file),
            address=address,
            min_devices=min_devices,
            timeout_s=timeout_s,
            span_sample_every=span_sample_every,
            curve=load_curve(curve_key_file) if curve_key_file else None,
        )

    async def __aenter__(self) -> Cluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> Cluster:
        if self._started:
            return self
        self._started = True
        try:
            if self._local_devices:
                await self._start_local()
            client = _client.Client(
                self.key,
                source="driver",
                span_sample_every=self._span_sample_every,
                curve=self.curve,
            )
            self._client = client
            client.connect_controller(self.address)
            client.notice_listeners.append(self._on_notice)
            self._previous_client = _client._CLIENT
            _client.set_current_client(client)
            try:
                view = await client.request(
                    None, "hello", {"source": "driver"}, timeout_s=self._timeout_s
                )
            except DeadlineExceeded:
                raise DeadlineExceeded(
                    f"no answer from the controller at {self.address} within "
                    f"{self._timeout_s} s: is it running, and is this the cluster's key? "
                    "(frames signed with another key are dropped unanswered)"
                ) from None
            deadline = time.monotonic() + self._timeout_s
            while len(view["devices"]) < self._min_devices:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"the controller at {self.address} has {len(view['devices'])} ready "
                        f"devices; waited {self._timeout_s} s for {self._min_devices}"
                    )
                await asyncio.sleep(0.05)  # a remote controller: poll until the nodes joined
                view = await client.request(None, "devices", {}, timeout_s=self._timeout_s)
            self._set_view(view)
            # Move what is alive now (imported modules; torch alone is ~150k objects) out
            # of the cyclic collector's reach: rescanning it on every full collection
            # otherwise costs ~10 us per call on the hot path.
            gc.freeze()
        except BaseException:
            await self.close()
            raise
        return self

    async def _start_local(self) -> None:
        self.controller = await Controller(
            self.key, heartbeat_timeout_s=self._heartbeat_timeout_s, curve=self.curve
        ).start()
        self.address = self.controller.address
        first = 0
        for i, n in enumerate(self._local_devices):
            node = NodeDaemon(
                self.address,
                self.key,
                devices=n,
                memory_per_device=self._memory_per_device,
                cores_per_device=self._node_cores(first, n),
                cgroup_root=self._cgroup_root,
                transport=self._transport,
                node_id=f"local{i}",
                heartbeat_s=min(0.5, self._heartbeat_timeout_s / 4),
                start_timeout_s=self._timeout_s,
                max_message_bytes=self._max_message_bytes,
                curve=self.curve,
            )
            self.nodes.append(node)
            first += n
        for node in self.nodes:  # one after the other: node i's devices come before node i+1's
            await node.register()
        await asyncio.gather(*(node.start() for node in self.nodes))
        await self.controller.wait_devices(sum(self._local_devices), self._timeout_s)

    def _node_cores(self, first: int, count: int) -> float | str | list[float]:
        """The ``cores_per_device`` of a node holding local devices first..first+count-1."""
        if isinstance(self._cores, (list, tuple)):
            return list(self._cores[first : first + count])
        return self._cores

    def _started_node(self, device: int) -> tuple[Any, int] | None:
        """(the node daemon this cluster started that holds ``device``, its local index),
        or None for an unknown device or one of a node started elsewhere."""
        info = next((d for d in self.devices if d.index == device), None)
        if info is None:
            return None
        node = next((n for n in self.nodes if n.node_id == info.node_id), None)
        return None if node is None else (node, info.local_index)

    def cores_of(self, device: int) -> float | None:
        """The CPU cores device ``device`` is capped at (a device of a node this cluster
        started), or None: shared cores, a GPU, or a device of a node started elsewhere."""
        found = self._started_node(device)
        if found is None or found[0].cores is None:
            return None
        return found[0].cores[found[1]]

    def cpu_seconds(self, device: int) -> float | None:
        """CPU seconds the kernel accounted to capped device ``device``'s worker processes
        (``CpuLimits.cpu_seconds``), or None where ``cores_of`` is None."""
        found = self._started_node(device)
        if found is None or found[0].limits is None:
            return None
        return found[0].limits.cpu_seconds(found[1])

    def _set_view(self, view: dict) -> None:
        self.tap_address = view["tap_address"]
        self.epoch = int(view.get("epoch", 0))
        devs = sorted(view["devices"], key=lambda d: d["index"])
        self.devices = [
            DeviceInfo(
                d["index"], d["host"], d["kind"], d["memory_bytes"], d["node_id"], d["local_index"]
            )
            for d in devs
        ]
        self._addresses = {d["index"]: d["address"] for d in devs}

    async def refresh_devices(self) -> list[DeviceInfo]:
        """Ask the controller for the devices that are alive and ready now."""
        self._set_view(await self._need_client().request(None, "devices", {}))
        return self.devices

    def _need_client(self) -> _client.Client:
        if self._client is None or self._client.closed:
            raise ConfigError("the cluster is not started (use `async with Cluster.local(...)`)")
        return self._client

    async def set_epoch(self, epoch: int) -> None:
        """Set the layout epoch the controller stamps on every tap event from now on
        (the transition layer bumps it when a new plan takes effect)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} must be an int >= 0")
        await self._need_client().request(None, "set_epoch", {"epoch": epoch})
        self.epoch = epoch

    # -- the device pool -------------------------------------------------------------

    @property
    def draining(self) -> frozenset[int]:
        """Devices marked by ``drain`` that have not been retired yet."""
        return frozenset(self._draining)

    def drain(self, device: int) -> None:
        """Mark ``device`` to be emptied by the next change of plan of whoever uses it;
        ``retire_drained`` then stops its worker. A ``device_drain`` event goes on the tap."""
        if device not in self._addresses:
            raise ConfigError(
                f"device={device!r} is not a live device of the cluster {sorted(self._addresses)}"
            )
        self._draining.add(device)
        self._need_client().emit_event({"type": "device_drain", "device": device})

    async def retire_drained(self, devices: Sequence[int]) -> None:
        """Stop the workers of drained ``devices`` (their work must have left them): the
        controller tells their nodes; this returns once every one of those workers has
        exited, and they leave the cluster's view without a failure."""
        for d in devices:
            if d not in self._draining:
                raise ConfigError(
                    f"device={d!r} is not draining (draining: {sorted(self._draining)})"
                )
        client = self._need_client()
        loop = asyncio.get_running_loop()
        waits = [self._retiring.setdefault(d, loop.create_future()) for d in devices]
        for d in devices:
            await client.request(None, "retire", {"device": d}, timeout_s=self._timeout_s)
            self._forget_device(d)
        try:
            await asyncio.wait_for(asyncio.gather(*waits), self._timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"drained devices {list(devices)} did not stop within {self._timeout_s} s"
            ) from None
        finally:
            for d in devices:
                self._retiring.pop(d, None)
                self._draining.discard(d)

    async def add_node(
        self,
        devices: int,
        memory_per_device: int | str | None = None,
        cores_per_device: float | str | None = None,
    ) -> list[int]:
        """Start one more node daemon with ``devices`` worker processes (a local cluster
        only); returns the indices its devices were given. Its workers get
        ``cores_per_device`` (default: the cluster's, the first device's where it gives
        one per device)."""
        if self.controller is None:
            raise ConfigError(
                "add_node starts node daemons of a local cluster; on a running cluster start "
                "`python -m nereus.node --controller ...` on the new host instead"
            )
        if not isinstance(devices, int) or devices < 1:
            raise ConfigError(f"devices={devices!r} must be an int >= 1")
        node = NodeDaemon(
            self.address,
            self.key,
            devices=devices,
            memory_per_device=memory_per_device or self._memory_per_device,
            cores_per_device=(
                cores_per_device if cores_per_device is not None else self._added_cores()
            ),
            cgroup_root=self._cgroup_root,
            transport=self._transport,
            node_id=f"local{len(self.nodes)}",
            heartbeat_s=min(0.5, self._heartbeat_timeout_s / 4),
            start_timeout_s=self._timeout_s,
            max_message_bytes=self._max_message_bytes,
        )
        self.nodes.append(node)
        await node.start()
        await self.refresh_devices()
        return list(node.indices)

    def _added_cores(self) -> float | str:
        if isinstance(self._cores, (list, tuple)):
            return self._cores[0]
        return self._cores

    def _forget_device(self, index: int) -> None:
        self._addresses.pop(index, None)
        self.devices = [d for d in self.devices if d.index != index]

    # -- spawning --------------------------------------------------------------------

    async def spawn(
        self,
        name: str,
        actor_class: type[Actor],
        devices: Sequence[int | DeviceInfo] | None = None,
        *,
        args: Sequence = (),
        kwargs: dict[str, Any] | None = None,
        axes: dict[str, int] | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> ActorMesh:
        """One actor of ``actor_class`` per entry of ``devices`` (default: every device),
        constructed in its worker with ``args``/``kwargs``. A device may repeat (several
        actors in one worker). Raises RemoteError if a constructor raised (the actors
        already made are stopped)."""
        client = self._need_client()
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"name={name!r} must be a non-empty string without '/'")
        if name in self._meshes:
            raise ConfigError(f"name={name!r} is already a live mesh; stop it or pick another")
        path = class_path(actor_class)
        indices = [
            d.index if isinstance(d, DeviceInfo) else d
            for d in (devices if devices is not None else self.devices)
        ]
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or i not in self._addresses:
                raise ConfigError(
                    f"devices contains {i!r}, which is not a live device of the "
                    f"cluster {sorted(self._addresses)}"
                )
        if not indices:
            raise ConfigError("devices=[] must name at least one device")
        axes = dict(axes) if axes is not None else {"dp": len(indices)}
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ConfigError(f"max_pending={max_pending!r} must be an int >= 1")
        shape = ActorMesh(name, [None] * len(indices), axes)  # validates axes
        bodies = []
        for rank in range(len(indices)):
            bodies.append(
                {
                    "name": f"{name}/{rank}",
                    "cls": path,
                    "args": list(args),
                    "kwargs": dict(kwargs or {}),
                    "mesh": name,
                    "rank": rank,
                    "coords": shape.coords(rank),
                    "max_pending": max_pending,
                }
            )
        results = await asyncio.gather(
            *(
                client.request(self._addresses[i], "spawn", b, timeout_s=self._timeout_s)
                for i, b in zip(indices, bodies, strict=True)
            ),
            return_exceptions=True,
        )
        refs = []
        for index, body, res in zip(indices, bodies, results, strict=True):
            if isinstance(res, BaseException):
                continue
            refs.append(
                ActorRef(
                    self._addresses[index],
                    body["name"],
                    res["incarnation"],
                    index,
                    name,
                    body["rank"],
                    path,
                )
            )
        failed = [
            (i, r) for i, r in zip(indices, results, strict=True) if isinstance(r, BaseException)
        ]
        if failed:
            if refs:
                await ActorMesh(name, refs, {"dp": len(refs)}).stop()
            index, err = failed[0]
            if isinstance(err, RemoteError):
                err.actor = f"{name} (device {index})"
            raise err
        mesh = ActorMesh(name, refs, axes)
        self._meshes[name] = (mesh, path)
        return mesh

    async def stop_mesh(self, mesh: ActorMesh) -> None:
        await mesh.stop()
        self._meshes.pop(mesh.name, None)

    # -- supervision -----------------------------------------------------------------

    def on_failure(self, callback: Callable[[Failure], Any]) -> None:
        """Call ``callback(failure)`` (sync, or async: then run as a task) on each failure."""
        if not callable(callback):
            raise ConfigError(f"on_failure callback {callback!r} is not callable")
        self._callbacks.append(callback)

    def _on_notice(self, op: str, body: dict) -> None:
        if op == "device_retired":
            done = self._retiring.get(body.get("device"))
            if done is not None and not done.done():
                done.set_result(None)
            return
        if op != "worker_died":
            return
        index = body.get("device")
        self._forget_device(index)
        self._draining.discard(index)
        failures = []
        for mesh, _path in self._meshes.values():
            for ref in mesh.refs:
                if ref.device == index:
                    failures.append(
                        (
                            mesh,
                            Failure(
                                index,
                                ref.name,
                                ref.incarnation,
                                body.get("reason", ""),
                                body.get("node_id", ""),
                                body.get("pid", 0),
                                mesh.name,
                                ref.rank,
                            ),
                        )
                    )
        if not failures:
            failures.append(
                (
                    None,
                    Failure(
                        index,
                        "",
                        0,
                        body.get("reason", ""),
                        body.get("node_id", ""),
                        body.get("pid", 0),
                    ),
                )
            )
        client = self._client
        for mesh, failure in failures:
            event = {"type": "failure", **dataclasses.asdict(failure)}
            client.emit_event(event)
            for cb in list(self._callbacks):
                try:
                    result = cb(failure)
                except Exception:
                    log.exception("on_failure callback %r failed", cb)
                    continue
                if inspect.isawaitable(result):
                    self._track(asyncio.ensure_future(result))
            if mesh is not None:
                for ref in mesh.refs:
                    if ref.address not in client.dead:
                        self._track(asyncio.ensure_future(self._supervise(ref, failure)))

    async def _supervise(self, ref: ActorRef, failure: Failure) -> None:
        try:
            await self._client.request(
                ref.address,
                "supervise",
                {"name": ref.name, "failure": dataclasses.asdict(failure)},
                timeout_s=self._timeout_s,
            )
        except (RemoteError, ActorDied, DeadlineExceeded) as e:
            log.error("__supervise__ of %s failed: %s", ref.name, e)
            self._client.emit_event(
                {
                    "type": "error",
                    "actor": ref.name,
                    "method": "__supervise__",
                    "device": ref.device,
                    "remote_type": type(e).__name__,
                    "message": str(e),
                }
            )

    def _track(self, task: asyncio.Future) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- teardown --------------------------------------------------------------------

    async def close(self) -> None:
        """Disconnect; for a local cluster also stop the workers and the controller."""
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.controller is None and self._client is not None and not self._client.closed:
            # Attached to a shared cluster: its workers outlive us, our actors must not.
            for mesh, _path in list(self._meshes.values()):
                try:
                    await asyncio.wait_for(mesh.stop(), 5.0)
                except (asyncio.TimeoutError, NereusError) as e:
                    log.warning("could not stop mesh %r on close: %s", mesh.name, e)
            self._meshes.clear()
        if self._client is not None and not self._client.closed:
            try:
                self._client.tell("bye", {})
            except Exception as e:  # best effort: the controller may be gone
                log.debug("bye: %s", e)
            self._client.close()
            if _client._CLIENT is self._client:
                _client.set_current_client(self._previous_client)
        for node in self.nodes:
            await node.stop()
        if self.controller is not None:
            await self.controller.close()


def _check_cores(value: float | str | Sequence[float], devices: int) -> float | str | list[float]:
    """``cores_per_device`` as given, refused early (``ConfigError``) when malformed."""
    parsed = parse_cores(value, devices)
    if parsed is None:
        return "shared"
    return list(value) if isinstance(value, (list, tuple)) else float(value)
