"""Plans written for people: a change of DP, of placement or of TP never reads as no change."""

from __future__ import annotations

from nereus.planner import Plan, StagePlan
from nereus.planner.plan_text import (
    devices_text,
    plan_changes,
    plan_text,
    stage_change_text,
    stage_plan_text,
)


def _sp(tp: int, pp: int, emus: list[list[int]], **kw) -> StagePlan:
    return StagePlan(tp, pp, len(emus), tuple(tuple(e) for e in emus), **kw)


def test_devices_are_sorted_with_runs_of_three_or_more_as_ranges():
    assert devices_text([1, 0]) == "[0,1]"
    assert devices_text([3, 2, 1, 0, 6, 7, 9]) == "[0-3,6,7,9]"
    assert devices_text(range(256)) == "[0-255]"
    assert devices_text([]) == "[]"


def test_a_dp_only_change_shows_dp_and_devices():
    text = stage_change_text(_sp(1, 1, [[0], [1]]), _sp(1, 1, [[0], [1], [2], [3]]))
    assert text == "tp1·pp1·dp2 [0,1] → tp1·pp1·dp4 [0-3]"


def test_a_placement_only_change_shows_the_devices_moving():
    text = stage_change_text(_sp(1, 1, [[0], [1]]), _sp(1, 1, [[2], [3]]))
    assert text == "tp1·pp1·dp2 [0,1] → tp1·pp1·dp2 [2,3]"
    before, after = text.split(" → ")
    assert before != after


def test_a_tp_change_on_the_same_devices():
    assert (
        stage_change_text(_sp(1, 1, [[0], [1]]), _sp(2, 1, [[0, 1]]))
        == "tp1·pp1·dp2 [0,1] → tp2·pp1·dp1 [0,1]"
    )


def test_the_same_devices_in_other_emus_show_each_emu():
    text = stage_change_text(_sp(2, 1, [[0, 1], [2, 3]]), _sp(2, 1, [[0, 2], [1, 3]]))
    assert text == "tp2·pp1·dp2 [0,1|2,3] → tp2·pp1·dp2 [0,2|1,3]"


def test_recompute_and_waves_are_written_where_set():
    assert stage_plan_text(_sp(1, 2, [[4, 5]], recompute=True)) == "tp1·pp2·dp1·recompute [4,5]"
    assert (
        stage_change_text(_sp(1, 1, [[2]]), _sp(1, 1, [[2]], waves=2))
        == "tp1·pp1·dp1 [2] → tp1·pp1·dp1·2 waves [2]"
    )


def test_the_plain_data_form_reads_as_the_plan_itself():
    plan = Plan(
        (
            ("policy_generation", _sp(1, 1, [[0], [1]], waves=2)),
            ("policy_training", _sp(2, 1, [[2, 3]])),
        )
    )
    data = plan.to_dict()
    assert (
        plan_text(data)
        == plan_text(plan)
        == ("policy_generation tp1·pp1·dp2·2 waves [0,1]; policy_training tp2·pp1·dp1 [2,3]")
    )
    # a tap event's plan may leave out dp, recompute and waves
    assert stage_plan_text({"tp": 1, "pp": 1, "devices": [[0], [1]]}) == "tp1·pp1·dp2 [0,1]"
    assert plan_text(None) == "-"


def test_plan_changes_lists_only_the_model_stages_that_moved():
    before = Plan(
        (
            ("policy_generation", _sp(1, 1, [[0], [1]])),
            ("policy_training", _sp(1, 1, [[0], [1]])),
            ("reference_inference", _sp(1, 1, [[0]])),
        )
    )
    after = Plan(
        (
            ("policy_generation", _sp(1, 1, [[0], [1]])),
            ("policy_training", _sp(1, 1, [[2], [3]])),
            ("critic_inference", _sp(1, 1, [[1]])),
        )
    )
    assert plan_changes(before, after) == [
        ("policy_training", "tp1·pp1·dp2 [0,1] → tp1·pp1·dp2 [2,3]"),
        ("critic_inference", "– → tp1·pp1·dp1 [1]"),
        ("reference_inference", "tp1·pp1·dp1 [0] → –"),
    ]
    assert plan_changes(before.to_dict(), after.to_dict()) == plan_changes(before, after)
    assert plan_changes(before, before) == []
