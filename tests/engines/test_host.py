"""Engines as actors on a local cluster: EMUs at TP x PP over real worker processes and
groups made by the data plane, DP model-stages, and the device budget."""

from __future__ import annotations

import pytest
import torch

from nereus.actors import Cluster
from nereus.engines import GenerationEngine, InferenceEngine, SamplingParams, TrainingEngine
from nereus.engines._base import stage_param_bytes
from nereus.engines.actors import spawn_emu, spawn_model_stage
from nereus.engines.context import EmuContext
from nereus.engines.memory import MemoryLedger
from nereus.errors import ConfigError, RemoteError
from nereus.models import ParallelContext, save_tiny_model, tiny_config

CONFIG = tiny_config(num_hidden_layers=2, tie_word_embeddings=True)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("actors") / "m", CONFIG, seed=4, init_std=0.3)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.timeout(240)
async def test_emus_at_tp_pp_and_dp_match_one_process(model_dir):
    ledger = MemoryLedger("actors-ref", None)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    ref_gen = GenerationEngine(CONFIG, model_dir=model_dir, ledger=ledger, name="g")
    ref_tokens = ref_gen.generate(PROMPTS, params).token_ids
    stop = ref_tokens[1][1]  # row 1 stops after two tokens; the others run on
    stop_params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(stop,))
    ref_stop = ref_gen.generate(PROMPTS * 2, stop_params)
    sampled_params = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=21)
    ref_sampled = ref_gen.generate(PROMPTS * 2, sampled_params)
    ref_single = ref_gen.generate(PROMPTS[:1], params).token_ids
    ref_lp = InferenceEngine(CONFIG, model_dir=model_dir, ledger=ledger, name="i").logprobs(_batch())
    ref_train = TrainingEngine(CONFIG, model_dir=model_dir, ledger=ledger, name="t", optim={"lr": 1e-3})
    ref_metrics = ref_train.train_step(_batch(), micro_batch_size=1)

    async with Cluster.local(devices=4, memory_per_device="256MiB") as cluster:
        gen = await spawn_emu(cluster, "policy-generation", "generation", [0, 1, 2, 3],
                              model_config=CONFIG, model_dir=model_dir, tp=2, pp=2,
                              options={"wavefront": True})
        inf = await spawn_emu(cluster, "reference-inference", "inference", [3, 2],
                              model_config=CONFIG, model_dir=model_dir, tp=2)
        try:
            out = await gen.generate(PROMPTS, params)
            assert out.token_ids == ref_tokens
            # the wavefront path: groups of rows finish at different steps
            got = await gen.generate(PROMPTS * 2, stop_params)
            assert got.token_ids == ref_stop.token_ids and got.finish_reasons == ref_stop.finish_reasons
            assert "stop" in got.finish_reasons and "length" in got.finish_reasons
            got = await gen.generate(PROMPTS * 2, sampled_params)
            assert got.token_ids == ref_sampled.token_ids
            # fewer prompts than stages: stage after stage
            assert (await gen.generate(PROMPTS[:1], params)).token_ids == ref_single
            lp = await inf.logprobs(_batch())
            torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
            held = await gen.memory()
            assert all("policy-generation/kv_cache" in h for h in held)
        finally:
            await gen.stop(drop_groups=True)
            await inf.stop(drop_groups=True)

        stage = await spawn_model_stage(cluster, "policy-training", "training", [[0, 1], [2, 3]],
                                        model_config=CONFIG, model_dir=model_dir, pp=2,
                                        options={"optim": {"lr": 1e-3}})
        try:
            metrics = await stage.train_step(_batch(), micro_batch_size=1)
            assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
            states = await stage.emus[1].state()
            ref_state = ref_train.named_state()
            for rank_state in states:
                assert rank_state["step"] == 1
                for name, tensor in rank_state["tensors"].items():
                    torch.testing.assert_close(tensor, ref_state[name], atol=2e-4, rtol=1e-3)
        finally:
            await stage.stop(drop_groups=True)

        # Two model-stages on the same devices share the epoch's TP group; stopping one
        # leaves the other working.
        gen2 = await spawn_emu(cluster, "policy-generation-2", "generation", [0, 1],
                               model_config=CONFIG, model_dir=model_dir, tp=2)
        inf2 = await spawn_emu(cluster, "reference-inference-2", "inference", [0, 1],
                               model_config=CONFIG, model_dir=model_dir, tp=2)
        assert gen2.groups[0].group_id == inf2.groups[0].group_id
        assert (await gen2.generate(PROMPTS, params)).token_ids == ref_tokens
        await gen2.stop()
        torch.testing.assert_close(await inf2.logprobs(_batch()), ref_lp, atol=1e-4, rtol=1e-4)
        await inf2.stop(drop_groups=True)


