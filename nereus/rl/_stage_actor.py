"""The actor that hosts one model-stage's engine on one device (worker side).

``StageActor`` is spawned once per device of each EMU of a model-stage (a mesh per
model-stage, placed by the job's plan). It builds the engine its kind names
(``generation``, ``inference``, ``training``) from the initial model folder, and serves
the calls of ``nereus.rl.cluster.ClusterStages``. Blocking engine work runs in a thread
(``asyncio.to_thread``) so the worker's event loop keeps answering.

Engines of every model-stage placed on a device live in the same worker process and
share its memory ledger (``nereus.engines.memory.device_ledger``): co-resident
model-stages are accounted together against the device budget. They are also listed in
a per-process registry, so a weight sync can read the training engine's weights and
write the generation engine's on the same device without a copy through the driver.

Weight sync (``sync``): every device taking part gets its parts of the state layer's
reshard plans (``nereus.state.apply.plan_part``) in ONE call; it runs them over the
registry's engines and moves all its sends and receives in one bucketed
``nereus.transfer.exchange`` over the sync group, then writes the received shards into
the target engine in place. Per-bucket throughput goes on the tap (the data plane
emits it); the call returns bytes and seconds.

Refuses (``ConfigError``): an unknown kind, calls for a model-stage this actor does not
host.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any

import torch

from nereus.actors import Actor, endpoint
from nereus.config import require

__all__ = ["StageActor"]

log = logging.getLogger("nereus.rl")

# model-stage name -> engine, for every engine in this worker process.
_ENGINES: dict[str, Any] = {}


def _one_thread(fn: Any, *args: Any) -> Any:
    # Engine work runs on executor threads, not the thread that built the actor; make
    # sure each of them stays at one torch thread (two workers sharing two cores thrash
    # as soon as either spreads over both).
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return fn(*args)


async def _run(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a thread (the worker's event loop keeps answering), one torch thread."""
    return await asyncio.to_thread(_one_thread, fn, *args)


class StageActor(Actor):
    """One device of one EMU of one model-stage (see the module docstring)."""

    def __init__(
        self,
        stage: str,
        kind: str,
        model_config: dict[str, Any],
        model_dir: str,
        options: dict[str, Any] | None = None,
        groups: dict[str, Any] | None = None,
    ) -> None:
        """``groups`` (from the driver): ``tp``/``pp``/``dp`` group ids indexed by this
        rank's pp rank, tp rank and position in the EMU, with ``tp_size``, ``pp_size``,
        ``dp_rank`` and ``dp_size``; this rank's place comes from its mesh coordinates."""
        from nereus.engines.context import EmuContext
        from nereus.models import ModelConfig
        from nereus.models.parallel import ParallelContext
        from nereus.transfer.group import get_communicator

        require(kind in ("generation", "inference", "training"), "StageActor.kind", kind, "must be generation, inference or training")
        torch.set_num_threads(1)
        opts = dict(options or {})
        g = dict(groups or {})
        tp_size, pp_size, dp_size = g.get("tp_size", 1), g.get("pp_size", 1), g.get("dp_size", 1)
        coords = getattr(self, "coords", {}) or {}
        tp_rank, pp_rank = coords.get("tp", 0), coords.get("pp", 0)
        position = pp_rank * tp_size + tp_rank

        def comm(axis: str, index: int) -> Any:
            ids = g.get(axis)
            return get_communicator(ids[index]) if ids else None

        parallel = ParallelContext(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, tp_comm=comm("tp", pp_rank))
        ctx = EmuContext(parallel, pp_comm=comm("pp", tp_rank), dp_rank=g.get("dp_rank", 0), dp_size=dp_size, dp_comm=comm("dp", position))
        config = ModelConfig(**model_config)
        self.stage = stage
        self.kind = kind
        if kind == "generation":
            from nereus.engines.generation import GenerationEngine

            self.engine = GenerationEngine(config, ctx, model_dir=model_dir, name=stage, **opts)
        elif kind == "inference":
            from nereus.engines.inference import InferenceEngine

            self.engine = InferenceEngine(config, ctx, model_dir=model_dir, name=stage, **opts)
        else:
            from nereus.engines.training import TrainingEngine

            self.engine = TrainingEngine(config, ctx, model_dir=model_dir, name=stage, **opts)
        _ENGINES[stage] = self.engine

    @endpoint
    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
        out = await _run(self.engine.generate, prompts, params)
        return {"token_ids": out.token_ids, "logprobs": out.logprobs}

    @endpoint
    async def logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        return await _run(self.engine.logprobs, batch, temperature)

    @endpoint
    async def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await _run(self.engine.values, batch)

    @endpoint
    async def train(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any], micro_batch_size: int, temperature: float = 1.0) -> dict[str, float]:
        return await _run(self.engine.train_step, batch, loss, loss_kwargs, micro_batch_size, temperature)

    @endpoint
    async def state(self) -> dict[str, Any]:
        """This rank's parameters and AdamW moments (training) or weights, plus the
        update counter."""
        if self.kind == "training":
            tensors = {k: v.clone() for k, v in self.engine.named_state().items()}
            return {"tensors": tensors, "step": self.engine.step}
        return {"tensors": {k: v.clone() for k, v in self.engine.named_weights().items()}, "step": 0}

    @endpoint
    async def load_state(self, tensors: dict[str, torch.Tensor], step: int | None = None) -> int:
        if self.kind == "training":
            return await _run(self.engine.load_named_state, tensors, step)
        return await _run(self.engine.load_named, tensors)

    @endpoint
    async def free_cache(self) -> int:
        """Give the generation KV cache back to the device budget; returns the bytes."""
        return self.engine.free_cache() if self.kind == "generation" else 0

    @endpoint
    async def memory(self) -> dict[str, int]:
        return self.engine.memory()

    @endpoint
    async def sync(self, parts: list[dict[str, Any]], group_id: str, rank_of: dict[int, int], sources: dict[str, str], target_stage: str) -> dict[str, Any]:
        """Run this device's parts of a weight-sync plan (see the module docstring).

        ``sources`` maps each source EMU name of the plan to the model-stage whose engine
        holds it in this process; ``rank_of`` maps devices to ranks of the sync group."""
        return await _run(_run_sync, parts, group_id, rank_of, sources, target_stage)

    def close(self) -> None:
        _ENGINES.pop(self.stage, None)
        self.engine.close()


