"""Tiny random models in Hugging Face format, for tests, demos and benchmarks offline.

``save_tiny_model(dir, config, seed)`` builds the whole model on CPU with seeded random
weights and writes it with ``save_checkpoint`` (config.json + safetensors, optionally
sharded with an index). Same config and seed give bit-identical files. Norm weights and
biases are random too (not the usual 1 and 0), so that a loader that drops or misplaces
them is caught by an equivalence test.

``tiny_config(...)`` is a small valid ``ModelConfig`` (Llama or Qwen2 flavour) whose
sizes every TP in {1, 2, 4} divides, with fewer kv heads than 4 so TP 4 exercises GQA
kv replication.

Never downloads anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nereus.models.checkpoint import save_checkpoint
from nereus.models.config import ModelConfig
from nereus.models.decoder import build_stage

__all__ = ["save_tiny_model", "tiny_config"]


def tiny_config(architecture: str = "llama", **overrides) -> ModelConfig:
    """A few-hundred-kilobyte decoder: 4 layers, hidden 64, 4 heads, 2 kv heads."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=architecture == "qwen2",
        max_position_embeddings=256,
        architecture=architecture,
    )
    base.update(overrides)
    return ModelConfig(**base)


def save_tiny_model(
    directory: str | Path,
    config: ModelConfig,
    seed: int = 0,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    init_std: float = 0.02,
) -> Path:
    """Write a seeded random ``config`` model to ``directory`` in Hugging Face format.

    ``max_shard_bytes`` splits the weights into several files plus
    ``model.safetensors.index.json``. Returns the directory."""
    gen = torch.Generator().manual_seed(seed)
    model = build_stage(config, dtype="float32", device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(init_std * torch.randn(param.shape, generator=gen))
    return save_checkpoint(
        model, directory, max_shard_bytes=max_shard_bytes, dtype=dtype or config.torch_dtype
    )
