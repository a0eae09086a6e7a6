"""The one map between cluster device ids and planner slots."""

from __future__ import annotations

import pytest

from nereus.errors import ConfigError
from nereus.planner import DevicePool, Plan, StagePlan


def test_plans_map_between_device_ids_and_slots_both_ways():
    pool = DevicePool.of([4, 0, 2, 1])  # device 3 left, a node's device 4 joined
    assert pool.ids == (0, 1, 2, 4) and len(pool) == 4
    by_id = Plan(
        (
            ("policy_generation", StagePlan(1, 1, 2, ((0,), (4,)))),
            (
                "policy_training",
                StagePlan(2, 1, 1, ((2, 1),)),
            ),
        )
    )
    slots = pool.to_slots(by_id)
    assert slots["policy_generation"].devices == ((0,), (3,)) and slots[
        "policy_training"
    ].devices == ((2, 1),)
    assert pool.to_devices(slots) == by_id
    with pytest.raises(ConfigError, match="device=3 is not in the pool"):
        pool.to_slots(Plan((("policy_training", StagePlan(1, 1, 1, ((3,),))),)))
    with pytest.raises(ConfigError, match="slot=4"):
        pool.to_devices(Plan((("policy_training", StagePlan(1, 1, 1, ((4,),))),)))
    with pytest.raises(ConfigError, match="must not repeat"):
        DevicePool((1, 1))
