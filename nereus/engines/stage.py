"""Model-stages on a cluster (driver side): the one place that makes EMUs, their groups and
their engines.

Every device of a job has one ``EngineHost`` (``spawn_hosts``): the worker's shard store
and the engines over it. A model-stage is ``dp`` EMUs (``nereus.state.EMU``: layout,
devices, ModelSpec, slots); each EMU is a TP x PP mesh of those hosts, and its engine is
called by EMU name.

Memory: engines reserve against the device's ledger (``nereus.state.ledger``); running
out raises ``OutOfMemory`` in the worker, which reaches the caller as ``RemoteError``
with ``remote_type == "OutOfMemory"`` and the device, need and budget in its message.

Refuses (``ConfigError``): an unknown kind, EMUs of different model-stages or layouts in
one handle, overlapping DP replicas, more DP replicas than rows.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nereus.actors import ActorMesh, ActorRef, Cluster
from nereus.config import require, to_dict
from nereus.engines.generation import GenerationOutput
from nereus.engines.host import KINDS, EngineHost
from nereus.engines.losses import even_slices
from nereus.engines.sampling import SamplingParams
from nereus.errors import ActorDied
from nereus.models.config import ModelConfig
from nereus.state.emu import EMU, emu_to_plain

__all__ = [
    "EmuHandle",
    "ModelStageHandle",
    "spawn_hosts",
    "spawn_model_stage",
    "start_model_stage",
    "stage_groups",
]

log = logging.getLogger("nereus.engines")


async def spawn_hosts(
    cluster: Cluster,
    devices: Sequence[int] | None = None,
    *,
    name: str | None = None,
    bucket_bytes: int | None = None,
    host_class: type[EngineHost] = EngineHost,
) -> ActorMesh:
    """One ``EngineHost`` on each of ``devices`` (default: every device of the cluster);
    returns their mesh (``{r.device: r for r in mesh.refs}`` is what the functions here
    take as ``hosts``; ``cluster.stop_mesh(mesh)`` stops them and frees their stores)."""
    devs = list(devices) if devices is not None else [d.index for d in cluster.devices]
    kwargs = {"bucket_bytes": bucket_bytes} if bucket_bytes is not None else {}
    return await cluster.spawn(
        name or f"nereus-hosts-{uuid.uuid4().hex[:8]}", host_class, devices=devs, kwargs=kwargs
    )


def emu_mesh(emu: EMU, hosts: Mapping[int, ActorRef]) -> ActorMesh:
    """``emu`` as a pp x tp mesh of its devices' hosts (rank = pp_rank * tp + tp_rank)."""
    missing = [d for d in emu.devices if d not in hosts]
    require(not missing, f"EMU {emu.name} devices", missing, "must each have an engine host")
    return ActorMesh(
        emu.name, [hosts[d] for d in emu.devices], {"pp": emu.layout.pp, "tp": emu.layout.tp}
    )


