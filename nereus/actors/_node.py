"""``python -m nereus.node``: the per-host daemon, one worker process per device.

    python -m nereus.node --controller tcp://HOST:PORT --devices 4 \\
        --memory-per-device 2GiB --key-file KEY
    python -m nereus.node --controller tcp://HOST:PORT --gpus all --key-file KEY

``NodeDaemon`` registers its devices with the controller (which assigns global
indices), spawns one worker (``python -m nereus.actors._worker``, via subprocess:
nothing is pickled) per device, tells the controller their addresses, heartbeats
every ``heartbeat_s``, and reports each worker that exits with how it died (e.g.
``SIGKILL``, ``exit code 1``). It restarts nothing: a dead device stays dead until
someone decides otherwise. A node the controller declared lost (its heartbeats
stopped for too long) that comes back is told so and stops its workers (the
command exits with status 3). On stop it tells the controller it leaves, terminates
its workers (SIGTERM, then SIGKILL after ``stop_grace_s``) and reaps them. Workers
die with the daemon (Linux parent-death signal).

On CPU, ``--devices N`` starts N workers each standing for one device with the
``--memory-per-device`` budget (default 1GiB) that engines must respect. With
``--gpus all|0,1,..`` each worker sees one GPU (``CUDA_VISIBLE_DEVICES``) and its
budget is that GPU's memory less the CUDA context's and NCCL's reserve
(``nereus.actors.gpu_memory``) unless ``--memory-per-device`` says otherwise. GPU ids
count within the daemon's own ``CUDA_VISIBLE_DEVICES`` when it is set (a Slurm step
or a container has already narrowed it to the GPUs this node may use): the daemon
maps within it and never widens it to the host's raw GPU ids.

``--cores-per-device q`` (one number, or one per device: ``0.25,0.5``) caps each CPU
worker at ``q`` cores by a cgroup CPU quota (``nereus.actors._cpulimit``): the worker
joins its group before it runs Python, torch gets ``ceil(q)`` threads, and the group
goes when the worker or the node ends (a starting node removes those of killed nodes).
Where no CPU controller is writable the node refuses to start (``ConfigError``);
without it (``"shared"``, the default) workers share the host's cores.

The key comes from ``--key-file`` or ``$NEREUS_CLUSTER_KEY``; workers get it through
their environment. Workers get the daemon's ``sys.path`` as ``PYTHONPATH`` and its
working directory, so they import the same actor modules.

Each daemon owns a scratch folder (``nereus-<pid>-*`` in its own temporary folder),
removed when it stops: it holds the workers' ipc sockets and is the workers'
``TMPDIR``, so what libraries in a worker leave in the temporary folder (vLLM's engine
sockets, for one) goes with the node, even when the worker was killed rather than
closed (a daemon killed with SIGKILL removes nothing: its folder stays). Nothing a
worker writes there outlives its node: a cache meant to last across runs belongs
elsewhere (torch's compile cache, for one, follows ``TMPDIR`` unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Mapping

from nereus.actors import _client
from nereus.actors._channel import DEFAULT_MAX_MESSAGE_BYTES
from nereus.actors._cpulimit import CpuLimits, parse_cores
from nereus.actors._curve import CurveKey, load_curve
from nereus.actors._keys import CURVE_ENV, KEY_ENV, load_key
from nereus.actors._loop import run
from nereus.actors._protocol import WORKER_READY
from nereus.actors.gpu_memory import gpu_budget_bytes
from nereus.config import parse_size
from nereus.errors import ConfigError, DeadlineExceeded, exit_status

__all__ = ["NodeDaemon", "main", "READY_PREFIX"]

# glibc's memcpy/memmove store around the cache above this size (no read of each
# destination line before it is written): a worker's large copies -- shards written
# into a peer's arena, see nereus.transfer._copy -- run ~25% faster with two cores
# copying at once. glibc's default here (3/4 of its idea of the shared cache) is 240 MiB.
NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NON_TEMPORAL_THRESHOLD = 1 << 18


def _add_tunable(env: dict[str, str], name: str, value: int) -> None:
    """Add ``name=value`` to ``env``'s ``GLIBC_TUNABLES`` unless it names ``name``
    already (the user's setting wins; their other tunables are kept)."""
    current = env.get("GLIBC_TUNABLES", "")
    if name in current:
        return
    env["GLIBC_TUNABLES"] = f"{current}:{name}={value:#x}" if current else f"{name}={value:#x}"


log = logging.getLogger("nereus.node")

READY_PREFIX = "NEREUS_NODE_READY "


def death_reason(returncode: int) -> str:
    """``"SIGKILL"`` for -9, ``"exit code 1"`` for 1, ..."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _visible_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (ids, ``GPU-<uuid>`` or ``MIG-<uuid>``), or
    None when it is unset (every GPU of the host is visible)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [x.strip() for x in value.split(",") if x.strip()]


def _gpu_ids(spec: str, environ: Mapping[str, str] | None = None) -> list[tuple[int, str]]:
    """One ``(index, visible)`` pair per GPU ``spec`` names: ``index`` is the GPU's number as
    CUDA counts it in this process (for ``torch.cuda``), ``visible`` the
    ``CUDA_VISIBLE_DEVICES`` value that shows a worker that GPU alone.

    Indices count within ``CUDA_VISIBLE_DEVICES`` when it is set: inside a Slurm step,
    or a container given some of a host's GPUs, it already names the GPUs this node may
    use, so index 1 of ``"2,3"`` is GPU 3, never the host's GPU 1."""
    environ = os.environ if environ is None else environ
    visible = _visible_gpus(environ)
    if spec == "all":
        if visible is not None:
            count = len(visible)
            where = f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
        else:
            import torch

            count = torch.cuda.device_count()
            where = "torch"
        if count == 0:
            raise ConfigError(f"gpus='all' but {where} names no CUDA device")
        ids = list(range(count))
    else:
        try:
            ids = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"gpus={spec!r} must be 'all' or a list like '0,1,3'") from None
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ConfigError(f"gpus={spec!r} must list distinct GPU ids >= 0")
        if visible is not None and max(ids) >= len(visible):
            raise ConfigError(
                f"gpus={spec!r} names GPU {max(ids)}, but CUDA_VISIBLE_DEVICES="
                f"{environ['CUDA_VISIBLE_DEVICES']!r} shows this node {len(visible)}: ids count "
                f"within it (0..{len(visible) - 1})"
            )
    return [(i, visible[i] if visible is not None else str(i)) for i in ids]


