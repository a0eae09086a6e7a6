"""Faults in an asynchronous run recovered as in sync mode (``nereus.job.async_recovery``).

A policy-training worker killed mid-update: with its last copy gone the run restores the
newest checkpoint and rewinds its ledger with it; with a replica left the update is redone
(killed in training) or kept (killed in the weight sync after it). Every policy-generation
worker killed: rebuilt on the devices left with ``[adapt]``, a clear error without it or
when no device is left. In every recovered run each update trains once, no position or
sample is trained twice or skipped, every token is within the staleness bound and the
training EMUs' logical state is one update per step."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from nereus.errors import StateError
from nereus.job.async_loop import AsyncRun
from nereus.job.async_recovery import GenerationLost
from nereus.job.loop import RLJob
from nereus.planner.plan import Plan
from tests.job._jobs import job
from tests.job.test_async_job import (  # noqa: F401 (fixtures)
    B,
    _check_tokens,
    _pid,
    kill_at_next_call,
    no_leaked_processes,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

K = 1  # max_staleness


def _config(
    out: str, steps: int, devices: int, plan: dict, adapt: bool = True, epochs: int = 1, **rl
):
    return job(
        out,
        steps,
        algorithm={"prompts_per_step": B, "samples_per_prompt": 8, "epochs": epochs},
        cluster={"mode": "local", "devices": devices, "memory_per_device": "256MiB"},
        plan=plan,
        rl={"mode": "async", "max_staleness": K, **rl},
        # a gamma so small that only hard triggers (here: the lost devices) change the plan
        adapt={"enabled": adapt, "gamma": 1e-9, "length_drift": 5.0},
        run={"steps": steps, "out_dir": out, "progress": False, "seed": 0, "checkpoint_every": 4},
    )


def _kill(rl: RLJob, devices: list[int]) -> None:
    for d in devices:
        os.kill(_pid(rl.stages.cluster, d), signal.SIGKILL)


async def _run(cfg, arm) -> tuple[RLJob, AsyncRun, list[dict], Plan]:
    """Run ``cfg`` with ``arm(rl, run)`` setting up the kill; returns the job, the run, the
    training EMUs' logical state and the plan at the end."""
    rl = RLJob(cfg)
    await rl.start()
    try:
        run = AsyncRun(rl)
        rl.async_run = run
        arm(rl, run)
        await asyncio.wait_for(run.run(), 90)
        states = await asyncio.gather(
            *(
                rl.stages.hosts[e.devices[0]].get_state.call_one(e.name)
                for e in rl.stages.emus["policy_training"]
            )
        )
        return rl, run, states, rl.stages.plan
    finally:
        await rl.close()


def _check_run(
    rl: RLJob, run: AsyncRun, states: list[dict], steps: int, optimizer_steps: int | None = None
) -> None:
    """Each update trained once with B groups, every position and sample once, no token
    past the bound, one update per step in the training EMUs' logical state (their
    optimizer steps: ``optimizer_steps``, by default one per update)."""
    versions = [v for v, _, _, _ in run.trained_log]
    assert sorted(set(versions)) == list(range(steps))
    assert all(versions.count(v) == B for v in range(steps)), "an update trained twice"
    positions = sorted(p for _, p, _, _ in run.trained_log)
    assert positions == list(range(steps * B)), "a position was trained twice or skipped"
    samples = {p: s for _, p, s, _ in run.trained_log}
    assert all(rl.dataset.at(p).index == s for p, s in samples.items())
    assert len(set(samples.values())) == len(samples), "a sample trained in two updates"
    _check_tokens(run, K)
    assert run.summary["max_staleness_seen"] <= K and run.summary["samples_discarded"] == 0
    assert run.summary["samples_trained"] == steps * B * 8
    assert rl.step == steps and run.version == steps
    optimizer_steps = steps if optimizer_steps is None else optimizer_steps
    assert [s["update_count"] for s in states] == [optimizer_steps] * len(states)
    assert [s["policy_version"] for s in states] == [steps] * len(states)


