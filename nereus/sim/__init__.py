"""nereus.sim: the simulated cluster (docs/design.md §9).

The real planner (``nereus.planner``: search, Replanner, admission, calibration) and the
real transition DAG (``nereus.transition``: build_dag, simulate) driven by a clock and a
ground truth written apart from the planner (measured curves and the paper's component
costs, ``nereus.sim.truth``), replaying device-availability
and response-length traces, to compare layout policies at up to 1,024 devices. Every
figure it produces is a simulation. Imports the planner, transition, state and models
(ModelSpecs read off the model definition on the meta device) layers; never the runtime
(actors, transfer, engines, rl).
"""

from nereus.sim.compare import run_policies, simulate
from nereus.sim.counterfactual import (
    Counterfactual,
    CounterfactualReport,
    admission_counterfactuals,
)
from nereus.sim.oracle import ORACLE, run_oracle
from nereus.sim.policies import EXTRA_POLICIES, POLICIES, Boundary, Move, Policy, make_policy
from nereus.sim.run import (
    PolicyResult,
    Scenario,
    SimConfig,
    SimulationError,
    StepRecord,
    build_scenario,
    policy_context,
    preset_config,
    run_policy,
)
from nereus.sim.traces import (
    CAP_SCHEDULES,
    CapSchedule,
    DeviceTrace,
    GrowthTrace,
    LengthTrace,
    SpotTrace,
    StepPoolTrace,
    cap_schedule,
    device_trace,
    length_trace,
)
from nereus.sim.transitions import Transitions, intact, model_spec_of, transition_seconds
from nereus.sim.truth import GroundTruth, StepTruth, TruthParams, load_truth_params

__all__ = [
    "CAP_SCHEDULES",
    "Counterfactual",
    "CounterfactualReport",
    "EXTRA_POLICIES",
    "ORACLE",
    "POLICIES",
    "Boundary",
    "CapSchedule",
    "cap_schedule",
    "DeviceTrace",
    "GroundTruth",
    "GrowthTrace",
    "LengthTrace",
    "Move",
    "Policy",
    "PolicyResult",
    "Scenario",
    "SimConfig",
    "SimulationError",
    "SpotTrace",
    "StepPoolTrace",
    "StepRecord",
    "StepTruth",
    "Transitions",
    "TruthParams",
    "build_scenario",
    "device_trace",
    "intact",
    "length_trace",
    "load_truth_params",
    "make_policy",
    "policy_context",
    "preset_config",
    "admission_counterfactuals",
    "model_spec_of",
    "run_oracle",
    "run_policies",
    "run_policy",
    "simulate",
    "transition_seconds",
]
