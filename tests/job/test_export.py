"""A job checkpoint's policy as a Hugging Face folder: from the in-process file or from the
state layer's checkpoint a cluster job writes in any layout, and through ``nereus export``."""

from __future__ import annotations

import json

import pytest
import torch

from nereus.cli import main as nereus_main
from nereus.config import from_dict, to_dict
from nereus.errors import StateError
from nereus.job.config import JobConfig
from nereus.job.export import policy_tensors
from nereus.models import (
    ModelConfig,
    build_stage,
    load_stage_weights,
    model_spec,
    save_tiny_model,
    tiny_config,
)
from nereus.state import EMU, OPTIMIZER_SLOTS, Layout
from nereus.state.checkpoint import save_checkpoint
from tests.state.helpers import shard_store

CONFIG = tiny_config("qwen3", tie_word_embeddings=True)


def _job(model_dir, out_dir) -> JobConfig:
    return from_dict(
        JobConfig,
        {
            "model": {"kind": "hf", "path": str(model_dir)},
            "task": {"name": "arithmetic"},
            "cluster": {"mode": "local", "devices": 4},
            "plan": {
                "policy_generation": {"devices": [0]},
                "policy_training": {"devices": [0, 1, 2, 3], "tp": 2, "pp": 2},
            },
            "run": {"out_dir": str(out_dir)},
        },
    )


def _cluster_checkpoint(folder, model_dir, layout: Layout) -> dict[str, torch.Tensor]:
    """A policy_training checkpoint as a cluster job writes it (parameters and AdamW
    moments, one file per (pp, tp) position); returns the whole model's parameters."""
    whole = build_stage(CONFIG)
    load_stage_weights(whole, model_dir)
    params = {n: p.detach() for n, p in whole.named_parameters()}
    spec = model_spec(CONFIG)
    emu = EMU(
        "policy_training/0",
        "policy_training",
        spec,
        layout,
        tuple(range(layout.size)),
        ("param", *OPTIMIZER_SLOTS),
    )
    full = {k: params.get(k, torch.randn(spec[k.split(":")[0]].shape)) for k in emu.keys()}
    save_checkpoint(folder / "policy_training", emu, shard_store(emu, full))
    return params


@pytest.mark.parametrize("layout", [Layout(2, 2), Layout(4, 1), Layout(1, 3, (1, 3))], ids=str)
def test_policy_tensors_from_a_cluster_checkpoint(tmp_path, layout):
    model_dir = save_tiny_model(tmp_path / "model", CONFIG, seed=6)
    ckpt = tmp_path / "run" / "checkpoints" / "step_3"
    want = _cluster_checkpoint(ckpt, model_dir, layout)
    got = policy_tensors(ckpt, _job(model_dir, tmp_path / "run"), CONFIG)
    assert got.keys() == want.keys()  # AdamW moments left behind
    assert all(torch.equal(got[k], want[k]) for k in want)
    (ckpt / "policy_training" / "manifest.json").unlink()
    with pytest.raises(
        StateError, match="neither policy_training.safetensors nor a complete policy_training/"
    ):
        policy_tensors(ckpt, _job(model_dir, tmp_path / "run"), CONFIG)


def test_nereus_export_command(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "model", CONFIG, seed=7)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(_job(model_dir, run))))
    ckpt = run / "checkpoints" / "step_3"
    want = _cluster_checkpoint(ckpt, model_dir, Layout(2, 2))
    (ckpt / "job.json").write_text("{}")
    assert nereus_main(["export", str(run)]) == 0
    assert f"wrote {run / 'hf'}" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    stage = build_stage(ModelConfig.from_hf(run / "hf"))
    stage.load_state_dict(want)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            hf(ids).logits, stage(ids, torch.arange(9).expand(2, 9)), rtol=1e-4, atol=1e-5
        )
    assert nereus_main(["export", str(tmp_path / "nowhere")]) == 2
    assert "has no config.json" in capsys.readouterr().err
