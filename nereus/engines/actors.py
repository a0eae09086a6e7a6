"""Engines as actors: one ``EngineActor`` per device, an EMU = a mesh of tp x pp actors.

Worker side, ``EngineActor(kind, model_config, model_dir, options, ...)`` builds the engine
``kind`` names -- ``"generation"`` (built-in), ``"vllm"``, ``"inference"``, ``"training"`` --
at its place in the EMU, read from its mesh coordinates (``pp``, ``tp``), with the
communicators of its TP, PP and DP groups looked up by id (``nereus.transfer``). Blocking
engine work runs in a thread (``nereus.actors.in_thread``, kept at one torch thread: two workers
sharing cores thrash as soon as either spreads) so the worker's loop keeps answering;
every endpoint is sequential per actor, and every rank of the EMU must be called together
(the engines run collectives), which ``mesh.<endpoint>.call`` does.

Driver side, ``spawn_emu(cluster, name, kind, devices, tp=, pp=, ...)`` makes the TP and PP
groups (``make_group``), spawns the mesh with axes ``{"pp": pp, "tp": tp}`` over
``devices`` in row-major order (rank = pp_rank * tp + tp_rank), and returns an ``EmuHandle``
whose methods call every rank and return one answer (rank 0's, or the last stage's for
training metrics). ``spawn_model_stage`` spawns ``dp`` such EMUs of one model-stage with a
DP group per (pp, tp) position; ``ModelStageHandle`` splits rows across them.

Memory: each worker's engines reserve against ``current_device().memory_bytes`` (the
cluster's ``memory_per_device``); running out raises ``OutOfMemory`` in the worker, which
reaches the caller as ``RemoteError`` with ``remote_type == "OutOfMemory"`` and the
device, need and budget in its message.

Refuses (``ConfigError``): an unknown kind, ``len(devices) != tp * pp``, a layout the model
cannot be cut into.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nereus.actors import Actor, Cluster, endpoint, in_thread
from nereus.config import require, to_dict
from nereus.engines.generation import GenerationOutput
from nereus.engines.losses import even_slices
from nereus.engines.sampling import SamplingParams
from nereus.models.config import ModelConfig

__all__ = ["EngineActor", "run_engine_work", "EmuHandle", "ModelStageHandle", "spawn_emu", "spawn_model_stage", "KINDS"]

log = logging.getLogger("nereus.engines")

KINDS = ("generation", "vllm", "inference", "training")


def _one_thread(fn: Any, *args: Any) -> Any:
    # OpenMP's thread count is per calling thread: executor threads start at the default.
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return fn(*args)


async def run_engine_work(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a thread (the worker's event loop keeps answering), one torch thread."""
    return await in_thread(_one_thread, fn, *args)


