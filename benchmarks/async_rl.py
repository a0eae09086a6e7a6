"""Asynchronous against synchronous RL: one pinned GRPO job on this machine's 4 CPU devices.

``python -m benchmarks.async_rl [--steps N] [--runs sync,k1-partial,...] [--refill on|off]
[--trace P] [--plot P]``

The job is pinned here (a tiny model reversing strings, 8 prompts x 8 samples per update,
the same seeds everywhere) with its response lengths following a long-tailed real log,
``../shared/traces/response-length/areal-fork-qwen2.5-0.5b-grpo-gsm8k-h200.json``
(per-step mean about 270 tokens, longest about 640): ``[trace] lengths`` with the cap at
``CAP`` tokens, so every response is generated to its own length drawn from its step's
mean and maximum (``nereus.sim.lengths``, end-of-sequence ignored until then, as
throughput benchmarks do; the reward reads the text before the first end-of-sequence).
A response's length depends on its sample index, row and step only, so every run
generates the same token counts. Runs, one after another on a fresh local cluster, once
per seed (``--seeds``, the order rotated with the seed):

- ``sync``: ``[rl] mode = "sync"`` on the planner's best sync plan (``nereus.planner.search``
  for the job at the trace's mean cap, the model-stages' layouts and placement as it
  chose them);
- ``k1-partial``, ``k1-whole``, ``k2-partial``, ``k2-whole``: ``mode = "async"`` with
  ``max_staleness`` 1 or 2 and ``partial_rollout`` on or off, on the planner's best async
  split (``nereus.planner.async_cost.search_async``), with ``[rl] refill`` as ``--refill``
  says (``on``: continuous batching; ``off``, the job's default: a request runs until
  its longest row ends).

Devices: ``cluster.cores_per_device = 0.45`` when the job config has that field (a
kernel-enforced CPU quota per device); otherwise the devices share the machine's cores
and the output says so. Each run's wall time is its step loop's (start-up excluded);
trained samples per second = rollouts trained / that wall time; mean update seconds =
wall / updates; a configuration's figures are the means over its seeds. ``reward_gap``:
mean reward over the last quarter of trained samples, sync minus the best async (each
averaged over the seeds), in units of the sync runs' per-sample reward standard
deviation over that quarter (pooled from each step's mean and std). Each async run also
reports ``decode_calls_per_entry``, ``refilled_entries`` and ``generation_busy_s`` (the
generation EMUs' seconds in decode calls, summed). Last line: one JSON object with
``speedup_vs_sync`` (best async samples/s over sync), ``max_staleness_seen`` and
``max_staleness`` (of that run), ``reward_gap``, ``samples_discarded`` (all async runs),
and every run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nereus.config import from_dict
from nereus.job.config import ClusterConfig, JobConfig, from_planner_plan
from nereus.job.local_stages import prepare_model
from nereus.job.loop import RLJob
from nereus.job.workload import job_workload
from nereus.planner import LengthStats, search
from nereus.planner._probe import local_cpu_cluster_probed, local_cpu_efficiency
from nereus.planner.async_cost import search_async

TRACE = Path("../shared/traces/response-length/areal-fork-qwen2.5-0.5b-grpo-gsm8k-h200.json")
CAP = 64
CORES_PER_DEVICE = 0.45
RUNS = ("sync", "k1-partial", "k1-whole", "k2-partial", "k2-whole")


def has_cores_field() -> bool:
    return any(f.name == "cores_per_device" for f in dataclasses.fields(ClusterConfig))


def base_config(steps: int, out_dir: str, trace: Path) -> dict[str, Any]:
    cluster: dict[str, Any] = {"mode": "local", "devices": 4, "memory_per_device": "256MiB"}
    if has_cores_field():
        cluster["cores_per_device"] = CORES_PER_DEVICE
    return {
        "model": {
            "kind": "tiny",
            "hidden_size": 64,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 4,
            "intermediate_size": 128,
            "max_seq_len": 96,
        },
        "task": {
            "name": "reverse",
            "options": {"letters": "abc", "min_len": 2, "max_len": 3},
            "dataset_size": 8192,
        },
        "algorithm": {"name": "grpo", "prompts_per_step": 8, "samples_per_prompt": 8},
        "sampling": {"max_new_tokens": CAP, "temperature": 1.0},
        "trace": {"lengths": str(trace)},
        "optim": {"lr": 3e-3, "micro_batch_size": 16},
        "cluster": cluster,
        "run": {
            "steps": steps,
            "seed": 0,
            "out_dir": out_dir,
            "progress": False,
            "checkpoint_every": steps,
        },
    }


def placement(sp: Any) -> dict[str, Any]:
    return {
        "devices": [d for emu in sp.devices for d in emu],
        "tp": sp.tp,
        "pp": sp.pp,
        "dp": sp.dp,
        "recompute": sp.recompute,
        "waves": sp.waves,
    }


def planned(
    data: dict[str, Any], out: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(best sync plan, best async plan, what the planner predicted) for the job ``data``."""
    probe = from_dict(
        JobConfig,
        {
            **data,
            "plan": {"policy_generation": {"devices": [0]}, "policy_training": {"devices": [0]}},
        },
    )
    job = RLJob(probe)
    model_config, _, _ = prepare_model(job.cfg, job.codec, out)
    lengths = job.cfg.sampling.lengths
    assert lengths is not None  # the job has a length trace
    steps = job.cfg.run.steps
    mean = statistics.fmean(lengths.mean_at(s) for s in range(steps))
    longest = max(job.cfg.sampling.cap_at(s) for s in range(steps))
    work = job_workload(
        job.cfg,
        model_config,
        prompt_length=job.max_prompt_tokens(),
        lengths=LengthStats(mean, float(longest), longest),
    )
    # priced on the devices the runs use: each one's CPU limit where it has one
    cluster = local_cpu_cluster_probed(
        4, probe.cluster.memory_bytes, device_cores=probe.cluster.device_cores
    )
    eff = local_cpu_efficiency()
    best_sync = search(work, cluster, eff, alternatives=False)
    best_async = search_async(work, cluster, eff)
    sync_plan = {n: placement(sp) for n, sp in from_planner_plan(best_sync.plan)}
    async_plan = {n: placement(sp) for n, sp in from_planner_plan(best_async.plan)}
    predicted = {
        "sync_step_s": round(best_sync.step_seconds, 4),
        "async_step_s": round(best_async.step_seconds, 4),
        "async_generation_devices": best_async.generation_devices,
    }
    return sync_plan, async_plan, predicted


