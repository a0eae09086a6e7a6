"""Cluster descriptions the planner plans for: how many devices, how fast, how connected.

A ``ClusterSpec`` is a frozen description: nodes x devices per node, each device's
memory, peak dense FLOP/s and memory bandwidth, and the two link types (intra-node,
per device; inter-node, per node and shared by its devices). Device indices are global
and node-major: device ``d`` lives on node ``d // devices_per_node``.

Promises:
- ``cluster_preset(name)`` returns the project's reference clusters (the paper's three,
  an 8xH100 node) by name; ``PRESETS`` lists them.
- ``local_cpu_cluster(devices, memory_bytes, probe)`` describes this machine's worker
  processes from probe figures (``nereus.planner._probe`` measures and caches them; this
  module never measures anything).
- ``with_nodes(n)`` is the same hardware with another node count (a device-pool change
  of whole nodes); ``with_devices(n)`` with another device count (whole nodes, or any
  count on a one-node cluster: a host whose worker processes come and go one by one).
- Devices of a fixed CPU capacity (``device_cores``: a kernel-enforced quota per worker,
  one number per device, possibly unlike): rates are one full core's, a device gets its
  cores' worth (``rate_share``), and a replica runs at its slowest device's.

Refuses (``ConfigError``): non-positive counts, sizes or rates, and unknown preset names
(the message lists the known ones).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nereus.config import require
from nereus.errors import ConfigError

__all__ = ["ClusterSpec", "PRESETS", "cluster_preset", "local_cpu_cluster", "core_share"]

GB = 1e9


def core_share(cores: int | None, busy_devices: int) -> float:
    """The share of a device's rates each of ``busy_devices`` devices working at once
    gets when they share ``cores`` (1.0 when ``cores`` is None: each has its own)."""
    return 1.0 if cores is None else min(1.0, cores / max(1, busy_devices))


@dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous devices on homogeneous nodes.

    Bandwidths are bytes per second in one direction: ``intra_node_bandwidth`` is what
    one device can push to a peer in its node; ``inter_node_bandwidth`` is what one
    node's NICs carry together, so a device's share is that divided by
    ``devices_per_node`` when every device of the node talks at once (ring collectives).
    """

    name: str
    nodes: int
    devices_per_node: int
    device_memory_bytes: int
    peak_flops: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float = 2e-6
    inter_node_latency_s: float = 8e-6
    # Bytes every device keeps for the framework, CUDA context, allocator slack.
    workspace_bytes: int = 2 * 2**30
    # The share of each device's memory plans leave free (margin for what the memory
    # model does not see).
    headroom: float = 0.10
    # Whether attention runs fused (scores never materialized, as FlashAttention on GPUs)
    # or eagerly (a [rows, heads, seq, seq] score and probability tensor per layer, as the
    # built-in engines on CPU).
    flash_attention: bool = True
    # Cores the devices share (processes on one CPU), None: each device computes on its
    # own. With c shared cores, a model-stage busy on n devices gets min(1, c/n) of each
    # device's rates (``rate_share``).
    cores: int | None = None
    # Each device's CPU capacity in cores (a cgroup quota per worker process), or None.
    # With it, ``peak_flops``, ``memory_bandwidth`` and the link bandwidths are one full
    # core's sustained rates (measured under the limit and divided by it), and a device
    # of q cores gets q of them; ``cores`` is then the host's core count (None: enough).
    device_cores: tuple[float, ...] | None = None
    # Latency steps of a small all-reduce among n ranks: "tree" (recursive doubling,
    # 2·log2 n: NCCL's and fabric collectives) or "ring" (2·(n-1): gloo's ring between
    # processes on one CPU host, where every step is a process wake-up).
    collective_steps: str = "tree"

    def __post_init__(self) -> None:
        require(bool(self.name), "ClusterSpec.name", self.name, "must be non-empty")
        for f in ("nodes", "devices_per_node", "device_memory_bytes"):
            v = getattr(self, f)
            require(isinstance(v, int) and v >= 1, f"ClusterSpec.{f}", v, "must be an integer >= 1")
        for f in ("peak_flops", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            v = getattr(self, f)
            require(v > 0, f"ClusterSpec.{f}", v, "must be > 0 (bytes or FLOP per second)")
        for f in ("intra_node_latency_s", "inter_node_latency_s"):
            v = getattr(self, f)
            require(v >= 0, f"ClusterSpec.{f}", v, "must be >= 0 seconds")
        require(0 <= self.headroom < 1, "ClusterSpec.headroom", self.headroom, "must be in [0, 1)")
        require(
            self.cores is None or (isinstance(self.cores, int) and self.cores >= 1),
            "ClusterSpec.cores",
            self.cores,
            "must be None or an integer >= 1",
        )
        if self.device_cores is not None:
            require(
                len(self.device_cores) == self.nodes * self.devices_per_node,
                "ClusterSpec.device_cores",
                self.device_cores,
                f"must give one capacity per device ({self.nodes * self.devices_per_node})",
            )
            require(
                all(c > 0 for c in self.device_cores),
                "ClusterSpec.device_cores",
                self.device_cores,
                "must be > 0 cores each",
            )
        require(
            self.collective_steps in ("tree", "ring"),
            "ClusterSpec.collective_steps",
            self.collective_steps,
            "must be 'tree' or 'ring'",
        )
        require(
            0 <= self.workspace_bytes < self.device_memory_bytes,
            "ClusterSpec.workspace_bytes",
            self.workspace_bytes,
            f"must be >= 0 and below device_memory_bytes={self.device_memory_bytes}",
        )

    def rate_share(self, busy_devices: int, capacity: float | None = None) -> float:
        """The share of a device's compute and bandwidth each of ``busy_devices`` devices
        working at once gets (1.0 unless the devices share ``cores``). With
        ``device_cores``: ``capacity`` (default: the slowest device's) cores, less where
        the busy devices' quotas add up to more than the host's ``cores``."""
        if self.device_cores is None:
            return core_share(self.cores, busy_devices)
        q = self.capacity() if capacity is None else capacity
        if self.cores is None:
            return q
        return q * min(1.0, self.cores / (busy_devices * q))

    def capacity(self, devices: object = None) -> float | None:
        """The cores a replica on ``devices`` (global indices; default: any device) runs
        at: its slowest device's (None without ``device_cores``)."""
        if self.device_cores is None:
            return None
        if devices is None:
            return min(self.device_cores)
        ids = [d for d in devices if 0 <= d < len(self.device_cores)]  # type: ignore[union-attr]
        return min((self.device_cores[d] for d in ids), default=min(self.device_cores))

    @property
    def is_heterogeneous(self) -> bool:
        return self.device_cores is not None and len(set(self.device_cores)) > 1

    def collective_latency_steps(self, n: int) -> int:
        """Latency steps of one small all-reduce among ``n`` ranks (``collective_steps``)."""
        if n <= 1:
            return 0
        if self.collective_steps == "ring":
            return 2 * (n - 1)
        return 2 * max(1, (n - 1).bit_length())

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        """The node holding global device index ``device``."""
        require(
            0 <= device < self.num_devices, "device", device, f"must be in [0, {self.num_devices})"
        )
        return device // self.devices_per_node

    def device_share_of_inter_node(self) -> float:
        """Bytes/s one device gets across nodes when all devices of its node send at once."""
        return self.inter_node_bandwidth / self.devices_per_node

    def with_nodes(self, nodes: int) -> ClusterSpec:
        """The same hardware with ``nodes`` nodes (whole nodes joined or lost); devices of
        one capacity keep it (devices of different capacities name which left: refused)."""
        cores = self.device_cores
        if cores is not None and len(cores) != nodes * self.devices_per_node:
            require(
                len(set(cores)) == 1,
                "ClusterSpec.device_cores",
                cores,
                "must be one capacity for every device to change the node count",
            )
            cores = (cores[0],) * (nodes * self.devices_per_node)
        return dataclasses.replace(self, nodes=nodes, device_cores=cores)

    def with_devices(self, devices: int) -> ClusterSpec:
        """The same hardware with ``devices`` devices: on a one-node cluster that node with
        ``devices`` devices (one host's worker processes come and go one at a time, as a
        running job's pool does: ``local_cpu_cluster`` of that many); on several nodes
        ``devices`` must be whole nodes (``with_nodes``). Devices of one capacity keep it,
        as in ``with_nodes``."""
        require(
            isinstance(devices, int) and devices >= 1, "devices", devices, "must be an integer >= 1"
        )
        per = self.devices_per_node
        if self.nodes > 1 or devices % per == 0:
            require(
                devices % per == 0,
                "devices",
                devices,
                f"must be whole nodes of {per} devices on a cluster of {self.nodes} nodes",
            )
            return self.with_nodes(devices // per)
        cores = self.device_cores
        if cores is not None:
            require(
                len(set(cores)) == 1,
                "ClusterSpec.device_cores",
                cores,
                "must be one capacity for every device to change the device count",
            )
            cores = (cores[0],) * devices
        return dataclasses.replace(self, devices_per_node=devices, device_cores=cores)


def _preset_table() -> dict[str, ClusterSpec]:
    return {
        # Frontier-class: 4 MI250X per node = 8 GCDs of 64 GB; Infinity Fabric 400 GB/s
        # between GCDs; 4x Slingshot-11 (25 GB/s each) per node.
        "mi250x-1024": ClusterSpec(
            name="mi250x-1024",
            nodes=128,
            devices_per_node=8,
            device_memory_bytes=64 * 2**30,
            peak_flops=191.5e12,
            memory_bandwidth=1.6e12,
            intra_node_bandwidth=400 * GB,
            inter_node_bandwidth=4 * 25 * GB,
        ),
        # 4 A100 64 GB per node, NVLink3 600 GB/s, 4x HDR100 (12.5 GB/s each).
        "a100-256": ClusterSpec(
            name="a100-256",
            nodes=64,
            devices_per_node=4,
            device_memory_bytes=64 * 2**30,
            peak_flops=312e12,
            memory_bandwidth=2.0e12,
            intra_node_bandwidth=600 * GB,
            inter_node_bandwidth=4 * 12.5 * GB,
        ),
        # 8 H200 141 GB per node, NVLink4 900 GB/s, a single HDR link (25 GB/s) per node.
        "h200-64": ClusterSpec(
            name="h200-64",
            nodes=8,
            devices_per_node=8,
            device_memory_bytes=141 * 10**9,
            peak_flops=989e12,
            memory_bandwidth=4.8e12,
            intra_node_bandwidth=900 * GB,
            inter_node_bandwidth=25 * GB,
        ),
        # One DGX-class 8xH100 80 GB node (NDR 400 Gb/s NIC if it ever gets a neighbour).
        "h100-8": ClusterSpec(
            name="h100-8",
            nodes=1,
            devices_per_node=8,
            device_memory_bytes=80 * 2**30,
            peak_flops=989e12,
            memory_bandwidth=3.35e12,
            intra_node_bandwidth=900 * GB,
            inter_node_bandwidth=50 * GB,
        ),
    }


PRESETS: dict[str, ClusterSpec] = _preset_table()


def cluster_preset(name: str, nodes: int | None = None) -> ClusterSpec:
    """A reference cluster by name, optionally with another node count.

    ``local-cpu`` is not here: it needs a probe (see ``local_cpu_cluster``)."""
    if name not in PRESETS:
        raise ConfigError(
            f"cluster={name!r} is not a known preset; expected one of {sorted(PRESETS)}"
        )
    spec = PRESETS[name]
    return spec if nodes is None else spec.with_nodes(nodes)


def local_cpu_cluster(
    devices: int,
    memory_bytes: int,
    *,
    flops_per_device: float,
    memory_bandwidth: float,
    exchange_bandwidth: float,
    workspace_bytes: int = 0,
    cores: int | None = None,
    headroom: float = 0.10,
    device_cores: tuple[float, ...] | list[float] | None = None,
) -> ClusterSpec:
    """This machine as ``devices`` worker processes, each with a ``memory_bytes`` budget.

    The rates come from a probe (one thread's matmul FLOP/s, one thread's memcpy bytes/s,
    the shared-memory hand-off bytes/s between processes); the caller passes them in so
    this stays pure. ``cores``: how many cores the devices share (default: one each);
    a model-stage busy on more devices than cores gets each device's share of them (4
    worker processes on 2 cores run about half as fast each as one alone, 2 run at full
    speed: ``ClusterSpec.rate_share``). One node: every collective takes the intra-node
    path.

    ``device_cores`` (one per device): each worker's CPU quota; the rates are then one
    full core's (the probe's figures under the limit, divided by it), each device gets
    its cores' worth, and ``cores`` is the host's core count, limiting only where the
    quotas add up to more. Small all-reduces are priced as gloo runs them there: a ring
    of 2·(n-1) process wake-ups."""
    require(
        isinstance(devices, int) and devices >= 1, "devices", devices, "must be an integer >= 1"
    )
    require(
        memory_bytes > workspace_bytes,
        "memory_bytes",
        memory_bytes,
        f"must exceed workspace_bytes={workspace_bytes}",
    )
    require(
        cores is None or (isinstance(cores, int) and cores >= 1),
        "cores",
        cores,
        "must be an integer >= 1",
    )
    require(
        device_cores is None or len(device_cores) == devices,
        "device_cores",
        device_cores,
        f"must give one capacity per device ({devices})",
    )
    return ClusterSpec(
        name=f"local-cpu-{devices}",
        nodes=1,
        devices_per_node=devices,
        device_memory_bytes=int(memory_bytes),
        peak_flops=float(flops_per_device),
        memory_bandwidth=float(memory_bandwidth),
        intra_node_bandwidth=float(exchange_bandwidth),
        inter_node_bandwidth=float(exchange_bandwidth),
        intra_node_latency_s=200e-6,
        inter_node_latency_s=200e-6,
        workspace_bytes=int(workspace_bytes),
        headroom=headroom,
        flash_attention=False,
        cores=_shared_cores(cores, devices, device_cores),
        device_cores=tuple(float(c) for c in device_cores) if device_cores is not None else None,
        collective_steps="ring" if device_cores is not None else "tree",
    )


def _shared_cores(cores: int | None, devices: int, device_cores: object) -> int | None:
    """``cores`` where it limits the devices, else None."""
    if cores is None:
        return None
    if device_cores is not None:
        return cores if sum(device_cores) > cores else None  # type: ignore[arg-type]
    return cores if cores < devices else None
