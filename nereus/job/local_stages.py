"""The in-process backend of ``ModelStages`` and the job's initial weights.

- ``InProcessStages``: one engine per model-stage inside the driver process (TP 1,
  PP 1, DP 1), each accounted on the ledger of the device its placement names, so
  model-stages that share a device share its memory budget. For tests and for custom
  pipelines that do not need workers; its plan cannot change.
- ``prepare_model`` makes the initial weights every model-stage loads: a seeded tiny
  random model (with the task's character tokenizer) or a Hugging Face folder.
- ``reward_model`` reads the reward model's config (``[reward] path``) and checks it
  speaks the policy's vocabulary.

The promises every backend keeps are ``nereus.rl.stages``'.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nereus.config import require
from nereus.data.pretrained import convert_smollm2
from nereus.data.vocab import Codec
from nereus.engines.generation import GenerationEngine
from nereus.engines.inference import InferenceEngine
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.engines.training import TrainingEngine
from nereus.errors import ConfigError, StateError
from nereus.job.config import JobConfig, resolve_model_dtype
from nereus.models import ModelConfig, save_tiny_model
from nereus.rl.stages import ModelStages, last_token_scores

__all__ = ["InProcessStages", "prepare_model", "reward_model"]

log = logging.getLogger("nereus.rl")


def prepare_model(
    cfg: JobConfig, codec: Codec | None, out_dir: str | Path
) -> tuple[Any, Path, Codec]:
    """(ModelConfig, model folder, codec) of the job's initial policy.

    ``tiny``: a seeded random model sized by ``[model]`` whose vocabulary is ``codec``'s,
    written with the tokenizer to ``out_dir/model``. ``hf``: ``model.path`` as is.
    ``smollm2``: the converted SmolLM2-135M-Instruct folder (converted on first use)."""
    m = cfg.model
    if m.kind == "smollm2":
        path = convert_smollm2(m.path or "runs/smollm2-135m-instruct")
        return ModelConfig.from_hf(path), path, codec or Codec.from_dir(path)
    if m.kind == "hf":
        path = Path(m.path)
        require(
            (path / "config.json").is_file(),
            "model.path",
            m.path,
            "must be a folder with config.json",
        )
        return ModelConfig.from_hf(path), path, codec or Codec.from_dir(path)
    require(
        codec is not None,
        "codec",
        None,
        "is required for a tiny model (its vocabulary sizes the model)",
    )
    assert codec is not None
    config = ModelConfig(
        vocab_size=codec.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_seq_len,
        tie_word_embeddings=False,
        torch_dtype="float32" if m.dtype == "auto" else m.dtype,  # the stages cast on load
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
    )
    folder = Path(out_dir) / "model"
    save_tiny_model(folder, config, seed=cfg.run.seed)
    codec.save(folder)
    return config, folder, codec


def reward_model(cfg: JobConfig, policy_config: Any) -> tuple[Any, Path]:
    """(ModelConfig, folder) of the job's reward model (``reward.kind == "model"``)."""
    path = Path(cfg.reward.path)
    require(
        (path / "config.json").is_file(),
        "reward.path",
        cfg.reward.path,
        "must be a folder with config.json",
    )
    config = ModelConfig.from_hf(path)
    require(
        config.vocab_size == policy_config.vocab_size,
        "reward.path",
        cfg.reward.path,
        "must hold a model over the policy's vocabulary "
        f"(vocab_size={policy_config.vocab_size}), not {config.vocab_size}",
    )
    return config, path


