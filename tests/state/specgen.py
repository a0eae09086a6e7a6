"""Test-only ModelSpec generator for a Llama/Qwen2-style decoder (fused QKV and gate-up,
GQA, tied or untied embeddings), used until every test can build specs from a model."""

from __future__ import annotations

from nereus.state.spec import Component, ModelSpec, ParamSpec


def make_spec(
    *,
    num_layers: int = 4,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 4,
    intermediate: int = 64,
    vocab: int = 64,
    tied: bool = False,
    qkv_bias: bool = True,
    dtype: str = "float32",
) -> ModelSpec:
    hidden = heads * head_dim
    q, kv = heads * head_dim, kv_heads * head_dim
    qkv = (Component("q", q, heads), Component("k", kv, kv_heads), Component("v", kv, kv_heads))
    gate_up = (Component("gate", intermediate, intermediate), Component("up", intermediate, intermediate))
    params = [ParamSpec("embed.weight", (vocab, hidden), dtype, "vocab", "embed", tied_head=tied)]
    for i in range(num_layers):
        p = f"layers.{i}."
        params += [
            ParamSpec(p + "input_norm.weight", (hidden,), dtype, "replicated", "layer", i),
            ParamSpec(p + "attn.qkv.weight", (q + 2 * kv, hidden), dtype, "column", "layer", i, qkv),
        ]
        if qkv_bias:
            params.append(ParamSpec(p + "attn.qkv.bias", (q + 2 * kv,), dtype, "column", "layer", i, qkv))
        params += [
            ParamSpec(p + "attn.o.weight", (hidden, q), dtype, "row", "layer", i),
            ParamSpec(p + "post_norm.weight", (hidden,), dtype, "replicated", "layer", i),
            ParamSpec(p + "mlp.gate_up.weight", (2 * intermediate, hidden), dtype, "column", "layer", i, gate_up),
            ParamSpec(p + "mlp.down.weight", (hidden, intermediate), dtype, "row", "layer", i),
        ]
    params.append(ParamSpec("norm.weight", (hidden,), dtype, "replicated", "head"))
    if not tied:
        params.append(ParamSpec("lm_head.weight", (vocab, hidden), dtype, "vocab", "head"))
    return ModelSpec("test-decoder", num_layers, heads, kv_heads, vocab, hidden, tuple(params))
