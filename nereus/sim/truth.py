"""The simulated cluster's ground truth: what a step and a transition really take.

The planner predicts with its formulas (``nereus.planner.cost``) and its efficiency
factors; the ground truth evaluates the same formulas with effects the planner does not
model, from the parameters in ``ground_truth.toml`` (each with its reason):

- efficiencies per operation class drawn once per seed around the file's values, then
  drifting over the run (a slow sinusoid per class), so calibration has something to learn;
- stragglers: every device has a persistent speed factor and a per-step jitter; a
  model-stage takes its slowest device's time, so more DP replicas wait longer;
- the step's sampled maximum response length (the trace's mean times a log-normal ratio,
  capped at the step's cap from the job's cap schedule) sets the decode steps and, with one sequence per
  micro-batch, the activations of inference and training; the planner sees the lengths of
  the previous step;
- inter-node congestion: inter-node collectives and transfers lose a share of their
  efficiency per doubling of the nodes they span;
- memory fragmentation on transient bytes (activations, logits; KV cache), and workspace
  the planner does not count.

Memory is checked against each device's full memory: a step whose peak exceeds it is a
memory failure (``StepTruth.overflow``). Deterministic: every draw comes from the seed,
the step and the attempt, so every policy meets the same lengths and jitter at a step.
Never imports the runtime; the phase structure of a plan comes from ``explain`` (once
per plan), model-stage times from ``stage_cost`` and bytes from ``stage_memory``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from nereus.config import load_toml, require
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import OP_CLASSES, Efficiency, stage_cost, stage_memory
from nereus.planner.explain import explain, links_of
from nereus.planner.plan import Plan
from nereus.planner.workload import LengthStats, Workload
from nereus.sim.traces import CapSchedule
from nereus.transition.schedule import LinkModel

__all__ = ["Param", "TruthParams", "load_truth_params", "GroundTruth", "StepTruth", "PARAMS_PATH"]

PARAMS_PATH = Path(__file__).with_name("ground_truth.toml")
GiB = 2**30


@dataclass(frozen=True)
class Param:
    """One ground-truth number and why it has that value."""

    value: float
    reason: str

    def __post_init__(self) -> None:
        require(bool(self.reason.strip()), "Param.reason", self.reason, "must state the figure or measurement behind the value")


@dataclass(frozen=True)
class EfficiencyParams:
    gemm: Param
    attention: Param
    decode: Param
    allreduce_intra: Param
    allreduce_inter: Param
    p2p_intra: Param
    p2p_inter: Param
    layer_pass_s: Param
    spread: Param


@dataclass(frozen=True)
class DriftParams:
    amplitude: Param
    period_steps: Param


@dataclass(frozen=True)
class StragglerParams:
    device_sigma: Param
    step_sigma: Param


@dataclass(frozen=True)
class CongestionParams:
    per_doubling: Param


@dataclass(frozen=True)
class LengthParams:
    max_over_mean_median: Param
    max_over_mean_sigma: Param


@dataclass(frozen=True)
class MemoryParams:
    activation_fragmentation: Param
    kv_fragmentation: Param
    extra_workspace_gib: Param


@dataclass(frozen=True)
class TransitionParams:
    group_setup_s: Param
    call_s: Param


@dataclass(frozen=True)
class RestartParams:
    seconds: Param


@dataclass(frozen=True)
class TruthParams:
    """Every ground-truth parameter (``ground_truth.toml``, one table per field)."""

    efficiency: EfficiencyParams
    drift: DriftParams
    stragglers: StragglerParams
    congestion: CongestionParams
    lengths: LengthParams
    memory: MemoryParams
    transitions: TransitionParams
    restart: RestartParams

    def __post_init__(self) -> None:
        for c in OP_CLASSES:
            v = getattr(self.efficiency, c).value
            require(0 < v <= 1.5, f"efficiency.{c}.value", v, "must be in (0, 1.5]")
        checks = [("efficiency.spread", self.efficiency.spread.value, 0, 0.5),
                  ("drift.amplitude", self.drift.amplitude.value, 0, 0.5),
                  ("stragglers.device_sigma", self.stragglers.device_sigma.value, 0, 0.5),
                  ("stragglers.step_sigma", self.stragglers.step_sigma.value, 0, 0.5),
                  ("congestion.per_doubling", self.congestion.per_doubling.value, 0, 1),
                  ("lengths.max_over_mean_sigma", self.lengths.max_over_mean_sigma.value, 0, 2),
                  ("memory.activation_fragmentation", self.memory.activation_fragmentation.value, 0, 2),
                  ("memory.kv_fragmentation", self.memory.kv_fragmentation.value, 0, 2),
                  ("memory.extra_workspace_gib", self.memory.extra_workspace_gib.value, 0, 64),
                  ("transitions.group_setup_s", self.transitions.group_setup_s.value, 0, 10),
                  ("transitions.call_s", self.transitions.call_s.value, 0, 10)]
        for name, v, lo, hi in checks:
            require(lo <= v <= hi, f"{name}.value", v, f"must be in [{lo}, {hi}]")
        require(self.drift.period_steps.value > 0, "drift.period_steps.value", self.drift.period_steps.value, "must be > 0")
        require(self.lengths.max_over_mean_median.value >= 1, "lengths.max_over_mean_median.value",
                self.lengths.max_over_mean_median.value, "must be >= 1 (a maximum is at least the mean)")
        require(self.restart.seconds.value >= 0, "restart.seconds.value", self.restart.seconds.value, "must be >= 0")

    def rows(self) -> list[tuple[str, float, str]]:
        """(``table.name``, value, reason) of every parameter, in file order."""
        out = []
        for group in fields(self):
            table = getattr(self, group.name)
            for f in fields(table):
                p = getattr(table, f.name)
                out.append((f"{group.name}.{f.name}", p.value, p.reason))
        return out


def load_truth_params(path: str | Path | None = None) -> TruthParams:
    """The ground truth's parameters (default: the project's ``ground_truth.toml``)."""
    return load_toml(TruthParams, path or PARAMS_PATH)


@dataclass(frozen=True)
class StepTruth:
    """One step as the simulated cluster ran it: seconds (and per model-stage), the
    lengths it generated, each model-stage's peak bytes on one of its devices (resident +
    transient), the peak of one device of each kind (devices holding the same
    model-stages peak alike), the highest device peak and the devices over their memory."""

    seconds: float
    stage_seconds: dict[str, float]
    lengths: LengthStats
    stage_peaks: dict[str, int]
    device_peaks: dict[int, int]
    device_peak: int
    overflow: tuple[tuple[int, int, int], ...]  # (device, bytes, memory)

    @property
    def failed(self) -> bool:
        return bool(self.overflow)


@dataclass(frozen=True)
class _Structure:
    """What a plan's ground truth needs that does not change from step to step."""

    stages: tuple[tuple[int, str, bool, bool, np.ndarray, int], ...]  # (index, name, pp_inter, dp_inter, devices, nodes)
    groups: tuple[tuple[tuple[str, ...], ...], ...]  # per phase: groups of model-stages that serialize
    classes: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]  # model-stages on a device -> devices