def device_cpu(job: RLJob) -> dict[int, tuple[float, float]]:
    """Each capped device's (cores, CPU seconds the kernel accounted to its worker so far);
    empty on shared cores."""
    cluster = job.stages.cluster
    out: dict[int, tuple[float, float]] = {}
    for d in cluster.devices:
        cores, used = cluster.cores_of(d.index), cluster.cpu_seconds(d.index)
        if cores is not None and used is not None:
            out[d.index] = (cores, used)
    return out


def capacity_figures(
    before: dict[int, tuple[float, float]],
    after: dict[int, tuple[float, float]],
    wall: float,
    samples: int,
) -> dict[str, Any]:
    """What the devices' quotas allowed against what the run used (kernel accounting):
    ``capacity_used`` = CPU seconds used / (cores x wall) over the devices;
    ``cpu_s_per_sample``; ``capacity_bound_samples_per_s`` = the devices' cores / the
    run's CPU seconds per sample, the rate this run's work per sample reaches with every
    device busy for its whole quota (no layout or overlap does that work faster)."""
    both = [d for d in after if d in before]
    if not both or samples <= 0 or wall <= 0:
        return {}
    used = {d: after[d][1] - before[d][1] for d in both}
    cores = sum(after[d][0] for d in both)
    per_sample = sum(used.values()) / samples
    return {
        "device_cpu_s": {str(d): round(u, 3) for d, u in sorted(used.items())},
        "capacity_used": round(sum(used.values()) / (cores * wall), 4),
        "cpu_s_per_sample": round(per_sample, 6),
        "capacity_bound_samples_per_s": round(cores / per_sample, 3) if per_sample > 0 else None,
    }


