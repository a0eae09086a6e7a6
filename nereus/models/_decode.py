"""One KV-cached decode step of a ``DecoderStage`` in as few torch ops as the math allows.

A decode step of a small model costs per op dispatched, not per FLOP, so this path keeps
every activation 2-D (``[B, hidden]``: ``F.linear`` on 2-D input is one GEMM with no
reshapes), and does once per step what every layer would otherwise redo:

- RoPE: one lookup of the stage's table (a slice when every row is at one position, else a
  gather), spread over all q, k and v heads of the fused projection: the q heads carry the
  attention scale ``head_dim ** -0.5`` and the v heads the identity (cos 1, sin 0). A
  layer then rotates its whole q/k/v output in three ops (``roll`` swaps the halves of
  each head, the fastest of the ways tried; then ``mul`` and ``addcmul``), and its new k
  and v, side by side, go into the layer's k/v pair buffer (``KVCache.pairs``) in one copy.
- Rows at different positions (ragged prompts): an additive mask ``[B * kv_heads, 1, S]``
  (``-inf`` past each row's own position) that ``baddbmm`` adds while computing the
  scores, and an index that writes each row's k/v at its own slot. Rows at one position
  need neither: one slice copy and no mask.
- Attention: one query per row against its cache slots, ``softmax(q k^T) v`` as two
  ``bmm`` over ``batch x kv_heads`` with the query heads of a kv head grouped (GQA without
  copies of k/v). SDPA's CPU kernel is slower for one query, several times so with a mask.
- RMSNorm from ``vector_norm`` (five small ops; ``torch.rms_norm`` is a composite of more
  on CPU), the residual adds fused into the row-parallel GEMMs (``addmm``) at TP 1, and
  SwiGLU's ``silu`` in place.

The results equal the general forward's up to float rounding (the same formulas in
another order). Preconditions (``DecoderStage.forward`` checks them before taking this
path): one token per row, every position ``>= 0`` and below the cache's length, each
row's cache written from slot 0 up to its position, a cache with pair buffers, float32,
no autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nereus.models.layers import RMSNorm, RowParallelLinear

__all__ = ["DecodeStep", "StepTables", "decode_step_plan", "decode_layer", "attend_one", "rms_norm_rows"]


@dataclass
class DecodeStep:
    """What every layer of one decode step shares (see the module docstring)."""

    cos: torch.Tensor  # [B or 1, heads + 2 * kv_heads, head_dim]: q scaled, v 1
    sin: torch.Tensor  # likewise (first half of each head negated; v 0)
    kv_len: int  # cache slots attended over: 0 .. the largest position
    slot: int | None  # the slot every row writes (rows at one position), else None
    index: torch.Tensor | None  # [B * kv_heads]: each row's slot in a [2, B * kv_heads * S, D] view
    bias: torch.Tensor | None  # [B * kv_heads, 1, kv_len]: 0 or -inf per slot
    eps: torch.Tensor  # the norms' epsilon as a 0-dim tensor (an addcmul operand)


class StepTables:
    """A stage's constants of the decode path: per head (q, k, v) the factor and offset
    that turn the RoPE table's ``[cos, signed sin]`` into that head's pair, epsilon, and
    slot ids."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float, max_len: int, device: torch.device) -> None:
        total = heads + 2 * kv_heads
        self.scale = torch.ones(total, 2, 1, device=device)
        self.scale[:heads] = head_dim**-0.5
        self.scale[heads + kv_heads :] = 0.0
        self.offset = torch.zeros(total, 2, head_dim, device=device)
        self.offset[heads + kv_heads :, 0] = 1.0
        self.eps = torch.tensor(eps, device=device)
        self.slot_ids = torch.arange(max_len, device=device)


