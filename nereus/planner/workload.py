"""What the planner plans for: the models, the algorithm's model-stages, the batch and lengths.

Promises:
- ``ModelShape`` is the arithmetic of a Llama/Qwen2-style decoder (parameter counts per
  layer, embedding, head, KV-cache bytes per token) from its config numbers; a critic or
  reward model is the same trunk with a scalar value head (``as_value_model``).
- ``algorithm_stages(name, reward_model)`` lists the model-stages of PPO, GRPO or ReMax
  and what each depends on; ``phases`` groups them by dependency level. The step loop
  runs level by level, so model-stages of one level may overlap and levels never do.
- ``Workload`` validates the batch rules: prompts x samples sequences per step, split
  into optimizer steps of ``global_batch`` sequences and micro-batches of
  ``micro_batch`` sequences; length statistics ordered mean <= p95 <= max.

Refuses (``ConfigError``): shapes that do not divide (heads by kv heads, hidden by
heads), unknown algorithms or model presets, missing models for the algorithm's
model-stages, a global batch that does not divide the step's sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from nereus.config import require
from nereus.errors import ConfigError

__all__ = [
    "ModelShape",
    "MODEL_PRESETS",
    "model_preset",
    "StageKind",
    "ModelStage",
    "ALGORITHMS",
    "algorithm_stages",
    "phases",
    "LengthStats",
    "Workload",
]

StageKind = Literal["generation", "inference", "training"]
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """Config numbers of one decoder model (weights in ``dtype``)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate_size: int
    dtype: str = "bfloat16"
    tied_embeddings: bool = False
    value_head: bool = False

    def __post_init__(self) -> None:
        for f in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "vocab_size",
            "intermediate_size",
        ):
            v = getattr(self, f)
            require(
                isinstance(v, int) and v >= 1,
                f"ModelShape({self.name}).{f}",
                v,
                "must be an integer >= 1",
            )
        require(
            self.hidden_size % self.num_heads == 0,
            f"ModelShape({self.name}).num_heads",
            self.num_heads,
            f"must divide hidden_size={self.hidden_size}",
        )
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"ModelShape({self.name}).num_kv_heads",
            self.num_kv_heads,
            f"must divide num_heads={self.num_heads}",
        )
        require(
            self.dtype in _DTYPE_BYTES,
            f"ModelShape({self.name}).dtype",
            self.dtype,
            f"must be one of {sorted(_DTYPE_BYTES)}",
        )

    @property
    def bytes_per_param(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @cached_property
    def layer_params(self) -> int:
        """Attention (q, k, v, o) + SwiGLU MLP (gate, up, down) + two norms."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h

    @cached_property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @cached_property
    def head_params(self) -> int:
        """Final norm + LM head (or the scalar value head of a critic/reward model)."""
        if self.value_head:
            return self.hidden_size + self.hidden_size
        return self.hidden_size + (
            0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        )

    @property
    def output_width(self) -> int:
        """Logits per token: the vocabulary, or 1 for a value head."""
        return 1 if self.value_head else self.vocab_size

    @cached_property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embed_params + self.head_params

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def as_value_model(self) -> ModelShape:
        """The same trunk with a scalar head: a critic or reward model."""
        return dataclasses.replace(
            self, name=f"{self.name}-value", value_head=True, tied_embeddings=False
        )


MODEL_PRESETS: dict[str, ModelShape] = {
    "llama-1b": ModelShape("llama-1b", 2048, 16, 32, 8, 128256, 8192, tied_embeddings=True),
    "llama-8b": ModelShape("llama-8b", 4096, 32, 32, 8, 128256, 14336),
    "llama-70b": ModelShape("llama-70b", 8192, 80, 64, 8, 128256, 28672),
    "qwen2-7b": ModelShape("qwen2-7b", 3584, 28, 28, 4, 152064, 18944),
    # The size the CPU tests and examples run for real.
    "tiny": ModelShape("tiny", 256, 4, 8, 4, 4096, 688, dtype="float32", tied_embeddings=True),
}


def model_preset(name: str) -> ModelShape:
    if name not in MODEL_PRESETS:
        raise ConfigError(
            f"model={name!r} is not a known preset; expected one of {sorted(MODEL_PRESETS)}"
        )
    return MODEL_PRESETS[name]


@dataclass(frozen=True)
class ModelStage:
    """One model in one stage, and the model-stages whose outputs it needs."""

    name: str
    model: str
    kind: StageKind
    deps: tuple[str, ...] = ()


def _ppo(reward_model: bool, reference: bool) -> tuple[ModelStage, ...]:
    gen = "policy-generation"
    scorers = (["reference-inference"] if reference else []) + ["critic-inference"]
    scorers += ["reward-inference"] if reward_model else []
    out = [ModelStage(gen, "policy", "generation")]
    out += [ModelStage(s, s.split("-")[0], "inference", (gen,)) for s in scorers]
    out.append(ModelStage("policy-training", "policy", "training", tuple(scorers)))
    critic_deps = tuple(s for s in scorers if s != "reference-inference")
    out.append(ModelStage("critic-training", "critic", "training", critic_deps))
    return tuple(out)


def _critic_free(reward_model: bool, reference: bool) -> tuple[ModelStage, ...]:
    gen = "policy-generation"
    scorers = (["reference-inference"] if reference else []) + (
        ["reward-inference"] if reward_model else []
    )
    out = [ModelStage(gen, "policy", "generation")]
    out += [ModelStage(s, s.split("-")[0], "inference", (gen,)) for s in scorers]
    # training always waits for the rollouts, scored or not
    out.append(ModelStage("policy-training", "policy", "training", tuple(scorers) or (gen,)))
    return tuple(out)


ALGORITHMS = ("ppo", "grpo", "remax")


def algorithm_stages(
    algorithm: str, reward_model: bool, reference: bool = True
) -> tuple[ModelStage, ...]:
    """The model-stages of ``algorithm`` in dependency order.

    ``reward_model`` adds reward-inference (PPO always scores with some reward; without
    a reward model the reward is a rule evaluated on the controller, which costs no
    device time); ``reference=False`` leaves reference-inference out (no KL term)."""
    if algorithm == "ppo":
        return _ppo(reward_model, reference)
    if algorithm in ("grpo", "remax"):
        return _critic_free(reward_model, reference)
    raise ConfigError(f"algorithm={algorithm!r} is not known; expected one of {list(ALGORITHMS)}")


def phases(stages: tuple[ModelStage, ...]) -> tuple[int, ...]:
    """Dependency level of each model-stage (0 for those with no deps)."""
    level: dict[str, int] = {}
    for s in stages:
        missing = [d for d in s.deps if d not in level]
        if missing:
            raise ConfigError(
                f"model-stage {s.name!r} depends on {missing}, which are not listed before it"
            )
        level[s.name] = 1 + max((level[d] for d in s.deps), default=-1)
    return tuple(level[s.name] for s in stages)


@dataclass(frozen=True)
class LengthStats:
    """Response lengths in tokens observed recently (mean, 95th percentile, maximum)."""

    mean: float
    p95: float
    max: int

    def __post_init__(self) -> None:
        require(self.mean >= 1, "LengthStats.mean", self.mean, "must be >= 1 token")
        require(self.mean <= self.p95, "LengthStats.p95", self.p95, f"must be >= mean={self.mean}")
        require(self.p95 <= self.max, "LengthStats.max", self.max, f"must be >= p95={self.p95}")


@dataclass(frozen=True)
class Workload:
    """One RL job as the planner sees it.

    ``models`` maps a role (policy, reference, critic, reward) to its shape. ``global_batch``
    is sequences per optimizer step (None: the whole step's sequences, one update);
    ``micro_batch`` is sequences per forward/backward pass on one replica."""

    algorithm: str
    models: dict[str, ModelShape]
    prompts_per_step: int
    samples_per_prompt: int
    prompt_length: int
    lengths: LengthStats
    global_batch: int | None = None
    micro_batch: int = 1
    epochs: int = 1
    reference: bool = True  # a reference model (a KL term): reference-inference runs
    # the lengths memory is checked at (e.g. the next step's cap: any response may reach
    # it); None: ``lengths``
    memory_lengths: LengthStats | None = None
    stages: tuple[ModelStage, ...] = field(init=False)

    def __post_init__(self) -> None:
        require(
            self.algorithm in ALGORITHMS,
            "Workload.algorithm",
            self.algorithm,
            f"must be one of {list(ALGORITHMS)}",
        )
        for f in (
            "prompts_per_step",
            "samples_per_prompt",
            "prompt_length",
            "micro_batch",
            "epochs",
        ):
            v = getattr(self, f)
            require(isinstance(v, int) and v >= 1, f"Workload.{f}", v, "must be an integer >= 1")
        stages = algorithm_stages(self.algorithm, "reward" in self.models, self.reference)
        object.__setattr__(self, "stages", stages)
        needed = sorted({s.model for s in stages})
        missing = [m for m in needed if m not in self.models]
        require(
            not missing,
            "Workload.models",
            sorted(self.models),
            f"lacks {missing} needed by {self.algorithm}",
        )
        gb = self.global_batch
        if gb is not None:
            require(
                gb >= 1 and self.sequences % gb == 0,
                "Workload.global_batch",
                gb,
                f"must divide the step's sequences={self.sequences}",
            )

    @cached_property
    def sequences(self) -> int:
        """Sequences generated per step (ReMax adds one greedy baseline per prompt)."""
        extra = self.prompts_per_step if self.algorithm == "remax" else 0
        return self.prompts_per_step * self.samples_per_prompt + extra

    @cached_property
    def batch(self) -> int:
        """Sequences per optimizer step: the batch every DP degree must divide."""
        return self.global_batch if self.global_batch is not None else self.sequences

    @cached_property
    def optimizer_steps(self) -> int:
        return self.epochs * (self.sequences // self.batch)

    @property
    def lengths_for_memory(self) -> LengthStats:
        """The lengths the memory model uses (``memory_lengths``, else ``lengths``)."""
        return self.memory_lengths if self.memory_lengths is not None else self.lengths

    def with_lengths(
        self, lengths: LengthStats, memory_lengths: LengthStats | None = None
    ) -> Workload:
        """The same job after its response lengths drifted (memory checked at
        ``memory_lengths`` when given, else at ``lengths``)."""
        return dataclasses.replace(self, lengths=lengths, memory_lengths=memory_lengths)

    @staticmethod
    def for_models(
        algorithm: str,
        policy: ModelShape,
        *,
        prompts_per_step: int,
        samples_per_prompt: int,
        prompt_length: int,
        lengths: LengthStats,
        value: ModelShape | None = None,
        reward_model: bool = True,
        **kw: int,
    ) -> Workload:
        """A workload whose reference shares the policy's shape and whose critic and
        reward share ``value`` (default: the policy's trunk with a value head)."""
        value = value or policy.as_value_model()
        models = {"policy": policy, "reference": policy}
        if algorithm == "ppo":
            models["critic"] = value
        if reward_model:
            models["reward"] = value
        return Workload(
            algorithm, models, prompts_per_step, samples_per_prompt, prompt_length, lengths, **kw
        )