async def run_one(
    name: str,
    data: dict[str, Any],
    plan: dict[str, Any],
    decode_steps: int | None = None,
    refill: bool = False,
) -> dict[str, Any]:
    rl_mode: dict[str, Any] = {"mode": "sync"}
    if name != "sync":
        k, how = name.split("-")
        rl_mode = {
            "mode": "async",
            "max_staleness": int(k[1:]),
            "partial_rollout": how == "partial",
            "refill": refill,
            **({} if decode_steps is None else {"decode_steps_per_call": decode_steps}),
        }
    cfg = from_dict(JobConfig, {**data, "plan": plan, "rl": rl_mode})
    job = RLJob(cfg)
    await job.start()
    stamps: list[float] = []

    async def stamp(_job: RLJob, _record: dict[str, Any]) -> None:
        stamps.append(time.perf_counter())

    job.boundary_hooks.append(stamp)
    cpu0 = device_cpu(job)
    driver0 = time.process_time()
    t0 = time.perf_counter()
    try:
        records = await job._loop()
        wall = time.perf_counter() - t0
        cpu1 = device_cpu(job)
        driver_cpu = time.process_time() - driver0
        summary = job.async_run.summary if job.async_run is not None else {}
        entries = len(job.async_run.ledger.trained) if job.async_run is not None else 0
    finally:
        await job.close()
    samples = [r["rollouts"] for r in records]
    out = {
        "run": name,
        "plan": plan,
        "updates": len(records),
        "wall_s": round(wall, 3),
        "samples_per_s": round(sum(samples) / wall, 3),
        "mean_update_s": round(wall / len(records), 4),
        "reward": [round(r["reward_mean"], 4) for r in records],
        "reward_std": [round(r["reward_std"], 4) for r in records],
        "samples": samples,
        "wall_at": [round(t - t0, 3) for t in stamps],
        "response_len_mean": round(statistics.fmean(r["response_len_mean"] for r in records), 2),
        "driver_cpu_s": round(driver_cpu, 3),
        **capacity_figures(cpu0, cpu1, wall, sum(samples)),
    }
    if summary:
        out.update(
            {
                k: summary[k]
                for k in (
                    "staleness_histogram",
                    "max_staleness_seen",
                    "samples_discarded",
                    "regenerated_groups",
                    "decode_calls",
                    "refilled_entries",
                )
            }
        )
        out["decode_calls_per_entry"] = round(summary["decode_calls"] / max(1, entries), 3)
        # seconds the generation EMUs spent in decode calls (each EMU's, summed)
        out["generation_busy_s"] = round(
            sum(records[-1].get("generation_busy_seconds", {}).values()), 3
        )
        out["max_staleness"] = cfg.rl.max_staleness
        out["importance_weight_mean"] = round(
            statistics.fmean(r.get("importance_weight_mean", 1.0) for r in records), 4
        )
        out["behaviour_kl"] = round(
            statistics.fmean(r.get("behaviour_kl", 0.0) for r in records), 5
        )
    return out


