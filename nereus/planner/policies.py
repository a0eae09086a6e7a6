"""The adaptation policies, defined once for the simulator and the running job (design §6).

A policy is a ``Replanner`` that acts on a chosen set of triggers and prices a chosen
set of targets; both executors (``nereus.sim.policies`` and ``nereus.job.adapt``) and
``nereus.planner.replay`` build it through ``make_replanner``, so the same boundary
reports give the same decisions wherever they are replayed.

- ``payback``: the Replanner with the payback rule (``gamma``, default 0.5).
- ``always``: any target with a predicted saving is admitted (no payback limit).
- ``every-k``: soft triggers are acted on only at steps that are multiples of
  ``every_k``, where a search runs even if nothing fired; hard triggers (devices lost or
  drained, a predicted memory overflow) at once; any predicted saving is admitted. Its
  targets are relabelled onto the current devices like every other policy's.
- ``static``: each model-stage keeps its TP, PP (and recompute) of the start; DP and
  placement follow the pool (the current layout rescaled; all model-stages in one pool
  when its pools no longer get a valid size each), taken without a payback
  test. When the memory model says the layout no longer fits, the generation
  model-stages decode in more waves, then training recomputes activations (never a
  TP/PP change). ``static_start`` picks its layout: the search's best for the first
  step's lengths among plans that fit the largest cap the job will reach.

Refuses (``ConfigError``): a name outside ``POLICIES``, ``every_k < 1``, ``gamma <= 0``.
Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nereus.config import require
from nereus.errors import InfeasiblePlan
from nereus.planner.admission import DEFAULT_GAMMA
from nereus.planner.calibrate import Calibrator
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import CONSERVATIVE, Efficiency
from nereus.planner.explain import explain
from nereus.planner.plan import Plan
from nereus.planner.replan import Replanner
from nereus.planner.rescale import Layout, layout_of, rescaled_layout
from nereus.planner.search import search
from nereus.planner.triggers import Trigger
from nereus.planner.workload import LengthStats, Workload

__all__ = [
    "POLICIES",
    "SIM_NAMES",
    "PolicySpec",
    "make_replanner",
    "relieved",
    "spec_of",
    "static_rescaled",
    "static_start",
]

POLICIES = ("payback", "always", "every-k", "static")
# the simulator's names for the same policies (its reports predate these)
SIM_NAMES = {
    "adaptive": "payback",
    "dynarl": "always",
    "every-k": "every-k",
    "static": "static",
}


@dataclass(frozen=True)
class PolicySpec:
    """Which policy, and its parameters (``gamma`` is used by ``payback`` only)."""

    name: str = "payback"
    gamma: float = DEFAULT_GAMMA
    every_k: int = 3

    def __post_init__(self) -> None:
        require(
            self.name in POLICIES, "adapt.policy", self.name, f"must be one of {list(POLICIES)}"
        )
        require(self.gamma > 0, "adapt.gamma", self.gamma, "must be > 0")
        require(
            isinstance(self.every_k, int) and self.every_k >= 1,
            "adapt.every_k",
            self.every_k,
            "must be an integer >= 1",
        )

    @property
    def admission_gamma(self) -> float:
        return self.gamma if self.name == "payback" else math.inf


class EveryKReplanner(Replanner):
    """``every-k`` (see the module docstring)."""

    def __init__(self, *args, every_k: int = 3, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.every_k = every_k

    def _acted_on(self, step: int, triggers: tuple[Trigger, ...]) -> tuple[Trigger, ...]:
        if any(t.hard for t in triggers):
            return triggers
        if step % self.every_k:
            return ()
        return triggers or (
            Trigger(
                "periodic",
                "every-k",
                False,
                step,
                f"every {self.every_k} steps",
                {"detail": "periodic"},
            ),
        )


def relieved(
    plan: Plan, work: Workload, cluster: ClusterSpec, eff: Efficiency, *, must_fit: bool = True
) -> list[tuple[str, Plan, float]]:
    """``plan`` with less memory per device and the same devices, TP and PP: generation
    model-stages in 2, 4, ... times their waves, then also training with recompute;
    of each kind the first variant the memory model says fits (``must_fit`` False: the
    first variant), with its predicted seconds per step."""
    kinds = {s.name: s.kind for s in work.stages}
    out: list[tuple[str, Plan, float]] = []
    for recompute in (False, True):
        factor, last = 1, None
        while True:
            stages = []
            for name, sp in plan:
                if kinds[name] == "generation":
                    most = max(sp.waves, -(-work.sequences // sp.dp))
                    stages.append((name, replace(sp, waves=min(most, sp.waves * factor))))
                else:
                    stages.append((name, replace(sp, recompute=sp.recompute or recompute)))
            variant = Plan(tuple(stages))
            if variant == last:
                break  # every generation model-stage decodes one sequence a wave
            last = variant
            if variant != plan:
                ex = explain(variant, work, cluster, eff)
                if ex.fits or not must_fit:
                    out.append(
                        (
                            f"waves x{factor}" + (" + recompute" if recompute else ""),
                            variant,
                            ex.step_seconds,
                        )
                    )
                    break  # the fewest waves that fit: more only cost time
            factor *= 2
    return out


class StaticReplanner(Replanner):
    """``static`` (see the module docstring)."""

    offers_rescaled = False

    def _acted_on(self, step: int, triggers: tuple[Trigger, ...]) -> tuple[Trigger, ...]:
        # the pool and memory move it; drift of the lengths does not
        return tuple(t for t in triggers if t.kind != "drift")

    def _candidates(self, current: float | None) -> list[tuple[str, Plan, float]]:
        out: list[tuple[str, Plan, float]] = []
        grown = static_rescaled(layout_of(self.plan, self.work), self.work, self.cluster)
        if grown is not None:
            grown = self._relabelled(grown)
            ex = explain(grown, self.work, self.cluster, self.eff)
            if self.failed:
                # it ran out of memory where the model said it fits: less memory, whatever it
                # says, on both sides (which model-stage overflowed is not known here)
                both = relieved(grown, self.work, self.cluster, self.eff, must_fit=False)
                out += both[-1:]
            elif ex.fits:
                out.append(("rescaled", grown, ex.step_seconds))
            else:
                out += relieved(grown, self.work, self.cluster, self.eff)
        if grown is None:
            raise InfeasiblePlan(
                f"the static layout fits no DP of the {self.cluster.num_devices} devices"
            )
        if not out and current is None:
            # no relief the model trusts: it runs as it is, and a measured failure relieves it
            out.append(
                ("as is", grown, explain(grown, self.work, self.cluster, self.eff).step_seconds)
            )
        return out


def static_rescaled(layout: Layout, work: Workload, cluster: ClusterSpec) -> Plan | None:
    """``layout`` (its TP, PP, recompute and waves' concurrency) rescaled to ``cluster``;
    when its pools no longer get a valid size each, every model-stage in one pool (a
    placement change, never a TP/PP one); None when even that has no valid size."""
    plan = rescaled_layout(layout, work, cluster)
    if plan is None and len(layout.pools) > 1:
        one = Layout(layout.stages, ((layout.order, layout.devices),), layout.order, layout.devices)
        plan = rescaled_layout(one, work, cluster)
    return plan


def static_start(work: Workload, cluster: ClusterSpec, eff: Efficiency, largest_cap: int) -> Plan:
    """``static``'s layout: the search's best at ``work``'s lengths among the plans
    whose memory holds ``largest_cap`` tokens (the largest the job will reach)."""
    cap = LengthStats(float(largest_cap), float(largest_cap), largest_cap)
    return search(work.with_lengths(work.lengths, cap), cluster, eff, alternatives=False).plan


def make_replanner(
    spec: PolicySpec,
    work: Workload,
    cluster: ClusterSpec,
    *,
    plan: Plan | None = None,
    eff: Efficiency = CONSERVATIVE,
    calibrator: Calibrator | None = None,
    length_threshold: float = 0.30,
    join_horizon_steps: float = 20.0,
    min_steps_between: int = 0,
    slack: float = 0.05,
    largest_cap: int | None = None,
) -> Replanner:
    """The Replanner of policy ``spec`` over ``work`` and ``cluster``, from ``plan`` (the
    planner's slots; default: the policy's own start, ``static_start`` for ``static``
    when ``largest_cap`` is given, else the search's best)."""
    if plan is None and spec.name == "static" and largest_cap is not None:
        plan = static_start(work, cluster, eff, largest_cap)
    kwargs = dict(
        plan=plan,
        eff=eff,
        gamma=spec.admission_gamma,
        slack=slack,
        length_threshold=length_threshold,
        calibrator=calibrator,
        join_horizon_steps=join_horizon_steps,
        min_steps_between=min_steps_between,
    )
    if spec.name == "every-k":
        return EveryKReplanner(work, cluster, every_k=spec.every_k, **kwargs)
    if spec.name == "static":
        return StaticReplanner(work, cluster, **kwargs)
    return Replanner(work, cluster, **kwargs)


def spec_of(rp: Replanner) -> PolicySpec:
    """The policy a Replanner built by ``make_replanner`` runs (for boundary records)."""
    if isinstance(rp, EveryKReplanner):
        return PolicySpec("every-k", every_k=rp.every_k)
    if isinstance(rp, StaticReplanner):
        return PolicySpec("static")
    if math.isinf(rp.gamma):
        return PolicySpec("always")
    return PolicySpec("payback", gamma=rp.gamma)