class EngineActor(Actor):
    """One rank of one EMU (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        model_config: dict[str, Any],
        model_dir: str | None,
        options: dict[str, Any] | None = None,
        *,
        engine_name: str = "",
        tp_groups: list[str] | None = None,
        pp_groups: list[str] | None = None,
        layer_cuts: list[int] | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        dp_groups: list[str] | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        from nereus.engines.context import EmuContext
        from nereus.models.parallel import ParallelContext
        from nereus.transfer import get_communicator

        require(kind in KINDS, "EngineActor.kind", kind, f"must be one of {KINDS}")
        torch.set_num_threads(1)
        pp_rank, tp_rank = self.coords.get("pp", 0), self.coords.get("tp", 0)
        tp = len(pp_groups) if pp_groups else 1
        pp = len(tp_groups) if tp_groups else 1
        tp_comm = get_communicator(tp_groups[pp_rank]) if tp_groups and tp > 1 else None
        pp_comm = get_communicator(pp_groups[tp_rank]) if pp_groups and pp > 1 else None
        dp_comm = get_communicator(dp_groups[pp_rank * tp + tp_rank]) if dp_groups and dp_size > 1 else None
        pc = ParallelContext(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, tp_comm=tp_comm,
                             layer_cuts=tuple(layer_cuts) if layer_cuts else None)
        # A GPU worker sees its GPU as the current CUDA device; a CPU worker stands for one.
        device = "cuda" if getattr(self.device, "kind", "cpu") == "cuda" and kind in ("inference", "training") else "cpu"
        ctx = EmuContext(pc, pp_comm=pp_comm, dp_rank=dp_rank, dp_size=dp_size, dp_comm=dp_comm,
                         timeout_s=timeout_s, device=device)
        config = ModelConfig(**model_config)
        opts = dict(options or {})
        name = engine_name or self.mesh_name
        self.kind = kind
        if kind == "generation":
            from nereus.engines.generation import GenerationEngine

            self.engine: Any = GenerationEngine(config, ctx, model_dir=model_dir, name=name, **opts)
        elif kind == "vllm":
            from nereus.engines.vllm_adapter import VllmGenerationEngine

            require(model_dir is not None, "EngineActor.model_dir", model_dir, "is required for kind='vllm'")
            self.engine = VllmGenerationEngine(config, model_dir, ctx, name=name, **opts)
        elif kind == "inference":
            from nereus.engines.inference import InferenceEngine

            self.engine = InferenceEngine(config, ctx, model_dir=model_dir, name=name, **opts)
        else:
            from nereus.engines.training import TrainingEngine

            self.engine = TrainingEngine(config, ctx, model_dir=model_dir, name=name, **opts)

    @endpoint
    async def generate(self, prompts: list[list[int]], params: dict[str, Any] | None = None) -> dict[str, Any]:
        out = await run_engine_work(self.engine.generate, prompts, params)
        return out.to_dict()

    @endpoint
    async def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        return await run_engine_work(self.engine.logprobs, batch, temperature)

    @endpoint
    async def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await run_engine_work(self.engine.values, batch)

    @endpoint
    async def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await run_engine_work(self.engine.rewards, batch)

    @endpoint
    async def train_step(self, batch: dict[str, torch.Tensor], loss: str = "nereus.engines.losses:nll_loss",
                         loss_kwargs: dict[str, Any] | None = None, micro_batch_size: int | None = None,
                         temperature: float = 1.0) -> dict[str, float]:
        return await run_engine_work(self.engine.train_step, batch, loss, loss_kwargs, micro_batch_size, temperature)

    @endpoint
    async def state(self) -> dict[str, Any]:
        """This rank's tensors (copies): parameters and AdamW moments for training,
        weights otherwise; plus the update counter."""
        if self.kind == "training":
            return {"tensors": {k: v.clone() for k, v in self.engine.named_state().items()}, "step": self.engine.step}
        return {"tensors": {k: v.clone() for k, v in self.engine.named_weights().items()}, "step": 0}

    @endpoint
    async def load_state(self, tensors: dict[str, torch.Tensor], step: int | None = None) -> int:
        if self.kind == "training":
            return await run_engine_work(self.engine.load_named_state, tensors, step)
        return await run_engine_work(self.engine.load_named, tensors)

    @endpoint
    async def memory(self) -> dict[str, int]:
        return self.engine.memory()

    @endpoint
    async def free_cache(self) -> int:
        """Give back the generation KV cache (built-in engine) or sleep (vLLM)."""
        if self.kind == "generation":
            return self.engine.free_cache()
        if self.kind == "vllm":
            return await run_engine_work(self.engine.sleep)
        return 0

    @endpoint
    async def sleep(self) -> int:
        """Free weights and KV cache of a generation engine; returns the bytes freed."""
        require(self.kind in ("generation", "vllm"), "sleep", self.kind, "is only for generation engines")
        return await run_engine_work(self.engine.sleep)

    @endpoint
    async def wake_up(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        require(self.kind in ("generation", "vllm"), "wake_up", self.kind, "is only for generation engines")
        if self.kind == "vllm":
            await run_engine_work(self.engine.wake_up)
            if weights:
                await run_engine_work(self.engine.load_named, weights)
            return
        await run_engine_work(self.engine.wake_up, weights)

    @endpoint
    async def close(self) -> None:
        self.engine.close()


@dataclass
class EmuHandle:
    """The driver's handle on one EMU (a tp x pp mesh of ``EngineActor``)."""

    name: str
    kind: str
    mesh: Any
    devices: list[int]
    tp: int
    pp: int
    groups: list[Any] = field(default_factory=list)

    @property
    def last_stage_rank(self) -> int:
        return (self.pp - 1) * self.tp

    async def generate(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None) -> GenerationOutput:
        p = SamplingParams.from_any(params).to_dict()
        out = (await self.mesh.generate.call(prompts, p))[0]
        return GenerationOutput(out["token_ids"], out["logprobs"], out["finish_reasons"])

    async def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        return (await self.mesh.logprobs.call(batch, temperature))[0]

    async def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (await self.mesh.values.call(batch))[0]

    async def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (await self.mesh.rewards.call(batch))[0]

    async def train_step(self, batch: dict[str, torch.Tensor], loss: str = "nereus.engines.losses:nll_loss",
                         loss_kwargs: dict[str, Any] | None = None, micro_batch_size: int | None = None,
                         temperature: float = 1.0) -> dict[str, float]:
        """Metrics of the step, as the last pipeline stage reports them."""
        results = await self.mesh.train_step.call(batch, loss, loss_kwargs or {}, micro_batch_size, temperature)
        return results[self.last_stage_rank]

    async def state(self) -> list[dict[str, Any]]:
        """Every rank's tensors and counter, in rank order."""
        return await self.mesh.state.call()

    async def memory(self) -> list[dict[str, int]]:
        return await self.mesh.memory.call()

    async def stop(self, drop_groups: bool = False) -> None:
        """Close the engines (their reservations) and stop the actors.

        The TP/PP groups belong to the layout epoch, not to this EMU: the data plane hands
        the same group to every EMU of that epoch over the same devices (two model-stages
        on the same devices share it, their calls being serialized by the driver). So they
        are dropped only with ``drop_groups`` (when no other EMU of the epoch uses them) or
        by ``nereus.transfer.release_groups(cluster, epoch)`` at the end of a transition."""
        try:
            await self.mesh.close.call()
        finally:
            await self.mesh.stop()
            if drop_groups:
                for g in self.groups:
                    await g.destroy()


