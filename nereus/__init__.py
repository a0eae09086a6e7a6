"""nereus: RL post-training of LLMs that changes each model-stage's parallel layout
while the job runs, built on a small, fast async actor framework.

The public API is what ``__all__`` lists; everything else is private. Names are
resolved on first use, so ``import nereus`` stays cheap (no torch until a name that
needs it is touched) and never imports cupy or vllm.
"""

from __future__ import annotations

import importlib
from typing import Any

from nereus.errors import (
    ActorDied,
    AuthenticationError,
    Backpressure,
    ConfigError,
    DeadlineExceeded,
    InfeasiblePlan,
    InfeasibleTransition,
    NereusError,
    OutOfMemory,
    PeerDied,
    ProtocolError,
    RemoteError,
    StateError,
    StuckCollective,
    TransferError,
)

__version__ = "0.1.0"

# public name -> the subpackage that defines it (layers bottom to top, docs/design.md §2)
_LAZY: dict[str, str] = {}
for _module, _names in {
    "nereus.actors": [
        "Actor",
        "ActorMesh",
        "ActorRef",
        "Cluster",
        "DeviceInfo",
        "Endpoint",
        "Failure",
        "current_device",
        "emit",
        "endpoint",
        "run",
    ],
    "nereus.transfer": [
        "Communicator",
        "CpuCommunicator",
        "GroupHandle",
        "P2POp",
        "TransferStats",
        "exchange",
        "get_communicator",
        "make_group",
        "release_epoch",
        "release_groups",
    ],
    "nereus.state": [
        "DeviceSet",
        "EMU",
        "Layout",
        "LogicalState",
        "MemoryLedger",
        "ModelSpec",
        "ParamSpec",
        "ShardHolder",
        "bytes_minimum",
        "destroy",
        "device_ledger",
        "execute",
        "execute_into",
        "execute_step",
        "extend",
        "load_from_disk",
        "merge",
        "plan_reshard",
        "plan_stage_transition",
        "save_to_disk",
        "split",
        "training_slots",
    ],
    "nereus.models": [
        "DecoderStage",
        "KVCache",
        "ModelConfig",
        "ParallelContext",
        "build_stage",
        "export_hf",
        "load_stage_weights",
        "load_tokenizer",
        "model_spec",
        "save_tiny_model",
        "tiny_config",
        "train_tiny_tokenizer",
    ],
    "nereus.engines": [
        "EmuContext",
        "EngineHost",
        "GenerationEngine",
        "InferenceEngine",
        "ModelStageHandle",
        "SamplingParams",
        "TrainingEngine",
        "VllmGenerationEngine",
        "spawn_hosts",
        "spawn_model_stage",
        "start_model_stage",
    ],
    "nereus.planner": [
        "Calibrator",
        "ClusterSpec",
        "Plan",
        "Replanner",
        "StagePlan",
        "Workload",
        "cluster_preset",
        "explain",
        "local_cpu_cluster",
        "model_preset",
        "search",
    ],
    "nereus.transition": [
        "LinkModel",
        "TransitionDAG",
        "build_dag",
        "simulate",
        "transition_seconds",
    ],
    "nereus.monitor": ["EVENT_TYPES", "SCHEMA_VERSION", "Dashboard", "DashboardView", "Subscriber"],
    "nereus.data": ["DataConfig", "FileTask", "PromptDataset", "Task", "load_reward", "make_task"],
    "nereus.rl": ["ModelStages"],
    "nereus.job": [
        "ClusterStages",
        "InProcessStages",
        "JobConfig",
        "RLJob",
        "make_loggers",
        "run_job",
    ],
    "nereus.sim": [
        "GroundTruth",
        "PolicyResult",
        "SimConfig",
        "TruthParams",
        "load_truth_params",
        "simulate",
    ],
    "nereus.launch": [
        "KubernetesCluster",
        "SbatchOptions",
        "SlurmCluster",
        "render_manifests",
        "render_sbatch",
    ],
}.items():
    for _name in _names:
        _LAZY[_name] = _module
del _module, _names, _name

__all__ = [
    "__version__",
    "ActorDied",
    "AuthenticationError",
    "Backpressure",
    "ConfigError",
    "DeadlineExceeded",
    "InfeasiblePlan",
    "InfeasibleTransition",
    "NereusError",
    "OutOfMemory",
    "ProtocolError",
    "RemoteError",
    "StateError",
    "StuckCollective",
    "PeerDied",
    "TransferError",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nereus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
