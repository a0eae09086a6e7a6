"""One KV-cached decode step of a ``DecoderStage`` in as few torch ops as the math allows.

A decode step of a small model costs per op dispatched, not per FLOP, so this path keeps
every activation 2-D (``[B, hidden]``: ``F.linear`` on 2-D input is one GEMM with no
reshapes), and does once per step what every layer would otherwise redo:

The results equal the general forward's up to float rounding (the same formulas in
another order). Preconditions (``DecoderStage.forward`` checks them before taking this
path): one token per row, every position ``>= 0`` and below the cache's length, each
row's cache written from slot 0 up to its position, a cache with pair buffers, float32,
no autograd.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "DecodeStep",
    "StepTables",
    "decode_step_plan",
    "layer_parts",
    "decode_layer",
    "attend_one",
    "rms_norm_rows",
]


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
    # k^T and v of every layer as one ``as_strided`` each: (the pair buffers' strides, k^T's
    # size and stride, v's size and stride, the offset of v in a pair), or None when a
    # pair's row and kv head dims do not merge (a strided row view of a cache).
    views: tuple | None = None


class StepTables:
    """A stage's constants of the decode path: per head (q, k, v) the factor and offset
    that turn the RoPE table's ``[cos, signed sin]`` into that head's pair, epsilon, and
    slot ids."""

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        max_len: int,
        device: torch.device,
    ) -> None:
        total = heads + 2 * kv_heads
        self.scale = torch.ones(total, 2, 1, device=device)
        self.scale[:heads] = head_dim**-0.5
        self.scale[heads + kv_heads :] = 0.0
        self.offset = torch.zeros(total, 2, head_dim, device=device)
        self.offset[heads + kv_heads :, 0] = 1.0
        self.eps = torch.tensor(eps, device=device)
        self.slot_ids = torch.arange(max_len, device=device)


def decode_step_plan(
    tables: StepTables,
    rope_table: torch.Tensor,
    positions: torch.Tensor,
    pair: torch.Tensor,
    low: int,
    high: int,
) -> DecodeStep:
    """The shared part of a decode step for ``positions`` ``[B]`` (all ``>= 0``) whose
    smallest and largest entries are ``low`` and ``high``, with pair buffers shaped and
    strided like ``pair`` (``[2, B, kv_heads, slots, head_dim]``, one of them);
    ``rope_table`` is the stage's ``[n > high, 2, head_dim]`` cos / signed-sin table."""
    kv_len = high + 1
    _, _, kv_heads, slots, d = pair.shape
    st = pair.stride()
    views = None
    if st[1] == kv_heads * st[2]:
        n = positions.shape[0] * kv_heads
        views = (
            st,
            (n, d, kv_len),
            (st[2], st[4], st[3]),
            (n, kv_len, d),
            (st[2], st[3], st[4]),
            st[0],
        )
    if low == high:
        rows = rope_table.narrow(0, low, 1)  # [1, 2, D]
        slot, index, bias = low, None, None
    else:
        rows = rope_table.index_select(0, positions)  # [B, 2, D]
        b = positions.shape[0]
        slot = None
        starts = torch.arange(0, b * kv_heads * slots, slots, device=positions.device).view(
            b, kv_heads
        )
        index = (starts + positions.view(b, 1)).view(-1)
        beyond = tables.slot_ids.narrow(0, 0, kv_len) > positions.view(b, 1)
        bias = (
            torch.where(beyond, float("-inf"), 0.0).repeat_interleave(kv_heads, dim=0).unsqueeze(1)
        )
    cos, sin = torch.addcmul(tables.offset, rows.unsqueeze(1), tables.scale).unbind(2)
    return DecodeStep(cos, sin, kv_len, slot, index, bias, tables.eps, views)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``RMSNorm`` of float32 rows ``[B, H]``: ``x * rsqrt(|x|^2 / H + eps) * weight``."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.mul(x, torch.addcmul(eps, n, n, value=1.0 / x.shape[-1]).rsqrt_()).mul_(weight)


