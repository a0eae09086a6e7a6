"""`make demo`: a GRPO job on 4 CPU devices that changes its own layout while it runs.

Each device is a fixed amount of compute, as a GPU is: its worker process runs under a
kernel-enforced CPU limit (``[cluster] cores_per_device``, 0.45 of a core). So a device
that leaves takes its compute with it and one that joins brings some: whether the job
takes a returning device up is the planner's payback test to decide. Where limits
cannot be set here (not root and no delegated cgroup) the demo says so on its first
line and in its summary, and runs on shared cores.

Runs examples/demo_adaptive.toml (a tiny model learning to reverse strings) with the
controller loop on (``[adapt] enabled``). Nothing in this script tells the job what to
change or when: the job's length cap grows on the config's schedule, and the device
pool follows a real spot-availability trace (``[trace] pool``, ``nereus.job.traces``):
at the trace's ticks the environment drains devices (``Cluster.drain``: the job must
empty them at the next boundary, then they stop) and adds fresh ones
(``Cluster.add_node``), as a spot market would.

What the job decides, it decides from its own triggers (memory predicted at the next
cap, length drift, the pool) and the planner's admission rule. The summary lists every
plan change (step, trigger, from -> to, predicted and measured seconds, bytes moved);
``runs/demo/plot.png`` marks them; ``runs/demo/tap.jsonl`` holds every tap event
(``decision``, ``transition``, ``transition_node``, ...) next to ``metrics.jsonl``.

``python -m examples.demo --async`` runs examples/demo_async.toml instead: the same task
in asynchronous mode (generation and training at once, a staleness bound, partial
rollouts), the planner moving devices between generation and training at weight syncs
as the length cap grows; the summary adds the staleness histogram.

``python -m examples.demo --no-adapt`` runs the same job on its starting layout: it
stops with OutOfMemory when the cap first exceeds what that layout holds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from nereus.actors import check_cpu_limits
from nereus.errors import ConfigError, OutOfMemory, RemoteError
from nereus.job.cli import parse_job
from nereus.job.loop import RLJob
from nereus.job.workload import PredictedFailure, predict_memory_failure

CONFIG = Path(__file__).with_name("demo_adaptive.toml")
ASYNC_CONFIG = Path(__file__).with_name("demo_async.toml")
log = logging.getLogger("examples.demo")


async def run(job: RLJob, predicted: list[PredictedFailure | None]) -> list[dict[str, Any]]:
    """Start the job, say where its starting plan is predicted to run out of memory (when
    it does not adapt), run it to the end."""
    await job.start()
    try:
        cfg = job.cfg
        p = predict_memory_failure(
            cfg,
            job.model_config,
            cfg.job_plan(),
            prompt_length=job.max_prompt_tokens(),
            budget_bytes=cfg.cluster.memory_bytes,
            devices=cfg.cluster.devices,
        )
        predicted.append(p)
        if p is not None:
            log.info(
                "the starting plan is predicted to run out of memory at step %d (cap %d: "
                "device %d needs %d "
                "of %d bytes)%s",
                p.step,
                p.cap,
                p.device,
                p.need_bytes,
                p.budget_bytes,
                "; the controller loop will move before that" if cfg.adapt.enabled else "",
            )
        return await job._loop()
    finally:
        await job.close()


def capacity_line(cfg: Any) -> tuple[Any, str]:
    """The config to run (on shared cores where limits cannot be set here) and what the
    demo says about its devices' compute."""
    cores = cfg.cluster.device_cores
    if cores is None or cfg.cluster.mode != "local":
        return cfg, 'devices share this machine\'s cores (cluster.cores_per_device = "shared")'
    try:
        where = check_cpu_limits()
    except ConfigError as e:
        shared = dataclasses.replace(
            cfg, cluster=dataclasses.replace(cfg.cluster, cores_per_device="shared")
        )
        return shared, (
            f"CPU LIMITS COULD NOT BE SET, running on shared cores instead of "
            f"{cfg.cluster.cores_per_device} cores per device: {e}"
        )
    return cfg, f"each device is capped at {cfg.cluster.cores_per_device} CPU cores ({where})"


