"""A move the search lays out from device 0 against the same move relabelled onto the
running plan's nodes: a TP 4 x PP 4 EMU spread over nodes 0, 1, 2 and 4 of 4-device
nodes, DP doubled. Laid out from 0, both target replicas overlap the EMU, so no target
has a replica inside it or a source disjoint from it; the state layer falls back to a
1 x 1 T_sub, a whole model with its optimizer state on one device, and a device cap of
four shards refuses it. Relabelled, the EMU stays as it is and the new replica is one
Extend onto the four free nodes, well under the cap."""

from __future__ import annotations

import pytest

from nereus.errors import InfeasibleTransition
from nereus.planner import Plan, StagePlan, relabel
from nereus.state import training_slots
from nereus.transition import build_dag
from tests.state.helpers import spec_for

SPEC = spec_for(layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=64)
SLOTS = {"policy_training": training_slots("float32")}
EMU_DEVICES = (*range(12), *range(16, 20))
CURRENT = Plan((("policy_training", StagePlan(4, 4, 1, (EMU_DEVICES,))),))
FROM_ZERO = Plan((("policy_training", StagePlan.on_range(4, 4, 2, 0)),))


def _cap() -> int:
    """Four times a device's even share of the EMU (parameters and optimizer state)."""
    return 4 * len(SLOTS["policy_training"]) * SPEC.nbytes // 16


def _dag(target: Plan):
    return build_dag(
        CURRENT,
        target,
        {"policy_training": SPEC},
        lambda d: _cap(),
        slots=SLOTS,
        host_of=lambda d: d // 4,
    )


def test_the_move_laid_out_from_zero_is_refused_on_memory():
    with pytest.raises(InfeasibleTransition) as info:
        _dag(FROM_ZERO)
    assert info.value.need_bytes > info.value.cap_bytes == _cap()


def test_the_relabelled_move_keeps_the_emu_and_extends_onto_the_free_nodes():
    target = relabel(CURRENT, FROM_ZERO, devices_per_node=4, devices=32)
    dag = _dag(target)
    assert [n.kind for n in dag.nodes] == ["extend"]
    assert set(dag.nodes[0].devices or ()) >= {12, 13, 14, 15, *range(20, 32)}
