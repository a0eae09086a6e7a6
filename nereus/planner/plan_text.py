"""Plans written for people: one model-stage as ``tp1·pp1·dp2 [0,1]``, a change of it as
``tp1·pp1·dp2 [0,1] → tp1·pp1·dp2 [2,3]``.

Every place that shows a plan to a person (the job's summary and log, the dashboard,
``nereus plan``) writes it with these functions, so a placement-only or DP-only change
never reads as ``tp1·pp1 → tp1·pp1``.

Promises: the text tells apart any two plans that differ: tp, pp and dp, the devices
(sorted, runs of three or more consecutive indices as ``a-b``), ``recompute`` and
``waves`` where set, and, only when two plans hold the same devices grouped into
different EMUs, each EMU's devices (``[0,2|1,3]``). Takes a ``StagePlan`` or its
``Plan.to_dict`` form (tap events, step records); dp, recompute and waves may be
absent from the latter (dp is then the number of EMUs).

Refuses nothing and checks nothing: validating a plan is ``StagePlan``'s job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nereus.planner.plan import Plan, StagePlan

__all__ = [
    "ARROW",
    "devices_text",
    "stage_plan_text",
    "stage_change_text",
    "plan_text",
    "plan_changes",
]

ARROW = "→"

StageLike = StagePlan | Mapping[str, Any]
PlanLike = Plan | Mapping[str, StageLike]


def _fields(sp: StageLike) -> tuple[int, int, int, list[list[int]], bool, int]:
    """(tp, pp, dp, EMUs, recompute, waves) of either form."""
    if isinstance(sp, StagePlan):
        return sp.tp, sp.pp, sp.dp, [list(e) for e in sp.devices], sp.recompute, sp.waves
    emus = [list(e) for e in sp.get("devices") or []]
    recompute, waves = bool(sp.get("recompute", False)), sp.get("waves", 1) or 1
    return sp.get("tp", 1), sp.get("pp", 1), sp.get("dp", len(emus)), emus, recompute, waves


def devices_text(devices: Iterable[int]) -> str:
    """Sorted device indices in brackets, runs of three or more as ``a-b``: ``[0-3,6,7]``."""
    ds = sorted(set(devices))
    parts: list[str] = []
    i = 0
    while i < len(ds):
        j = i
        while j + 1 < len(ds) and ds[j + 1] == ds[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ds[i]}-{ds[j]}")
        else:
            parts += [str(d) for d in ds[i : j + 1]]
        i = j + 1
    return "[" + ",".join(parts) + "]"


def _emus_text(emus: list[list[int]]) -> str:
    return "[" + "|".join(",".join(map(str, e)) for e in emus) + "]"


def stage_plan_text(sp: StageLike, *, emus: bool = False) -> str:
    """``tp1·pp2·dp2 [0-3]`` (and ``·recompute``, ``·2 waves`` where set); with ``emus``
    the devices of each EMU in its order, EMUs split by ``|``: ``[0,1|2,3]``."""
    tp, pp, dp, groups, recompute, waves = _fields(sp)
    extra = ("·recompute" if recompute else "") + (f"·{waves} waves" if waves > 1 else "")
    where = _emus_text(groups) if emus else devices_text(d for e in groups for d in e)
    return f"tp{tp}·pp{pp}·dp{dp}{extra} {where}"


def stage_change_text(before: StageLike | None, after: StageLike | None) -> str:
    """``before → after``; ``–`` for a side that is absent. Where the two read the same
    but differ (the same devices in other EMUs), both sides show their EMUs."""
    a = stage_plan_text(before) if before is not None else "–"
    b = stage_plan_text(after) if after is not None else "–"
    if before is not None and after is not None and a == b and _fields(before) != _fields(after):
        a, b = stage_plan_text(before, emus=True), stage_plan_text(after, emus=True)
    return f"{a} {ARROW} {b}"


def _stages(plan: PlanLike | None) -> dict[str, StageLike]:
    if plan is None:
        return {}
    if isinstance(plan, Plan):
        return dict(plan.stages)
    return dict(plan)


def plan_text(plan: PlanLike | None, *, sep: str = "; ") -> str:
    """Every model-stage on one line: ``policy_generation tp1·pp1·dp2 [0,1]; ...``
    (``-`` for no plan)."""
    stages = _stages(plan)
    if not stages:
        return "-"
    return sep.join(f"{name} {stage_plan_text(sp)}" for name, sp in stages.items())


def plan_changes(before: PlanLike | None, after: PlanLike | None) -> list[tuple[str, str]]:
    """``(model-stage, stage_change_text)`` for each model-stage whose plan differs
    between ``before`` and ``after``, in ``after``'s order, then those ``after`` drops."""
    old, new = _stages(before), _stages(after)
    out = []
    for name in [*new, *(n for n in old if n not in new)]:
        a, b = old.get(name), new.get(name)
        if a is None or b is None or _fields(a) != _fields(b):
            out.append((name, stage_change_text(a, b)))
    return out