@pytest.mark.timeout(120)
async def test_out_of_memory_in_a_worker_names_device_need_and_budget(model_dir):
    weights = stage_param_bytes(CONFIG, EmuContext(ParallelContext()), torch.float32)
    budget = weights + 4096  # the weights fit, a KV cache for the request does not
    async with Cluster.local(devices=1, memory_per_device=budget) as cluster:
        gen = await spawn_emu(cluster, "policy-generation", "generation", [0], model_config=CONFIG, model_dir=model_dir)
        try:
            with pytest.raises(RemoteError) as info:
                await gen.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
            err = info.value
            assert err.remote_type == "OutOfMemory"
            assert "device 0" in err.remote_message and str(budget) in err.remote_message
            assert "policy-generation/kv_cache" in err.remote_message
        finally:
            await gen.stop()
        with pytest.raises(RemoteError, match="OutOfMemory"):
            await spawn_emu(cluster, "policy-training", "training", [0], model_config=CONFIG, model_dir=model_dir)


async def test_bad_layouts_are_refused_before_spawning(model_dir):
    async with Cluster.local(devices=2, memory_per_device="64MiB") as cluster:
        with pytest.raises(ConfigError, match="devices"):
            await spawn_emu(cluster, "g", "generation", [0], model_config=CONFIG, model_dir=model_dir, tp=2)
        with pytest.raises(ConfigError, match="kind"):
            await spawn_emu(cluster, "g", "decoding", [0], model_config=CONFIG, model_dir=model_dir)
        with pytest.raises(ConfigError, match="tp_size"):
            await spawn_emu(cluster, "g", "generation", [0, 1, 1], model_config=CONFIG, model_dir=None, tp=3)


@pytest.mark.timeout(120)
async def test_a_dp_critic_stage_splits_rows_and_concatenates_values(model_dir):
    ref = InferenceEngine(CONFIG, model_dir=model_dir, value_head=True, ledger=MemoryLedger("v-ref", None), name="v")
    batch = _batch()
    async with Cluster.local(devices=2, memory_per_device="256MiB") as cluster:
        stage = await spawn_model_stage(cluster, "critic-inference", "inference", [[0], [1]],
                                        model_config=CONFIG, model_dir=model_dir, options={"value_head": True})
        try:
            # a non-zero head (a fresh one is zero), written in place on every rank
            head = {"value_head.weight": torch.randn(1, CONFIG.hidden_size, generator=torch.Generator().manual_seed(3)),
                    "value_head.bias": torch.tensor([0.25])}
            ref.load_named(head)
            for emu in stage.emus:
                await emu.mesh.load_state.call(head)
            values = await stage.values(batch)
            assert float(values.abs().sum()) > 0
            torch.testing.assert_close(values, ref.values(batch))
            torch.testing.assert_close(await stage.rewards(batch), ref.rewards(batch))
            torch.testing.assert_close(await stage.logprobs(batch), ref.logprobs(batch), atol=1e-5, rtol=1e-5)
        finally:
            await stage.stop(drop_groups=True)
