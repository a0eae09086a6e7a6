"""Which model-stages a change of plan holds back, and whether running it beside the
next step pays (``[adapt] overlap``; pure).

A change started with overlap runs in the background while the next step begins. Its
model-stages fall in two sets:

- ``held_back(...)``: those that must not work until the change is done: every
  model-stage it moves, retunes (engines restarted for other decode waves or recompute)
  or builds, and every model-stage with a device the change uses: the DAG's devices and
  the devices where engines stop and start again (the current and target devices of
  the model-stages it moves, retunes or builds). Their EMUs, engines and groups are in
  flux until the change is done.
- the rest keep their EMUs, engines and groups, on devices nothing of the change uses:
  they go on with the next step's work beside it.

``overlaps(mode, held, fixed_compute)`` resolves ``[adapt] overlap``: ``true`` and
``false`` as given; ``"auto"`` (the default) overlaps when every device the job uses is
a fixed unit of compute (a GPU, or a CPU worker under a core quota: ``cores_per_device``)
and the step's first work, generation (``FIRST_WORK``), is not held back. On shared
cores the work beside a change takes its cores from the change, and with generation
held back the step waits at its first call: in both there is nothing to gain.

Refuses (``ConfigError``): an overlap mode other than ``true``, ``false`` or ``"auto"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nereus.config import require
from nereus.planner.plan import StagePlan

__all__ = ["FIRST_WORK", "OVERLAP_MODES", "check_mode", "held_back", "overlaps"]

# the first work of every synchronous step (GRPO, PPO and ReMax all start by generating)
FIRST_WORK = "policy_generation"
OVERLAP_MODES = (True, False, "auto")


def check_mode(mode: Any, field: str = "adapt.overlap") -> bool | str:
    """``mode`` when it is ``true``, ``false`` or ``"auto"``; ``ConfigError`` otherwise."""
    require(
        isinstance(mode, bool) or mode == "auto",
        field,
        mode,
        'must be true, false or "auto"',
    )
    return mode


def held_back(
    current: Mapping[str, StagePlan],
    target: Mapping[str, StagePlan],
    changed: Iterable[str],
    touched: Iterable[int],
) -> set[str]:
    """The model-stages that may not work until the change is done (module docstring):
    ``changed`` (moved, retuned or built; ``current`` lacks the built ones) and every
    model-stage of ``current`` with a device in ``touched`` (the DAG's devices) or in
    the current or target placement of a changed one."""
    changed = set(changed)
    busy = set(touched)
    for stage in changed:
        if stage in current:
            busy |= current[stage].device_set
        if stage in target:
            busy |= target[stage].device_set
    return changed | {s for s, sp in current.items() if not busy.isdisjoint(sp.device_set)}


def overlaps(mode: bool | str, held: set[str], fixed_compute: bool) -> bool:
    """Whether a change runs beside the next step (module docstring)."""
    check_mode(mode)
    if mode == "auto":
        return fixed_compute and FIRST_WORK not in held
    return bool(mode)
