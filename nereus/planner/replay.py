"""Boundary reports as data, and the Replanner run again over them (docs/design.md §6).

A running job's controller hands the ``Replanner`` one boundary report per step: the
lengths the step ran at and the next step's cap, the device pool, the job's plan over
the pool's slots, what left or joined, the efficiency factors calibration has fitted so
far, and the price of every target the search offered (the transition DAG's estimate).
``boundary_record`` writes one such report, with what was decided, as plain data (JSON
and msgpack safe: the job puts it on the tap as a ``boundary`` event); the first
record of a run also holds how its Replanner was built.

``replay(records)`` builds a Replanner as the first record says (its policy too,
``nereus.planner.policies``) and feeds it every
record in order, with each target priced as recorded: the same triggers, references,
pool horizons, searches and admissions run again, so a decision sequence can be checked
against what the job did, or re-decided under another ``gamma``. A target the recording
never priced (another search result) raises ``ConfigError`` naming the step and plan.

Pure: records in, outcomes out; nothing here reads files or clocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from nereus.errors import ConfigError
from nereus.planner.admission import DEFAULT_GAMMA
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import Efficiency
from nereus.planner.plan import Plan
from nereus.planner.policies import PolicySpec, make_replanner, spec_of
from nereus.planner.replan import BoundaryOutcome, Replanner
from nereus.planner.workload import LengthStats, ModelShape, Workload

__all__ = ["boundary_record", "replay", "workload_from_dict", "workload_to_dict"]


def _lengths(d: Mapping[str, Any] | None) -> LengthStats | None:
    return None if d is None else LengthStats(float(d["mean"]), float(d["p95"]), int(d["max"]))


def workload_to_dict(work: Workload) -> dict[str, Any]:
    """``work`` as plain data (``workload_from_dict`` reads it back)."""
    out = {f.name: getattr(work, f.name) for f in dataclasses.fields(work) if f.init}
    out["models"] = {role: dataclasses.asdict(m) for role, m in work.models.items()}
    out["lengths"] = dataclasses.asdict(work.lengths)
    out["memory_lengths"] = (
        None if work.memory_lengths is None else dataclasses.asdict(work.memory_lengths)
    )
    return out


def workload_from_dict(d: Mapping[str, Any]) -> Workload:
    fields = dict(d)
    fields["models"] = {role: ModelShape(**m) for role, m in d["models"].items()}
    fields["lengths"] = _lengths(d["lengths"])
    fields["memory_lengths"] = _lengths(d.get("memory_lengths"))
    return Workload(**fields)


def _plan_key(plan: Plan) -> str:
    return repr(sorted(plan.to_dict().items()))


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def boundary_record(
    rp: Replanner,
    outcome: BoundaryOutcome,
    *,
    eff: Efficiency,
    lost: Sequence[int] = (),
    drained: Sequence[int] = (),
    joined: Sequence[int] = (),
    priced: Mapping[Plan, float] | None = None,
    first: bool = False,
    initial: tuple[Workload, ClusterSpec, Plan, Efficiency] | None = None,
) -> dict[str, Any]:
    """One boundary as data: what ``rp`` was given (its workload, cluster and the plan it
    started from; ``eff``, the factors in force; the pool changes), the price of each
    target (``priced``), and the outcome. With ``first``, also how ``rp`` was built
    (``initial``: the workload, cluster, plan and factors it was constructed with)."""
    d = outcome.decision
    record: dict[str, Any] = {
        "step": outcome.step,
        "work": workload_to_dict(rp.work),
        "cluster": dataclasses.asdict(rp.cluster),
        "plan": outcome.previous_plan.to_dict()
        if outcome.previous_plan is not None
        else rp.plan.to_dict(),
        "eff": dataclasses.asdict(eff),
        "lost": [int(x) for x in lost],
        "drained": [int(x) for x in drained],
        "joined": [int(x) for x in joined],
        "failed": bool(rp.failed),
        "priced": [[p.to_dict(), _finite(s)] for p, s in (priced or {}).items()],
        "triggers": [t.kind for t in outcome.triggers],
        "action": d.action,
        "admitted": d.admitted,
        "target": d.target.plan.to_dict() if d.target is not None else None,
    }
    if first:
        assert initial is not None, "the first record needs how the Replanner was built"
        work, cluster, plan, eff0 = initial
        record["replanner"] = {
            "work": workload_to_dict(work),
            "cluster": dataclasses.asdict(cluster),
            "plan": plan.to_dict(),
            "eff": dataclasses.asdict(eff0),
            "gamma": rp.gamma,
            "slack": rp.slack,
            "length_threshold": rp.monitor.signals["length"].threshold,
            "join_horizon_steps": rp.monitor.pool.initial,
            "min_steps_between": rp.min_steps_between,
            "policy": spec_of(rp).name,
            "every_k": spec_of(rp).every_k,
        }
    return record


def replay(
    records: Sequence[Mapping[str, Any]], *, gamma: float | None = None
) -> tuple[Replanner, list[BoundaryOutcome]]:
    """Run a Replanner again over ``records`` (the first holds how it was built); with
    ``gamma``, under another admission limit. Returns the Replanner and each outcome."""
    if not records or "replanner" not in records[0]:
        raise ConfigError("records[0] must be a run's first boundary record (with 'replanner')")
    init = records[0]["replanner"]
    name = init.get("policy", "payback" if math.isfinite(init["gamma"]) else "always")
    if gamma is not None:
        name = "payback"  # re-decided under another payback limit
    recorded = init["gamma"] if math.isfinite(init["gamma"]) else DEFAULT_GAMMA
    spec = PolicySpec(
        name, gamma=recorded if gamma is None else gamma, every_k=int(init.get("every_k", 3))
    )
    rp = make_replanner(
        spec,
        workload_from_dict(init["work"]),
        ClusterSpec(**init["cluster"]),
        plan=Plan.from_dict(init["plan"]),
        eff=Efficiency(**init["eff"]),
        slack=init["slack"],
        length_threshold=init["length_threshold"],
        join_horizon_steps=init["join_horizon_steps"],
        min_steps_between=init["min_steps_between"],
    )
    outcomes = []
    for r in records:
        step = int(r["step"])
        prices = {
            _plan_key(Plan.from_dict(p)): (math.inf if s is None else float(s))
            for p, s in r["priced"]
        }

        def price(
            _: Plan, target: Plan, step: int = step, prices: dict[str, float] = prices
        ) -> float:
            key = _plan_key(target)
            if key not in prices:
                raise ConfigError(
                    f"step {step}: target {target.to_dict()} was never priced by the recorded run"
                )
            return prices[key]

        rp.eff = Efficiency(**r["eff"])
        work = workload_from_dict(r["work"])
        rp.work = work
        outcomes.append(
            rp.on_boundary(
                step,
                lengths=work.lengths,
                memory_lengths=work.memory_lengths,
                cluster=ClusterSpec(**r["cluster"]),
                plan=Plan.from_dict(r["plan"]),
                lost=r["lost"],
                drained=r["drained"],
                joined=r["joined"],
                failed=bool(r.get("failed", False)),
                transition_seconds=price,
            )
        )
    return rp, outcomes
