"""Planner search time at 32, 256 and 1,024 devices for PPO with four models (8B and 70B).

    .venv/bin/python -m benchmarks.planner [--reps 5]

Side by side in one run: the exact search (``nereus.planner.search``) on each cluster,
and, as the reference it must agree with, brute-force enumeration of the same plan
space on an 8-device PPO instance (all six model-stages; brute force cannot reach 32
devices with six model-stages in reasonable time). Both run in this one process, one
thread (pure Python). Warm-up first, then ``--reps`` repetitions; median and spread
(min-max). Peak memory of a 1,024-device search is measured with tracemalloc in a
separate run (tracemalloc slows the search down, so it is not timed).

The last line is one JSON object: search_ms_32, search_ms_256, search_ms_1024 (the
slower of 8B and 70B at each size), per-model figures, peak_mb, brute_force_agrees.
Four 70B models do not fit 32 devices of 141 GB under the memory model (no ZeRO: each
training model-stage holds 18 bytes per parameter over its tp x pp shards, and the KV
cache of 1,024 sequences at 4,608 tokens is 1.5 TB); the 32-device 70B figure is the
time the search takes to prove that, and its step is printed as inf.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

from nereus.errors import InfeasiblePlan
from nereus.planner import (
    CONSERVATIVE,
    ClusterSpec,
    LengthStats,
    ModelShape,
    Workload,
    cluster_preset,
    model_preset,
    search,
)


def _work(model: str) -> Workload:
    return Workload.for_models("ppo", model_preset(model), prompts_per_step=256, samples_per_prompt=4, prompt_length=512,
                               lengths=LengthStats(2048, 3686, 4096), micro_batch=1)


CLUSTERS = {32: ("h200-64", 4), 256: ("a100-256", None), 1024: ("mi250x-1024", None)}


def _search_step(work: Workload, cluster: ClusterSpec) -> float:
    """Predicted step seconds of the best plan, or inf when the search proves none fits."""
    try:
        return search(work, cluster, alternatives=False).step_seconds
    except InfeasiblePlan:
        return float("inf")


def _time_search(work: Workload, cluster: ClusterSpec, reps: int) -> tuple[list[float], float]:
    step = _search_step(work, cluster)  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        _search_step(work, cluster)
        times.append((time.perf_counter() - t) * 1000)
    return times, step


def _brute_force_check() -> dict[str, float | bool]:
    from tests.planner._brute import brute_force

    model = ModelShape("bench-1layer", 4096, 1, 32, 8, 32000, 11008)
    work = Workload.for_models("ppo", model, prompts_per_step=4, samples_per_prompt=4, prompt_length=256,
                               lengths=LengthStats(1024, 1843, 2048))
    cluster = ClusterSpec("bench-2x4", 2, 4, 3 * 2**30, 100e12, 1.5e12, 300e9, 25e9, workspace_bytes=2**28)
    t = time.perf_counter()
    want, _, count = brute_force(work, cluster, CONSERVATIVE)
    brute_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    got = search(work, cluster, alternatives=False)
    search_ms = (time.perf_counter() - t) * 1000
    return {"brute_force_ms_8": brute_ms, "brute_force_plans_8": count, "search_ms_8": search_ms,
            "brute_force_agrees": abs(got.step_seconds - want) <= 1e-9 * want}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    out: dict[str, float | bool | int] = {}
    print(f"{'devices':>7} {'model':>9} {'median ms':>10} {'min-max ms':>16} {'step s':>9}   (1 thread, pure Python)")
    for devices, (name, nodes) in CLUSTERS.items():
        cluster = cluster_preset(name, nodes)
        worst = 0.0
        for model in ("llama-8b", "llama-70b"):
            times, step = _time_search(_work(model), cluster, args.reps)
            med = statistics.median(times)
            worst = max(worst, med)
            tag = model.split("-")[1]
            out[f"search_ms_{devices}_{tag}"] = round(med, 2)
            print(f"{devices:>7} {model:>9} {med:>10.2f} {min(times):>7.2f}-{max(times):<8.2f} {step:>9.2f}")
        out[f"search_ms_{devices}"] = round(worst, 2)
    tracemalloc.start()
    for model in ("llama-8b", "llama-70b"):
        _search_step(_work(model), cluster_preset("mi250x-1024"))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out["peak_mb"] = round(peak / 2**20, 2)
    check = _brute_force_check()
    print(f"brute force (8 devices, PPO, 6 model-stages): {check['brute_force_plans_8']} layout choices in "
          f"{check['brute_force_ms_8']:.0f} ms; search {check['search_ms_8']:.2f} ms; agree: {check['brute_force_agrees']}")
    out.update({k: (round(v, 2) if isinstance(v, float) else v) for k, v in check.items()})
    out["threads"] = 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
