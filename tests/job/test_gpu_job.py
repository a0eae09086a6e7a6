"""GPU tier: a few GRPO steps on GPU workers (a controller and a ``--gpus all`` node
daemon in this process, the job attached to them), with the built-in generation engine
and, where vLLM is importable, with vLLM.

Every worker's shards and engines are on its ``cuda:0``; with two GPUs the weight sync
crosses devices over an NCCL group. After the steps, the generation EMU scores a fixed
batch as the training EMU does (the synced weights are the ones it computes with).
Skipped (by tests/conftest.py) where CUDA or libnccl is absent; the vLLM case also where
vLLM is. ``make test-gpu`` runs it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from nereus.actors.gpu_memory import VLLM_WORKSPACE_BYTES, gpu_budget_bytes
from nereus.job.loop import RLJob
from tests.job._jobs import job

pytestmark = [pytest.mark.integration, pytest.mark.gpu, pytest.mark.timeout(300)]

# head_dim 32: a size every vLLM attention backend takes
MODEL = {
    "hidden_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "num_layers": 2,
    "max_seq_len": 64,
}


@contextlib.asynccontextmanager
async def gpu_node(folder: Path) -> AsyncIterator[tuple[str, Path, int]]:
    """(controller address, key file, GPUs) of a controller with one node daemon over
    every GPU of this machine."""
    from nereus.actors import Controller, NodeDaemon
    from nereus.actors._keys import generate_key

    key = generate_key()
    key_file = folder / "key"
    key_file.write_bytes(key)
    controller = await Controller(key).start()
    node = NodeDaemon(controller.address, key, gpus="all", transport="ipc", node_id="gpu")
    try:
        await node.start()
        yield controller.address, key_file, len(node.workers)
    finally:
        await node.stop()
        await controller.close()


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("engine", ["builtin", pytest.param("vllm", marks=pytest.mark.vllm)])
async def test_grpo_steps_on_gpu_workers(tmp_path, engine):
    async with gpu_node(tmp_path) as (address, key_file, gpus):
        last = min(gpus, 2) - 1  # generation on a second GPU where there is one
        cfg = job(
            str(tmp_path / "run"),
            3,
            model=MODEL,
            algorithm={"prompts_per_step": 4, "samples_per_prompt": 4},
            sampling={"engine": engine, "max_new_tokens": 6},
            cluster={
                "mode": "connect",
                "address": address,
                "key_file": str(key_file),
                "devices": last + 1,
            },
            plan={"policy_generation": {"devices": [last]}, "policy_training": {"devices": [0]}},
        )
        rl = RLJob(cfg)
        await rl.start()
        try:
            stages = rl.stages
            assert rl.cfg.model.dtype == "bfloat16"  # "auto" on GPU workers
            for host in stages.hosts.values():
                assert (await host.memory.call_one())["tensor_device"] == "cuda:0"
            _, group = stages._sync["policy_generation"]
            assert (group is None) == (last == 0) and (group is None or group.backend == "nccl")

            records = [await rl.run_step() for _ in range(3)]
            assert [r["policy_version"] for r in records] == [0, 1, 2]
            assert all(r["sync_bytes"] > 0 and r["tokens_generated"] > 0 for r in records)

            gen, train = (
                stages.emus["policy_generation"][0].name,
                stages.emus["policy_training"][0].name,
            )
            batch = _batch(rl.model_config.vocab_size)
            mask = batch["attention_mask"].float()
            on_gen = await stages.hosts[last].logprobs.call_one(gen, batch) * mask
            policy = await stages.hosts[0].logprobs.call_one(train, batch) * mask
            # bfloat16 on both sides; weights a sync missed would be three AdamW steps
            # away, far past these (vLLM's kernels round otherwise than the built-in ones).
            tol = 2e-2 if engine == "builtin" else 5e-2
            torch.testing.assert_close(on_gen, policy, atol=tol, rtol=tol)
            memory = await stages.hosts[last].memory.call_one()
            assert memory["engines"][gen] == "generation"
            # the GPU's memory less the CUDA context's and NCCL's reserve
            assert memory["budget_bytes"] == gpu_budget_bytes(
                torch.cuda.get_device_properties(last).total_memory
            )
            if engine == "vllm":
                assert memory["breakdown"][f"{gen}/weights"] == memory["breakdown"][f"shards/{gen}"]
                assert memory["breakdown"][f"{gen}/kv_cache"] > 0
                assert memory["breakdown"][f"{gen}/workspace"] == VLLM_WORKSPACE_BYTES
        finally:
            await rl.close()
