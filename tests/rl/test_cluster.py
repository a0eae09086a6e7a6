"""The shipped demo config on a real local cluster: GRPO learns, EMUs sync, workers clean up."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from nereus.config import load_toml
from nereus.rl.config import JobConfig
from nereus.rl.job import RLJob
from nereus.rl.report import read_metrics
from tests.rl._jobs import window_mean

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
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(tmp_path), progress=False))
    before = _children()
    job = RLJob(cfg)
    await job.start()
    try:
        memory = await job.stages.memory()
        # Co-resident model-stages are accounted on one device ledger.
        assert {"policy_generation/weights", "policy_training/weights", "policy_training/optimizer"} <= set(memory[0])
        assert set(memory[3]) >= {"policy_generation/weights"} and "policy_training/weights" not in memory[3]
        records = await job._loop()
    finally:
        await job.close()
    early, late = window_mean(records, "reward_mean", 0, 10), window_mean(records, "reward_mean", 100, 120)
    assert late > early + 0.2, (early, late)
    assert [r["policy_version"] for r in records] == list(range(120))
    assert all(r["sync_bytes"] > 0 for r in records)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 120
    assert (tmp_path / "plot.png").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_120", "step_40", "step_80"]
    assert _children() <= before, "worker processes outlived the job"
