"""The job as the planner sees it: ``job_workload`` is the one place a job's config
becomes the planner's ``Workload`` (its model-stages, batch and lengths), and
``predict_memory_failure`` walks the cap schedule on a fixed plan and names the first
step the memory model says it cannot hold (what a job without adaptation runs into).

Pure: no cluster, no I/O; the online loop (``nereus.job.adapt``), the asynchronous
adapter, the benchmarks and the demo all price a job through these.

Refuses (``ConfigError``): a job with a reward model but no ``reward_config``.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.config import require
from nereus.engines.precision import resolve_dtype
from nereus.job.config import JobConfig, to_planner_plan
from nereus.models import ModelConfig
from nereus.planner import LengthStats, ModelShape, Workload, explain
from nereus.planner.cluster import local_cpu_cluster
from nereus.planner.plan import Plan
from nereus.planner.pool import DevicePool

__all__ = ["PredictedFailure", "job_workload", "planner_shape", "predict_memory_failure"]


def planner_shape(
    config: ModelConfig, dtype: str, name: str, value_head: bool = False
) -> ModelShape:
    """A ``nereus.models.ModelConfig`` as the planner's ``ModelShape``."""
    shape = ModelShape(
        name,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        vocab_size=config.vocab_size,
        intermediate_size=config.intermediate_size,
        dtype=dtype,
        tied_embeddings=bool(config.tie_word_embeddings),
    )
    return shape.as_value_model() if value_head else shape


def job_workload(
    cfg: JobConfig,
    model_config: ModelConfig,
    *,
    prompt_length: int,
    lengths: LengthStats,
    memory_lengths: LengthStats | None = None,
    reward_config: ModelConfig | None = None,
) -> Workload:
    """The planner's view of the job ``cfg`` (its model-stages, batch and lengths)."""
    a = cfg.algorithm
    # A config not yet resolved for its devices (planning outside a running job, for CPU
    # workers) is priced as what "auto" means there.
    dtype = resolve_dtype(cfg.model.dtype, ["cpu"])
    policy = planner_shape(model_config, dtype, "policy")
    models = {"policy": policy, "reference": policy}
    if a.name == "ppo":
        models["critic"] = policy.as_value_model()
    if cfg.reward.kind == "model":
        require(
            reward_config is not None,
            "reward_config",
            None,
            "must be given for a job with a reward model",
        )
        models["reward"] = planner_shape(reward_config, dtype, "reward", value_head=True)
    return Workload(
        a.name,
        models,
        a.prompts_per_step,
        a.samples_per_prompt,
        max(1, int(prompt_length)),
        lengths,
        micro_batch=min(cfg.optim.micro_batch_size, a.rollouts_per_step),
        epochs=a.epochs,
        reference=cfg.uses_reference,
        memory_lengths=memory_lengths,
    )


@dataclass(frozen=True)
class PredictedFailure:
    """The first step whose length cap the memory model says a plan cannot hold."""

    step: int
    cap: int
    device: int
    need_bytes: int
    budget_bytes: int


def predict_memory_failure(
    cfg: JobConfig,
    model_config: ModelConfig,
    plan: Plan,
    *,
    prompt_length: int,
    budget_bytes: int,
    devices: int,
    reward_config: ModelConfig | None = None,
) -> PredictedFailure | None:
    """Walk the job's cap schedule on the fixed ``plan`` (device ids, ``0..devices-1``) and
    return the first step at which the memory model (uncalibrated, no headroom: the
    device's whole budget) puts some device over ``budget_bytes``; None if every cap fits.
    This is the prediction a job without adaptation is checked against."""
    spec = local_cpu_cluster(
        devices,
        budget_bytes,
        flops_per_device=1e9,
        memory_bandwidth=1e9,
        exchange_bandwidth=1e9,
        headroom=0.0,
    )
    slots = DevicePool.of(range(devices)).to_slots(to_planner_plan(plan))
    caps = cfg.sampling.max_new_tokens
    starts = [0] if isinstance(caps, int) else [start for start, _ in caps]
    for step in starts:
        if step >= cfg.run.steps:
            break
        cap = cfg.sampling.cap_at(step)
        at_cap = LengthStats(float(cap), float(cap), cap)
        work = job_workload(
            cfg,
            model_config,
            prompt_length=prompt_length,
            lengths=at_cap,
            reward_config=reward_config,
        )
        over = explain(slots, work, spec).violations
        if over:
            worst = max(over, key=lambda m: m.total - m.usable)
            return PredictedFailure(step, cap, worst.device, worst.total, worst.usable)
    return None
