"""Evaluate and explain any plan from its device sets: step time, terms, memory per device.

``explain(plan, work, cluster, eff)`` does not trust how the plan was made: it reads
each model-stage's EMUs, derives which links its pipeline sends and DP all-reduces take
from the nodes of the devices, computes every model-stage's terms (with their formulas),
builds the overlap graph (model-stages of one phase that share any device serialize,
the others overlap; phases run one after another) and sums, for every device, the
resident bytes of every model-stage on it plus the largest transient bytes of one of
them plus the workspace.

Promises: the same numbers the search optimizes, computed independently of the
search's pools, so it checks plans from anywhere (the runtime's current plan, a
simulator's, a hand-written one). ``fits`` is False when any device exceeds its
memory less 10% headroom; ``violations`` names those devices.

Refuses (``ConfigError``): a plan that lacks one of the workload's model-stages, uses a
device the cluster does not have, or puts one TP group across two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from nereus.errors import ConfigError
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import (
    CONSERVATIVE,
    Efficiency,
    StageCost,
    StageMemory,
    stage_cost,
    stage_memory,
    usable_bytes,
)
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import Workload, phases

__all__ = ["StageExplanation", "DeviceMemory", "PhaseTime", "Explanation", "explain", "links_of"]


@dataclass(frozen=True)
class StageExplanation:
    name: str
    phase: int
    plan: StagePlan
    cost: StageCost
    memory: StageMemory
    pp_inter: bool
    dp_inter: bool


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device by kind; ``transient_of`` names the model-stage whose
    transient bytes are the largest (only one model-stage runs on a device at a time)."""

    device: int
    workspace: int
    resident: tuple[tuple[str, int], ...]
    transient_of: str
    transient: int
    usable: int

    @property
    def total(self) -> int:
        return self.workspace + sum(b for _, b in self.resident) + self.transient

    @property
    def fits(self) -> bool:
        return self.total <= self.usable


@dataclass(frozen=True)
class PhaseTime:
    """One phase: groups of model-stages that share devices (each group serializes)."""

    phase: int
    groups: tuple[tuple[str, ...], ...]
    group_seconds: tuple[float, ...]

    @property
    def seconds(self) -> float:
        return max(self.group_seconds)


@dataclass(frozen=True)
class Explanation:
    stages: tuple[StageExplanation, ...]
    phases: tuple[PhaseTime, ...]
    memory: tuple[DeviceMemory, ...]

    @property
    def step_seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)

    @property
    def violations(self) -> list[DeviceMemory]:
        return [m for m in self.memory if not m.fits]

    def stage(self, name: str) -> StageExplanation:
        for s in self.stages:
            if s.name == name:
                return s
        raise ConfigError(
            f"model-stage {name!r} is not explained; known: {[s.name for s in self.stages]}"
        )

    def to_dict(self, eff: Efficiency = CONSERVATIVE) -> dict[str, Any]:
        """Plain data for the tap: per model-stage seconds by term, per device bytes."""
        return {
            "step_seconds": self.step_seconds,
            "stages": {
                s.name: {
                    "layout": s.plan.layout(),
                    "seconds": s.cost.seconds,
                    "terms_seconds": s.cost.term_seconds(eff),
                    "resident_bytes": s.memory.resident,
                    "transient_bytes": s.memory.transient,
                }
                for s in self.stages
            },
            "memory_bytes": {m.device: m.total for m in self.memory},
        }


def links_of(sp: StagePlan, cluster: ClusterSpec, name: str = "") -> tuple[bool, bool]:
    """(pp_inter, dp_inter): whether pipeline sends / DP all-reduces of ``sp`` cross nodes."""
    for d in (min(sp.device_set), max(sp.device_set)):
        cluster.node_of(d)  # raises for a device the cluster does not have
    got = _links(sp, cluster.devices_per_node)
    if isinstance(got, tuple):
        return got
    raise ConfigError(
        f"{name or 'model-stage'}: TP group {list(got)} spans nodes; TP must stay inside a node"
    )


