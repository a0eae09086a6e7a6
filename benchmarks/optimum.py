"""The planner's pick against the measured optimum, on devices of a fixed CPU capacity.

``python -m benchmarks.optimum [--settings 16x2,32x2,64x2,16x4,32x4,64x4] [--cores 0.45]``
``[--prompts 8] [--steps 2] [--warmup 1] [--rounds 3] [--calibration 24x2,48x2,24x4,48x4]``
``[--calibration-plans 3] [--top 20] [--random 5] [--seed 0]``

The job is pinned: the demo's GRPO model (``examples/demo_adaptive.toml``: a tiny model,
11.5 MiB per device) at ``--prompts`` prompts of 8 samples per step, each device capped
at ``--cores`` cores by the kernel, generation running to exactly the length cap
(``ignore_eos``), adaptation off. A setting is ``CAPxDEVICES``. A *run* of a plan is
``warmup`` + ``steps`` steps under it; the runs of one setting in one round share one
started job (one cluster): each plan is put in place by the job's own ``apply_plan``
(a transition at a step boundary, not timed), so a run costs its steps, not a cluster.

1. **Calibration, on other runs**: at the ``--calibration`` settings (caps and device
   counts the benchmark does not measure), the demo's starting plan and
   ``--calibration-plans`` plans drawn at random from each setting's valid plans run
   once each; every model-stage's measured seconds fit the cost model's efficiency per
   operation class (``Calibrator``, from the probe's priors under the limit, weighed
   against them as the live job does), and the step's time outside the model-stages
   (weight sync, rewards, the step loop: step seconds less the model-stages' seconds)
   is one constant, its median over those runs. Nothing measured later changes them.
2. **Measurement**: at every setting, every valid plan of the planner's space (the
   model-stages in one pool or apart, every pool size, layout, recompute and decode
   waves that fit; or, where more than ``top + random``, the ``top`` it predicts fastest
   plus ``random`` drawn from the rest, said in the output), each run once per round,
   in ``rounds`` rounds with the order rotated; a plan's figure is the median over
   rounds of its runs' median step time. The planner's pick is ``search`` with the
   calibrated factors (added to the list if the list lacks it).

Per setting: the measured best, the pick, the gap (pick over best, minus 1). Last line:
one JSON object with ``settings``, ``plans_measured``, ``exact_share``,
``within_5pct_share``, ``median_gap``, ``p95_gap``, ``prediction_mape`` (over every
measured plan, with the factors fitted in step 1 only) and the details (each row has
every model-stage's predicted and measured seconds). Two diagnostics beside them, not
targets: ``in_sample_mape``, the same error with the factors fitted to the measured
plans' own model-stage seconds (what no calibration of this cost model can beat on these
devices: the error left is the model's form), and ``repeat_spread``, a run's mean
distance from its plan's median (the measurement's own noise); ``host_gauge_s``, a
fixed loop timed in this process before each job, shows the host's speed drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.measure_plans import (
    job_config,
    prior_efficiency,
    run_plans,
    setting_view,
    valid_plans,
)
from nereus.job.config import JobConfig, to_planner_plan
from nereus.planner import Calibrator, Efficiency, Plan, explain, search


def parse_settings(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        cap, _, devices = item.strip().partition("x")
        out.append((int(cap), int(devices)))
    return out


class Context:
    """What every run of the benchmark shares: the model as the job sees it."""

    def __init__(self, out: str, cores: float | str, steps: int, warmup: int, prompts: int) -> None:
        self.out, self.cores, self.steps, self.warmup = out, cores, steps, warmup
        self.prompts = prompts
        self.model_config: Any = None
        self.prompt_length = 0
        self.jobs = 0
        self.jobs_started = 0
        self.gauge: list[float] = []  # host_gauge() before each job's runs

    def host_gauge(self) -> None:
        """Seconds of a fixed pure-Python loop here (best of 3): the host's speed now."""
        best = float("inf")
        for _ in range(3):
            t, x = time.perf_counter(), 0
            for i in range(200_000):
                x += i * i
            best = min(best, time.perf_counter() - t)
        self.gauge.append(round(best, 4))

    def config(self, cap: int, devices: int, plan: Plan | None) -> JobConfig:
        self.jobs += 1
        return job_config(
            devices, cap, self.cores, 10**6, f"{self.out}/job{self.jobs}", plan, self.prompts
        )

    def view(self, cfg: JobConfig) -> tuple[Any, Any]:
        return setting_view(cfg, self.model_config, self.prompt_length)

    async def run(self, cap: int, devices: int, plans: list[Plan | None]) -> list[dict[str, Any]]:
        """Each of ``plans`` (None: the demo's starting plan) in turn on one started job
        (``run_plans``: the job's own ``apply_plan`` between them)."""
        self.host_gauge()
        start = self.config(cap, devices, None)
        named = [p or to_planner_plan(start.job_plan()) for p in plans]
        cfg = self.config(cap, devices, named[0])

        def learn(job: Any) -> None:
            self.model_config, self.prompt_length = job.model_config, job.max_prompt_tokens()

        got = await run_plans(
            cfg,
            named,
            self.warmup,
            self.steps,
            on_start=learn if self.model_config is None else None,
        )
        self.jobs_started += sum(1 for r in got if r.get("fresh_job"))
        for r, plan in zip(got, named, strict=True):
            r["plan"] = plan.to_dict()
            r["cfg"] = cfg
        return got


