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
slower of 8B and 70B at each size, in CPU milliseconds of this one thread: on a shared
machine the wall clock also counts time spent waiting for a core), the same as wall
milliseconds (search_wall_ms_*), per-model figures, peak_mb, brute_force_agrees.
A search that proves no plan fits reports its time and a step of inf.
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
    return Workload.for_models(
        "ppo",
        model_preset(model),
        prompts_per_step=256,
        samples_per_prompt=4,
        prompt_length=512,
        lengths=LengthStats(2048, 3686, 4096),
        micro_batch=1,
    )


CLUSTERS = {32: ("h200-64", 4), 256: ("a100-256", None), 1024: ("mi250x-1024", None)}


def _search_step(work: Workload, cluster: ClusterSpec) -> float:
    """Predicted step seconds of the best plan, or inf when the search proves none fits."""
    try:
        return search(work, cluster, alternatives=False).step_seconds
    except InfeasiblePlan:
        return float("inf")


def _time_search(
    work: Workload, cluster: ClusterSpec, reps: int
) -> tuple[list[float], list[float], float]:
    """(CPU ms per search, wall ms per search, predicted step seconds)."""
    step = _search_step(work, cluster)  # warm-up
    cpu, wall = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        _search_step(work, cluster)
        cpu.append((time.process_time() - c) * 1000)
        wall.append((time.perf_counter() - t) * 1000)
    return cpu, wall, step


def _brute_force_check() -> dict[str, float | bool]:
    from tests.planner._brute import brute_force

    model = ModelShape("bench-1layer", 4096, 1, 32, 8, 32000, 11008)
    work = Workload.for_models(
        "ppo",
        model,
        prompts_per_step=2,
        samples_per_prompt=2,
        prompt_length=256,
        lengths=LengthStats(1024, 1843, 2048),
    )
    cluster = ClusterSpec(
        "bench-2x4", 2, 4, 3 * 2**30, 100e12, 1.5e12, 300e9, 25e9, workspace_bytes=2**28
    )
    t = time.perf_counter()
    want, _, count = brute_force(work, cluster, CONSERVATIVE)
    brute_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    got = search(work, cluster, alternatives=False)
    search_ms = (time.perf_counter() - t) * 1000
    return {
        "brute_force_ms_8": brute_ms,
        "brute_force_plans_8": count,
        "search_ms_8": search_ms,
        "brute_force_agrees": abs(got.step_seconds - want) <= 1e-9 * want,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    out: dict[str, float | bool | int] = {}
    print(
        f"{'devices':>7} {'model':>9} {'cpu ms':>8} {'min-max':>15} {'wall ms':>8} "
        f"{'min-max':>15} {'step s':>9}"
        "   (1 thread, pure Python)"
    )
    for devices, (name, nodes) in CLUSTERS.items():
        cluster = cluster_preset(name, nodes)
        worst_cpu = worst_wall = 0.0
        for model in ("llama-8b", "llama-70b"):
            cpu, wall, step = _time_search(_work(model), cluster, args.reps)
            med_cpu, med_wall = statistics.median(cpu), statistics.median(wall)
            worst_cpu, worst_wall = max(worst_cpu, med_cpu), max(worst_wall, med_wall)
            tag = model.split("-")[1]
            out[f"search_ms_{devices}_{tag}"] = round(med_cpu, 2)
            out[f"search_wall_ms_{devices}_{tag}"] = round(med_wall, 2)
            print(
                f"{devices:>7} {model:>9} {med_cpu:>8.2f} {min(cpu):>7.2f}-{max(cpu):<7.2f} "
                f"{med_wall:>8.2f} "
                f"{min(wall):>7.2f}-{max(wall):<7.2f} {step:>9.2f}"
            )
        out[f"search_ms_{devices}"] = round(worst_cpu, 2)
        out[f"search_wall_ms_{devices}"] = round(worst_wall, 2)
    tracemalloc.start()
    for model in ("llama-8b", "llama-70b"):
        _search_step(_work(model), cluster_preset("mi250x-1024"))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out["peak_mb"] = round(peak / 2**20, 2)
    check = _brute_force_check()
    print(
        f"brute force (8 devices, PPO, 6 model-stages): {check['brute_force_plans_8']} layout "
        "choices in "
        f"{check['brute_force_ms_8']:.0f} ms; search {check['search_ms_8']:.2f} ms; agree: "
        f"{check['brute_force_agrees']}"
    )
    out.update({k: (round(v, 2) if isinstance(v, float) else v) for k, v in check.items()})
    out["threads"] = 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