def _tap(out) -> list[dict]:
    return [json.loads(line) for line in (out / "tap.jsonl").read_text().splitlines()]


async def test_a_killed_policy_training_worker_restores_the_checkpoint_and_rewinds(
    tmp_path,
    no_leaked_processes,  # noqa: F811
):
    steps, kill_at = 12, 6  # checkpoints at updates 4 and 8: update 6 goes back to step_4
    plan = {"policy_generation": {"devices": [1, 2], "dp": 2}, "policy_training": {"devices": [0]}}
    cfg = _config(str(tmp_path), steps, 3, plan, partial_rollout=True)
    seen: dict[str, object] = {}

    def arm(rl: RLJob, run: AsyncRun) -> None:
        train = rl.stages.train_policy

        async def killed_mid_update(batch, loss, kw):
            if rl.step == kill_at and not seen:
                # the update's own positions, and what was trained before the fault
                seen["log"] = list(run.trained_log)
                _kill(rl, [0])
            return await train(batch, loss, kw)

        rl.stages.train_policy = killed_mid_update

    rl, run, states, final = await _run(cfg, arm)
    assert seen, "the kill never happened"
    [fault] = rl.faults
    assert fault.restored_from == "step_4" and fault.missing == ["policy_training"]
    assert fault.devices == [0] and fault.during == "update" and not fault.redone
    # the record goes back with the ledger: each update recorded once, the redone ones
    assert [r["step"] for r in run.records] == list(range(steps))
    # the updates before the checkpoint stand as they were trained
    before = [t[:3] for t in seen["log"] if t[0] < 4]
    assert [t[:3] for t in run.trained_log if t[0] < 4] == before
    _check_run(rl, run, states, steps)
    assert 0 not in final.devices
    assert len(final["policy_training"].devices) == 1
    # every group trained (updates 4 and 5) or finished after the checkpoint was issued again
    assert run.summary["rewound_groups"] >= 2 * B
    events = _tap(tmp_path)
    [tap_fault] = [e for e in events if e["type"] == "fault"]
    assert tap_fault["restored_from"] == "step_4"
    assert tap_fault["rewound_groups"] == run.summary["rewound_groups"]
    [rewind] = [e for e in events if e["type"] == "rewind"]
    assert rewind["discarded_steps"] == [4, 5]
    lost = [e for e in events if e["type"] == "decision" and e["triggers"][0]["kind"] == "lost"]
    assert len(lost) == 1 and lost[0]["admitted"] and lost[0]["triggers"][0]["devices"] == [0]


@pytest.mark.parametrize("where", ["train", "sync", "epoch"])
async def test_a_killed_policy_training_replica_redoes_or_keeps_the_update(
    tmp_path,
    where,
    no_leaked_processes,  # noqa: F811
):
    steps, kill_at = 10, 5
    plan = {
        "policy_generation": {"devices": [2, 3], "dp": 2},
        "policy_training": {"devices": [0, 1], "dp": 2},
    }
    epochs = 2 if where == "epoch" else 1
    cfg = _config(str(tmp_path), steps, 4, plan, epochs=epochs, partial_rollout=where == "sync")
    seen: dict[str, object] = {}

    def arm(rl: RLJob, run: AsyncRun) -> None:
        # in training the survivor's gradient reduction fails: no replica steps (in the
        # second of two epochs: the first stepped, so the update stands, as in sync mode);
        # in the weight sync (partial rollouts: after the ledger committed it) it stands
        if where in ("train", "epoch"):
            train = rl.stages.train_policy
            calls: list[int] = []

            async def killed(*args):
                if rl.step == kill_at:
                    calls.append(1)
                if len(calls) == epochs and not seen:
                    seen["step"] = rl.step
                    _kill(rl, [0])
                return await train(*args)

            rl.stages.train_policy = killed
        else:
            publish = run._publish

            async def killed():
                if rl.step == kill_at and not seen:
                    # a replica the weight sync reads from, as it publishes the new weights
                    seen["victim"] = victim = min(
                        d for w in run.workers for d in w.plan.devices() if d not in w.emu.devices
                    )
                    _kill(rl, [victim])
                return await publish()

            run._publish = killed

    rl, run, states, final = await _run(cfg, arm)
    assert seen, "the kill never happened"
    [fault] = rl.faults
    if where == "train":
        assert fault.devices == [0] and not fault.restored_from and fault.missing == []
        assert fault.redone and not fault.committed
        # the redone update was recorded once
        assert [r["step"] for r in run.records] == list(range(steps))
        # the replan may give policy-training a second replica on a device left (the
        # planner's pick at the probe's prices); every replica's state is checked below
        assert 1 <= len(states) <= 2
    else:
        assert fault.devices == [seen.get("victim", 0)] and not fault.restored_from
        assert fault.committed and not fault.redone
        # the update stands; its record went with the fault, as in sync mode
        assert [r["step"] for r in run.records] == [s for s in range(steps) if s != kill_at]
    # the second epoch of the update the fault hit never stepped
    _check_run(rl, run, states, steps, epochs * steps - (where == "epoch"))


