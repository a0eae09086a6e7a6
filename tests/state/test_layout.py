"""Layouts and boxes: tiling, per-component splits, GQA replication, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError, StateError
from nereus.models.spec import shard_tensor
from nereus.state import EMU, Layout, check_layout, layer_bounds, param_shard
from nereus.state.layout import box_intersect, box_numel, box_subtract
from tests.state.helpers import spec_for

POW2 = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=40, deadline=None)
@given(tp=POW2, kv=POW2, tied=st.booleans())
def test_shards_tile_every_tensor_and_match_the_model_placement(tp, kv, tied):
    spec = spec_for(kv_heads=kv, tied=tied)
    check_layout(spec, Layout(tp, 1))
    for p in spec.params:
        count = np.zeros(p.shape, dtype=np.int64)
        full = np.arange(p.numel, dtype=np.float32).reshape(p.shape)
        full_t = torch.from_numpy(full)
        for r in range(tp):
            shard = param_shard(p, tp, r)
            local = np.zeros(shard.shape, dtype=np.float32)
            for piece in shard.pieces:
                count[tuple(slice(*b) for b in piece.box)] += 1
                local[tuple(slice(*b) for b in piece.local)] = full[
                    tuple(slice(*b) for b in piece.box)
                ]
            # the state layer's boxes reproduce the model layer's own slicing
            assert np.array_equal(local, shard_tensor(p, full_t, r, tp).numpy()), (p.name, tp, r)
        if p.split_dim is None:
            assert (count == tp).all()
        elif "qkv" in p.name and tp > kv:
            q = p.components[0].size
            assert (count[:q] == 1).all() and (count[q:] == tp // kv).all()
        else:
            assert (count == 1).all(), p.name


def test_fused_qkv_is_split_per_component():
    spec = spec_for(kv_heads=2)
    qkv = spec["model.layers.0.self_attn.qkv_proj.weight"]  # q 16 rows, k 4, v 4
    shard = param_shard(qkv, 2, 1)
    assert [p.box[0] for p in shard.pieces] == [(8, 16), (18, 20), (22, 24)]
    assert shard.shape == (12, 16)


@settings(max_examples=30, deadline=None)
@given(pp=POW2, data=st.data())
def test_layer_cuts_cover_each_layer_once(pp, data):
    cuts = tuple(sorted(data.draw(st.sets(st.integers(1, 7), min_size=pp - 1, max_size=pp - 1))))
    spec = spec_for()
    layout = Layout(1, pp, cuts)
    bounds = layer_bounds(layout, spec.num_layers)
    assert bounds[0] == 0 and bounds[-1] == spec.num_layers and len(bounds) == pp + 1
    emu = EMU("e", "policy-training", spec, layout, tuple(range(pp)))
    for p in spec.params:
        holders = [d for d in emu.devices if p.name in emu.shards_on(d)]
        expected = 2 if (p.tied_head and pp > 1) else 1
        assert len(holders) == expected, (p.name, holders)


def test_default_cuts_follow_the_model_layer():
    from nereus.models.parallel import stage_layer_range

    for pp in (1, 2, 3, 4, 8):
        b = layer_bounds(Layout(1, pp), 8)
        assert [range(b[s], b[s + 1]) for s in range(pp)] == [
            stage_layer_range(8, pp, s) for s in range(pp)
        ]


@pytest.mark.parametrize(
    "heads,kv,tp,needle",
    [
        (8, 2, 3, "tp=3 must divide num_attention_heads=8"),
        (12, 4, 3, "tp=3 must divide num_kv_heads=4"),
        (12, 4, 6, "tp=6 must be a multiple of num_kv_heads=4"),
        (8, 8, 16, "tp=16 must divide num_attention_heads=8"),
    ],
)
def test_layouts_that_do_not_divide_are_refused(heads, kv, tp, needle):
    spec = spec_for(kv_heads=kv, heads=heads, intermediate=48, vocab=96)
    with pytest.raises(StateError, match=needle):
        check_layout(spec, Layout(tp, 1))
    with pytest.raises(StateError, match=needle):
        EMU("e", "policy-training", spec, Layout(tp, 1), tuple(range(tp)))


def test_vocab_and_intermediate_must_divide_too():
    spec = spec_for(intermediate=36, vocab=64)
    with pytest.raises(StateError, match="gate_up_proj.weight component 'gate' units=36"):
        check_layout(spec, Layout(8, 1))


def test_pipeline_refusals():
    spec = spec_for(layers=4)
    with pytest.raises(StateError, match="pp=8 must be <= num_layers=4"):
        check_layout(spec, Layout(1, 8))
    with pytest.raises(StateError, match="cuts=\\[2, 4\\] must all be < num_layers=4"):
        check_layout(spec, Layout(1, 3, (2, 4)))
    with pytest.raises(ConfigError, match="Layout.cuts"):
        Layout(1, 3, (2, 2))
    with pytest.raises(ConfigError, match="must list pp-1=1"):
        Layout(1, 2, (1, 2))
    with pytest.raises(ConfigError, match="Layout.tp"):
        Layout(0, 1)


def test_emu_device_list_must_match_layout():
    spec = spec_for()
    with pytest.raises(ConfigError, match="must list tp\\*pp=4 devices"):
        EMU("e", "policy-training", spec, Layout(2, 2), (0, 1, 2))
    with pytest.raises(ConfigError, match="must not list a device twice"):
        EMU("e", "policy-training", spec, Layout(2, 1), (1, 1))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=2, max_size=2),
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=2, max_size=2),
)
def test_box_subtract_partitions_the_difference(a, b):
    a = tuple((lo, lo + n) for lo, n in a)
    b = tuple((lo, lo + n) for lo, n in b)
    parts = box_subtract(a, b)
    inter = box_intersect(a, b)
    assert sum(box_numel(p) for p in parts) + (box_numel(inter) if inter else 0) == box_numel(a)
    for i, p in enumerate(parts):
        assert box_intersect(p, b) is None
        for q in parts[i + 1 :]:
            assert box_intersect(p, q) is None
