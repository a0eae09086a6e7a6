"""Pricing an asynchronous plan as a pipeline, and the best split of devices for one.

In asynchronous RL, policy-generation runs on devices of its own while the other
model-stages (policy-training; reference-inference with a KL term; PPO's critic-inference
and critic-training) share the rest. After each update the trainer publishes the new
weights into a snapshot on its own devices and goes on; each generation EMU then syncs
from the snapshot between its decode calls (``nereus.job.async_loop``). So the sync
costs generation time, the publish costs training time, and steady-state seconds per
update are

    step = max(generation + weight sync, training side + publish)

where ``generation`` is policy-generation's cost on its devices (``stage_cost`` through
``stage_candidates``: the fastest layout that fits, over the workload's sequences, which
count ReMax's greedy row per prompt), the training side is the sum of its model-stages'
fastest layouts on the other devices (they share devices, so they serialize), and the
sync is the policy's bytes over the intra-node (or inter-node, when the split crosses
nodes) link at the calibrated ``p2p`` efficiency, and the publish one copy of a training
device's share of the policy at its memory bandwidth. That snapshot stays on the training
devices: policy-training's layout must fit beside it. PPO's critic sync (critic-training to
critic-inference) stays on the training side's devices and is not priced, as in sync
mode.

``search_async(work, cluster, eff)`` prices every split of the budget (generation gets
``g`` devices, the rest ``budget - g``; a split counts when both sides have a valid
layout: ``stage_candidates`` keeps only those whose DP divides the batch) and returns the
fastest as an ``AsyncPlan``: longer responses make generation the slower side, so the
best split moves devices to it. Pure: numbers in, a plan out; the same cost model as
``search`` (no fork).

Refuses (``InfeasiblePlan``): a budget under two devices, or no split where both sides fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.errors import InfeasiblePlan
from nereus.planner.candidates import stage_candidates
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import CONSERVATIVE, Efficiency, usable_bytes
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import Workload

__all__ = [
    "AsyncPlan",
    "async_step_seconds",
    "publish_seconds",
    "search_async",
    "snapshot_bytes",
    "sync_seconds",
]

GENERATION = "policy-generation"


@dataclass(frozen=True)
class AsyncPlan:
    """A plan for asynchronous RL with its pipeline price (seconds per update)."""

    plan: Plan
    step_seconds: float
    generation_seconds: float
    training_seconds: float
    sync_seconds: float
    generation_devices: int
    publish_seconds: float = 0.0


def async_step_seconds(
    generation_seconds: float, training_seconds: float, sync: float, publish: float = 0.0
) -> float:
    """Steady-state seconds per update of a generation/training pipeline: generation
    takes each version's weights (``sync``), training publishes them (``publish``)."""
    return max(generation_seconds + sync, training_seconds + publish)


def publish_seconds(
    work: Workload, cluster: ClusterSpec, tp: int, pp: int, devices: list[int]
) -> float:
    """One publish: a training device copies its share (``1 / (tp * pp)``) of the policy
    into its snapshot, at the memory bandwidth it gets while every one of ``devices``
    does the same."""
    share = cluster.rate_share(len(devices), cluster.capacity(devices))
    return snapshot_bytes(work, tp, pp) / (cluster.memory_bandwidth * share)


def sync_seconds(
    work: Workload, cluster: ClusterSpec, eff: Efficiency, crosses_nodes: bool
) -> float:
    """One weight sync: the policy's bytes over the link between the two sides."""
    policy = work.models["policy"]
    nbytes = policy.num_params * policy.bytes_per_param
    if crosses_nodes:
        return (
            nbytes / (cluster.inter_node_bandwidth * eff["p2p_inter"])
            + cluster.inter_node_latency_s
        )
    return nbytes / (cluster.intra_node_bandwidth * eff["p2p_intra"]) + cluster.intra_node_latency_s


def snapshot_bytes(work: Workload, tp: int, pp: int) -> int:
    """A policy-training device's snapshot: its share of the policy's parameters."""
    policy = work.models["policy"]
    return -(-policy.num_params * policy.bytes_per_param // (tp * pp))


def _fastest(work: Workload, cluster: ClusterSpec, eff: Efficiency, index: int, n: int):
    """The fastest layout of model-stage ``index`` on ``n`` devices that fits; for
    policy-training, with its snapshot beside it."""
    cands = stage_candidates(work, cluster, eff, index, n)
    if work.stages[index].name == "policy-training":
        cap = usable_bytes(cluster) - cluster.workspace_bytes
        cands = [
            c for c in cands if c.resident + c.transient + snapshot_bytes(work, c.tp, c.pp) <= cap
        ]
    return min(cands, key=lambda c: c.seconds) if cands else None


def _stage_plan(c, devices: list[int]) -> StagePlan:
    size = c.tp * c.pp
    return StagePlan(
        c.tp,
        c.pp,
        c.dp,
        tuple(tuple(devices[i * size : (i + 1) * size]) for i in range(c.dp)),
        recompute=c.recompute,
        waves=c.waves,
    )


def search_async(
    work: Workload,
    cluster: ClusterSpec,
    eff: Efficiency = CONSERVATIVE,
    *,
    budget: int | None = None,
    generation_devices: int | None = None,
) -> AsyncPlan:
    """The fastest split of the first ``budget`` devices between generation and the rest
    (only the split giving generation ``generation_devices``, when given: the price of
    the split a job runs now)."""
    budget = cluster.num_devices if budget is None else budget
    if budget < 2:
        raise InfeasiblePlan(
            f"asynchronous RL needs at least 2 devices (generation apart), not {budget}"
        )
    names = [s.name for s in work.stages]
    gen = names.index(GENERATION)
    best: AsyncPlan | None = None
    for g in range(1, budget):
        if generation_devices is not None and g != generation_devices:
            continue
        rest = budget - g
        gen_c = _fastest(work, cluster, eff, gen, g)
        others = {i: _fastest(work, cluster, eff, i, rest) for i in range(len(names)) if i != gen}
        if gen_c is None or any(c is None for c in others.values()):
            continue
        train_s = sum(c.seconds for c in others.values())  # co-located: they serialize
        crosses = cluster.devices_per_node < budget and g % cluster.devices_per_node != 0
        sync = sync_seconds(work, cluster, eff, crosses)
        rest_devices = list(range(g, budget))
        trainer = others[names.index("policy-training")]
        publish = publish_seconds(work, cluster, trainer.tp, trainer.pp, rest_devices)
        step = async_step_seconds(gen_c.seconds, train_s, sync, publish)
        if best is None or step < best.step_seconds:
            gen_devices = list(range(g))
            stages = [(names[gen], _stage_plan(gen_c, gen_devices))]
            stages += [(names[i], _stage_plan(c, rest_devices)) for i, c in others.items()]
            order = {n: i for i, n in enumerate(names)}
            plan = Plan(tuple(sorted(stages, key=lambda s: order[s[0]])))
            best = AsyncPlan(plan, step, gen_c.seconds, train_s, sync, g, publish)
    if best is None:
        raise InfeasiblePlan(
            f"no split of {budget} devices of {cluster.name} fits generation apart from training"
        )
    return best
