"""Rotary position embeddings and the attention kernels of the decoder's layers.

``RotaryEmbedding`` gives cos and a pre-negated sin from a table grown on demand;
``apply_rope`` rotates queries and keys with them. ``attention_plan`` decides once per
forward what every layer's attention shares (a mask, SDPA's causal kernel, or none; and
where new keys and values go in a KV cache); ``sdpa`` and ``decode_attention`` compute
attention (the latter for one query per row that sees every key) and ``write_cache``
writes a step's keys or values.

Promises: the same values as Hugging Face's RoPE (float32 products, its "linear" and
"llama3" scaling) and attention; no row is ever fully masked (padding queries see
themselves or slot 0, so SDPA never gives NaN). Refuses nothing: shapes are the
decoder's (``nereus.models.decoder``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nereus.models.config import ModelConfig

__all__ = [
    "AttentionPlan",
    "RotaryEmbedding",
    "apply_rope",
    "attention_plan",
    "decode_attention",
    "rope_inv_freq",
    "sdpa",
    "write_cache",
]

# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5.
_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def rope_inv_freq(config: ModelConfig, device: str | torch.device = "cpu") -> torch.Tensor:
    """RoPE's inverse frequencies ``[head_dim / 2]`` (float32), scaled as ``config.rope_type``
    says, by the same formulas as transformers' ``ROPE_INIT_FUNCTIONS``."""
    d = config.head_dim
    inv = 1.0 / (
        config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    )
    if config.rope_type == "linear":
        return inv / config.rope_factor
    if config.rope_type == "llama3":
        factor, low, high = (
            config.rope_factor,
            config.rope_low_freq_factor,
            config.rope_high_freq_factor,
        )
        old = config.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        # Long wavelengths (beyond the pretraining context / low) are stretched by factor,
        # short ones (below context / high) kept, and the band between interpolated.
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """cos/sin of positions (Hugging Face's RoPE, computed in float32, with its "linear" and
    "llama3" scaling folded into the inverse frequencies).

    The values come from a table ``[n, 2, head_dim]`` (cos; sin with its first half
    negated, see ``apply_rope``) built once per dtype and device and grown on demand, so
    a forward costs one lookup instead of recomputing the trigonometry."""

    def __init__(self, config: ModelConfig, device: str | torch.device) -> None:
        super().__init__()
        if torch.device(device).type == "meta":
            # meta tensors run torch's Python reference kernels, whose first use imports
            # seconds of modules; the values do not matter there, only the shape
            inv = rope_inv_freq(config, "cpu").to(device)
        else:
            inv = rope_inv_freq(config, device)
        self.register_buffer("inv_freq", inv, persistent=False)
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _table(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, self.inv_freq.device)
        table = self._tables.get(key)
        if table is None or table.shape[0] < length:
            with torch.inference_mode(False):  # a cached table serves inference and training alike
                table = self._build(key, length, table, dtype)
        return table

    def _build(
        self, key: tuple, length: int, table: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        # Grow geometrically so a decode loop rebuilds it O(log n) times.
        n = max(length, 64, 2 * (table.shape[0] if table is not None else 0))
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos.unsqueeze(-1) * self.inv_freq  # the same float32 products as per-position math
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        table = torch.stack((emb.cos(), sin), dim=1).to(dtype)
        self._tables[key] = table
        return table

    def forward(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        length: int | None = None,
        start: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[B or 1, T, 1, head_dim]`` for ``positions`` ``[B, T]``
        (padding reads position 0); ``length`` bounds the positions (computed when None).
        ``start``: every row is at positions ``start .. start + T - 1``, so one slice of
        the table serves all rows (views, no gather)."""
        if length is None:
            length = int(positions.max().item()) + 1 if positions.numel() else 1
        table = self._table(length, dtype)
        if start is not None:
            rows = table.narrow(0, start, positions.shape[1]).unsqueeze(0)  # [1, T, 2, D]
        else:
            rows = table[positions.clamp(min=0)]  # [B, T, 2, D]
        return rows.narrow(2, 0, 1), rows.narrow(2, 1, 1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[B, T, heads, D]``.

    ``rotate_half(x) = cat(-x2, x1)``: swapping the halves (one ``flip`` of a
    ``[..., 2, D/2]`` view) and taking the minus sign from the pre-negated sin table
    gives the same products with 3 ops instead of 7."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)


@dataclass
class AttentionPlan:
    """What every layer's attention of one forward shares: the boolean mask
    ``[B, 1, T, S]`` (or None: with ``causal`` when the batch is dense, since SDPA's
    causal kernels are about twice as fast on CPU, or without when every slot is
    visible) and, with a KV cache, where each real token is written: slots
    ``start .. start + T - 1`` of every row when all rows are at the same positions (one
    slice copy), else each real token ``(rows, cols)`` at its own slot."""

    mask: torch.Tensor | None
    causal: bool = False
    start: int | None = None
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    kv_len: int = 0
    uniform: bool = False  # every row at the same positions (the first is ``low``)


def attention_plan(
    positions: torch.Tensor, kv_len: int | None, low: int, high: int
) -> AttentionPlan:
    """``kv_len``: None without a cache, else the cache slots attended over; ``low`` and
    ``high``: the smallest and largest entry of ``positions``."""
    t = positions.shape[1]
    # Every row at the same positions start..start+T-1 (no padding). A single token per
    # row needs no comparison: min == max says it.
    uniform = low >= 0 and high - low == t - 1
    if uniform and t > 1:
        uniform = bool((positions == torch.arange(low, high + 1, device=positions.device)).all())
    valid = positions >= 0
    if kv_len is None:
        if uniform and low == 0:
            return AttentionPlan(None, causal=True, uniform=True)
        # Key j is visible to query i of the same row when it is real and not later.
        mask = valid.unsqueeze(1) & (positions.unsqueeze(1) <= positions.unsqueeze(2))
        # A padding query sees itself, so no row is fully masked (SDPA would give NaN).
        mask |= torch.eye(t, dtype=torch.bool, device=positions.device)
        return AttentionPlan(mask.unsqueeze(1))
    if uniform and kv_len == high + 1:
        # Prefill from slot 0 is causal; one decode step sees every written slot.
        return AttentionPlan(
            None, causal=low == 0 and t > 1, start=low, kv_len=kv_len, uniform=True
        )
    rows, cols = valid.nonzero(as_tuple=True)
    slots = positions[rows, cols]
    slot_ids = torch.arange(kv_len, device=positions.device)
    mask = slot_ids.view(1, 1, kv_len) <= positions.unsqueeze(-1)
    mask[..., 0] |= ~valid  # padding queries look at slot 0 (finite, ignored)
    return AttentionPlan(mask.unsqueeze(1), False, None, rows, cols, slots, kv_len, uniform)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    kwargs = {"attn_mask": plan.mask, "is_causal": plan.causal}
    if rep > 1 and _HAS_GQA:
        # Grouped-query attention without copying k/v per query head.
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per row that sees every key: ``softmax(q k^T / sqrt(D)) v`` as two
    batched matmuls, ``[B, 1, heads * D]`` out. The query heads are grouped by the kv head
    they share (``[B, kv_heads, rep, D]``), so GQA needs no copies and the result needs no
    transpose; for a single query this beats SDPA's CPU flash kernel by 10-15%.
    ``q``: ``[B, 1, heads, D]``; ``k``, ``v``: ``[B, kv_heads, S, D]``."""
    b, _, heads, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, kv, heads // kv, d) * (d**-0.5)
    probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
    return torch.matmul(probs, v).view(b, 1, heads * d)


def write_cache(cache: torch.Tensor, new: torch.Tensor, plan: AttentionPlan) -> None:
    """Write ``new`` (``[B, T, kv_heads, D]``) into ``cache`` (``[B, kv_heads, S, D]``)."""
    if plan.start is not None:
        cache.narrow(2, plan.start, new.shape[1]).copy_(new.transpose(1, 2))
    else:
        cache[plan.rows, :, plan.slots] = new[plan.rows, plan.cols].to(cache.dtype)
