"""A GRPO job whose policy-generation runs on vLLM at TP 2: one vLLM engine whose two
ranks live in two worker processes (vLLM's ``external_launcher``, the EMU's ranks as
the launcher), each rank's parameters written from that rank's shards.

The tiny model's vocabulary is not a multiple of vLLM's 64-row padding, so vLLM cuts
the embedding across its ranks differently from nereus (rank 1 holds none of the real
rows): those weights are gathered over the EMU's TP group and cut vLLM's way. Every
weight vLLM computes with came from the shards (it starts with dummy weights): its
scores equal the training EMU's before any step and after weight syncs, and its greedy
tokens equal the built-in engine's over the synced shards. A plan change to two TP 1
replicas on the same devices gives each its own engine, which the next sync reaches.
vLLM's CPU all-reduce segments are named after the engine and unlinked once both ranks
joined: a leftover segment under vLLM's own name does not stop the engine, two TP 2
engines (two DP replicas) start side by side on one host, and nothing of theirs stays in
/dev/shm. Runs where vllm is importable (``make test-vllm``)."""

from __future__ import annotations

import asyncio
import glob
import os

import pytest
import torch

from nereus.engines import GenerationEngine, SamplingParams
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.job.loop import RLJob
from nereus.planner.plan import Plan, StagePlan
from tests.job._jobs import job
from tests.job.test_vllm_job import GREEDY, MODEL, _batch

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]


def _cpu_shm() -> set[str]:
    """vLLM's CPU shared-memory segments on this host (every name ends ``cpushm_<rank>``)."""
    return set(glob.glob("/dev/shm/*cpushm_*"))


async def test_a_grpo_job_generates_on_vllm_at_tp2_across_two_workers(tmp_path):
    # what a killed engine under vLLM's own naming leaves behind: the job's engine must
    # not need that name
    stale = "/dev/shm/-tp:0-[0-1]-cpushm_0"
    assert not os.path.exists(stale), f"{stale} is left over from an earlier run: remove it"
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    cfg = job(
        str(tmp_path),
        2,
        model=MODEL,
        algorithm={"prompts_per_step": 4, "samples_per_prompt": 4},
        sampling={"engine": "vllm", "max_new_tokens": 6},
        cluster={"mode": "local", "devices": 3, "memory_per_device": "512MiB"},
        plan={
            "policy_generation": {"devices": [1, 2], "tp": 2},
            "policy_training": {"devices": [0]},
        },
    )
    rl = RLJob(cfg)
    try:
        await rl.start()
        # every rank unlinked its segment once both had joined: nothing stays in /dev/shm
        assert _cpu_shm() == {stale}
        stages = rl.stages
        vocab = rl.model_config.vocab_size
        assert vocab % 64, (
            "the vocabulary must need vLLM's padding for this test to cut it vLLM's way"
        )
        assert stages.plan["policy_generation"].tp == 2
        gen = stages.emus["policy_generation"][0].name
        train = stages.emus["policy_training"][0].name
        ranks = [stages.hosts[1], stages.hosts[2]]
        batch = _batch(vocab)
        mask = batch["attention_mask"].float()
        prompts = [row[:5] for row in batch["input_ids"].tolist()]

        async def on_vllm(method: str, *args):
            # both ranks run the one engine's forward together
            outs = await asyncio.gather(*(getattr(h, method).call_one(gen, *args) for h in ranks))
            return outs[0], outs[1]

        async def scores() -> tuple[torch.Tensor, torch.Tensor]:
            first, second = await on_vllm("logprobs", batch)
            torch.testing.assert_close(first, second)  # one engine: both ranks see its result
            policy = await stages.hosts[0].logprobs.call_one(train, batch)
            return first * mask, policy * mask

        vllm0, policy0 = await scores()
        torch.testing.assert_close(vllm0, policy0, atol=1e-3, rtol=1e-3)

        records = [await rl.run_step() for _ in range(2)]
        assert [r["policy_version"] for r in records] == [0, 1]
        assert all(r["sync_bytes"] > 0 and r["tokens_generated"] > 0 for r in records)

        vllm1, policy1 = await scores()
        assert float((policy1 - policy0).abs().max()) > 1e-2  # the policy moved
        torch.testing.assert_close(
            vllm1, policy1, atol=1e-3, rtol=1e-3
        )  # and vLLM's two ranks with it
        greedy, other = await on_vllm("generate", prompts, GREEDY)
        assert greedy["token_ids"] == other["token_ids"]
        synced = {
            k: t
            for k, t in (await stages.hosts[0].get_shards.call_one(train)).items()
            if ":" not in k
        }
        builtin = GenerationEngine(
            rl.model_config,
            options=EngineOptions(
                tensors=synced, ledger=MemoryLedger("vllm-tp-ref", None), name="ref"
            ),
        )
        assert greedy["token_ids"] == builtin.generate(prompts, SamplingParams(**GREEDY)).token_ids

        for host in ranks:  # each rank's ledger holds its half of vLLM's weights beside its shards
            held = (await host.memory.call_one())["breakdown"]
            assert held[f"{gen}/weights"] == held[f"shards/{gen}"] > 0

        # a plan change from TP 2 to two TP 1 replicas on the same devices: the shards are
        # resharded in the workers, each replica gets a vLLM engine of its own, and the
        # next step's sync reaches both
        target = Plan(
            tuple(
                (name, StagePlan(1, 1, 2, ((1,), (2,))) if name == "policy_generation" else sp)
                for name, sp in stages.plan
            )
        )
        report = await rl.apply_plan(target)
        assert report["changed"] == ["policy_generation"]
        record = await rl.run_step()
        assert record["policy_version"] == 2 and record["sync_bytes"] > 0
        policy2 = await stages.hosts[0].logprobs.call_one(train, batch) * mask
        assert float((policy2 - policy1).abs().max()) > 1e-3
        for device, emu in zip((1, 2), stages.emus["policy_generation"], strict=True):
            replica = await stages.hosts[device].logprobs.call_one(emu.name, batch) * mask
            torch.testing.assert_close(replica, policy2, atol=1e-3, rtol=1e-3)
    finally:
        await rl.close()
        os.unlink(stale)
    assert _cpu_shm() == set()


