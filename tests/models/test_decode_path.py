"""The decode fast path: RoPE table lookups, single-query attention, long cached decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.models import build_stage, tiny_config
from nereus.models.decoder import RotaryEmbedding, _apply_rope, _decode_attention


def _reference_rope(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Hugging Face's formula, computed per call: x * cos + rotate_half(x) * sin."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(2), emb.sin().unsqueeze(2)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def test_rope_table_matches_the_formula_across_growth_and_both_lookups():
    rope = RotaryEmbedding(16, 10000.0, "cpu")
    x = torch.randn(3, 5, 4, 16)
    # Short positions first (a small table), then far ones (the table grows).
    for start in (0, 7, 300):
        pos = torch.arange(start, start + 5).expand(3, 5)
        gathered = _apply_rope(x, *rope(pos, torch.float32))
        sliced = _apply_rope(x, *rope(pos, torch.float32, start + 5, start))
        expect = _reference_rope(x, pos, 16, 10000.0)
        torch.testing.assert_close(gathered, expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sliced, expect, rtol=1e-5, atol=1e-5)
    assert rope._tables[(torch.float32, torch.device("cpu"))].shape[0] >= 305
    # Padding (negative positions) reads position 0 and stays finite.
    pos = torch.tensor([[-1, 0, 1, 2, 3]]).expand(3, 5)
    assert torch.isfinite(_apply_rope(x, *rope(pos, torch.float32))).all()
    # Another dtype gets its own table, rounded from the float32 values.
    cos16, _ = rope(torch.arange(4)[None], torch.bfloat16)
    assert cos16.dtype == torch.bfloat16


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 5), kv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2, 3]), slots=st.integers(1, 40))
def test_single_query_attention_matches_sdpa(batch, kv, rep, slots):
    g = torch.Generator().manual_seed(batch * 1000 + kv * 100 + rep * 10 + slots)
    heads, d = kv * rep, 8
    q = torch.randn(batch, 1, heads, d, generator=g)
    cache_k = torch.randn(batch, kv, slots + 3, d, generator=g)
    cache_v = torch.randn(batch, kv, slots + 3, d, generator=g)
    k, v = cache_k.narrow(2, 0, slots), cache_v.narrow(2, 0, slots)  # strided, as from a cache
    got = _decode_attention(q, k, v)
    expect = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    ).transpose(1, 2).reshape(batch, 1, heads * d)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_long_cached_decode_matches_full_forward():
    # 80 positions: past the RoPE table's first size, every step through the fast path.
    torch.manual_seed(0)
    stage = build_stage(tiny_config("llama", max_position_embeddings=128)).eval()
    ids = torch.randint(0, 256, (2, 80))
    pos = torch.arange(80).expand(2, 80)
    with torch.inference_mode():
        full = stage(ids, pos)
        cache = stage.new_kv_cache(2, max_len=96)
        steps = [stage(ids[:, :4], pos[:, :4], kv_cache=cache)]
        steps += [stage(ids[:, t : t + 1], pos[:, t : t + 1], kv_cache=cache) for t in range(4, 80)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
