"""Export a model as a Hugging Face folder that transformers and vLLM load.

``export_hf(directory, config, params, tokenizer_dir)`` takes every parameter of the whole
model (TP 1, PP 1) under nereus's names and writes:

- ``config.json`` (``ModelConfig.to_hf``: the architecture transformers and vLLM build),
- ``model.safetensors`` under Hugging Face's names: fused ``qkv_proj`` and
  ``gate_up_proj`` split back into ``q_proj``/``k_proj``/``v_proj`` and
  ``gate_proj``/``up_proj``; a tied embedding written once (no ``lm_head.weight``);
  ``value_head.*`` (a critic's head) left out,
- the tokenizer's files copied from ``tokenizer_dir`` (``tokenizer.json``,
  ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``,
  ``generation_config.json``, ``vocab.json``, ``merges.txt``, whichever exist).

``merge_shards(param, shards)`` is the inverse of ``nereus.models.spec.shard_tensor``: the
global tensor from the TP shards of every rank (replicated units -- GQA kv heads at
``tp > kv heads`` -- are read from the first rank that holds them);
``gather_ranks(spec, ranks, tp, pp)`` applies it to a whole model saved as one tensor map
per (pp_rank, tp_rank), rank ``pp_rank * tp + tp_rank``, whatever the layer cuts.

Refuses (``StateError``): a missing parameter, a tensor whose shape disagrees with the
model, names the model does not have.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from nereus.errors import StateError
from nereus.models.checkpoint import SINGLE_FILE, hf_tensor_names
from nereus.models.config import ModelConfig
from nereus.models.decoder import torch_dtype
from nereus.models.layers import component_range
from nereus.models.spec import model_spec
from nereus.state.spec import ModelSpec, ParamSpec

__all__ = ["export_hf", "merge_shards", "gather_ranks", "TOKENIZER_FILES"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def merge_shards(param: ParamSpec, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global tensor of ``param`` from the shards of TP ranks ``0 .. len(shards) - 1``."""
    tp = len(shards)
    dim = param.split_dim
    if dim is None or tp == 1:
        return shards[0]
    comps = param.effective_components()
    pieces = []
    for index in range(len(comps)):
        seen: dict[tuple[int, int], torch.Tensor] = {}
        for rank, shard in enumerate(shards):
            ranges = [component_range(c.size, c.units, rank, tp, f"{param.name}:{c.name}") for c in comps]
            start, stop = ranges[index]
            # A replicated unit (kv heads at tp > kv heads): every rank holding it holds the same rows.
            offset = sum(b - a for a, b in ranges[:index])  # this component's rows follow the earlier ones'
            seen.setdefault((start, stop), shard.narrow(dim, offset, stop - start))
        pieces.extend(seen[key] for key in sorted(seen))
    full = torch.cat(pieces, dim=dim)
    if tuple(full.shape) != param.shape:
        raise StateError(f"{param.name!r}: merged shards have shape {tuple(full.shape)}, expected {param.shape}")
    return full


def gather_ranks(spec: ModelSpec, ranks: Sequence[Mapping[str, torch.Tensor]], tp: int, pp: int) -> dict[str, torch.Tensor]:
    """Every parameter of ``spec`` whole, from the tensor maps of the ``tp * pp`` ranks."""
    if len(ranks) != tp * pp:
        raise StateError(f"expected {tp * pp} rank maps for tp={tp} pp={pp}, got {len(ranks)}")
    out: dict[str, torch.Tensor] = {}
    for param in spec:
        # The first stage that holds it: any layer cut works, and a tied embedding's copy
        # on the last stage is the same tensor as the first stage's.
        pp_rank = next((r for r in range(pp) if param.name in ranks[r * tp]), None)
        if pp_rank is None:
            raise StateError(f"no rank holds {param.name!r}")
        shards = []
        for tp_rank in range(tp):
            tensors = ranks[pp_rank * tp + tp_rank]
            if param.name not in tensors:
                raise StateError(f"rank pp{pp_rank}/tp{tp_rank} holds no {param.name!r}")
            shards.append(tensors[param.name])
        out[param.name] = merge_shards(param, shards)
    return out


def export_hf(
    directory: str | Path,
    config: ModelConfig,
    params: Mapping[str, torch.Tensor],
    tokenizer_dir: str | Path | None = None,
    dtype: str | None = None,
) -> Path:
    """Write ``params`` (whole, nereus names) as a Hugging Face folder; returns it."""
    spec = model_spec(config)
    known = {p.name for p in spec}
    extra = sorted(k for k in params if k not in known and not k.startswith("value_head."))
    if extra:
        raise StateError(f"parameters {extra[:5]} are not parameters of {spec.name}")
    target = torch_dtype(dtype or config.torch_dtype)
    tensors: dict[str, torch.Tensor] = {}
    for param in spec:
        if param.name not in params:
            raise StateError(f"export needs parameter {param.name!r}, which is missing")
        full = params[param.name]
        if tuple(full.shape) != param.shape:
            raise StateError(f"{param.name!r} has shape {tuple(full.shape)}, expected {param.shape}")
        names = hf_tensor_names(param.name)
        pieces = [full] if len(names) == 1 else torch.split(full, [c.size for c in param.components], dim=0)
        for name, piece in zip(names, pieces, strict=True):
            tensors[name] = piece.detach().to(target).contiguous().clone()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config.replace(torch_dtype=str(target).removeprefix("torch.")).save(out)
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for file in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / file
            if src.is_file():
                shutil.copyfile(src, out / file)
    return out
