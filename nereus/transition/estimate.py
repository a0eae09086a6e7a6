"""What a transition costs: the makespan of its scheduled DAG (docs/design.md §5, §6).

``transition_seconds(current, target, specs, devices, link)`` builds the transition DAG
and returns the makespan of its one list schedule under ``link`` (per-link bandwidth,
calibrated p2p efficiency, group set-up, cores shared where devices share them) plus
the transition's costs outside its nodes (``LinkModel.total``): the estimate admission weighs
against the saving. A target the DAG cannot reach -- no source to Extend from (``InfeasiblePlan``),
an acquisition blocked on memory with no Destroy to wait for (``InfeasibleTransition``)
-- costs ``inf``, which admission refuses and the urgent path skips.

``estimator(specs, devices, link)`` closes over what does not change between
boundaries and returns the ``transition_seconds(plan_a, plan_b)`` callback the
``Replanner`` takes. It prices the plans as given: the ``Replanner`` relabels a target
onto the devices the current plan uses (``nereus.planner.relabel``) before it prices
and stores it, so the plan priced is the plan executed.

``cluster_devices(cluster)`` describes a planner ``ClusterSpec``'s devices for the DAG:
hosts by node, each device's budget (what plans may fill: memory less headroom and
workspace); ``LinkModel.of(cluster, efficiency)`` its links.
Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from nereus.errors import InfeasiblePlan
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import usable_bytes
from nereus.planner.plan import Plan
from nereus.state.emu import DeviceSet
from nereus.state.spec import ModelSpec
from nereus.transition.build import build_dag
from nereus.transition.dag import TransitionDAG
from nereus.transition.schedule import LinkModel, Schedule

__all__ = ["transition_seconds", "estimator", "scheduled", "cluster_devices"]


def cluster_devices(cluster: ClusterSpec) -> DeviceSet:
    """Every device of ``cluster``: its node as host, and what plans may fill on it."""
    n, per = cluster.num_devices, cluster.devices_per_node
    budget = usable_bytes(cluster) - cluster.workspace_bytes
    return DeviceSet(tuple(d // per for d in range(n)), (budget,) * n)


def scheduled(
    current: Plan,
    target: Plan,
    specs: Mapping[str, ModelSpec],
    devices: DeviceSet,
    link: LinkModel,
    **kw,
) -> tuple[TransitionDAG, Schedule]:
    """The DAG from ``current`` to ``target`` and its list schedule under ``link``
    (``kw``: ``build_dag``'s keywords). Raises what ``build_dag`` raises."""
    dag = build_dag(
        current, target, specs, devices, duration=link.seconds, share=link.sharing, **kw
    )
    return dag, dag.schedule


def transition_seconds(
    current: Plan,
    target: Plan,
    specs: Mapping[str, ModelSpec],
    devices: DeviceSet,
    link: LinkModel,
    *,
    slots: Mapping[str, Sequence[str]] | None = None,
    names: Mapping[str, Sequence[str]] | None = None,
    resident: Mapping[int, int] | None = None,
    bucket_bytes: int = 0,
) -> float:
    """Seconds the transition from ``current`` to ``target`` takes (its makespan plus
    its fixed cost), or ``inf`` when the DAG cannot reach it (see the module docstring)."""
    if current == target:
        return 0.0
    try:
        dag, schedule = scheduled(
            current,
            target,
            specs,
            devices,
            link,
            slots=slots,
            names=names,
            resident=resident,
            bucket_bytes=bucket_bytes,
        )
    except InfeasiblePlan:  # InfeasibleTransition too
        return math.inf
    return link.total(dag, schedule.makespan)


def estimator(
    specs: Mapping[str, ModelSpec],
    devices: DeviceSet,
    link: LinkModel,
    *,
    slots: Mapping[str, Sequence[str]] | None = None,
    bucket_bytes: int = 0,
) -> Callable[[Plan, Plan], float]:
    """``transition_seconds`` with everything but the two plans fixed: the ``Replanner``'s
    ``transition_seconds`` callback (it relabels targets before it calls this)."""

    def seconds(current: Plan, target: Plan) -> float:
        return transition_seconds(
            current, target, specs, devices, link, slots=slots, bucket_bytes=bucket_bytes
        )

    return seconds
