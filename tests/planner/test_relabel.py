"""relabel: a target laid out from device 0 moved onto the devices the current plan uses,
whole nodes at a time."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError
from nereus.planner import (
    LengthStats,
    Plan,
    StagePlan,
    Workload,
    cluster_preset,
    model_preset,
    relabel,
    search,
)


def _overlap(current: Plan, target: Plan) -> int:
    """Devices where a model-stage of the target sits where it sits now."""
    return sum(len(sp.device_set & current[name].device_set) for name, sp in target)


def _check_moved(target: Plan, got: Plan, per: int, devices: int) -> None:
    assert got.names == target.names
    onto: dict[int, int] = {}
    for (name, want), (_, sp) in zip(target, got, strict=True):
        assert (sp.tp, sp.pp, sp.dp, sp.recompute, sp.waves) == (
            want.tp,
            want.pp,
            want.dp,
            want.recompute,
            want.waves,
        )
        for a, b in zip(want.devices, sp.devices, strict=True):
            for x, y in zip(a, b, strict=True):
                assert x % per == y % per, (name, x, y)  # the same place in the node
                assert onto.setdefault(x // per, y // per) == y // per  # whole nodes move together
                assert y < devices
    assert len(set(onto.values())) == len(onto)  # one target node per node


def test_a_plan_that_already_fits_the_current_devices_comes_back_unchanged():
    work = Workload.for_models(
        "ppo",
        model_preset("llama-8b"),
        prompts_per_step=256,
        samples_per_prompt=4,
        prompt_length=512,
        lengths=LengthStats(2048, 3686, 4096),
    )
    cluster = cluster_preset("mi250x-1024")
    small = search(work, cluster, budget=512, alternatives=False).plan
    big = search(work, cluster, budget=1024, alternatives=False).plan
    assert relabel(small, big, devices_per_node=8, devices=1024) is big
    assert relabel(big, big, devices_per_node=8) is big


def test_a_target_laid_out_from_zero_moves_onto_the_nodes_the_job_uses():
    current = Plan(
        (
            ("policy-generation", StagePlan.on_range(2, 1, 2, 8)),
            ("policy-training", StagePlan.on_range(4, 1, 1, 12)),
        )
    )
    target = Plan(
        (
            ("policy-generation", StagePlan.on_range(2, 1, 4, 0)),
            ("policy-training", StagePlan.on_range(4, 1, 1, 8)),
        )
    )
    got = relabel(current, target, devices_per_node=4, devices=16)
    _check_moved(target, got, 4, 16)
    # generation keeps nodes 2 and 3's... its current node (2), training its node (3)
    assert got["policy-training"].device_set == current["policy-training"].device_set
    assert current["policy-generation"].device_set <= got["policy-generation"].device_set
    assert _overlap(current, got) == 8 > _overlap(current, target)


def test_lost_nodes_are_not_used_and_a_target_too_big_is_refused():
    current = Plan((("policy-generation", StagePlan.on_range(1, 1, 4, 4)),))
    target = Plan((("policy-generation", StagePlan.on_range(1, 1, 2, 0)),))
    got = relabel(current, target, devices_per_node=2, devices=6)
    _check_moved(target, got, 2, 6)
    assert got["policy-generation"].device_set <= {4, 5}
    with pytest.raises(ConfigError, match="must fit the 2 nodes available"):
        relabel(
            current,
            Plan((("policy-generation", StagePlan.on_range(1, 1, 6, 0)),)),
            devices_per_node=2,
            devices=4,
        )
    with pytest.raises(ConfigError, match="devices_per_node"):
        relabel(current, target, devices_per_node=0)


@st.composite
def cases(draw):
    per = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.integers(2, 8))
    devices = per * nodes
    plans = []
    for _ in range(2):
        stages, start = [], 0
        for name in ("policy-generation", "policy-training"):
            tp = draw(st.sampled_from([t for t in (1, 2, 4) if t <= per]))
            room = (devices - start) // tp
            if room < 1:
                start = 0
                room = devices // tp
            dp = draw(st.integers(1, min(room, 4)))
            stages.append((name, StagePlan.on_range(tp, 1, dp, start)))
            start = draw(st.sampled_from([start + tp * dp, 0])) if start + tp * dp < devices else 0
            if start % per:  # pools start on a node boundary (or inside one node)
                start = 0
        plans.append(Plan(tuple(stages)))
    return plans[0], plans[1], per, devices


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_relabel_moves_whole_nodes_and_never_keeps_less_in_place(case):
    current, target, per, devices = case
    got = relabel(current, target, devices_per_node=per, devices=devices)
    _check_moved(target, got, per, devices)
    assert _overlap(current, got) >= _overlap(current, target)
    assert relabel(current, got, devices_per_node=per, devices=devices) == got  # a fixed point


def test_a_pipeline_over_nodes_keeps_its_nodes_stage_for_stage_when_dp_doubles():
    # a TP 4 x PP 4 EMU on nodes 0, 1, 2 and 4 (node 3 was lost and came back): doubling
    # DP must keep it whole where it is and put the new replica on the four other nodes;
    # node by model-stage alone every node of the EMU looks alike and the target kept the
    # layout from zero, whose second replica overlaps the EMU (no disjoint source to
    # Extend from: the transition DAG fell back to a 1 x 1 T_sub that no device can hold)
    emu = (*range(12), *range(16, 20))
    current = Plan(
        (
            (
                "policy-generation",
                StagePlan(4, 1, 4, ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (16, 17, 18, 19))),
            ),
            ("policy-training", StagePlan(4, 4, 1, (emu,))),
        )
    )
    target = Plan(
        (
            ("policy-generation", StagePlan.on_range(4, 1, 8, 0)),
            ("policy-training", StagePlan.on_range(4, 4, 2, 0)),
        )
    )
    got = relabel(current, target, devices_per_node=4, devices=32)
    _check_moved(target, got, 4, 32)
    assert got["policy-training"].devices[0] == emu
    assert set(got["policy-training"].devices[1]).isdisjoint(emu)
    assert current["policy-generation"].device_set <= got["policy-generation"].device_set
