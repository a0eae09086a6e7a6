"""Engines over worker-resident shard stores on a local cluster: EMUs at TP x PP over real
worker processes and groups made by the data plane, DP model-stages, engines that adopt
the store's tensors, and the device budget."""

from __future__ import annotations

import pytest
import torch

from nereus.actors import Cluster, endpoint
from nereus.engines import (
    EngineHost,
    GenerationEngine,
    InferenceEngine,
    SamplingParams,
    TrainingEngine,
    spawn_hosts,
    spawn_model_stage,
    start_model_stage,
)
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.errors import ConfigError, RemoteError
from nereus.models import model_spec, save_tiny_model, tiny_config
from nereus.state import EMU, Layout, training_slots
from tests._leaks import children, wait_gone

pytestmark = pytest.mark.integration

CONFIG = tiny_config(num_hidden_layers=2, tie_word_embeddings=True)
SPEC = model_spec(CONFIG)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


class ProbeHost(EngineHost):
    @endpoint
    async def adopted(self, emu: str) -> bool:
        """Whether every parameter of ``emu``'s engine is the store's tensor itself."""
        held = self.shards[emu]
        return all(
            p.data_ptr() == held[k].data_ptr()
            for k, p in self.engines[emu].named_parameters().items()
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("hosts") / "m", CONFIG, seed=4, init_std=0.3)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _emu(name: str, stage: str, layout: Layout, devices, spec=SPEC, slots=("param",)) -> EMU:
    return EMU(name, stage, spec, layout, tuple(devices), slots)