def _run_sync(parts: list[dict[str, Any]], group_id: str, rank_of: dict[int, int], sources: dict[str, str], target_stage: str) -> dict[str, Any]:
    from nereus.state.apply import run_part
    from nereus.transfer.bucket import exchange
    from nereus.transfer.group import get_communicator

    t0 = time.perf_counter()
    stores = {emu: _ENGINES[stage].named_weights() for emu, stage in sources.items() if stage in _ENGINES}
    sends: dict[int, list[torch.Tensor]] = defaultdict(list)
    recvs: dict[int, list[torch.Tensor]] = defaultdict(list)

    def collect(s: dict[int, list[torch.Tensor]], r: dict[int, list[torch.Tensor]]) -> None:
        # Plan parts list peers by device; the group speaks ranks.
        for device, views in s.items():
            sends[rank_of[int(device)]] += views
        for device, views in r.items():
            recvs[rank_of[int(device)]] += views

    targets = [run_part(part, stores, collect) for part in parts]
    moved = 0
    if sends or recvs:
        # Buckets sized to the largest peer's bytes (capped at the data plane's default):
        # a tiny model must not allocate 64 MiB double buffers per sync.
        largest = max(sum((v.numel() * v.element_size() + 15) // 16 * 16 for v in vs) for vs in [*sends.values(), *recvs.values()])
        bucket = min(64 * 2**20, max(4096, largest))
        stats = exchange(get_communicator(group_id), dict(sends), dict(recvs), bucket_bytes=bucket)
        moved = int(getattr(stats, "bytes_sent", 0)) + int(getattr(stats, "bytes_received", 0))
    written = 0
    engine = _ENGINES.get(target_stage)
    for part, tensors in zip(parts, targets, strict=True):
        if tensors and part["tensors"]:
            require(engine is not None, "sync.target_stage", target_stage, "must be hosted on every target device")
            written += engine.load_named(tensors)
    return {"bytes_written": written, "bytes_moved": moved, "seconds": time.perf_counter() - t0}
