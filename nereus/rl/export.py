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

``nereus export RUN_DIR [--checkpoint DIR] [--out DIR]`` does the same from the command
line (the run's ``config.json`` says the model and the plan; the newest complete
checkpoint and ``RUN_DIR/hf`` by default), and ``[run] export_hf`` at the end of a job.
Reads only the files; never touches a running job.

Refuses (``StateError``): a checkpoint without the policy's files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nereus.errors import ConfigError, StateError
from nereus.models.export import export_hf, gather_ranks
from nereus.models.spec import model_spec

__all__ = ["export_checkpoint", "policy_tensors", "main"]

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


def _model_folder(cfg: Any, run_dir: Path) -> Path:
    if cfg.model.kind == "tiny":
        return run_dir / "model"  # the job wrote the tiny model and its tokenizer there
    if cfg.model.kind == "smollm2":
        return Path(cfg.model.path or "runs/smollm2-135m-instruct")
    return Path(cfg.model.path)


def main(argv: list[str]) -> int:
    from nereus.config import from_dict
    from nereus.models.config import ModelConfig
    from nereus.rl.config import JobConfig
    from nereus.rl.job import latest_checkpoint

    p = argparse.ArgumentParser(prog="nereus export", description="Write a job's trained policy as a Hugging Face folder.")
    p.add_argument("run_dir", help="the job's output folder (run.out_dir)")
    p.add_argument("--checkpoint", help="a checkpoints/step_N folder (default: the newest complete one)")
    p.add_argument("--out", help="where to write the folder (default: RUN_DIR/hf)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        config_file = run_dir / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{str(run_dir)!r} has no config.json: is it a job's output folder?")
        cfg = from_dict(JobConfig, json.loads(config_file.read_text()))
        checkpoint = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(run_dir)
        if checkpoint is None:
            raise StateError(f"{str(run_dir)!r} has no complete checkpoint")
        model_dir = _model_folder(cfg, run_dir)
        out = export_checkpoint(checkpoint, cfg, ModelConfig.from_hf(model_dir), model_dir, args.out or run_dir / "hf")
    except (ConfigError, StateError) as e:
        print(f"nereus export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} from {checkpoint}")
    return 0