def _observe_plan(
    cal: Calibrator,
    plan: dict[str, Any],
    view: tuple[Any, Any],
    prior: Efficiency,
    seconds_of: Callable[[str], float | None],
) -> None:
    """Every model-stage of ``plan`` (on ``view``: workload, cluster) with its measured
    seconds (``seconds_of`` its planner name) into ``cal``."""
    for st in explain(Plan.from_dict(plan), *view, prior).stages:
        seconds = seconds_of(st.name)
        if seconds:
            cal.observe_stage(st.cost, seconds)


def _observe(cal: Calibrator, r: dict[str, Any], ctx: Context, prior: Efficiency) -> None:
    stage_s = r["stage_s"]  # under the job's names
    _observe_plan(
        cal, r["plan"], ctx.view(r["cfg"]), prior, lambda n: stage_s.get(n.replace("-", "_"))
    )


async def calibrate(
    ctx: Context, settings: list[tuple[int, int]], per_setting: int, rng: random.Random
) -> tuple[Efficiency, float, list[dict[str, Any]]]:
    """Efficiency factors and the step overhead from runs at ``settings`` (see step 1)."""
    runs: list[dict[str, Any]] = []
    for k, (cap, devices) in enumerate(settings):
        if k == 0 or ctx.model_config is None:  # the starting plan first: it learns the model
            runs += await ctx.run(cap, devices, [None])
            print(f"calibration {cap}x{devices}: {_brief(runs[-1])}", flush=True)
        prior = prior_efficiency(runs[0]["cfg"])
        work, cluster = ctx.view(ctx.config(cap, devices, None))
        plans = [p for _, p in valid_plans(work, cluster, prior)]
        chosen: list[Plan | None] = list(rng.sample(plans, min(per_setting, len(plans))))
        for r in await ctx.run(cap, devices, chosen):
            runs.append(r)
            print(f"calibration {cap}x{devices}: {_brief(r)}", flush=True)
    prior = prior_efficiency(runs[0]["cfg"])
    done = [r for r in runs if r["completed"]]
    cal = Calibrator(prior=prior, prior_weight=0.05)
    for r in done:
        _observe(cal, r, ctx, prior)
    eff = cal.fit()
    # measured directly, not as the model's residual: the step's seconds beyond its
    # model-stages' (generation and training are dependency phases: they add up)
    rest = [r["step_s"] - sum(r["stage_s"].values()) for r in done]
    overhead = max(0.0, statistics.median(rest)) if rest else 0.0
    return eff, overhead, runs


def _brief(r: dict[str, Any]) -> str:
    if not r["completed"]:
        return f"OutOfMemory at step {r['failed_at_step']}"
    stages = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["stage_s"].items()))
    return f"{r['step_s']:.4f} s/step ({stages})"


