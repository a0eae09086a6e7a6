"""A reward model as the reward_inference model-stage: scores match transformers'
sequence classifier on the same folder, in process and as TP 2 EMUs on a local cluster,
and an RL step runs on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nereus.data.tasks import make_task
from nereus.data.vocab import Codec
from nereus.errors import ConfigError
from nereus.job.loop import RLJob
from nereus.rl.rollout import Rollouts, to_batch
from tests.job._jobs import REVERSE, job

transformers = pytest.importorskip("transformers")


def _codec() -> Codec:
    return Codec.for_alphabet(make_task(REVERSE["name"], **REVERSE["options"]).alphabet)


def make_reward_model(folder: Path, codec: Codec, seed: int = 3) -> torch.nn.Module:
    """A random Llama sequence classifier (num_labels 1) over the task's vocabulary, saved
    as transformers saves it; returns the transformers model."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=codec.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=codec.pad_id,
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
    )
    model = transformers.LlamaForSequenceClassification(config).float().eval()
    with torch.no_grad():  # a visible head: HF initialises it small
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _rollouts(codec: Codec) -> Rollouts:
    prompts = [codec.encode("ab>"), codec.encode("abc>"), codec.encode("ca>"), codec.encode("b>")]
    responses = [codec.encode("ba"), codec.encode("cb"), codec.encode("acab"), []]
    logprobs = [[-1.0] * len(r) for r in responses]
    return Rollouts(prompts, responses, logprobs, [0, 1, 2, 3], [0] * 4)


def _hf_scores(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return (
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            .logits[:, 0]
            .float()
        )


def _rm_job(tmp_path: Path, rm: Path, **sections):
    plan = sections.pop(
        "plan",
        {
            "policy_generation": {"devices": [0]},
            "policy_training": {"devices": [0]},
            "reward_inference": {"devices": [0]},
        },
    )
    return job(
        str(tmp_path / "run"), 2, reward={"kind": "model", "path": str(rm)}, plan=plan, **sections
    )


async def test_in_process_scores_match_transformers_and_a_step_runs(tmp_path):
    codec = _codec()
    hf = make_reward_model(tmp_path / "rm", codec)
    rl = RLJob(_rm_job(tmp_path, tmp_path / "rm"))
    await rl.start()
    try:
        batch = to_batch(_rollouts(codec), codec.pad_id)
        ours = await rl.stages.reward_scores(batch)
        torch.testing.assert_close(ours, _hf_scores(hf, batch), atol=1e-5, rtol=1e-5)
        assert ours.std() > 0.01  # the rows really differ: the head is not zero
        record = await rl.run_step()
    finally:
        await rl.close()
    assert record["score_seconds"] > 0
    assert 0.0 <= record["task_reward_mean"] <= 1.0
    assert record["reward_mean"] != record["task_reward_mean"]


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_tp2_reward_emus_on_a_local_cluster_match_transformers(tmp_path):
    codec = _codec()
    hf = make_reward_model(tmp_path / "rm", codec)
    plan = {
        "policy_generation": {"devices": [0]},
        "policy_training": {"devices": [0]},
        "reward_inference": {"devices": [0, 1], "tp": 2},
    }
    cfg = _rm_job(
        tmp_path,
        tmp_path / "rm",
        plan=plan,
        cluster={"mode": "local", "devices": 2, "memory_per_device": "512MiB"},
    )
    rl = RLJob(cfg)
    await rl.start()
    try:
        batch = to_batch(_rollouts(codec), codec.pad_id)
        ours = await rl.stages.reward_scores(batch)
        record = await rl.run_step()
    finally:
        await rl.close()
    torch.testing.assert_close(ours, _hf_scores(hf, batch), atol=1e-5, rtol=1e-5)
    assert "task_reward_mean" in record


def test_config_refusals(tmp_path):
    codec = _codec()
    with pytest.raises(ConfigError, match="reward.path"):
        job(str(tmp_path), 1, reward={"kind": "model"})
    with pytest.raises(ConfigError, match="reward_inference"):
        job(str(tmp_path), 1, reward={"kind": "model", "path": str(tmp_path)})  # not placed
    with pytest.raises(ConfigError, match="reward_inference"):  # placed but rule reward
        job(
            str(tmp_path),
            1,
            plan={
                "policy_generation": {"devices": [0]},
                "policy_training": {"devices": [0]},
                "reward_inference": {"devices": [0]},
            },
        )
    other = Codec.for_alphabet("abcdefghij")
    assert other.vocab_size != codec.vocab_size
    make_reward_model(tmp_path / "rm", other)
    from nereus.job.local_stages import reward_model
    from nereus.models import ModelConfig

    policy = ModelConfig(
        vocab_size=codec.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    with pytest.raises(ConfigError, match=r"reward\.path.*vocab_size"):
        reward_model(_rm_job(tmp_path, tmp_path / "rm"), policy)
