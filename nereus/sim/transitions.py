"""What a transition costs in the simulator: the real transition DAG, scheduled.

``transition_seconds(current, target, ...)`` is the one function that turns two plans
into seconds: ``nereus.transition.build_dag`` (analytic bytes, every device's memory
cap, resource edges) then ``nereus.transition.simulate`` (the one list scheduler) with a
``LinkModel``; ``inf`` when the DAG is infeasible. ``Transitions`` prices every move of
a run from one DAG: with the planner's link model under its calibrated efficiencies
(what admission sees), and as the ground truth times it: ``actual_total(current,
target, step)`` when given (the paper's figures), its nodes sharing that total as they
share the DAG's time under the truth's link model (what calibration observes); without
it, the DAG under the truth's link model. DAGs are cached per (current, target) pair,
since a policy prices the same candidate moves again at later boundaries.

Model-stages' ``ModelSpec``s are read off the model definition (``nereus.models.
model_spec`` on the meta device: no weights), from the planner's ``ModelShape``, in one
place (``stage_specs``); training model-stages hold their optimizer's slots as the
runtime's do.

``intact(plan, devices)`` is what survives a loss: each model-stage's EMUs whose devices
are all still there (None when a model-stage lost every EMU: only a checkpoint restores
it). Plans here name the cluster's global device ids; node = id // devices per node.
Pure apart from the cache: no clock, no I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache

from nereus.errors import InfeasibleTransition
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import Efficiency, usable_bytes
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import ModelShape, Workload
from nereus.state.spec import ModelSpec, training_slots
from nereus.transition import LinkModel, TransitionDAG, build_dag, simulate

__all__ = [
    "model_spec_of",
    "stage_specs",
    "stage_slots",
    "intact",
    "dag_of",
    "transition_seconds",
    "Transitions",
]


@lru_cache(maxsize=16)
def model_spec_of(shape: ModelShape) -> ModelSpec:
    """The ``ModelSpec`` of a planner model shape, read off the model definition."""
    from nereus.models import ModelConfig, model_spec  # torch: imported only when a DAG is needed

    config = ModelConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        tie_word_embeddings=shape.tied_embeddings,
        torch_dtype=shape.dtype,
    )
    return model_spec(config, dtype=shape.dtype, value_head=shape.value_head)


def stage_specs(work: Workload) -> dict[str, ModelSpec]:
    """Every model-stage's ``ModelSpec`` (the critic and reward models carry a value head)."""
    return {s.name: model_spec_of(work.models[s.model]) for s in work.stages}


def stage_slots(work: Workload) -> dict[str, tuple[str, ...]]:
    """Slots per model-stage: training holds its parameters' optimizer state too."""
    return {
        s.name: training_slots(work.models[s.model].dtype)
        for s in work.stages
        if s.kind == "training"
    }


def intact(plan: Plan, devices: Iterable[int]) -> Plan | None:
    """``plan`` without the EMUs that lost a device; None when a model-stage lost every EMU."""
    live = set(devices)
    out = []
    for name, sp in plan:
        kept = tuple(emu for emu in sp.devices if live.issuperset(emu))
        if not kept:
            return None
        out.append(
            (
                name,
                sp
                if len(kept) == sp.dp
                else StagePlan(sp.tp, sp.pp, len(kept), kept, sp.recompute, sp.waves),
            )
        )
    return Plan(tuple(out))


