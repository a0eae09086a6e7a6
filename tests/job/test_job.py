"""The RL job in-process: GRPO learns, PPO and ReMax run through the same API, resume is exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nereus.job.loop import RLJob, latest_checkpoint, run_job
from nereus.job.report import read_metrics
from tests.job._jobs import job, window_mean

PPO_PLAN = {
    "policy_generation": {"devices": [0]},
    "policy_training": {"devices": [0]},
    "reference_inference": {"devices": [1]},
    "critic_inference": {"devices": [1]},
    "critic_training": {"devices": [1]},
}


@pytest.mark.timeout(120)
async def test_grpo_reward_rises_and_outputs_are_written(tmp_path):
    records = await run_job(job(str(tmp_path), 100))
    early, late = (
        window_mean(records, "reward_mean", 0, 10),
        window_mean(records, "reward_mean", 80, 100),
    )
    assert late > early + 0.2, (early, late)
    assert [r["step"] for r in records] == list(range(100))
    # Every rollout records the policy version that generated it: one sync per step.
    assert [r["policy_version"] for r in records] == list(range(100))
    assert all(r["sync_bytes"] > 0 for r in records)
    assert read_metrics(tmp_path / "metrics.jsonl") == json.loads(json.dumps(records))
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert latest_checkpoint(tmp_path).name == "step_100"


@pytest.mark.timeout(120)
async def test_ppo_with_kl_penalty_runs_and_learns(tmp_path):
    cfg = job(
        str(tmp_path),
        60,
        algorithm={"name": "ppo", "samples_per_prompt": 4, "kl_coef": 0.01, "kl_mode": "penalty"},
        plan=PPO_PLAN,
    )
    records = await run_job(cfg)
    assert (
        window_mean(records, "reward_mean", 45, 60)
        > window_mean(records, "reward_mean", 0, 10) + 0.1
    )
    assert all("value_loss" in r and "critic_grad_norm" in r for r in records)


@pytest.mark.timeout(120)
async def test_remax_and_grpo_kl_loss_run(tmp_path):
    remax = await run_job(
        job(str(tmp_path / "remax"), 60, algorithm={"name": "remax", "samples_per_prompt": 4})
    )
    assert (
        window_mean(remax, "reward_mean", 45, 60) > window_mean(remax, "reward_mean", 0, 10) + 0.1
    )
    assert all("greedy_reward_mean" in r for r in remax)
    plan = {
        "policy_generation": {"devices": [0]},
        "policy_training": {"devices": [0]},
        "reference_inference": {"devices": [1]},
    }
    grpo = await run_job(job(str(tmp_path / "kl"), 5, algorithm={"kl_coef": 0.05}, plan=plan))
    assert grpo[0]["kl_ref"] == pytest.approx(0.0, abs=1e-4)  # policy == reference at step 0
    assert grpo[-1]["kl_ref"] > 0


@pytest.mark.timeout(120)
async def test_resume_takes_the_same_steps(tmp_path):
    full = await run_job(job(str(tmp_path / "full"), 6, run={"checkpoint_every": 3}))
    await run_job(job(str(tmp_path / "cut"), 3))
    resumed_job = RLJob(job(str(tmp_path / "cut"), 6, run={"resume": True}))
    resumed = await resumed_job.run()
    assert [r["step"] for r in resumed] == [3, 4, 5]
    keys = (
        "reward_mean",
        "response_len_mean",
        "policy_loss",
        "grad_norm",
        "policy_version",
        "dataset_position",
    )
    for a, b in zip(full[3:], resumed, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    wa = load_file(
        str(tmp_path / "full" / "checkpoints" / "step_6" / "policy_training.safetensors")
    )
    wb = load_file(str(tmp_path / "cut" / "checkpoints" / "step_6" / "policy_training.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")] == list(range(6))