@pytest.mark.timeout(240)
async def test_emus_at_tp_pp_and_dp_over_shard_stores_match_one_process(model_dir):
    ledger = MemoryLedger("hosts-ref", None)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    ref_gen = GenerationEngine(
        CONFIG, options=EngineOptions(model_dir=model_dir, ledger=ledger, name="g")
    )
    ref_tokens = ref_gen.generate(PROMPTS, params).token_ids
    stop = ref_tokens[1][1]  # row 1 stops after two tokens; the others run on
    stop_params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(stop,))
    ref_stop = ref_gen.generate(PROMPTS * 2, stop_params)
    sampled_params = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=21)
    ref_sampled = ref_gen.generate(PROMPTS * 2, sampled_params)
    limits = tuple(1 + i % 5 for i in range(len(PROMPTS) * 2))
    row_params = SamplingParams(max_tokens=5, temperature=0.9, seed=21, row_max_tokens=limits)
    ref_rows = ref_gen.generate(PROMPTS * 2, row_params)
    ref_lp = InferenceEngine(
        CONFIG, options=EngineOptions(model_dir=model_dir, ledger=ledger, name="i")
    ).logprobs(_batch())
    ref_train = TrainingEngine(
        CONFIG,
        options=EngineOptions(model_dir=model_dir, ledger=ledger, name="t"),
        optim={"lr": 1e-3},
    )
    ref_metrics = ref_train.train_step(_batch(), micro_batch_size=1)

    before = children()
    async with Cluster.local(devices=4, memory_per_device="256MiB") as cluster:
        mesh = await cluster.spawn("hosts", ProbeHost, devices=[0, 1, 2, 3])
        hosts = {r.device: r for r in mesh.refs}
        gen = await spawn_model_stage(
            cluster,
            hosts,
            "policy_generation",
            "generation",
            [_emu("gen.0", "policy_generation", Layout(2, 2), [0, 1, 2, 3])],
            model_config=CONFIG,
            model_dir=model_dir,
            options={"wavefront": True},
        )
        inf = await spawn_model_stage(
            cluster,
            hosts,
            "reference_inference",
            "inference",
            [_emu("ref.0", "reference_inference", Layout(2, 1), [3, 2])],
            model_config=CONFIG,
            model_dir=model_dir,
        )
        out = await gen.generate(PROMPTS, params)
        assert out.token_ids == ref_tokens
        # the wavefront path: groups of rows finish at different steps
        got = await gen.generate(PROMPTS * 2, stop_params)
        assert got.token_ids == ref_stop.token_ids and got.finish_reasons == ref_stop.finish_reasons
        assert "stop" in got.finish_reasons and "length" in got.finish_reasons
        assert (await gen.generate(PROMPTS * 2, sampled_params)).token_ids == ref_sampled.token_ids
        # rows with their own lengths: the wavefront's groups finish at their longest row
        got = await gen.generate(PROMPTS * 2, row_params)
        assert got.token_ids == ref_rows.token_ids
        assert [len(t) for t in got.token_ids] == list(limits)
        torch.testing.assert_close(await inf.logprobs(_batch()), ref_lp, atol=1e-4, rtol=1e-4)
        # the engines compute with the store's tensors: no second copy, no weights of their own
        assert all(await gen.emus[0].mesh.adopted.call("gen.0"))
        report = await hosts[0].memory.call_one()
        assert (
            report["breakdown"]["shards/gen.0"] > 0 and "gen.0/weights" not in report["breakdown"]
        )
        assert report["breakdown"]["gen.0/kv_cache"] > 0 and report["engines"] == {
            "gen.0": "generation"
        }
        assert report["peak_bytes"] >= report["used_bytes"] > 0

        # a second EMU of the same model-stage on the same devices: engines are keyed by EMU
        gen_b = await spawn_model_stage(
            cluster,
            hosts,
            "policy_generation",
            "generation",
            [_emu("gen.1", "policy_generation", Layout(2, 1), [0, 1])],
            model_config=CONFIG,
            model_dir=model_dir,
        )
        assert (await gen_b.generate(PROMPTS, params)).token_ids == ref_tokens
        assert (await gen.generate(PROMPTS, params)).token_ids == ref_tokens
        # stopping an engine keeps the store's tensors; starting it again needs no weights
        await gen_b.stop()
        assert "gen.1" in await hosts[0].held.call_one()
        gen_b = await start_model_stage(
            cluster,
            hosts,
            "policy_generation",
            "generation",
            [gen_b.emus[0].emu],
            model_config=CONFIG,
        )
        assert (await gen_b.generate(PROMPTS, params)).token_ids == ref_tokens
        for stage in (gen, gen_b, inf):
            await stage.stop()

        slots = training_slots("float32")
        train = await spawn_model_stage(
            cluster,
            hosts,
            "policy_training",
            "training",
            [
                _emu(f"train.{i}", "policy_training", Layout(1, 2), devs, slots=slots)
                for i, devs in enumerate([[0, 1], [2, 3]])
            ],
            model_config=CONFIG,
            model_dir=model_dir,
            options={"optim": {"lr": 1e-3}},
        )
        metrics = await train.train_step(_batch(), micro_batch_size=1)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
        ref_state = ref_train.named_state()
        for rank_state in await train.emus[
            1
        ].shards():  # the store holds what the optimizer stepped
            for key, tensor in rank_state.items():
                torch.testing.assert_close(tensor, ref_state[key], atol=2e-4, rtol=1e-3)
        assert all(
            s["update_count"] == 1 for s in await train.emus[1].mesh.get_state.call("train.1")
        )
        await train.stop()
        await cluster.stop_mesh(mesh)
    assert not wait_gone(children() - before, timeout_s=10), "leaked worker processes"


