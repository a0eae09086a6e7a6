"""Admission: whether moving to a target plan pays for itself (docs/design.md §6).

The rule: admit a target when the saving per step is positive and

    transition seconds / saving per step  <=  gamma * H

where H (in steps) is the moving average of the intervals between crossings of the
signal that triggered the replan (``DriftSignal.horizon_steps``) and gamma defaults to
0.5: the move must pay back within half the time the new plan is expected to last.

``choose`` applies it to the search's ranked targets: the fastest reachable first
(a target whose transition is impossible is skipped); if it is refused, slightly
slower targets (within ``slack`` of the fastest reachable) with cheaper transitions
are tried in order of predicted step time before keeping the current plan. The urgent path (devices
lost, the current plan no longer fits) skips the payback test and takes the fastest target whose
transition is possible; when no
transition is possible the last resort is to checkpoint and restart on the fastest
target.

Inputs are numbers (plan costs, transition estimates, H) so the transition DAG's
estimate, a simulator's or a test's plug in alike. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nereus.config import require

__all__ = ["Decision", "Target", "admit", "choose", "DEFAULT_GAMMA"]

DEFAULT_GAMMA = 0.5


@dataclass(frozen=True)
class Target:
    """A candidate plan with its predicted step time and transition cost (inf: impossible)."""

    plan: Any
    step_seconds: float
    transition_seconds: float
    label: str = ""


@dataclass(frozen=True)
class Decision:
    """``action``: "transition" (move to ``target``), "keep", or "restart" (checkpoint and
    restart on ``target``). ``reason`` states the numbers the rule compared."""

    action: str
    target: Target | None
    reason: str
    saving_seconds: float = 0.0
    payback_steps: float = math.inf
    limit_steps: float = math.inf
    # when keeping: the fastest target the rule was applied to (what was turned down)
    candidate: Target | None = None

    @property
    def admitted(self) -> bool:
        return self.action in ("transition", "restart")


def admit(
    current_step_seconds: float,
    target_step_seconds: float,
    transition_seconds: float,
    horizon_steps: float | None,
    gamma: float = DEFAULT_GAMMA,
) -> Decision:
    """The payback test for one target (no urgency). ``horizon_steps`` None (no crossing
    seen yet) admits nothing that costs time: there is no evidence the plan will last."""
    require(gamma > 0, "gamma", gamma, "must be > 0")
    require(transition_seconds >= 0, "transition_seconds", transition_seconds, "must be >= 0")
    target = Target(None, target_step_seconds, transition_seconds)
    saving = current_step_seconds - target_step_seconds
    limit = gamma * horizon_steps if horizon_steps is not None else 0.0
    if saving <= 0:
        return Decision(
            "keep",
            None,
            f"no saving: target {target_step_seconds:.4g} s/step vs current "
            f"{current_step_seconds:.4g} s/step",
            saving,
            math.inf,
            limit,
        )
    payback = transition_seconds / saving
    if payback <= limit:
        return Decision(
            "transition",
            target,
            f"pays back in {payback:.3g} steps <= gamma*H = {gamma}*"
            f"{horizon_steps} = {limit:.3g} steps",
            saving,
            payback,
            limit,
        )
    h = "unknown (no crossing yet)" if horizon_steps is None else f"{horizon_steps:.3g}"
    return Decision(
        "keep",
        None,
        f"payback {payback:.3g} steps > gamma*H = {gamma}*{h} = {limit:.3g} steps",
        saving,
        payback,
        limit,
    )


def choose(
    current_step_seconds: float | None,
    targets: Sequence[Target],
    horizon_steps: float | None,
    *,
    gamma: float = DEFAULT_GAMMA,
    urgent: bool = False,
    slack: float = 0.05,
) -> Decision:
    """Pick the move to make among ``targets`` (any order; ranked here by step time).

    ``current_step_seconds`` None means the current plan cannot run (urgent).
    ``slack``: how much slower than the fastest reachable target a cheaper-to-reach one may be."""
    require(slack >= 0, "slack", slack, "must be >= 0")
    ranked = sorted(targets, key=lambda t: (t.step_seconds, t.transition_seconds))
    if not ranked:
        return Decision("keep", None, "no target plan")
    urgent = urgent or current_step_seconds is None
    if urgent:
        for t in ranked:
            if math.isfinite(t.transition_seconds):
                return Decision(
                    "transition",
                    t,
                    f"urgent: fastest reachable target {t.label or ''} "
                    f"{t.step_seconds:.4g} s/step, transition {t.transition_seconds:.3g} s",
                )
        return Decision(
            "restart",
            ranked[0],
            "urgent and no transition is possible: checkpoint and restart "
            f"on the fastest target ({ranked[0].step_seconds:.4g} s/step)",
        )
    # slack is measured from the fastest target that can be reached: an impossible
    # transition to a faster plan must not hide a reachable one that saves time
    best = next(
        (t.step_seconds for t in ranked if math.isfinite(t.transition_seconds)),
        ranked[0].step_seconds,
    )
    tried = []
    first: Decision | None = None  # the fastest target's verdict, reported when keeping
    first_target = ranked[0]
    for t in ranked:
        if t.step_seconds > best * (1 + slack):
            break
        if not math.isfinite(t.transition_seconds):
            tried.append(f"{t.label or 'target'}: transition impossible")
            continue
        d = admit(current_step_seconds, t.step_seconds, t.transition_seconds, horizon_steps, gamma)
        if d.admitted:
            return Decision(
                "transition", t, d.reason, d.saving_seconds, d.payback_steps, d.limit_steps
            )
        if first is None:
            first, first_target = d, t
        tried.append(f"{t.label or 'target'}: {d.reason}")
    reason = "kept the current plan; " + "; ".join(tried)
    if first is None:
        return Decision("keep", None, reason, candidate=ranked[0])
    return Decision(
        "keep",
        None,
        reason,
        first.saving_seconds,
        first.payback_steps,
        first.limit_steps,
        candidate=first_target,
    )