class GroundTruth:
    """The simulated cluster (see the module docstring).

    ``cluster``: the whole cluster (plans name its global device ids); ``work``: the job
    (its lengths are replaced at every step); ``max_length``: the job's generation cap,
    or ``caps``: its cap at every step (the job's cap schedule; ``max_length`` is then
    its largest)."""

    def __init__(self, params: TruthParams, cluster: ClusterSpec, work: Workload, *, max_length: int | None = None,
                 caps: CapSchedule | None = None, seed: int = 0) -> None:
        require(caps is not None or max_length is not None, "max_length", max_length,
                "must be given when no cap schedule is")
        if caps is None:
            assert max_length is not None
            require(max_length >= 1, "max_length", max_length, "must be >= 1 token")
            caps = CapSchedule.fixed(int(max_length))
        require(seed >= 0, "seed", seed, "must be >= 0")
        self.params, self.cluster, self.work = params, cluster, work
        self.caps, self.max_length, self.seed = caps, caps.largest, seed
        rng = np.random.default_rng([seed, 0x7E5])
        spread = params.efficiency.spread.value
        self.base_eff = {c: float(min(1.5, getattr(params.efficiency, c).value * math.exp(spread * rng.normal())))
                         for c in OP_CLASSES}
        self.phase = {c: float(rng.uniform(0, 2 * math.pi)) for c in OP_CLASSES}
        self.device_speed = np.exp(params.stragglers.device_sigma.value * rng.normal(size=cluster.num_devices))
        self._structures: dict[Plan, _Structure] = {}

    # --- draws -------------------------------------------------------------------------

    def _rng(self, step: int, attempt: int, tag: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step + 1, attempt, tag])  # step -1: the warm-up

    def efficiency(self, step: int) -> Efficiency:
        """True efficiency per operation class at ``step`` (the drift applied)."""
        amp, period = self.params.drift.amplitude.value, self.params.drift.period_steps.value
        f = {c: self.base_eff[c] * (1 + amp * math.sin(2 * math.pi * step / period + self.phase[c])) for c in OP_CLASSES}
        return Efficiency(**{c: float(min(1.5, max(1e-3, v))) for c, v in f.items()},
                          layer_pass_s=self.params.efficiency.layer_pass_s.value,
                          group_setup_s=self.params.transitions.group_setup_s.value,
                          transition_call_s=self.params.transitions.call_s.value)

    def lengths(self, step: int, mean: float) -> LengthStats:
        """The lengths step ``step`` generates when the trace's mean is ``mean``: the
        maximum is mean x a log-normal ratio, capped at the step's cap; the 95th
        percentile (unused by the cost model) halfway between mean and maximum."""
        p = self.params.lengths
        ratio = p.max_over_mean_median.value * math.exp(p.max_over_mean_sigma.value * self._rng(step, 0, 1).normal())
        cap = self.caps.cap_at(step)
        mean = min(float(mean), float(cap))
        top = int(min(cap, max(math.ceil(mean), round(mean * ratio))))
        return LengthStats(mean, (mean + top) / 2, top)

    def _jitter(self, step: int, attempt: int) -> np.ndarray:
        sigma = self.params.stragglers.step_sigma.value
        return np.exp(sigma * self._rng(step, attempt, 2).normal(size=self.cluster.num_devices))

    def _congested(self, eff: Efficiency, nodes: int) -> Efficiency:
        slow = 1 + self.params.congestion.per_doubling.value * math.log2(max(1, nodes))
        return eff.replace(allreduce_inter=eff.allreduce_inter / slow, p2p_inter=eff.p2p_inter / slow)

    # --- a plan's step -----------------------------------------------------------------

    def _structure(self, plan: Plan) -> _Structure:
        found = self._structures.get(plan)
        if found is not None:
            return found
        ex = explain(plan, self.work, self.cluster)
        per = self.cluster.devices_per_node
        stages = []
        for i, stage in enumerate(self.work.stages):
            sp = plan[stage.name]
            pp_inter, dp_inter = links_of(sp, self.cluster, stage.name)
            devs = np.array(sorted(sp.device_set), dtype=np.int64)
            stages.append((i, stage.name, pp_inter, dp_inter, devs, len({int(d) // per for d in devs})))
        groups = tuple(p.groups for p in ex.phases)
        classes: dict[tuple[str, ...], list[int]] = {}
        for m in ex.memory:
            classes.setdefault(tuple(sorted(n for n, _ in m.resident)), []).append(m.device)
        found = _Structure(tuple(stages), groups, tuple((k, tuple(v)) for k, v in classes.items()))
        self._structures[plan] = found
        return found

    def step(self, plan: Plan, step: int, mean_length: float, attempt: int = 0) -> StepTruth:
        """Run ``plan`` for step ``step`` (``attempt``: how many times it was tried before)."""
        s = self._structure(plan)
        lengths = self.lengths(step, mean_length)
        eff = self.efficiency(step)
        jitter = self.device_speed * self._jitter(step, attempt)
        work = self.work.with_lengths(lengths)
        longest = self.work.with_lengths(LengthStats(lengths.max, lengths.max, lengths.max))
        mem = self.params.memory
        seconds: dict[str, float] = {}
        resident: dict[str, int] = {}
        transient: dict[str, int] = {}
        for i, name, pp_inter, dp_inter, devs, nodes in s.stages:
            stage = self.work.stages[i]
            model = self.work.models[stage.model]
            sp = plan[name]
            e = self._congested(eff, nodes) if (pp_inter or dp_inter) else eff
            cost = stage_cost(stage, model, work, self.cluster, e, sp.tp, sp.pp, sp.dp, pp_inter=pp_inter,
                              dp_inter=dp_inter, recompute=sp.recompute, waves=sp.waves, keep_terms=False)
            seconds[name] = cost.seconds * float(jitter[devs].max())
            if stage.kind == "generation":
                m = stage_memory(stage, model, work, sp.tp, sp.pp, sp.dp, waves=sp.waves)
                frag = mem.kv_fragmentation.value
            else:
                m = stage_memory(stage, model, longest, sp.tp, sp.pp, sp.dp, recompute=sp.recompute)
                frag = mem.activation_fragmentation.value
            resident[name] = m.resident
            transient[name] = int(m.transient * (1 + frag))
        total = sum(max(sum(seconds[n] for n in g) for g in groups) for groups in s.groups)
        base = self.cluster.workspace_bytes + int(mem.extra_workspace_gib.value * GiB)
        peak, over, device_peaks = 0, [], {}
        for names, devices in s.classes:
            need = base + sum(resident[n] for n in names) + max(transient[n] for n in names)
            peak = max(peak, need)
            device_peaks[devices[0]] = need
            if need > self.cluster.device_memory_bytes:
                over += [(d, need, self.cluster.device_memory_bytes) for d in devices]
        peaks = {n: resident[n] + transient[n] for n in seconds}
        return StepTruth(total, seconds, lengths, peaks, device_peaks, peak, tuple(sorted(over)))

    # --- transitions ---------------------------------------------------------------------

    def link_model(self, step: int, nodes: int) -> LinkModel:
        """How transition nodes really run at ``step`` when the transition spans ``nodes``
        nodes: the true p2p efficiencies (inter-node congested), group set-up and call costs."""
        eff = self._congested(self.efficiency(step), nodes)
        return LinkModel(self.cluster.intra_node_bandwidth, self.cluster.device_share_of_inter_node(),
                         eff.p2p_intra, eff.p2p_inter, eff.group_setup_s, eff.transition_call_s)

    @property
    def restart_seconds(self) -> float:
        return self.params.restart.seconds.value
