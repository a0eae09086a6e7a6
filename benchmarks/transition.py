"""The transition DAG: build and schedule at 1,024 devices, and (parts b, c) a running job.

    .venv/bin/python -m benchmarks.transition [--reps 30] [--only-dag]

(a) ``dag_ms_1024``: a cold ``build_dag`` plus its list schedule (``scheduled``: the path
``transition_seconds`` takes, with the cluster's ``LinkModel``) of a pinned case: a PPO
job with a llama-8b-sized policy (the reference the same model, critic and reward one
value model) on the ``mi250x-1024`` preset, from the search's plan at 512 devices to its
plan at 1,024 (pinned as the search gave them when first recorded, ``PLAN_512`` and
``PLAN_1024``; relabelled onto the current devices; every model-stage changes). Each
run gets fresh inputs, as a job's boundary does: new ModelSpecs, plans, devices and link
model, made outside the timed region, and the state layer's ``param_shard`` and
``layer_bounds`` caches cleared. ``dag_ms_1024_edges``: the same, timed the same way, for
a second pinned 1,024-device case whose transition needs resource edges: on the 1,024
plan, policy-generation and policy-training swap halves of the cluster, and devices
0-511 hold ``RESIDENT_BYTES`` besides the plans' EMUs, so policy-generation's Extends
there fit only after policy-training's Destroy (generation goes first: only a resource
edge makes it wait). ``dag_ms_1024_warm``: the first case with its
inputs made once and reused by every run (the figure recorded before). One thread, pure
Python. Warm-up first, then ``--reps`` runs: median and spread (min-max) in CPU
milliseconds of this thread (on a shared machine the wall clock also counts time spent
waiting for a core; ``dag_wall_ms_1024``: the wall median). Also printed: ``nodes_1024``
(nodes of the DAG), ``emus_1024`` (EMUs of the 1,024-device plan), the primitives the
nodes stand for, the classes of alike devices, the resource edges and the estimate.

(b) ``prediction_error`` and (c) ``overlap_ratio``: transitions of a running job on
this machine's CPU workers (``benchmarks._transition_live``). (b): calibrated on
``--calibrate`` changes through one cycle of layouts, then ``--measure`` changes between
other layouts (never calibrated on) predicted and measured: the median (and 90th
percentile) of |measured - predicted| / measured over the whole change, engines' stop
and restart included (``prediction_error``, ``prediction_error_p90``), and over the
moves alone (``prediction_error_moves``). (c): generation tokens per second on devices
a transition does not touch over those without a transition (bounded by the cores on a
small machine: reported, not targeted). ``--only-dag`` runs part (a) alone.

The last line is one JSON object with the figures' keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from nereus.errors import InfeasiblePlan
from nereus.planner import (
    LengthStats,
    ModelShape,
    Plan,
    StagePlan,
    Workload,
    cluster_preset,
    model_preset,
    relabel,
    search,
)
from nereus.sim.transitions import model_spec_of
from nereus.state import DeviceSet, ModelSpec, training_slots
from nereus.state.layout import layer_bounds, param_shard
from nereus.transition import LinkModel, cluster_devices, scheduled

CLUSTER = "mi250x-1024"


@dataclass(frozen=True)
class Case:
    current: Plan
    target: Plan
    specs: dict[str, ModelSpec]
    slots: dict[str, tuple[str, ...]]
    devices: DeviceSet
    link: LinkModel
    resident: dict[int, int] | None = None


# The search's plans for the pinned workload at 512 and at 1,024 devices, as it gave them
# when the figure was first recorded: (tp, pp, dp) per model-stage, every model-stage on
# devices 0 .. n-1. Pinned as data so the figure measures the DAG, not whatever the
# search's model picks today (``search_pair_feasible`` says whether today's pair is).
PLAN_512 = {
    "policy-generation": (8, 1, 64),
    "reference-inference": (4, 1, 128),
    "critic-inference": (2, 1, 256),
    "reward-inference": (2, 1, 256),
    "policy-training": (8, 1, 64),
    "critic-training": (8, 2, 32),
}
PLAN_1024 = {
    "policy-generation": (8, 1, 128),
    "reference-inference": (2, 1, 512),
    "critic-inference": (2, 1, 512),
    "reward-inference": (1, 1, 1024),
    "policy-training": (8, 2, 64),
    "critic-training": (8, 2, 64),
}


def _workload() -> Workload:
    policy = model_preset("llama-8b")
    return Workload.for_models(
        "ppo",
        policy,
        prompts_per_step=256,
        samples_per_prompt=4,
        prompt_length=512,
        lengths=LengthStats(2048, 3686, 4096),
        micro_batch=1,
    )


def _plan(names: tuple[str, ...], shape: dict[str, tuple[int, int, int]]) -> Plan:
    return Plan(tuple((name, StagePlan.on_range(*shape[name], 0)) for name in names))


def _case(
    work: Workload,
    current: Plan,
    target: Plan,
    *,
    relabelled: bool = True,
    resident: dict[int, int] | None = None,
) -> Case:
    cluster = cluster_preset(CLUSTER)
    if relabelled:
        target = relabel(
            current, target, devices_per_node=cluster.devices_per_node, devices=cluster.num_devices
        )
    # one ModelSpec per architecture, as a job holds them: the reference is the policy's
    # model, the reward model the critic's
    specs: dict[ModelShape, ModelSpec] = {}
    for shape in work.models.values():
        specs.setdefault(shape, model_spec_of(shape))
    return Case(
        current,
        target,
        {s.name: specs[work.models[s.model]] for s in work.stages},
        {
            s.name: training_slots(work.models[s.model].dtype)
            for s in work.stages
            if s.kind == "training"
        },
        cluster_devices(cluster),
        LinkModel.of(cluster),
        resident,
    )


def pinned_case() -> Case:
    """The 512 -> 1,024 device case of part (a), made outside the timed region."""
    work = _workload()
    names = tuple(s.name for s in work.stages)
    return _case(work, _plan(names, PLAN_512), _plan(names, PLAN_1024))


# the edges case: devices 0-511 also hold this many bytes (an engine's cache kept, another
# tenant): between what policy-generation's Extends there need after policy-training's
# Destroy and what they need before it, so they wait for it
RESIDENT_BYTES = 15_000_000_000
SWAP_CURRENT = {"policy-generation": (8, 1, 64, 512), "policy-training": (8, 2, 32, 0)}
SWAP_TARGET = {"policy-generation": (8, 1, 64, 0), "policy-training": (8, 2, 32, 512)}


def edges_case() -> Case:
    """The 1,024-device case whose transition needs resource edges (see the module
    docstring), not relabelled: the swap is the point."""
    work = _workload()
    names = tuple(s.name for s in work.stages)

    def plan(moved: dict[str, tuple[int, int, int, int]]) -> Plan:
        return Plan(
            tuple((n, StagePlan.on_range(*moved.get(n, (*PLAN_1024[n], 0)))) for n in names)
        )

    return _case(
        work,
        plan(SWAP_CURRENT),
        plan(SWAP_TARGET),
        relabelled=False,
        resident={d: RESIDENT_BYTES for d in range(512)},
    )


def search_pair_feasible() -> str:
    """Whether the search's plans for the pinned workload today (at 512 and 1,024
    devices) are one transition apart within the caps, and if not, why."""
    work = _workload()
    cluster = cluster_preset(CLUSTER)
    case = _case(
        work,
        search(work, cluster, budget=512, alternatives=False).plan,
        search(work, cluster, budget=1024, alternatives=False).plan,
    )
    try:
        _build_and_schedule(case)
    except InfeasiblePlan as e:
        return f"infeasible: {e}"
    return "feasible"


def _build_and_schedule(case: Case):
    return scheduled(
        case.current,
        case.target,
        case.specs,
        case.devices,
        case.link,
        slots=case.slots,
        resident=case.resident,
    )


def _cold() -> None:
    """Empty the state layer's caches the DAG reads, so that a run starts cold."""
    param_shard.cache_clear()
    layer_bounds.cache_clear()


