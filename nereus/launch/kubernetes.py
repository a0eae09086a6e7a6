"""A nereus cluster on Kubernetes: the manifests that run it.

``render_manifests(cluster, key)`` returns the objects, ``nereus k8s render`` prints
them as YAML for ``kubectl apply -f -``: a Secret with the cluster key (left out when
``key`` is None), the controller (a Deployment of one pod and its Service), the node
daemons (a StatefulSet, one daemon per pod, with GPUs or CPU devices per pod, and a
headless Service), and with ``job`` a ConfigMap and a Job that waits for every device
and runs ``nereus run`` attached to the cluster on a shared volume.

Promises: the key is readable only by the pods' user; every pod gets a memory-backed
``/dev/shm``; every object carries the labels ``app.kubernetes.io/name: nereus``,
``instance: NAME`` and its ``component``.

Refuses (``ConfigError`` naming the field): names Kubernetes would refuse, neither or
both of GPUs and CPU devices, counts below 1, sizes or quantities it cannot read.
Builds plain data only; talks to no cluster.

More (how it works): docs/clusters.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.config import parse_size, require

__all__ = ["KubernetesCluster", "render_manifests"]

KEY_PATH = "/etc/nereus/key"
JOB_PATH = "/etc/nereus/job"
SHARED_PATH = "/shared"
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
_QUANTITY = re.compile(r"([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?\Z")


@dataclass(frozen=True)
class KubernetesCluster:
    """What ``render_manifests`` describes; every field is a ``nereus k8s render`` flag."""

    image: str
    """A container image with nereus installed (``pip install nereus``; ``[gpu]`` on GPUs)."""
    name: str = "nereus"
    """Prefix of every object's name (a DNS label of at most 40 characters)."""
    namespace: str = "default"
    """Namespace of every object."""
    nodes: int = 2
    """Node daemon pods (StatefulSet replicas); Kubernetes spreads them as it schedules."""
    gpus_per_node: int = 0
    """GPUs each node pod requests (``nvidia.com/gpu``); its daemon takes them all."""
    devices_per_node: int = 0
    """CPU devices (worker processes) each node pod runs when it has no GPUs."""
    memory_per_device: str = ""
    """Memory budget per device (``"16GiB"``); empty: 1GiB on CPU, a GPU's own memory."""
    cpu_per_node: str = ""
    """CPU each node pod requests and is limited to (a quantity: ``"8"``, ``"7500m"``)."""
    memory_per_node: str = ""
    """Memory each node pod requests and is limited to (a quantity: ``"64Gi"``)."""
    shm_size: str = "8Gi"
    """Size limit of each pod's memory-backed ``/dev/shm``."""
    controller_port: int = 5555
    """The controller's port (its Service's too)."""
    tap_port: int = 5556
    """The monitoring tap's port."""
    heartbeat_timeout_s: float = 10.0
    """A node pod silent this long is declared lost (its devices reported dead)."""
    run_as_user: int = 1000
    """User (and group) every container runs as; the key is readable by that group only."""
    python: str = "python"
    """The image's Python with nereus."""
    job: str = ""
    """An RL job's TOML file: rendered into a ConfigMap and a Job that runs it on the
    cluster. Empty: no Job (attach one with ``nereus run --connect``)."""
    shared_claim: str = ""
    """A PersistentVolumeClaim (ReadWriteMany) mounted at ``/shared`` in every pod, and the
    Job's working folder: ``run.out_dir`` and ``model.path`` must be on it."""

    def __post_init__(self) -> None:
        require(
            bool(self.image) and not any(c.isspace() for c in self.image),
            "image",
            self.image,
            "must name a container image with nereus installed",
        )
        require(
            len(self.name) <= 40 and bool(_DNS_LABEL.match(self.name)),
            "name",
            self.name,
            "must be a DNS label of at most 40 characters ([a-z0-9-], a letter first)",
        )
        require(
            len(self.namespace) <= 63 and bool(_DNS_LABEL.match(self.namespace)),
            "namespace",
            self.namespace,
            "must be a DNS label ([a-z0-9-], a letter first)",
        )
        require(self.nodes >= 1, "nodes", self.nodes, "must be >= 1")
        require(self.gpus_per_node >= 0, "gpus_per_node", self.gpus_per_node, "must be >= 0")
        require(
            self.devices_per_node >= 0, "devices_per_node", self.devices_per_node, "must be >= 0"
        )
        require(
            (self.gpus_per_node > 0) != (self.devices_per_node > 0),
            "gpus_per_node",
            self.gpus_per_node,
            f"and devices_per_node={self.devices_per_node} must be "
            "exactly one > 0 (GPUs or CPU devices per node pod)",
        )
        if self.memory_per_device:
            parse_size(self.memory_per_device, "memory_per_device")
        for name in ("cpu_per_node", "memory_per_node", "shm_size"):
            value = getattr(self, name)
            require(
                not value or bool(_QUANTITY.match(value)),
                name,
                value,
                "must be a Kubernetes quantity such as '8', '500m' or '64Gi'",
            )
        for name in ("controller_port", "tap_port"):
            port = getattr(self, name)
            require(1 <= port <= 65535, name, port, "must be a TCP port in 1..65535")
        require(
            self.controller_port != self.tap_port,
            "tap_port",
            self.tap_port,
            "must differ from controller_port",
        )
        require(
            self.heartbeat_timeout_s > 0,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s,
            "must be > 0",
        )
        require(
            self.run_as_user >= 1,
            "run_as_user",
            self.run_as_user,
            "must be a user id >= 1 (pods run as non-root)",
        )
        require(
            not self.job or Path(self.job).is_file(),
            "job",
            self.job,
            "must be an existing TOML file (the RL job's config)",
        )
        require(
            not self.shared_claim or bool(_DNS_LABEL.match(self.shared_claim)),
            "shared_claim",
            self.shared_claim,
            "must name a PersistentVolumeClaim",
        )
        require(
            not self.job or bool(self.shared_claim),
            "shared_claim",
            self.shared_claim,
            "must name a ReadWriteMany PersistentVolumeClaim when job is given: the job "
            "writes its model to run.out_dir, which every node pod must read",
        )

    @property
    def devices(self) -> int:
        """Devices of the whole cluster."""
        return self.nodes * (self.gpus_per_node or self.devices_per_node)

    @property
    def controller_address(self) -> str:
        return f"tcp://{self.name}-controller.{self.namespace}.svc:{self.controller_port}"