@pytest.mark.timeout(120)
async def test_out_of_memory_in_a_worker_names_device_need_and_budget(model_dir):
    emu = _emu("gen.0", "policy_generation", Layout(), [0])
    budget = emu.bytes_on(0) + 4096  # the weights fit, a KV cache for the request does not
    async with Cluster.local(devices=1, memory_per_device=budget) as cluster:
        hosts = {r.device: r for r in (await spawn_hosts(cluster)).refs}
        gen = await spawn_model_stage(
            cluster,
            hosts,
            "policy_generation",
            "generation",
            [emu],
            model_config=CONFIG,
            model_dir=model_dir,
        )
        with pytest.raises(RemoteError) as info:
            await gen.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
        err = info.value
        assert err.remote_type == "OutOfMemory"
        assert "device 0" in err.remote_message and str(budget) in err.remote_message
        assert "gen.0/kv_cache" in err.remote_message
        await gen.stop()
        # a training EMU's shards (weights and moments) are refused before they are read
        with pytest.raises(RemoteError, match="OutOfMemory") as info:
            await spawn_model_stage(
                cluster,
                hosts,
                "policy_training",
                "training",
                [
                    _emu(
                        "train.0", "policy_training", Layout(), [0], slots=training_slots("float32")
                    )
                ],
                model_config=CONFIG,
                model_dir=model_dir,
            )
        assert "shards/train.0" in info.value.remote_message
        assert "train.0" not in await hosts[0].held.call_one()


async def test_bad_model_stages_are_refused_before_anything_starts(model_dir):
    async with Cluster.local(devices=2, memory_per_device="64MiB") as cluster:
        hosts = {r.device: r for r in (await spawn_hosts(cluster)).refs}
        with pytest.raises(ConfigError, match="kind"):
            await spawn_model_stage(
                cluster,
                hosts,
                "g",
                "decoding",
                [_emu("g", "g", Layout(), [0])],
                model_config=CONFIG,
                model_dir=model_dir,
            )
        with pytest.raises(ConfigError, match="disjoint"):
            await spawn_model_stage(
                cluster,
                hosts,
                "g",
                "generation",
                [_emu("g0", "g", Layout(), [0]), _emu("g1", "g", Layout(), [0])],
                model_config=CONFIG,
                model_dir=model_dir,
            )
        with pytest.raises(ConfigError, match="one layout"):
            await spawn_model_stage(
                cluster,
                hosts,
                "g",
                "generation",
                [_emu("g0", "g", Layout(2), [0, 1]), _emu("g1", "g", Layout(), [0])],
                model_config=CONFIG,
                model_dir=model_dir,
            )
        assert await hosts[0].held.call_one() == {}


@pytest.mark.timeout(120)
async def test_a_dp_critic_stage_splits_rows_and_concatenates_values(model_dir):
    ref = InferenceEngine(
        CONFIG,
        options=EngineOptions(model_dir=model_dir, ledger=MemoryLedger("v-ref", None), name="v"),
        value_head=True,
    )
    batch = _batch()
    spec = model_spec(CONFIG, value_head=True)
    async with Cluster.local(devices=2, memory_per_device="256MiB") as cluster:
        hosts = {r.device: r for r in (await spawn_hosts(cluster)).refs}
        emus = [_emu(f"critic.{i}", "critic_inference", Layout(), [i], spec=spec) for i in range(2)]
        # a non-zero head (a fresh one is zero), written into the stores before the engines start
        head = {
            "value_head.weight": torch.randn(
                1, CONFIG.hidden_size, generator=torch.Generator().manual_seed(3)
            ),
            "value_head.bias": torch.tensor([0.25]),
        }
        ref.load_named(head)
        stage = await spawn_model_stage(
            cluster,
            hosts,
            "critic_inference",
            "inference",
            emus,
            model_config=CONFIG,
            model_dir=model_dir,
        )
        await stage.stop()
        for e in emus:
            held = await hosts[e.devices[0]].get_shards.call_one(e.name)
            await hosts[e.devices[0]].put_shards.call_one(e.name, {**held, **head})
        stage = await start_model_stage(
            cluster, hosts, "critic_inference", "inference", emus, model_config=CONFIG
        )
        values = await stage.values(batch)
        assert float(values.abs().sum()) > 0
        torch.testing.assert_close(values, ref.values(batch))
        torch.testing.assert_close(await stage.rewards(batch), ref.rewards(batch))
        torch.testing.assert_close(
            await stage.logprobs(batch), ref.logprobs(batch), atol=1e-5, rtol=1e-5
        )
        await stage.stop()
