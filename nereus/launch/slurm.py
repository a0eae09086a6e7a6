"""A nereus cluster inside a Slurm allocation: what to start, and the sbatch script.

``SlurmCluster`` says what ``nereus slurm run`` starts inside an allocation: the
controller on the allocation's first node, ``tasks_per_node`` node daemons on every
node (one ``srun`` step; each daemon takes ``devices_per_task`` CPU devices or the
``gpus_per_task`` GPUs Slurm gives its task), and optionally an RL job attached to
them (``cluster.mode = "connect"``). ``SbatchOptions`` are the batch script's
``#SBATCH`` lines. ``render_sbatch(cluster, options)`` writes the script that
``sbatch`` runs; ``nereus slurm script`` prints it.

Promises: ``SlurmCluster.argv()`` and ``parse_cluster_args`` are inverses (the script
carries the cluster on ``nereus slurm run``'s command line, nothing else); the
allocation the script asks for is what the cluster uses (nodes x tasks x GPUs); the
script's second line is the ``nereus slurm script`` command that renders it again.
Refuses (``ConfigError`` naming the field): neither or both of CPU devices and GPUs,
counts below 1, a job file that does not exist, sbatch values with a newline.
Renders text only; runs nothing (``nereus.launch._slurm_driver`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nereus.config import parse_size, require

__all__ = ["SbatchOptions", "SlurmCluster", "parse_cluster_args", "render_sbatch"]


@dataclass(frozen=True)
class SlurmCluster:
    """What ``nereus slurm run`` starts in the allocation it runs in."""

    tasks_per_node: int = 1
    """Node daemons per node. One owns every device of its node; more split a node
    (e.g. one per socket, or two on one test host)."""
    devices_per_task: int = 0
    """CPU devices (worker processes) each daemon starts; 0 when the daemons take GPUs."""
    gpus_per_task: int = 0
    """GPUs each daemon takes: the node step asks ``srun --gpus-per-task``, Slurm narrows
    each task's ``CUDA_VISIBLE_DEVICES`` and the daemon maps within it. 0 on CPU."""
    memory_per_device: str = ""
    """Memory budget per device (``"16GiB"``); empty: 1GiB on CPU, a GPU's own memory."""
    job: str = ""
    """An RL job's TOML file to run against the cluster once every daemon is ready
    (``nereus run FILE --connect ...``); the allocation ends when it does. Empty: hold
    the cluster until the allocation ends or is cancelled, for jobs attached by hand."""
    key_dir: str = ""
    """Folder (mode 0700) for the cluster key (mode 0600) and ``cluster.json``; every
    node must see it. Empty: ``$SLURM_SUBMIT_DIR/.nereus/slurm-$SLURM_JOB_ID``."""
    controller_port: int = 0
    """TCP port of the controller on the first node; 0 picks a free one."""
    tap_port: int = 0
    """TCP port of the monitoring tap on the first node; 0 picks a free one."""
    heartbeat_timeout_s: float = 10.0
    """A node daemon silent this long is declared lost (its devices are reported dead)."""
    start_timeout_s: float = 300.0
    """How long the controller and every node daemon may take to become ready."""

    def __post_init__(self) -> None:
        require(self.tasks_per_node >= 1, "tasks_per_node", self.tasks_per_node, "must be >= 1")
        require(
            self.devices_per_task >= 0, "devices_per_task", self.devices_per_task, "must be >= 0"
        )
        require(self.gpus_per_task >= 0, "gpus_per_task", self.gpus_per_task, "must be >= 0")
        require(
            (self.devices_per_task > 0) != (self.gpus_per_task > 0),
            "devices_per_task",
            self.devices_per_task,
            f"and gpus_per_task={self.gpus_per_task} must be "
            "exactly one > 0 (CPU devices or GPUs per node daemon)",
        )
        if self.memory_per_device:
            parse_size(self.memory_per_device, "memory_per_device")
        require(
            not self.job or Path(self.job).is_file(),
            "job",
            self.job,
            "must be an existing TOML file (the RL job's config)",
        )
        for name in ("controller_port", "tap_port"):
            port = getattr(self, name)
            require(0 <= port <= 65535, name, port, "must be a TCP port in 0..65535")
        require(
            self.heartbeat_timeout_s > 0,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s,
            "must be > 0",
        )
        require(self.start_timeout_s > 0, "start_timeout_s", self.start_timeout_s, "must be > 0")

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_task > 0

    def node_argv(self) -> list[str]:
        """The device flags of each ``nereus slurm node`` task."""
        argv = ["--gpus", "all"] if self.uses_gpus else ["--devices", str(self.devices_per_task)]
        if self.memory_per_device:
            argv += ["--memory-per-device", self.memory_per_device]
        return argv

    def argv(self) -> list[str]:
        """``nereus slurm run``'s flags for this cluster (fields at their default left out)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out += ["--" + f.name.replace("_", "-"), str(value)]
        return out

    def with_absolute_paths(self) -> SlurmCluster:
        """This cluster with ``job`` and ``key_dir`` absolute, as a batch script that may
        run in another folder must carry them."""
        return dataclasses.replace(
            self,
            job=str(Path(self.job).resolve()) if self.job else "",
            key_dir=str(Path(self.key_dir).resolve()) if self.key_dir else "",
        )


def add_cluster_args(ap: argparse.ArgumentParser) -> None:
    """The flags of ``SlurmCluster``, one per field, for ``nereus slurm run`` and ``script``."""
    ap.add_argument(
        "--tasks-per-node",
        type=int,
        default=1,
        help="node daemons per node (default 1: one owns the node)",
    )
    ap.add_argument(
        "--devices-per-task",
        type=int,
        default=0,
        help="CPU devices (worker processes) per node daemon",
    )
    ap.add_argument(
        "--gpus-per-task",
        type=int,
        default=0,
        help="GPUs per node daemon (Slurm narrows CUDA_VISIBLE_DEVICES to them)",
    )
    ap.add_argument(
        "--memory-per-device",
        default="",
        help="budget per device, e.g. 16GiB (CPU default 1GiB; GPU: its memory)",
    )
    ap.add_argument(
        "--job",
        default="",
        help="RL job TOML to run on the cluster; without it the cluster is held "
        "until the allocation ends",
    )
    ap.add_argument(
        "--key-dir",
        default="",
        help="folder for the key and cluster.json, seen by every node "
        "(default $SLURM_SUBMIT_DIR/.nereus/slurm-$SLURM_JOB_ID)",
    )
    ap.add_argument("--controller-port", type=int, default=0, help="controller port (0: any)")
    ap.add_argument("--tap-port", type=int, default=0, help="monitoring tap port (0: any)")
    ap.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=10.0,
        help="declare a silent node lost after this long",
    )
    ap.add_argument(
        "--start-timeout-s",
        type=float,
        default=300.0,
        help="how long the controller and the node daemons may take to start",
    )


def cluster_from_args(args: argparse.Namespace) -> SlurmCluster:
    """The ``SlurmCluster`` of flags ``add_cluster_args`` declared."""
    return SlurmCluster(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SlurmCluster)})


def parse_cluster_args(argv: list[str]) -> SlurmCluster:
    """The ``SlurmCluster`` that ``argv`` (``SlurmCluster.argv()``'s form) describes."""
    ap = argparse.ArgumentParser(prog="nereus slurm run")
    add_cluster_args(ap)
    return cluster_from_args(ap.parse_args(argv))


@dataclass(frozen=True)
class SbatchOptions:
    """The batch script's ``#SBATCH`` lines (besides the nodes, tasks and GPUs, which
    follow from the ``SlurmCluster``)."""

    nodes: int = 1
    """Nodes in the allocation (``--nodes``)."""
    job_name: str = "nereus"
    """``--job-name``."""
    partition: str = ""
    """``--partition``; empty: the cluster's default."""
    account: str = ""
    """``--account``; empty: the user's default."""
    time: str = ""
    """``--time`` (``HH:MM:SS`` or ``D-HH:MM:SS``); empty: the partition's limit."""
    cpus_per_task: int = 0
    """``--cpus-per-task`` of each node daemon; 0: Slurm's default."""
    output: str = "nereus-%j.out"
    """``--output`` (``%j`` is the job id)."""
    python: str = field(default_factory=lambda: sys.executable)
    """The Python (with nereus installed) every node runs; a shared filesystem path."""
    extra: tuple[str, ...] = ()
    """More ``#SBATCH`` options, verbatim (``--constraint=a100``, ``--exclusive``)."""

    def __post_init__(self) -> None:
        require(self.nodes >= 1, "nodes", self.nodes, "must be >= 1")
        require(self.cpus_per_task >= 0, "cpus_per_task", self.cpus_per_task, "must be >= 0")
        for name in ("job_name", "partition", "account", "time", "output", "python"):
            value = getattr(self, name)
            require("\n" not in value, name, value, "must be one line")
        require(bool(self.python), "python", self.python, "must name a Python interpreter")
        for option in self.extra:
            require(
                option.startswith("-") and "\n" not in option,
                "extra",
                option,
                "must be one sbatch option per entry, like '--constraint=a100'",
            )

    def argv(self) -> list[str]:
        """``nereus slurm script``'s flags for these options (defaults left out, but the
        Python, whose default is the one rendering)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                out += [f"--sbatch={option}" for option in value]
            elif f.name == "python" or value != f.default:
                out += ["--" + f.name.replace("_", "-"), str(value)]
        return out


def render_sbatch(cluster: SlurmCluster, options: SbatchOptions) -> str:
    """The batch script: ``#SBATCH`` lines, then ``nereus slurm run`` with ``cluster``."""
    lines = [
        "#!/bin/bash",
        "# Rendered by: nereus slurm script " + shlex.join(cluster.argv() + options.argv()),
        "# A nereus cluster: the controller on the first node, "
        f"{cluster.tasks_per_node} node daemon(s) per node,",
        "# then "
        + (
            f"the RL job {cluster.job}."
            if cluster.job
            else "held until the allocation ends (attach jobs with `nereus run --connect`)."
        ),
        "# Relative paths start from the folder sbatch runs in: submit from there.",
        f"#SBATCH --job-name={options.job_name}",
        f"#SBATCH --nodes={options.nodes}",
        f"#SBATCH --ntasks-per-node={cluster.tasks_per_node}",
    ]
    if cluster.uses_gpus:
        lines.append(f"#SBATCH --gpus-per-node={cluster.tasks_per_node * cluster.gpus_per_task}")
    if options.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={options.cpus_per_task}")
    for name in ("partition", "account", "time", "output"):
        value = getattr(options, name)
        if value:
            lines.append(f"#SBATCH --{name}={value}")
    lines += [f"#SBATCH {option}" for option in options.extra]
    command = [options.python, "-m", "nereus.cli", "slurm", "run", *cluster.argv()]
    lines += ["set -euo pipefail", "exec " + shlex.join(command), ""]
    return "\n".join(lines)
