"""Model-stages as the RL step sees them, and the in-process backend.

``ModelStages`` is the async interface every algorithm step calls: ``generate``,
``reference_logprobs``, ``critic_values``, ``reward_scores``, ``train_policy``, ``train_critic``,
``sync_policy``, ``save``/``load`` (the job checkpoint), ``close``; plus the job's plan
(``plan``, ``apply_plan``), each device's memory (``memory``) and the seconds each
model-stage worked (``take_stage_seconds``). Two backends implement it:

- ``InProcessStages`` (here): one engine per model-stage inside the driver process
  (TP 1, PP 1, DP 1), each accounted on the ledger of the device its placement names,
  so model-stages that share a device share its memory budget. For tests and for
  custom pipelines that do not need workers; its plan cannot change.
- ``ClusterStages`` (``nereus.rl.cluster``): each model-stage's EMUs as actor meshes
  on an embedded local cluster, placed by the job's plan.

Promises (both backends):
- ``generate`` returns ``token_ids``, ``logprobs`` and, per row, the ``policy_version``
  of the weights that generated it (the number of weight syncs applied so far).
- ``reward_scores`` is the reward model's score of each row (its value head on the
  row's last token, as transformers' sequence classifiers pool), ``[B]`` float32.
- ``sync_policy`` copies policy-training's weights into policy-generation and bumps
  the policy version; it returns ``bytes``, ``seconds`` and ``gbps``.
- ``save(dir)`` writes every piece of logical state the stages hold (policy and critic
  parameters, AdamW moments, update counters, policy version) as safetensors plus a
  JSON manifest; ``load(dir)`` restores it in place and re-syncs generation, so the
  next step is the one the saved job would have taken.

``prepare_model`` makes the initial weights every model-stage loads: a seeded tiny
random model (with the task's character tokenizer) or a Hugging Face folder.
``reward_model`` reads the reward model's config (``[reward] path``) and checks it
speaks the policy's vocabulary.
"""

from __future__ import annotations

import abc
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nereus.config import require
from nereus.errors import ConfigError, StateError
from nereus.rl.config import JobConfig, resolve_model_dtype
from nereus.rl.vocab import Codec

__all__ = ["ModelStages", "InProcessStages", "prepare_model", "reward_model", "last_token_scores", "engine_optim"]

log = logging.getLogger("nereus.rl")


def prepare_model(cfg: JobConfig, codec: Codec | None, out_dir: str | Path) -> tuple[Any, Path, Codec]:
    """(ModelConfig, model folder, codec) of the job's initial policy.

    ``tiny``: a seeded random model sized by ``[model]`` whose vocabulary is ``codec``'s,
    written with the tokenizer to ``out_dir/model``. ``hf``: ``model.path`` as is.
    ``smollm2``: the converted SmolLM2-135M-Instruct folder (converted on first use)."""
    from nereus.models import ModelConfig, save_tiny_model

    m = cfg.model
    if m.kind == "smollm2":
        from nereus.rl.pretrained import convert_smollm2

        path = convert_smollm2(m.path or "runs/smollm2-135m-instruct")
        return ModelConfig.from_hf(path), path, codec or Codec.from_dir(path)
    if m.kind == "hf":
        path = Path(m.path)
        require((path / "config.json").is_file(), "model.path", m.path, "must be a folder with config.json")
        return ModelConfig.from_hf(path), path, codec or Codec.from_dir(path)
    require(codec is not None, "codec", None, "is required for a tiny model (its vocabulary sizes the model)")
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
    from nereus.models import ModelConfig

    path = Path(cfg.reward.path)
    require((path / "config.json").is_file(), "reward.path", cfg.reward.path, "must be a folder with config.json")
    config = ModelConfig.from_hf(path)
    require(config.vocab_size == policy_config.vocab_size, "reward.path", cfg.reward.path,
            f"must hold a model over the policy's vocabulary (vocab_size={policy_config.vocab_size}), not {config.vocab_size}")
    return config, path


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's value at its last attended token (right padding)."""
    last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
    return values.float().gather(1, last.unsqueeze(1)).squeeze(1)


def engine_optim(cfg: JobConfig, critic: bool = False) -> dict[str, Any]:
    o = cfg.optim
    return {
        "lr": o.critic_lr if critic else o.lr,
        "beta1": o.beta1,
        "beta2": o.beta2,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.grad_clip,
    }


