"""A GRPO job whose policy-generation runs on vLLM inside a real worker process
(``sampling.engine = "vllm"``; vLLM's CPU build here, in-process in the worker).

vLLM starts with dummy weights, so every weight it computes with came from the
generation EMU's shards: its scores of a fixed batch equal the training EMU's before
any step and again after weight syncs, while the policy itself moved, and its greedy
tokens equal the built-in engine's over the synced shards. Its weights and KV cache
are reserved in the device's ledger beside the store's shards. A plan change that moves
generation starts a new vLLM engine over the moved shards, which the next sync reaches.
Runs where vllm is importable (``make test-vllm``)."""

from __future__ import annotations

import pytest
import torch

from nereus.engines import GenerationEngine, SamplingParams
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.job.loop import RLJob
from nereus.planner.plan import Plan, StagePlan
from tests.job._jobs import job

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]

# vLLM's CPU attention needs head_dim >= 32
MODEL = {
    "hidden_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "num_layers": 2,
    "max_seq_len": 64,
}
GREEDY = {"max_tokens": 6, "temperature": 0.0}


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[3, 5:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


async def test_a_grpo_job_generates_on_vllm_whose_weights_follow_every_sync(tmp_path):
    cfg = job(
        str(tmp_path),
        3,
        model=MODEL,
        algorithm={"prompts_per_step": 4, "samples_per_prompt": 4},
        sampling={"engine": "vllm", "max_new_tokens": 6},
        cluster={"mode": "local", "devices": 2, "memory_per_device": "512MiB"},
        plan={"policy_generation": {"devices": [1]}, "policy_training": {"devices": [0]}},
    )
    rl = RLJob(cfg)
    await rl.start()
    try:
        stages = rl.stages
        gen_host, train_host = stages.hosts[1], stages.hosts[0]
        gen, train = (
            stages.emus["policy_generation"][0].name,
            stages.emus["policy_training"][0].name,
        )
        batch = _batch(rl.model_config.vocab_size)
        mask = batch["attention_mask"].float()
        prompts = [row[:5] for row in batch["input_ids"].tolist()]

        async def scores() -> tuple[torch.Tensor, torch.Tensor]:
            on_vllm = await gen_host.logprobs.call_one(gen, batch)
            policy = await train_host.logprobs.call_one(train, batch)
            return on_vllm * mask, policy * mask

        vllm0, policy0 = await scores()
        torch.testing.assert_close(vllm0, policy0, atol=1e-3, rtol=1e-3)
        greedy0 = (await gen_host.generate.call_one(gen, prompts, GREEDY))["token_ids"]

        records = [await rl.run_step() for _ in range(3)]
        assert [r["policy_version"] for r in records] == [0, 1, 2]
        assert all(r["sync_bytes"] > 0 and r["tokens_generated"] > 0 for r in records)

        vllm1, policy1 = await scores()
        assert float((policy1 - policy0).abs().max()) > 1e-2  # the policy moved
        torch.testing.assert_close(vllm1, policy1, atol=1e-3, rtol=1e-3)  # and vLLM with it
        greedy1 = (await gen_host.generate.call_one(gen, prompts, GREEDY))["token_ids"]
        assert greedy1 != greedy0
        synced = {
            k: t for k, t in (await train_host.get_shards.call_one(train)).items() if ":" not in k
        }
        builtin = GenerationEngine(
            rl.model_config,
            options=EngineOptions(
                tensors=synced, ledger=MemoryLedger("vllm-job-ref", None), name="ref"
            ),
        )
        assert greedy1 == builtin.generate(prompts, SamplingParams(**GREEDY)).token_ids

        memory = await gen_host.memory.call_one()
        held = memory["breakdown"]
        assert memory["engines"] == {gen: "generation"} and memory["tensor_device"] == "cpu"
        assert held[f"{gen}/weights"] == held[f"shards/{gen}"] > 0  # vLLM's copy beside the store's
        assert held[f"{gen}/kv_cache"] == stages._vllm_cache_bytes(stages.plan["policy_generation"])
        assert (
            memory["used_bytes"]
            == sum(held.values())
            <= memory["peak_bytes"]
            <= memory["budget_bytes"]
        )

        # a plan change moves generation beside training: a new vLLM engine over the moved
        # shards, and the next step's sync reaches it
        target = Plan(
            tuple(
                (name, StagePlan(1, 1, 1, ((0,),)) if name == "policy_generation" else sp)
                for name, sp in stages.plan
            )
        )
        report = await rl.apply_plan(target)
        assert report["changed"] == ["policy_generation"]
        gen_host, gen = stages.hosts[0], stages.emus["policy_generation"][0].name
        assert f"{gen}/weights" not in (await stages.hosts[1].memory.call_one())["breakdown"]
        torch.testing.assert_close(*(await scores()), atol=1e-3, rtol=1e-3)
        record = await rl.run_step()
        assert record["policy_version"] == 3 and record["sync_bytes"] > 0
        vllm2, policy2 = await scores()
        assert float((policy2 - policy1).abs().max()) > 1e-3
        torch.testing.assert_close(vllm2, policy2, atol=1e-3, rtol=1e-3)
    finally:
        await rl.close()