def write_state(
    folder: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """``name.safetensors`` (contiguous copies) and ``name.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in tensors.items()},
        str(folder / f"{name}.safetensors"),
    )
    (folder / f"{name}.json").write_text(json.dumps(meta))


def read_state(folder: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    file = folder / f"{name}.safetensors"
    if not file.is_file():
        raise StateError(f"checkpoint {str(folder)!r} has no {file.name}")
    return load_file(str(file)), json.loads((folder / f"{name}.json").read_text())


class InProcessStages(ModelStages):
    """Every model-stage as one engine in this process (see the module docstring)."""

    def __init__(self, cfg: JobConfig, model_config: Any, model_dir: str | Path) -> None:
        super().__init__()

        for name, p in cfg.plan.items():
            require(
                p.tp == p.pp == p.dp == 1,
                f"plan.{name}",
                f"tp={p.tp} pp={p.pp} dp={p.dp}",
                "must be 1 x 1 x 1 with cluster.mode='in_process'",
            )
        cfg = self.cfg = resolve_model_dtype(cfg, ["cpu"])  # in the driver: on its CPU
        budget = cfg.cluster.memory_bytes
        ledgers: dict[int, MemoryLedger] = {}

        def ledger(stage: str) -> MemoryLedger:
            device = cfg.plan[stage].devices[0]
            if device not in ledgers:
                ledgers[device] = MemoryLedger(device, budget)
            return ledgers[device]

        self.ledgers = ledgers

        def options(stage: str, folder: str | Path = model_dir) -> EngineOptions:
            return EngineOptions(
                model_dir=folder, dtype=cfg.model.dtype, ledger=ledger(stage), name=stage
            )

        mbs = cfg.optim.micro_batch_size
        self.generation = GenerationEngine(model_config, options=options("policy_generation"))
        self.policy = TrainingEngine(
            model_config, options=options("policy_training"), optim=cfg.optim.for_engine()
        )
        self.reference = None
        if "reference_inference" in cfg.plan:
            self.reference = InferenceEngine(
                model_config, options=options("reference_inference"), micro_batch_size=mbs
            )
        self.critic = self.critic_inference = None
        if "critic_training" in cfg.plan:
            self.critic = TrainingEngine(
                model_config,
                options=options("critic_training"),
                optim=cfg.optim.for_engine(critic=True),
                critic=True,
            )
            self.critic_inference = InferenceEngine(
                model_config,
                options=options("critic_inference"),
                value_head=True,
                micro_batch_size=mbs,
            )
            self._sync_critic()
        self.reward = None
        if "reward_inference" in cfg.plan:
            rm_config, rm_dir = reward_model(cfg, model_config)
            self.reward = InferenceEngine(
                rm_config,
                options=options("reward_inference", rm_dir),
                value_head=True,
                micro_batch_size=mbs,
            )
        self.policy_version = 0

    def _sync_critic(self) -> None:
        assert self.critic is not None and self.critic_inference is not None
        self.critic_inference.load_named(self.critic.named_weights())

    @property
    def plan(self) -> Any:
        return self.cfg.job_plan()

    async def apply_plan(self, target: Any, *, overlap: bool | str = False) -> dict[str, Any]:
        raise ConfigError(
            "cluster.mode='in_process' runs every model-stage in the driver at one fixed "
            "layout; its plan cannot change (use cluster.mode='local')"
        )

    async def memory(self) -> dict[int, dict[str, Any]]:
        return {d: ledger.report() for d, ledger in self.ledgers.items()}

    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
        with self.timed("policy_generation"):
            out = self.generation.generate(prompts, params)
        return {
            "token_ids": out.token_ids,
            "logprobs": out.logprobs,
            "policy_version": [self.policy_version] * len(prompts),
        }

    async def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        require(
            self.reference is not None,
            "plan",
            sorted(self.cfg.plan),
            "must place reference_inference to compute KL",
        )
        assert self.reference is not None
        with self.timed("reference_inference"):
            return self.reference.logprobs(batch, temperature=self.cfg.sampling.temperature)

    async def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        require(
            self.critic_inference is not None,
            "plan",
            sorted(self.cfg.plan),
            "must place critic_inference for values",
        )
        assert self.critic_inference is not None
        with self.timed("critic_inference"):
            return self.critic_inference.values(batch)

    async def reward_scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        require(
            self.reward is not None,
            "plan",
            sorted(self.cfg.plan),
            "must place reward_inference for reward.kind='model'",
        )
        assert self.reward is not None
        with self.timed("reward_inference"):
            return last_token_scores(self.reward.values(batch), batch["attention_mask"])

    async def train_policy(
        self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        with self.timed("policy_training"):
            return self.policy.train_step(
                batch,
                loss=loss,
                loss_kwargs=loss_kwargs,
                micro_batch_size=self.cfg.optim.micro_batch_size,
                temperature=self.cfg.sampling.temperature,
            )

    async def train_critic(
        self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        assert self.critic is not None
        with self.timed("critic_training"):
            metrics = self.critic.train_step(
                batch,
                loss=loss,
                loss_kwargs=loss_kwargs,
                micro_batch_size=self.cfg.optim.micro_batch_size,
            )
            self._sync_critic()
        return {f"critic_{k}" if not k.startswith("value") else k: v for k, v in metrics.items()}

    async def sync_policy(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        nbytes = self.generation.load_named(self.policy.named_weights())
        seconds = time.perf_counter() - t0
        self.policy_version += 1
        return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / 1e9}

    async def save(self, folder: str | Path) -> None:
        out = Path(folder)
        write_state(
            out,
            "policy_training",
            self.policy.named_state(),
            {"step": self.policy.step, "policy_version": self.policy_version},
        )
        if self.critic is not None:
            write_state(
                out, "critic_training", self.critic.named_state(), {"step": self.critic.step}
            )

    async def load(self, folder: str | Path) -> None:
        src = Path(folder)
        tensors, meta = read_state(src, "policy_training")
        self.policy.load_named_state(tensors, step=int(meta["step"]))
        if self.critic is not None:
            tensors, cmeta = read_state(src, "critic_training")
            self.critic.load_named_state(tensors, step=int(cmeta["step"]))
            self._sync_critic()
        self.generation.load_named(self.policy.named_weights())
        self.policy_version = int(meta["policy_version"])

    async def close(self) -> None:
        for engine in (
            self.generation,
            self.policy,
            self.reference,
            self.critic,
            self.critic_inference,
            self.reward,
        ):
            if engine is not None:
                engine.close()