def pool_trace_line(cfg: Any) -> tuple[Any, str | None]:
    """The config to run and what the demo says when its pool trace is not on this
    machine (the traces lie in ../shared beside the repository; never copied into it):
    the job then runs without pool events, and the first lines say so."""
    pool = cfg.trace.pool
    if pool is None or pool.startswith("growth:") or Path(pool).is_file():
        return cfg, None
    bare = dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, pool=None))
    return bare, (
        f"THE POOL TRACE {pool!r} IS NOT ON THIS MACHINE (run from the repository root with "
        "../shared/traces beside it): running without device-pool events"
    )


def _dp(plan: dict[str, Any] | None) -> str:
    return ", ".join(f"{name} DP{sp['dp']}" for name, sp in sorted((plan or {}).items()))


def describe_pool_change(decisions: list[dict[str, Any]], at: int, word: str) -> str:
    """What the job decided when the pool changed at step ``at`` (``word``: "joined" or
    "drained"): the first decision from then on with that trigger, its payback against
    its limit (a drained device skips the test: it must go), DP before and after."""
    for d in decisions:
        hit = any(t["kind"] == "device-pool" and word in t.get("text", "") for t in d["triggers"])
        if d["step"] < at or not hit:
            continue
        after = d["target_plan"] if d["admitted"] and d["target_plan"] else d["current_plan"]
        payback = "n/a" if d["payback_steps"] is None else f"{d['payback_steps']:.2f}"
        limit = "n/a" if d["limit_steps"] is None else f"{d['limit_steps']:.1f}"
        return (
            f"step {d['step']}: payback {payback} steps against a limit of {limit} -> "
            f"{'admitted' if d['admitted'] else 'turned down'} ({d['reason']}); "
            f"before: {_dp(d['current_plan'])}; after: {_dp(after)}"
        )
    return f"no decision on devices {word} was recorded"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--async",
        dest="is_async",
        action="store_true",
        help="asynchronous RL (examples/demo_async.toml): generation and training at once",
    )
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in (
        "nereus.actors",
        "nereus.transfer",
        "nereus.engines",
        "nereus.controller",
        "nereus.node",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = parse_job([str(ASYNC_CONFIG if args.is_async else CONFIG), *rest])
    except ConfigError as e:
        print(f"demo: config error: {e}", file=sys.stderr)
        return 2
    cfg, capacity = capacity_line(cfg)
    print(f"demo: {capacity}", flush=True)
    cfg, missing = pool_trace_line(cfg)
    if missing is not None:
        print(f"demo: {missing}", flush=True)
    job = RLJob(cfg)
    predicted: list[PredictedFailure | None] = []
    try:
        records = asyncio.run(run(job, predicted))
    except (OutOfMemory, RemoteError) as e:
        if isinstance(e, RemoteError) and e.remote_type != "OutOfMemory":
            raise
        p = predicted[0] if predicted else None
        said = (
            f"the planner predicted step {p.step} (cap {p.cap}: device {p.device} needs "
            f"{p.need_bytes} "
            f"bytes of {p.budget_bytes})"
            if p
            else "the planner predicted no failure"
        )
        print(
            f"demo: the job stopped with OutOfMemory at step {job.step}; {said}: {e}",
            file=sys.stderr,
        )
        return 1
    changes = [r["transition"] for r in records if r.get("transition")]
    if args.is_async and job.async_run is not None:
        s = job.async_run.summary
        print(
            f"async: staleness histogram (tokens per versions behind) {s['staleness_histogram']}, "
            f"max {s['max_staleness_seen']} of {cfg.rl.max_staleness}; samples discarded "
            f"{s['samples_discarded']}; generation/training split changes: "
            f"{[c['generation_devices'] for c in changes]}"
        )
    print(
        f"done: {len(records)} steps, reward {records[0]['reward_mean']:.3f} -> "
        f"{records[-1]['reward_mean']:.3f}, "
        f"{len(changes)} plan changes; {cfg.run.out_dir}/metrics.jsonl, tap.jsonl, plot.png"
    )
    print(f"devices: {capacity}")
    if missing is not None:
        print(f"pool: {missing}")
    decisions = job.adapter.decisions if job.adapter is not None else []
    events = job.pool_trace.events if job.pool_trace is not None else []
    for step, kind, devices in events:
        word = "drained" if kind == "drain" else "joined"
        print(
            f"pool trace, step {step}: devices {devices} {word}: "
            f"{describe_pool_change(decisions, step, word)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
