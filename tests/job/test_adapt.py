"""The controller loop in running jobs on real worker processes: a GRPO job whose length
cap grows moves before the step that would break a device's budget (the same job without
adaptation dies with OutOfMemory at the step the planner predicted); a PPO job with a
critic loses a device to a drain and gets it back through add_node; every change is
followed by a bitwise check of the logical state against a copy gathered before it; a
job left with no usable device waits for one to join, and stops with an error naming
its devices when none does."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from nereus.errors import OutOfMemory, RemoteError, StateError
from nereus.job.adapt import usable_devices
from nereus.job.loop import RLJob
from nereus.job.workload import predict_memory_failure
from nereus.planner import replay
from tests.job._jobs import job
from tests.job._state import assert_same_state, logical_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = {
    "kind": "tiny",
    "hidden_size": 64,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 4,
    "intermediate_size": 128,
    "max_seq_len": 96,
}
# the generation KV cache of the starting layout fits 11.5 MiB at a cap of 16, not at 64
GROWING = dict(
    model=MODEL,
    algorithm={"prompts_per_step": 16, "samples_per_prompt": 8},
    sampling={"max_new_tokens": [[0, 16], [4, 64]]},
    optim={"lr": 3e-3, "micro_batch_size": 2},
    cluster={"mode": "local", "devices": 4, "memory_per_device": "11.5MiB"},
    plan={
        "policy_generation": {"devices": [0, 1], "dp": 2},
        "policy_training": {"devices": [0, 1], "dp": 2},
    },
)


def checked_changes(rl: RLJob) -> list[dict]:
    """Wrap the job's apply_plan: gather the logical state before and after each change
    and compare them bitwise; returns the list the reports go into."""
    stages, seen = rl.stages, []
    original = stages.apply_plan

    async def apply_plan(target, *, overlap=False):
        before = await logical_state(stages, rl.dataset.position)
        report = await original(target, overlap=overlap)
        if report.get("overlapped"):
            report = await stages.transition_done()
        assert_same_state(before, await logical_state(stages, rl.dataset.position))
        seen.append(report)
        return report

    stages.apply_plan = apply_plan
    return seen


def tap_events(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "tap.jsonl").read_text().splitlines()]


def assert_replays(events: list[dict]) -> None:
    """The job's boundary reports, from its tap, run through a fresh Replanner give the
    decisions the job made, boundary by boundary."""
    boundaries = [e for e in events if e["type"] == "boundary"]
    assert boundaries and "replanner" in boundaries[0]
    _, outcomes = replay(boundaries)
    for recorded, again in zip(boundaries, outcomes, strict=True):
        d = again.decision
        assert (
            [t.kind for t in again.triggers],
            d.action,
            d.admitted,
            d.target.plan.to_dict() if d.target is not None else None,
        ) == (recorded["triggers"], recorded["action"], recorded["admitted"], recorded["target"]), (
            recorded["step"]
        )


async def test_a_growing_cap_moves_the_job_before_the_step_that_would_break_memory(tmp_path):
    rl = RLJob(job(str(tmp_path), 7, adapt={"enabled": True}, **GROWING))
    await rl.start()
    try:
        predicted = predict_memory_failure(
            rl.cfg,
            rl.model_config,
            rl.cfg.job_plan(),
            prompt_length=rl.max_prompt_tokens(),
            budget_bytes=rl.cfg.cluster.memory_bytes,
            devices=4,
        )
        assert predicted is not None and predicted.step == 4
        changes = checked_changes(rl)
        records = await rl._loop()
    finally:
        await rl.close()
    assert [r["step"] for r in records] == list(range(7))
    moved = [r for r in records if r.get("transition")]
    memory = [r for r in moved if any(t.startswith("memory") for t in r["transition"]["triggers"])]
    # the memory trigger fired on its own, at the boundary before the cap's step, and moved bytes
    assert memory and memory[0]["transition"]["step"] <= 4 and memory[0]["transition"]["bytes"] > 0
    assert changes and all(c["ok"] for c in changes)
    assert (
        max(int(p) for r in records[4:] for p in r["device_peak_bytes"].values())
        <= rl.cfg.cluster.memory_bytes
    )
    events = tap_events(tmp_path)
    decisions = [e for e in events if e["type"] == "decision"]
    assert decisions and all(
        {"triggers", "current_plan", "admitted", "reason"} <= e.keys() for e in decisions
    )
    trig = next(t for e in decisions for t in e["triggers"] if t["kind"] == "memory")
    assert trig["detail"] == "over-budget" and trig["need_bytes"] > trig["budget_bytes"]
    kinds = {e["type"] for e in events}
    assert {"transition", "transition_node", "step", "weight_sync", "boundary"} <= kinds
    assert_replays(events)


async def test_without_adaptation_the_job_dies_at_the_predicted_step(tmp_path):
    rl = RLJob(job(str(tmp_path), 7, adapt={"enabled": False}, **GROWING))
    await rl.start()
    try:
        predicted = predict_memory_failure(
            rl.cfg,
            rl.model_config,
            rl.cfg.job_plan(),
            prompt_length=rl.max_prompt_tokens(),
            budget_bytes=rl.cfg.cluster.memory_bytes,
            devices=4,
        )
        with pytest.raises((OutOfMemory, RemoteError)) as info:
            await rl._loop()
    finally:
        await rl.close()
    err = info.value
    assert isinstance(err, OutOfMemory) or err.remote_type == "OutOfMemory"
    assert predicted is not None and abs(rl.step - predicted.step) <= 1


PPO_PLAN = {
    "policy_generation": {"devices": [0, 1], "dp": 2},
    "reference_inference": {"devices": [2]},
    "critic_inference": {"devices": [3]},
    "policy_training": {"devices": [0, 1], "dp": 2},
    "critic_training": {"devices": [2, 3], "dp": 2},
}


async def test_a_ppo_job_gives_up_a_drained_device_and_takes_a_new_one_back(tmp_path):
    cfg = job(
        str(tmp_path),
        6,
        algorithm={"name": "ppo", "samples_per_prompt": 4, "kl_coef": 0.01, "kl_mode": "penalty"},
        cluster={"mode": "local", "devices": 4, "memory_per_device": "512MiB"},
        plan=PPO_PLAN,
        adapt={"enabled": True, "join_horizon_steps": 1000},
    )
    rl = RLJob(cfg)
    added: list[int] = []

    async def pool(job_: RLJob, record: dict) -> None:
        if job_.step == 2:
            job_.stages.cluster.drain(1)
        elif job_.step == 3:
            added.extend(await job_.stages.cluster.add_node(1))

    rl.boundary_hooks.append(pool)
    await rl.start()
    try:
        changes = checked_changes(rl)
        records = await rl._loop()
        final = rl.stages.plan
    finally:
        await rl.close()
    assert [r["step"] for r in records] == list(range(6))
    triggers = {t for r in records if r.get("transition") for t in r["transition"]["triggers"]}
    assert "device-pool:drained" in triggers
    assert 1 not in final.devices and changes and all(c["ok"] for c in changes)
    events = tap_events(tmp_path)
    assert_replays(events)
    decisions = [e for e in events if e["type"] == "decision"]
    joined = [e for e in decisions if any(t["detail"] == "joined" for t in e["triggers"])]
    assert joined and joined[0]["triggers"][0]["devices"] == added  # judged by the payback rule
    assert joined[0]["limit_steps"] is not None


class _Pool:
    """A cluster's device view as ``usable_devices`` reads it: ``joins`` lists the
    devices the controller reports from each refresh on (the last one stays)."""

    def __init__(self, live: list[int], draining: set[int], joins: list[list[int]]) -> None:
        self.devices = [SimpleNamespace(index=d) for d in live]
        self.draining = frozenset(draining)
        self.joins, self.refreshes = joins, 0

    async def refresh_devices(self):
        self.refreshes += 1
        if self.joins:
            live = self.joins[min(self.refreshes, len(self.joins)) - 1]
            self.devices = [SimpleNamespace(index=d) for d in live]
        return self.devices


async def test_a_job_with_no_usable_device_waits_for_one_to_join():
    # every live device drains and the others died: nothing to plan on until device 7 joins
    pool = _Pool([3], {3}, [[3], [3], [3, 7]])
    live, draining = await usable_devices(pool, 30.0)
    assert live - draining == {7} and pool.refreshes == 3
    # a usable device: no wait, no refresh beyond the caller's
    pool = _Pool([0, 3], {3}, [])
    assert await usable_devices(pool, 30.0) == ({0, 3}, {3}) and pool.refreshes == 0


async def test_a_job_whose_pool_stays_empty_stops_naming_what_is_live_and_draining():
    pool = _Pool([3], {3, 5}, [])
    with pytest.raises(
        StateError,
        match=r"no usable device: live \[3\], draining \[3\]; none joined within "
        r"adapt.pool_wait_s=0.3 s",
    ):
        await usable_devices(pool, 0.3)
    assert pool.refreshes >= 2
