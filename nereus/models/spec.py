"""``model_spec``: the ``ModelSpec`` of a model, read off the model itself.

The whole model (TP 1, PP 1) is built on the meta device (no memory) and its modules
are walked: every parameter's shard rule, components and global shape come from the
``ShardedModule`` that owns it; its pipeline position from where it sits (``embed`` for
``model.embed_tokens``, ``layer`` for ``model.layers.{i}``, ``head`` for ``model.norm`` and
``lm_head``). A tied embedding is listed once, as ``model.embed_tokens.weight`` with
``tied_head=True``. Nothing here is a hand-written table, so a change to a layer changes
the spec with it.

``shard_tensor(param, full, tp_rank, tp_size)`` cuts a global tensor into the shard one
TP rank holds under a ``ParamSpec`` -- the same placement the layers build and the loader
reads, used to check shards against an unsharded reference.

Refuses: parameters owned by a module that declares no shard rule (``StateError``: a
layer was added without saying how it is sharded).
"""

from __future__ import annotations

import torch

from nereus.errors import StateError
from nereus.models.config import ModelConfig
from nereus.models.decoder import build_stage
from nereus.models.layers import ShardedModule, component_range
from nereus.state.spec import ModelSpec, ParamSpec

__all__ = ["model_spec", "shard_tensor"]


def _position(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if parts[:2] == ["model", "embed_tokens"]:
        return "embed", None
    if parts[:2] == ["model", "layers"]:
        return "layer", int(parts[2])
    return "head", None


def model_spec(config: ModelConfig, dtype: str = "float32", value_head: bool = False) -> ModelSpec:
    """Every parameter of the model ``config`` describes, with shard rules and stages;
    with ``value_head`` the scalar head of a critic or reward model too (``value_head.*``,
    replicated, on the last pipeline stage)."""
    model = build_stage(config, dtype=dtype, device="meta", value_head=value_head)
    params: list[ParamSpec] = []
    for module_name, module in model.named_modules():
        for local, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            if not isinstance(module, ShardedModule) or local not in module.shard_rules:
                raise StateError(
                    f"parameter {name!r} is owned by {type(module).__name__}, which declares "
                    "no shard rule"
                )
            rule, components = module.shard_rules[local]
            stage, layer = _position(name)
            params.append(
                ParamSpec(
                    name=name,
                    shape=tuple(module.global_shapes[local]),
                    dtype=dtype,
                    rule=rule,
                    stage=stage,  # type: ignore[arg-type]
                    layer=layer,
                    components=components,
                    tied_head=stage == "embed" and config.tie_word_embeddings,
                )
            )
    return ModelSpec(
        name=f"{config.architecture}-{config.num_hidden_layers}x{config.hidden_size}"
        + ("-value" if value_head else ""),
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        params=tuple(params),
    )


def shard_tensor(param: ParamSpec, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The shard of the global tensor ``full`` that TP rank ``tp_rank`` holds."""
    if tuple(full.shape) != param.shape:
        raise StateError(
            f"tensor for {param.name!r} has shape {tuple(full.shape)}, expected {param.shape}"
        )
    dim = param.split_dim
    if dim is None or tp_size == 1:
        return full.clone()
    pieces = []
    offset = 0
    for comp in param.effective_components():
        start, stop = component_range(
            comp.size, comp.units, tp_rank, tp_size, f"{param.name}:{comp.name}"
        )
        pieces.append(full.narrow(dim, offset + start, stop - start))
        offset += comp.size
    return torch.cat(pieces, dim=dim).clone()
