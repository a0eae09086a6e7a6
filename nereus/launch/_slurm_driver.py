"""``nereus slurm run`` and ``nereus slurm node``: a nereus cluster inside a Slurm allocation.

``run_cluster(cluster, task)`` runs in the batch script, on the allocation's first node:

1. makes the key folder (mode 0700) with a fresh random cluster key (mode 0600: only
   the job's user reads it), refusing a folder another user owns or others may read;
2. starts the controller (``python -m nereus.cli controller``) on the first node's address;
3. starts one ``srun`` step of ``tasks_per_node`` tasks on every node, each a
   ``nereus slurm node`` that becomes a node daemon, and waits for every ready line;
4. writes ``cluster.json`` (addresses, key file, nodes and their devices) beside the key;
5. runs the job (``nereus run JOB --connect ...``) and returns its exit status, or, with
   no job, holds the cluster until SIGTERM (``scancel``, the time limit) or SIGINT;
6. always, whatever ended it: stops the job, sends the node step SIGTERM through
   ``scancel --signal=TERM JOB.STEP`` (every daemon stops and reaps its workers; a plain
   signal to ``srun`` would have Slurm kill them at once), then stops the controller and
   removes the key folder.

A node daemon that dies is the controller's business, not this driver's: its node is
declared lost like any other and its devices reported dead to the job; the other
daemons go on (``srun --kill-on-bad-exit=0``). The controller dying ends everything.

``node_main`` is each task of that step: it names itself ``slurm-JOB-PROCID``, binds
its workers to its own node's address and execs ``python -m nereus.node``, so Slurm's
signals reach the daemon itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shlex
import signal
import sys
from pathlib import Path

from nereus.actors import CONTROLLER_READY, NODE_READY
from nereus.errors import ConfigError, DeadlineExceeded, NereusError
from nereus.launch._slurm_env import SlurmTask, host_address
from nereus.launch.slurm import SlurmCluster

__all__ = ["NODE_PREFIX", "make_key_dir", "node_main", "run_cluster"]

log = logging.getLogger("nereus.launch")

NODE_PREFIX = "NEREUS_SLURM_NODE "
"""``nereus slurm node`` prints ``NEREUS_SLURM_NODE STEP PROCID NODE`` before it becomes
the daemon: the driver learns the step to signal from it."""

STOP_GRACE_S = 15.0
"""How long each part may take to stop after SIGTERM before it is killed (a node daemon
gives its workers 3 s)."""


DRAIN_S = 5.0


def make_key_dir(path: Path) -> Path:
    """Make (or take over) ``path`` as a folder only this user may enter, and write a
    fresh random key into ``path/key`` readable only by this user. Returns the key file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        st = path.stat()
        if not path.is_dir() or st.st_uid != os.getuid():
            raise ConfigError(
                f"key_dir={str(path)!r} exists and is not a folder of this user (uid {os.getuid()})"
            ) from None
    os.chmod(path, 0o700)  # mkdir's mode passes through the umask; a reused folder keeps its own
    key_file = path / "key"
    key_file.unlink(missing_ok=True)  # a requeued job reuses its id: never reuse its key
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    return key_file


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


class _Part:
    """One process the driver started, with its name for messages."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.forward: asyncio.Task | None = None

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; reaps it either way."""
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            await self.wait_or_kill(grace_s)
        await self.drain()

    async def wait_or_kill(self, grace_s: float) -> None:
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning(
                "%s (pid %d) did not stop within %.0f s; killing it",
                self.name,
                self.proc.pid,
                grace_s,
            )
            self.proc.kill()
            await self.proc.wait()

    async def drain(self) -> None:
        """Wait until its output is copied, for a while: a process it started and left
        behind would hold the pipe open forever."""
        if self.forward is not None:
            try:
                await asyncio.wait_for(self.forward, DRAIN_S)
            except asyncio.TimeoutError:
                log.warning("%s's output stayed open %.0f s after it exited", self.name, DRAIN_S)


async def _forward(stream: asyncio.StreamReader) -> None:
    while True:
        line = await stream.readline()
        if not line:
            return
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()


