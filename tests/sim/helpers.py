"""Small generated scenarios for the simulator's tests: a 4-node cluster of 4 devices,
llama-1b under PPO, a spot-like trace and a growth length trace, all from a seed. The toy
job's steps take seconds, not minutes, so its ground truth restarts in 30-60 s instead of
the paper's 696-981 s (``small_params``): losses, pauses and restarts all happen within a
run of a few dozen steps."""

from __future__ import annotations

import copy

from nereus.planner import ClusterSpec, LengthStats, Workload, model_preset
from nereus.sim import (
    GroundTruth,
    Scenario,
    SpotTrace,
    TruthParams,
    cap_schedule,
    length_trace,
    load_truth_params,
)

GiB = 2**30

# A 16-instance count per tick (one instance = one device here), with drops, a zero and
# rises, so pools shrink mid-step, empty and grow again.
COUNTS = [16, 16, 12, 16, 8, 8, 16, 16, 0, 16, 12, 16] * 20


def small_cluster(memory_gib: float = 14.0, nodes: int = 4) -> ClusterSpec:
    return ClusterSpec("sim-test", nodes, 4, int(memory_gib * GiB), 312e12, 2.0e12, 300e9, 25e9)


def small_work() -> Workload:
    return Workload.for_models(
        "ppo",
        model_preset("llama-1b"),
        prompts_per_step=32,
        samples_per_prompt=4,
        prompt_length=256,
        lengths=LengthStats(200, 200, 200),
    )


def small_params() -> TruthParams:
    """The project's ground truth with restarts scaled to the toy job (module docstring)."""
    params = load_truth_params()
    tables = copy.deepcopy(params.tables)
    tables["restart"]["points"] = [[4, 30.0], [16, 60.0]]
    return TruthParams(tables, params.sources)


def small_scenario(
    *,
    memory_gib: float = 14.0,
    steps: int = 24,
    seed: int = 3,
    counts: list[int] | None = None,
    gap_s: float = 60.0,
    lengths: str = "growth:200:3000",
    caps: str | None = None,
) -> Scenario:
    """``caps``: a cap schedule of the length trace (``stepped``, ``fixed``); None: one
    cap of 8,192 tokens."""
    cluster = small_cluster(memory_gib)
    work = small_work()
    devices = SpotTrace(counts if counts is not None else COUNTS, gap_s, cluster, 1.0, seed=seed)
    trace = length_trace(lengths, steps)
    schedule = cap_schedule(caps, trace) if caps else None
    truth = GroundTruth(
        small_params(),
        cluster,
        work,
        max_length=None if schedule else 8192,
        caps=schedule,
        seed=seed,
    )
    return Scenario(cluster, work, devices, trace, steps, truth)
