"""A custom RL pipeline written from scratch with nereus's public async API.

Not GRPO, PPO or ReMax: *rejection-sampling fine-tuning* (expert iteration). Each step
samples k answers per prompt on policy-generation, scores them with the task's rule
reward, keeps the best answer of each prompt if it beats a threshold, fine-tunes
policy-training on the kept answers with the built-in NLL loss, and syncs the weights
back to generation. Every call below is the same one the built-in algorithms use:

- ``ClusterStages.start``: spawn the model-stages as EMUs on a local cluster per plan;
- ``stages.generate``: sample on every generation EMU at once (DP), with per-token
  logprobs and the policy version of every rollout;
- ``stages.train_policy``: one optimizer step with any loss named by import path;
- ``stages.sync_policy``: training -> generation weights through the state layer.

    python -m examples.custom_pipeline [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile

import torch

from nereus.config import from_dict
from nereus.data import PromptDataset, make_task
from nereus.data.vocab import Codec
from nereus.job import ClusterStages, JobConfig, prepare_model
from nereus.rl import Rollouts, to_batch


async def main(steps: int, samples_per_prompt: int = 8, keep_above: float = 0.3) -> list[float]:
    task = make_task("reverse", letters="abc", min_len=2, max_len=3)
    codec = Codec.for_alphabet(task.alphabet)
    cfg = from_dict(
        JobConfig,
        {
            "task": {"name": "reverse"},
            "cluster": {"mode": "local", "devices": 3, "memory_per_device": "256MiB"},
            "plan": {
                "policy_generation": {"devices": [0, 1], "dp": 2},
                "policy_training": {"devices": [2]},
            },
            "optim": {"lr": 3e-3},
        },
    )
    dataset = PromptDataset(task, size=2048, seed=0)
    rewards: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        model_config, model_dir, codec = prepare_model(cfg, codec, out)
        stages = await ClusterStages.start(cfg, model_config, model_dir)
        try:
            for step in range(steps):
                samples = dataset.take(8)
                prompts = [
                    codec.encode(s.prompt) for s in samples for _ in range(samples_per_prompt)
                ]
                out_ = await stages.generate(
                    prompts,
                    {
                        "max_tokens": 6,
                        "temperature": 1.0,
                        "stop_token_ids": [codec.eos_id],
                        "seed": step,
                    },
                )
                texts = [codec.decode(t) for t in out_["token_ids"]]
                scores = [
                    task.reward(s, t)
                    for s, t in zip(
                        (s for s in samples for _ in range(samples_per_prompt)), texts, strict=True
                    )
                ]
                # Keep the best answer per prompt when it is good enough.
                keep = []
                for g in range(len(samples)):
                    rows = range(g * samples_per_prompt, (g + 1) * samples_per_prompt)
                    best = max(rows, key=lambda r: scores[r])
                    if scores[best] > keep_above:
                        keep.append(best)
                rewards.append(statistics.fmean(scores))
                if keep:
                    kept = Rollouts(
                        [prompts[r] for r in keep],
                        [out_["token_ids"][r] for r in keep],
                        [out_["logprobs"][r] for r in keep],
                        [samples[r // samples_per_prompt].index for r in keep],
                        [out_["policy_version"][r] for r in keep],
                    )
                    batch = to_batch(kept, codec.pad_id)
                    metrics = await stages.train_policy(batch, "nereus.engines.losses:nll_loss", {})
                    await stages.sync_policy()
                else:
                    metrics = {}
                print(
                    f"step {step:3d}  reward {rewards[-1]:.3f}  kept {len(keep)}/{len(samples)}  "
                    f"nll {metrics.get('nll', float('nan')):.3f}  policy version "
                    f"{stages.policy_version}"
                )
        finally:
            await stages.close()
    return rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    torch.set_num_threads(1)
    r = asyncio.run(main(parser.parse_args().steps))
    print(
        f"mean reward: first 5 steps {statistics.fmean(r[:5]):.3f}, last 5 steps "
        f"{statistics.fmean(r[-5:]):.3f}"
    )
