"""nereus.job: the running RL job: its configuration, the step loop, the model-stages
it drives (in process, or on a cluster whose plan changes while the job runs),
adaptation, recovery, checkpoints, export, report and step loggers.

Layers used: nereus.rl (one step), nereus.data, nereus.planner and nereus.transition
(plan changes), nereus.engines, nereus.state and nereus.actors (the cluster),
nereus.monitor (the tap recorder). ``nereus run CONFIG.toml`` is the command line
(``nereus.job.cli``); see each module's docstring for its contract.
"""

from nereus.job.cluster_stages import ClusterStages
from nereus.job.config import (
    MODEL_STAGES,
    AdaptConfig,
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
    TrainingConfig,
    required_stages,
)
from nereus.job.export import export_checkpoint, latest_checkpoint
from nereus.job.local_stages import InProcessStages, prepare_model
from nereus.job.loggers import StepLogger, StepLoggers, make_loggers
from nereus.job.loop import RLJob, run_job
from nereus.job.report import MetricsWriter, StepProgress, plot_metrics, read_metrics, summary_table

__all__ = [
    "MODEL_STAGES",
    "AdaptConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "ClusterStages",
    "DataConfig",
    "InProcessStages",
    "JobConfig",
    "MetricsWriter",
    "ModelConfigSection",
    "OptimConfig",
    "Placement",
    "RLJob",
    "RewardConfig",
    "RunConfig",
    "SamplingConfig",
    "StepLogger",
    "StepLoggers",
    "StepProgress",
    "TaskConfig",
    "TrainingConfig",
    "export_checkpoint",
    "latest_checkpoint",
    "make_loggers",
    "plot_metrics",
    "prepare_model",
    "read_metrics",
    "required_stages",
    "run_job",
    "summary_table",
]
