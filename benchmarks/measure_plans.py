"""Run given plans for a few steps each on the local cluster; measured beside predicted.

``python -m benchmarks.measure_plans --devices 4 --cap 32 --cores 0.45 --plans FILE``
``[--steps 4] [--warmup 2]``

The job is pinned: the demo's GRPO job (``examples/demo_adaptive.toml``) on ``devices``
CPU devices of ``cores`` cores each (kernel-enforced, ``cluster.cores_per_device``;
``shared`` for none), its length cap held at ``cap`` for the whole run, adaptation off,
so each run holds one plan. ``FILE`` is a JSON list of plans as ``Plan.to_dict`` writes
them (model-stage -> tp, pp, dp, devices, recompute, waves). Every plan runs
``warmup + steps`` steps in a fresh job; a run's figure is the median step time over its
last ``steps`` steps, next to the planner's prediction (``explain`` at the cap, the
probe's figures under the limit, uncalibrated).

The functions here are what ``benchmarks.optimum`` measures with: ``job_config``,
``setting_view`` (the planner's workload and cluster for a setting), ``valid_plans``
(every plan of the planner's space that fits), ``run_plan`` and ``run_plans`` (many
plans on one started job, each put in place by the job's own ``apply_plan``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project claims Python 3.10
    import tomli as tomllib

from nereus.config import from_dict
from nereus.errors import OutOfMemory, RemoteError
from nereus.job.config import JobConfig, from_planner_plan
from nereus.job.loop import RLJob
from nereus.job.workload import job_workload
from nereus.planner import ClusterSpec, Efficiency, LengthStats, Plan, StagePlan, Workload, explain
from nereus.planner._probe import local_cpu_cluster_probed, local_cpu_efficiency
from nereus.planner.candidates import stage_candidates

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo_adaptive.toml"


def job_config(
    devices: int,
    cap: int,
    cores: float | str,
    steps: int,
    out_dir: str,
    plan: Plan | None = None,
    prompts: int | None = None,
) -> JobConfig:
    """The pinned job on ``devices`` devices of ``cores``, the cap held at ``cap``
    (``prompts``: prompts per step, default the demo's 16)."""
    data = copy.deepcopy(tomllib.loads(CONFIG.read_text()))
    data["sampling"].update(max_new_tokens=cap, ignore_eos=True)  # exactly the cap: fixed work
    if prompts is not None:
        data["algorithm"]["prompts_per_step"] = prompts
    data["adapt"]["enabled"] = False
    data.pop("trace", None)  # no pool events: each run holds one plan on its devices
    data["cluster"].update(devices=devices, cores_per_device=cores)
    data["run"].update(steps=steps, out_dir=out_dir, progress=False, checkpoint_every=steps + 1)
    if plan is not None:
        data["plan"] = {n: _placement(sp) for n, sp in from_planner_plan(plan)}
    else:  # the demo's starting plan, on the devices there are
        data["plan"] = {
            n: {**p, "devices": p["devices"][:devices], "dp": min(p.get("dp", 1), devices)}
            for n, p in data["plan"].items()
        }
    return from_dict(JobConfig, data)


def _placement(sp: StagePlan) -> dict[str, Any]:
    return {
        "devices": [d for emu in sp.devices for d in emu],
        "tp": sp.tp,
        "pp": sp.pp,
        "dp": sp.dp,
        "recompute": sp.recompute,
        "waves": sp.waves,
    }


def setting_view(
    cfg: JobConfig, model_config: Any, prompt_length: int
) -> tuple[Workload, ClusterSpec]:
    """The planner's workload (lengths at the cap) and cluster for ``cfg``'s setting."""
    cap = cfg.sampling.cap_at(0)
    work = job_workload(
        cfg,
        model_config,
        prompt_length=prompt_length,
        lengths=LengthStats(float(cap), float(cap), cap),
    )
    cluster = local_cpu_cluster_probed(
        cfg.cluster.devices,
        cfg.cluster.memory_bytes,
        headroom=cfg.adapt.headroom,
        device_cores=cfg.cluster.device_cores,
    )
    return work, cluster


def prior_efficiency(cfg: JobConfig) -> Efficiency:
    cores = cfg.cluster.device_cores
    return local_cpu_efficiency(cores=min(cores) if cores else None)


def valid_plans(work: Workload, cluster: ClusterSpec, eff: Efficiency) -> list[tuple[float, Plan]]:
    """Every plan of the planner's space on this one-node cluster that fits, with its
    predicted step seconds, fastest first: the model-stages in one shared pool or one pool
    each laid back to back, every pool size, every layout and variant each model-stage
    admits there (``stage_candidates``, unpruned), kept where ``explain`` says it fits."""
    names = [s.name for s in work.stages]
    devices = cluster.num_devices
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= devices]
    layouts: list[tuple[tuple[int, ...], ...]] = [
        tuple(tuple(range(n)) for _ in names) for n in sizes
    ]
    for split in itertools.product(sizes, repeat=len(names)):
        if sum(split) <= devices:
            starts = [sum(split[:i]) for i in range(len(split))]
            layouts.append(
                tuple(tuple(range(s, s + n)) for s, n in zip(starts, split, strict=True))
            )
    seen: dict[Plan, float] = {}
    for ranges in layouts:
        options = [
            stage_candidates(work, cluster, eff, i, len(r), prune=False)
            for i, r in enumerate(ranges)
        ]
        for combo in itertools.product(*options):
            stages = []
            for name, r, c in zip(names, ranges, combo, strict=True):
                size = c.tp * c.pp
                emus = tuple(r[i * size : (i + 1) * size] for i in range(c.dp))
                stages.append(
                    (name, StagePlan(c.tp, c.pp, c.dp, emus, recompute=c.recompute, waves=c.waves))
                )
            plan = Plan(tuple(stages))
            ex = explain(plan, work, cluster, eff)
            if ex.fits:
                seen[plan] = ex.step_seconds
    return sorted(((s, p) for p, s in seen.items()), key=lambda sp: (sp[0], str(sp[1])))