async def stage_groups(
    cluster: Cluster, kind: str, emus: Sequence[EMU], *, epoch: int, timeout_s: float = 120.0
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Per EMU, the group ids its ranks need (TP per pipeline stage, PP per TP rank, DP per
    position for training), and every group handle made."""
    from nereus.transfer import make_group

    handles: list[Any] = []

    async def group(devices: list[int]) -> str | None:
        if len(devices) < 2:
            return None
        g = await make_group(cluster, devices=devices, epoch=epoch, timeout_s=timeout_s)
        handles.append(g)
        return g.group_id

    lay = emus[0].layout
    tp, pp, dp = lay.tp, lay.pp, len(emus)
    dp_ids: list[str | None] = []
    if kind == "training" and dp > 1:
        dp_ids = [await group([e.devices[pos] for e in emus]) for pos in range(tp * pp)]
    out = []
    for i, emu in enumerate(emus):
        devs = list(emu.devices)
        tp_ids = [await group(devs[s * tp : (s + 1) * tp]) for s in range(pp)] if tp > 1 else []
        pp_ids = [await group(devs[t::tp]) for t in range(tp)] if pp > 1 else []
        # only training replicas talk to each other (gradients); other EMUs are independent
        dp_rank, dp_size = (i, dp) if dp_ids else (0, 1)
        out.append(
            {
                "tp": tp_ids,
                "pp": pp_ids,
                "dp": dp_ids,
                "dp_rank": dp_rank,
                "dp_size": dp_size,
                "timeout_s": timeout_s,
            }
        )
    return out, handles


def _check_stage(kind: str, emus: Sequence[EMU]) -> None:
    require(kind in KINDS, "kind", kind, f"must be one of {KINDS}")
    require(len(emus) >= 1, "emus", list(emus), "must list at least one EMU")
    require(
        len({(e.model_stage, e.layout) for e in emus}) == 1,
        "emus",
        list(emus),
        "must share one model-stage and one layout",
    )
    flat = [d for e in emus for d in e.devices]
    require(
        len(set(flat)) == len(flat),
        "emus",
        list(emus),
        "must sit on disjoint devices (DP replicas)",
    )


async def spawn_model_stage(
    cluster: Cluster,
    hosts: Mapping[int, ActorRef],
    name: str,
    kind: str,
    emus: Sequence[EMU],
    *,
    model_config: ModelConfig,
    model_dir: str | Path | None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    epoch: int = 0,
    timeout_s: float = 120.0,
) -> ModelStageHandle:
    """Fill the stores with ``emus``' shards (read from ``model_dir``, or seeded) and start
    their engines (see the module docstring)."""
    _check_stage(kind, emus)
    plain_config = to_dict(model_config)
    folder = None if model_dir is None else str(model_dir)
    await asyncio.gather(
        *(
            hosts[d].load_weights.call_one(emu_to_plain(e), plain_config, folder, seed)
            for e in emus
            for d in e.devices
        )
    )
    return await start_model_stage(
        cluster,
        hosts,
        name,
        kind,
        emus,
        model_config=model_config,
        options=options,
        epoch=epoch,
        timeout_s=timeout_s,
    )


async def start_model_stage(
    cluster: Cluster,
    hosts: Mapping[int, ActorRef],
    name: str,
    kind: str,
    emus: Sequence[EMU],
    *,
    model_config: ModelConfig,
    options: dict[str, Any] | None = None,
    epoch: int = 0,
    timeout_s: float = 120.0,
    caches: Mapping[str, Sequence[int]] | None = None,
) -> ModelStageHandle:
    """Start the engines of ``emus`` over the shards the stores hold (see the module
    docstring); ``caches`` (EMU name -> ``[rows, slots]``) reserves generation KV caches."""
    _check_stage(kind, emus)
    groups, handles = await stage_groups(cluster, kind, emus, epoch=epoch, timeout_s=timeout_s)
    handle = ModelStageHandle(
        name, kind, [EmuHandle(e, kind, emu_mesh(e, hosts)) for e in emus], handles
    )
    plain_config = to_dict(model_config)
    caches = caches or {}
    try:
        await asyncio.gather(
            *(
                h.mesh.build_engine.call(
                    emu_to_plain(h.emu),
                    kind,
                    plain_config,
                    options or {},
                    g,
                    list(caches[h.emu.name]) if h.emu.name in caches else None,
                )
                for h, g in zip(handle.emus, groups, strict=True)
            )
        )
    except BaseException:
        await handle.stop()
        raise
    return handle


@dataclass
class EmuHandle:
    """The driver's handle on one EMU's engine: its description and its mesh of hosts."""

    emu: EMU
    kind: str
    mesh: ActorMesh

    @property
    def name(self) -> str:
        return self.emu.name

    @property
    def devices(self) -> tuple[int, ...]:
        return self.emu.devices

    @property
    def last_stage_rank(self) -> int:
        return (self.emu.layout.pp - 1) * self.emu.layout.tp

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None
    ) -> GenerationOutput:
        p = SamplingParams.from_any(params).to_dict()
        out = (await self.mesh.generate.call(self.name, prompts, p))[0]
        return GenerationOutput(out["token_ids"], out["logprobs"], out["finish_reasons"])

    async def logprobs(
        self, batch: dict[str, torch.Tensor], temperature: float = 1.0
    ) -> torch.Tensor:
        return (await self.mesh.logprobs.call(self.name, batch, temperature))[0]

    async def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (await self.mesh.values.call(self.name, batch))[0]

    async def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (await self.mesh.rewards.call(self.name, batch))[0]

    async def train_step(
        self,
        batch: dict[str, torch.Tensor],
        loss: str = "nereus.engines.losses:nll_loss",
        loss_kwargs: dict[str, Any] | None = None,
        micro_batch_size: int | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Metrics of the step, as the last pipeline stage reports them."""
        results = await self.mesh.train_step.call(
            self.name, batch, loss, loss_kwargs or {}, micro_batch_size, temperature
        )
        return results[self.last_stage_rank]

    async def free_cache(self) -> None:
        await self.mesh.free_cache.call(self.name)

    async def cache_shape(self) -> list[int]:
        return (await self.mesh.cache_shape.call(self.name))[0]

    async def shards(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's tensors of this EMU from its store (parameters and optimizer
        slots), in rank order."""
        return await self.mesh.get_shards.call(self.name)


@dataclass
class ModelStageHandle:
    """``dp`` EMUs of one model-stage with their engines (see the module docstring)."""

    name: str
    kind: str
    emus: list[EmuHandle]
    groups: list[Any] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return len(self.emus)

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None
    ) -> GenerationOutput:
        """Prompts cut across the EMUs (with their rows' own bounds, if any); EMU ``i``
        samples with ``seed + i``."""
        p = SamplingParams.from_any(params)
        limits = p.row_limits(len(prompts))
        calls = []
        for i, (emu, s) in enumerate(
            zip(self.emus, even_slices(len(prompts), len(self.emus)), strict=True)
        ):
            d = p.to_dict()
            if p.seed is not None:
                d["seed"] = p.seed + i
            if limits is not None:
                d["row_max_tokens"] = limits[s]
            if s.stop > s.start:
                calls.append(emu.generate(prompts[s], d))
        merged = GenerationOutput([], [], [])
        for o in await asyncio.gather(*calls):
            merged.token_ids += o.token_ids
            merged.logprobs += o.logprobs
            merged.finish_reasons += o.finish_reasons
        return merged

    async def train_step(
        self,
        batch: dict[str, torch.Tensor],
        loss: str = "nereus.engines.losses:nll_loss",
        loss_kwargs: dict[str, Any] | None = None,
        micro_batch_size: int | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Rows cut across the DP replicas (see the module docstring); replica 0's
        (global) metrics."""
        rows = next(iter(batch.values())).shape[0]
        require(
            rows >= len(self.emus),
            "batch rows",
            rows,
            f"must be >= the number of DP replicas ({len(self.emus)})",
        )
        outs = await asyncio.gather(
            *(
                emu.train_step(
                    {k: v[s] for k, v in batch.items()},
                    loss,
                    loss_kwargs,
                    micro_batch_size,
                    temperature,
                )
                for emu, s in zip(self.emus, even_slices(rows, len(self.emus)), strict=True)
            )
        )
        return outs[0]

    async def _split(self, method: str, batch: dict[str, torch.Tensor], *args: Any) -> torch.Tensor:
        """Rows cut across the EMUs (none left empty), results concatenated in order."""
        rows = next(iter(batch.values())).shape[0]
        parts = [s for s in even_slices(rows, len(self.emus)) if s.stop > s.start]
        outs = await asyncio.gather(
            *(
                getattr(emu, method)({k: v[s] for k, v in batch.items()}, *args)
                for emu, s in zip(self.emus, parts, strict=False)
            )
        )
        return torch.cat(outs, dim=0)

    async def logprobs(
        self, batch: dict[str, torch.Tensor], temperature: float = 1.0
    ) -> torch.Tensor:
        return await self._split("logprobs", batch, temperature)

    async def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await self._split("values", batch)

    async def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await self._split("rewards", batch)

    async def free_caches(self) -> None:
        await asyncio.gather(*(emu.free_cache() for emu in self.emus))

    async def stop(self) -> None:
        """Close the engines (their gradients, caches and activations leave the ledgers);
        the stores keep the EMUs' tensors. Groups belong to their layout epoch and are
        released with it (``nereus.transfer.release_groups``)."""
        results = await asyncio.gather(
            *(emu.mesh.drop_engines.call([emu.name]) for emu in self.emus), return_exceptions=True
        )
        errors = []
        for emu, r in zip(self.emus, results, strict=True):
            if isinstance(r, ActorDied):
                # a dead worker took the engine with it; its failure went to on_failure
                log.info("the engine of %s died with its worker: %s", emu.name, r)
            elif isinstance(r, BaseException):
                errors.append(r)
        if errors:
            raise errors[0]
