"""The Llama/Qwen2/Qwen3-style decoder, built one pipeline stage at a time.

``build_stage(config, pc, dtype, device)`` builds the part of the model that pipeline
rank ``pc.pp_rank`` holds, sharded for TP rank ``pc.tp_rank``: the embedding on the first
stage, its layers, and the final norm + LM head on the last. With tied embeddings and
``pp > 1`` the last stage holds its own copy of the embedding (as
``model.embed_tokens.weight``, used only as the LM head's weight); the two copies start
equal (loaded from the same tensor) and the *engines* keep them equal by all-reducing
their gradients between the first and last stage before each optimizer step.

RoPE and the attention kernels the layers call are ``nereus.models.attention``.

Refuses (``ConfigError``): TP sizes that do not divide heads, intermediate size or vocab;
more pipeline stages than layers; positions beyond the cache.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from nereus.config import require
from nereus.models._decode import (
    StepTables,
    decode_layer,
    decode_step_plan,
    layer_parts,
    rms_norm_rows,
)
from nereus.models.attention import (
    AttentionPlan,
    RotaryEmbedding,
    apply_rope,
    attention_plan,
    decode_attention,
    sdpa,
    write_cache,
)
from nereus.models.config import ModelConfig
from nereus.models.layers import (
    ColumnParallelLinear,
    HeadRMSNorm,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    ValueHead,
    VocabParallelEmbedding,
)
from nereus.models.parallel import ParallelContext, gather_from_tp
from nereus.state.spec import Component

__all__ = ["KVCache", "DecoderStage", "build_stage", "check_layout", "torch_dtype"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` from ``"float32"`` (or a torch dtype, unchanged)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    require(dtype in _TORCH_DTYPES, "dtype", dtype, f"must be one of {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[dtype]


def check_layout(config: ModelConfig, tp_size: int, pp_size: int) -> None:
    """Raise ``ConfigError`` unless the model can be cut into ``tp_size`` x ``pp_size``."""
    c = config
    require(
        c.num_attention_heads % tp_size == 0,
        "tp_size",
        tp_size,
        f"must divide num_attention_heads={c.num_attention_heads}",
    )
    kv = c.num_key_value_heads
    require(
        kv % tp_size == 0 or tp_size % kv == 0,
        "tp_size",
        tp_size,
        f"must divide num_key_value_heads={kv} or be a multiple of it",
    )
    require(
        c.intermediate_size % tp_size == 0,
        "tp_size",
        tp_size,
        f"must divide intermediate_size={c.intermediate_size}",
    )
    require(
        c.vocab_size % tp_size == 0, "tp_size", tp_size, f"must divide vocab_size={c.vocab_size}"
    )
    require(
        pp_size <= c.num_hidden_layers,
        "pp_size",
        pp_size,
        f"must be <= num_hidden_layers={c.num_hidden_layers}",
    )


@dataclass
class KVCache:
    """Per-layer preallocated keys and values, keyed by global layer index.

    ``pairs`` (optional) holds per layer one buffer ``[2, batch, kv_heads, max_len,
    head_dim]`` whose halves *are* ``keys[i]`` and ``values[i]`` (views of it): the decode
    path writes a step's k and v with one copy. ``new_kv_cache`` always makes them; a
    cache without them takes the general path."""

    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    max_len: int
    pairs: dict[int, torch.Tensor] | None = None

    @classmethod
    def of_pairs(cls, pairs: dict[int, torch.Tensor], max_len: int) -> KVCache:
        """The cache whose keys and values are the two halves of each pair buffer."""
        return cls(
            {i: p[0] for i, p in pairs.items()}, {i: p[1] for i, p in pairs.items()}, max_len, pairs
        )

    def rows(self, rows: slice) -> KVCache:
        """A view of some rows (a slice of the batch) of this cache."""
        if self.pairs is None:
            return KVCache(
                {i: k[rows] for i, k in self.keys.items()},
                {i: v[rows] for i, v in self.values.items()},
                self.max_len,
            )
        return KVCache.of_pairs({i: p[:, rows] for i, p in self.pairs.items()}, self.max_len)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values())
        )


# One components tuple per config, shared by every layer (and so by every layer's
# ParamSpec: a spec's layers compare equal without comparing their components field
# by field).
@lru_cache(maxsize=64)
def _qkv_components(c: ModelConfig) -> tuple[Component, ...]:
    return (
        Component("q", c.q_size, c.num_attention_heads),
        Component("k", c.kv_size, c.num_key_value_heads),
        Component("v", c.kv_size, c.num_key_value_heads),
    )


@lru_cache(maxsize=64)
def _gate_up_components(c: ModelConfig) -> tuple[Component, ...]:
    i = c.intermediate_size
    return (Component("gate", i, i), Component("up", i, i))


class Attention(nn.Module):
    """GQA self-attention with fused, column-parallel q/k/v and a row-parallel output."""

    def __init__(
        self, c: ModelConfig, pc: ParallelContext, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        super().__init__()
        self.head_dim = c.head_dim
        self.heads_local = c.num_attention_heads // pc.tp_size
        self.kv_heads_local = max(1, c.num_key_value_heads // pc.tp_size)
        comps = _qkv_components(c)
        self.qkv_proj = ColumnParallelLinear(
            c.hidden_size, comps, pc, bias=c.has_qkv_bias, dtype=dtype, device=device
        )
        self.o_proj = RowParallelLinear(
            c.q_size, c.hidden_size, pc, bias=c.has_o_bias, dtype=dtype, device=device
        )
        self.q_norm = self.k_norm = None
        if c.has_qk_norm:
            self.q_norm = HeadRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
            self.k_norm = HeadRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        h, kv, d = self.heads_local, self.kv_heads_local, self.head_dim
        qkv = self.qkv_proj.forward(x)
        qk = qkv.narrow(-1, 0, (h + kv) * d).view(b, t, h + kv, d)
        if self.q_norm is not None:
            qk = torch.cat(
                (self.q_norm.forward(qk.narrow(2, 0, h)), self.k_norm.forward(qk.narrow(2, h, kv))),
                dim=2,
            )
        # q and k sit side by side in the fused output: rotate both with one set of ops.
        qk = apply_rope(qk, *rope)
        q, k = qk.narrow(2, 0, h), qk.narrow(2, h, kv)
        v = qkv.narrow(-1, (h + kv) * d, kv * d).view(b, t, kv, d)
        if cache is not None:
            k_cache, v_cache = cache
            write_cache(k_cache, k, plan)
            write_cache(v_cache, v, plan)
            k, v = k_cache.narrow(2, 0, plan.kv_len), v_cache.narrow(2, 0, plan.kv_len)
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if t == 1 and plan.mask is None and q.dtype == torch.float32:
            # A decode step of rows at one length (lower precisions keep SDPA's kernel).
            return self.o_proj.forward(decode_attention(q, k, v))
        out = sdpa(q.transpose(1, 2), k, v, plan)
        return self.o_proj.forward(out.transpose(1, 2).reshape(b, t, h * d))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with fused, column-parallel gate/up."""

    def __init__(
        self, c: ModelConfig, pc: ParallelContext, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        super().__init__()
        i = c.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            c.hidden_size, _gate_up_components(c), pc, dtype=dtype, device=device
        )
        self.down_proj = RowParallelLinear(i, c.hidden_size, pc, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        # gate and up have the same local size; chunk's backward concatenates the two
        # gradients, where two narrows would each zero-fill a full-size gradient first.
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, c: ModelConfig, pc: ParallelContext, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Attention(c, pc, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = MLP(c, pc, dtype, device)
        # Plain references (a tuple is not registered again): the hot path skips
        # nn.Module.__getattr__ for its submodules.
        self._parts = (
            self.input_layernorm,
            self.self_attn,
            self.post_attention_layernorm,
            self.mlp,
        )

    def forward(self, x, rope, plan, cache=None):
        norm1, attn, norm2, mlp = self._parts
        x = x + attn.forward(norm1.forward(x), rope, plan, cache)
        return x + mlp.forward(norm2.forward(x))


class _Body(nn.Module):
    """Holds ``embed_tokens``, ``layers`` and ``norm`` so names read ``model.*`` as in HF."""


class DecoderStage(nn.Module):
    """One pipeline stage of the decoder on one TP rank (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        pc: ParallelContext,
        dtype: torch.dtype,
        device: str | torch.device,
        value_head: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.pc = pc
        self.dtype = dtype
        self.layer_ids = list(pc.layer_range(config.num_hidden_layers))
        c = config
        self.model = _Body()
        needs_embed = pc.is_first_stage or (pc.is_last_stage and c.tie_word_embeddings)
        if needs_embed:
            self.model.embed_tokens = VocabParallelEmbedding(
                c.vocab_size, c.hidden_size, pc, dtype, device
            )
        self.model.layers = nn.ModuleDict(
            {str(i): DecoderLayer(c, pc, dtype, device) for i in self.layer_ids}
        )
        # A plain list (not registered twice) spares the hot loop the ModuleDict lookups.
        self._layers: list[DecoderLayer] = [self.model.layers[str(i)] for i in self.layer_ids]
        # training: recompute each layer's activations in backward (keep only its input)
        self.recompute_activations = False
        self.rotary = RotaryEmbedding(c, device)
        self._decode_setup: tuple | None = (
            None  # the decode path's constants and parts, made on first use
        )
        if pc.is_last_stage:
            self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
            tied = self.model.embed_tokens if c.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(
                c.hidden_size, c.vocab_size, pc, tied=tied, dtype=dtype, device=device
            )
        self.value_head: ValueHead | None = None
        if value_head and pc.is_last_stage:
            self.value_head = ValueHead(c.hidden_size, dtype, device)

    @property
    def heads_local(self) -> int:
        return self.config.num_attention_heads // self.pc.tp_size

    @property
    def kv_heads_local(self) -> int:
        return max(1, self.config.num_key_value_heads // self.pc.tp_size)

    def new_kv_cache(
        self,
        batch: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> KVCache:
        """Zeroed k/v of ``[batch, kv_heads_local, max_len, head_dim]`` per local layer (the
        two halves of one pair buffer, see ``KVCache``)."""
        require(batch >= 1, "batch", batch, "must be >= 1")
        require(
            1 <= max_len <= self.config.max_position_embeddings,
            "max_len",
            max_len,
            f"must be in [1, max_position_embeddings={self.config.max_position_embeddings}]",
        )
        dtype = dtype or self.dtype
        device = device or self.rotary.inv_freq.device
        shape = (2, batch, self.kv_heads_local, max_len, self.config.head_dim)
        pairs = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layer_ids}
        return KVCache.of_pairs(pairs, max_len)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache | None = None,
        logits_index: torch.Tensor | None = None,
        output: str = "logits",
        gather_logits: bool = False,
    ) -> torch.Tensor:
        """Run this stage.

        ``x``: token ids ``[B, T]`` on the first stage, hidden states ``[B, T, H]``
        elsewhere. ``positions``: ``[B, T]`` (negative = padding). On the last stage the
        result is vocab-parallel logits ``[B, T, V/tp]`` (full ``[B, T, V]`` with
        ``gather_logits``), or the final-normed hidden states with ``output="hidden"``
        (for a value head); ``logits_index`` (``[B]``) keeps one position per row, giving
        ``[B, V/tp]``. Other stages return hidden states ``[B, T, H]``."""
        require(output in ("logits", "hidden"), "output", output, "must be 'logits' or 'hidden'")
        if positions.shape != x.shape[:2]:  # checked before formatting: this runs every token
            require(
                False,
                "positions.shape",
                tuple(positions.shape),
                f"must equal the batch shape {tuple(x.shape[:2])}",
            )
        # The plan and the RoPE table need both bounds (one reduction, read on the host).
        low, high = (int(m) for m in torch.aminmax(positions)) if positions.numel() else (0, 0)
        kv_len = None
        if kv_cache is not None:
            if high >= kv_cache.max_len:
                require(
                    False, "positions", high, f"must be < the KV cache's max_len={kv_cache.max_len}"
                )
            kv_len = max(high + 1, 1)
        if (
            kv_cache is not None
            and kv_cache.pairs is not None
            and positions.shape[1] == 1
            and low >= 0
            and self.dtype == torch.float32
            and not torch.is_grad_enabled()
            and kv_cache.pairs[self.layer_ids[0]].dtype == torch.float32
        ):
            return self._decode(
                x, positions.view(-1), kv_cache, low, high, logits_index, output, gather_logits
            )
        h = self.model.embed_tokens(x) if self.pc.is_first_stage else x
        plan = attention_plan(positions, kv_len, low, high)
        rope = self.rotary(positions, h.dtype, max(high + 1, 1), low if plan.uniform else None)
        recompute = self.recompute_activations and kv_cache is None and torch.is_grad_enabled()
        for i, layer in zip(self.layer_ids, self._layers, strict=True):
            if recompute:
                # keep only the layer's input; its activations are recomputed in backward
                h = torch.utils.checkpoint.checkpoint(
                    layer.forward, h, rope, plan, None, use_reentrant=False
                )
                continue
            cache = None if kv_cache is None else (kv_cache.keys[i], kv_cache.values[i])
            h = layer.forward(h, rope, plan, cache)
        if not self.pc.is_last_stage:
            return h
        if logits_index is not None:
            # With one token per row the only valid index is 0: a view, no gather.
            h = (
                h[:, 0]
                if h.shape[1] == 1
                else h[torch.arange(h.shape[0], device=h.device), logits_index]
            )
        h = self.model.norm(h)
        if output == "hidden":
            return h
        logits = self.lm_head(h)
        return gather_from_tp(logits, self.pc) if gather_logits else logits

    def _decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        low: int,
        high: int,
        logits_index: torch.Tensor | None,
        output: str,
        gather_logits: bool,
    ) -> torch.Tensor:
        """``forward`` of one token per row at ``positions`` ``[B]`` (all ``>= 0``) with a
        cache, in float32 without autograd: the few-op path of ``nereus.models._decode``."""
        setup = self._decode_setup
        if setup is None:
            setup = self._decode_setup = self._make_decode_setup()
        tables, rotary, layers, embed, norm, lm_head = setup
        b = positions.shape[0]
        h = embed.forward(x.view(b)) if embed is not None else x.reshape(b, -1)
        rope_table = rotary._table(high + 1, h.dtype)
        pairs = kv_cache.pairs
        assert pairs is not None
        step = decode_step_plan(tables, rope_table, positions, pairs[layers[0][0]], low, high)
        for i, parts in layers:
            h = decode_layer(parts, h, step, pairs[i])
        if norm is None:
            return h.view(b, 1, -1)
        out = rms_norm_rows(h, norm["weight"], step.eps)
        if output == "logits":
            out = lm_head.forward(out)
            if gather_logits:
                out = gather_from_tp(out, self.pc)
        # With one token per row the only valid index is 0: the rows are the answer.
        return out if logits_index is not None else out.unsqueeze(1)

    def _make_decode_setup(self) -> tuple:
        """What ``_decode`` needs besides its inputs, gathered once: the step tables, the
        rotary module, ``(global index, layer_parts)`` per layer, the embedding (first
        stage, else None), the final norm's parameter dict and the LM head (last stage,
        else None). Modules and parameter dicts, never tensors derived from weights: a
        weight update (in place or by ``set_``) is seen by the next step."""
        c = self.config
        tables = StepTables(
            self.heads_local,
            self.kv_heads_local,
            c.head_dim,
            c.rms_norm_eps,
            c.max_position_embeddings,
            self.rotary.inv_freq.device,
        )
        layers = [
            (i, layer_parts(layer)) for i, layer in zip(self.layer_ids, self._layers, strict=True)
        ]
        embed = self.model.embed_tokens if self.pc.is_first_stage else None
        last = self.pc.is_last_stage
        return (
            tables,
            self.rotary,
            layers,
            embed,
            self.model.norm._parameters if last else None,
            self.lm_head if last else None,
        )

    def reduce_replicated_grads(self) -> None:
        """After backward at ``tp > 1``: sum the partial gradients of replicated k/v rows
        (at ``tp > num_key_value_heads``, see ``ColumnParallelLinear.reduce_replicated_grads``)
        and of the per-head norms (Qwen3's ``q_norm``/``k_norm``: each rank normed only its
        own heads), the latter in one all-reduce. Every TP rank must call it (it is a
        collective); at TP 1 it does nothing."""
        if self.pc.tp_size == 1:
            return
        partial = []
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear):
                module.reduce_replicated_grads()
            elif isinstance(module, HeadRMSNorm) and module.weight.grad is not None:
                partial.append(module.weight.grad)
        if partial:
            flat = torch.cat([g.reshape(-1) for g in partial])
            self.pc.tp_comm.all_reduce(flat, "sum")
            for g, summed in zip(partial, flat.split([g.numel() for g in partial]), strict=True):
                g.copy_(summed.view_as(g))


def build_stage(
    config: ModelConfig,
    parallel_ctx: ParallelContext | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    *,
    value_head: bool = False,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> DecoderStage:
    """Build the stage ``parallel_ctx`` holds (the whole model by default); with
    ``value_head`` the last stage also holds a ``ValueHead`` (a critic, a reward model).

    Weights start random (normal, std 0.02; norms 1, biases 0), except on the meta device
    where nothing is allocated; load real ones with ``load_stage_weights``. With
    ``tensors`` (parameter name -> this rank's shard) the stage is built over them:
    every parameter *is* the given tensor (adopted, not copied; nothing random is made),
    and each must be given with its shard's shape and ``dtype`` (``StateError``
    otherwise, naming the parameter)."""
    pc = parallel_ctx or ParallelContext()
    check_layout(config, pc.tp_size, pc.pp_size)
    if tensors is None:
        return DecoderStage(config, pc, torch_dtype(dtype), device, value_head)
    stage = DecoderStage(config, pc, torch_dtype(dtype), "meta", value_head)
    _adopt(stage, tensors)
    stage.rotary = RotaryEmbedding(config, device)
    return stage


def _adopt(stage: DecoderStage, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make every parameter of a meta-built ``stage`` the tensor ``tensors`` gives it."""
    from nereus.errors import StateError

    names = {
        f"{m}.{p}" if m else p
        for m, mod in stage.named_modules()
        for p, _ in mod.named_parameters(recurse=False)
    }
    missing = sorted(names - set(tensors))
    if missing:
        raise StateError(
            f"building a stage over given tensors: no tensor for {missing[:5]} "
            f"({len(missing)} missing)"
        )
    for module_name, module in stage.named_modules():
        for local, meta in list(module.named_parameters(recurse=False)):
            name = f"{module_name}.{local}" if module_name else local
            t = tensors[name]
            if tuple(t.shape) != tuple(meta.shape) or t.dtype != meta.dtype:
                raise StateError(
                    f"tensor {name!r} is {tuple(t.shape)} {t.dtype}; this rank's shard is "
                    f"{tuple(meta.shape)} {meta.dtype}"
                )
            module._parameters[local] = nn.Parameter(t, requires_grad=meta.requires_grad)
