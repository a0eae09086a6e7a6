"""Where a worker's tensors live: every shard, plan target and engine of a worker is on
its device (``cuda:0`` on a GPU worker, the CPU otherwise), and a weight sync reloads
the engines that keep their own copy of the weights (vLLM's way).

The CPU tier checks the placement with a stand-in device (``meta``: not the CPU, so a
tensor made without the device would show up on the wrong one) and on real CPU
workers; the GPU tier (``tests/job/test_gpu_job.py``) runs the same path on CUDA."""

from __future__ import annotations

import pytest
import torch

from nereus.actors import Cluster, DeviceInfo, endpoint
from nereus.config import to_dict
from nereus.engines import EngineHost, spawn_hosts
from nereus.engines.host import _load_shards
from nereus.errors import RemoteError
from nereus.models import model_spec, tiny_config
from nereus.state import EMU, Layout, execute_into, plan_reshard, training_slots
from nereus.state.apply import plan_part, run_part
from nereus.state.emu import emu_to_plain
from nereus.transfer import make_group

pytestmark = pytest.mark.integration

CONFIG = tiny_config(num_hidden_layers=2, tie_word_embeddings=True)
SPEC = model_spec(CONFIG)


def _emu(name: str, stage: str, layout: Layout, devices, slots=("param",)) -> EMU:
    return EMU(name, stage, SPEC, layout, tuple(devices), slots)


def test_a_gpu_device_is_cuda_0_inside_its_worker():
    gpu = DeviceInfo(5, "h", "cuda", 1 << 30, "n", local_index=3)
    assert gpu.torch_device == "cuda:0"  # the node shows the worker its GPU alone
    assert DeviceInfo(0, "h", "cpu", 1 << 30, "n").torch_device == "cpu"


def test_loaded_shards_and_plan_targets_are_made_on_the_workers_device():
    train = _emu("t", "policy_training", Layout(2), [0, 1], slots=training_slots("float32"))
    shards = _load_shards(train, CONFIG, None, 3, 0, 0, 0, "meta")
    assert set(shards) == set(train.shards_on(0))
    assert {t.device.type for t in shards.values()} == {"meta"}
    # a reshard into one device: local copies, receives from device 1, new targets
    gen = _emu("g", "policy_generation", Layout(), [0])
    plan = plan_reshard([train], gen, lambda d: 0)
    part = plan_part(plan, 0)
    assert part["tensors"] and part["recvs"]
    seen: list[torch.Tensor] = []
    out = run_part(
        part,
        {"t": shards},
        lambda sends, recvs: seen.extend(v for vs in recvs.values() for v in vs),
        tensor_device="meta",
    )
    assert set(out) == set(gen.shards_on(0))
    assert {t.device.type for t in [*out.values(), *seen]} == {"meta"}


class _CopyingEngine:
    """Stands in for vLLM: holds its own copy of the weights, reloaded by name."""

    adopts_store = False

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = {k: t.clone() for k, t in weights.items()}
        self.loads = 0

    def load_named(self, shards: dict[str, torch.Tensor]) -> int:
        for k, t in shards.items():
            self.weights[k].copy_(t)
        self.loads += 1
        return sum(t.numel() * t.element_size() for t in shards.values())

    def memory(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class CopyingHost(EngineHost):
    @endpoint
    async def use_copying_engine(self, emu: str) -> None:
        """Replace ``emu``'s engine with a copying one over the store's current values."""
        self._close([emu])
        self.engines[emu], self.kinds[emu] = _CopyingEngine(self.shards[emu]), "generation"

    @endpoint
    async def engine_weights(self, emu: str) -> dict:
        engine = self.engines[emu]
        return {"loads": engine.loads, "weights": {k: t.clone() for k, t in engine.weights.items()}}

    @endpoint
    async def placement(self, emu: str) -> dict:
        """The device of the store's tensors of ``emu`` and of its engine's context."""
        engine = self.engines.get(emu)
        return {
            "shards": sorted({str(t.device) for t in self.shards[emu].values()}),
            "engine": None if engine is None or not hasattr(engine, "ctx") else engine.ctx.device,
        }


@pytest.mark.timeout(120)
async def test_cpu_workers_place_everything_on_the_cpu_and_a_sync_reloads_copying_engines():
    train = _emu("train.0", "policy_training", Layout(), [0], slots=training_slots("float32"))
    gen = _emu("gen.0", "policy_generation", Layout(), [1])
    async with Cluster.local(devices=2, memory_per_device="128MiB") as cluster:
        mesh = await spawn_hosts(cluster, host_class=CopyingHost)
        hosts = {r.device: r for r in mesh.refs}
        plain = to_dict(CONFIG)
        await hosts[0].load_weights.call_one(emu_to_plain(train), plain, None, 1)
        await hosts[1].load_weights.call_one(emu_to_plain(gen), plain, None, 2)
        await hosts[1].build_engine.call_one(emu_to_plain(gen), "generation", plain, {}, {})
        report = await hosts[1].memory.call_one()
        assert report["tensor_device"] == "cpu"
        assert await hosts[1].placement.call_one("gen.0") == {"shards": ["cpu"], "engine": "cpu"}

        # the generation engine is replaced by one that copies; a sync must reload it
        await hosts[1].use_copying_engine.call_one("gen.0")
        before = await hosts[1].engine_weights.call_one("gen.0")
        policy = await hosts[0].get_shards.call_one("train.0")
        name = "model.layers.0.self_attn.qkv_proj.weight"
        assert not torch.equal(before["weights"][name], policy[name])
        plan = plan_reshard([train], gen, lambda d: 0)
        group = await make_group(cluster, devices=sorted(plan.devices()), epoch=1)
        stats = await execute_into([plan], hosts, group)
        assert stats.bytes_moved > 0
        after = await hosts[1].engine_weights.call_one("gen.0")
        assert after["loads"] == before["loads"] + 1
        for k, t in after["weights"].items():
            assert torch.equal(t, policy[k]), k
        await group.destroy()

        # the generation engine a host runs is refused by name when it is not one it knows
        for kind, options, field in (
            ("generation", {"engine": "tgi"}, "options.engine"),
            ("inference", {"engine": "vllm"}, "options.engine"),
            ("generation", {"engine": "vllm"}, "options.model_dir"),
        ):
            with pytest.raises(RemoteError) as info:
                await hosts[0].build_engine.call_one(emu_to_plain(train), kind, plain, options, {})
            assert info.value.remote_type == "ConfigError" and field in info.value.remote_message
        await cluster.stop_mesh(mesh)
