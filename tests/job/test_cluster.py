"""The shipped demo config on a real local cluster: GRPO learns, EMUs sync, workers clean up."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from nereus.config import load_toml
from nereus.job.config import JobConfig
from nereus.job.loop import RLJob
from nereus.job.report import read_metrics
from tests.job._jobs import window_mean

pytestmark = pytest.mark.integration

DEMO = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.toml"


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().split(") ", 1)[1].split()[1] == me:
                        out.add(int(pid))
            except OSError:
                continue
    return out


@pytest.mark.timeout(240)
async def test_demo_config_learns_on_a_local_cluster(tmp_path):
    cfg = load_toml(JobConfig, DEMO)
    cfg = dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, out_dir=str(tmp_path), progress=False)
    )
    before = _children()
    job = RLJob(cfg)
    await job.start()
    try:
        memory = {d: m["breakdown"] for d, m in (await job.stages.memory()).items()}
        # Co-resident model-stages are accounted on one device ledger: the shard store
        # holds every EMU's tensors, the training engine adds its gradients.
        gen0, train0, gen3 = "policy_generation.0", "policy_training.0", "policy_generation.3"
        assert {f"shards/{gen0}", f"shards/{train0}", f"{train0}/grads"} <= set(memory[0])
        assert f"shards/{gen3}" in memory[3] and not any("policy_training" in k for k in memory[3])
        records = await job._loop()
        after = {d: m["breakdown"] for d, m in (await job.stages.memory()).items()}
    finally:
        await job.close()
    # Generation EMUs co-resident with training gave their KV cache back; the others keep it.
    assert f"{gen0}/kv_cache" not in after[0] and f"{gen3}/kv_cache" in after[3]
    early, late = (
        window_mean(records, "reward_mean", 0, 10),
        window_mean(records, "reward_mean", 100, 120),
    )
    assert late > early + 0.2, (early, late)
    assert [r["policy_version"] for r in records] == list(range(120))
    assert all(r["sync_bytes"] > 0 for r in records)
    # what the planner needs, measured every step
    assert all(
        set(r["model_stage_seconds"]) == {"policy_generation", "policy_training"} for r in records
    )
    assert all(
        r["max_new_tokens"] == 6 and set(r["device_peak_bytes"]) == {"0", "1", "2", "3"}
        for r in records
    )
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 120
    assert (tmp_path / "plot.png").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_120",
        "step_40",
        "step_80",
    ]
    assert _children() <= before, "worker processes outlived the job"


@pytest.mark.timeout(240)
async def test_weight_sync_reshards_pp_training_into_tp_generation(tmp_path):
    import torch

    from nereus.models import model_spec, shard_tensor
    from tests.job._jobs import job

    plan = {
        "policy_generation": {"devices": [0, 1, 2, 3], "tp": 2, "dp": 2},
        "policy_training": {"devices": [2, 3], "pp": 2},
    }
    cfg = job(
        str(tmp_path),
        2,
        cluster={"mode": "local", "devices": 4, "memory_per_device": "256MiB"},
        plan=plan,
    )
    rl = RLJob(cfg)
    await rl.start()
    try:
        records = [await rl.run_step() for _ in range(2)]
        assert [r["policy_version"] for r in records] == [0, 1] and rl.stages.policy_version == 2
        full = {}
        for st in await rl.stages.handles["policy_training"].emus[0].shards():  # one pp stage each
            full.update({k: v for k, v in st.items() if ":" not in k})
        spec = model_spec(rl.model_config)
        assert set(full) == {p.name for p in spec}
        for emu in rl.stages.handles["policy_generation"].emus:
            for tp_rank, st in enumerate(await emu.shards()):
                for p in spec:
                    assert torch.equal(st[p.name], shard_tensor(p, full[p.name], tp_rank, 2)), (
                        p.name
                    )
    finally:
        await rl.close()


@pytest.mark.timeout(240)
async def test_ppo_with_tp_critic_resumes_exactly_on_a_cluster(tmp_path):
    from tests.job._jobs import job

    plan = {
        "policy_generation": {"devices": [0, 1], "dp": 2},
        "policy_training": {"devices": [0]},
        "reference_inference": {"devices": [1]},
        "critic_inference": {"devices": [3]},  # synced from a TP 2 critic through the state layer
        "critic_training": {"devices": [2, 3], "tp": 2},
    }
    cfg = job(
        str(tmp_path),
        4,
        algorithm={"name": "ppo", "samples_per_prompt": 4, "kl_coef": 0.01, "kl_mode": "penalty"},
        cluster={"mode": "local", "devices": 4, "memory_per_device": "256MiB"},
        plan=plan,
    )
    rl = RLJob(cfg)
    await rl.start()
    try:
        first = [await rl.run_step() for _ in range(2)]
        folder = await rl.save_checkpoint()
        after = [await rl.run_step() for _ in range(2)]
        await rl.load_checkpoint(folder)
        again = [await rl.run_step() for _ in range(2)]
    finally:
        await rl.close()
    assert all("value_loss" in r and "kl_ref" not in r for r in first)  # KL as a reward penalty
    keys = (
        "step",
        "reward_mean",
        "response_len_mean",
        "policy_loss",
        "value_loss",
        "policy_version",
        "dataset_position",
    )
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in after]
