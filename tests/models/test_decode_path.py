"""The decode fast path: RoPE table lookups, single-query attention, long cached decode,
ragged decode steps (rows at different positions) and its fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.models import build_stage, tiny_config
from nereus.models._decode import attend_one
from nereus.models.attention import RotaryEmbedding, apply_rope, decode_attention
from nereus.models.decoder import DecoderStage, KVCache


def _reference_rope(
    x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float
) -> torch.Tensor:
    """Hugging Face's formula, computed per call: x * cos + rotate_half(x) * sin."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(2), emb.sin().unsqueeze(2)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def test_rope_table_matches_the_formula_across_growth_and_both_lookups():
    rope = RotaryEmbedding(tiny_config(), "cpu")  # head_dim 16, theta 10000
    x = torch.randn(3, 5, 4, 16)
    # Short positions first (a small table), then far ones (the table grows).
    for start in (0, 7, 300):
        pos = torch.arange(start, start + 5).expand(3, 5)
        gathered = apply_rope(x, *rope(pos, torch.float32))
        sliced = apply_rope(x, *rope(pos, torch.float32, start + 5, start))
        expect = _reference_rope(x, pos, 16, 10000.0)
        torch.testing.assert_close(gathered, expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sliced, expect, rtol=1e-5, atol=1e-5)
    assert rope._tables[(torch.float32, torch.device("cpu"))].shape[0] >= 305
    # Padding (negative positions) reads position 0 and stays finite.
    pos = torch.tensor([[-1, 0, 1, 2, 3]]).expand(3, 5)
    assert torch.isfinite(apply_rope(x, *rope(pos, torch.float32))).all()
    # Another dtype gets its own table, rounded from the float32 values.
    cos16, _ = rope(torch.arange(4)[None], torch.bfloat16)
    assert cos16.dtype == torch.bfloat16


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 5),
    kv=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 2, 3]),
    slots=st.integers(1, 40),
)
def test_single_query_attention_matches_sdpa(batch, kv, rep, slots):
    g = torch.Generator().manual_seed(batch * 1000 + kv * 100 + rep * 10 + slots)
    heads, d = kv * rep, 8
    q = torch.randn(batch, 1, heads, d, generator=g)
    cache_k = torch.randn(batch, kv, slots + 3, d, generator=g)
    cache_v = torch.randn(batch, kv, slots + 3, d, generator=g)
    k, v = cache_k.narrow(2, 0, slots), cache_v.narrow(2, 0, slots)  # strided, as from a cache
    got = decode_attention(q, k, v)
    expect = (
        F.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        )
        .transpose(1, 2)
        .reshape(batch, 1, heads * d)
    )
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


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 5),
    kv=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 2, 3]),
    slots=st.integers(2, 40),
)
def test_masked_single_query_attention_matches_sdpa(batch, kv, rep, slots):
    g = torch.Generator().manual_seed(batch * 1000 + kv * 100 + rep * 10 + slots)
    heads, d = kv * rep, 8
    q = torch.randn(batch, kv, rep, d, generator=g)
    k = torch.randn(batch, kv, slots, d, generator=g)
    v = torch.randn(batch, kv, slots, d, generator=g)
    last = torch.randint(0, slots, (batch,), generator=g)  # each row sees slots 0..last
    visible = torch.arange(slots) <= last.view(batch, 1)
    bias = torch.where(visible, 0.0, float("-inf")).repeat_interleave(kv, dim=0).unsqueeze(1)
    got = attend_one(
        (q * d**-0.5).reshape(batch * kv, rep, d),
        k.reshape(batch * kv, slots, d).transpose(1, 2),
        v.reshape(batch * kv, slots, d),
        bias,
    ).view(batch, heads, d)
    expect = F.scaled_dot_product_attention(
        q.reshape(batch, heads, 1, d),
        k.repeat_interleave(rep, dim=1),
        v.repeat_interleave(rep, dim=1),
        attn_mask=visible.view(batch, 1, 1, slots),
    ).view(batch, heads, d)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def _ragged(batch: int, steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths and ``steps`` tokens after each: ids and
    positions ``[batch, width + steps]`` and the prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (batch,), generator=g)
    lengths[0] = 6  # the widest row sets the width
    width = int(lengths.max())
    cols = torch.arange(width + steps).expand(batch, -1)
    pad = (width - lengths).unsqueeze(1)
    positions = torch.where(cols >= pad, cols - pad, torch.full_like(cols, -1))
    return torch.randint(0, 256, (batch, width + steps), generator=g), positions, lengths


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("strided", [False, True], ids=["rows-of-one-buffer", "strided-rows"])
def test_ragged_decode_steps_match_full_forward(arch, strided, monkeypatch):
    # Rows at different positions: each decode step writes k/v at every row's own slot and
    # masks the slots past it. GQA (4 heads, 2 kv heads); qwen2 adds q/k/v biases.
    torch.manual_seed(1)
    stage = build_stage(tiny_config(arch)).eval()
    ids, positions, lengths = _ragged(batch=4, steps=9, seed=2)
    width = ids.shape[1] - 9
    fast = []
    real = DecoderStage._decode
    monkeypatch.setattr(DecoderStage, "_decode", lambda self, *a: fast.append(1) or real(self, *a))
    with torch.inference_mode():
        full = stage(ids, positions)
        cache = stage.new_kv_cache(8, max_len=32)
        # Every other row of a larger cache: each half of a pair buffer is strided.
        cache = cache.rows(slice(0, 8, 2)) if strided else cache.rows(slice(0, 4))
        stage(ids[:, :width], positions[:, :width], kv_cache=cache)
        steps = [
            stage(ids[:, t : t + 1], positions[:, t : t + 1], kv_cache=cache)
            for t in range(width, width + 9)
        ]
    assert len(fast) == 9
    assert cache.pairs is not None and cache.pairs[0][0].is_contiguous() is not strided
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, width:], rtol=1e-5, atol=1e-5)
    # Every row's k/v of the last step sits at that row's own slot.
    last = positions[:, -1]
    assert (last == lengths + 8).all()
    for b in range(4):
        assert cache.keys[0][b, :, last[b]].abs().sum() > 0
        assert cache.keys[0][b, :, last[b] + 1 :].abs().sum() == 0


