"""Each of the four policies (``[adapt] policy``) runs a short PPO job with a critic on
real worker processes while a spot-availability trace (``[trace] pool``) drains a device
and returns one through the cluster API: every step completes, the logical state is
bitwise intact after every change, ``static`` never changes a model-stage's TP or PP,
and the job's boundary reports replay to the decisions it took (the definition the
simulator runs)."""

from __future__ import annotations

import pytest

from nereus.job.loop import RLJob
from nereus.planner.policies import POLICIES
from tests.job._jobs import TRACES, job
from tests.job.test_adapt import PPO_PLAN, assert_replays, checked_changes, tap_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SPOT = TRACES / "spot-availability" / "us-west-2a_v100_1.json"
# from this tick on, one tick a step and counts mapped onto 2..4 devices: 4, 4, 3, 3, 4
OFFSET = 35


def _devices(plan: dict) -> set[int]:
    out: set[int] = set()
    for p in plan.values():
        for d in p["devices"]:
            out |= set(d) if isinstance(d, list) else {d}
    return out


def _layouts(plan: dict) -> dict[str, tuple[int, int]]:
    return {name: (p["tp"], p["pp"]) for name, p in plan.items()}


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_ppo_job_runs_a_pool_trace_under_each_policy(tmp_path, policy):
    if not SPOT.is_file():
        pytest.fail(
            f"the spot trace {SPOT} is missing (../shared/traces must resolve from the repository)"
        )
    cfg = job(
        str(tmp_path),
        5,
        algorithm={"name": "ppo", "samples_per_prompt": 4, "kl_coef": 0.01, "kl_mode": "penalty"},
        cluster={"mode": "local", "devices": 4, "memory_per_device": "512MiB"},
        plan=PPO_PLAN,
        adapt={"enabled": True, "policy": policy, "every_k": 3, "join_horizon_steps": 1000},
        trace={"pool": str(SPOT), "pool_offset": OFFSET},
    )
    rl = RLJob(cfg)
    await rl.start()
    try:
        assert rl.pool_trace is not None and rl.pool_trace.counts == [4, 4, 3, 3, 4]
        start = rl.stages.plan.to_dict()
        changes = checked_changes(rl)
        records = await rl._loop()
        events_of_trace = list(rl.pool_trace.events)
    finally:
        await rl.close()
    assert [r["step"] for r in records] == list(range(5))
    assert [(s, kind) for s, kind, _ in events_of_trace] == [(2, "drain"), (4, "join")]
    drained = events_of_trace[0][2]
    assert changes and all(
        c["ok"] for c in changes
    )  # the logical state after each change is the one before
    moved = [r["transition"] for r in records if r.get("transition")]
    assert any("device-pool:drained" in t["triggers"] for t in moved)
    after_drain = next(t for t in moved if "device-pool:drained" in t["triggers"])
    assert not set(drained) & _devices(after_drain["to"])
    if policy == "static":
        for t in moved:
            assert _layouts(t["to"]) == _layouts(start), t
    events = tap_events(tmp_path)
    assert_replays(events)
    boundaries = [e for e in events if e["type"] == "boundary"]
    assert boundaries[0]["replanner"]["policy"] == policy
    if policy == "every-k":  # step 3: nothing fired, the period searches; the join at 4 waits for 6
        by_step = {b["step"]: b for b in boundaries}
        assert by_step[3]["triggers"] == ["periodic"] and by_step[4]["action"] == "keep"
