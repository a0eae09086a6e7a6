"""GPU defaults that CPU tests can pin: ``model.dtype = "auto"`` resolves to bfloat16 on
GPU devices and float32 elsewhere (training keeps float32 master weights and moments),
and AdamW steps with torch's multi-tensor kernels on CUDA."""

from __future__ import annotations

import pytest
import torch

from nereus.config import from_dict
from nereus.engines.options import EngineOptions
from nereus.engines.precision import resolve_dtype
from nereus.engines.training import TrainingEngine, adamw_kernel
from nereus.errors import ConfigError
from nereus.job.config import JobConfig, resolve_model_dtype
from nereus.models import tiny_config
from nereus.state import training_slots


def test_auto_is_bfloat16_on_gpus_and_float32_elsewhere():
    assert resolve_dtype("auto", ["cuda", "cuda"]) == "bfloat16"
    assert resolve_dtype("auto", ["cpu"]) == "float32"
    assert resolve_dtype("auto", ["cuda", "cpu"]) == "float32"  # one dtype for the job: the CPU's
    assert resolve_dtype("float32", ["cuda"]) == "float32"  # an explicit choice stands
    assert resolve_dtype("bfloat16", ["cpu"]) == "bfloat16"
    with pytest.raises(ConfigError, match="model.dtype"):
        resolve_dtype("float16", ["cuda"])
    with pytest.raises(ConfigError, match="device_kinds"):
        resolve_dtype("auto", [])


def test_a_job_config_defaults_to_auto_and_resolves_for_its_devices():
    cfg = from_dict(JobConfig, {})
    assert cfg.model.dtype == "auto"
    on_gpus = resolve_model_dtype(cfg, ["cuda"])
    assert on_gpus.model.dtype == "bfloat16" and on_gpus.model.hidden_size == cfg.model.hidden_size
    assert resolve_model_dtype(cfg, ["cpu"]).model.dtype == "float32"
    pinned = from_dict(JobConfig, {"model": {"dtype": "float32"}})
    assert resolve_model_dtype(pinned, ["cuda"]) is pinned
    with pytest.raises(ConfigError, match="model.dtype"):
        from_dict(JobConfig, {"model": {"dtype": "float16"}})


def test_bfloat16_training_keeps_float32_master_weights_and_moments():
    slots = training_slots("bfloat16")
    assert "master" in slots and {"exp_avg", "exp_avg_sq"} <= set(slots)
    assert "master" not in training_slots("float32")
    engine = TrainingEngine(
        tiny_config(num_hidden_layers=1),
        options=EngineOptions(dtype="bfloat16", name="bf16-train"),
        optim={"lr": 1e-3},
    )
    try:
        state = engine.named_state()
        masters = {k: v for k, v in state.items() if k.endswith(":master")}
        moments = {k: v for k, v in state.items() if k.endswith((":exp_avg", ":exp_avg_sq"))}
        assert masters and all(v.dtype == torch.float32 for v in masters.values())
        assert moments and all(v.dtype == torch.float32 for v in moments.values())
        params = {k: v for k, v in state.items() if ":" not in k}
        assert params and all(v.dtype == torch.bfloat16 for v in params.values())
    finally:
        engine.close()


def test_adamw_uses_the_multi_tensor_kernels_on_cuda_only():
    assert adamw_kernel(torch.device("cuda", 0)) == {"foreach": True}
    assert adamw_kernel(torch.device("cpu")) == {"foreach": False}
    engine = TrainingEngine(
        tiny_config(num_hidden_layers=1),
        options=EngineOptions(name="cpu-train"),
        optim={"lr": 1e-3},
    )
    try:
        assert engine.optimizer.defaults["foreach"] is False
    finally:
        engine.close()