def _labels(cluster: KubernetesCluster, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "nereus",
        "app.kubernetes.io/instance": cluster.name,
        "app.kubernetes.io/component": component,
    }


def _meta(cluster: KubernetesCluster, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": cluster.namespace, "labels": _labels(cluster, component)}


_POD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "OMP_NUM_THREADS", "value": "1"},
]


def _pod_spec(
    cluster: KubernetesCluster,
    container: dict[str, Any],
    *,
    config_map: str = "",
    init: dict[str, Any] | None = None,
    restart: str = "Always",
) -> dict[str, Any]:
    """A pod of ``container`` (and ``init`` before it) with the key, ``/dev/shm``, the
    shared claim (its working folder) and ``config_map`` mounted."""
    mounts = [
        {"name": "key", "mountPath": KEY_PATH, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    volumes = [
        {"name": "key", "secret": {"secretName": f"{cluster.name}-key", "defaultMode": 0o440}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}},
    ]
    extra: dict[str, Any] = {}
    if cluster.shared_claim:
        # Relative paths in a job's config (run.out_dir) name the same files in every pod.
        mounts.append({"name": "shared", "mountPath": SHARED_PATH})
        volumes.append(
            {"name": "shared", "persistentVolumeClaim": {"claimName": cluster.shared_claim}}
        )
        extra["workingDir"] = SHARED_PATH
    if config_map:
        mounts.append({"name": "job", "mountPath": JOB_PATH, "readOnly": True})
        volumes.append({"name": "job", "configMap": {"name": config_map}})

    def full(c: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": c["name"],
            "image": cluster.image,
            **c,
            "env": _POD_ENV,
            **extra,
            "volumeMounts": mounts,
            "securityContext": {"allowPrivilegeEscalation": False},
        }

    spec: dict[str, Any] = {
        "restartPolicy": restart,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": cluster.run_as_user,
            "runAsGroup": cluster.run_as_user,
            "fsGroup": cluster.run_as_user,
        },
        "containers": [full(container)],
        "volumes": volumes,
    }
    if init is not None:
        spec["initContainers"] = [full(init)]
    return spec


