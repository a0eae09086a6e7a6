"""PPO and ReMax in asynchronous mode on a real local cluster (worker processes): every
token of every update within the staleness bound, no entry (nor, with one sample per
prompt, sample index) in two updates and none skipped, the training EMUs' logical state
intact (one update per step); PPO's critic trained (its weights change) beside the
policy, and carried through a plan change at a weight sync that moves it; ReMax's greedy
baseline decoded by the generation EMU for the entry's own prompt, greedily, and never
trained on."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from nereus.job.async_loop import AsyncRun
from nereus.job.config import Placement
from nereus.job.loop import RLJob
from nereus.rl.async_buffer import Group
from tests.job._jobs import job
from tests.job._state import logical_state
from tests.job.test_async_job import _check_tokens, no_leaks  # noqa: F401 (fixture)

B = 8  # prompts per step
CLUSTER = {"mode": "local", "devices": 3, "memory_per_device": "256MiB"}
GENERATION = {"policy_generation": {"devices": [1, 2], "dp": 2}}


async def _run(cfg, hook=None) -> tuple[AsyncRun, list[list[Group]], dict, dict, dict]:
    """The whole run; returns it, each update's entries, the logical state before and after,
    and, per training model-stage, each EMU's devices and update counter at the end."""
    rl = RLJob(cfg)
    await rl.start()
    try:
        run = AsyncRun(rl)
        rl.async_run = run
        if hook is not None:
            rl.boundary_hooks.append(hook)
        batches: list[list[Group]] = []
        update = run._update

        async def kept(groups: list[Group]):
            batches.append(list(groups))
            return await update(groups)

        run._update = kept
        before = await logical_state(rl.stages, 0)
        await run.run()
        after = await logical_state(rl.stages, 0)
        counts: dict[str, list] = {}
        for stage in ("policy_training", "critic_training"):
            emus = rl.stages.emus.get(stage, [])
            states = await asyncio.gather(
                *(rl.stages.hosts[e.devices[0]].get_state.call_one(e.name) for e in emus)
            )
            counts[stage] = [
                (e.devices, s["update_count"]) for e, s in zip(emus, states, strict=True)
            ]
    finally:
        await rl.close()
    return run, batches, before, after, counts


def _check_order(run: AsyncRun, batches: list[list[Group]], steps: int, entries: int) -> None:
    """Every entry once, none skipped; each update took its batch in entry order."""
    assert len(run.records) == steps
    positions = [p for r in run.records for p in r["positions"]]
    assert sorted(positions) == list(range(entries)), "an entry was trained twice or skipped"
    assert all(r["positions"] == sorted(r["positions"]) for r in run.records)
    assert [[g.position for g in b] for b in batches] == [r["positions"] for r in run.records]
    assert run.summary["samples_discarded"] == 0


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_async_ppo_trains_the_critic_within_the_bound_each_sample_once(tmp_path, no_leaks):  # noqa: F811
    steps, k = 12, 1
    cfg = job(
        str(tmp_path),
        steps,
        algorithm={
            "name": "ppo",
            "prompts_per_step": B,
            "samples_per_prompt": 1,
            "kl_coef": 0.05,
            "kl_mode": "penalty",
        },
        cluster=CLUSTER,
        plan={
            **GENERATION,
            "reference_inference": {"devices": [0]},
            "critic_inference": {"devices": [0]},
            "policy_training": {"devices": [0]},
            "critic_training": {"devices": [0]},
        },
        rl={"mode": "async", "max_staleness": k, "partial_rollout": True},
        run={"steps": steps, "out_dir": str(tmp_path), "progress": False, "seed": 0},
    )

    async def move(rl: RLJob, record) -> None:
        # a plan change at a weight sync, as the async adapter makes one (pause, transition,
        # resume): generation to device 2 alone, the critic's model-stages to device 1
        if record["step"] != 4:
            return
        placements = {
            **{n: {"devices": [0]} for n in ("reference_inference", "policy_training")},
            "policy_generation": {"devices": [2]},
            "critic_inference": {"devices": [1]},
            "critic_training": {"devices": [1]},
        }
        target = replace(cfg, plan={n: Placement(**p) for n, p in placements.items()}).job_plan()
        await rl.async_run.pause()
        await rl.apply_plan(target)
        await rl.async_run.resume()

    run, batches, before, after, counts = await _run(cfg, move)
    _check_order(run, batches, steps, steps * B)
    _check_tokens(run, k)
    assert run.summary["max_staleness_seen"] <= k
    assert [w.emu.devices for w in run.workers] == [(2,)]
    # one sample per prompt: an entry is a sample, and no sample index is in two updates
    updates_of = defaultdict(set)
    for version, _, index, _ in run.trained_log:
        updates_of[index].add(version)
    assert len(updates_of) == steps * B and all(len(v) == 1 for v in updates_of.values())
    assert all(len(b) == B and all(g.rows == 1 for g in b) for b in batches)
    # the critic was trained: its weights changed and its update counter is one per step
    critic_before, _ = before["critic_training"][0]
    critic_after, _ = after["critic_training"][0]
    assert critic_before.keys() == critic_after.keys()
    assert not all(torch.equal(critic_before[n], critic_after[n]) for n in critic_before)
    # ... and the plan change moved it with its state
    assert counts == {"policy_training": [((0,), steps)], "critic_training": [((1,), steps)]}
    assert all("value_loss" in r and "value_mean" in r for r in run.records)


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_async_remax_decodes_its_greedy_baseline_beside_its_samples(tmp_path, no_leaks):  # noqa: F811
    steps, k, K = 12, 1, 2
    cfg = job(
        str(tmp_path),
        steps,
        algorithm={"name": "remax", "prompts_per_step": B, "samples_per_prompt": K},
        cluster=CLUSTER,
        plan={**GENERATION, "policy_training": {"devices": [0]}},
        # a request runs on one version: two baselines of one prompt and version must match
        rl={"mode": "async", "max_staleness": k, "partial_rollout": False},
        run={"steps": steps, "out_dir": str(tmp_path), "progress": False, "seed": 0},
    )
    run, batches, _, _, counts = await _run(cfg)
    _check_order(run, batches, steps, steps * B)
    _check_tokens(run, k)  # the baseline row's versions are in the log and within k
    assert counts == {"policy_training": [((0,), steps)], "critic_training": []}
    groups = [g for b in batches for g in b]
    for g in groups:
        # the baseline: one row of the entry's own prompt, tagged by the generation EMU
        assert g.rows == K and g.baseline_ids
        assert len(g.baseline_versions) == len(g.baseline_ids)
        assert g.start_version <= min(g.baseline_versions)
        assert g.oldest_version <= min(min(v) for v in g.versions)
    # greedy: a baseline depends only on the prompt and the weights (one version per request
    # here), while the samples of a prompt at one version differ
    seen: dict[tuple, list[int]] = {}
    compared = differing_samples = 0
    for g in groups:
        versions = set(g.baseline_versions)
        if len(versions) != 1:
            continue
        key = (tuple(g.prompt_ids), versions.pop())
        if key in seen:
            assert g.baseline_ids == seen[key], key
            compared += 1
        seen[key] = g.baseline_ids
        differing_samples += g.response_ids[0] != g.response_ids[1]
    assert compared >= 3, compared
    assert differing_samples > 0
    # never trained on: an update's rows are its entries' samples only
    assert all(r["rollouts"] == B * K for r in run.records)
    for r, b in zip(run.records, batches, strict=True):
        assert r["greedy_reward_mean"] == pytest.approx(sum(g.baseline_score for g in b) / len(b))
