"""The actor that hosts one model-stage's engine on one device (worker side).

``StageActor`` is an ``nereus.engines.EngineActor`` (same endpoints: ``generate``,
``logprobs``, ``values``, ``train_step``, ``state``, ``load_state``, ``free_cache``,
``memory``, ``close``; same engines, CPU or GPU by the worker's device) spawned once per
device of each EMU of a model-stage (a mesh per EMU, placed by the job's plan), with the
job's group ids, and one more endpoint: ``sync``.

Engines of every model-stage placed on a device live in the same worker process and
share its memory ledger (``nereus.engines.memory.device_ledger``): co-resident
model-stages are accounted together against the device budget. They are also listed in
a per-process registry, so a weight sync can read the training engine's weights and
write the generation engine's on the same device without a copy through the driver.
``close`` releases the engine's reservations and leaves the registry.

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

import logging
import time
from collections import defaultdict
from typing import Any

import torch

from nereus.actors import endpoint
from nereus.config import require
from nereus.engines.actors import EngineActor, run_engine_work

__all__ = ["StageActor"]

log = logging.getLogger("nereus.rl")

# model-stage name -> engine, for every engine in this worker process.
_ENGINES: dict[str, Any] = {}


class StageActor(EngineActor):
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
        require(kind in ("generation", "inference", "training"), "StageActor.kind", kind, "must be generation, inference or training")
        g = dict(groups or {})
        tp_size, pp_size = g.get("tp_size", 1), g.get("pp_size", 1)
        super().__init__(
            kind, model_config, model_dir, options,
            engine_name=stage,
            tp_groups=g.get("tp") or [""] * pp_size,
            pp_groups=g.get("pp") or [""] * tp_size,
            dp_rank=g.get("dp_rank", 0),
            dp_size=g.get("dp_size", 1),
            dp_groups=g.get("dp") or None,
        )
        self.stage = stage
        _ENGINES[stage] = self.engine

    @endpoint
    async def sync(self, parts: list[dict[str, Any]], group_id: str, rank_of: dict[int, int], sources: dict[str, str], target_stage: str) -> dict[str, Any]:
        """Run this device's parts of a weight-sync plan (see the module docstring).

        ``sources`` maps each source EMU name of the plan to the model-stage whose engine
        holds it in this process; ``rank_of`` maps devices to ranks of the sync group."""
        return await run_engine_work(_run_sync, parts, group_id, rank_of, sources, target_stage)

    @endpoint
    async def close(self) -> None:
        if _ENGINES.get(self.stage) is self.engine:
            del _ENGINES[self.stage]
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
