"""The trained policy of a job's checkpoint as a Hugging Face folder.

``export_checkpoint(checkpoint, cfg, model_config, model_dir, out)`` reads the policy's
parameters from ``checkpoint`` (a ``checkpoints/step_N`` folder the job wrote: one
``policy_training.safetensors`` from an in-process job, or one
``policy_training.rank{R}.safetensors`` per (pp_rank, tp_rank) of the first training EMU,
in the layout ``[plan.policy_training]`` names), puts the TP shards and pipeline stages
back together (``nereus.models.export.gather_ranks``), drops the AdamW moments, and
writes ``out`` with ``nereus.models.export.export_hf``: config, ``model.safetensors`` and
the tokenizer files of the job's model folder. transformers' ``from_pretrained`` and
vLLM load the result.

``nereus export RUN_DIR`` does the same from the command line, and ``[run] export_hf``
at the end of a job. Reads only the files; never touches a running job.

Refuses (``StateError``): a checkpoint without the policy's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nereus.errors import StateError
from nereus.models.export import export_hf, gather_ranks
from nereus.models.spec import model_spec

__all__ = ["export_checkpoint", "policy_tensors"]

_STAGE = "policy_training"


def policy_tensors(checkpoint: str | Path, cfg: Any, model_config: Any) -> dict[str, torch.Tensor]:
    """The policy's whole parameters in ``checkpoint`` (nereus names)."""
    folder = Path(checkpoint)
    spec = model_spec(model_config)
    names = {p.name for p in spec}
    single = folder / f"{_STAGE}.safetensors"
    if single.is_file():
        tensors = load_file(str(single))
        return {k: v for k, v in tensors.items() if k in names}
    place = cfg.plan[_STAGE]
    files = [folder / f"{_STAGE}.rank{r}.safetensors" for r in range(place.tp * place.pp)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise StateError(f"checkpoint {str(folder)!r} has no {single.name} and lacks {missing} "
                         f"(plan.policy_training is tp={place.tp} pp={place.pp})")
    ranks = [{k: v for k, v in load_file(str(f)).items() if k in names} for f in files]
    return gather_ranks(spec, ranks, place.tp, place.pp)


def export_checkpoint(checkpoint: str | Path, cfg: Any, model_config: Any, model_dir: str | Path, out: str | Path) -> Path:
    """Write the policy of ``checkpoint`` to ``out`` as a Hugging Face folder; returns ``out``."""
    params = policy_tensors(checkpoint, cfg, model_config)
    return export_hf(out, model_config, params, tokenizer_dir=model_dir, dtype=cfg.model.dtype)
