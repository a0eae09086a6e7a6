"""nereus.planner: cluster and workload descriptions, the cost and memory model, plan
search, calibration, triggers and admission (docs/design.md §6).

Pure Python with no I/O (``_probe`` is the one thin shell that measures this CPU
machine); never imports torch, so the same code runs in the controller and in the
simulator at 1,024 devices.
"""

from nereus.planner._probe import local_cpu_cluster_probed, local_cpu_efficiency
from nereus.planner.admission import DEFAULT_GAMMA, Decision, Target, admit, choose
from nereus.planner.calibrate import Calibrator
from nereus.planner.candidates import Candidate, pool_sizes, stage_candidates
from nereus.planner.cluster import PRESETS, ClusterSpec, cluster_preset, local_cpu_cluster
from nereus.planner.cost import (
    CONSERVATIVE,
    HEADROOM,
    OP_CLASSES,
    Efficiency,
    StageCost,
    StageMemory,
    Term,
    stage_cost,
    stage_memory,
    usable_bytes,
)
from nereus.planner.explain import DeviceMemory, Explanation, PhaseTime, StageExplanation, explain
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.plan_text import plan_changes, plan_text, stage_change_text, stage_plan_text
from nereus.planner.pool import DevicePool
from nereus.planner.relabel import relabel
from nereus.planner.replan import BoundaryOutcome, Replanner
from nereus.planner.replay import boundary_record, replay
from nereus.planner.search import Alternative, SearchResult, search
from nereus.planner.triggers import DriftSignal, Trigger, TriggerMonitor
from nereus.planner.workload import (
    ALGORITHMS,
    MODEL_PRESETS,
    LengthStats,
    ModelShape,
    ModelStage,
    Workload,
    algorithm_stages,
    model_preset,
    phases,
)

__all__ = [
    "ALGORITHMS",
    "Alternative",
    "BoundaryOutcome",
    "Replanner",
    "Calibrator",
    "Candidate",
    "ClusterSpec",
    "CONSERVATIVE",
    "DEFAULT_GAMMA",
    "Decision",
    "DeviceMemory",
    "DevicePool",
    "DriftSignal",
    "Efficiency",
    "Explanation",
    "HEADROOM",
    "LengthStats",
    "MODEL_PRESETS",
    "ModelShape",
    "ModelStage",
    "OP_CLASSES",
    "PhaseTime",
    "Plan",
    "PRESETS",
    "SearchResult",
    "StageCost",
    "StageExplanation",
    "StageMemory",
    "StagePlan",
    "Target",
    "Term",
    "Trigger",
    "TriggerMonitor",
    "Workload",
    "admit",
    "algorithm_stages",
    "boundary_record",
    "choose",
    "cluster_preset",
    "explain",
    "local_cpu_cluster",
    "local_cpu_cluster_probed",
    "local_cpu_efficiency",
    "model_preset",
    "phases",
    "pool_sizes",
    "relabel",
    "replay",
    "search",
    "stage_candidates",
    "stage_cost",
    "stage_memory",
    "usable_bytes",
    "plan_changes",
    "plan_text",
    "stage_change_text",
    "stage_plan_text",
]
