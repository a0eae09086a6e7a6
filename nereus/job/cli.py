"""``nereus run CONFIG.toml``: run an RL job from its TOML config.

Options override the file (``--steps``, ``--out``, ``--seed``, ``--resume``,
``--in-process``, ``--no-progress``, ``--adapt``/``--no-adapt``). ``--connect ADDRESS`` (with
``--key-file`` and ``--cluster-devices``) attaches the job to a running cluster whatever the file's
``[cluster]`` says: a launcher that started the cluster (``nereus slurm run``, a
Kubernetes Job) knows its address only then. A config error is printed as one line
naming the field, the value and the rule, and the command exits with status 2; nothing
runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from nereus.config import load_toml
from nereus.errors import ConfigError, exit_status
from nereus.job.config import JobConfig
from nereus.job.loop import run_job

__all__ = ["main", "parse_job"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nereus run", description="Run an RL job (GRPO, PPO, ReMax) from a TOML config."
    )
    p.add_argument("config", help="the job's TOML file, e.g. examples/grpo_tiny.toml")
    p.add_argument("--steps", type=int, help="override run.steps")
    p.add_argument("--out", help="override run.out_dir")
    p.add_argument("--seed", type=int, help="override run.seed")
    p.add_argument(
        "--resume",
        action="store_true",
        help="resume from the newest checkpoint in the output folder",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every model-stage in this process (no workers)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="log steps instead of drawing a progress bar"
    )
    adapt = p.add_mutually_exclusive_group()
    adapt.add_argument(
        "--adapt",
        dest="adapt",
        action="store_true",
        default=None,
        help="change the plan while the job runs (adapt.enabled = true)",
    )
    adapt.add_argument(
        "--no-adapt",
        dest="adapt",
        action="store_false",
        help="keep the starting plan to the end (adapt.enabled = false)",
    )
    p.add_argument(
        "--connect",
        metavar="ADDRESS",
        help="attach to the running cluster at this controller address (cluster.mode = 'connect')",
    )
    p.add_argument("--key-file", help="override cluster.key_file (the running cluster's key)")
    p.add_argument(
        "--cluster-devices",
        type=int,
        help="override cluster.devices (how many devices to wait for)",
    )
    return p


def parse_job(argv: list[str]) -> JobConfig:
    """The JobConfig of ``argv`` (file plus overrides); raises ConfigError."""
    args = _parser().parse_args(argv)
    cfg = load_toml(JobConfig, args.config)
    run = cfg.run
    run = dataclasses.replace(
        run,
        steps=args.steps if args.steps is not None else run.steps,
        out_dir=args.out or run.out_dir,
        seed=args.seed if args.seed is not None else run.seed,
        resume=run.resume or args.resume,
        progress=run.progress and not args.no_progress,
    )
    if args.adapt is not None:
        cfg = dataclasses.replace(cfg, adapt=dataclasses.replace(cfg.adapt, enabled=args.adapt))
    cluster = cfg.cluster
    if args.connect is not None or args.key_file is not None or args.cluster_devices is not None:
        if args.in_process:
            raise ConfigError(
                "--in-process cannot be combined with --connect, --key-file or --cluster-devices"
            )
        if args.connect is not None:
            cluster = dataclasses.replace(cluster, mode="connect", address=args.connect)
        if args.key_file is not None:
            cluster = dataclasses.replace(cluster, key_file=args.key_file)
        if args.cluster_devices is not None:
            cluster = dataclasses.replace(cluster, devices=args.cluster_devices)
    if args.in_process:
        cluster = dataclasses.replace(cluster, mode="in_process")
        # One engine per model-stage in-process: keep each stage's first device only.
        plan = {
            k: dataclasses.replace(p, devices=p.devices[:1], tp=1, pp=1, dp=1)
            for k, p in cfg.plan.items()
        }
        adapt = dataclasses.replace(cfg.adapt, enabled=False)
        return dataclasses.replace(cfg, run=run, cluster=cluster, plan=plan, adapt=adapt)
    return dataclasses.replace(cfg, run=run, cluster=cluster)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return exit_status("nereus run: config error", lambda: _run(parse_job(argv)))


def _run(cfg: JobConfig) -> int:
    records = asyncio.run(run_job(cfg))
    if records:
        last = records[-1]
        print(
            f"done: {last['step'] + 1} steps, last reward {last['reward_mean']:.3f}; metrics "
            f"in {cfg.run.out_dir}/metrics.jsonl, plot in {cfg.run.out_dir}/plot.png"
        )
    return 0