class ModelStages(abc.ABC):
    """The model-stages of one job (see the module docstring)."""

    policy_version: int = 0
    # the job's position in its global sample order, carried by every transition
    sample_position: int = 0

    def __init__(self) -> None:
        self._stage_seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Adds the seconds spent in the block to ``stage``'s account."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._stage_seconds[stage] = self._stage_seconds.get(stage, 0.0) + time.perf_counter() - t0

    def take_stage_seconds(self) -> dict[str, float]:
        """Seconds each model-stage worked since the last call (and start a new account)."""
        out, self._stage_seconds = self._stage_seconds, {}
        return out

    @property
    @abc.abstractmethod
    def plan(self) -> Any:
        """The job's placement now: a ``nereus.planner.Plan`` under the job's names."""

    @abc.abstractmethod
    async def apply_plan(self, target: Any, *, overlap: bool = False) -> dict[str, Any]:
        """Change the placement to ``target`` at a step boundary; returns a report."""

    @abc.abstractmethod
    async def memory(self) -> dict[int, dict[str, Any]]:
        """Per device: budget, used and peak bytes and who holds them."""

    async def memory_peaks(self, reset: bool = True) -> dict[int, int]:
        """Each device's ledger high-water mark since the last reset (then reset it)."""
        out = {d: int(r["peak_bytes"]) for d, r in (await self.memory()).items()}
        if reset:
            for ledger in getattr(self, "ledgers", {}).values():
                ledger.reset_peak()
        return out

    @abc.abstractmethod
    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    async def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    async def reward_scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @abc.abstractmethod
    async def train_policy(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]: ...

    @abc.abstractmethod
    async def train_critic(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]: ...

    @abc.abstractmethod
    async def sync_policy(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def save(self, folder: str | Path) -> None: ...

    @abc.abstractmethod
    async def load(self, folder: str | Path) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


def write_state(folder: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """``name.safetensors`` (contiguous copies) and ``name.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(folder / f"{name}.safetensors"))
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
        from nereus.engines.generation import GenerationEngine
        from nereus.engines.inference import InferenceEngine
        from nereus.engines.memory import MemoryLedger
        from nereus.engines.training import TrainingEngine

        for name, p in cfg.plan.items():
            require(p.tp == p.pp == p.dp == 1, f"plan.{name}", f"tp={p.tp} pp={p.pp} dp={p.dp}", "must be 1 x 1 x 1 with cluster.mode='in_process'")
        cfg = self.cfg = resolve_model_dtype(cfg, ["cpu"])  # in the driver: on its CPU
        budget = cfg.cluster.memory_bytes
        ledgers: dict[int, MemoryLedger] = {}

        def ledger(stage: str) -> MemoryLedger:
            device = cfg.plan[stage].devices[0]
            if device not in ledgers:
                ledgers[device] = MemoryLedger(device, budget)
            return ledgers[device]

        self.ledgers = ledgers
        common = {"model_dir": model_dir, "dtype": cfg.model.dtype}
        mbs = cfg.optim.micro_batch_size
        self.generation = GenerationEngine(model_config, ledger=ledger("policy_generation"), name="policy_generation", **common)
        self.policy = TrainingEngine(model_config, optim=engine_optim(cfg), ledger=ledger("policy_training"), name="policy_training", **common)
        self.reference = None
        if "reference_inference" in cfg.plan:
            self.reference = InferenceEngine(model_config, micro_batch_size=mbs, ledger=ledger("reference_inference"), name="reference_inference", **common)
        self.critic = self.critic_inference = None
        if "critic_training" in cfg.plan:
            self.critic = TrainingEngine(model_config, optim=engine_optim(cfg, critic=True), critic=True, ledger=ledger("critic_training"), name="critic_training", **common)
            self.critic_inference = InferenceEngine(model_config, value_head=True, micro_batch_size=mbs, ledger=ledger("critic_inference"), name="critic_inference", **common)
            self._sync_critic()
        self.reward = None
        if "reward_inference" in cfg.plan:
            rm_config, rm_dir = reward_model(cfg, model_config)
            self.reward = InferenceEngine(rm_config, model_dir=rm_dir, dtype=cfg.model.dtype, value_head=True, micro_batch_size=mbs,
                                          ledger=ledger("reward_inference"), name="reward_inference")
        self.policy_version = 0

    def _sync_critic(self) -> None:
        assert self.critic is not None and self.critic_inference is not None
        self.critic_inference.load_named(self.critic.named_weights())

    @property
    def plan(self) -> Any:
        return self.cfg.job_plan()

    async def apply_plan(self, target: Any, *, overlap: bool = False) -> dict[str, Any]:
        raise ConfigError("cluster.mode='in_process' runs every model-stage in the driver at one fixed "
                          "layout; its plan cannot change (use cluster.mode='local')")

    async def memory(self) -> dict[int, dict[str, Any]]:
        return {d: ledger.report() for d, ledger in self.ledgers.items()}

    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
        with self.timed("policy_generation"):
            out = self.generation.generate(prompts, params)
        return {"token_ids": out.token_ids, "logprobs": out.logprobs, "policy_version": [self.policy_version] * len(prompts)}

    async def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        require(self.reference is not None, "plan", sorted(self.cfg.plan), "must place reference_inference to compute KL")
        assert self.reference is not None
        with self.timed("reference_inference"):
            return self.reference.logprobs(batch, temperature=self.cfg.sampling.temperature)

    async def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        require(self.critic_inference is not None, "plan", sorted(self.cfg.plan), "must place critic_inference for values")
        assert self.critic_inference is not None
        with self.timed("critic_inference"):
            return self.critic_inference.values(batch)

    async def reward_scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        require(self.reward is not None, "plan", sorted(self.cfg.plan), "must place reward_inference for reward.kind='model'")
        assert self.reward is not None
        with self.timed("reward_inference"):
            return last_token_scores(self.reward.values(batch), batch["attention_mask"])

    async def train_policy(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        with self.timed("policy_training"):
            return self.policy.train_step(batch, loss=loss, loss_kwargs=loss_kwargs, micro_batch_size=self.cfg.optim.micro_batch_size,
                                          temperature=self.cfg.sampling.temperature)

    async def train_critic(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        assert self.critic is not None
        with self.timed("critic_training"):
            metrics = self.critic.train_step(batch, loss=loss, loss_kwargs=loss_kwargs, micro_batch_size=self.cfg.optim.micro_batch_size)
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
        write_state(out, "policy_training", self.policy.named_state(), {"step": self.policy.step, "policy_version": self.policy_version})
        if self.critic is not None:
            write_state(out, "critic_training", self.critic.named_state(), {"step": self.critic.step})

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
        for engine in (self.generation, self.policy, self.reference, self.critic, self.critic_inference, self.reward):
            if engine is not None:
                engine.close()
