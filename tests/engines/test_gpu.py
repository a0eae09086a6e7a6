"""GPU tier: the inference and training engines on CUDA give the CPU's results.

Skipped (by tests/conftest.py) only where CUDA or libnccl is absent."""

from __future__ import annotations

import pytest
import torch

from nereus.engines import EmuContext, InferenceEngine, TrainingEngine
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.models import ParallelContext, save_tiny_model, tiny_config

pytestmark = pytest.mark.gpu

CONFIG = tiny_config(num_hidden_layers=2, tie_word_embeddings=True)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_cuda_engines_match_cpu(tmp_path):
    path = save_tiny_model(tmp_path / "m", CONFIG, seed=1, init_std=0.2)
    cuda = EmuContext(ParallelContext(), device="cuda")
    for device_ctx, tag in ((None, "cpu"), (cuda, "cuda")):
        ledger = MemoryLedger(f"gpu-test-{tag}", None)
        inf = InferenceEngine(
            CONFIG,
            device_ctx,
            options=EngineOptions(model_dir=path, ledger=ledger, name=f"i-{tag}"),
        )
        train = TrainingEngine(
            CONFIG,
            device_ctx,
            options=EngineOptions(model_dir=path, ledger=ledger, name=f"t-{tag}"),
            optim={"lr": 1e-3},
        )
        lp = inf.logprobs(_batch())
        assert lp.device.type == "cpu"
        assert train.optimizer.defaults["foreach"] is (tag == "cuda")  # multi-tensor AdamW on CUDA
        metrics = train.train_step(_batch(), micro_batch_size=2)
        state = {k: v.cpu() for k, v in train.named_state().items()}
        if tag == "cpu":
            ref_lp, ref_metrics, ref_state = lp, metrics, state
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-4)
    for k, v in state.items():
        torch.testing.assert_close(v, ref_state[k], atol=2e-4, rtol=1e-3)