def _controller(cluster: KubernetesCluster) -> list[dict[str, Any]]:
    name = f"{cluster.name}-controller"
    labels = _labels(cluster, "controller")
    ports = [
        {"name": "control", "containerPort": cluster.controller_port, "protocol": "TCP"},
        {"name": "tap", "containerPort": cluster.tap_port, "protocol": "TCP"},
    ]
    container = {
        "name": "controller",
        "command": [
            cluster.python,
            "-m",
            "nereus.cli",
            "controller",
            "--bind",
            f"tcp://$(POD_IP):{cluster.controller_port}",
            "--tap-bind",
            f"tcp://$(POD_IP):{cluster.tap_port}",
            "--key-file",
            f"{KEY_PATH}/key",
            "--heartbeat-timeout-s",
            str(cluster.heartbeat_timeout_s),
        ],
        "ports": ports,
        "readinessProbe": {"tcpSocket": {"port": "control"}, "periodSeconds": 2},
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(cluster, name, "controller"),
            "spec": {
                "selector": labels,
                "ports": [
                    {
                        "name": p["name"],
                        "port": p["containerPort"],
                        "targetPort": p["name"],
                        "protocol": "TCP",
                    }
                    for p in ports
                ],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(cluster, name, "controller"),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": _pod_spec(cluster, container)},
            },
        },
    ]


def _nodes(cluster: KubernetesCluster) -> list[dict[str, Any]]:
    name = f"{cluster.name}-node"
    labels = _labels(cluster, "node")
    devices = (
        ["--gpus", "all"] if cluster.gpus_per_node else ["--devices", str(cluster.devices_per_node)]
    )
    if cluster.memory_per_device:
        devices += ["--memory-per-device", cluster.memory_per_device]
    resources: dict[str, dict[str, Any]] = {}
    for key, value in (("cpu", cluster.cpu_per_node), ("memory", cluster.memory_per_node)):
        if value:
            resources.setdefault("requests", {})[key] = value
            resources.setdefault("limits", {})[key] = value
    if cluster.gpus_per_node:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = cluster.gpus_per_node
    container = {
        "name": "node",
        "command": [
            cluster.python,
            "-m",
            "nereus.node",
            "--controller",
            cluster.controller_address,
            "--key-file",
            f"{KEY_PATH}/key",
            "--node-id",
            "$(POD_NAME)",
            "--bind-host",
            "$(POD_IP)",
            *devices,
        ],
        "resources": resources,
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(cluster, name, "node"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _meta(cluster, name, "node"),
            "spec": {
                "serviceName": name,
                "replicas": cluster.nodes,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": _pod_spec(cluster, container)},
            },
        },
    ]


def _job(cluster: KubernetesCluster) -> list[dict[str, Any]]:
    name = f"{cluster.name}-job"
    config = Path(cluster.job).read_text()
    attach = ["--key-file", f"{KEY_PATH}/key"]
    container = {
        "name": "job",
        "command": [
            cluster.python,
            "-m",
            "nereus.cli",
            "run",
            f"{JOB_PATH}/job.toml",
            "--connect",
            cluster.controller_address,
            *attach,
            "--cluster-devices",
            str(cluster.devices),
            "--no-progress",
        ],
    }
    # Node pods may take minutes to schedule and pull their image: wait for every device
    # here rather than within the job's own (short) connect deadline.
    wait = {
        "name": "wait-for-devices",
        "command": [
            cluster.python,
            "-m",
            "nereus.cli",
            "k8s",
            "wait",
            "--controller",
            cluster.controller_address,
            *attach,
            "--devices",
            str(cluster.devices),
            "--timeout-s",
            "1800",
        ],
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(cluster, name, "job"),
            "data": {"job.toml": config},
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": _meta(cluster, name, "job"),
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": _labels(cluster, "job")},
                    "spec": _pod_spec(
                        cluster, container, config_map=name, init=wait, restart="Never"
                    ),
                },
            },
        },
    ]


def render_manifests(cluster: KubernetesCluster, key: str | None) -> list[dict[str, Any]]:
    """Every object of the cluster (see the module docstring), in the order to apply
    them. ``key``: the cluster key to put in the Secret, or None to leave the Secret out
    (one made beforehand is used)."""
    out: list[dict[str, Any]] = []
    if key is not None:
        require(len(key.strip()) >= 16, "key", "<hidden>", "must hold at least 16 characters")
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": _meta(cluster, f"{cluster.name}-key", "key"),
                "stringData": {"key": key},
            }
        )
    out += _controller(cluster) + _nodes(cluster)
    if cluster.job:
        out += _job(cluster)
    return out
