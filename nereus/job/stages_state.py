"""What the cluster-backed stages and their plan changes share (``StagesState``).

``nereus.job.cluster_stages.ClusterStages`` runs the model-stages' work and
``nereus.job.plan_changes.PlanChanges`` changes their plan; both hold one
``StagesState`` and read or write the job's placement only through it: the cluster,
the engine hosts, each model-stage's EMUs and engine handles, the plan, the layout
epoch, the in-place weight syncs, the models' folders, the link model and its
calibrator, and what the last change reported.

It holds data only: no method here talks to a worker. ``link``, ``calibrator`` and
``cluster_spec`` are set when the stages start (before that they are absent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nereus.actors import Cluster
from nereus.job.config import JobConfig
from nereus.models import ModelConfig
from nereus.planner import Calibrator, ClusterSpec
from nereus.planner.plan import Plan
from nereus.state import EMU
from nereus.transition import LinkModel

__all__ = ["StagesState"]


@dataclass(eq=False)
class StagesState:
    """The placement of one job's model-stages on a cluster (see the module docstring)."""

    cfg: JobConfig
    cluster: Cluster
    model_config: ModelConfig
    plan: Plan  # the job's plan now
    epoch: int = 0  # the layout epoch the groups and engines belong to
    hosts: dict[int, Any] = field(default_factory=dict)  # device -> its engine host
    emus: dict[str, list[EMU]] = field(default_factory=dict)  # model-stage -> its EMUs (DP order)
    handles: dict[str, Any] = field(default_factory=dict)  # model-stage -> ModelStageHandle
    sync: dict[str, tuple[list[Any], Any]] = field(default_factory=dict)  # target -> (plans, group)
    models: dict[str, tuple[ModelConfig, str]] = field(default_factory=dict)  # "policy"/"reward"
    # model-stages a fault left without an intact EMU: the next change builds them
    # (nereus.job.recovery)
    missing: set[str] = field(default_factory=set)
    cache_slots: int = 0  # slots of the generation KV caches before a change
    spawn_s: list[float] = field(default_factory=list)  # spawning each model-stage at start
    last_transition: dict[str, Any] | None = None  # the report of the last change
    learn_transitions: bool = True  # measured transition nodes refit the link model
    cluster_spec: ClusterSpec = field(init=False)  # this machine's rates
    calibrator: Calibrator = field(init=False)
    link: LinkModel = field(init=False)
