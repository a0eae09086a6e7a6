"""Where a process of a Slurm job runs, read from the environment Slurm gives it.

``SlurmTask.from_environ()`` reads what slurmd and srun set for the batch script and
for every task of a step: the job id, the task's rank (``SLURM_PROCID``), its node's
rank in the allocation (``SLURM_NODEID``), its rank on that node (``SLURM_LOCALID``),
the node it runs on (``SLURMD_NODENAME``) and the allocation's nodes, with
``SLURM_JOB_NODELIST`` (``gpu[01-04,07]``) expanded by Slurm's own parser,
``scontrol show hostnames``; nereus never re-implements the hostlist syntax.

``host_address(name)`` is the IPv4 address of a node that other nodes reach (never a
loopback one in a multi-node allocation): what a controller or worker binds.

Refuses (``ConfigError``): a process outside a Slurm job (the missing variable is
named), a value that is not what Slurm writes, a node list ``scontrol`` cannot expand
(its own error is quoted), a node name that does not resolve. Reads only; sets nothing.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from nereus.errors import ConfigError

__all__ = ["SlurmTask", "expand_hostnames", "host_address"]


def expand_hostnames(nodelist: str, scontrol: str = "scontrol") -> list[str]:
    """The node names of a Slurm host list, in Slurm's order (``scontrol show hostnames``)."""
    try:
        done = subprocess.run(
            [scontrol, "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        raise ConfigError(
            f"cannot expand SLURM_JOB_NODELIST={nodelist!r}: {scontrol!r} is not "
            "on PATH (is this a Slurm node?)"
        ) from None
    if done.returncode != 0:
        raise ConfigError(
            f"`{scontrol} show hostnames {nodelist}` failed with exit code "
            f"{done.returncode}: {done.stderr.strip()}"
        )
    hosts = done.stdout.split()
    if not hosts:
        raise ConfigError(f"`{scontrol} show hostnames {nodelist}` printed no host")
    return hosts


def host_address(name: str, alone: bool = False) -> str:
    """The IPv4 address of node ``name`` that other nodes reach: the first address it
    resolves to that is not a loopback one. A loopback address is refused unless the
    node is ``alone`` in its allocation (Debian's /etc/hosts maps a host's own name to
    127.0.1.1: binding it would hide the controller from every other node)."""
    try:
        addresses = socket.gethostbyname_ex(name)[2]
    except OSError as e:
        raise ConfigError(f"node name {name!r} does not resolve to an address: {e}") from None
    for address in addresses:
        if not address.startswith("127."):
            return address
    if alone:
        return addresses[0]
    raise ConfigError(
        f"node name {name!r} resolves only to loopback addresses {addresses}, "
        "which other nodes cannot reach: map it to the node's network address "
        "(/etc/hosts or DNS)"
    )


def _int(environ: Mapping[str, str], name: str) -> int:
    value = _get(environ, name)
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer") from None
    if number < 0:
        raise ConfigError(f"{name}={value!r} must be >= 0")
    return number


def _get(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise ConfigError(
            f"${name} is not set: run this inside a Slurm job (the batch script "
            "sbatch runs, or a task that srun starts)"
        )
    return value


@dataclass(frozen=True)
class SlurmTask:
    """One process of a Slurm job: the batch script (rank 0 on the first node) or one
    task of a step."""

    job_id: str
    """``SLURM_JOB_ID``."""
    procid: int
    """``SLURM_PROCID``: the task's rank in its step (0 for the batch script)."""
    nodeid: int
    """``SLURM_NODEID``: the rank of the task's node in the step's node list."""
    localid: int
    """``SLURM_LOCALID``: the task's rank among the step's tasks on its node."""
    node_name: str
    """``SLURMD_NODENAME``: the node this process runs on."""
    hosts: tuple[str, ...]
    """Every node of the allocation, ``SLURM_JOB_NODELIST`` expanded, in Slurm's order:
    the batch script runs on ``hosts[0]``."""
    submit_dir: str
    """``SLURM_SUBMIT_DIR``: where ``sbatch`` was run (the batch script's working folder)."""

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigError("hosts=() must name the allocation's nodes")
        if self.node_name not in self.hosts:
            raise ConfigError(
                f"SLURMD_NODENAME={self.node_name!r} is not one of the "
                f"allocation's nodes {list(self.hosts)}"
            )

    @property
    def first_host(self) -> str:
        """The allocation's first node: where the batch script, and so the controller, run."""
        return self.hosts[0]

    @property
    def is_first_node(self) -> bool:
        return self.node_name == self.hosts[0]

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, scontrol: str = "scontrol"
    ) -> SlurmTask:
        """Read the current process's Slurm environment (see the module docstring)."""
        environ = os.environ if environ is None else environ
        job_id = _get(environ, "SLURM_JOB_ID")
        hosts = tuple(expand_hostnames(_get(environ, "SLURM_JOB_NODELIST"), scontrol))
        return cls(
            job_id=job_id,
            procid=_int(environ, "SLURM_PROCID"),
            nodeid=_int(environ, "SLURM_NODEID"),
            localid=_int(environ, "SLURM_LOCALID"),
            node_name=_get(environ, "SLURMD_NODENAME"),
            hosts=hosts,
            submit_dir=environ.get("SLURM_SUBMIT_DIR") or os.getcwd(),
        )