def decode_step_plan(
    tables: StepTables, rope_table: torch.Tensor, positions: torch.Tensor, kv_heads: int, slots: int, low: int, high: int
) -> DecodeStep:
    """The shared part of a decode step for ``positions`` ``[B]`` (all ``>= 0``) whose
    smallest and largest entries are ``low`` and ``high``, with caches of ``slots`` slots;
    ``rope_table`` is the stage's ``[n > high, 2, head_dim]`` cos / signed-sin table."""
    kv_len = high + 1
    if low == high:
        rows = rope_table.narrow(0, low, 1)  # [1, 2, D]
        slot, index, bias = low, None, None
    else:
        rows = rope_table.index_select(0, positions)  # [B, 2, D]
        b = positions.shape[0]
        slot = None
        starts = torch.arange(0, b * kv_heads * slots, slots, device=positions.device).view(b, kv_heads)
        index = (starts + positions.view(b, 1)).view(-1)
        beyond = tables.slot_ids.narrow(0, 0, kv_len) > positions.view(b, 1)
        bias = torch.where(beyond, float("-inf"), 0.0).repeat_interleave(kv_heads, dim=0).unsqueeze(1)
    cos, sin = torch.addcmul(tables.offset, rows.unsqueeze(1), tables.scale).unbind(2)
    return DecodeStep(cos, sin, kv_len, slot, index, bias, tables.eps)


def rms_norm_rows(x: torch.Tensor, norm: RMSNorm, eps: torch.Tensor) -> torch.Tensor:
    """``RMSNorm`` of float32 rows ``[B, H]``: ``x * rsqrt(|x|^2 / H + eps) * w``."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    scale = torch.addcmul(eps, n, n, value=1.0 / x.shape[-1]).rsqrt_()
    return torch.mul(x, scale).mul_(norm.weight)


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``softmax(q k^T + bias) v`` for ``q`` ``[B * kv_heads, rep, D]`` (already scaled) and
    ``k``, ``v`` ``[B * kv_heads, S, D]``; ``bias`` ``[B * kv_heads, 1, S]`` or None."""
    kt = k.transpose(1, 2)
    scores = torch.bmm(q, kt) if bias is None else torch.baddbmm(bias, q, kt)
    return torch.bmm(torch.softmax(scores, dim=-1), v)


def _add_row_parallel(h: torch.Tensor, x: torch.Tensor, lin: RowParallelLinear) -> torch.Tensor:
    """``h + lin(x)``: one ``addmm`` when there is nothing to reduce or add after the GEMM."""
    if lin.bias is None and lin.pc.tp_size == 1:
        return torch.addmm(h, x, lin.weight.t())
    return h + lin.forward(x)


def _write(pair: torch.Tensor, new: torch.Tensor, step: DecodeStep) -> None:
    """Write ``new`` ``[2, B, kv_heads, D]`` (k, v) at each row's slot of ``pair``
    ``[2, B, kv_heads, S, D]``."""
    if step.slot is not None:
        pair.select(3, step.slot).copy_(new)
        return
    b, kv, slots, d = pair.shape[1:]
    if pair[0].is_contiguous():  # rows of one allocation: a row copy, twice as fast as a scatter
        pair.view(2, b * kv * slots, d).index_copy_(1, step.index, new.reshape(2, b * kv, d))
    else:
        rows = (step.index.view(b, kv) % slots).view(1, b, kv, 1, 1).expand(2, b, kv, 1, d)
        pair.scatter_(3, rows, new.unsqueeze(3))


def decode_layer(layer, h: torch.Tensor, step: DecodeStep, pair: torch.Tensor) -> torch.Tensor:
    """One ``DecoderLayer`` on rows ``h`` ``[B, hidden]``: writes this step's k/v into the
    layer's pair buffer and returns the layer's output ``[B, hidden]``."""
    norm1, attn, norm2, mlp = layer._parts
    b = h.shape[0]
    nq, nkv, d = attn.heads_local, attn.kv_heads_local, attn.head_dim
    qkv_proj = attn.qkv_proj
    qkv = F.linear(rms_norm_rows(h, norm1, step.eps), qkv_proj.weight, qkv_proj.bias).view(b, nq + 2 * nkv, d)
    qkv = torch.addcmul(qkv * step.cos, torch.roll(qkv, d // 2, 2), step.sin)
    _write(pair, qkv.narrow(1, nq, 2 * nkv).view(b, 2, nkv, d).transpose(0, 1), step)
    q = qkv.narrow(1, 0, nq).reshape(b * nkv, nq // nkv, d)
    k, v = pair.narrow(3, 0, step.kv_len).reshape(2, b * nkv, step.kv_len, d).unbind(0)
    h = _add_row_parallel(h, attend_one(q, k, v, step.bias).view(b, nq * d), attn.o_proj)
    gate, up = F.linear(rms_norm_rows(h, norm2, step.eps), mlp.gate_up_proj.weight).chunk(2, dim=-1)
    return _add_row_parallel(h, torch.mul(F.silu(gate, inplace=True), up), mlp.down_proj)
