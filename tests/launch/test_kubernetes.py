"""Kubernetes manifests: every rendered object validates against the Kubernetes API
schemas (kubernetes-validate, strict: an unknown field fails), the objects refer to
each other consistently, the committed manifests are what the renderer writes, and
``nereus k8s wait`` waits for real devices."""

from __future__ import annotations

import asyncio
import os
import shlex
import stat
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from nereus.actors import Controller, NodeDaemon
from nereus.cli import main as nereus_main
from nereus.errors import ConfigError
from nereus.launch.kubernetes import KubernetesCluster, render_manifests

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
JOB = REPO / "examples" / "grpo_tiny.toml"
# The oldest Kubernetes the manifests promise to fit, and the newest the schemas know.
VERSIONS = ("1.28", kubernetes_validate.latest_version())
KEY = "k" * 64

GPU = KubernetesCluster(
    image="registry.example/nereus:0.1.0",
    nodes=4,
    gpus_per_node=8,
    cpu_per_node="32",
    memory_per_node="256Gi",
)
CPU_JOB = KubernetesCluster(
    image="nereus:0.1.0",
    name="rl-a",
    namespace="team-x",
    devices_per_node=2,
    memory_per_device="256MiB",
    job=str(JOB),
    shared_claim="nereus-shared",
)


def _validate(objects: list[dict]) -> None:
    for obj in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("cluster", [GPU, CPU_JOB], ids=["with-gpus", "cpu-job"])
def test_manifests_validate_against_the_api_schemas(cluster):
    objects = render_manifests(cluster, KEY)
    _validate(objects)
    kinds = [o["kind"] for o in objects]
    assert kinds[:5] == ["Secret", "Service", "Deployment", "Service", "StatefulSet"]
    assert kinds[5:] == (["ConfigMap", "Job"] if cluster.job else [])


def test_the_validator_refuses_what_kubernetes_would():
    statefulset = next(o for o in render_manifests(GPU, None) if o["kind"] == "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8  # no such field
    with pytest.raises(kubernetes_validate.ValidationError, match="gpus"):
        kubernetes_validate.validate(statefulset, VERSIONS[-1], strict=True)


def _by(objects: list[dict], kind: str, component: str) -> dict:
    return next(
        o
        for o in objects
        if o["kind"] == kind and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    )


def _containers(obj: dict) -> list[dict]:
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_the_objects_fit_together():
    objects = render_manifests(CPU_JOB, KEY)
    assert all(o["metadata"]["namespace"] == "team-x" for o in objects)
    secret = _by(objects, "Secret", "key")
    assert secret["stringData"] == {"key": KEY}
    controller_svc, controller = (
        _by(objects, "Service", "controller"),
        _by(objects, "Deployment", "controller"),
    )
    node_svc, nodes = _by(objects, "Service", "node"), _by(objects, "StatefulSet", "node")
    config, job = _by(objects, "ConfigMap", "job"), _by(objects, "Job", "job")
    # Services select the pods of their workload; the StatefulSet names its headless Service.
    for svc, workload in ((controller_svc, controller), (node_svc, nodes)):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"] == labels == workload["spec"]["selector"]["matchLabels"]
    assert node_svc["spec"]["clusterIP"] == "None" and nodes["spec"]["serviceName"] == "rl-a-node"
    assert (
        controller["spec"]["replicas"] == 1 and controller["spec"]["strategy"]["type"] == "Recreate"
    )
    assert nodes["spec"]["replicas"] == 2
    # Every pod reaches the controller through its Service, with the key of the Secret.
    address = "tcp://rl-a-controller.team-x.svc:5555"
    ports = {p["name"]: p["port"] for p in controller_svc["spec"]["ports"]}
    assert ports == {"control": 5555, "tap": 5556}
    for workload in (controller, nodes, job):
        pod = workload["spec"]["template"]["spec"]
        key_volume = next(v for v in pod["volumes"] if v["name"] == "key")
        assert key_volume["secret"] == {"secretName": "rl-a-key", "defaultMode": 0o440}
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["fsGroup"] == 1000
        for c in _containers(workload):
            assert "/etc/nereus/key/key" in c["command"] and c["workingDir"] == "/shared"
            assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    node_cmd = _containers(nodes)[0]["command"]
    assert node_cmd[node_cmd.index("--controller") + 1] == address
    assert node_cmd[-4:] == ["--devices", "2", "--memory-per-device", "256MiB"]
    assert node_cmd[node_cmd.index("--node-id") + 1] == "$(POD_NAME)"
    # The job waits for all 4 devices, then runs the TOML of the ConfigMap against them.
    wait, run = _containers(job)
    assert wait["command"][2:5] == ["nereus.cli", "k8s", "wait"]
    assert wait["command"][wait["command"].index("--devices") + 1] == "4"
    assert run["command"][run["command"].index("--cluster-devices") + 1] == "4"
    assert run["command"][run["command"].index("--connect") + 1] == address
    assert config["data"]["job.toml"] == JOB.read_text()
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_gpus_are_requested_per_pod():
    nodes = _by(render_manifests(GPU, None), "StatefulSet", "node")
    node = _containers(nodes)[0]
    assert node["resources"] == {
        "requests": {"cpu": "32", "memory": "256Gi"},
        "limits": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": 8},
    }
    assert node["command"][-2:] == ["--gpus", "all"]
    assert GPU.devices == 32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"image": ""}, "image='' must name a container image"),
        (
            {"gpus_per_node": 1, "devices_per_node": 1},
            "gpus_per_node=1 and devices_per_node=1 must be exactly one",
        ),
        ({"devices_per_node": 0}, "gpus_per_node=0 and devices_per_node=0"),
        ({"name": "Nereus_1"}, "name='Nereus_1' must be a DNS label"),
        ({"cpu_per_node": "eight"}, "cpu_per_node='eight' must be a Kubernetes quantity"),
        ({"tap_port": 5555}, "tap_port=5555 must differ from controller_port"),
        ({"run_as_user": 0}, "run_as_user=0 must be a user id >= 1"),
        (
            {"job": str(JOB)},
            "shared_claim='' must name a ReadWriteMany PersistentVolumeClaim when job is given",
        ),
    ],
)
def test_bad_clusters_are_refused_by_field(kwargs, message):
    base = {"image": "nereus:1", "devices_per_node": 1}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        KubernetesCluster(**{**base, **kwargs})
    with pytest.raises(ConfigError, match="key=.* at least 16"):
        render_manifests(KubernetesCluster(**base), "short")


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_committed_manifests_are_what_the_renderer_writes(path, tmp_path, monkeypatch):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# Rendered by: nereus k8s render ")
    argv = shlex.split(first.removeprefix("# Rendered by: nereus "))
    monkeypatch.chdir(REPO)  # the header's paths are relative to the repository
    out = tmp_path / path.name
    assert nereus_main([*argv, "-o", str(out)]) == 0
    assert out.read_text() == path.read_text(), f"re-render {path} with its first line"
    _validate(list(yaml.safe_load_all(path.read_text())))


