"""``nereus k8s ...``: run nereus clusters on Kubernetes.

    nereus k8s render --image registry/nereus:0.1.0 --nodes 4 --gpus-per-node 8 | kubectl apply -f -
    nereus k8s render --image IMG --devices-per-node 2 --job job.toml --shared-claim data -o c.yaml
    nereus k8s wait --controller tcp://nereus-controller.default.svc:5555 --key-file KEY --devices 8

``render`` prints the manifests (``nereus.launch.kubernetes``) as YAML. The Secret holds
a fresh random key unless ``--key-file`` gives one or ``--no-secret`` leaves it out (a
Secret made beforehand is used); a file written with ``-o`` that holds a key is
readable by its owner only. ``wait`` returns once the controller at ``--controller``
has ``--devices`` ready devices (status 0), or says why not by ``--timeout-s``
(status 1): the Job's init container. A bad flag is one line naming it (status 2).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import shlex
import sys

from nereus.errors import ConfigError, NereusError, exit_status
from nereus.launch._yaml import dump_all
from nereus.launch.kubernetes import KubernetesCluster, render_manifests

__all__ = ["main"]

_HELP = {
    "image": "container image with nereus installed (required)",
    "name": "prefix of every object's name",
    "namespace": "namespace of every object",
    "nodes": "node daemon pods",
    "gpus_per_node": "GPUs (nvidia.com/gpu) per node pod",
    "devices_per_node": "CPU devices per node pod (without GPUs)",
    "memory_per_device": "budget per device, e.g. 16GiB (CPU default 1GiB; GPU: its memory)",
    "cpu_per_node": "CPU request and limit of each node pod, e.g. 8",
    "memory_per_node": "memory request and limit of each node pod, e.g. 64Gi",
    "shm_size": "size of each pod's memory-backed /dev/shm",
    "controller_port": "controller port",
    "tap_port": "monitoring tap port",
    "heartbeat_timeout_s": "declare a silent node pod lost after this long",
    "run_as_user": "user and group id the containers run as",
    "python": "the image's Python with nereus",
    "job": "RL job TOML to run on the cluster as a Job (needs --shared-claim)",
    "shared_claim": "ReadWriteMany PersistentVolumeClaim mounted at /shared in every pod",
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="nereus k8s", description="Run nereus clusters (and RL jobs) on Kubernetes."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="print the manifests of a cluster (and its job)")
    for f in dataclasses.fields(KubernetesCluster):
        flag = "--" + f.name.replace("_", "-")
        if f.default is dataclasses.MISSING:
            render.add_argument(flag, required=True, help=_HELP[f.name])
        else:
            render.add_argument(
                flag,
                type=type(f.default),
                default=f.default,
                help=f"{_HELP[f.name]} (default {f.default!r})",
            )
    keys = render.add_mutually_exclusive_group()
    keys.add_argument("--key-file", help="put this file's key in the Secret (default: a fresh one)")
    keys.add_argument(
        "--no-secret",
        action="store_true",
        help="leave the Secret out: `kubectl create secret generic NAME-key "
        "--from-file=key=FILE` made it",
    )
    render.add_argument("-o", "--out", default="-", help="file to write (default: stdout)")
    wait = sub.add_parser("wait", help="wait until a controller has this many ready devices")
    wait.add_argument("--controller", required=True, help="tcp://HOST:PORT of the controller")
    wait.add_argument("--key-file", required=True)
    wait.add_argument("--devices", type=int, required=True)
    wait.add_argument("--timeout-s", type=float, default=600.0)
    return ap


def _render(args: argparse.Namespace) -> int:
    cluster = KubernetesCluster(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(KubernetesCluster)}
    )
    if args.no_secret:
        key = None
    elif args.key_file:
        try:
            with open(args.key_file) as fh:
                key = fh.read().strip()
        except OSError as e:
            raise ConfigError(f"key_file={args.key_file!r} cannot be read: {e.strerror}") from None
    else:
        key = secrets.token_hex(32)
    text = _header(cluster, args) + dump_all(render_manifests(cluster, key))
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    mode = 0o600 if key is not None else 0o644
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)  # an existing file keeps its mode through O_CREAT: set it
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return 0


def _header(cluster: KubernetesCluster, args: argparse.Namespace) -> str:
    """Comments: the command that renders these manifests again, and whether they hold
    the key."""
    flags = []
    for f in dataclasses.fields(KubernetesCluster):
        value = getattr(cluster, f.name)
        if value != f.default:
            flags += ["--" + f.name.replace("_", "-"), str(value)]
    if args.no_secret:
        return (
            f"# Rendered by: nereus k8s render {shlex.join(flags)} --no-secret\n"
            f"# Needs the Secret {cluster.name}-key (kubectl create secret generic "
            f"{cluster.name}-key --from-file=key=FILE).\n"
        )
    return (
        f"# Rendered by: nereus k8s render {shlex.join(flags)}\n"
        "# Holds the cluster key (the Secret): keep this file private.\n"
    )


async def _wait(args: argparse.Namespace) -> int:
    from nereus.actors import Cluster

    if args.devices < 1:
        raise ConfigError(f"devices={args.devices!r} must be >= 1")
    async with Cluster.connect(
        args.controller, key_file=args.key_file, min_devices=args.devices, timeout_s=args.timeout_s
    ) as cluster:
        print(f"{len(cluster.devices)} devices ready at {args.controller}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)

    def command() -> int:
        return _render(args) if args.command == "render" else asyncio.run(_wait(args))

    return exit_status(f"nereus k8s {args.command}", command, failure=(NereusError,))
