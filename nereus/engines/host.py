"""The engine host: one actor per worker that owns the device's EMU state and runs the
engines built over it (worker side).

``EngineHost`` *is* the worker's shard store (``nereus.state.ShardHolder``: every EMU's
parameter and optimizer tensors, its logical state, the reshard and sync endpoints, the
device's memory ledger) and, beside it, the engines of the EMUs on this device, keyed by
EMU name (so two EMUs of one model-stage may share a device during a transition):

- ``advance_rollout`` decodes an open request a few steps at a time
  (``nereus.engines.stepped``), so a weight sync lands between decode steps and new rows
  can take the slots of finished ones (refills); on vLLM, which runs a request whole,
  one call decodes every row to its end.

Device: shards and engines live on the worker's device (``tensor_device``: ``cuda:0``
on a GPU worker, else the CPU); the engines' ``EmuContext.device`` is that device, so
their TP/PP/DP groups (NCCL between GPUs, gloo between CPU workers) get tensors of
their backend's kind.

Refuses (``ConfigError``/``StateError``): an unknown kind or generation engine, a vLLM
engine without ``model_dir``, an EMU this device is not part of or whose shards it does
not hold, calls for an engine that was not built.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from nereus.actors import device_threads, endpoint, in_thread
from nereus.config import require
from nereus.engines.options import EngineOptions
from nereus.engines.stepped import SteppedRollout
from nereus.errors import StateError
from nereus.models.config import ModelConfig
from nereus.state.emu import EMU, LogicalState, emu_from_plain, split_key, tensor_key
from nereus.state.holder import ShardHolder
from nereus.state.memory import DEFAULT_BUCKET_BYTES

__all__ = ["EngineHost", "GENERATION_ENGINES", "KINDS", "run_engine_work"]

log = logging.getLogger("nereus.engines")

KINDS = ("generation", "inference", "training")
# what runs a generation EMU: the built-in sampler, or vLLM (nereus.engines.vllm_adapter)
GENERATION_ENGINES = ("builtin", "vllm")


def _one_thread(fn: Any, *args: Any) -> Any:
    # OpenMP's thread count is per calling thread: executor threads start at the default.
    # One thread, or ceil(cores) on a device with a CPU limit (nereus.actors.device_threads).
    threads = device_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(*args)


async def run_engine_work(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a thread (the worker's event loop keeps answering), the device's torch
    threads."""
    return await in_thread(_one_thread, fn, *args)


