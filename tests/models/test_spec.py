"""model_spec is read off the modules, and agrees with what each rank builds and with
the state layer's shard placement."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nereus.models.spec as spec_module
from nereus.errors import StateError
from nereus.models import (
    ModelConfig,
    ParallelContext,
    build_stage,
    model_spec,
    shard_tensor,
    tiny_config,
)
from nereus.state.layout import Layout, holds_param, param_shard
from tests.models.test_decoder import ShapeOnlyComm


def test_spec_lists_every_parameter_with_its_rule():
    config = tiny_config("llama", attention_bias=True)
    spec = model_spec(config, dtype="bfloat16")
    whole = build_stage(config, device="meta")
    assert [p.name for p in spec] == [n for n, _ in whole.named_parameters()]
    assert all(p.shape == tuple(dict(whole.named_parameters())[p.name].shape) for p in spec)
    assert spec.nbytes == sum(p.numel() * 2 for p in whole.parameters())
    qkv = spec["model.layers.1.self_attn.qkv_proj.weight"]
    assert (qkv.rule, qkv.stage, qkv.layer) == ("column", "layer", 1)
    assert [(c.name, c.size, c.units) for c in qkv.components] == [
        ("q", 64, 4),
        ("k", 32, 2),
        ("v", 32, 2),
    ]
    gate_up = spec["model.layers.0.mlp.gate_up_proj.weight"]
    assert [(c.name, c.units) for c in gate_up.components] == [("gate", 128), ("up", 128)]
    assert spec["model.layers.0.self_attn.o_proj.weight"].rule == "row"
    assert (
        spec["model.layers.0.self_attn.o_proj.bias"].rule == "replicated"
    )  # Llama with attention_bias
    assert spec["model.layers.0.mlp.down_proj.weight"].rule == "row"
    assert spec["model.norm.weight"].stage == "head"
    assert (spec["lm_head.weight"].rule, spec["lm_head.weight"].stage) == ("vocab", "head")
    assert spec["model.embed_tokens.weight"].stage == "embed" and not spec.is_tied


def test_tied_embedding_is_listed_once():
    spec = model_spec(tiny_config("qwen2", tie_word_embeddings=True))
    names = [p.name for p in spec]
    assert (
        "lm_head.weight" not in names
        and spec["model.embed_tokens.weight"].tied_head
        and spec.is_tied
    )
    assert "model.layers.0.self_attn.o_proj.bias" not in names  # Qwen2: q/k/v biases only
    assert spec["model.layers.0.self_attn.qkv_proj.bias"].components


def test_qwen3_per_head_norms_are_replicated_layer_parameters():
    config = tiny_config("qwen3", head_dim=24, tie_word_embeddings=True)
    spec = model_spec(config)
    for i in range(config.num_hidden_layers):
        for norm in ("q_norm", "k_norm"):
            p = spec[f"model.layers.{i}.self_attn.{norm}.weight"]
            assert (p.rule, p.stage, p.layer, p.shape) == ("replicated", "layer", i, (24,))
    assert spec["model.layers.0.self_attn.qkv_proj.weight"].shape == (
        4 * 24 + 2 * 2 * 24,
        config.hidden_size,
    )
    assert "model.layers.0.self_attn.q_norm.weight" not in {
        p.name for p in model_spec(tiny_config("llama"))
    }


@pytest.mark.parametrize(("src", "dst"), [((1, 1), (2, 2)), ((2, 2), (4, 1)), ((4, 1), (1, 2))])
def test_qwen3_reshards_through_the_state_layer(src, dst):
    """A policy-training EMU of a Qwen3 model moves between layouts with the state
    layer's primitives; every shard it ends with (q/k norms included) is what the model
    itself cuts for that rank."""
    from nereus.state import EMU, OPTIMIZER_SLOTS, Layout, apply_step, plan_stage_transition
    from tests.state.helpers import global_tensors, shard_store

    spec = model_spec(tiny_config("qwen3", attention_bias=True))
    slots = ("param", *OPTIMIZER_SLOTS)
    a, b = Layout(*src), Layout(*dst)
    cur = EMU("cur", "policy-training", spec, a, tuple(range(a.size)), slots)
    tgt = EMU("tgt", "policy-training", spec, b, tuple(range(8, 8 + b.size)), slots)
    full = global_tensors(cur, seed=5)
    stores = {d: {"cur": t} for d, t in shard_store(cur, full).items()}
    plan = plan_stage_transition([cur], [tgt])
    for step in plan.steps:
        apply_step(step, stores)
    (result,) = plan.result
    want = shard_store(result, full)
    norms = 0
    for device in result.devices:
        got = stores[device][result.name]
        assert set(got) == set(want[device])
        for key, tensor in want[device].items():
            assert torch.equal(got[key], tensor), (device, key)
            norms += "q_norm" in key or "k_norm" in key
    assert norms > 0


def test_a_parameter_without_a_shard_rule_is_refused(monkeypatch):
    real = spec_module.build_stage

    def with_plain_linear(*args, **kwargs):
        stage = real(*args, **kwargs)
        stage.extra = torch.nn.Linear(2, 2, device="meta")
        return stage

    monkeypatch.setattr(spec_module, "build_stage", with_plain_linear)
    with pytest.raises(StateError, match="extra.weight"):
        model_spec(tiny_config())


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([2, 4, 8]),
    kv=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 3]),
    tied=st.booleans(),
    arch=st.sampled_from(["llama", "qwen2", "qwen3"]),
)
def test_built_shards_agree_with_the_state_layer(heads, kv, tp, pp, tied, arch):
    if kv > heads or heads % tp or (kv % tp and tp % kv):
        return
    config = ModelConfig(
        vocab_size=64,
        hidden_size=heads * 4,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=tied,
        attention_bias=arch == "qwen2",
        architecture=arch,
    )
    spec = model_spec(config)
    layout = Layout(tp=tp, pp=pp)
    full = {p.name: torch.arange(p.numel, dtype=torch.float32).reshape(p.shape) for p in spec}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            pc = ParallelContext(
                tp_rank=tp_rank,
                tp_size=tp,
                pp_rank=pp_rank,
                pp_size=pp,
                tp_comm=ShapeOnlyComm(tp_rank, tp) if tp > 1 else None,
            )
            params = dict(build_stage(config, pc, device="meta").named_parameters())
            assert set(params) == {p.name for p in spec if holds_param(spec, layout, p, pp_rank)}
            for name, p in params.items():
                shard = param_shard(spec[name], tp, tp_rank)
                assert tuple(p.shape) == shard.shape, (name, tp_rank)
                mine = shard_tensor(spec[name], full[name], tp_rank, tp)
                for piece in shard.pieces:
                    glob = full[name][tuple(slice(a, b) for a, b in piece.box)]
                    loc = mine[tuple(slice(a, b) for a, b in piece.local)]
                    assert torch.equal(glob, loc), (name, tp_rank, piece)
