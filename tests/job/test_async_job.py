"""Asynchronous RL on a real local cluster: generation and training at once, the staleness
bound on every token, each position trained once, a straggler carried not dropped, resume
trains the same positions, a killed generation worker's groups regenerated, and the reward
rises over that run (first vs last quarter); with refill (continuous batching, the
default) and without.

These start worker processes (no ``integration`` marker exists in this tree)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest

from nereus.job.async_loop import AsyncRun
from nereus.job.loop import RLJob
from nereus.job.traces import response_lengths
from tests._leaks import children, shm_segments, wait_gone
from tests.job._jobs import TRACES, job

B = 8  # prompts per step
TOPS = TRACES / "response-length" / "areal-fork-qwen2.5-0.5b-grpo-gsm8k-a40-reasoning.json"
PLAN = {"policy_generation": {"devices": [1, 2], "dp": 2}, "policy_training": {"devices": [0]}}
CLUSTER = {"mode": "local", "devices": 3, "memory_per_device": "256MiB"}


def _config(out: str, steps: int, **rl):
    # one decode step per call: the straggler is slowed per step and syncs land mid-flight
    # in these short responses (the default takes 8 steps a call)
    return job(
        out,
        steps,
        cluster=CLUSTER,
        plan=PLAN,
        rl={"mode": "async", "decode_steps_per_call": 1, **rl},
        run={
            "steps": steps,
            "out_dir": out,
            "progress": False,
            "seed": 0,
            "checkpoint_every": steps // 2,
        },
    )


def _check_tokens(run: AsyncRun, k: int) -> None:
    """Every token of every trained sample within k versions; versions monotone per row."""
    for version, _, _, rows in run.trained_log:
        for row in rows:
            assert all(0 <= version - v <= k for v in row), (version, row)
            assert row == sorted(row), row


async def _run(
    cfg, straggler: int | None = None, delay_s: float = 0.0, hook=None
) -> tuple[RLJob, AsyncRun]:
    rl = RLJob(cfg)
    await rl.start()
    try:
        run = AsyncRun(rl)
        if delay_s > 0:
            advance = run._advance

            async def slowed(w, args):
                # the EMU holding the straggler (without one, every EMU) decodes slowly
                if straggler is None or straggler in w.current:
                    await asyncio.sleep(delay_s)
                return await advance(w, args)

            run._advance = slowed
        rl.async_run = run
        if hook is not None:
            rl.boundary_hooks.append(hook)
        await run.run()
        return rl, run
    finally:
        await rl.close()


def _own_segments() -> set[str]:
    """Shared-memory segments this process created (other jobs share the machine)."""
    return {p for p in shm_segments() if p.startswith(f"/dev/shm/nereus-{os.getpid()}-")}


@pytest.fixture
def no_leaks():
    procs, segments = children(), _own_segments()
    yield
    assert not wait_gone(children() - procs, timeout_s=10), "leaked worker processes"
    assert _own_segments() <= segments, "leaked shared-memory segments"


@pytest.fixture
def no_leaked_processes():
    """For a test that SIGKILLs a worker: a transfer group with a member killed mid-run
    leaves the segments of its shared-memory channels behind (the runtime does not reap
    them); they are this test's, so it removes them."""
    procs, segments = children(), _own_segments()
    yield
    assert not wait_gone(children() - procs, timeout_s=10), "leaked worker processes"
    for path in _own_segments() - segments:
        os.unlink(path)


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_async_bound_order_straggler_plan_change_and_resume(tmp_path, no_leaks):
    steps, k, straggler = 60, 2, 13
    cfg = _config(str(tmp_path / "a"), steps, max_staleness=k, partial_rollout=True)
    moved: dict[str, object] = {}

    async def move(job: RLJob, record) -> None:
        # a plan change at a weight sync, mid-run: generation from devices 1-2 to 2, training
        # from 0 to 0-1 (the mechanism the async adapter uses: pause, transition, resume)
        if record["step"] != 40:
            return
        target = {
            "policy_generation": {"devices": [2]},
            "policy_training": {"devices": [0, 1], "dp": 2},
        }
        plan = type(cfg)(
            **{
                **cfg.__dict__,
                "plan": {n: type(cfg.plan["policy_training"])(**p) for n, p in target.items()},
            }
        ).job_plan()
        await job.async_run.pause()
        moved["report"] = await job.apply_plan(plan)
        await job.async_run.resume()
        moved["plan"] = job.stages.plan

    rl, run = await _run(cfg, straggler=straggler, delay_s=0.25, hook=move)
    assert [e for sp in [moved["plan"]["policy_generation"]] for e in sp.devices] == [(2,)]
    assert [w.emu.devices for w in run.workers] == [(2,)]
    records = run.records
    assert len(records) == steps and rl.step == steps
    positions = [p for r in records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * B)), "a position was trained twice or skipped"
    assert all(len(r["positions"]) == B for r in records)
    _check_tokens(run, k)
    assert run.summary["max_staleness_seen"] <= k and run.summary["samples_discarded"] == 0
    # the straggler was carried past its own batch, trained within the bound, never dropped
    at = next(v for v, p, _, _ in run.trained_log if p == straggler)
    assert at > straggler // B, (at, straggler)
    # partial rollouts: some sequences took a sync mid-flight
    assert any(len(set(row)) > 1 for _, _, _, rows in run.trained_log for row in rows)

    # resume from the checkpoint in the middle: the same positions, each once, same samples
    half = tmp_path / "b"
    (half / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "a" / "checkpoints" / f"step_{steps // 2}",
        half / "checkpoints" / f"step_{steps // 2}",
    )
    cfg_b = _config(str(half), steps, max_staleness=k, partial_rollout=True)
    cfg_b = type(cfg_b)(
        **{**cfg_b.__dict__, "run": type(cfg_b.run)(**{**cfg_b.run.__dict__, "resume": True})}
    )
    rl_b, run_b = await _run(cfg_b)
    assert len(run_b.records) == steps - steps // 2
    before = {p for r in records[: steps // 2] for p in r["positions"]}
    after_a = sorted(p for r in records[steps // 2 :] for p in r["positions"])
    after_b = sorted(p for r in run_b.records for p in r["positions"])
    assert after_b == after_a and not before & set(after_b)
    sample_a = {p: s for _, p, s, _ in run.trained_log}
    assert all(sample_a[p] == s for _, p, s, _ in run_b.trained_log)
    _check_tokens(run_b, k)


def _pid(cluster, device: int) -> int:
    return next(w.proc.pid for node in cluster.nodes for w in node.workers if w.index == device)


def kill_at_next_call(rl: RLJob, victims: list, devices: list[int], seen: dict) -> None:
    """SIGKILL the workers of ``devices`` once, as the driver sends one of ``victims``
    (generation workers) its next decode call: that worker's request is then open with
    rows not done, which go to ``seen["in_flight"]``. Killing at the call, not at a moment
    the test picks, keeps the death from landing after the request's last reply is already
    on its way (nothing would be left to lose)."""
    run = rl.async_run
    advance = run._advance

    async def advance_or_kill(w, args):
        if w in victims and "in_flight" not in seen:
            seen["in_flight"] = list(w.current)
            for d in devices:
                os.kill(_pid(rl.stages.cluster, d), signal.SIGKILL)
        return await advance(w, args)

    run._advance = advance_or_kill


def _kill_device_2_after_update_3(killed: dict[str, list[int]]):
    """A boundary hook that, after update 3, kills the generation worker of device 2 at
    its next decode call (``kill_at_next_call``)."""

    async def arm(rl: RLJob, record) -> None:
        if record["step"] != 3 or "armed" in killed:
            return
        killed["armed"] = []
        victim = next(w for w in rl.async_run.workers if 2 in w.emu.devices)
        kill_at_next_call(rl, [victim], [2], killed)

    return arm


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_a_killed_generation_worker_loses_only_its_unfinished_groups_and_reward_rises(
    tmp_path, no_leaked_processes
):
    steps, k = 100, 1
    cfg = _config(str(tmp_path), steps, max_staleness=k, partial_rollout=False)
    killed: dict[str, list[int]] = {}
    kill = _kill_device_2_after_update_3(killed)

    rl = RLJob(cfg)
    await rl.start()
    try:
        run = AsyncRun(rl)
        rl.async_run = run
        rl.boundary_hooks.append(kill)
        await run.run()
        counts = await asyncio.gather(
            *(
                rl.stages.hosts[d].get_state.call_one(e.name)
                for e in rl.stages.emus["policy_training"]
                for d in e.devices[:1]
            )
        )
    finally:
        await rl.close()
    assert killed["in_flight"], "the victim had nothing in flight"
    positions = [p for r in run.records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * B))
    assert run.ledger.regenerated_groups >= 1 and run.summary["samples_discarded"] == 0
    assert [w.emu.devices for w in run.workers] == [(1,)]
    assert [c["update_count"] for c in counts] == [
        steps
    ]  # logical state intact: one update per step
    _check_tokens(run, k)
    quarter = steps // 4
    early = sum(r["reward_mean"] for r in run.records[:quarter]) / quarter
    late = sum(r["reward_mean"] for r in run.records[-quarter:]) / quarter
    assert late > early + 0.1, (early, late)


def _refill_config(out: str, steps: int, k: int, **rl):
    """Responses of drawn lengths (a long tail) up to 24 tokens, two decode steps a call."""
    return job(
        out,
        steps,
        sampling={"max_new_tokens": 24},
        trace={"lengths": str(TOPS)},
        cluster=CLUSTER,
        plan=PLAN,
        rl={"mode": "async", "max_staleness": k, "decode_steps_per_call": 2, "refill": True, **rl},
        run={"steps": steps, "out_dir": out, "progress": False, "seed": 0},
    )


def _check_refill_run(rl: RLJob, run: AsyncRun, steps: int, k: int) -> None:
    """Each position trained once, every token within the bound, nothing discarded, and
    every trained response exactly its drawn length (a refilled row's own bound)."""
    positions = [p for r in run.records for p in r["positions"]]
    assert sorted(positions) == list(range(steps * B)), "a position trained twice or skipped"
    _check_tokens(run, k)
    summary = run.summary
    assert summary["max_staleness_seen"] <= k and summary["samples_discarded"] == 0
    for _, position, index, rows in run.trained_log:
        drawn = response_lengths(rl.cfg, position // B, [index], run.K)
        assert [len(r) for r in rows] == drawn, position


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_refill_keeps_every_invariant_through_a_killed_generation_worker(
    tmp_path, no_leaked_processes
):
    """Continuous batching (asked for: it is off by default) without partial rollouts:
    done slots take new entries, an EMU that needs newer weights drains its request
    first, and a killed generation worker's entries, first or refilled, are issued
    again."""
    steps, k = 12, 1
    cfg = _refill_config(str(tmp_path), steps, k, partial_rollout=False)
    assert cfg.rl.refill
    killed: dict[str, list[int]] = {}
    kill = _kill_device_2_after_update_3(killed)

    rl, run = await _run(cfg, hook=kill)
    assert killed["in_flight"], "the victim had nothing in flight"
    _check_refill_run(rl, run, steps, k)
    assert run.summary["regenerated_groups"] >= 1
    assert [w.emu.devices for w in run.workers] == [(1,)]
    assert run.summary["refilled_entries"] > 0
    # without partial rollouts every row of an entry is of one version
    assert all(len({v for row in rows for v in row}) <= 1 for _, _, _, rows in run.trained_log)


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_refill_costs_fewer_decode_calls_per_entry(tmp_path, no_leaks):
    """The same run with refill on and off, generation the bottleneck (each decode call
    slowed): with refill an entry costs fewer calls, since done slots do not idle until a
    request's longest row ends."""
    steps, k = 12, 2
    calls_per_entry = {}
    for refill in (True, False):
        out = str(tmp_path / f"refill-{refill}")
        cfg = _refill_config(out, steps, k, partial_rollout=True, refill=refill)
        rl, run = await _run(cfg, delay_s=0.02)
        _check_refill_run(rl, run, steps, k)
        summary = run.summary
        assert (summary["refilled_entries"] > 0) == refill, summary
        calls_per_entry[refill] = summary["decode_calls"] / (steps * B)
    assert calls_per_entry[True] < 0.9 * calls_per_entry[False], calls_per_entry