def last_quarter(run: dict[str, Any]) -> tuple[float, float]:
    """Mean reward and per-sample std over the last quarter of the run's samples."""
    n = len(run["reward"])
    part = range(n - max(1, n // 4), n)
    w = [run["samples"][i] for i in part]
    means = [run["reward"][i] for i in part]
    mean = sum(m * c for m, c in zip(means, w, strict=True)) / sum(w)
    var = sum(
        c * (s**2 + (m - mean) ** 2)
        for m, s, c in zip(means, [run["reward_std"][i] for i in part], w, strict=True)
    ) / sum(w)
    return mean, math.sqrt(var)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        cum = [sum(r["samples"][: i + 1]) for i in range(len(r["samples"]))]
        a.plot(cum, r["reward"], label=r["run"])
        b.plot(r["wall_at"][: len(r["reward"])], r["reward"][: len(r["wall_at"])], label=r["run"])
    a.set_xlabel("trained samples"), a.set_ylabel("reward (mean per update)")
    b.set_xlabel("wall seconds"), b.set_ylabel("reward (mean per update)")
    a.legend(), b.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _mean_curve(curves: list[list[float]]) -> list[float]:
    n = min(len(c) for c in curves)
    return [round(statistics.fmean(c[i] for c in curves), 4) for i in range(n)]


def combine(name: str, seeded: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its seeds: means of the rates and of the reward curves,
    summed histograms and counts, and each seed's own figures."""
    out: dict[str, Any] = {
        "run": name,
        "plan": seeded[0]["plan"],
        "seeds": [r["seed"] for r in seeded],
        "samples_per_s": round(statistics.fmean(r["samples_per_s"] for r in seeded), 3),
        "samples_per_s_by_seed": [r["samples_per_s"] for r in seeded],
        "mean_update_s": round(statistics.fmean(r["mean_update_s"] for r in seeded), 4),
        "reward": _mean_curve([r["reward"] for r in seeded]),
        "samples": seeded[0]["samples"][: min(len(r["samples"]) for r in seeded)],
        "wall_at": _mean_curve([r["wall_at"] for r in seeded]),
        "last_quarter_by_seed": [round(last_quarter(r)[0], 4) for r in seeded],
        "response_len_mean": round(statistics.fmean(r["response_len_mean"] for r in seeded), 2),
        "driver_cpu_s": round(statistics.fmean(r["driver_cpu_s"] for r in seeded), 3),
    }
    for key in ("capacity_used", "cpu_s_per_sample", "capacity_bound_samples_per_s"):
        if all(r.get(key) is not None for r in seeded):
            out[key] = round(statistics.fmean(r[key] for r in seeded), 6)
    if "staleness_histogram" in seeded[0]:
        hist: dict[str, int] = {}
        for r in seeded:
            for k, v in r["staleness_histogram"].items():
                hist[k] = hist.get(k, 0) + v
        out.update(
            {
                "staleness_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
                "max_staleness_seen": max(r["max_staleness_seen"] for r in seeded),
                "max_staleness": seeded[0]["max_staleness"],
                "samples_discarded": sum(r["samples_discarded"] for r in seeded),
                "regenerated_groups": sum(r["regenerated_groups"] for r in seeded),
                "refilled_entries": sum(r["refilled_entries"] for r in seeded),
                "decode_calls_per_entry": round(
                    statistics.fmean(r["decode_calls_per_entry"] for r in seeded), 3
                ),
                "generation_busy_s": round(
                    statistics.fmean(r["generation_busy_s"] for r in seeded), 3
                ),
                "importance_weight_mean": round(
                    statistics.fmean(r["importance_weight_mean"] for r in seeded), 4
                ),
                "behaviour_kl": round(statistics.fmean(r["behaviour_kl"] for r in seeded), 5),
            }
        )
    return out


def reward_gap(sync: list[dict[str, Any]], best: list[dict[str, Any]]) -> float:
    """Sync's last-quarter reward minus the async run's, both averaged over the seeds, in
    units of sync's per-sample reward standard deviation over its last quarters."""
    s = [last_quarter(r) for r in sync]
    a = [last_quarter(r) for r in best]
    std = math.sqrt(statistics.fmean(sd**2 for _, sd in s))
    gap = statistics.fmean(m for m, _ in s) - statistics.fmean(m for m, _ in a)
    return round(gap / max(std, 1e-9), 3)


async def main_async(
    steps: int,
    names: list[str],
    trace: Path,
    plot_path: Path,
    seeds: list[int],
    decode_steps: int | None = None,
    refill: bool = False,
) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="nereus-bench-async-")
    by_name: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        data = base_config(steps, out, trace)
        sync_plan, async_plan, predicted = planned(data, f"{out}/probe")
        print(f"lengths: {trace.name}, cap {CAP} tokens, a length drawn per response", flush=True)
        cores = (
            f"cores_per_device = {CORES_PER_DEVICE:.2f}"
            if has_cores_field()
            else "shared cores (this tree has no cluster.cores_per_device)"
        )
        print(f"devices: {cores}; seeds {seeds}", flush=True)
        print(
            f"planner: best sync plan {sync_plan}; best async plan {async_plan}; {predicted}",
            flush=True,
        )
        for i, seed in enumerate(seeds):
            # the order rotates with the seed, so no configuration always runs first
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                d = {
                    **data,
                    "run": {**data["run"], "seed": seed, "out_dir": f"{out}/{name}-{seed}"},
                }
                plan = sync_plan if name == "sync" else async_plan
                r = await run_one(name, d, plan, decode_steps, refill)
                r["seed"] = seed
                by_name[name].append(r)
                brief = {
                    k: v
                    for k, v in r.items()
                    if k not in ("reward", "reward_std", "samples", "wall_at", "plan")
                }
                print(f"{name} seed {seed}: {json.dumps(brief)}", flush=True)
        runs = [combine(n, by_name[n]) for n in names]
        plot(runs, plot_path)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    sync = next((r for r in runs if r["run"] == "sync"), None)
    asyncs = [r for r in runs if r["run"] != "sync"]
    result: dict[str, Any] = {
        "steps": steps,
        "seeds": seeds,
        "decode_steps_per_call": decode_steps,
        "refill": refill,
        "trace": str(trace),
        "cap": CAP,
        "predicted": predicted,
        "cores_per_device": CORES_PER_DEVICE if has_cores_field() else None,
        "plot": str(plot_path),
    }
    if asyncs:
        best = max(asyncs, key=lambda r: r["samples_per_s"])
        result.update(
            {
                "best_async": best["run"],
                "max_staleness_seen": best["max_staleness_seen"],
                "max_staleness": best["max_staleness"],
                "samples_discarded": sum(r["samples_discarded"] for r in asyncs),
            }
        )
        if sync is not None:
            result["speedup_vs_sync"] = round(best["samples_per_s"] / sync["samples_per_s"], 3)
            result["reward_gap"] = reward_gap(by_name["sync"], by_name[best["run"]])
            bounds = [
                r["capacity_bound_samples_per_s"]
                for r in asyncs
                if r.get("capacity_bound_samples_per_s")
            ]
            if bounds and sync.get("capacity_used") is not None:
                # the most any async run's work per sample allows on these quotas, over
                # what sync measured: what no split or overlap of that work can pass
                result["capacity_bound_speedup"] = round(max(bounds) / sync["samples_per_s"], 3)
                result["sync_capacity_used"] = sync["capacity_used"]
    result["runs"] = [{k: v for k, v in r.items() if k != "wall_at"} for r in runs]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="updates per run (default 80)")
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"which runs, comma-separated (default {','.join(RUNS)})",
    )
    parser.add_argument(
        "--trace", type=Path, default=TRACE, help="response-length JSON (default %(default)s)"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path("runs/async_rl.png"),
        help="reward plot (default %(default)s)",
    )
    parser.add_argument(
        "--decode-steps-per-call",
        type=int,
        default=None,
        help="rl.decode_steps_per_call of the async runs (default: the job's default)",
    )
    parser.add_argument(
        "--refill",
        choices=("on", "off"),
        default="off",
        help="rl.refill of the async runs: continuous batching on or off (default off, "
        "the job's default)",
    )
    parser.add_argument(
        "--seeds",
        default="0,1,2",
        help="run seeds, comma-separated; every configuration runs once per seed and its "
        "figures are the means (default %(default)s)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"--runs={args.runs!r} names {unknown}; choose from {list(RUNS)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r} must be comma-separated integers")
    if not seeds:
        parser.error("--seeds must name at least one seed")
    result = asyncio.run(
        main_async(
            args.steps,
            names,
            args.trace,
            args.plot,
            seeds,
            args.decode_steps_per_call,
            args.refill == "on",
        )
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
