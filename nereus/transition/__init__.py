"""nereus.transition: the global transition DAG (docs/design.md §5, §10).

``build_dag`` joins every model-stage's primitives into one DAG with analytic bytes and
exact per-device memory effects; ``simulate`` is the one list scheduler (the estimate,
the executor's dispatch order, the simulator's timing); ``transition_seconds`` prices a
move for admission (``inf`` when infeasible); ``execute_dag`` runs a DAG on a runtime:
real workers (``nereus.job``'s) or ``SimulatedRuntime`` (a clock with injected durations
and failures).

Pure planning: no sockets, processes or files; the executor drives whatever runtime it
is given.
"""

from nereus.transition.analytic import SpecBytes
from nereus.transition.build import build_dag
from nereus.transition.dag import Node, TransitionDAG, stage_moves, stage_rank
from nereus.transition.estimate import (
    cluster_devices,
    estimator,
    scheduled,
    transition_seconds,
)
from nereus.transition.rules import ALL_RULES, Rules
from nereus.transition.schedule import (
    Blocked,
    Dispatcher,
    LinkModel,
    Schedule,
    full_rate_seconds,
    simulate,
)

__all__ = [
    "ALL_RULES",
    "Blocked",
    "Dispatcher",
    "LinkModel",
    "Node",
    "Rules",
    "Schedule",
    "SpecBytes",
    "TransitionDAG",
    "build_dag",
    "cluster_devices",
    "estimator",
    "full_rate_seconds",
    "scheduled",
    "simulate",
    "stage_moves",
    "stage_rank",
    "transition_seconds",
]