def test_padding_or_a_cache_without_pairs_takes_the_general_path(monkeypatch):
    torch.manual_seed(3)
    stage = build_stage(tiny_config("llama")).eval()
    ids, positions, _ = _ragged(batch=3, steps=2, seed=4)
    width = ids.shape[1] - 2
    positions[2, width:] = -1  # row 2 finished: padding in both decode steps
    monkeypatch.setattr(
        DecoderStage, "_decode", lambda *a: pytest.fail("the decode path took padding")
    )
    with torch.inference_mode():
        full = stage(ids, positions)
        cache = stage.new_kv_cache(3, max_len=16)
        stage(ids[:, :width], positions[:, :width], kv_cache=cache)
        steps = [
            stage(ids[:, t : t + 1], positions[:, t : t + 1], kv_cache=cache)
            for t in range(width, width + 2)
        ]
        torch.testing.assert_close(
            torch.cat(steps, dim=1)[:2], full[:2, width:], rtol=1e-5, atol=1e-5
        )
        plain = KVCache(dict(cache.keys), dict(cache.values), cache.max_len)  # no pair buffers
        stage(ids[:2, :1], positions[:2, width - 1 : width], kv_cache=plain.rows(slice(0, 2)))


def test_decode_path_sees_weights_written_repointed_or_replaced_after_its_first_step():
    # The decode path gathers each layer's parameter dicts once; every way the engines
    # update weights (copy_ in place, set_ onto a received buffer) and even replacing a
    # parameter object must reach the next step. Reference: the general path (a cache
    # without pair buffers) with the same weights.
    torch.manual_seed(5)
    stage = build_stage(tiny_config("qwen2")).eval()
    ids = torch.randint(0, 256, (3, 5))
    pos = torch.arange(5).expand(3, 5)
    layer = stage._layers[0]

    def step_both() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            fast_cache, plain_cache = (
                stage.new_kv_cache(3, max_len=8),
                stage.new_kv_cache(3, max_len=8),
            )
            plain = KVCache(plain_cache.keys, plain_cache.values, plain_cache.max_len)
            outs = []
            for cache in (fast_cache, plain):
                stage(ids[:, :4], pos[:, :4], kv_cache=cache)
                outs.append(stage(ids[:, 4:], pos[:, 4:], kv_cache=cache))
        return outs[0], outs[1]

    before, _ = step_both()
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(3.0)  # in place, as load_named / load_stage_weights
        qkv = layer.self_attn.qkv_proj.weight
        qkv.set_(qkv.detach().clone().mul_(-1.0))  # re-pointed, as an adopted transfer bucket
        stage.model.norm.weight.set_(torch.full_like(stage.model.norm.weight, 2.0))
        layer.self_attn.qkv_proj.bias = torch.nn.Parameter(
            torch.randn_like(layer.self_attn.qkv_proj.bias)
        )
    fast, general = step_both()
    assert not torch.allclose(fast, before)
    torch.testing.assert_close(fast, general, rtol=1e-5, atol=1e-5)