def nodes_of(dag: TransitionDAG, per_node: int) -> int:
    """How many nodes a transition touches."""
    return len({d // per_node for d in dag.devices()}) or 1


def dag_of(
    current: Plan,
    target: Plan,
    specs: Mapping[str, ModelSpec],
    slots: Mapping[str, tuple[str, ...]],
    cluster: ClusterSpec,
) -> TransitionDAG | None:
    """The transition DAG of the move over ``cluster``'s devices (every device capped at
    its usable memory, holding the workspace besides the EMUs); None when infeasible."""
    per = cluster.devices_per_node
    try:
        return build_dag(
            current,
            target,
            specs,
            lambda d: usable_bytes(cluster),
            slots=slots,
            resident=dict.fromkeys(current.devices | target.devices, cluster.workspace_bytes),
            host_of=lambda d: d // per,
        )
    except InfeasibleTransition:
        return None


def transition_seconds(
    current: Plan,
    target: Plan,
    specs: Mapping[str, ModelSpec],
    slots: Mapping[str, tuple[str, ...]],
    cluster: ClusterSpec,
    link: LinkModel,
    dag: TransitionDAG | None = None,
) -> float:
    """Seconds of the move ``current`` -> ``target``: ``build_dag`` (or the given ``dag``
    of that move) then ``simulate`` with ``link``; ``inf`` when no schedule keeps every
    device under its cap."""
    if current == target:
        return 0.0
    dag = dag if dag is not None else dag_of(current, target, specs, slots, cluster)
    if dag is None:
        return math.inf
    try:
        return simulate(dag, link.seconds).makespan
    except InfeasibleTransition:
        return math.inf


class Transitions:
    """Prices and times the moves of one run (see the module docstring).

    ``actual_link(step, nodes)`` gives the ground truth's link model at a step for a
    transition over that many nodes. ``dag_seconds`` accumulates the wall time spent
    building and scheduling DAGs (the decision time the simulator reports)."""

    def __init__(
        self,
        work: Workload,
        cluster: ClusterSpec,
        actual_link: Callable[[int, int], LinkModel],
        actual_total: Callable[[Plan, Plan, int], float] | None = None,
    ) -> None:
        self.work, self.cluster, self.actual_link, self.actual_total = (
            work,
            cluster,
            actual_link,
            actual_total,
        )
        self.specs = stage_specs(work)
        self.slots = stage_slots(work)
        self._dags: dict[tuple[Plan, Plan], TransitionDAG | None] = {}
        self.dag_seconds = 0.0
        self.dags_built = 0

    def dag(self, current: Plan, target: Plan) -> TransitionDAG | None:
        """The DAG of the move (None when infeasible), built once per pair."""
        key = (current, target)
        if key in self._dags:
            return self._dags[key]
        t0 = time.perf_counter()
        dag = dag_of(current, target, self.specs, self.slots, self.cluster)
        self.dag_seconds += time.perf_counter() - t0
        self.dags_built += 1
        self._dags[key] = dag
        return dag

    def _seconds(
        self, current: Plan, target: Plan, link: Callable[[TransitionDAG], LinkModel]
    ) -> float:
        if current == target:
            return 0.0
        dag = self.dag(current, target)
        if dag is None:
            return math.inf
        t0 = time.perf_counter()
        seconds = transition_seconds(
            current, target, self.specs, self.slots, self.cluster, link(dag), dag
        )
        self.dag_seconds += time.perf_counter() - t0
        return seconds

    def estimate(self, current: Plan, target: Plan, eff: Efficiency) -> float:
        """What the planner expects the move to take (its link model, ``eff``)."""
        link = LinkModel.of(self.cluster, eff)
        return self._seconds(current, target, lambda dag: link)

    def actual(self, current: Plan, target: Plan, step: int) -> float:
        """What the move really takes at ``step`` (the ground truth's link model)."""
        per = self.cluster.devices_per_node
        seconds = self._seconds(
            current, target, lambda dag: self.actual_link(step, nodes_of(dag, per))
        )
        if self.actual_total is None or not math.isfinite(seconds):
            return seconds
        return self.actual_total(current, target, step)

    def observed_nodes(
        self, current: Plan, target: Plan, step: int
    ) -> list[tuple[dict[str, float], float]]:
        """Every node of an executed move as calibration sees it: the planner link model's
        ideal terms and the node's true seconds."""
        dag = self.dag(current, target)
        if dag is None or current == target:
            return []
        per = self.cluster.devices_per_node
        truth = self.actual_link(step, nodes_of(dag, per))
        planner = LinkModel.of(self.cluster, Efficiency())
        seconds = [truth.seconds(n) for n in dag.nodes]
        if self.actual_total is not None:
            # the move's true total, shared out as its nodes share the DAG's makespan
            makespan = simulate(dag, truth.seconds).makespan
            scale = self.actual_total(current, target, step) / makespan if makespan > 0 else 0.0
            seconds = [s * scale for s in seconds]
        return [(planner.ideal(n), s) for n, s in zip(dag.nodes, seconds, strict=True)]
