"""Adaptive against fixed layouts: one RL job, three ways, on this machine's 4 CPU devices.

``python -m benchmarks.adaptive [--steps N] [--rounds R]``

The job is pinned here: the demo's GRPO job (``examples/demo_adaptive.toml``: a tiny
model, 11.5 MiB per device, generation and training starting at DP 2 on devices 0-1)
with its length cap growing 16 -> 32 -> 64 tokens over ``steps`` (the cap doubles at one
third and at two thirds of the run), the same seeds in every run. It runs

1. **adaptive**: ``[adapt] enabled``, starting from the demo's layout; the controller
   moves when its triggers fire and admission says so;
2. **static at the starting layout**: the same job with ``[adapt] enabled = false``; the
   starting layout cannot hold the last cap, so this one is expected to stop with
   ``OutOfMemory`` (reported with the step);
3. **static at the best fixed layout in hindsight**: the five plans the planner predicts
   fastest among those that fit the final cap (every placement, TP/PP/DP, training
   recompute and generation waves: enumerated over ``stage_candidates`` and priced by
   ``explain``, the planner's own model), each run as a fixed layout; the fastest one
   that completes every step is the baseline.

A run's mean step time is its loop's wall time over its steps, so boundaries, decisions
and transitions count. ``transition_share`` is the adaptive run's measured transition
seconds over its wall time. The runs share the machine one after another, in ``R``
rounds (default 3): each round runs the adaptive job and every candidate once, the order
rotated from round to round (the same layout measures up to 15% apart from one run to
the next on this machine); every figure is the median over the rounds, and the best
fixed layout is the candidate with the lowest median.

Last line: one JSON object with ``adaptive_mean_step_s``, ``static_initial_failed``,
``static_initial_fail_step``, ``best_static_mean_step_s``, ``ratio_vs_best_static``,
``transition_share``, ``memory_failures`` and the details of every run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project runs on 3.10 too
    import tomli as tomllib

from benchmarks.measure_plans import valid_plans
from nereus.config import from_dict
from nereus.errors import OutOfMemory, RemoteError
from nereus.job.config import JobConfig, from_planner_plan
from nereus.job.loop import RLJob
from nereus.job.workload import job_workload
from nereus.planner import (
    LengthStats,
    Plan,
    StagePlan,
    local_cpu_cluster_probed,
    local_cpu_efficiency,
)

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo_adaptive.toml"
TOP = 5


def job_config(
    steps: int, out_dir: str, *, adapt: bool, plan: dict[str, Any] | None = None
) -> JobConfig:
    """The pinned job: the demo's, with the cap doubling at 1/3 and 2/3 of ``steps``."""
    data = tomllib.loads(CONFIG.read_text())
    data = copy.deepcopy(data)
    data["sampling"]["max_new_tokens"] = [[0, 16], [steps // 3, 32], [2 * steps // 3, 64]]
    data["adapt"]["enabled"] = adapt
    data["run"].update(steps=steps, out_dir=out_dir, progress=False, checkpoint_every=steps)
    if plan is not None:
        data["plan"] = plan
    return from_dict(JobConfig, data)


def placement(sp: StagePlan) -> dict[str, Any]:
    return {
        "devices": [d for emu in sp.devices for d in emu],
        "tp": sp.tp,
        "pp": sp.pp,
        "dp": sp.dp,
        "recompute": sp.recompute,
        "waves": sp.waves,
    }


def fastest_fixed_plans(
    cfg: JobConfig, model_config: Any, prompt_length: int, top: int = TOP
) -> list[tuple[float, Plan]]:
    """The ``top`` plans the planner predicts fastest among those that fit the last cap:
    every split of the 4 devices into a shared pool or two disjoint ones, every layout and
    variant each model-stage admits there, priced by ``explain``."""
    cap = max(c for _, c in cfg.sampling.max_new_tokens)
    at_cap = LengthStats(float(cap), float(cap), cap)
    work = job_workload(cfg, model_config, prompt_length=prompt_length, lengths=at_cap)
    devices = cfg.cluster.devices
    cluster = local_cpu_cluster_probed(
        devices, cfg.cluster.memory_bytes, headroom=cfg.adapt.headroom
    )
    return valid_plans(work, cluster, local_cpu_efficiency())[:top]


async def run_job(cfg: JobConfig, after_start: Any = None) -> dict[str, Any]:
    """Run ``cfg`` to the end or to its first OutOfMemory; the loop's wall time.
    ``after_start(job)`` runs once the job has started, before its loop (not timed)."""
    job = RLJob(cfg)
    await job.start()
    if after_start is not None:
        after_start(job)
    t0 = time.perf_counter()
    failed_at = None
    records: list[dict[str, Any]] = []
    try:
        try:
            records = await job._loop()
        except (OutOfMemory, RemoteError) as e:
            if isinstance(e, RemoteError) and e.remote_type != "OutOfMemory":
                raise
            failed_at = job.step
        wall = time.perf_counter() - t0
        changes = job.adapter.changes if job.adapter is not None else []
    finally:
        await job.close()
    steps = cfg.run.steps
    transition_s = sum(c.measured_seconds for c in changes)
    return {
        "plan": cfg.job_plan().to_dict(),
        "failed_at_step": failed_at,
        "completed": failed_at is None and len(records) == steps,
        "wall_s": round(wall, 3),
        "mean_step_s": round(wall / steps, 4) if failed_at is None else None,
        "transitions": len(changes),
        "transition_s": round(transition_s, 3),
        "changes": [
            {
                "step": c.step,
                "triggers": c.triggers,
                "bytes": c.bytes,
                "predicted_s": round(c.predicted_seconds, 3),
                "measured_s": round(c.measured_seconds, 3),
            }
            for c in changes
        ],
        "reward_last": records[-1]["reward_mean"] if records else None,
    }


async def main_async(steps: int, rounds: int) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="nereus-bench-adaptive-")
    try:
        return await _runs(out, steps, rounds)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # every run's model, checkpoints and tap


async def _runs(out: str, steps: int, rounds: int) -> dict[str, Any]:
    """Every run of the benchmark under ``out`` (see the module docstring)."""
    ranked: list[tuple[float, Plan]] = []

    def rank(job: RLJob) -> None:  # the model config and prompt length, as the job sees them
        ranked.extend(fastest_fixed_plans(job.cfg, job.model_config, job.max_prompt_tokens()))
        print(
            f"fixed candidates (predicted fastest that fit the last cap): {len(ranked)}", flush=True
        )
        for s, p in ranked:
            print(f"  {s:.4f} s/step predicted: {p}", flush=True)

    static_initial = await run_job(
        job_config(steps, f"{out}/static-initial", adapt=False), after_start=rank
    )
    print("static at the starting layout:", json.dumps(static_initial), flush=True)
    # Rounds: every run once per round, the order rotated from round to round, so a slow
    # spell of the machine falls on all of them alike; each figure is the median over
    # the rounds.
    adaptive: list[dict[str, Any]] = []
    fixed: dict[int, list[dict[str, Any]]] = {}
    names = ["adaptive"] + [f"fixed-{i}" for i in range(len(ranked))]
    for rnd in range(rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            if name == "adaptive":
                r = await run_job(job_config(steps, f"{out}/r{rnd}-adaptive", adapt=True))
                adaptive.append(r)
            else:
                i = int(name.split("-")[1])
                job_plan = {n: placement(sp) for n, sp in from_planner_plan(ranked[i][1])}
                r = await run_job(
                    job_config(steps, f"{out}/r{rnd}-{name}", adapt=False, plan=job_plan)
                )
                r["predicted_step_s"] = round(ranked[i][0], 4)
                fixed.setdefault(i, []).append(r)
            print(f"round {rnd} {name}:", json.dumps(r), flush=True)
    done = {i: runs for i, runs in fixed.items() if all(r["completed"] for r in runs)}
    medians = {i: statistics.median(r["mean_step_s"] for r in runs) for i, runs in done.items()}
    best = min(medians, key=lambda i: medians[i]) if medians else None
    completed = [r for r in adaptive if r["completed"]]
    adaptive_s = (
        statistics.median(r["mean_step_s"] for r in completed)
        if len(completed) == len(adaptive)
        else None
    )
    share = statistics.median(r["transition_s"] / r["wall_s"] for r in adaptive if r["wall_s"])
    return {
        "steps": steps,
        "rounds": rounds,
        "adaptive_mean_step_s": round(adaptive_s, 4) if adaptive_s is not None else None,
        "adaptive_runs_s": [r["mean_step_s"] for r in adaptive],
        "adaptive_transitions": [r["transitions"] for r in adaptive],
        "static_initial_failed": not static_initial["completed"],
        "static_initial_fail_step": static_initial["failed_at_step"],
        "best_static_mean_step_s": round(medians[best], 4) if best is not None else None,
        "best_static_plan": fixed[best][0]["plan"] if best is not None else None,
        "ratio_vs_best_static": (
            round(adaptive_s / medians[best], 4) if best is not None and adaptive_s else None
        ),
        "transition_share": round(share, 4),
        "memory_failures": len(adaptive) - len(completed),
        "fixed_completed": len(done),
        "fixed_mean_step_s": {
            f"fixed-{i}": [r["mean_step_s"] for r in runs] for i, runs in sorted(fixed.items())
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.adaptive", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--steps", type=int, default=48, help="steps per run (the cap doubles at 1/3 and 2/3)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of each layout, interleaved; figures are medians",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(main_async(args.steps, args.rounds))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
