"""The simulated cluster's ground truth: what a step, a transition and a restart take.

Written apart from the planner: it imports no cost, memory or explain function of
``nereus.planner`` (a test reads its imports), only the data types that describe a job
(``Workload``, ``ModelShape``, ``Plan``, ``ClusterSpec``). Its numbers come from
``ground_truth.toml`` (read and checked by ``nereus.sim.truth_params``), where every
table names its source:

- generation: prefill at the training table's share of peak; decode step by step over the
  step's sampled lengths, each decode step timed by the measured vLLM curve (batch x
  context), the batch shrinking as sequences end; TP splits it and adds two all-reduces
  per layer and step, PP adds a send per stage and step and buys no speed;
- inference and training: PaLM's FLOP count per token at the Megatron MFU of the TP
  degree (less for micro-batches of few tokens), TP all-reduces per layer, a 1F1B
  pipeline of (micro-batches + pp - 1) slots of its slowest stage, the DP gradient
  all-reduce and the AdamW update per optimizer step;
- collectives: bus bandwidth against message size over NVLink or the node's IB ports,
  inter-node bandwidth congested by the nodes spanned; stragglers (a model-stage waits
  for its slowest device) and a slow drift of the rates;
- memory: the optimizer's bytes per parameter, a per-layer activation count of the Llama
  architecture at the step's longest sequence, logits, the paged KV cache at its peak,
  the allocator's fragmentation against sequence length, a fixed workspace; a device
  over its full memory is a memory failure (``StepTruth.overflow``);
- moves: Extend (DP only) and TP/PP resharding, checkpoint restarts, by GPU count, from
  the paper's figures;
- devices with a CPU quota (``ClusterSpec.device_cores``: a host's worker processes) are
  no GPUs: their steps, memory, moves and restarts come from the measured ``[cpu]``
  table instead (``nereus.sim.cpu_truth``).

Deterministic: every draw comes from the seed, the step and the attempt, so every policy
meets the same lengths and jitter at a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nereus.config import require
from nereus.planner.cluster import ClusterSpec
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import LengthStats, ModelShape, ModelStage, Workload
from nereus.sim.cpu_truth import CpuTruth, uses_cpu_truth
from nereus.sim.traces import CapSchedule
from nereus.sim.truth_params import (
    PARAMS_PATH,
    SCHEMA,
    TruthParams,
    load_truth_params,
    truth_params_from,
)
from nereus.transition.schedule import LinkModel

__all__ = [
    "TruthParams",
    "load_truth_params",
    "GroundTruth",
    "StepTruth",
    "PARAMS_PATH",
    "GiB",
    "SCHEMA",
    "truth_params_from",
]

GiB = 2**30
BUCKETS = 32  # quantiles of a step's lengths the decode integral walks over


def log_interp(points: Sequence[Sequence[float]], x: float, *, extrapolate: bool = False) -> float:
    """y at ``x`` on ``points`` ([x, y], increasing x), linear in log x between points;
    outside them clamped, or carried on the nearest segment's slope when ``extrapolate``."""
    xs = [math.log(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    lx = math.log(max(x, 1e-300))
    if len(xs) == 1:
        return ys[0]
    if lx <= xs[0] or lx >= xs[-1]:
        if not extrapolate:
            return ys[0] if lx <= xs[0] else ys[-1]
        i = 0 if lx <= xs[0] else len(xs) - 2
    else:
        i = max(j for j in range(len(xs) - 1) if xs[j] <= lx)
    return ys[i] + (ys[i + 1] - ys[i]) * (lx - xs[i]) / (xs[i + 1] - xs[i])


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
class _Sample:
    """A step's response lengths: its stats and ``BUCKETS`` quantile means (ascending)."""

    stats: LengthStats
    buckets: np.ndarray


class GroundTruth:
    """The simulated cluster (see the module docstring).

    ``cluster``: the whole cluster (plans name its global device ids); ``work``: the job;
    ``caps`` (or one ``max_length``): the job's cap at every step; ``p95_ratio``: the
    trace's 95th percentile over its mean at every step (None: the file's default
    spread)."""

    def __init__(
        self,
        params: TruthParams,
        cluster: ClusterSpec,
        work: Workload,
        *,
        max_length: int | None = None,
        caps: CapSchedule | None = None,
        seed: int = 0,
        p95_ratio: Sequence[float] | None = None,
    ) -> None:
        require(
            caps is not None or max_length is not None,
            "max_length",
            max_length,
            "must be given when no cap schedule is",
        )
        if caps is None:
            assert max_length is not None
            require(max_length >= 1, "max_length", max_length, "must be >= 1 token")
            caps = CapSchedule.fixed(int(max_length))
        require(seed >= 0, "seed", seed, "must be >= 0")
        if p95_ratio is not None:
            require(
                all(r >= 1 for r in p95_ratio) and len(p95_ratio) >= 1,
                "p95_ratio",
                list(p95_ratio)[:4],
                "must hold a ratio >= 1 for every step",
            )
        self.params, self.cluster, self.work = params, cluster, work
        self.caps, self.max_length, self.seed = caps, caps.largest, seed
        self.p95_ratio = tuple(p95_ratio) if p95_ratio is not None else None
        t = params.tables
        self.flops_scale = cluster.peak_flops / t["device"]["peak_flops"]
        self.hbm = cluster.memory_bandwidth * t["decode"]["roofline_share"]
        rng = np.random.default_rng([seed, 0x7E5])
        self.phase = float(rng.uniform(0, 2 * math.pi))
        self.device_speed = np.exp(
            t["stragglers"]["device_sigma"] * rng.normal(size=cluster.num_devices)
        )
        # decode curve: t1 is the weight stream; what the second point adds beyond its KV
        # bytes is the per-sequence cost (compute, sampling), scaled to this device
        (b1, c1, t1), (b2, c2, t2) = sorted(t["decode"]["points"])[:2]
        ref_hbm = t["device"]["hbm_bytes_per_s"] * t["decode"]["roofline_share"]
        ref_kv = 131072  # the measured model (Llama-3.1-8B, bf16): K and V bytes per token
        per_seq = (t2 - t1) / (b2 - b1) - c2 * ref_kv / ref_hbm
        self.per_seq_s = max(0.0, per_seq) / self.flops_scale
        self.decode_weight_s_per_byte = (
            t1
            / t["decode"]["weight_bytes"]
            * (t["device"]["hbm_bytes_per_s"] / cluster.memory_bandwidth)
        )
        # devices with a CPU quota are CPU workers: the measured [cpu] table describes them
        self.cpu = CpuTruth(t["cpu"], cluster, work) if uses_cpu_truth(cluster) else None

    # --- draws -------------------------------------------------------------------------

    def _rng(self, step: int, attempt: int, tag: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step + 1, attempt, tag])  # step -1: the warm-up

    def drift(self, step: int) -> float:
        """The factor on every rate at ``step`` (1 +- the drift's amplitude)."""
        d = self.params.tables["drift"]
        return 1.0 + d["amplitude"] * math.sin(2 * math.pi * step / d["period_steps"] + self.phase)

    def _sigma(self, step: int) -> float:
        if self.p95_ratio is None:
            return float(self.params.tables["lengths"]["default_sigma"])
        r = self.p95_ratio[min(max(step, 0), len(self.p95_ratio) - 1)]
        z = 1.6448536269514722
        # a log-normal's p95 over its mean is exp(z s - s^2 / 2)
        return z - math.sqrt(max(0.0, z * z - 2 * math.log(r)))

    def _sample(self, step: int, mean: float) -> _Sample:
        n = self.work.sequences
        sigma = self._sigma(step)
        cap = self.caps.cap_at(step)
        draws = np.exp(
            math.log(mean) - sigma * sigma / 2 + sigma * self._rng(step, 0, 1).standard_normal(n)
        )
        lengths = np.sort(np.clip(np.rint(draws), 1, cap))
        stats = LengthStats(
            float(lengths.mean()),
            float(max(lengths.mean(), np.percentile(lengths, 95))),
            int(lengths[-1]),
        )
        return _Sample(stats, np.array([b.mean() for b in np.array_split(lengths, BUCKETS)]))

    def lengths(self, step: int, mean: float) -> LengthStats:
        """The lengths step ``step`` generates when the trace's mean is ``mean``."""
        return self._sample(step, mean).stats

    def _jitter(self, step: int, attempt: int) -> np.ndarray:
        sigma = self.params.tables["stragglers"]["step_sigma"]
        return np.exp(sigma * self._rng(step, attempt, 2).normal(size=self.cluster.num_devices))

    # --- collectives -----------------------------------------------------------------------

    def _bus_bytes_per_s(self, nbytes: float, inter: bool, nodes: int) -> float:
        c = self.params.tables["collectives"]
        share = log_interp(c["size_share"], max(nbytes, 1.0))
        if not inter:
            return c["intra_node_bytes_per_s"] * share
        per_device = (
            c["inter_node_port_bytes_per_s"] * c["ports_per_node"] / self.cluster.devices_per_node
        )
        slow = 1 + self.params.tables["congestion"]["per_doubling"] * math.log2(max(1, nodes))
        return per_device * share / slow

    def allreduce_s(self, nbytes: float, ranks: int, inter: bool, nodes: int = 1) -> float:
        """A ring all-reduce of ``nbytes`` over ``ranks`` devices."""
        if ranks <= 1:
            return 0.0
        c = self.params.tables["collectives"]
        latency = c["inter_latency_s"] if inter else c["intra_latency_s"]
        return latency + 2 * (ranks - 1) / ranks * nbytes / self._bus_bytes_per_s(
            nbytes, inter, nodes
        )

    def _send_s(self, nbytes: float, inter: bool) -> float:
        c = self.params.tables["collectives"]
        latency = c["inter_latency_s"] if inter else c["intra_latency_s"]
        return latency + nbytes / self._bus_bytes_per_s(nbytes, inter, 2)

    # --- one model-stage ---------------------------------------------------------------------

    def _mfu(self, tp: int, tokens: float) -> float:
        t = self.params.tables
        return log_interp(t["training"]["mfu_by_tp"], tp) * log_interp(
            t["short_batches"]["points"], max(tokens, 1.0)
        )

    @staticmethod
    def _stage_params(model: ModelShape, pp: int) -> tuple[float, float]:
        """(parameters of the heaviest pipeline stage for memory, for compute): the
        first stage holds the embedding, the last the head."""
        layers = math.ceil(model.num_layers / pp) * model.layer_params
        if pp == 1:
            return float(model.num_params), float(
                model.num_layers * model.layer_params + model.head_params
            )
        return float(max(layers + model.embed_params, layers + model.head_params)), float(
            layers + model.head_params
        )

    def _links(self, sp: StagePlan) -> tuple[bool, bool, int]:
        """Whether a pipeline crosses nodes, whether DP crosses nodes, nodes spanned."""
        per = self.cluster.devices_per_node
        pp_inter = any(len({d // per for d in emu}) > 1 for emu in sp.devices)
        firsts = {emu[0] // per for emu in sp.devices}
        nodes = len({d // per for d in sp.device_set})
        return pp_inter, len(firsts) > 1 or (sp.dp > 1 and pp_inter), nodes

    def _forward_pass_s(
        self,
        stage: ModelStage,
        model: ModelShape,
        sp: StagePlan,
        sample: _Sample,
        seqs: int,
        train: bool,
    ) -> float:
        """Inference or training of one replica's ``seqs`` sequences."""
        t = self.params.tables
        work, h, layers = self.work, model.hidden_size, model.num_layers
        prompt = work.prompt_length
        s = sample.buckets + prompt
        share = seqs / len(s)  # sequences each bucket stands for
        mem_params, compute_params = self._stage_params(model, sp.pp)
        stage_layers = math.ceil(layers / sp.pp)
        tokens = float(s.sum()) * share
        squares = float((s * s).sum()) * share
        if train:
            per_token, per_square, passes = (8, 16, 6) if sp.recompute else (6, 12, 4)
            flops = work.epochs * (
                per_token * compute_params * tokens + per_square * stage_layers * h * squares
            )
        else:
            per_token, per_square, passes = 2, 4, 2
            flops = per_token * compute_params * tokens + per_square * stage_layers * h * squares
        mb_tokens = work.micro_batch * (prompt + float(sample.stats.mean))
        rate = t["device"]["peak_flops"] * self.flops_scale * self._mfu(sp.tp, mb_tokens) * sp.tp
        micro = max(1, math.ceil(seqs / work.micro_batch)) * (work.epochs if train else 1)
        tp_s = (
            micro * stage_layers * passes * self.allreduce_s(mb_tokens * h * 2, sp.tp, False)
            if sp.tp > 1
            else 0.0
        )
        body = flops / rate + tp_s
        pp_inter, dp_inter, nodes = self._links(sp)
        if sp.pp > 1:
            # 1F1B: (micro-batches + pp - 1) slots of the slowest stage per optimizer step
            steps = work.optimizer_steps if train else 1
            per_step = micro / steps
            body *= (per_step + sp.pp - 1) / per_step
            body += micro * (2 if train else 1) * self._send_s(mb_tokens * h * 2, pp_inter)
        if not train:
            return body
        steps = work.optimizer_steps
        grads = 4.0 * mem_params / sp.tp  # fp32 gradients
        reduce_s = steps * self.allreduce_s(grads, sp.dp, dp_inter, nodes)
        o = t["optimizer"]
        update_s = steps * mem_params / sp.tp * o["bytes_per_param"] * o["update_passes"] / self.hbm
        return body + reduce_s + update_s

    def _decode_step_s(
        self, model: ModelShape, sp: StagePlan, batch: float, context: float
    ) -> float:
        weights = 2.0 * model.num_params
        kv = model.kv_bytes_per_token
        params = model.num_params / 8.03e9
        one = (
            weights * self.decode_weight_s_per_byte
            + max(0.0, batch - 1) * (context * kv / self.hbm + self.per_seq_s * params)
        ) / sp.tp
        if sp.tp > 1:
            one += (
                2 * model.num_layers * self.allreduce_s(batch * model.hidden_size * 2, sp.tp, False)
            )
        if sp.pp > 1:
            pp_inter = self._links(sp)[0]
            one += (sp.pp - 1) * self._send_s(batch * model.hidden_size * 2, pp_inter)
        return one

    def _generation_s(self, model: ModelShape, sp: StagePlan, sample: _Sample, seqs: int) -> float:
        t = self.params.tables
        limit = int(t["decode"]["max_concurrent"])
        at_once = max(1, min(limit, math.ceil(seqs / sp.waves)))
        waves = math.ceil(seqs / at_once)
        prompt = self.work.prompt_length
        pre_tokens = at_once * prompt
        rate = (
            t["device"]["peak_flops"]
            * self.flops_scale
            * sp.tp
            * t["prefill"]["share_of_training_mfu"]
            * self._mfu(sp.tp, pre_tokens)
        )
        compute_params = self._stage_params(model, 1)[1]
        prefill = (
            2 * compute_params * pre_tokens
            + 4 * model.num_layers * model.hidden_size * at_once * prompt * prompt
        ) / rate
        # decode: between two bucket lengths the batch holds the sequences not yet ended
        ends = np.concatenate([sample.buckets, [float(sample.stats.max)]])
        seconds, done = 0.0, 0.0
        for j, end in enumerate(ends):
            steps = float(end) - done
            if steps <= 0:
                continue
            active = (
                at_once * (len(sample.buckets) - j) / len(sample.buckets)
                if j < len(sample.buckets)
                else 1.0
            )
            seconds += steps * self._decode_step_s(
                model, sp, max(1.0, active), prompt + (done + end) / 2
            )
            done = float(end)
        return float(waves * (prefill + seconds))

    def _stage_seconds(self, stage: ModelStage, sp: StagePlan, sample: _Sample) -> float:
        model = self.work.models[stage.model]
        seqs = math.ceil(self.work.sequences / sp.dp)
        if stage.kind == "generation":
            return self._generation_s(model, sp, sample, seqs)
        return self._forward_pass_s(stage, model, sp, sample, seqs, stage.kind == "training")

    def _stage_bytes(self, stage: ModelStage, sp: StagePlan, sample: _Sample) -> tuple[int, int]:
        """(resident, transient) bytes of one device of the model-stage."""
        t = self.params.tables
        model = self.work.models[stage.model]
        h, prompt = model.hidden_size, self.work.prompt_length
        mem_params = self._stage_params(model, sp.pp)[0] / sp.tp
        longest = prompt + sample.stats.max
        frag = log_interp(t["fragmentation"]["points"], longest)
        if stage.kind == "generation":
            seqs = math.ceil(self.work.sequences / sp.dp)
            at_once = max(1, min(int(t["decode"]["max_concurrent"]), math.ceil(seqs / sp.waves)))
            kv = model.kv_bytes_per_token / (sp.tp * sp.pp)
            # the KV cache peaks where the sequences still running hold the most tokens
            b = sample.buckets
            held = max(at_once * (len(b) - j) / len(b) * (prompt + b[j]) for j in range(len(b)))
            transient = held * kv * (1 + t["fragmentation"]["kv_share"])
            transient += at_once * model.output_width * 4 / sp.tp  # a decode step's fp32 logits
            return int(2 * mem_params), int(transient)
        a = t["activations"]
        tokens = self.work.micro_batch * longest
        split = 2 + 4 * model.num_kv_heads / model.num_heads + 2 + 8 * model.intermediate_size / h
        per_layer = (a["replicated"] + split / sp.tp) * h
        logits = tokens * model.output_width * a["logit_bytes"] / sp.tp
        if stage.kind == "training":
            micro = max(
                1, math.ceil(math.ceil(self.work.sequences / sp.dp) / self.work.micro_batch)
            )
            in_flight = min(sp.pp, micro)
            layers = math.ceil(model.num_layers / sp.pp)
            if sp.recompute:
                acts = (
                    in_flight * layers * tokens * a["recompute_bytes_per_h"] * h
                    + tokens * per_layer
                )
            else:
                acts = in_flight * layers * tokens * per_layer
            resident = mem_params * t["optimizer"]["bytes_per_param"]
        else:
            acts = 2 * tokens * per_layer  # a forward pass keeps a layer's input and output
            resident = 2 * mem_params
        return int(resident), int((acts + logits) * (1 + frag))

    # --- a plan's step -----------------------------------------------------------------

    def _levels(self) -> list[list[ModelStage]]:
        level: dict[str, int] = {}
        for s in self.work.stages:
            level[s.name] = 1 + max((level[d] for d in s.deps), default=-1)
        out: list[list[ModelStage]] = [[] for _ in range(max(level.values()) + 1)]
        for s in self.work.stages:
            out[level[s.name]].append(s)
        return out

    def step(self, plan: Plan, step: int, mean_length: float, attempt: int = 0) -> StepTruth:
        """Run ``plan`` for step ``step`` (``attempt``: how many times it was tried before)."""
        sample = self._sample(step, mean_length)
        jitter = self.device_speed * self._jitter(step, attempt)
        slow = 1.0 / self.drift(step)
        seconds: dict[str, float] = {}
        resident: dict[str, int] = {}
        transient: dict[str, int] = {}
        cpu, stats = self.cpu, sample.stats
        for stage in self.work.stages:
            sp = plan[stage.name]
            devs = np.fromiter(sp.device_set, dtype=np.int64)
            if cpu is not None:
                base_s = cpu.stage_seconds(stage, sp, stats.mean, stats.max)
                resident[stage.name], transient[stage.name] = cpu.stage_bytes(stage, sp, stats.max)
            else:
                base_s = self._stage_seconds(stage, sp, sample)
                resident[stage.name], transient[stage.name] = self._stage_bytes(stage, sp, sample)
            seconds[stage.name] = base_s * slow * float(jitter[devs].max())
        if cpu is not None:
            return self._cpu_step(plan, sample, seconds, resident, transient, slow)
        total = 0.0
        for members in self._levels():
            # model-stages of one level that share a device run one after the other
            groups: list[tuple[set[int], float]] = []
            for s in members:
                devices, secs = set(plan[s.name].device_set), seconds[s.name]
                for g in [g for g in groups if g[0] & devices]:
                    groups.remove(g)
                    devices, secs = devices | g[0], secs + g[1]
                groups.append((devices, secs))
            total += max(secs for _, secs in groups)
        on: dict[int, list[str]] = {}
        for name, sp in plan:
            for d in sp.device_set:
                on.setdefault(d, []).append(name)
        classes: dict[tuple[str, ...], list[int]] = {}
        for d, names in on.items():
            classes.setdefault(tuple(sorted(names)), []).append(d)
        base = int(self.params.tables["workspace"]["gib"] * GiB)
        memory = self.cluster.device_memory_bytes
        peak, over, device_peaks = 0, [], {}
        for names, devices in classes.items():
            need = base + sum(resident[n] for n in names) + max(transient[n] for n in names)
            peak = max(peak, need)
            device_peaks[min(devices)] = need
            if need > memory:
                over += [(d, need, memory) for d in devices]
        peaks = {n: resident[n] + transient[n] for n in seconds}
        return StepTruth(
            total, seconds, sample.stats, peaks, device_peaks, peak, tuple(sorted(over))
        )

    def _cpu_step(
        self,
        plan: Plan,
        sample: _Sample,
        seconds: dict[str, float],
        resident: dict[str, int],
        transient: dict[str, int],
        slow: float,
    ) -> StepTruth:
        """A step on CPU workers (``nereus.sim.cpu_truth``): its model-stages one after the
        other, then the weight broadcasts and the controller's work; memory as the
        workers' ledgers hold it."""
        assert self.cpu is not None
        total = sum(seconds.values()) + self.cpu.step_seconds(plan, sample.stats.mean) * slow
        device_peaks = self.cpu.device_bytes(plan, resident, transient)
        memory = self.cluster.device_memory_bytes
        over = tuple((d, need, memory) for d, need in device_peaks.items() if need > memory)
        peaks = {n: resident[n] + transient[n] for n in seconds}
        return StepTruth(
            total, seconds, sample.stats, peaks, device_peaks, max(device_peaks.values()), over
        )

    # --- moves ----------------------------------------------------------------------------

    def _by_gpus(self, table: str, gpus: int) -> float:
        return log_interp(self.params.tables[table]["points"], max(1, gpus), extrapolate=True)

    def restart_seconds(self, plan: Plan) -> float:
        """A checkpoint restart onto ``plan`` (the paper's Table 4, by its GPU count; on
        CPU workers every engine started again, ``nereus.sim.cpu_truth``)."""
        if self.cpu is not None:
            return self.cpu.restart_seconds(plan)
        return self._by_gpus("restart", len(plan.devices))

    def transition_seconds(self, current: Plan, target: Plan, step: int = 0) -> float:
        """A live move ``current`` -> ``target``: the paper's TP/PP resharding figure when
        a model-stage changes TP or PP (scaled by its parameters), else its Extend figure
        when any model-stage's EMUs change; by the target's GPU count."""
        if current == target:
            return 0.0
        if self.cpu is not None:
            return self.cpu.move_seconds(current, target) / self.drift(step)
        gpus = len(target.devices)
        seconds = 0.0
        ref = self.params.tables["reshard"]["reference_params"]
        for stage in self.work.stages:
            a, b = current[stage.name], target[stage.name]
            if (a.tp, a.pp) != (b.tp, b.pp):
                params = self.work.models[stage.model].num_params
                seconds = max(seconds, self._by_gpus("reshard", gpus) * params / ref)
            elif a != b:
                seconds = max(seconds, self._by_gpus("extend", gpus))
        return seconds

    def link_model(self, step: int, nodes: int) -> LinkModel:
        """The truth's links for a transition over ``nodes`` nodes: what shares its nodes'
        seconds out of the move's total (``transition_seconds``)."""
        if self.cpu is not None:  # one host: every worker pair at the measured broadcast rate
            bw = self.cpu.bandwidth()
            return LinkModel(bw, bw, 1.0, 1.0, 0.0, 0.0)
        c = self.params.tables["collectives"]
        big = 2.0**28
        per_device = (
            c["inter_node_port_bytes_per_s"] * c["ports_per_node"] / self.cluster.devices_per_node
        )
        return LinkModel(
            self._bus_bytes_per_s(big, False, 1),
            per_device,
            1.0,
            self._bus_bytes_per_s(big, True, nodes) / per_device,
            0.0,
            0.0,
        )

    def reference_rates(self, step: int) -> dict[str, float]:
        """The truth's headline rates at ``step`` as shares of the cluster's nominal ones
        (what an oracle's search is told): training MFU at TP 1, the decode roofline,
        large-message bus bandwidths; and its memory terms (fragmentation at the cap,
        the fixed workspace in bytes)."""
        t = self.params.tables
        d = self.drift(step)
        big = 2.0**28
        intra = self._bus_bytes_per_s(big, False, 1) / self.cluster.intra_node_bandwidth
        inter = (
            self._bus_bytes_per_s(big, True, 2)
            * self.cluster.devices_per_node
            / self.cluster.inter_node_bandwidth
        )
        mfu = log_interp(t["training"]["mfu_by_tp"], 1)
        return {
            "gemm": mfu * d,
            "attention": mfu * d,
            "decode": t["decode"]["roofline_share"] * d,
            "allreduce_intra": intra,
            "allreduce_inter": inter,
            "p2p_intra": intra,
            "p2p_inter": inter,
            "memory_scale": 1
            + max(
                log_interp(t["fragmentation"]["points"], self.max_length),
                t["fragmentation"]["kv_share"],
            ),
            "memory_fixed_bytes": float(t["workspace"]["gib"] * GiB),
        }
