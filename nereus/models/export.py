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

Putting a model saved in another layout back together is the state layer's job
(``nereus.state.checkpoint.load_shards`` into a TP 1, PP 1 target); this module only
writes.

Refuses (``StateError``): a missing parameter, a tensor whose shape disagrees with the
model, names the model does not have.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from nereus.errors import StateError
from nereus.models.checkpoint import SINGLE_FILE, hf_tensor_names
from nereus.models.config import ModelConfig
from nereus.models.decoder import torch_dtype
from nereus.models.spec import model_spec

__all__ = ["export_hf", "TOKENIZER_FILES"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


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
            raise StateError(
                f"{param.name!r} has shape {tuple(full.shape)}, expected {param.shape}"
            )
        names = hf_tensor_names(param.name)
        pieces = (
            [full]
            if len(names) == 1
            else torch.split(full, [c.size for c in param.components], dim=0)
        )
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