class EngineHost(ShardHolder):
    """This worker's shard store and the engines over it (see the module docstring)."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, direct: bool = True) -> None:
        super().__init__(bucket_bytes=bucket_bytes, direct=direct)
        self.engines: dict[str, Any] = {}
        self.kinds: dict[str, str] = {}
        self.rollouts: dict[str, Any] = {}  # EMU -> its open SteppedRollout (asynchronous RL)
        # imported now, so the first engine a change builds here costs what a rebuild costs
        import nereus.engines.generation  # noqa: F401
        import nereus.engines.inference  # noqa: F401
        import nereus.engines.training  # noqa: F401

    @endpoint
    async def warm_up(self) -> float:
        """Pay, now, what the first training engine built in this process would pay beyond
        a rebuild: torch's optimizers import ``torch._dynamo`` on first construction
        (seconds of CPU). Returns the seconds it took (0 when already done)."""
        import sys

        if "torch._dynamo" in sys.modules:
            return 0.0
        t0 = time.perf_counter()
        await run_engine_work(importlib.import_module, "torch._dynamo")
        return time.perf_counter() - t0

    # --- filling the store ------------------------------------------------------------

    @endpoint
    async def load_weights(
        self, emu: dict, model_config: dict, model_dir: str | None = None, seed: int = 0
    ) -> int:
        """Fill the store with this device's shards of ``emu`` (see the module docstring);
        returns the bytes now held on this device."""
        desc = emu_from_plain(emu)
        device = self.device.index
        pp_rank, tp_rank = desc.position(device)
        require(
            desc.name not in self.shards,
            "load_weights.emu",
            desc.name,
            "is already held on this device",
        )
        self._reserve_new(desc.name, desc.bytes_on(device))
        try:
            tensors = await run_engine_work(
                _load_shards,
                desc,
                ModelConfig(**model_config),
                model_dir,
                seed,
                pp_rank,
                tp_rank,
                device,
                self.tensor_device,
            )
        except BaseException:
            self._account()
            raise
        self.shards[desc.name] = tensors
        self.states[desc.name] = desc.state
        self._account()
        return self.held_bytes()

    # --- engines ----------------------------------------------------------------------

    @endpoint
    async def build_engine(
        self,
        emu: dict,
        kind: str,
        model_config: dict,
        options: dict | None = None,
        groups: dict | None = None,
        cache: list[int] | None = None,
    ) -> dict[str, int]:
        """Build ``emu``'s engine of ``kind`` on this device over the store's tensors.

        ``groups``: ``tp`` (one group id per pipeline stage), ``pp`` (one per TP rank),
        ``dp`` (one per position in the EMU; training only), ``dp_rank``, ``dp_size``,
        ``timeout_s``. ``cache``: ``[rows, slots]`` of a KV cache to reserve at once (a
        rebuilt generation engine takes back the cache it had). Returns the engine's
        reservations."""
        require(kind in KINDS, "build_engine.kind", kind, f"must be one of {KINDS}")
        engine_name = (options or {}).get("engine", "builtin")
        require(
            engine_name in GENERATION_ENGINES
            and (kind == "generation" or engine_name == "builtin"),
            "build_engine.options.engine",
            engine_name,
            f"must be one of {GENERATION_ENGINES} for a generation EMU ('builtin' for other kinds)",
        )
        require(
            engine_name != "vllm" or bool((options or {}).get("model_dir")),
            "build_engine.options.model_dir",
            (options or {}).get("model_dir"),
            "must name the model's folder (its config.json) for a vLLM engine",
        )
        desc = emu_from_plain(emu)
        if desc.name in self.engines:
            raise StateError(
                f"device {self.device.index} already runs an engine of EMU {desc.name!r}"
            )
        held = self._held_of(desc.name)
        engine = await run_engine_work(
            self._make_engine,
            desc,
            kind,
            ModelConfig(**model_config),
            dict(options or {}),
            dict(groups or {}),
            held,
        )
        self.engines[desc.name], self.kinds[desc.name] = engine, kind
        if cache and kind == "generation" and engine_name == "builtin":
            await run_engine_work(engine.reserve_cache, int(cache[0]), int(cache[1]))
        return engine.memory()

    def _make_engine(
        self,
        emu: EMU,
        kind: str,
        config: ModelConfig,
        options: dict,
        groups: dict,
        held: dict[str, torch.Tensor],
    ) -> Any:
        from nereus.engines.context import EmuContext
        from nereus.models.parallel import ParallelContext
        from nereus.transfer import get_communicator

        pp_rank, tp_rank = emu.position(self.device.index)
        tp, pp = emu.layout.tp, emu.layout.pp
        tp_ids, pp_ids, dp_ids = (
            groups.get("tp") or [],
            groups.get("pp") or [],
            groups.get("dp") or [],
        )
        dp_rank, dp_size = int(groups.get("dp_rank", 0)), int(groups.get("dp_size", 1))
        timeout_s = float(groups.get("timeout_s", 120.0))
        tp_comm = get_communicator(tp_ids[pp_rank]) if tp > 1 else None
        pp_comm = get_communicator(pp_ids[tp_rank]) if pp > 1 else None
        dp_comm = get_communicator(dp_ids[pp_rank * tp + tp_rank]) if dp_size > 1 else None
        pc = ParallelContext(
            tp_rank=tp_rank,
            tp_size=tp,
            pp_rank=pp_rank,
            pp_size=pp,
            tp_comm=tp_comm,
            layer_cuts=emu.layout.cuts or None,
        )
        ctx = EmuContext(
            pc,
            pp_comm=pp_comm,
            dp_rank=dp_rank,
            dp_size=dp_size,
            dp_comm=dp_comm,
            timeout_s=timeout_s,
            device=str(self.tensor_device),
        )
        dtype = emu.spec.params[0].dtype if emu.spec.params else "float32"
        params = {k: t for k, t in held.items() if split_key(k)[0] == "param"}
        value_head = any(p.name.startswith("value_head.") for p in emu.spec.params)
        if kind == "training":
            from nereus.engines.training import TrainingEngine

            return TrainingEngine(
                config,
                ctx,
                options=EngineOptions(tensors=held, dtype=dtype, name=emu.name),
                step=self.states[emu.name].update_count,
                critic=value_head,
                **options,
            )
        if kind == "inference":
            from nereus.engines.inference import InferenceEngine

            return InferenceEngine(
                config,
                ctx,
                options=EngineOptions(tensors=params, dtype=dtype, name=emu.name),
                value_head=value_head,
                **options,
            )
        if options.pop("engine", "builtin") == "vllm":
            from nereus.engines.vllm_adapter import VllmGenerationEngine

            model_dir = options.pop("model_dir")
            shared = EngineOptions(dtype=dtype, seed=options.pop("seed", 0), name=emu.name)
            options.setdefault(
                "load_format", "dummy"
            )  # every weight comes from the EMU's shards next
            # a job never puts this engine to sleep: its memory stays in torch's own allocator
            options.setdefault("enable_sleep_mode", False)
            engine = VllmGenerationEngine(config, model_dir, ctx, options=shared, **options)
            try:
                engine.load_named(params)
            except BaseException:
                engine.close()
                raise
            return engine
        from nereus.engines.generation import GenerationEngine

        return GenerationEngine(
            config,
            ctx,
            options=EngineOptions(tensors=params, dtype=dtype, name=emu.name),
            **options,
        )

    def _engine(self, emu: str, kind: str | None = None) -> Any:
        engine = self.engines.get(emu)
        if engine is None:
            raise StateError(
                f"device {self.device.index} runs no engine of EMU {emu!r} "
                f"(engines: {sorted(self.engines)})"
            )
        if kind is not None and self.kinds[emu] != kind:
            raise StateError(f"EMU {emu!r} runs a {self.kinds[emu]} engine, not a {kind} one")
        return engine

    def _close(self, names: Sequence[str]) -> int:
        closed = 0
        for name in names:
            self.rollouts.pop(name, None)
            engine = self.engines.pop(name, None)
            self.kinds.pop(name, None)
            if engine is not None:
                engine.close()
                closed += 1
        return closed

    @endpoint
    async def drop_engines(self, names: list[str] | None = None) -> int:
        """Close the engines of ``names`` (default: every engine); the store keeps their
        tensors. Returns how many were closed."""
        return self._close(list(self.engines) if names is None else names)

    def _free(self, emus: Sequence[str]) -> None:
        self._close([e for e in emus if e in self.engines])
        super()._free(emus)

    @endpoint
    async def run_into(
        self,
        parts: list[dict],
        group: str | None = None,
        group_devices: Sequence[int] = (),
        bucket_bytes: int | None = None,
    ) -> dict:
        """``ShardHolder.run_into`` (the EMUs' shards written in place), then every engine
        that holds its own copy of the weights (vLLM) loads its EMU's new shards in place;
        ``reloaded_bytes`` and ``reload_s`` say what that took."""
        stats = await super().run_into(parts, group, group_devices, bucket_bytes)
        t0 = time.perf_counter()
        reloaded = 0
        for target in dict.fromkeys(p["target"] for p in parts if p["tensors"]):
            engine = self.engines.get(target)
            if engine is None or getattr(engine, "adopts_store", True):
                continue
            params = {k: t for k, t in self.shards[target].items() if split_key(k)[0] == "param"}
            reloaded += await run_engine_work(engine.load_named, params)
        stats["reloaded_bytes"], stats["reload_s"] = reloaded, time.perf_counter() - t0
        return stats

    @endpoint
    async def generate(
        self, emu: str, prompts: list[list[int]], params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out = await run_engine_work(self._engine(emu, "generation").generate, prompts, params)
        return out.to_dict()

    @endpoint
    async def advance_rollout(
        self,
        emu: str,
        steps: int,
        prompts: list[list[int]] | None = None,
        params: dict[str, Any] | None = None,
        greedy_rows: list[int] | None = None,
        refill: list[dict[str, Any]] | None = None,
        prompt_width: int | None = None,
    ) -> dict[str, Any]:
        """Decode up to ``steps`` tokens of ``emu``'s open request (``prompts`` given: open
        a new one first, ``nereus.engines.stepped``, ``greedy_rows`` decoded greedily, room
        for refills of prompts up to ``prompt_width``; it replaces a request the caller
        abandoned); a weight sync between two calls is read by the next decode step, the
        KV cache kept. ``refill`` (``Refill`` fields as maps: ``slot``, ``prompt``,
        ``max_tokens``, ``greedy``) first puts new rows into done slots. The request closes
        when every row is done."""
        engine = self._engine(emu, "generation")
        if not getattr(engine, "stepped", True):
            return await self._whole_request(engine, prompts, params, greedy_rows, refill)
        if prompts is not None:
            self.rollouts[emu] = SteppedRollout(
                engine, prompts, params, greedy_rows=greedy_rows or (), prompt_width=prompt_width
            )
        require(
            emu in self.rollouts,
            "advance_rollout.emu",
            emu,
            "must have an open request (give prompts)",
        )
        out = await run_engine_work(self.rollouts[emu].advance, steps, refill or ())
        if out["finished"]:
            del self.rollouts[emu]
        return out

    async def _whole_request(
        self,
        engine: Any,
        prompts: list[list[int]] | None,
        params: dict[str, Any] | None,
        greedy_rows: list[int] | None,
        refill: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        """``advance_rollout`` on an engine that runs a request whole (vLLM): one call
        opens the request and decodes every row to its end."""
        require(
            prompts is not None and not refill,
            "advance_rollout",
            "no prompts" if prompts is None else "a refill",
            "must open a request with prompts and no refill on an engine that runs a "
            "request whole (vLLM: async mode without partial rollouts or refill)",
        )
        out = await run_engine_work(engine.generate, prompts, params, greedy_rows or ())
        rows = len(out.token_ids)
        return {
            "tokens": out.token_ids,
            "logprobs": out.logprobs,
            "done": [True] * rows,
            "finished": True,
        }

    @endpoint
    async def logprobs(
        self, emu: str, batch: dict[str, torch.Tensor], temperature: float = 1.0
    ) -> torch.Tensor:
        """Per-token log-probabilities of ``batch`` under ``emu``'s weights (any kind of
        engine evaluates forward-only: the inference engine's work, and a probe)."""
        return await run_engine_work(self._engine(emu).logprobs, batch, temperature)

    @endpoint
    async def values(self, emu: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await run_engine_work(self._engine(emu).values, batch)

    @endpoint
    async def rewards(self, emu: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return await run_engine_work(self._engine(emu).rewards, batch)

    @endpoint
    async def train_step(
        self,
        emu: str,
        batch: dict[str, torch.Tensor],
        loss: str = "nereus.engines.losses:nll_loss",
        loss_kwargs: dict[str, Any] | None = None,
        micro_batch_size: int | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        engine = self._engine(emu, "training")
        metrics = await run_engine_work(
            engine.train_step, batch, loss, loss_kwargs, micro_batch_size, temperature
        )
        state = self.states.get(emu, LogicalState())
        self.states[emu] = LogicalState(engine.step, state.policy_version, state.sample_position)
        return metrics

    @endpoint
    async def free_cache(self, emu: str) -> int:
        """Give back the KV cache of ``emu``'s generation engine; returns the bytes freed."""
        return self._engine(emu, "generation").free_cache()

    @endpoint
    async def cache_shape(self, emu: str) -> list[int]:
        """``[rows, slots]`` of the KV cache ``emu``'s generation engine holds now."""
        return list(self._engine(emu, "generation").cache_shape)

    @endpoint(concurrent=True)
    async def memory(self, reset_peak: bool = False) -> dict[str, Any]:
        """The device's ledger (budget, used, peak, breakdown) and the engines alive; with
        ``reset_peak`` a new high-water mark starts after the report."""
        report = self.ledger.report()
        report["engines"] = dict(self.kinds)
        report["tensor_device"] = str(self.tensor_device)
        if reset_peak:
            self.ledger.reset_peak()
        return report


class _NoCollectives:
    """The TP position of a stage that is only built and loaded, never run: any
    collective on it is a bug."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __getattr__(self, name: str) -> Any:
        raise StateError(f"a stage built to load weights cannot run collectives ({name})")


def _load_shards(
    emu: EMU,
    config: ModelConfig,
    model_dir: str | None,
    seed: int,
    pp_rank: int,
    tp_rank: int,
    device: int,
    place: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """This device's tensors of ``emu`` on ``place`` (the worker's torch device): a stage
    built at its place on the CPU (random from ``seed``, then read from ``model_dir``),
    its parameters taken as they are, plus the EMU's optimizer slots."""
    from nereus.models.decoder import build_stage
    from nereus.models.parallel import ParallelContext

    dtype = emu.spec.params[0].dtype if emu.spec.params else "float32"
    value_head = any(p.name.startswith("value_head.") for p in emu.spec.params)
    tp = emu.layout.tp
    pc = ParallelContext(
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=pp_rank,
        pp_size=emu.layout.pp,
        tp_comm=_NoCollectives(tp_rank, tp) if tp > 1 else None,  # type: ignore[arg-type]
        layer_cuts=emu.layout.cuts or None,
    )
    torch.manual_seed(seed)
    stage = build_stage(config, pc, dtype, value_head=value_head)
    if model_dir is not None:
        from nereus.models.checkpoint import load_stage_weights

        # a critic starts from the policy's folder (no score head: the head starts at zero);
        # a reward model's folder has a score head and may lack the LM head
        optional = ("lm_head.weight", "value_head.weight", "value_head.bias") if value_head else ()
        load_stage_weights(stage, model_dir, pc, optional=optional)
    params = {k: p.detach() for k, p in stage.named_parameters()}
    want = emu.shards_on(device)
    out: dict[str, torch.Tensor] = {}
    for key, (shard, _) in want.items():
        slot, name = split_key(key)
        if name not in params:
            raise StateError(
                f"EMU {emu.name}: the model builds no parameter {name!r} at pp {pp_rank} tp "
                f"{tp_rank}"
            )
        p = params[name]
        if tuple(p.shape) != shard.shape:
            raise StateError(
                f"EMU {emu.name}: {name!r} is {tuple(p.shape)} here, its shard is {shard.shape}"
            )
        if slot == "param":
            out[key] = p.to(place)
        elif slot == "master":
            out[key] = p.float().to(place, copy=True)
        else:
            out[key] = torch.zeros(shard.shape, dtype=torch.float32, device=place)
    extra = sorted(set(params) - {split_key(k)[1] for k in want})
    if extra:
        raise StateError(
            f"EMU {emu.name}: the stage holds {extra[:5]} that its ModelSpec does not list"
        )
    assert all(tensor_key("param", n) in out for n in params)
    return out