def test_the_render_command(tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    out = tmp_path / "c.yaml"
    out.write_text("")
    out.chmod(0o644)
    assert (
        nereus_main(
            [
                "k8s",
                "render",
                "--image",
                "i:1",
                "--devices-per-node",
                "1",
                "--key-file",
                str(key_file),
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # it holds the key now
    secret = next(yaml.safe_load_all(out.read_text()))
    assert secret["kind"] == "Secret" and secret["stringData"]["key"] == KEY
    assert nereus_main(["k8s", "render", "--image", "i:1", "--devices-per-node", "1"]) == 0
    fresh = [d for d in yaml.safe_load_all(capsys.readouterr().out)][0]
    assert fresh["kind"] == "Secret" and len(fresh["stringData"]["key"]) == 64
    assert nereus_main(["k8s", "render", "--image", "i:1", "--gpus-per-node", "0"]) == 2
    assert "gpus_per_node=0 and devices_per_node=0" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_wait_returns_once_the_devices_are_ready(tmp_path, capsys):
    key = KEY.encode()
    key_file = tmp_path / "key"
    key_file.write_bytes(key)
    controller = await Controller(key).start()
    node = NodeDaemon(controller.address, key, devices=1, memory_per_device="64MiB")
    argv = [
        "k8s",
        "wait",
        "--controller",
        controller.address,
        "--key-file",
        str(key_file),
        "--devices",
        "1",
    ]
    try:
        assert await asyncio.to_thread(nereus_main, [*argv, "--timeout-s", "1"]) == 1
        assert "has 0 ready devices; waited 1.0 s for 1" in capsys.readouterr().err
        waiting = asyncio.ensure_future(
            asyncio.to_thread(nereus_main, [*argv, "--timeout-s", "60"])
        )
        await node.start()
        assert await waiting == 0
        assert f"1 devices ready at {controller.address}" in capsys.readouterr().out
    finally:
        await node.stop()
        await controller.close()
    assert os.path.exists(key_file)