def attend_one(
    q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``softmax(q k^T + bias) v`` for ``q`` ``[B * kv_heads, rep, D]`` (already scaled),
    ``kt`` (``k^T``) ``[B * kv_heads, D, S]``, ``v`` ``[B * kv_heads, S, D]`` and ``bias``
    ``[B * kv_heads, 1, S]`` or None."""
    scores = torch.bmm(q, kt) if bias is None else torch.baddbmm(bias, q, kt)
    return torch.bmm(torch.softmax(scores, dim=-1), v)


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


def layer_parts(layer) -> tuple:
    """What ``decode_layer`` reads of a ``DecoderLayer``, gathered once per stage: the
    parameter dicts of its norms and linears (so a step finds each weight with a dict
    lookup instead of ``nn.Module.__getattr__``; the dicts stay the modules' own, so
    weights written in place, re-pointed with ``set_`` or even replaced stay current),
    the head counts, and per row-parallel linear None when its residual add can be
    fused into one ``addmm`` (no bias, TP 1), else the module to call."""
    norm1, attn, norm2, mlp = layer._parts
    o, down = attn.o_proj, mlp.down_proj
    return (
        norm1._parameters,
        attn.qkv_proj._parameters,
        o._parameters,
        norm2._parameters,
        mlp.gate_up_proj._parameters,
        down._parameters,
        attn.heads_local,
        attn.kv_heads_local,
        attn.head_dim,
        None if o.bias is None and o.pc.tp_size == 1 else o,
        None if down.bias is None and down.pc.tp_size == 1 else down,
        None if attn.q_norm is None else (attn.q_norm._parameters, attn.k_norm._parameters),
    )


def decode_layer(
    parts: tuple, h: torch.Tensor, step: DecodeStep, pair: torch.Tensor
) -> torch.Tensor:
    """One ``DecoderLayer`` (given as its ``layer_parts``) on rows ``h`` ``[B, hidden]``:
    writes this step's k/v into the layer's pair buffer and returns the layer's output
    ``[B, hidden]``. The norms and residual adds are inlined: at this size a Python call
    per piece costs more than some of its ops."""
    norm1, qkv_p, o_p, norm2, gate_up_p, down_p, nq, nkv, d, o_proj, down_proj, qk_norms = parts
    b, hidden = h.shape
    heads, eps, inv_h = nq + 2 * nkv, step.eps, 1.0 / hidden
    n = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
    x = torch.mul(h, torch.addcmul(eps, n, n, value=inv_h).rsqrt_()).mul_(norm1["weight"])
    qkv = F.linear(x, qkv_p["weight"], qkv_p.get("bias")).view(b, heads, d)
    if qk_norms is not None:
        # Qwen3: RMSNorm over each q and k head, before RoPE (in place: qkv is fresh).
        qk = qkv.narrow(1, 0, nq + nkv)
        n = torch.linalg.vector_norm(qk, dim=-1, keepdim=True)
        qk.mul_(torch.addcmul(eps, n, n, value=1.0 / d).rsqrt_())
        qkv.narrow(1, 0, nq).mul_(qk_norms[0]["weight"])
        qkv.narrow(1, nq, nkv).mul_(qk_norms[1]["weight"])
    qkv = torch.addcmul(qkv * step.cos, torch.roll(qkv, d // 2, 2), step.sin)
    # The new k and v heads as [2, B, kv_heads, D]: one view of the fresh (contiguous) qkv.
    _write(
        pair,
        qkv.as_strided((2, b, nkv, d), (nkv * d, heads * d, d, 1), qkv.storage_offset() + nq * d),
        step,
    )
    q = qkv.narrow(1, 0, nq).reshape(b * nkv, nq // nkv, d)
    views = step.views
    if views is not None and pair.stride() == views[0]:
        base = pair.storage_offset()
        kt, v = (
            pair.as_strided(views[1], views[2], base),
            pair.as_strided(views[3], views[4], base + views[5]),
        )
    else:
        k, v = pair.narrow(3, 0, step.kv_len).reshape(2, b * nkv, step.kv_len, d).unbind(0)
        kt = k.transpose(1, 2)
    a = attend_one(q, kt, v, step.bias).view(b, nq * d)
    h = torch.addmm(h, a, o_p["weight"].t()) if o_proj is None else h + o_proj.forward(a)
    n = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
    x = torch.mul(h, torch.addcmul(eps, n, n, value=inv_h).rsqrt_()).mul_(norm2["weight"])
    gate, up = F.linear(x, gate_up_p["weight"]).chunk(2, dim=-1)
    x = torch.mul(F.silu(gate, inplace=True), up)
    return (
        torch.addmm(h, x, down_p["weight"].t()) if down_proj is None else h + down_proj.forward(x)
    )