async def test_every_generation_worker_killed_is_rebuilt_on_the_devices_left(
    tmp_path,
    no_leaked_processes,  # noqa: F811
):
    steps, kill_at = 10, 3
    plan = {
        "policy_generation": {"devices": [2, 3], "dp": 2},
        "policy_training": {"devices": [0, 1], "dp": 2},
    }
    cfg = _config(str(tmp_path), steps, 4, plan, partial_rollout=False)
    seen: dict[str, object] = {}

    def arm(rl: RLJob, run: AsyncRun) -> None:
        async def kill(job_: RLJob, record) -> None:
            if record["step"] == kill_at and not seen:
                seen["armed"] = True
                kill_at_next_call(job_, list(run.workers), [2, 3], seen)

        rl.boundary_hooks.append(kill)

    rl, run, states, final = await _run(cfg, arm)
    assert "in_flight" in seen, "the kill never happened"
    [fault] = rl.faults
    assert fault.devices == [2, 3] and fault.missing == ["policy_generation"]
    assert not fault.restored_from
    # no spare device: training gave one of its two to the rebuilt generation EMU
    after = final
    assert set(after.devices) <= {0, 1}, after
    assert len(after["policy_generation"].devices) == 1
    assert len(after["policy_training"].devices) == 1
    assert [w.emu.devices for w in run.workers] == list(after["policy_generation"].devices)
    assert [r["step"] for r in run.records] == list(range(steps))
    _check_run(rl, run, states, steps)
    # the unfinished groups of the requests in flight were issued again
    assert seen["in_flight"] and run.ledger.regenerated_groups >= 1
    events = [e for e in _tap(tmp_path) if e["type"] == "fault"]
    assert {e["during"] for e in events if e["devices"] != [2, 3]} == {"generation"}
    [tap_fault] = [e for e in events if e["devices"] == [2, 3]]
    assert tap_fault["missing"] == ["policy_generation"]


@pytest.mark.parametrize("adapt", [False, True])
async def test_every_generation_worker_killed_with_no_way_back_is_a_clear_error(
    tmp_path,
    adapt,
    no_leaked_processes,  # noqa: F811
):
    # without [adapt], or with it but one device left (generation needs a device apart)
    steps, kill_at = 8, 2
    plan = {"policy_generation": {"devices": [1, 2], "dp": 2}, "policy_training": {"devices": [0]}}
    cfg = _config(str(tmp_path), steps, 3, plan, adapt=adapt, partial_rollout=True)

    def arm(rl: RLJob, run: AsyncRun) -> None:
        async def kill(job_: RLJob, record) -> None:
            if record["step"] == kill_at:
                _kill(job_, [1, 2])

        rl.boundary_hooks.append(kill)

    if adapt:
        with pytest.raises(StateError, match=r"devices left \[0\] cannot hold policy-generation"):
            await _run(cfg, arm)
    else:
        with pytest.raises(GenerationLost, match="every policy-generation EMU died"):
            await _run(cfg, arm)