def _timed(
    make: Callable[[], Case], reps: int, fresh: bool
) -> tuple[list[float], list[float], Case, object, object]:
    """CPU and wall milliseconds of ``reps`` cold builds plus schedules after a warm-up;
    with ``fresh`` each run gets the inputs ``make()`` returns anew (made untimed)."""
    case = make()
    for _ in range(3):
        _cold()
        _build_and_schedule(make() if fresh else case)
    cpu, wall = [], []
    dag = schedule = None
    for _ in range(reps):
        dag = schedule = None  # the last run's DAG is freed here, before the clock starts
        if fresh:
            case = make()
        _cold()
        t, c = time.perf_counter(), time.process_time()
        dag, schedule = _build_and_schedule(case)
        cpu.append((time.process_time() - c) * 1000)
        wall.append((time.perf_counter() - t) * 1000)
    return cpu, wall, case, dag, schedule


def _spread(ms: list[float]) -> str:
    return f"median {statistics.median(ms):.3f} ms (min {min(ms):.3f}, max {max(ms):.3f})"


def dag_ms(reps: int) -> dict[str, float | int]:
    """Part (a): cold build plus schedule, ``reps`` times after a warm-up, for the pinned
    case from fresh inputs and from reused ones, and for the edges case from fresh ones."""
    cpu, wall, case, dag, schedule = _timed(pinned_case, reps, fresh=True)
    warm, _, _, _, _ = _timed(pinned_case, reps, fresh=False)
    edges, edges_wall, ecase, edag, eschedule = _timed(edges_case, reps, fresh=True)
    changed = sum(1 for name, sp in case.current if sp != case.target[name])
    print(
        f"(a) {CLUSTER}: PPO llama-8b, plan at 512 -> plan at 1,024 devices ({changed} of "
        f"{len(case.current.names)} model-stages change), {reps} runs each, CPU ms of this thread"
    )
    print(f"    fresh inputs: {_spread(cpu)}; wall {_spread(wall)}")
    print(f"    inputs reused (warm): {_spread(warm)}")
    emus = sum(sp.dp for _, sp in case.target)
    print(
        f"    {len(dag.nodes)} nodes standing for {sum(n.count for n in dag.nodes)} "
        f"primitives, {emus} EMUs at "
        f"1,024 devices ({sum(sp.dp for _, sp in case.current)} at 512), "
        f"{len(dag.classes.caps)} classes of "
        f"alike devices, {dag.resource_edges} resource edges, {dag.bytes / 1e12:.2f} TB moved, "
        f"estimate {schedule.makespan:.2f} s"
    )
    print(
        "    edges case (policy-generation and policy-training swap halves; "
        f"{RESIDENT_BYTES / 1e9:.1f} GB resident "
        f"on devices 0-511): {_spread(edges)}; wall {_spread(edges_wall)}"
    )
    print(
        f"    {len(edag.nodes)} nodes, {len(edag.classes.caps)} classes, "
        f"{edag.resource_edges} resource edges, "
        f"estimate {eschedule.makespan:.2f} s"
    )
    assert edag.resource_edges >= 1, "the edges case inserted no resource edge"
    return {
        "dag_ms_1024": round(statistics.median(cpu), 3),
        "dag_wall_ms_1024": round(statistics.median(wall), 3),
        "dag_ms_1024_warm": round(statistics.median(warm), 3),
        "dag_ms_1024_edges": round(statistics.median(edges), 3),
        "resource_edges_1024": edag.resource_edges,
        "nodes_1024": len(dag.nodes),
        "emus_1024": emus,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reps", type=int, default=30, help="timed runs of part (a) per figure, at least 20"
    )
    parser.add_argument(
        "--calibrate",
        type=int,
        default=14,
        help="part (b): transitions that teach the calibrator (two passes of the cycle)",
    )
    parser.add_argument("--skip-dag", action="store_true", help="parts (b) and (c) only")
    parser.add_argument(
        "--measure", type=int, default=12, help="part (b): transitions predicted, at least 10"
    )
    parser.add_argument(
        "--rounds", type=int, default=6, help="part (c): transitions generation overlaps"
    )
    parser.add_argument(
        "--only-dag", action="store_true", help="part (a) only (no worker processes)"
    )
    args = parser.parse_args()
    out: dict[str, object] = {}
    if not args.skip_dag:
        out.update(dag_ms(max(args.reps, 20)))
        print(f"    the search's plans today at 512 and 1,024 devices: {search_pair_feasible()}")
    if not args.only_dag:
        from benchmarks import _transition_live as live

        b = asyncio.run(
            live.prediction_error(calibrate=args.calibrate, measure=max(args.measure, 10))
        )
        print(
            f"(b) {b['transitions_measured']} transitions between held-out layouts predicted after "
            f"{args.calibrate} calibrated on others: whole change (engine restarts in) median "
            "error "
            f"{b['prediction_error']:.3f}, p90 {b['prediction_error_p90']:.3f}, max "
            f"{b['prediction_error_max']:.3f}; "
            f"moves alone median {b['prediction_error_moves']:.3f}, p90 "
            f"{b['prediction_error_moves_p90']:.3f}"
        )
        print(
            f"    calibrated {b['calibrated']}; restart_seconds {b['restart_seconds']:.3f} (frozen)"
        )
        print(
            "    predicted vs measured s (whole change, then moves), bytes, nodes: "
            f"{b['predicted_vs_measured_s']}"
        )
        c = asyncio.run(live.overlap_ratio(rounds=args.rounds))
        print(
            f"(c) generation on untouched devices: {c['tokens_per_s_during']:.1f} tokens/s "
            "during a transition, "
            f"{c['tokens_per_s_alone']:.1f} without one ({c['cores']} cores)"
        )
        out.update(
            prediction_error=round(b["prediction_error"], 3),
            prediction_error_p90=round(b["prediction_error_p90"], 3),
            prediction_error_max=round(b["prediction_error_max"], 3),
            prediction_error_moves=round(b["prediction_error_moves"], 3),
            prediction_error_moves_p90=round(b["prediction_error_moves_p90"], 3),
            overlap_ratio=round(c["overlap_ratio"], 3),
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
