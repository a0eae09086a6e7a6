"""A job over a GSM8K-shaped file on a tiny random Qwen3 with a real tokenizer and chat
template: the reward a user function gives rises, loggers and export write what they
promise, and resume takes the same samples and updates."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from nereus.config import from_dict
from nereus.job.config import JobConfig
from nereus.job.loop import RLJob, run_job
from nereus.job.report import read_metrics
from tests.data._files import gsm8k_rows, tiny_chat_model, write_jsonl
from tests.job._jobs import window_mean

REWARD_MODULE = '''
def digits(prompt, response, ground_truth, data_source=None):
    """The share of a response's characters that are digits (a reward a random policy
    rarely earns and GRPO quickly raises)."""
    assert prompt and ground_truth.isdigit() and data_source == "openai/gsm8k"
    return sum(c.isdigit() for c in response) / max(len(response), 1)
'''


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("file_job")
    model, _ = tiny_chat_model(root / "model", architecture="qwen3", seed=1)
    data = write_jsonl(root / "train.jsonl", gsm8k_rows(48, seed=2))
    (root / "job_rewards.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(root))
    yield model, data
    sys.path.remove(str(root))
    sys.modules.pop("job_rewards", None)


def _cfg(model, data, out, steps, rule="job_rewards:digits", **run):
    return from_dict(
        JobConfig,
        {
            "model": {"kind": "hf", "path": str(model)},
            "data": {"path": str(data)},
            "reward": {"rule": rule},
            "algorithm": {"prompts_per_step": 4, "samples_per_prompt": 8},
            "sampling": {"max_new_tokens": 6},
            "optim": {"lr": 3e-3},
            "cluster": {"mode": "in_process"},
            "plan": {"policy_generation": {"devices": [0]}, "policy_training": {"devices": [0]}},
            "run": {"steps": steps, "out_dir": str(out), "progress": False, "seed": 0, **run},
        },
    )


@pytest.mark.timeout(150)
async def test_file_job_learns_logs_and_exports(workload, tmp_path):
    from transformers import AutoModelForCausalLM

    model, data = workload
    cfg = _cfg(model, data, tmp_path, 30, loggers=["jsonl", "tensorboard"], export_hf=True)
    records = await run_job(cfg)
    early, late = (
        window_mean(records, "reward_mean", 0, 5),
        window_mean(records, "reward_mean", 25, 30),
    )
    assert late > early + 0.15, (early, late)
    # 4 prompts per step over 48 rows: epochs wrap and every row is visited once per epoch.
    assert [r["dataset_position"] for r in records] == [4 * (s + 1) for s in range(30)]
    assert read_metrics(tmp_path / "metrics.jsonl") == json.loads(json.dumps(records))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # The exported folder is the last checkpoint's policy, loadable by transformers.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    trained = load_file(str(tmp_path / "checkpoints" / "step_30" / "policy_training.safetensors"))
    hf_params = dict(hf.named_parameters())
    torch.testing.assert_close(
        hf_params["model.layers.1.self_attn.q_norm.weight"],
        trained["model.layers.1.self_attn.q_norm.weight"],
    )
    assert not torch.equal(
        trained["model.norm.weight"],
        load_file(str(model / "model.safetensors"))["model.norm.weight"],
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (model / name).read_bytes()


@pytest.mark.timeout(150)
async def test_file_job_resume_takes_the_same_steps(workload, tmp_path):
    model, data = workload
    full = await run_job(_cfg(model, data, tmp_path / "full", 5, rule="math", checkpoint_every=2))
    await run_job(_cfg(model, data, tmp_path / "cut", 2, rule="math"))
    resumed = await RLJob(_cfg(model, data, tmp_path / "cut", 5, rule="math", resume=True)).run()
    assert [r["step"] for r in resumed] == [2, 3, 4]
    keys = (
        "reward_mean",
        "response_len_mean",
        "policy_loss",
        "grad_norm",
        "policy_version",
        "dataset_position",
    )
    for a, b in zip(full[2:], resumed, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    job = json.loads((tmp_path / "cut" / "checkpoints" / "step_5" / "job.json").read_text())
    assert job["dataset"]["position"] == 20 and len(job["dataset"]["fingerprint"]) == 16
