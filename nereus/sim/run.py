"""One simulated job per policy: a clock, the traces, the ground truth and the policy.

``build_scenario(config)`` builds the scenario (cluster, workload, traces, the job's cap
schedule, ground truth) once; ``nereus.sim.compare.simulate`` runs every policy of
``config.policies`` on it (and the ``oracle`` reference, ``nereus.sim.oracle``, when
named); ``run_policy`` is one run. Moves cost the ground truth's time (the paper's Extend
or resharding figure; a move the real DAG cannot schedule becomes a checkpoint restart at
the truth's restart time).

Times are simulated seconds; ``planner_s`` and ``dag_s`` are the wall seconds this
process spent in planner calls and in building and scheduling DAGs (reported, never
added to the clock, so a run is deterministic under its seed). Everything here is a
simulation: labels say so.

More (how it works): docs/simulation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nereus.config import require
from nereus.errors import InfeasiblePlan, NereusError
from nereus.planner.cluster import ClusterSpec, cluster_preset
from nereus.planner.cost import CONSERVATIVE, Efficiency
from nereus.planner.plan import Plan
from nereus.planner.workload import ALGORITHMS, LengthStats, Workload, model_preset
from nereus.sim.policies import (
    EXTRA_POLICIES,
    POLICIES,
    Boundary,
    Policy,
    _Ctx,
)
from nereus.sim.presets import cap_for, pair_paths, paper_lengths, preset
from nereus.sim.traces import (
    CAP_SCHEDULES,
    CapSchedule,
    DeviceTrace,
    LengthTrace,
    cap_schedule,
    device_trace,
    length_trace,
)
from nereus.sim.transitions import Transitions, intact
from nereus.sim.truth import GroundTruth, TruthParams, load_truth_params

__all__ = [
    "SimConfig",
    "Scenario",
    "StepRecord",
    "PolicyResult",
    "SimulationError",
    "run_policy",
    "policy_context",
    "devices_of",
    "pause_until_available",
    "wait_for_change",
    "build_scenario",
    "preset_config",
]


class SimulationError(NereusError):
    """The simulated job cannot go on (a step that keeps failing, a trace with no device,
    ``static`` out of memory with no relief left). ``result``: the run up to there (set by
    ``run_policy``)."""

    result: PolicyResult | None = None


@dataclass(frozen=True)
class SimConfig:
    """One simulation (``nereus simulate``'s flags)."""

    cluster: str
    model: str
    algorithm: str
    gpus_trace: str
    length_trace: str
    steps: int
    length_range: tuple[float, float] | None = None
    pool_scale: float | None = None
    gamma: float = 0.5
    seed: int = 0
    k: int = 3
    # The workload of the project's planner benchmark (benchmarks/planner.py).
    prompts_per_step: int = 256
    samples_per_prompt: int = 4
    prompt_length: int = 512
    micro_batch: int = 1
    # The job's largest generation cap (default: twice the trace's largest mean, a power
    # of two); the cap schedule raises the cap up to it (``nereus.sim.traces``).
    max_length: int | None = None
    # How the job's cap follows the lengths: "stepped" (raised in stages as responses
    # grow) or "fixed" (the largest cap from the first step).
    cap_schedule: str = "stepped"
    policies: tuple[str, ...] = POLICIES
    join_horizon_steps: float = 20.0
    min_steps_between: int = 0
    truth_path: str | None = None
    # a named scenario (``nereus.sim.presets``: its cluster allocation, traces and cap
    # replace the fields above) and its trace pair; where the shared traces lie
    scenario: str | None = None
    pair: int = 0
    traces_dir: str | None = None

    def __post_init__(self) -> None:
        require(
            self.algorithm in ALGORITHMS,
            "algo",
            self.algorithm,
            f"must be one of {list(ALGORITHMS)}",
        )
        require(
            isinstance(self.steps, int) and self.steps >= 1,
            "steps",
            self.steps,
            "must be an integer >= 1",
        )
        require(self.gamma > 0, "gamma", self.gamma, "must be > 0")
        require(
            isinstance(self.seed, int) and self.seed >= 0,
            "seed",
            self.seed,
            "must be an integer >= 0",
        )
        require(isinstance(self.k, int) and self.k >= 1, "k", self.k, "must be an integer >= 1")
        require(
            self.max_length is None or self.max_length >= 1,
            "max_length",
            self.max_length,
            "must be >= 1 token",
        )
        require(
            self.cap_schedule in CAP_SCHEDULES,
            "cap_schedule",
            self.cap_schedule,
            f"must be one of {list(CAP_SCHEDULES)}",
        )
        unknown = [p for p in self.policies if p not in POLICIES + EXTRA_POLICIES]
        require(
            not unknown and len(self.policies) >= 1,
            "policies",
            list(self.policies),
            f"must name some of {list(POLICIES + EXTRA_POLICIES)}",
        )


@dataclass
class Scenario:
    """What every policy of one simulation shares."""

    cluster: ClusterSpec
    work: Workload
    devices: DeviceTrace
    lengths: LengthTrace
    steps: int
    truth: GroundTruth
    max_attempts: int = 50
    # the job's first plan (device ids) where its config pins one, as a running job's
    # does; None: each policy starts on its own (the search's, or static's start)
    initial_plan: Plan | None = None
    # what every policy's calibration starts from (a running job on CPU workers starts
    # from the probed ``local_cpu_efficiency``) and the weight of its pull
    prior: Efficiency = CONSERVATIVE
    prior_weight: float = 1e-3

    def __post_init__(self) -> None:
        require(
            not self.devices.per_device or self.cluster.nodes == 1,
            "Scenario.devices",
            self.devices.name,
            f"must count nodes: a trace of single devices needs a one-node cluster, "
            f"not {self.cluster.nodes} nodes",
        )
        if self.initial_plan is not None:
            require(
                self.initial_plan.devices <= set(range(self.cluster.num_devices)),
                "Scenario.initial_plan",
                sorted(self.initial_plan.devices),
                f"must name devices of the cluster (0..{self.cluster.num_devices - 1})",
            )

    @property
    def unit(self) -> int:
        """Devices per unit of the device trace: a node's, or 1 for a trace of devices."""
        return 1 if self.devices.per_device else self.cluster.devices_per_node

    @property
    def caps(self) -> CapSchedule:
        """The job's generation cap at every step (the ground truth caps each step's
        sampled maximum by it; the policies plan memory at it)."""
        return self.truth.caps


def preset_config(
    name: str,
    pair: int = 0,
    *,
    traces_dir: str | None = None,
    seed: int = 0,
    policies: tuple[str, ...] | None = None,
) -> SimConfig:
    """The ``SimConfig`` of preset ``name`` on its trace pair ``pair`` (``nereus.sim.presets``)."""
    p = preset(name)
    lengths, spot, _ = pair_paths(p, pair, traces_dir)
    return SimConfig(
        p.cluster,
        p.model,
        p.algorithm,
        str(spot),
        str(lengths),
        p.steps,
        gamma=p.gamma,
        seed=seed,
        k=p.k,
        cap_schedule="fixed",
        policies=policies or p.policies,
        scenario=name,
        pair=pair,
        traces_dir=traces_dir,
    )


def build_scenario(config: SimConfig, params: TruthParams | None = None) -> Scenario:
    """The cluster, workload, traces and ground truth of ``config``."""
    cluster = cluster_preset(config.cluster)
    if config.scenario is not None:
        p = preset(config.scenario)
        cluster = cluster.with_nodes(p.nodes)
        lengths = paper_lengths(config.length_trace, p.steps, p.mean, p.p95)
        caps = CapSchedule.fixed(cap_for(lengths), p.steps)
        devices = device_trace(
            config.gpus_trace,
            cluster,
            config.steps,
            seed=config.seed,
            pool_range=p.pool_range,
            offset_ticks=p.pairs[config.pair].offset_ticks,
        )
    else:
        lengths = length_trace(config.length_trace, config.steps, length_range=config.length_range)
        caps = cap_schedule(config.cap_schedule, lengths, max_length=config.max_length)
        devices = device_trace(
            config.gpus_trace, cluster, config.steps, pool_scale=config.pool_scale, seed=config.seed
        )
    first = min(lengths.mean_at(0), caps.cap_at(0))
    work = Workload.for_models(
        config.algorithm,
        model_preset(config.model),
        prompts_per_step=config.prompts_per_step,
        samples_per_prompt=config.samples_per_prompt,
        prompt_length=config.prompt_length,
        lengths=LengthStats(first, first, math.ceil(first)),
        micro_batch=config.micro_batch,
    )
    truth = GroundTruth(
        params or load_truth_params(config.truth_path),
        cluster,
        work,
        caps=caps,
        seed=config.seed,
        p95_ratio=lengths.p95_ratios(),
    )
    return Scenario(cluster, work, devices, lengths, config.steps, truth)


@dataclass(frozen=True)
class StepRecord:
    """One completed step: when it started, its seconds, the devices live at its boundary
    (``pool``) and how many its plan used, its lengths, its highest device peak (bytes),
    whether a transition or restart preceded it, and how many times the step was tried
    before (``attempt``: its stragglers' draw)."""

    step: int
    start_s: float
    seconds: float
    pool: tuple[int, ...]
    plan_devices: int
    mean_length: float
    max_length: int
    peak_bytes: int
    transition: bool
    restart: bool
    attempt: int = 0

    @property
    def devices(self) -> int:
        """How many devices were live at the step's boundary."""
        return len(self.pool)


@dataclass
class PolicyResult:
    """One policy's run (simulated seconds unless named otherwise)."""

    policy: str
    steps: int = 0
    total_s: float = 0.0
    paused_s: float = 0.0
    waiting_s: float = 0.0
    compute_s: float = 0.0
    transition_s: float = 0.0
    restart_s: float = 0.0
    wasted_s: float = 0.0
    transitions: int = 0
    restarts: int = 0
    aborted_steps: int = 0
    memory_failures: int = 0
    decisions: int = 0
    planner_s: float = 0.0  # wall seconds in planner calls
    dag_s: float = 0.0  # wall seconds building and scheduling DAGs
    tokens: float = 0.0
    # the oracle's step seconds on this run's own steps, pools and straggler draws
    # (``nereus.sim.oracle.matched_compute``; set when the oracle ran beside it)
    oracle_compute_s: float | None = None
    # why the run ended before its last step (a ``SimulationError``; its counters and
    # mean step cover the steps it finished): set by ``nereus.sim.compare.simulate``
    stopped: str | None = None
    records: list[StepRecord] = field(default_factory=list)

    @property
    def run_s(self) -> float:
        """Run time without the paused time."""
        return self.total_s - self.paused_s

    @property
    def mean_step_s(self) -> float:
        return self.run_s / self.steps if self.steps else math.inf

    @property
    def throughput_steps_per_hour(self) -> float:
        return 3600.0 * self.steps / self.total_s if self.total_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def transition_overhead_pct(self) -> float:
        return 100.0 * self.transition_s / self.run_s if self.run_s > 0 else 0.0

    @property
    def plan_gap(self) -> float | None:
        """How much longer this run's steps took than the oracle's plans on the same
        steps, pools and straggler draws (a fraction; None unless the oracle ran)."""
        if self.oracle_compute_s is None or self.oracle_compute_s <= 0:
            return None
        return self.compute_s / self.oracle_compute_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        ms = 1000.0 / max(1, self.decisions)
        out = {
            "policy": self.policy,
            "simulated": True,
            "steps": self.steps,
            "mean_step_s": self.mean_step_s,
            "throughput_steps_per_hour": self.throughput_steps_per_hour,
            "tokens_per_s": self.tokens_per_s,
            "transitions": self.transitions,
            "transition_s": self.transition_s,
            "transition_overhead_pct": self.transition_overhead_pct,
            "restarts": self.restarts,
            "restart_s": self.restart_s,
            "memory_failures": self.memory_failures,
            "aborted_steps": self.aborted_steps,
            "wasted_s": self.wasted_s,
            "paused_s": self.paused_s,
            "waiting_s": self.waiting_s,
            "compute_s": self.compute_s,
            "total_s": self.total_s,
            "decisions": self.decisions,
            "planner_ms_per_decision": self.planner_s * ms,
            "dag_ms_per_decision": self.dag_s * ms,
            "planner_s": self.planner_s,
            "dag_s": self.dag_s,
        }
        if self.oracle_compute_s is not None:
            out.update(oracle_compute_s=self.oracle_compute_s, plan_gap=self.plan_gap)
        if self.stopped is not None:
            out["stopped"] = self.stopped
        return out


def policy_context(scn: Scenario) -> _Ctx:
    """What one policy's run on ``scn`` plans with: the job, the cluster, its own
    transition cache (the truth's link model and move times), the cap schedule, the
    pinned first plan and the calibration's prior."""
    transitions = Transitions(
        scn.work, scn.cluster, scn.truth.link_model, scn.truth.transition_seconds
    )
    return _Ctx(
        scn.work,
        scn.cluster,
        transitions,
        scn.caps,
        initial_plan=scn.initial_plan,
        prior=scn.prior,
        prior_weight=scn.prior_weight,
    )


def devices_of(nodes: frozenset[int], per_node: int) -> tuple[int, ...]:
    """The device ids of ``nodes``, ascending."""
    return tuple(d for n in sorted(nodes) for d in range(n * per_node, (n + 1) * per_node))


def run_policy(
    scn: Scenario,
    policy: Policy,
    *,
    on_step: Callable[[StepRecord, PolicyResult], None] | None = None,
) -> PolicyResult:
    """Run ``policy`` over ``scn`` (see the module docstring). ``on_step(record, result)``
    is called after each completed step with its record and the result so far (its
    counters up to and including that step; ``total_s`` is set only at the end). A
    ``SimulationError`` it raises carries the run up to there as ``result``."""
    res = PolicyResult(policy.name)
    try:
        return _run(scn, policy, res, on_step)
    except SimulationError as e:
        res.steps = len(res.records)
        res.total_s = (
            res.paused_s
            + res.waiting_s
            + res.compute_s
            + res.transition_s
            + res.restart_s
            + res.wasted_s
        )
        e.result = res
        raise


def _run(
    scn: Scenario,
    policy: Policy,
    res: PolicyResult,
    on_step: Callable[[StepRecord, PolicyResult], None] | None,
) -> PolicyResult:
    per = scn.unit
    transitions = policy.ctx.transitions
    clock, step, attempt = 0.0, 0, 0
    observed = scn.truth.lengths(-1, scn.lengths.mean_at(0))  # one warm-up rollout
    plan = None
    started = failed = False
    seen: tuple[int, ...] = ()
    moved = restarted = False
    while step < scn.steps:
        devices = devices_of(scn.devices.nodes_at(clock, step), per)
        if not devices:
            clock = pause_until_available(scn, res, clock, step)
            continue
        left = tuple(sorted(set(seen) - set(devices)))
        # drained devices keep what they hold until a change moves it: the plan's EMUs
        # there are sources of the next move, never places the next step runs on
        drained = (
            tuple(d for d in sorted(plan.devices) if d not in devices)
            if scn.devices.drains and plan is not None
            else ()
        )
        b = Boundary(
            step,
            devices,
            () if scn.devices.drains else left,
            tuple(sorted(set(devices) - set(seen))),
            observed,
            failed,
            drained,
        )
        seen, failed = devices, False
        if not started:
            try:
                plan = policy.start(b)
            except InfeasiblePlan as e:
                clock = wait_for_change(scn, res, clock, step, str(e), policy.name)
                continue
            started, move = True, None
        else:
            move = policy.decide(b, plan)
            res.decisions += 1
            res.planner_s += move.planner_s
            res.dag_s += move.dag_s
        if move is not None:
            if move.action == "stop":
                raise SimulationError(
                    f"{policy.name}: step {step} cannot go on after {res.memory_failures} "
                    f"memory failures: {move.reason}"
                )
            if move.action == "wait":
                clock = wait_for_change(scn, res, clock, step, move.reason, policy.name)
                continue
            current = intact(plan, devices + drained) if plan is not None else None
            if move.action == "transition" and current is not None:
                seconds = transitions.actual(current, move.plan, step)
                if math.isfinite(seconds):
                    policy.observe_transition(transitions.observed_nodes(current, move.plan, step))
                    clock += seconds
                    res.transition_s += seconds
                    res.transitions += 1
                    plan, moved = move.plan, True
                else:
                    move.action = "restart"
            elif move.action == "transition":
                move.action = "restart"
            if move.action == "restart":
                seconds = scn.truth.restart_seconds(move.plan)
                clock += seconds
                res.restart_s += seconds
                res.restarts += 1
                plan, restarted = move.plan, True
            elif move.action == "keep":
                if current is None or not current.devices <= set(devices):
                    raise SimulationError(
                        f"{policy.name} kept a plan that lost every EMU of a model-stage, or "
                        f"that holds drained devices, at step {step}"
                    )
                plan = current
            if move.action in ("transition", "restart"):
                now = devices_of(scn.devices.nodes_at(clock, step), per)
                if not plan.devices <= set(now):
                    continue  # the pool changed under the move: back to the boundary
        assert plan is not None
        truth = scn.truth.step(plan, step, scn.lengths.mean_at(step), attempt)
        nodes = frozenset(d // per for d in plan.devices)
        loss = scn.devices.first_loss(clock, clock + truth.seconds, nodes)
        if truth.failed or loss is not None:
            attempt += 1
            if attempt > scn.max_attempts:
                raise SimulationError(
                    f"{policy.name}: step {step} failed {attempt} times in a row "
                    f"(memory failures {res.memory_failures}, aborted {res.aborted_steps})"
                )
            if loss is not None and (not truth.failed or loss < clock + truth.seconds):
                res.wasted_s += loss - clock
                res.aborted_steps += 1
                clock = loss
            else:
                res.wasted_s += truth.seconds
                res.memory_failures += 1
                clock += truth.seconds
                policy.observe(plan, devices, observed, truth, step)
                failed = True
            continue
        record = StepRecord(
            step,
            clock,
            truth.seconds,
            devices,
            len(plan.devices),
            truth.lengths.mean,
            truth.lengths.max,
            truth.device_peak,
            moved,
            restarted,
            attempt,
        )
        res.records.append(record)
        clock += truth.seconds
        res.compute_s += truth.seconds
        res.tokens += scn.work.sequences * truth.lengths.mean
        policy.observe(plan, devices, observed, truth, step)
        observed = truth.lengths
        if on_step is not None:
            on_step(record, res)
        step, attempt = step + 1, 0
        moved = restarted = False
    res.steps = step
    res.total_s = clock
    return res


def pause_until_available(scn: Scenario, res: PolicyResult, clock: float, step: int) -> float:
    """No device is available: the job is paused (``paused_s``) until one is."""
    nxt = scn.devices.next_available(clock, step)
    if nxt is None or nxt <= clock:
        raise SimulationError(
            f"{scn.devices.name}: no device is ever available again after {clock:.0f} s"
        )
    res.paused_s += nxt - clock
    return nxt


def wait_for_change(
    scn: Scenario, res: PolicyResult, clock: float, step: int, reason: str, policy: str
) -> float:
    """No plan fits the pool: the job waits until the pool changes."""
    nxt = scn.devices.next_change(clock, step)
    if nxt is None or nxt <= clock:
        raise SimulationError(
            f"{policy}: no plan fits the pool at step {step} and it never changes: {reason}"
        )
    res.waiting_s += nxt - clock
    return nxt
