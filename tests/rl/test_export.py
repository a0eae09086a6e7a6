"""A job checkpoint's policy as a Hugging Face folder: from the in-process file or from one
file per (pp, tp) rank as cluster jobs write them, and through ``nereus export``."""

from __future__ import annotations

import json

import pytest
import torch

from nereus.cli import main as nereus_main
from nereus.config import from_dict, to_dict
from nereus.errors import StateError
from nereus.models import (
    ModelConfig,
    ParallelContext,
    build_stage,
    load_stage_weights,
    save_tiny_model,
    tiny_config,
)
from nereus.rl.config import JobConfig
from nereus.rl.export import policy_tensors
from nereus.rl.stages import write_state
from tests.models.test_decoder import ShapeOnlyComm

CONFIG = tiny_config("qwen3", tie_word_embeddings=True)


def _job(model_dir, out_dir, tp=1, pp=1) -> JobConfig:
    return from_dict(JobConfig, {
        "model": {"kind": "hf", "path": str(model_dir)},
        "task": {"name": "arithmetic"},
        "cluster": {"mode": "local", "devices": tp * pp},
        "plan": {"policy_generation": {"devices": [0]}, "policy_training": {"devices": list(range(tp * pp)), "tp": tp, "pp": pp}},
        "run": {"out_dir": str(out_dir)},
    })


def _write_ranks(folder, model_dir, tp, pp) -> dict[str, torch.Tensor]:
    """Rank files as a cluster job's checkpoint holds them (parameters and AdamW moments);
    returns the whole model's parameters."""
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            pc = ParallelContext(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp,
                                 tp_comm=ShapeOnlyComm(tp_rank, tp) if tp > 1 else None)
            stage = build_stage(CONFIG, pc)
            load_stage_weights(stage, model_dir)
            tensors = {}
            for name, p in stage.named_parameters():
                tensors[name] = p.detach()
                tensors[f"{name}.exp_avg"] = torch.randn_like(p)
                tensors[f"{name}.exp_avg_sq"] = torch.rand_like(p)
            write_state(folder, f"policy_training.rank{pp_rank * tp + tp_rank}", tensors, {"step": 3, "policy_version": 3})
    whole = build_stage(CONFIG)
    load_stage_weights(whole, model_dir)
    return {n: p.detach() for n, p in whole.named_parameters()}


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_policy_tensors_from_rank_files(tmp_path, tp, pp):
    model_dir = save_tiny_model(tmp_path / "model", CONFIG, seed=6)
    ckpt = tmp_path / "run" / "checkpoints" / "step_3"
    want = _write_ranks(ckpt, model_dir, tp, pp)
    got = policy_tensors(ckpt, _job(model_dir, tmp_path / "run", tp, pp), CONFIG)
    assert got.keys() == want.keys()  # AdamW moments dropped
    assert all(torch.equal(got[k], want[k]) for k in want)
    if tp * pp > 1:
        (ckpt / "policy_training.rank1.safetensors").unlink()
        with pytest.raises(StateError, match=r"lacks \['policy_training.rank1.safetensors'\].*tp=2 pp=2"):
            policy_tensors(ckpt, _job(model_dir, tmp_path / "run", tp, pp), CONFIG)


def test_nereus_export_command(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "model", CONFIG, seed=7)
    run = tmp_path / "run"
    cfg = _job(model_dir, run, 2, 1)
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    ckpt = run / "checkpoints" / "step_3"
    want = _write_ranks(ckpt, model_dir, 2, 1)
    (ckpt / "job.json").write_text("{}")
    assert nereus_main(["export", str(run)]) == 0
    assert f"wrote {run / 'hf'}" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    stage = build_stage(ModelConfig.from_hf(run / "hf"))
    stage.load_state_dict(want, strict=False)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, stage(ids, torch.arange(9).expand(2, 9)), rtol=1e-4, atol=1e-5)
    assert nereus_main(["export", str(tmp_path / "nowhere")]) == 2
    assert "has no config.json" in capsys.readouterr().err