async def measure_setting(
    ctx: Context,
    cap: int,
    devices: int,
    eff: Efficiency,
    overhead: float,
    rounds: int,
    top: int,
    extra: int,
    rng: random.Random,
) -> dict[str, Any]:
    cfg = ctx.config(cap, devices, None)
    work, cluster = ctx.view(cfg)
    ranked = valid_plans(work, cluster, eff)
    pick = search(work, cluster, eff, alternatives=False).plan
    total = len(ranked)
    if total > top + extra:
        chosen = ranked[:top] + rng.sample(ranked[top:], extra)
        how = f"{top} predicted fastest + {extra} drawn at random of {total} valid plans"
    else:
        chosen = ranked
        how = f"every valid plan ({total})"
    plans = [p for _, p in chosen]
    pick_listed = pick in plans
    if not pick_listed:
        plans.append(pick)
    print(f"setting {cap}x{devices}: {how}{'' if pick_listed else ' + the pick'}", flush=True)
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(plans))}
    order = list(range(len(plans)))
    for rnd in range(rounds):  # one job per round; every plan through its apply_plan
        shift = rnd % len(order)
        turn = order[shift:] + order[:shift]
        for i, r in zip(turn, await ctx.run(cap, devices, [plans[i] for i in turn]), strict=True):
            runs[i].append(r)
            print(f"  round {rnd} plan {i}: {_brief(r)}", flush=True)
    rows = []
    for i, plan in enumerate(plans):
        ok = [r for r in runs[i] if r["completed"]]
        predicted = explain(plan, work, cluster, eff).step_seconds + overhead
        measured = statistics.median(r["step_s"] for r in ok) if len(ok) == len(runs[i]) else None
        rows.append(
            {
                "plan": plan.to_dict(),
                "predicted_s": round(predicted, 4),
                "measured_s": round(measured, 4) if measured is not None else None,
                "runs_s": [round(r["step_s"], 4) if r["completed"] else None for r in runs[i]],
                "is_pick": plan == pick,
                # model-stage -> [predicted, measured median] seconds: where a gap comes from
                "stages": _stage_rows(plan, work, cluster, eff, ok),
            }
        )
    measured = [r for r in rows if r["measured_s"] is not None]
    best = min(measured, key=lambda r: r["measured_s"]) if measured else None
    mine = next(r for r in rows if r["is_pick"])
    gap = (
        (mine["measured_s"] / best["measured_s"] - 1)
        if best and mine["measured_s"] is not None
        else None
    )
    return {
        "setting": f"{cap}x{devices}",
        "plans": how,
        "pick_listed": pick_listed,
        "best_s": best["measured_s"] if best else None,
        "best_plan": best["plan"] if best else None,
        "pick_s": mine["measured_s"],
        "pick_plan": mine["plan"],
        "pick_predicted_s": mine["predicted_s"],
        "gap": round(gap, 4) if gap is not None else None,
        "exact": best is not None and best["plan"] == mine["plan"],
        "rows": rows,
        "_view": (work, cluster),
    }


def _stage_rows(
    plan: Plan, work: Any, cluster: Any, eff: Efficiency, ok: list[dict[str, Any]]
) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {}
    for st in explain(plan, work, cluster, eff).stages:
        got = [r["stage_s"].get(st.name.replace("-", "_")) for r in ok]
        seen = [g for g in got if g is not None]
        measured = round(statistics.median(seen), 4) if seen else None
        out[st.name] = [round(st.cost.seconds, 4), measured]
    return out


def in_sample_mape(
    results: list[dict[str, Any]], prior: Efficiency, overhead: float
) -> float | None:
    """The prediction error with the factors fitted to the measured plans themselves
    (every model-stage's median seconds, as step 1 fits its runs): a floor, not a
    prediction."""
    cal = Calibrator(prior=prior, prior_weight=0.05, window=4096)
    for r in results:
        for row in r["rows"]:
            if row["measured_s"] is not None:
                stages = row["stages"]
                _observe_plan(cal, row["plan"], r["_view"], prior, lambda n, st=stages: st[n][1])
    eff = cal.fit()
    errors = []
    for r in results:
        work, cluster = r["_view"]
        for row in r["rows"]:
            if row["measured_s"]:
                predicted = explain(Plan.from_dict(row["plan"]), work, cluster, eff).step_seconds
                errors.append(abs(predicted + overhead - row["measured_s"]) / row["measured_s"])
    return round(statistics.mean(errors), 4) if errors else None


def repeat_spread(results: list[dict[str, Any]]) -> float | None:
    """A run's mean distance from the median of its plan's runs, relative to it."""
    spread = []
    for r in results:
        for row in r["rows"]:
            runs = [x for x in row["runs_s"] if x is not None]
            if row["measured_s"] and len(runs) > 1:
                spread += [abs(x - row["measured_s"]) / row["measured_s"] for x in runs]
    return round(statistics.mean(spread), 4) if spread else None


