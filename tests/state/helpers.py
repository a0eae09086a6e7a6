"""Shared test helpers: specs from the real model definition, shard stores filled from
global tensors with the models layer's own slicing, and a brute-force byte minimum."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from hypothesis import strategies as st

from nereus.models.config import ModelConfig
from nereus.models.spec import model_spec, shard_tensor
from nereus.state import DTYPE_BYTES, EMU, ModelSpec, split_key
from nereus.state.apply import TORCH_DTYPES
from nereus.state.layout import Layout


@lru_cache(maxsize=64)
def spec_for(
    kv_heads: int = 2,
    tied: bool = False,
    dtype: str = "float32",
    layers: int = 8,
    heads: int = 8,
    head_dim: int = 2,
    intermediate: int = 32,
    vocab: int = 64,
) -> ModelSpec:
    """A small Qwen2-style decoder spec read off the model itself (nereus.models)."""
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        architecture="qwen2",
        attention_bias=True,
    )
    return model_spec(config, dtype=dtype)


def global_tensors(emu: EMU, seed: int = 0) -> dict[str, torch.Tensor]:
    """A distinct random global tensor for every key ``emu`` holds."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key in emu.keys():
        slot, name = split_key(key)
        p = emu.spec[name]
        out[key] = torch.randn(p.shape, generator=gen).to(TORCH_DTYPES[emu.slot_dtype(slot, p)])
    return out


def shard_store(emu: EMU, full: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """device -> key -> shard, cut by nereus.models.spec.shard_tensor (not by the state
    layer), so the state layer's boxes are checked against the model's own placement."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for device in emu.devices:
        _, tp_rank = emu.position(device)
        out[device] = {
            key: shard_tensor(emu.spec[split_key(key)[1]], full[key], tp_rank, emu.layout.tp)
            for key in emu.shards_on(device)
        }
    return out


def brute_force_minimum(sources: list[EMU], target: EMU) -> int:
    """Bytes of target elements not held on their device, by element masks."""
    total = 0
    for device in target.devices:
        for key, (shard, dtype) in target.shards_on(device).items():
            shape = target.spec[split_key(key)[1]].shape
            need = np.zeros(shape, dtype=bool)
            for piece in shard.pieces:
                need[tuple(slice(*r) for r in piece.box)] = True
            for s in sources:
                if device in s.devices and key in s.shards_on(device):
                    for piece in s.shards_on(device)[key][0].pieces:
                        need[tuple(slice(*r) for r in piece.box)] = False
            total += int(need.sum()) * DTYPE_BYTES[dtype]
    return total


POW2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def layouts(draw, layers: int = 8) -> Layout:
    """A power-of-two layout (tp, pp in 1..8), with random valid layer cuts half the time."""
    tp, pp = draw(POW2), draw(POW2)
    cuts = ()
    if pp > 1 and draw(st.booleans()):
        cuts = tuple(
            sorted(draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1)))
        )
    return Layout(tp, pp, cuts)