async def run_plan(cfg: JobConfig, warmup: int, on_start: Any = None) -> dict[str, Any]:
    """Run ``cfg`` (``warmup`` + measured steps); the median step and model-stage seconds
    over the measured steps. ``on_start(job)`` runs once the job started (not timed)."""
    job = RLJob(cfg)
    await job.start()
    try:
        if on_start is not None:
            on_start(job)
        try:
            records = await job._loop()
        except (OutOfMemory, RemoteError) as e:
            if isinstance(e, RemoteError) and e.remote_type != "OutOfMemory":
                raise
            return {"completed": False, "failed_at_step": job.step}
    finally:
        await job.close()
    return _figures(records[warmup:])


async def run_plans(
    cfg: JobConfig, plans: list[Plan], warmup: int, steps: int, on_start: Any = None
) -> list[dict[str, Any]]:
    """Run every plan of ``plans`` in turn on ONE started job (one cluster, ``cfg`` with
    its plan the first of them): each is put in place by the job's own ``apply_plan`` (a
    transition at a step boundary, not timed), then runs ``warmup`` + ``steps`` steps;
    the figures are ``run_plan``'s over the measured steps. A plan that runs out of
    memory ends the job; the plans after it run on a fresh one."""
    out: list[dict[str, Any]] = []
    todo = list(plans)
    while todo:
        job = RLJob(cfg)
        await job.start()
        try:
            if on_start is not None:
                on_start(job)
                on_start = None
            fresh = True
            while todo:
                plan = todo.pop(0)
                target = from_planner_plan(plan)
                if target != job.stages.plan:
                    await job.apply_plan(target)
                records = []
                try:
                    for _ in range(warmup + steps):
                        records.append(await job.run_step())
                except (OutOfMemory, RemoteError) as e:
                    if isinstance(e, RemoteError) and e.remote_type != "OutOfMemory":
                        raise
                    out.append(
                        {"completed": False, "failed_at_step": len(records), "fresh_job": fresh}
                    )
                    break  # the job's state is gone: a fresh one for the rest
                out.append(_figures(records[warmup:]) | {"fresh_job": fresh})
                fresh = False
        finally:
            await job.close()
    return out


def _figures(measured: list[dict[str, Any]]) -> dict[str, Any]:
    stages: dict[str, list[float]] = {}
    for r in measured:
        for name, secs in r["model_stage_seconds"].items():
            stages.setdefault(name, []).append(secs)
    return {
        "completed": True,
        "step_s": statistics.median(r["step_seconds"] for r in measured),
        "steps_s": [round(r["step_seconds"], 4) for r in measured],
        "stage_s": {n: statistics.median(v) for n, v in stages.items()},
        "response_len_mean": statistics.mean(r["response_len_mean"] for r in measured),
    }


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    plans = [Plan.from_dict(p) for p in json.loads(Path(args.plans).read_text())]
    cores = args.cores if args.cores == "shared" else float(args.cores)
    out = tempfile.mkdtemp(prefix="nereus-measure-plans-")
    rows = []
    try:
        for i, plan in enumerate(plans):
            cfg = job_config(
                args.devices, args.cap, cores, args.warmup + args.steps, f"{out}/{i}", plan
            )
            view: list[Any] = []
            r = await run_plan(
                cfg,
                args.warmup,
                on_start=lambda job, view=view: view.append(
                    setting_view(job.cfg, job.model_config, job.max_prompt_tokens())
                ),
            )
            work, cluster = view[0]
            r["predicted_s"] = explain(plan, work, cluster, prior_efficiency(cfg)).step_seconds
            r["plan"] = plan.to_dict()
            rows.append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.measure_plans", description=__doc__.splitlines()[0]
    )
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--cap", type=int, default=32, help="response length cap (tokens), held")
    p.add_argument("--cores", default="0.45", help="cores per device, or 'shared'")
    p.add_argument("--plans", required=True, help="JSON list of plans (Plan.to_dict)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per plan")
    p.add_argument("--warmup", type=int, default=2, help="steps run first, not measured")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = asyncio.run(_main(args))
    for r in rows:
        if r["completed"]:
            print(
                f"{r['step_s']:.4f} s/step measured, {r['predicted_s']:.4f} predicted: {r['plan']}"
            )
        else:
            print(f"OutOfMemory at step {r['failed_at_step']}: {r['plan']}")


if __name__ == "__main__":
    main()
