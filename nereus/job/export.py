"""The trained policy of a job's checkpoint as a Hugging Face folder.

``export_checkpoint(checkpoint, cfg, model_config, model_dir, out)`` reads the policy's
parameters from ``checkpoint`` (a ``checkpoints/step_N`` folder the job wrote: one
``policy_training.safetensors`` from an in-process job, or the state layer's checkpoint
``policy_training/`` of a cluster job, saved in whatever layout trained it and read back
whole through ``nereus.state.checkpoint.load_shards`` into a TP 1, PP 1 target), leaves
the AdamW moments, and writes ``out`` with ``nereus.models.export.export_hf``: config,
``model.safetensors`` and the tokenizer files of the job's model folder.
transformers' ``from_pretrained`` and vLLM load the result.

``nereus export RUN_DIR [--checkpoint DIR] [--out DIR]`` does the same from the command
line (the run's ``config.json`` says the model; the newest complete checkpoint and
``RUN_DIR/hf`` by default), and ``[run] export_hf`` at the end of a job. Reads only the
files; never touches a running job.

Refuses (``StateError``): a checkpoint without the policy's files, or one of another model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from nereus.config import from_dict
from nereus.engines.precision import resolve_dtype
from nereus.errors import ConfigError, StateError, exit_status
from nereus.job.config import JobConfig
from nereus.models.config import ModelConfig
from nereus.models.export import export_hf
from nereus.models.spec import model_spec
from nereus.state import EMU, Layout
from nereus.state.checkpoint import MANIFEST, load_shards

__all__ = ["export_checkpoint", "latest_checkpoint", "policy_tensors", "main"]

_STAGE = "policy_training"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest ``checkpoints/step_N`` folder that is complete, or None."""
    root = Path(out_dir) / "checkpoints"
    done = [p for p in root.glob("step_*") if (p / "job.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def policy_tensors(
    checkpoint: str | Path, cfg: JobConfig, model_config: ModelConfig
) -> dict[str, torch.Tensor]:
    """The policy's whole parameters in ``checkpoint`` (nereus names)."""
    folder = Path(checkpoint)
    spec = model_spec(model_config, dtype=_dtype(cfg))
    single = folder / f"{_STAGE}.safetensors"
    if single.is_file():
        names = {p.name for p in spec}
        return {k: v for k, v in load_file(str(single)).items() if k in names}
    saved = folder / _STAGE
    if not (saved / MANIFEST).is_file():
        raise StateError(
            f"checkpoint {str(folder)!r} holds neither {single.name} nor a complete {_STAGE}/ "
            "checkpoint"
        )
    whole = EMU("export", _STAGE, spec, Layout(1, 1), (0,))
    return load_shards(saved, whole, 0)


def export_checkpoint(
    checkpoint: str | Path,
    cfg: JobConfig,
    model_config: ModelConfig,
    model_dir: str | Path,
    out: str | Path,
) -> Path:
    """Write the policy of ``checkpoint`` to ``out`` as a Hugging Face folder; returns ``out``."""
    params = policy_tensors(checkpoint, cfg, model_config)
    return export_hf(out, model_config, params, tokenizer_dir=model_dir, dtype=_dtype(cfg))


def _dtype(cfg: JobConfig) -> str:
    # A job writes its config.json again once "auto" is resolved for its devices; one
    # still saying "auto" never ran on GPUs (nereus.engines.precision).
    return resolve_dtype(cfg.model.dtype, ["cpu"])


def _model_folder(cfg: JobConfig, run_dir: Path) -> Path:
    if cfg.model.kind == "tiny":
        return run_dir / "model"  # the job wrote the tiny model and its tokenizer there
    if cfg.model.kind == "smollm2":
        return Path(cfg.model.path or "runs/smollm2-135m-instruct")
    return Path(cfg.model.path)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="nereus export", description="Write a job's trained policy as a Hugging Face folder."
    )
    p.add_argument("run_dir", help="the job's output folder (run.out_dir)")
    p.add_argument(
        "--checkpoint", help="a checkpoints/step_N folder (default: the newest complete one)"
    )
    p.add_argument("--out", help="where to write the folder (default: RUN_DIR/hf)")
    args = p.parse_args(argv)

    def export() -> None:
        run_dir = Path(args.run_dir)
        config_file = run_dir / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{str(run_dir)!r} has no config.json: is it a job's output folder?")
        cfg = from_dict(JobConfig, json.loads(config_file.read_text()))
        checkpoint = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(run_dir)
        if checkpoint is None:
            raise StateError(f"{str(run_dir)!r} has no complete checkpoint")
        model_dir = _model_folder(cfg, run_dir)
        out = export_checkpoint(
            checkpoint, cfg, ModelConfig.from_hf(model_dir), model_dir, args.out or run_dir / "hf"
        )
        print(f"wrote {out} from {checkpoint}")

    return exit_status("nereus export", export, usage=(ConfigError, StateError))
