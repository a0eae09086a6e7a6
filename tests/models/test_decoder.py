"""The decoder in one process: KV cache, ragged batches, stages, layout checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError
from nereus.models import ParallelContext, build_stage, stage_layer_range, tiny_config
from nereus.transfer.communicator import Communicator


class ShapeOnlyComm(Communicator):
    """Stands in for a TP group when only shapes are built (meta device): any
    collective call is a test failure."""

    def __init__(self, rank: int, size: int) -> None:
        self.group_id, self.rank, self.size, self.epoch, self.backend = (
            "shape-only",
            rank,
            size,
            0,
            "none",
        )

    def _refuse(self, *args, **kwargs):
        raise AssertionError("a shape-only communicator was asked to communicate")

    batch_p2p = broadcast = all_reduce = all_gather = reduce_scatter = barrier = _refuse

    def destroy(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _model(arch="llama", **kw):
    torch.manual_seed(0)
    c = tiny_config(arch, **kw)
    stage = build_stage(c)
    with torch.no_grad():  # random biases and norms so every parameter matters
        for name, p in stage.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return stage.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ragged_rows_match_unpadded_rows(arch):
    stage = _model(arch, attention_bias=True)
    ids = torch.randint(0, 256, (3, 8))
    positions = torch.stack(
        [
            torch.arange(8),
            torch.tensor([-1, -1, -1, 0, 1, 2, 3, 4]),
            torch.tensor([0, 1, 2, 3, 4, -1, -1, -1]),
        ]
    )
    with torch.no_grad():
        batch = stage(ids, positions)
        assert torch.isfinite(batch).all(), "padding must not produce NaN anywhere"
        for row in range(3):
            keep = positions[row] >= 0
            alone = stage(ids[row, keep][None], positions[row, keep][None])
            torch.testing.assert_close(batch[row, keep], alone[0], rtol=1e-5, atol=1e-5)


def test_kv_cache_prefill_and_decode_match_full_forward():
    stage = _model("qwen2", tie_word_embeddings=True)
    ids = torch.randint(0, 256, (2, 9))
    positions = torch.stack([torch.arange(9), torch.tensor([-1, -1, 0, 1, 2, 3, 4, 5, 6])])
    with torch.no_grad():
        full = stage(ids, positions)
        cache = stage.new_kv_cache(2, max_len=16)
        assert cache.keys[0].shape == (2, 2, 16, 16) and cache.nbytes == 2 * 4 * 2 * 2 * 16 * 16 * 4
        steps = [stage(ids[:, :5], positions[:, :5], kv_cache=cache)]
        for t in range(5, 9):
            steps.append(stage(ids[:, t : t + 1], positions[:, t : t + 1], kv_cache=cache))
        cached = torch.cat(steps, dim=1)
    valid = positions >= 0
    torch.testing.assert_close(cached[valid], full[valid], rtol=1e-5, atol=1e-5)


def test_dense_batch_cached_decode_matches_full_forward():
    # No padding: prefill takes the causal kernel and decode steps need no mask at all.
    stage = _model("llama", attention_bias=True)
    ids = torch.randint(0, 256, (3, 8))
    pos = torch.arange(8).expand(3, 8)
    with torch.no_grad():
        full = stage(ids, pos)
        cache = stage.new_kv_cache(3, max_len=8)
        steps = [stage(ids[:, :3], pos[:, :3], kv_cache=cache)]
        steps += [stage(ids[:, t : t + 1], pos[:, t : t + 1], kv_cache=cache) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_decode_rows_at_different_lengths_and_finished_rows():
    stage = _model()
    a, b = torch.randint(0, 256, (1, 6)), torch.randint(0, 256, (1, 3))
    with torch.no_grad():
        cache = stage.new_kv_cache(2, max_len=8)
        # right-padded prefill: row 1 is shorter
        ids = torch.cat([a[:, :5], torch.cat([b, torch.zeros(1, 2, dtype=torch.long)], 1)])
        pos = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]])
        stage(ids, pos, kv_cache=cache)
        # one decode step: row 0 writes position 5, row 1 has finished (position -1)
        step = stage(torch.tensor([[a[0, 5]], [0]]), torch.tensor([[5], [-1]]), kv_cache=cache)
        assert torch.isfinite(step).all()
        ref = stage(a, torch.arange(6)[None])
    torch.testing.assert_close(step[0, 0], ref[0, 5], rtol=1e-5, atol=1e-5)


def test_logits_index_and_hidden_output():
    stage = _model()
    ids = torch.randint(0, 256, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        full = stage(ids, pos)
        picked = stage(ids, pos, logits_index=torch.tensor([4, 2]))
        hidden = stage(ids, pos, output="hidden")
    torch.testing.assert_close(picked, torch.stack([full[0, 4], full[1, 2]]))
    assert hidden.shape == (2, 5, 64)
    torch.testing.assert_close(stage.lm_head(hidden), full)


def test_pipeline_stages_compose_to_the_whole_model():
    c = tiny_config("qwen2", tie_word_embeddings=True, num_hidden_layers=5)
    whole = build_stage(c)
    stages = [
        build_stage(c, ParallelContext(pp_rank=r, pp_size=3, layer_cuts=(1, 4))) for r in range(3)
    ]
    assert [s.layer_ids for s in stages] == [[0], [1, 2, 3], [4]]
    params = dict(whole.named_parameters())
    with torch.no_grad():
        for s in stages:
            for name, p in s.named_parameters():
                p.copy_(params[name])  # the last stage's tied embedding copies the first's
    assert "model.embed_tokens.weight" in dict(stages[2].named_parameters())
    assert "lm_head.weight" not in dict(stages[2].named_parameters())
    ids = torch.randint(0, 256, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        h = ids
        for s in stages:
            h = s(h, pos)
        torch.testing.assert_close(h, whole(ids, pos))


def test_bad_inputs_are_refused():
    stage = _model()
    cache = stage.new_kv_cache(1, max_len=4)
    with pytest.raises(ConfigError, match="max_len=4"):
        stage(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], kv_cache=cache)
    with pytest.raises(ConfigError, match="positions.shape"):
        stage(torch.zeros(1, 5, dtype=torch.long), torch.arange(4)[None])
    with pytest.raises(ConfigError, match="max_len"):
        stage.new_kv_cache(1, max_len=10_000)
    with pytest.raises(ConfigError, match="output"):
        stage(torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], output="probs")


@pytest.mark.parametrize(
    ("kw", "tp", "words"),
    [
        ({}, 3, "num_attention_heads=4"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64}, 8, None),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48},
            2,
            "num_key_value_heads=3",
        ),
        ({"vocab_size": 250}, 4, "vocab_size=250"),
        ({"intermediate_size": 130}, 4, "intermediate_size=130"),
    ],
)
def test_layout_checks(kw, tp, words):
    c = tiny_config(**kw)
    pc = ParallelContext(tp_rank=0, tp_size=tp, tp_comm=ShapeOnlyComm(0, tp))
    if words is None:
        build_stage(c, pc, device="meta")
        return
    with pytest.raises(ConfigError, match=words):
        build_stage(c, pc, device="meta")


def test_parallel_context_validation():
    with pytest.raises(ConfigError, match="tp_comm"):
        ParallelContext(tp_rank=0, tp_size=2)
    with pytest.raises(ConfigError, match="tp_comm.rank"):
        ParallelContext(tp_rank=1, tp_size=2, tp_comm=ShapeOnlyComm(0, 2))
    with pytest.raises(ConfigError, match="pp_rank"):
        ParallelContext(pp_rank=2, pp_size=2)
    with pytest.raises(ConfigError, match="layer_cuts"):
        ParallelContext(pp_rank=0, pp_size=3, layer_cuts=(2, 2))
    with pytest.raises(ConfigError, match="pp_size"):
        build_stage(tiny_config(num_hidden_layers=2), ParallelContext(pp_rank=0, pp_size=3))


@settings(max_examples=50, deadline=None)
@given(layers=st.integers(1, 40), data=st.data())
def test_stage_layer_ranges_partition_the_layers(layers, data):
    pp = data.draw(st.integers(1, layers))
    ranges = [stage_layer_range(layers, pp, r) for r in range(pp)]
    assert [i for r in ranges for i in r] == list(range(layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    if pp > 1:
        cuts = sorted(
            data.draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1))
        )
        custom = [stage_layer_range(layers, pp, r, cuts) for r in range(pp)]
        assert [i for r in custom for i in r] == list(range(layers))
        assert [r.start for r in custom[1:]] == cuts


def test_bfloat16_stage_tracks_float32():
    stage = _model()
    half = build_stage(stage.config, dtype="bfloat16")
    with torch.no_grad():
        for p, q in zip(stage.parameters(), half.parameters(), strict=True):
            q.copy_(p.to(torch.bfloat16))
    ids = torch.randint(0, 256, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        ref = stage(ids, pos)
        out = half(ids, pos)
        cache = half.new_kv_cache(2, 8)
        cached = torch.cat(
            [
                half(ids[:, :4], pos[:, :4], kv_cache=cache),
                half(ids[:, 4:5], pos[:, 4:5], kv_cache=cache),
                half(ids[:, 5:], pos[:, 5:], kv_cache=cache),
            ],
            dim=1,
        )
    assert out.dtype == torch.bfloat16 and cache.keys[0].dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.02)
    torch.testing.assert_close(cached.float(), out.float(), rtol=0.05, atol=0.02)


def test_a_few_adamw_steps_fit_a_batch():
    stage = _model().train()
    ids = torch.randint(0, 256, (4, 12))
    pos = torch.arange(11).expand(4, 11)
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        logits = stage(ids[:, :-1], pos)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in stage.parameters())
    assert losses[-1] < 0.5 * losses[0], losses