class _Worker:
    __slots__ = ("index", "local_index", "proc", "address", "watch", "reader", "retired")

    def __init__(self, index: int, local_index: int) -> None:
        self.index = index
        self.local_index = local_index
        self.retired = False
        self.proc: asyncio.subprocess.Process | None = None
        self.address = ""
        self.watch: asyncio.Task | None = None
        self.reader: asyncio.Task | None = None


class NodeDaemon:
    """See the module docstring."""

    def __init__(
        self,
        controller: str,
        key: bytes,
        *,
        devices: int | None = None,
        gpus: str | None = None,
        memory_per_device: int | str | None = None,
        transport: str = "tcp",
        bind_host: str = "127.0.0.1",
        node_id: str | None = None,
        heartbeat_s: float = 0.5,
        start_timeout_s: float = 60.0,
        stop_grace_s: float = 3.0,
        log_level: str = "WARNING",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        curve: CurveKey | None = None,
        cores_per_device: float | str | list[float] | None = None,
        cgroup_root: str | None = None,
    ) -> None:
        if (devices is None) == (gpus is None):
            raise ConfigError(f"devices={devices!r}, gpus={gpus!r}: give exactly one of them")
        if devices is not None and (not isinstance(devices, int) or devices < 1):
            raise ConfigError(f"devices={devices!r} must be an int >= 1")
        if transport not in ("tcp", "ipc"):
            raise ConfigError(f"transport={transport!r} must be 'tcp' or 'ipc'")
        if heartbeat_s <= 0:
            raise ConfigError(f"heartbeat_s={heartbeat_s!r} must be > 0")
        self.controller = controller
        self.key = key
        self.curve = curve
        self.kind = "cpu" if devices is not None else "cuda"
        gpu_pairs = _gpu_ids(gpus) if gpus is not None else []
        self.gpu_ids = [index for index, _ in gpu_pairs]
        self.gpu_visible = [visible for _, visible in gpu_pairs]
        count = devices if devices is not None else len(gpu_pairs)
        if memory_per_device is None:
            # A GPU's budget leaves out its CUDA context and NCCL's buffers (gpu_memory).
            self.memory_bytes = [gpu_budget_bytes(self._gpu_memory(i)) for i in self.gpu_ids] or [
                2**30
            ] * count
        else:
            self.memory_bytes = [parse_size(memory_per_device, "memory_per_device")] * count
        self.count = count
        if cores_per_device not in (None, "shared") and self.kind != "cpu":
            raise ConfigError(
                f"cores_per_device={cores_per_device!r} caps CPU workers; "
                "GPU devices are one GPU each"
            )
        # per local device, None: shared cores; groups are made in start()
        self.cores = parse_cores(cores_per_device, count)
        self.cgroup_root = cgroup_root
        self.limits: CpuLimits | None = None
        self.transport = transport
        self.bind_host = bind_host
        self.node_id = node_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.host = socket.gethostname()
        self.heartbeat_s = heartbeat_s
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_level = log_level
        if max_message_bytes < 1024:
            raise ConfigError(f"max_message_bytes={max_message_bytes!r} must be >= 1024")
        self.max_message_bytes = int(max_message_bytes)
        self.workers: list[_Worker] = []
        self.stopping = False
        self.fenced = asyncio.Event()  # set when the controller declared this node lost
        self._client: _client.Client | None = None
        self._heartbeat: asyncio.Task | None = None
        self._tmpdir: str | None = None

    @staticmethod
    def _gpu_memory(gpu: int) -> int:
        import torch

        return int(torch.cuda.get_device_properties(gpu).total_memory)

    @property
    def indices(self) -> list[int]:
        return [w.index for w in self.workers]

    async def register(self) -> None:
        """Register with the controller, which gives this node's devices their global
        indices (in registration order). ``start`` registers first if this was not called;
        calling it for several nodes one after the other fixes their order."""
        if self._client is not None:
            return
        self._client = _client.Client(
            self.key, source=f"node:{self.node_id}", span_sample_every=0, curve=self.curve
        )
        self._client.connect_controller(self.controller)
        self._client.notice_listeners.append(self._on_notice)
        devices = [
            {"local_index": i, "kind": self.kind, "memory_bytes": self.memory_bytes[i]}
            for i in range(self.count)
        ]
        try:
            reply = await self._client.request(
                None,
                "node_register",
                {"node_id": self.node_id, "host": self.host, "devices": devices},
                timeout_s=self.start_timeout_s,
            )
        except DeadlineExceeded:
            self._client.close()
            self._client = None
            raise DeadlineExceeded(
                f"the controller at {self.controller} did not answer within "
                f"{self.start_timeout_s} s: is it running, and does it hold this key?"
            ) from None
        self.workers = [_Worker(g, i) for i, g in enumerate(reply["indices"])]

    async def start(self) -> NodeDaemon:
        """Register, spawn and announce the workers; heartbeat from then on."""
        await self.register()
        # Heartbeat from registration on: starting workers may take longer than the timeout.
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        self._tmpdir = tempfile.mkdtemp(prefix=f"nereus-{os.getpid()}-")
        os.mkdir(os.path.join(self._tmpdir, "tmp"))
        try:
            if self.cores is not None:
                self.limits = CpuLimits(self.cores, owner=self.node_id, root=self.cgroup_root)
            await asyncio.wait_for(
                asyncio.gather(*(self._spawn(w) for w in self.workers)), self.start_timeout_s
            )
        except asyncio.TimeoutError:
            await self.stop()
            raise DeadlineExceeded(
                f"node {self.node_id}: workers not ready within {self.start_timeout_s} s"
            ) from None
        except BaseException:
            await self.stop()
            raise
        await self._client.request(
            None,
            "workers_ready",
            {
                "node_id": self.node_id,
                "workers": [
                    {"index": w.index, "address": w.address, "pid": w.proc.pid}
                    for w in self.workers
                ],
            },
        )
        for w in self.workers:
            w.watch = asyncio.get_running_loop().create_task(self._watch(w))
        return self

    def _env(self, w: _Worker) -> dict[str, str]:
        env = dict(os.environ)
        env[KEY_ENV] = self.key.decode("latin-1")
        if self.curve is not None:
            env[CURVE_ENV] = self.curve.secret.decode()
        else:
            env.pop(CURVE_ENV, None)
        if self.limits is not None:
            env["OMP_NUM_THREADS"] = str(self.limits.threads(w.local_index))
        else:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")  # actors' prints show up as they happen
        if self._tmpdir is not None:  # made by start(), removed by stop()
            env["TMPDIR"] = os.path.join(self._tmpdir, "tmp")
        paths = [p if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if os.path.isdir(p)))
        if self.kind == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_visible[w.local_index]
        else:
            # torch's CPU allocator on huge pages: filling a fresh 240 MB tensor (a
            # received shard, a new KV cache) takes ~20 ms instead of ~90 ms.
            env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
            _add_tunable(env, NON_TEMPORAL_TUNABLE, NON_TEMPORAL_THRESHOLD)
        return env

    async def _spawn(self, w: _Worker) -> None:
        if self.transport == "ipc":
            bind = f"ipc://{self._tmpdir}/w{w.index}"
        else:
            bind = f"tcp://{self.bind_host}:0"
        cmd = [
            sys.executable,
            "-m",
            "nereus.actors._worker",
            "--controller",
            self.controller,
            "--bind",
            bind,
            "--device-index",
            str(w.index),
            "--local-index",
            str(w.local_index),
            "--host",
            self.host,
            "--kind",
            self.kind,
            "--memory-bytes",
            str(self.memory_bytes[w.local_index]),
            "--node-id",
            self.node_id,
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            self.log_level,
            "--max-message-bytes",
            str(self.max_message_bytes),
        ]
        # a capped worker is in its group before it executes Python (so before torch)
        join = self.limits.preexec(w.local_index) if self.limits is not None else None
        w.proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, env=self._env(w), cwd=os.getcwd(), preexec_fn=join
        )
        while True:
            line = await w.proc.stdout.readline()
            if not line:
                rc = await w.proc.wait()
                raise ConfigError(
                    f"worker for device {w.index} exited before it was ready "
                    f"({death_reason(rc)}); see its stderr above"
                )
            text = line.decode(errors="replace").rstrip()
            if text.startswith(WORKER_READY):
                w.address = text[len(WORKER_READY) :]
                break
            sys.stdout.write(f"[device {w.index}] {text}\n")
        w.reader = asyncio.get_running_loop().create_task(self._forward(w))

    async def _forward(self, w: _Worker) -> None:
        """Copy the worker's stdout (user prints) to ours, prefixed with its device."""
        while True:
            line = await w.proc.stdout.readline()
            if not line:
                return
            sys.stdout.write(f"[device {w.index}] {line.decode(errors='replace')}")

    async def _watch(self, w: _Worker) -> None:
        rc = await w.proc.wait()
        if self.limits is not None and not self.stopping:
            self.limits.remove(w.local_index)
        if self.stopping or w.retired:
            return
        reason = death_reason(rc)
        log.warning("worker of device %d (pid %d) died: %s", w.index, w.proc.pid, reason)
        try:
            self._client.tell(
                "worker_died",
                {
                    "node_id": self.node_id,
                    "index": w.index,
                    "pid": w.proc.pid,
                    "reason": reason,
                    "returncode": rc,
                },
            )
        except Exception:
            log.exception("could not report the death of device %d", w.index)
            raise

    async def _beat(self) -> None:
        while True:
            self._client.tell("heartbeat", {"node_id": self.node_id})
            await asyncio.sleep(self.heartbeat_s)

    def _on_notice(self, op: str, body: dict) -> None:
        if op == "stop_worker":
            w = next((w for w in self.workers if w.index == body.get("index")), None)
            if w is not None and not w.retired:
                asyncio.get_running_loop().create_task(self._retire(w))
            return
        if op == "node_lost" and body.get("node_id") == self.node_id and not self.stopping:
            log.error(
                "the controller declared node %s lost (heartbeats came too late); "
                "stopping its workers",
                self.node_id,
            )
            self.fenced.set()
            asyncio.get_running_loop().create_task(self.stop())

    async def _retire(self, w: _Worker) -> None:
        """Stop one worker the controller retired (a drained device): SIGTERM, then kill
        after the grace period. Its exit is not a death."""
        w.retired = True
        if w.proc is not None and w.proc.returncode is None:
            w.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(w.proc.wait(), self.stop_grace_s)
            except asyncio.TimeoutError:
                log.warning("retired worker pid %d ignored SIGTERM; killing it", w.proc.pid)
                w.proc.kill()
                await w.proc.wait()
        self._client.tell("worker_retired", {"node_id": self.node_id, "index": w.index})

    def kill_heartbeat(self) -> None:
        """Stop heartbeating (tests use it to make the controller declare this node lost)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()

    async def stop(self) -> None:
        """Leave the cluster: terminate and reap every worker, close sockets, clean files."""
        if self.stopping:
            return
        self.stopping = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._client is not None and not self._client.closed:
            try:
                self._client.tell("node_leave", {"node_id": self.node_id, "reason": "shutdown"})
            except Exception as e:  # the controller may already be gone; leaving anyway
                log.info("could not tell the controller we leave: %s", e)
        procs = [w.proc for w in self.workers if w.proc is not None]
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), self.stop_grace_s)
            except asyncio.TimeoutError:
                log.warning("worker pid %d ignored SIGTERM; killing it", p.pid)
                p.kill()
                await p.wait()
        for w in self.workers:
            for t in (w.watch, w.reader):
                if t is not None:
                    t.cancel()
        tasks = [t for w in self.workers for t in (w.watch, w.reader) if t is not None]
        if self._heartbeat is not None:
            tasks.append(self._heartbeat)
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in procs:
            if p.stdout is not None and p._transport is not None:
                p._transport.close()
        if self._client is not None:
            self._client.close()
        if self.limits is not None:
            self.limits.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="nereus node", description=__doc__.split("\n\n")[0])
    ap.add_argument("--controller", required=True, help="tcp://HOST:PORT of the controller")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--devices", type=int, help="CPU worker processes, one per device")
    group.add_argument("--gpus", help="'all' or GPU ids like 0,1")
    ap.add_argument(
        "--memory-per-device",
        default=None,
        help="budget per device, e.g. 2GiB (CPU default 1GiB; GPU: its memory)",
    )
    ap.add_argument(
        "--cores-per-device",
        default="shared",
        help="CPU cores each worker may use (cgroup quota): a number, one per "
        "device like 0.25,0.5, or 'shared' (no limit; the default)",
    )
    ap.add_argument(
        "--cgroup-root",
        default=None,
        help="make the CPU groups in this cgroup folder (default: found)",
    )
    ap.add_argument("--key-file", default=None, help="cluster key file (else $NEREUS_CLUSTER_KEY)")
    ap.add_argument(
        "--curve-key-file",
        default=None,
        help="encrypt tcp sockets with this CURVE secret key (nereus curve-key)",
    )
    ap.add_argument(
        "--bind-host", default="127.0.0.1", help="address workers listen on (drivers must reach it)"
    )
    ap.add_argument("--node-id", default=None)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument(
        "--start-timeout-s",
        type=float,
        default=60.0,
        help="how long to wait for the controller and the workers",
    )
    ap.add_argument(
        "--max-message-bytes", default="4GiB", help="workers reject (and count) larger messages"
    )
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def _cores_arg(text: str) -> float | str | list[float]:
    """``--cores-per-device``: 'shared', one number, or a comma-separated list."""
    if text == "shared":
        return text
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"cores_per_device={text!r} must be 'shared', a number or a "
            "comma-separated list of numbers"
        ) from None
    return values[0] if len(values) == 1 else values


async def _serve(args: argparse.Namespace) -> None:
    key = load_key(key_file=args.key_file)
    node = NodeDaemon(
        args.controller,
        key,
        devices=args.devices,
        gpus=args.gpus,
        memory_per_device=args.memory_per_device,
        bind_host=args.bind_host,
        node_id=args.node_id,
        heartbeat_s=args.heartbeat_s,
        start_timeout_s=args.start_timeout_s,
        max_message_bytes=parse_size(args.max_message_bytes, "max_message_bytes"),
        curve=load_curve(args.curve_key_file) if args.curve_key_file else None,
        cores_per_device=_cores_arg(args.cores_per_device),
        cgroup_root=args.cgroup_root,
        log_level="WARNING" if args.log_level.upper() == "INFO" else args.log_level,
    )
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await node.start()
    print(f"{READY_PREFIX}{node.node_id} {','.join(map(str, node.indices))}", flush=True)
    fenced = loop.create_task(node.fenced.wait())
    try:
        await asyncio.wait([stop, fenced], return_when=asyncio.FIRST_COMPLETED)
    finally:
        fenced.cancel()
        await node.stop()
    if node.fenced.is_set():
        raise SystemExit(3)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s node %(name)s %(levelname)s %(message)s"
    )
    return exit_status(
        "nereus node", lambda: run(_serve(args)), usage=(ConfigError, DeadlineExceeded)
    )


if __name__ == "__main__":
    sys.exit(main())
