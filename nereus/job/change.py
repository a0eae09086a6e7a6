"""A running job's EMUs under a plan, and what its engines add after a change (pure).

- ``stage_emus(stage, stage_plan, spec, slots)``: the EMUs of a model-stage under a
  ``StagePlan``, one per DP replica, named ``<model-stage>.<replica>`` (``emu_name``).
  A model-stage keeps those names across changes: a transition builds its targets
  under other names (``nereus.transition.build_dag``: ``<model-stage>.next<replica>``)
  and the job renames them once it is done, so a transition that recurs (a layout
  switched back and forth, every weight sync) has the same names and the state layer
  plans it once.
- ``stage_changed(a, b)``: whether a model-stage moves at all between two StagePlans.
- ``check_after(dag, engine_bytes)``: what every device holds once the transition DAG
  has run, plus what the engines started afterwards add (a training EMU's gradients, a
  generation EMU's KV cache), against every device's cap: ``OutOfMemory`` naming the
  device, the need and the cap, before anything moves. The DAG itself checks every
  device through the change (``InfeasibleTransition``).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nereus.errors import OutOfMemory
from nereus.planner.plan import StagePlan
from nereus.state.emu import EMU, LogicalState
from nereus.state.layout import Layout
from nereus.state.spec import ModelSpec
from nereus.transition.dag import TransitionDAG, stage_moves

__all__ = ["STAGE_KINDS", "stage_emus", "emu_name", "stage_changed", "check_after", "after_bytes"]

# the kind of engine each model-stage runs
STAGE_KINDS = {
    "policy_generation": "generation",
    "reference_inference": "inference",
    "critic_inference": "inference",
    "reward_inference": "inference",
    "policy_training": "training",
    "critic_training": "training",
}

# bytes an engine adds on a device for an EMU beyond the store's tensors
EngineBytes = Callable[[str, EMU, int], int]


def emu_name(stage: str, replica: int, tag: str = "") -> str:
    """``<model-stage>.<replica>``, or ``<model-stage>.<tag><replica>``."""
    return f"{stage}.{tag}{replica}"


def stage_emus(
    stage: str,
    sp: StagePlan,
    spec: ModelSpec,
    slots: Sequence[str],
    tag: str = "",
    state: LogicalState | None = None,
) -> list[EMU]:
    """The EMUs of ``stage`` under ``sp``, one per DP replica (names: ``emu_name``)."""
    layout = Layout(sp.tp, sp.pp)
    return [
        EMU(
            emu_name(stage, i, tag),
            stage,
            spec,
            layout,
            tuple(devs),
            tuple(slots),
            state or LogicalState(),
        )
        for i, devs in enumerate(sp.devices)
    ]


def stage_changed(a: StagePlan, b: StagePlan) -> bool:
    """Whether going from ``a`` to ``b`` moves any tensor (layout, DP or devices)."""
    return stage_moves(a, b)


def after_bytes(dag: TransitionDAG) -> dict[int, int]:
    """What every device holds once every node of ``dag`` has run."""
    out = dict(dag.initial)
    for n in dag.nodes:
        for d in n.devices:
            out[d] = out.get(d, 0) + n.alloc.get(d, 0) - n.release.get(d, 0)
    return out


def check_after(dag: TransitionDAG, engines: dict[int, int]) -> dict[int, int]:
    """``after_bytes`` plus ``engines`` (device -> bytes the restarted engines add),
    checked against every device's cap; returns the total per device."""
    total = after_bytes(dag)
    for d, extra in engines.items():
        total[d] = total.get(d, 0) + extra
    for d, need in sorted(total.items()):
        cap = dag.caps.get(d)
        if cap is not None and need > cap:
            raise OutOfMemory(d, need, cap, "the job's EMUs and their engines after the change")
    return total