async def spawn_emu(
    cluster: Cluster,
    name: str,
    kind: str,
    devices: list[int],
    *,
    model_config: ModelConfig,
    model_dir: str | Path | None,
    tp: int = 1,
    pp: int = 1,
    options: dict[str, Any] | None = None,
    layer_cuts: list[int] | None = None,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_groups: list[str] | None = None,
    epoch: int = 0,
    timeout_s: float = 120.0,
) -> EmuHandle:
    """Spawn one EMU of ``kind`` over ``devices`` (rank order: pp-major, then tp)."""
    from nereus.models.decoder import check_layout
    from nereus.transfer import make_group

    require(kind in KINDS, "kind", kind, f"must be one of {KINDS}")
    require(tp >= 1 and pp >= 1, "tp/pp", (tp, pp), "must be >= 1")
    require(len(devices) == tp * pp, "devices", list(devices), f"must list tp*pp={tp * pp} devices")
    check_layout(model_config, tp, pp)
    groups = []
    try:
        tp_groups: list[str] = []
        pp_groups: list[str] = []
        if tp > 1:
            for p in range(pp):
                g = await make_group(cluster, [devices[p * tp + t] for t in range(tp)], epoch=epoch, timeout_s=timeout_s)
                groups.append(g)
                tp_groups.append(g.group_id)
        if pp > 1:
            for t in range(tp):
                g = await make_group(cluster, [devices[p * tp + t] for p in range(pp)], epoch=epoch, timeout_s=timeout_s)
                groups.append(g)
                pp_groups.append(g.group_id)
        mesh = await cluster.spawn(
            name, EngineActor, devices=list(devices),
            args=(kind, to_dict(model_config), None if model_dir is None else str(model_dir), options or {}),
            kwargs={"engine_name": name, "tp_groups": tp_groups or [""] * pp, "pp_groups": pp_groups or [""] * tp,
                    "layer_cuts": layer_cuts, "dp_rank": dp_rank, "dp_size": dp_size, "dp_groups": dp_groups,
                    "timeout_s": timeout_s},
            axes={"pp": pp, "tp": tp},
        )
    except BaseException:
        for g in groups:
            await g.destroy()
        raise
    return EmuHandle(name, kind, mesh, list(devices), tp, pp, groups)


