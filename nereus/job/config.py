"""The configuration of an RL job, one-to-one with its TOML file.

``JobConfig`` is a tree of dataclasses validated in ``__post_init__``; build it with
``nereus.config.load_toml(JobConfig, path)`` or ``from_dict``. An unknown key, a value
of the wrong type or out of range raises ``ConfigError`` naming the dotted field, the
value and the rule (``algorithm.samples_per_prompt=1 must be >= 2 for grpo``).

Tables: ``[model]`` (a tiny random model or a Hugging Face folder), ``[task]`` (a
synthetic task) or ``[data]`` (prompts and ground truth from a file), ``[algorithm]`` (grpo, ppo or
remax and their coefficients), ``[reward]`` (the task's rule or a reward model), ``[sampling]``,
``[optim]``, ``[cluster]`` (local devices and their memory budget), ``[plan]`` (the
placement each model-stage starts from, as EMUs on devices), ``[adapt]`` (whether and
how the job changes that placement while it runs), ``[rl]`` (sync or async mode,
``nereus.rl.mode``) and ``[run]`` (steps, seed, output
directory, checkpoints, loggers, export).

Model-stages: ``policy_generation``, ``reference_inference``, ``critic_inference``,
``reward_inference``, ``policy_training``, ``critic_training``. Which ones a job needs
follows from the algorithm and the reward (``required_stages``); a plan entry for a
model-stage the job does not use is refused, and so is a missing one.

The tables this package owns are dataclasses of ``nereus.job.sections`` (re-exported
here); this module holds ``JobConfig`` and the checks that span tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.config import require
from nereus.data.filedata import DataConfig
from nereus.engines.training import OptimConfig
from nereus.job.sections import (
    LOGGERS,
    MODEL_STAGES,
    AdaptConfig,
    ClusterConfig,
    ModelConfigSection,
    Placement,
    RewardConfig,
    RunConfig,
    TaskConfig,
    TraceConfig,
    TrainingConfig,
)
from nereus.planner.plan import Plan
from nereus.rl.algorithms import AlgorithmConfig
from nereus.rl.mode import RLModeConfig
from nereus.rl.rollout import SamplingConfig

__all__ = [
    "LOGGERS",
    "MODEL_STAGES",
    "ModelConfigSection",
    "TaskConfig",
    "DataConfig",
    "AlgorithmConfig",
    "RewardConfig",
    "SamplingConfig",
    "OptimConfig",
    "TrainingConfig",
    "ClusterConfig",
    "AdaptConfig",
    "TraceConfig",
    "Placement",
    "RunConfig",
    "JobConfig",
    "PLANNER_NAMES",
    "from_planner_plan",
    "required_stages",
    "resolve_model_dtype",
    "to_planner_plan",
]


def required_stages(algorithm: str, reward: str = "rule") -> tuple[str, ...]:
    """The model-stages an algorithm needs (rule rewards need no reward model)."""
    if algorithm == "ppo":
        stages = (
            "policy_generation",
            "reference_inference",
            "critic_inference",
            "policy_training",
            "critic_training",
        )
    else:
        stages = ("policy_generation", "reference_inference", "policy_training")
    return (*stages, "reward_inference") if reward == "model" else stages


def _default_plan() -> dict[str, Placement]:
    return {
        "policy_generation": Placement(devices=[0, 1, 2, 3], dp=4),
        "reference_inference": Placement(devices=[2]),
        "policy_training": Placement(devices=[0]),
    }


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfigSection = field(default_factory=ModelConfigSection)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig | None = None
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    optim: TrainingConfig = field(default_factory=TrainingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: dict[str, Placement] = field(default_factory=_default_plan)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    run: RunConfig = field(default_factory=RunConfig)
    rl: RLModeConfig = field(default_factory=RLModeConfig)

    def __post_init__(self) -> None:
        if self.data is not None:
            require(
                self.task == TaskConfig(),
                "task",
                self.task,
                "must be left out when [data] is given (the prompts come from data.path)",
            )
            require(
                self.model.kind != "tiny",
                "model.kind",
                self.model.kind,
                "must be 'hf' or 'smollm2' with [data] (file prompts need the model's own "
                "tokenizer; 'tiny' has a character vocabulary)",
            )
            require(
                self.reward.rule != "task",
                "reward.rule",
                self.reward.rule,
                "must be 'math', 'exact' or 'module:function' with [data] (file rows carry "
                "no task rule)",
            )
        else:
            require(
                self.reward.rule == "task",
                "reward.rule",
                self.reward.rule,
                "must be 'task' for a synthetic task (other rules score file data: give [data])",
            )
        needed = required_stages(self.algorithm.name, self.reward.kind)
        for name in self.plan:
            require(
                name in needed,
                "plan",
                sorted(self.plan),
                f"places {name!r}, which {self.algorithm.name} with "
                f"reward.kind={self.reward.kind!r} does not use (it uses {list(needed)})",
            )
        for name in needed:
            if name == "reference_inference" and self.algorithm.kl_coef == 0:
                continue  # no KL term: the reference is never asked
            require(
                name in self.plan, "plan", sorted(self.plan), f"must place model-stage {name!r}"
            )
        for name, p in self.plan.items():
            bad = [d for d in p.devices if not 0 <= d < self.cluster.devices]
            require(
                not bad,
                f"plan.{name}.devices",
                p.devices,
                f"must be in [0, cluster.devices={self.cluster.devices})",
            )
            heads = self.model.num_heads
            if (
                self.model.kind == "tiny" and name != "reward_inference"
            ):  # the reward model has its own shape
                require(
                    heads % p.tp == 0,
                    f"plan.{name}.tp",
                    p.tp,
                    f"must divide model.num_heads={heads}",
                )
                require(
                    self.model.num_layers >= p.pp,
                    f"plan.{name}.pp",
                    p.pp,
                    f"must be <= model.num_layers={self.model.num_layers}",
                )
        require(
            self.trace.lengths is None or isinstance(self.sampling.max_new_tokens, int),
            "trace.lengths",
            self.trace.lengths,
            "needs sampling.max_new_tokens as one number (the cap the trace is scaled to)",
        )
        require(
            self.trace.pool is None or self.cluster.mode == "local",
            "trace.pool",
            self.trace.pool,
            "needs cluster.mode = 'local' (the trace adds nodes to the job's own cluster)",
        )
        if self.trace.pool is not None and self.trace.pool_range is not None:
            require(
                self.trace.pool_range[1] <= self.cluster.devices,
                "trace.pool_range",
                self.trace.pool_range,
                f"must not exceed cluster.devices={self.cluster.devices}",
            )
        require(
            not self.adapt.enabled or self.cluster.mode != "in_process",
            "adapt.enabled",
            self.adapt.enabled,
            "needs cluster.mode 'local' or 'connect' (in_process has one device and no plan "
            "to change)",
        )
        gen = self.plan["policy_generation"]
        if self.sampling.engine == "vllm":
            require(
                self.cluster.mode != "in_process",
                "sampling.engine",
                self.sampling.engine,
                "needs cluster.mode 'local' or 'connect' (vLLM runs in the workers that hold "
                "the generation EMUs)",
            )
            require(
                gen.pp == 1,
                "plan.policy_generation.pp",
                gen.pp,
                "must be 1 with sampling.engine='vllm' (vLLM runs TP only)",
            )
        if self.rl.is_async:
            self._check_async()
        require(
            self.algorithm.prompts_per_step % gen.dp == 0,
            "plan.policy_generation.dp",
            gen.dp,
            f"must divide algorithm.prompts_per_step={self.algorithm.prompts_per_step}",
        )

    def _check_async(self) -> None:
        """``[rl] mode = "async"``: GRPO, ReMax or PPO on a cluster, rule rewards, generation
        on devices of its own (PPO's critic and the reference live on the training side);
        on vLLM, whole requests (no partial rollouts, no refill)."""
        require(
            self.reward.kind == "rule",
            "reward.kind",
            self.reward.kind,
            "must be 'rule' in async mode (entries are scored by the rule when generated)",
        )
        require(
            self.cluster.mode != "in_process",
            "rl.mode",
            self.rl.mode,
            "needs cluster.mode 'local' or 'connect' (generation runs on devices of its own)",
        )
        if self.sampling.engine == "vllm":
            # vLLM runs a request whole: weights change only between requests, and no done
            # slot takes a new row
            require(
                not self.rl.partial_rollout,
                "rl.partial_rollout",
                self.rl.partial_rollout,
                "must be false with sampling.engine='vllm' (vLLM runs a request whole)",
            )
            require(
                not self.rl.refill,
                "rl.refill",
                self.rl.refill,
                "must be false with sampling.engine='vllm' (vLLM runs a request whole)",
            )
        gen = set(self.plan["policy_generation"].devices)
        shared = sorted(
            gen & {d for n, p in self.plan.items() if n != "policy_generation" for d in p.devices}
        )
        require(
            not shared,
            "plan.policy_generation.devices",
            sorted(gen),
            f"must not share devices {shared} with another model-stage in async mode",
        )

    @property
    def uses_reference(self) -> bool:
        return self.algorithm.kl_coef > 0

    def job_plan(self):
        """The ``[plan]`` tables as the planner's ``Plan`` (model-stages in
        ``MODEL_STAGES`` order, under the job's names)."""
        return Plan(
            tuple(
                (name, self.plan[name].stage_plan()) for name in MODEL_STAGES if name in self.plan
            )
        )


# The job's model-stage names and the planner's, mapped in this one place.
PLANNER_NAMES: dict[str, str] = {name: name.replace("_", "-") for name in MODEL_STAGES}


def to_planner_plan(plan):
    """A plan under the job's model-stage names, renamed for the planner."""
    return Plan(tuple((PLANNER_NAMES[n], sp) for n, sp in plan))


def from_planner_plan(plan):
    """A planner's plan, renamed to the job's model-stage names."""
    back = {v: k for k, v in PLANNER_NAMES.items()}
    unknown = [n for n, _ in plan if n not in back]
    require(not unknown, "plan", unknown, f"must name model-stages among {sorted(back)}")
    return Plan(tuple((back[n], sp) for n, sp in plan))


def resolve_model_dtype(cfg: JobConfig, device_kinds: list[str]) -> JobConfig:
    """``cfg`` with ``model.dtype`` resolved for devices of ``device_kinds`` (``auto``:
    bfloat16 on GPUs, float32 otherwise; ``nereus.engines.precision``)."""
    import dataclasses

    from nereus.engines.precision import resolve_dtype

    dtype = resolve_dtype(cfg.model.dtype, device_kinds)
    if dtype == cfg.model.dtype:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
