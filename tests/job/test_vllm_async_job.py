"""Asynchronous GRPO whose policy-generation runs on vLLM inside a real worker process
(``sampling.engine = "vllm"``, ``rl.partial_rollout = false``: vLLM runs a request whole).

Generation and training run at once; every position is trained once with every token
within the staleness bound (a ReMax job too, its baseline rows greedy on vLLM), and the
weights vLLM computes with follow the published snapshots: at a boundary, once the
EMU has taken the newest version, its scores of a fixed batch equal the training EMU's,
while the policy itself moved since the start. Runs where vllm is importable
(``make test-vllm``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nereus.job.async_loop import AsyncRun
from nereus.job.loop import RLJob
from tests.job._jobs import job
from tests.job.test_async_job import _check_tokens, _run
from tests.job.test_vllm_job import MODEL, _batch

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]

K = 1  # max_staleness


def _config(out: str, steps: int, **algorithm: Any):
    return job(
        out,
        steps,
        model=MODEL,
        algorithm={"prompts_per_step": 4, "samples_per_prompt": 4, **algorithm},
        sampling={"engine": "vllm", "max_new_tokens": 6},
        cluster={"mode": "local", "devices": 2, "memory_per_device": "512MiB"},
        plan={"policy_generation": {"devices": [1]}, "policy_training": {"devices": [0]}},
        rl={"mode": "async", "max_staleness": K, "partial_rollout": False},
    )


async def test_async_grpo_on_vllm_trains_every_position_with_synced_weights(tmp_path):
    steps = 6
    rl = RLJob(_config(str(tmp_path), steps))
    await rl.start()
    seen: dict[str, Any] = {}
    try:
        stages = rl.stages
        gen_host, train_host = stages.hosts[1], stages.hosts[0]
        train = stages.emus["policy_training"][0].name
        batch = _batch(rl.model_config.vocab_size)
        mask = batch["attention_mask"].float()
        gen0 = stages.emus["policy_generation"][0].name
        start = await gen_host.logprobs.call_one(gen0, batch) * mask

        async def compare(job_: RLJob, record: dict) -> None:
            if record["step"] != steps - 2 or seen:
                return
            run = job_.async_run
            [w] = run.workers
            async with w.lock:  # the request in flight ends first; no new one starts
                if w.version < run.published:
                    await run._sync_worker(w)
                seen["versions"] = (w.version, run.published, job_.step)
                seen["vllm"] = await gen_host.logprobs.call_one(w.name, batch) * mask
                seen["policy"] = await train_host.logprobs.call_one(train, batch) * mask

        run = AsyncRun(rl)
        rl.async_run = run
        rl.boundary_hooks.append(compare)
        await run.run()
    finally:
        await rl.close()
    B = 4
    positions = sorted(p for r in run.records for p in r["positions"])
    assert positions == list(range(steps * B)), "a position trained twice or skipped"
    _check_tokens(run, K)
    summary = run.summary
    assert summary["max_staleness_seen"] <= K and summary["samples_discarded"] == 0
    assert summary["weight_syncs"] >= 1
    version, published, step = seen["versions"]
    assert version == published == step == steps - 1
    assert float((seen["policy"] - start).abs().max()) > 1e-2  # the policy moved
    torch.testing.assert_close(seen["vllm"], seen["policy"], atol=1e-3, rtol=1e-3)


async def test_async_remax_on_vllm_decodes_its_baseline_rows_greedily(tmp_path):
    steps = 3
    _, run = await _run(_config(str(tmp_path), steps, name="remax", samples_per_prompt=2))
    positions = sorted(p for r in run.records for p in r["positions"])
    assert positions == list(range(steps * 4))
    _check_tokens(run, K)
    assert all(r["tokens_generated"] > 0 for r in run.records)