@dataclass
class ModelStageHandle:
    """``dp`` EMUs of one model-stage; rows are split across them in contiguous chunks."""

    emus: list[EmuHandle]
    dp_groups: list[Any] = field(default_factory=list)

    async def generate(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None) -> GenerationOutput:
        """Prompts split across the EMUs; EMU ``i`` samples with ``seed + i``."""
        p = SamplingParams.from_any(params)
        parts = even_slices(len(prompts), len(self.emus))
        calls = []
        for i, (emu, s) in enumerate(zip(self.emus, parts, strict=True)):
            d = p.to_dict()
            if p.seed is not None:
                d["seed"] = p.seed + i
            if s.stop > s.start:
                calls.append(emu.generate(prompts[s], d))
        outs = await asyncio.gather(*calls)
        merged = GenerationOutput([], [], [])
        for o in outs:
            merged.token_ids += o.token_ids
            merged.logprobs += o.logprobs
            merged.finish_reasons += o.finish_reasons
        return merged

    async def train_step(self, batch: dict[str, torch.Tensor], loss: str = "nereus.engines.losses:nll_loss",
                         loss_kwargs: dict[str, Any] | None = None, micro_batch_size: int | None = None,
                         temperature: float = 1.0) -> dict[str, float]:
        """Rows split across the DP replicas; gradients meet in the DP all-reduce, so the
        step equals one over the whole batch. Returns replica 0's (global) metrics."""
        rows = next(iter(batch.values())).shape[0]
        require(rows >= len(self.emus), "batch rows", rows, f"must be >= the number of DP replicas ({len(self.emus)})")
        parts = even_slices(rows, len(self.emus))
        outs = await asyncio.gather(*(
            emu.train_step({k: v[s] for k, v in batch.items()}, loss, loss_kwargs, micro_batch_size, temperature)
            for emu, s in zip(self.emus, parts, strict=True)))
        return outs[0]

    async def _split(self, method: str, batch: dict[str, torch.Tensor], *args: Any) -> torch.Tensor:
        """Rows split across the EMUs (none left empty), results concatenated in order."""
        rows = next(iter(batch.values())).shape[0]
        parts = [s for s in even_slices(rows, len(self.emus)) if s.stop > s.start]
        outs = await asyncio.gather(*(getattr(emu, method)({k: v[s] for k, v in batch.items()}, *args)
                                      for emu, s in zip(self.emus, parts, strict=False)))
        return torch.cat(outs, dim=0)

    async def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        return await self._split("logprobs", batch, temperature)

    async def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await self._split("values", batch)

    async def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await self._split("rewards", batch)

    async def stop(self, drop_groups: bool = False) -> None:
        """Stop every EMU (see ``EmuHandle.stop`` about groups)."""
        for emu in self.emus:
            await emu.stop(drop_groups)
        if drop_groups:
            for g in self.dp_groups:
                await g.destroy()


async def spawn_model_stage(
    cluster: Cluster,
    name: str,
    kind: str,
    emu_devices: list[list[int]],
    *,
    model_config: ModelConfig,
    model_dir: str | Path | None,
    tp: int = 1,
    pp: int = 1,
    options: dict[str, Any] | None = None,
    epoch: int = 0,
    timeout_s: float = 120.0,
) -> ModelStageHandle:
    """Spawn ``len(emu_devices)`` EMUs (DP replicas) of one model-stage, each over its
    own ``tp * pp`` devices, with one DP group per (pp, tp) position."""
    from nereus.transfer import make_group

    dp = len(emu_devices)
    require(dp >= 1, "emu_devices", emu_devices, "must list at least one EMU")
    flat = [d for devs in emu_devices for d in devs]
    require(len(set(flat)) == len(flat), "emu_devices", emu_devices, "must be disjoint (DP replicas live on different devices)")
    dp_groups: list[Any] = []
    handle = ModelStageHandle([], dp_groups)
    try:
        if dp > 1:
            for pos in range(tp * pp):
                dp_groups.append(await make_group(cluster, [devs[pos] for devs in emu_devices], epoch=epoch, timeout_s=timeout_s))
        ids = [g.group_id for g in dp_groups] or None
        for i, devs in enumerate(emu_devices):
            handle.emus.append(await spawn_emu(
                cluster, f"{name}-dp{i}", kind, devs, model_config=model_config, model_dir=model_dir, tp=tp, pp=pp,
                options=options, dp_rank=i, dp_size=dp, dp_groups=ids, epoch=epoch, timeout_s=timeout_s))
    except BaseException:
        await handle.stop(drop_groups=True)
        raise
    return handle
