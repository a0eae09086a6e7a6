"""``nereus slurm ...``: start nereus clusters under Slurm.

    nereus slurm script --nodes 4 --gpus-per-task 8 --job job.toml -o job.sbatch
    sbatch job.sbatch                       # or: nereus slurm script ... | sbatch
    nereus slurm run --devices-per-task 2   # inside an allocation: what the script runs
    nereus slurm node ...                   # each task of the node step (run by srun)

``script`` prints the batch script (``nereus.launch.slurm.render_sbatch``); ``run``
starts the controller, the node daemons and the job in the allocation it runs in and
stops them all when the job ends or the allocation is cancelled
(``nereus.launch._slurm_driver``); ``node`` is one node daemon of that allocation.
A bad flag is one line naming it, and the command exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from nereus.errors import NereusError, exit_status
from nereus.launch.slurm import SbatchOptions, add_cluster_args, cluster_from_args, render_sbatch

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="nereus slurm", description="Start nereus clusters (and RL jobs) under Slurm."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    script = sub.add_parser("script", help="print the sbatch script of a cluster (and its job)")
    add_cluster_args(script)
    script.add_argument("--nodes", type=int, default=1, help="nodes to allocate")
    script.add_argument("--job-name", default="nereus")
    script.add_argument("--partition", default="")
    script.add_argument("--account", default="")
    script.add_argument("--time", default="", help="time limit, e.g. 04:00:00")
    script.add_argument(
        "--cpus-per-task",
        type=int,
        default=0,
        help="CPUs for each node daemon (0: Slurm's default)",
    )
    script.add_argument("--output", default="nereus-%j.out", help="the job's output file")
    script.add_argument(
        "--python",
        default=sys.executable,
        help="the Python with nereus that every node runs (default: this one)",
    )
    script.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="one more #SBATCH option, e.g. --sbatch=--constraint=a100",
    )
    script.add_argument("-o", "--out", default="-", help="file to write (default: stdout)")
    run = sub.add_parser("run", help="inside an allocation: start the cluster (and the job)")
    add_cluster_args(run)
    node = sub.add_parser("node", help="one node daemon of the allocation (what srun runs)")
    node.add_argument("--controller", required=True)
    node.add_argument("--key-file", required=True)
    devices = node.add_mutually_exclusive_group(required=True)
    devices.add_argument("--devices", type=int, help="CPU devices of this daemon")
    devices.add_argument("--gpus", help="'all': every GPU Slurm gave this task")
    node.add_argument("--memory-per-device", default="")
    node.add_argument("--heartbeat-s", type=float, default=0.5)
    node.add_argument("--start-timeout-s", type=float, default=300.0)
    return ap


def _script(args: argparse.Namespace) -> int:
    cluster = cluster_from_args(args)
    options = SbatchOptions(
        nodes=args.nodes,
        job_name=args.job_name,
        partition=args.partition,
        account=args.account,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        output=args.output,
        python=args.python,
        extra=tuple(args.sbatch),
    )
    text = render_sbatch(cluster, options)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


def _run(args: argparse.Namespace) -> int:
    from nereus.launch._slurm_driver import run_cluster
    from nereus.launch._slurm_env import SlurmTask

    cluster = cluster_from_args(args).with_absolute_paths()
    task = SlurmTask.from_environ()
    return asyncio.run(run_cluster(cluster, task))


def _node(args: argparse.Namespace) -> int:
    from nereus.launch._slurm_driver import node_main

    device_argv = (
        ["--devices", str(args.devices)] if args.devices is not None else ["--gpus", args.gpus]
    )
    if args.memory_per_device:
        device_argv += ["--memory-per-device", args.memory_per_device]
    node_main(
        args.controller,
        args.key_file,
        device_argv,
        heartbeat_s=args.heartbeat_s,
        start_timeout_s=args.start_timeout_s,
    )
    return 0  # not reached: node_main execs the daemon


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s slurm %(name)s %(levelname)s %(message)s"
    )
    command = {"script": _script, "run": _run, "node": _node}[args.command]
    return exit_status(
        f"nereus slurm {args.command}", lambda: command(args), failure=(NereusError,)
    )
