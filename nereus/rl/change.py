"""Planning a running job's change of plan: which primitives move which EMUs, and whether
every device's memory holds through it (pure: descriptions in, steps out).

``plan_change(current, target, ...)`` turns the EMUs every model-stage has now into the
EMUs the target plan asks for: for each model-stage whose layout, DP or devices change,
the state layer's local transition (``nereus.state.plan_stage_transition``: Split ->
Destroy -> Extend -> Merge through T_sub). Model-stages change one after another, in
an order that releases before it acquires (the ones that free bytes first; then any
that fits); each is checked against every device's budget counting what the other
model-stages hold at that moment and one transfer bucket. After the last one, what the
engines will add back on each device (gradients of training EMUs, KV caches of
generation EMUs) must fit too. So a change that would break a budget is refused, with
``OutOfMemory`` naming the device, the need and the budget, before anything moves.

Result EMUs are named ``<model-stage>.<epoch>.<replica>`` (``emu_name``); their logical
state is the one every source carried.

Refuses: ``OutOfMemory`` (above), ``InfeasiblePlan`` (no source to Extend from, from the
state layer), ``ConfigError`` (a target that names other model-stages than the job's).
Nothing here runs anything: the job executes the steps on its workers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nereus.config import require
from nereus.errors import OutOfMemory
from nereus.planner.plan import Plan, StagePlan
from nereus.state.emu import EMU, DeviceSet, LogicalState
from nereus.state.layout import Layout
from nereus.state.memory import DEFAULT_BUCKET_BYTES
from nereus.state.spec import ModelSpec
from nereus.state.transition import StageTransition, plan_stage_transition

__all__ = ["StageChange", "PlannedChange", "plan_change", "stage_emus", "emu_name", "stage_changed"]

# bytes an engine adds on a device for an EMU beyond the store's tensors
EngineBytes = Callable[[str, EMU, int], int]


def emu_name(stage: str, epoch: int, replica: int) -> str:
    return f"{stage}.{epoch}.{replica}"


def stage_emus(stage: str, sp: StagePlan, spec: ModelSpec, slots: Sequence[str], epoch: int,
               state: LogicalState | None = None) -> list[EMU]:
    """The EMUs of ``stage`` under ``sp``, one per DP replica, named for ``epoch``."""
    layout = Layout(sp.tp, sp.pp)
    return [EMU(emu_name(stage, epoch, i), stage, spec, layout, tuple(devs), tuple(slots), state or LogicalState())
            for i, devs in enumerate(sp.devices)]


def stage_changed(a: StagePlan, b: StagePlan) -> bool:
    """Whether going from ``a`` to ``b`` moves any tensor (layout, DP or devices)."""
    return (a.tp, a.pp, a.devices) != (b.tp, b.pp, b.devices)


@dataclass(frozen=True)
class StageChange:
    """One model-stage's transition and the names its resulting EMUs take."""

    stage: str
    transition: StageTransition
    renames: tuple[tuple[str, str], ...]

    @property
    def bytes_moved(self) -> int:
        return self.transition.bytes_moved


@dataclass(frozen=True)
class PlannedChange:
    """Every model-stage's transition in execution order, the EMUs after, and the
    projected bytes per device: the peak during the change and what is held after it
    (engines included)."""

    changes: tuple[StageChange, ...]
    result: dict[str, list[EMU]]
    peak: dict[int, int]
    after: dict[int, int]

    @property
    def bytes_moved(self) -> int:
        return sum(c.bytes_moved for c in self.changes)


def _bytes(emus: Sequence[EMU]) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for e in emus:
        for d in e.devices:
            out[d] += e.bytes_on(d)
    return out


def plan_change(
    current: Mapping[str, Sequence[EMU]],
    target: Plan,
    devices: DeviceSet,
    *,
    epoch: int,
    resident: Mapping[int, int] | None = None,
    engine_bytes: EngineBytes | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> PlannedChange:
    """Plan the change from ``current`` (model-stage -> its EMUs) to ``target`` (see the
    module docstring). ``resident``: bytes per device held besides the model-stages' EMUs
    (default none); ``engine_bytes(stage, emu, device)``: what an engine adds back."""
    require(set(target.names) == set(current), "target plan", target.names,
            f"must place exactly the job's model-stages {sorted(current)}")
    other: dict[int, int] = defaultdict(int, resident or {})
    held = {stage: _bytes(emus) for stage, emus in current.items()}
    wanted = {}
    for stage, emus in current.items():
        sp = target[stage]
        now = StagePlan(emus[0].layout.tp, emus[0].layout.pp, len(emus), tuple(e.devices for e in emus))
        if stage_changed(now, sp):
            wanted[stage] = stage_emus(stage, sp, emus[0].spec, emus[0].slots, epoch, emus[0].state)
    result = {stage: list(emus) for stage, emus in current.items()}
    peak: dict[int, int] = defaultdict(int)

    def total(exclude: str | None = None) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int, other)
        for stage, per in held.items():
            if stage != exclude:
                for d, n in per.items():
                    out[d] += n
        return out

    def attempt(stage: str) -> StageTransition:
        used = total(exclude=stage)
        tr = plan_stage_transition(result[stage], wanted[stage], devices, used=used, bucket_bytes=bucket_bytes)
        for step in tr.steps:  # only a transition that fits counts towards the peak
            for d in step.memory.devices():
                peak[d] = max(peak[d], used.get(d, 0) + step.memory.peak.get(d, 0))
        return tr

    # release before acquire: model-stages that free bytes go first, then any that fits
    order = sorted(wanted, key=lambda s: sum(_bytes(wanted[s]).values()) - sum(held[s].values()))
    changes: list[StageChange] = []
    while order:
        failure: OutOfMemory | None = None
        for stage in order:
            try:
                tr = attempt(stage)
            except OutOfMemory as e:
                failure = failure or e
                continue
            break
        else:
            assert failure is not None
            raise failure
        order.remove(stage)
        renames = tuple((got.name, want.name) for got, want in zip(tr.result, wanted[stage], strict=True))
        changes.append(StageChange(stage, tr, renames))
        result[stage] = [want.with_(state=got.state) for got, want in zip(tr.result, wanted[stage], strict=True)]
        held[stage] = _bytes(result[stage])
    after = total()
    if engine_bytes is not None:
        for stage, emus in result.items():
            for e in emus:
                for d in e.devices:
                    after[d] += engine_bytes(stage, e, d)
    for d, need in sorted(after.items()):
        budget = devices.budget(d)
        if budget is not None and need > budget:
            raise OutOfMemory(d, need, budget, "the job's EMUs and their engines after the change")
    for d, n in after.items():
        peak[d] = max(peak[d], n)
    return PlannedChange(tuple(changes), result, dict(peak), dict(after))