def _p95(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = tempfile.mkdtemp(prefix="nereus-bench-optimum-")
    cores: float | str = args.cores if args.cores == "shared" else float(args.cores)
    rng = random.Random(args.seed)
    ctx = Context(out, cores, args.steps, args.warmup, args.prompts)
    try:
        eff, overhead, cal_runs = await calibrate(
            ctx, parse_settings(args.calibration), args.calibration_plans, rng
        )
        print(
            f"calibrated on {len(cal_runs)} runs: {eff}; step overhead {overhead:.4f} s", flush=True
        )
        results = []
        for cap, devices in parse_settings(args.settings):
            res = await measure_setting(
                ctx, cap, devices, eff, overhead, args.rounds, args.top, args.random, rng
            )
            print(
                f"setting {res['setting']}: best {res['best_s']} s/step, pick {res['pick_s']} "
                "s/step "
                f"(predicted {res['pick_predicted_s']}), gap {res['gap']}, exact {res['exact']}",
                flush=True,
            )
            results.append(res)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    gaps = [r["gap"] for r in results if r["gap"] is not None]
    errors = [
        abs(row["predicted_s"] - row["measured_s"]) / row["measured_s"]
        for r in results
        for row in r["rows"]
        if row["measured_s"]
    ]
    return {
        "settings": len(results),
        "plans_measured": sum(
            1 for r in results for row in r["rows"] if row["measured_s"] is not None
        ),
        "exact_share": round(sum(r["exact"] for r in results) / len(results), 4)
        if results
        else None,
        "within_5pct_share": round(sum(1 for g in gaps if g <= 0.05) / len(results), 4)
        if results
        else None,
        "median_gap": round(statistics.median(gaps), 4) if gaps else None,
        "p95_gap": round(_p95(gaps), 4) if gaps else None,
        "prediction_mape": round(statistics.mean(errors), 4) if errors else None,
        "in_sample_mape": in_sample_mape(results, prior_efficiency(cal_runs[0]["cfg"]), overhead),
        "repeat_spread": repeat_spread(results),
        "cores_per_device": cores,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "prompts_per_step": args.prompts,
        "jobs_started": ctx.jobs_started,
        "calibration_runs": len(cal_runs),
        "calibration_settings": args.calibration,
        "step_overhead_s": round(overhead, 4),
        "efficiency": eff.as_dict()
        | {
            "layer_pass_s": eff.layer_pass_s,
            "recompute_passes": eff.recompute_passes,
            "micro_batch_passes": eff.micro_batch_passes,
        },
        # the host's own speed over the run (a fixed loop in this process, no limit):
        # a drift here moves every measured step, calibration's and the settings' alike
        "host_gauge_s": ctx.gauge,
        "plan_runs": len(cal_runs) + sum(len(row["runs_s"]) for r in results for row in r["rows"]),
        "wall_s": round(time.perf_counter() - t0, 1),
        "per_setting": [
            {k: v for k, v in r.items() if k not in ("rows", "_view")} for r in results
        ],
        "rows": {r["setting"]: r["rows"] for r in results},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.optimum", description=__doc__.splitlines()[0]
    )
    p.add_argument("--settings", default="16x2,32x2,64x2,16x4,32x4,64x4", help="CAPxDEVICES,...")
    p.add_argument(
        "--calibration",
        default="24x2,48x2,24x4,48x4",
        help="CAPxDEVICES,... the calibration runs use (not measured settings)",
    )
    p.add_argument(
        "--calibration-plans", type=int, default=3, help="random plans per calibration setting"
    )
    p.add_argument("--cores", default="0.45", help="cores per device ('shared': no limit)")
    p.add_argument(
        "--prompts", type=int, default=8, help="prompts per step (8 samples each; demo: 16)"
    )
    p.add_argument("--steps", type=int, default=2, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps per run before measuring")
    p.add_argument("--rounds", type=int, default=3, help="runs of each plan, order rotated")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--random", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    overlap = set(parse_settings(args.settings)) & set(parse_settings(args.calibration))
    if overlap:
        p.error(f"--calibration must not share a setting with --settings: {sorted(overlap)}")
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
