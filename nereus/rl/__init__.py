"""nereus.rl: RL post-training on model-stages (PPO, GRPO, ReMax), tasks and file datasets,
rule rewards, step loggers, the job and its export.

Layers used: nereus.engines (what runs inside an EMU), nereus.state (weight-sync plans),
nereus.transfer (the data plane), nereus.actors (the cluster). See each module's
docstring for its contract; ``nereus run CONFIG.toml`` is the command line.
"""

from nereus.rl.advantages import (
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    remax_advantages,
    token_rewards,
)
from nereus.rl.algorithms import ALGORITHMS, StepContext, grpo_step, ppo_step, remax_step
from nereus.rl.cluster import ClusterStages
from nereus.rl.config import (
    MODEL_STAGES,
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    JobConfig,
    ModelConfigSection,
    OptimConfig,
    Placement,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    required_stages,
)
from nereus.rl.data import PromptDataset
from nereus.rl.export import export_checkpoint
from nereus.rl.filedata import FileRow, FileTask, read_rows
from nereus.rl.job import RLJob, latest_checkpoint, run_job
from nereus.rl.loggers import StepLogger, StepLoggers, make_loggers
from nereus.rl.losses import (
    clipped_policy_objective,
    clipped_value_objective,
    policy_loss,
    value_loss,
)
from nereus.rl.report import MetricsWriter, StepProgress, plot_metrics, read_metrics, summary_table
from nereus.rl.rewards import RewardInput, exact_reward, load_reward, math_reward
from nereus.rl.rollout import Rollouts, to_batch
from nereus.rl.stages import InProcessStages, ModelStages, prepare_model
from nereus.rl.tasks import TASKS, ArithmeticTask, CountTask, ReverseTask, Sample, Task, make_task
from nereus.rl.vocab import Codec, char_tokenizer

__all__ = [
    "ALGORITHMS",
    "MODEL_STAGES",
    "TASKS",
    "AlgorithmConfig",
    "RewardConfig",
    "ArithmeticTask",
    "ClusterConfig",
    "ClusterStages",
    "Codec",
    "CountTask",
    "DataConfig",
    "FileRow",
    "FileTask",
    "RewardInput",
    "StepLogger",
    "StepLoggers",
    "exact_reward",
    "export_checkpoint",
    "load_reward",
    "make_loggers",
    "math_reward",
    "read_rows",
    "InProcessStages",
    "JobConfig",
    "MetricsWriter",
    "ModelConfigSection",
    "ModelStages",
    "OptimConfig",
    "Placement",
    "PromptDataset",
    "RLJob",
    "ReverseTask",
    "Rollouts",
    "RunConfig",
    "Sample",
    "SamplingConfig",
    "StepContext",
    "StepProgress",
    "Task",
    "TaskConfig",
    "broadcast_to_tokens",
    "char_tokenizer",
    "clipped_policy_objective",
    "clipped_value_objective",
    "gae",
    "grpo_advantages",
    "grpo_step",
    "kl_estimate",
    "latest_checkpoint",
    "make_task",
    "masked_mean",
    "masked_whiten",
    "plot_metrics",
    "policy_loss",
    "ppo_step",
    "prepare_model",
    "read_metrics",
    "remax_advantages",
    "remax_step",
    "required_stages",
    "run_job",
    "summary_table",
    "to_batch",
    "token_rewards",
    "value_loss",
]