async def test_two_tp2_vllm_engines_share_a_host(tmp_path):
    # two DP replicas of a TP 2 generation EMU on one host: two vLLM engines whose CPU
    # all-reduce groups would take one name under vLLM's own naming
    cfg = job(
        str(tmp_path),
        1,
        model=MODEL,
        algorithm={"prompts_per_step": 4, "samples_per_prompt": 2},
        sampling={"engine": "vllm", "max_new_tokens": 4},
        cluster={"mode": "local", "devices": 5, "memory_per_device": "512MiB"},
        plan={
            "policy_generation": {"devices": [1, 2, 3, 4], "tp": 2, "dp": 2},
            "policy_training": {"devices": [0]},
        },
    )
    rl = RLJob(cfg)
    try:
        await rl.start()
        assert _cpu_shm() == set()
        stages = rl.stages
        assert [e.devices for e in stages.emus["policy_generation"]] == [(1, 2), (3, 4)]
        record = await rl.run_step()
        assert record["tokens_generated"] > 0 and record["sync_bytes"] > 0
        batch = _batch(rl.model_config.vocab_size)
        mask = batch["attention_mask"].float()
        train = stages.emus["policy_training"][0].name
        policy = await stages.hosts[0].logprobs.call_one(train, batch) * mask
        for emu in stages.emus["policy_generation"]:  # each engine scores with the synced weights
            first, second = await asyncio.gather(
                *(stages.hosts[d].logprobs.call_one(emu.name, batch) for d in emu.devices)
            )
            torch.testing.assert_close(first, second)
            torch.testing.assert_close(first * mask, policy, atol=1e-3, rtol=1e-3)
    finally:
        await rl.close()
    assert _cpu_shm() == set()