async def _start_controller(
    cluster: SlurmCluster, bind_ip: str, key_file: Path, deadline: float
) -> tuple[_Part, str, str]:
    cmd = [
        sys.executable,
        "-m",
        "nereus.cli",
        "controller",
        "--bind",
        f"tcp://{bind_ip}:{cluster.controller_port}",
        "--tap-bind",
        f"tcp://{bind_ip}:{cluster.tap_port}",
        "--key-file",
        str(key_file),
        "--heartbeat-timeout-s",
        str(cluster.heartbeat_timeout_s),
    ]
    part = _Part(
        "the controller", await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    )
    loop = asyncio.get_running_loop()
    while True:
        try:
            line = await asyncio.wait_for(part.proc.stdout.readline(), deadline - loop.time())
        except asyncio.TimeoutError:
            await part.stop()
            raise DeadlineExceeded(
                f"the controller was not ready within {cluster.start_timeout_s} s"
            ) from None
        if not line:
            rc = await part.proc.wait()
            raise NereusError(
                f"the controller exited with status {rc} before it was ready "
                f"(its error is above): {shlex.join(cmd)}"
            )
        text = line.decode(errors="replace").strip()
        if text.startswith(CONTROLLER_READY):
            address, tap_address = text[len(CONTROLLER_READY) :].split()
            part.forward = loop.create_task(_forward(part.proc.stdout))
            return part, address, tap_address
        print(text, flush=True)