@lru_cache(maxsize=8192)
def _links(sp: StagePlan, per: int) -> tuple[bool, bool] | list[int]:
    # cached: every explain of a plan asks again, and a plan's EMUs can span 1,024
    # devices; a TP group that spans nodes comes back as a list (the caller raises)
    pp_inter = False
    for emu in sp.devices:
        for j in range(sp.pp):
            group = emu[j * sp.tp : (j + 1) * sp.tp]
            if len({d // per for d in group}) > 1:
                return list(group)
        if len({d // per for d in emu}) > 1:
            pp_inter = True
    dp_inter = any(len({emu[k] // per for emu in sp.devices}) > 1 for k in range(sp.tp * sp.pp))
    return pp_inter, dp_inter


def explain(
    plan: Plan, work: Workload, cluster: ClusterSpec, eff: Efficiency = CONSERVATIVE
) -> Explanation:
    """Every model-stage's terms, the phase structure, and memory per device of ``plan``."""
    missing = [s.name for s in work.stages if s.name not in plan.names]
    if missing:
        raise ConfigError(
            f"plan lacks model-stage(s) {missing} of {work.algorithm}; it has {plan.names}"
        )
    bad = sorted(d for d in plan.devices if d >= cluster.num_devices)
    if bad:
        raise ConfigError(f"plan uses device(s) {bad} but {cluster.name} has {cluster.num_devices}")
    levels = phases(work.stages)
    out: list[StageExplanation] = []
    for stage, level in zip(work.stages, levels, strict=False):
        sp = plan[stage.name]
        model = work.models[stage.model]
        pp_inter, dp_inter = links_of(sp, cluster, stage.name)
        cost = stage_cost(
            stage,
            model,
            work,
            cluster,
            eff,
            sp.tp,
            sp.pp,
            sp.dp,
            pp_inter=pp_inter,
            dp_inter=dp_inter,
            recompute=sp.recompute,
            waves=sp.waves,
            formulas=True,
            capacity=cluster.capacity([d for emu in sp.devices for d in emu]),
        )
        mem = stage_memory(
            stage,
            model,
            work,
            sp.tp,
            sp.pp,
            sp.dp,
            recompute=sp.recompute,
            waves=sp.waves,
            scale=eff.memory_scale,
            fixed=eff.memory_fixed_bytes,
            flash_attention=cluster.flash_attention,
        )
        out.append(StageExplanation(stage.name, level, sp, cost, mem, pp_inter, dp_inter))
    return Explanation(tuple(out), _phase_times(out), _device_memory(out, cluster))


def _phase_times(stages: list[StageExplanation]) -> tuple[PhaseTime, ...]:
    result = []
    for level in sorted({s.phase for s in stages}):
        members = [s for s in stages if s.phase == level]
        # union-find over "shares a device"
        parent = list(range(len(members)))

        def root(i: int, parent: list[int] = parent) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i, a in enumerate(members):
            for j in range(i):
                if a.plan.device_set & members[j].plan.device_set:
                    parent[root(i)] = root(j)
        groups: dict[int, list[StageExplanation]] = {}
        for i, s in enumerate(members):
            groups.setdefault(root(i), []).append(s)
        ordered = sorted(groups.values(), key=lambda g: members.index(g[0]))
        result.append(
            PhaseTime(
                level,
                tuple(tuple(s.name for s in g) for g in ordered),
                tuple(sum(s.cost.seconds for s in g) for g in ordered),
            )
        )
    return tuple(result)


def _device_memory(
    stages: list[StageExplanation], cluster: ClusterSpec
) -> tuple[DeviceMemory, ...]:
    on: dict[int, list[int]] = {}
    for i, s in enumerate(stages):
        for d in s.plan.device_set:
            on.setdefault(d, []).append(i)
    usable = usable_bytes(cluster)
    # devices holding the same model-stages hold the same bytes: one figure per kind
    kinds: dict[tuple[int, ...], tuple[tuple[tuple[str, int], ...], str, int]] = {}
    out = []
    for d in sorted(on):
        key = tuple(on[d])
        kind = kinds.get(key)
        if kind is None:
            here = [stages[i] for i in key]
            peak = max(here, key=lambda s: s.memory.transient)
            kind = kinds[key] = (
                tuple((s.name, s.memory.resident) for s in here),
                peak.name,
                peak.memory.transient,
            )
        out.append(DeviceMemory(d, cluster.workspace_bytes, kind[0], kind[1], kind[2], usable))
    return tuple(out)