class _NodeStep:
    """The ``srun`` step of node daemons and what their ready lines said."""

    def __init__(self, part: _Part, job_id: str, expected: int) -> None:
        self.part = part
        self.job_id = job_id
        self.expected = expected
        self.step_id = ""
        self.hosts: dict[str, str] = {}  # procid -> node name
        self.nodes: list[dict] = []  # one per ready daemon: node_id, devices

    async def wait_ready(self, deadline: float, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        stdout = self.part.proc.stdout
        while len(self.nodes) < self.expected:
            try:
                line = await asyncio.wait_for(stdout.readline(), deadline - loop.time())
            except asyncio.TimeoutError:
                raise DeadlineExceeded(
                    f"{len(self.nodes)} of {self.expected} node daemons were "
                    f"ready within {timeout_s} s"
                ) from None
            if not line:
                rc = await self.part.proc.wait()
                raise NereusError(
                    f"the node step (srun) exited with status {rc} after "
                    f"{len(self.nodes)} of {self.expected} node daemons were "
                    "ready; Slurm's and the daemons' errors are above"
                )
            text = line.decode(errors="replace")
            sys.stdout.write(text)
            self._parse(text.strip())
        sys.stdout.flush()
        self.part.forward = loop.create_task(_forward(stdout))

    def _parse(self, text: str) -> None:
        # srun --label prefixes each line with "RANK: ".
        if NODE_PREFIX in text:
            step, procid, node = text.split(NODE_PREFIX, 1)[1].split()
            self.step_id = step
            self.hosts[procid] = node
        elif NODE_READY in text:
            node_id, indices = text.split(NODE_READY, 1)[1].split()
            procid = node_id.rsplit("-", 1)[1]
            self.nodes.append(
                {
                    "node_id": node_id,
                    "host": self.hosts.get(procid, ""),
                    "devices": [int(i) for i in indices.split(",")],
                }
            )

    async def stop(self) -> None:
        """SIGTERM to every daemon through Slurm (they leave the cluster and reap their
        workers), then wait for srun; kill the step if it does not end."""
        proc = self.part.proc
        if proc.returncode is None and self.step_id:
            await _scancel(["--signal=TERM", f"{self.job_id}.{self.step_id}"])
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                log.warning(
                    "the node step %s.%s did not stop within %.0f s; cancelling it",
                    self.job_id,
                    self.step_id,
                    STOP_GRACE_S,
                )
                await _scancel([f"{self.job_id}.{self.step_id}"])
        await self.part.stop()


async def _scancel(args: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec("scancel", *args)
    rc = await proc.wait()
    if rc != 0:  # the step may have ended on its own meanwhile; srun's exit says more
        log.info("scancel %s exited with status %d", " ".join(args), rc)


def _node_command(cluster: SlurmCluster, nnodes: int, address: str, key_file: Path) -> list[str]:
    srun = [
        "srun",
        f"--nodes={nnodes}",
        f"--ntasks={nnodes * cluster.tasks_per_node}",
        f"--ntasks-per-node={cluster.tasks_per_node}",
        "--kill-on-bad-exit=0",
        "--label",
        "--job-name=nereus-nodes",
    ]
    if cluster.uses_gpus:
        srun.append(f"--gpus-per-task={cluster.gpus_per_task}")
    return [
        *srun,
        sys.executable,
        "-m",
        "nereus.cli",
        "slurm",
        "node",
        "--controller",
        address,
        "--key-file",
        str(key_file),
        "--heartbeat-s",
        str(min(0.5, cluster.heartbeat_timeout_s / 4)),
        "--start-timeout-s",
        str(cluster.start_timeout_s),
        *cluster.node_argv(),
    ]


async def run_cluster(cluster: SlurmCluster, task: SlurmTask) -> int:
    """See the module docstring. Returns the job's exit status (0 when a held cluster is
    stopped by SIGTERM or SIGINT)."""
    if not task.is_first_node:
        raise ConfigError(
            f"`nereus slurm run` runs on the allocation's first node "
            f"{task.first_host!r} (the batch script's), not on {task.node_name!r}"
        )
    key_dir = Path(cluster.key_dir or Path(task.submit_dir) / ".nereus" / f"slurm-{task.job_id}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parts: list[_Part] = []
    step: _NodeStep | None = None
    job: _Part | None = None
    key_file: Path | None = None
    try:
        bind_ip = host_address(task.first_host, alone=len(task.hosts) == 1)
        key_file = make_key_dir(key_dir)
        deadline = loop.time() + cluster.start_timeout_s
        controller, address, tap_address = await _start_controller(
            cluster, bind_ip, key_file, deadline
        )
        parts.append(controller)
        cmd = _node_command(cluster, len(task.hosts), address, key_file)
        step = _NodeStep(
            _Part(
                "the node step (srun)",
                await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE),
            ),
            task.job_id,
            len(task.hosts) * cluster.tasks_per_node,
        )
        ready = loop.create_task(step.wait_ready(deadline, cluster.start_timeout_s))
        stopped = loop.create_task(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not ready.done():
            ready.cancel()
            log.warning("stopped while the node daemons were starting")
            return 0
        ready.result()
        devices = sum(len(n["devices"]) for n in step.nodes)
        info = {
            "job_id": task.job_id,
            "address": address,
            "tap_address": tap_address,
            "key_file": str(key_file),
            "devices": devices,
            "nodes": step.nodes,
        }
        _write_private(key_dir / "cluster.json", json.dumps(info, indent=1) + "\n")
        print(
            f"nereus cluster ready: {devices} devices on {len(step.nodes)} node daemons; "
            f"controller {address}, tap {tap_address}, key {key_file}",
            flush=True,
        )
        if not cluster.job:
            print(
                "attach a job with: nereus run JOB.toml "
                + shlex.join(
                    [
                        "--connect",
                        address,
                        "--key-file",
                        str(key_file),
                        "--cluster-devices",
                        str(devices),
                    ]
                ),
                flush=True,
            )
        watched = {
            loop.create_task(controller.proc.wait()): "controller",
            loop.create_task(stop.wait()): "stop",
        }
        if cluster.job:
            job = _Part(
                "the job",
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "nereus.cli",
                    "run",
                    cluster.job,
                    "--connect",
                    address,
                    "--key-file",
                    str(key_file),
                    "--cluster-devices",
                    str(devices),
                ),
            )
            watched[loop.create_task(job.proc.wait())] = "job"
        else:
            watched[loop.create_task(step.part.proc.wait())] = "nodes"
        done, pending = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        why = watched[next(iter(done))]
        if why == "job":
            rc = job.proc.returncode
            log.info("the job ended with status %d", rc)
            return 128 - rc if rc < 0 else rc  # killed by signal N: the shell's 128 + N
        if why == "controller":
            raise NereusError(
                f"the controller exited with status {controller.proc.returncode}"
                " while the cluster ran; stopping everything"
            )
        if why == "nodes":
            raise NereusError(
                f"every node daemon has ended (srun exited with status "
                f"{step.part.proc.returncode}); stopping the controller"
            )
        log.info("stopping the cluster (signal received)")
        return 0 if job is None else 143
    finally:
        if job is not None:
            await job.stop()
        if step is not None:
            await step.stop()
        for part in reversed(parts):
            await part.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if key_file is not None:  # only a folder this run made its own
            _remove_key_dir(key_dir)


def _remove_key_dir(key_dir: Path) -> None:
    for name in ("key", "cluster.json"):
        (key_dir / name).unlink(missing_ok=True)
    try:
        key_dir.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:  # someone put files there: leave them, say so
        log.warning("kept %s: %s", key_dir, e)


def node_main(
    controller: str,
    key_file: str,
    device_argv: list[str],
    *,
    heartbeat_s: float,
    start_timeout_s: float,
    task: SlurmTask | None = None,
) -> None:
    """Become this task's node daemon (``os.execv``; returns only by raising)."""
    task = task or SlurmTask.from_environ()
    step = os.environ.get("SLURM_STEP_ID", "")
    print(f"{NODE_PREFIX}{step} {task.procid} {task.node_name}", flush=True)
    argv = [
        sys.executable,
        "-m",
        "nereus.node",
        "--controller",
        controller,
        "--key-file",
        key_file,
        "--bind-host",
        host_address(task.node_name, alone=len(task.hosts) == 1),
        "--node-id",
        f"slurm-{task.job_id}-{task.procid}",
        "--heartbeat-s",
        str(heartbeat_s),
        "--start-timeout-s",
        str(start_timeout_s),
        *device_argv,
    ]
    os.execv(sys.executable, argv)
