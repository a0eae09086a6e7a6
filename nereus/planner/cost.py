"""Cost and memory model of one model-stage under one layout (docs/design.md §6).

Time: every model-stage's time is a sum of terms; each term is an *ideal* time per
operation class (bytes or FLOPs over the hardware's peak rate) divided by that class's
efficiency factor, so calibration is linear in 1/efficiency. Operation classes
(``OP_CLASSES``): ``gemm`` and ``attention`` (FLOPs / peak), ``decode`` (memory-bound
streaming of weights, KV cache and optimizer state / memory bandwidth),
``allreduce_intra``/``allreduce_inter`` (ring all-reduce bytes / link bandwidth plus
a per-step latency) and ``p2p_intra``/``p2p_inter`` (pipeline sends).

Devices of a fixed CPU capacity (``ClusterSpec.device_cores``) get their replica's
capacity in cores (its slowest device's); their small all-reduces are a ring of process
wake-ups (``ClusterSpec.collective_latency_steps``).

The efficiency factors and memory terms it divides and scales by are
``nereus.planner.efficiency.Efficiency`` (re-exported here), which checks their ranges.
Refuses nothing itself: layouts are checked by the search and ``explain``.

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from nereus.planner.cluster import ClusterSpec
from nereus.planner.efficiency import CONSERVATIVE, FIXED_COSTS, OP_CLASSES, Efficiency
from nereus.planner.workload import ModelShape, ModelStage, Workload
from nereus.state.spec import grad_bytes_per_param, optimizer_bytes_per_param

__all__ = [
    "OP_CLASSES",
    "FIXED_COSTS",
    "Efficiency",
    "Term",
    "StageCost",
    "StageMemory",
    "stage_cost",
    "stage_memory",
    "HEADROOM",
    "CONSERVATIVE",
    "usable_bytes",
]

HEADROOM = 0.10
UPDATE_BYTES = 16  # bytes streamed per parameter by an AdamW step (read+write)


@dataclass(frozen=True)
class Term:
    """One line of a model-stage's time: ideal seconds per op class and the formula."""

    name: str
    ideal: tuple[tuple[str, float], ...]
    formula: str = ""

    def seconds(self, eff: Efficiency) -> float:
        return sum(t / eff[c] for c, t in self.ideal)


class StageCost(NamedTuple):
    """The time of one replica of a model-stage (all replicas are equal), by term."""

    stage: str
    tp: int
    pp: int
    dp: int
    terms: tuple[Term, ...]
    seconds: float

    def ideal_by_class(self) -> dict[str, float]:
        """Ideal seconds per op class, and counts per fixed cost (``FIXED_COSTS``)."""
        out = dict.fromkeys(OP_CLASSES, 0.0)
        for term in self.terms:
            for c, t in term.ideal:
                out[c] = out.get(c, 0.0) + t
        return out

    def term_seconds(self, eff: Efficiency) -> dict[str, float]:
        return {t.name: t.seconds(eff) for t in self.terms}


class StageMemory(NamedTuple):
    """Bytes per device of one model-stage under one layout, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    kv_cache: int
    logits: int
    fixed: int = 0  # the calibrated fixed term (``Efficiency.memory_fixed_bytes``)

    @property
    def resident(self) -> int:
        """Held while the model-stage is idle too."""
        return self.params + self.grads + self.optimizer

    @property
    def transient(self) -> int:
        """Held only while the model-stage runs."""
        return self.activations + self.kv_cache + self.logits + self.fixed


def usable_bytes(cluster: ClusterSpec) -> int:
    """What plans may fill on one device: its memory less the cluster's headroom (10%
    by default, ``HEADROOM``)."""
    return int(cluster.device_memory_bytes * (1.0 - cluster.headroom))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _stage_params(model: ModelShape, pp: int, *, for_memory: bool) -> int:
    """Parameters held (or multiplied, for compute) by the heaviest pipeline stage."""
    layers = _ceil_div(model.num_layers, pp) * model.layer_params
    head_compute = model.hidden_size * model.output_width
    if for_memory:
        ends = (
            model.embed_params + model.head_params
            if pp == 1
            else max(model.embed_params, model.head_params)
        )
    else:
        ends = head_compute  # the embedding is a lookup; the head is a GEMM
    return layers + ends


def stage_memory(
    stage: ModelStage,
    model: ModelShape,
    work: Workload,
    tp: int,
    pp: int,
    dp: int,
    *,
    recompute: bool = False,
    waves: int = 1,
    scale: float = 1.0,
    fixed: float = 0.0,
    flash_attention: bool = True,
) -> StageMemory:
    """Bytes per device of ``stage`` at layout tp x pp with dp replicas (max over pp ranks).

    ``waves`` (generation): the replica decodes its sequences in that many successive
    batches, so its KV cache holds one batch. ``recompute`` (training): only each
    layer's input is kept per micro-batch in flight, plus one layer's activations.
    ``scale`` multiplies the transient bytes (``Efficiency.memory_scale``) and ``fixed``
    is added to them (``Efficiency.memory_fixed_bytes``). Without
    ``flash_attention`` every layer's activations also hold the attention scores and
    probabilities (``2 * rows * heads/tp * seq^2`` values). Activations are in the
    model's dtype (the per-layer figure is for 2-byte activations)."""
    b = model.bytes_per_param
    extra = int(math.ceil(fixed))
    p_dev = _ceil_div(_stage_params(model, pp, for_memory=True), tp)
    n_r = _ceil_div(work.sequences, dp)
    lengths = work.lengths_for_memory
    seq = work.prompt_length + lengths.mean
    layers = _ceil_div(model.num_layers, pp)
    logit_width = _ceil_div(model.output_width, tp)
    if stage.kind == "generation":
        kv_shards = min(tp, model.num_kv_heads)
        batch = _ceil_div(n_r, waves)
        kv = (
            batch
            * (work.prompt_length + lengths.max)
            * model.kv_bytes_per_token
            * layers
            / model.num_layers
            / kv_shards
        )
        return StageMemory(
            p_dev * b, 0, 0, 0, int(kv * scale), int(batch * logit_width * 4 * scale), extra
        )
    rows = min(work.micro_batch, n_r)
    t_mb = rows * seq
    per_layer = t_mb * model.hidden_size * (10 + 24 / tp) * model.bytes_per_param / 2
    if not flash_attention:
        per_layer += 2 * rows * _ceil_div(model.num_heads, tp) * seq * seq * model.bytes_per_param
    logits = int(t_mb * logit_width * 4 * scale)
    if stage.kind == "inference":
        return StageMemory(p_dev * b, 0, 0, int(per_layer * scale), 0, logits, extra)
    micro = _ceil_div(_ceil_div(work.batch, dp), work.micro_batch)
    in_flight = min(pp, micro)
    if recompute:
        act = t_mb * model.hidden_size * 2 * layers * in_flight + per_layer
    else:
        act = per_layer * layers * in_flight
    return StageMemory(
        p_dev * b,
        p_dev * grad_bytes_per_param(model.dtype),
        p_dev * optimizer_bytes_per_param(model.dtype),
        int(act * scale),
        0,
        2 * logits,
        extra,
    )


def _ring(n: int, nbytes: float, bw: float) -> float:
    return 2.0 * (n - 1) / n * nbytes / bw


class _Terms:
    """A stage's terms as they are added: each term's seconds at the efficiencies, their
    running total, and (``keep``) the terms themselves, formulas filled when asked."""

    __slots__ = ("effd", "keep", "formulas", "terms", "total")

    def __init__(self, eff: Efficiency, keep: bool, formulas: bool) -> None:
        self.effd = eff.as_dict()
        self.effd["layer_passes"] = eff["layer_passes"]
        self.keep, self.formulas = keep, formulas
        self.terms: list[Term] = []
        self.total = 0.0

    def add(
        self,
        name: str,
        ideal: tuple[tuple[str, float], ...],
        formula: tuple[str, tuple] | None = None,
    ) -> bool:
        # ``formula`` is (template, values): the search never pays for formatting text
        secs = 0.0
        for c, t in ideal:
            secs += t / self.effd[c]
        if secs <= 0:
            return False
        if self.keep:
            self.terms.append(
                Term(
                    name, ideal, formula[0].format(*formula[1]) if self.formulas and formula else ""
                )
            )
        self.total += secs
        return True


@dataclass(frozen=True)
class _Links:
    """The rates one replica sees: compute and memory (shared when devices share cores)
    and each collective's bandwidth, latency and op class."""

    busy: float
    peak: float
    mem_bw: float
    bw_tp: float
    a_tp: float
    bw_pp: float
    a_pp: float
    pp_cls: str
    bw_dp: float
    a_dp: float
    dp_cls: str
    hops: Callable[[int], int]  # latency steps of one small all-reduce among n ranks

    @classmethod
    def of(
        cls,
        cluster: ClusterSpec,
        devices: int,
        pp_inter: bool,
        dp_inter: bool,
        capacity: float | None = None,
    ) -> _Links:
        # devices sharing cores slow each other down; a capped device has its quota's worth
        busy = cluster.rate_share(devices, capacity)
        bw_tp, a_tp = cluster.intra_node_bandwidth * busy, cluster.intra_node_latency_s
        share = cluster.device_share_of_inter_node()
        bw_pp, a_pp, pp_cls = (
            (share, cluster.inter_node_latency_s, "p2p_inter")
            if pp_inter
            else (bw_tp, a_tp, "p2p_intra")
        )
        bw_dp, a_dp, dp_cls = (
            (share, cluster.inter_node_latency_s, "allreduce_inter")
            if dp_inter
            else (bw_tp, a_tp, "allreduce_intra")
        )
        return cls(
            busy,
            cluster.peak_flops * busy,
            cluster.memory_bandwidth * busy,
            bw_tp,
            a_tp,
            bw_pp,
            a_pp,
            pp_cls,
            bw_dp,
            a_dp,
            dp_cls,
            cluster.collective_latency_steps,
        )


def stage_cost(
    stage: ModelStage,
    model: ModelShape,
    work: Workload,
    cluster: ClusterSpec,
    eff: Efficiency,
    tp: int,
    pp: int,
    dp: int,
    *,
    pp_inter: bool,
    dp_inter: bool,
    recompute: bool = False,
    waves: int = 1,
    formulas: bool = False,
    keep_terms: bool = True,
    capacity: float | None = None,
) -> StageCost:
    """Time of one replica of ``stage`` at layout tp x pp with dp replicas.

    ``pp_inter``/``dp_inter`` say whether pipeline sends / DP all-reduces cross nodes.
    ``waves`` (generation) streams the weights once per decode step of every wave;
    ``recompute`` (training) adds a second forward: 8·N instead of 6·N FLOPs per token
    and 6 TP all-reduces per layer instead of 4.
    ``formulas`` fills each term's formula text (for ``explain``; the search skips it);
    ``keep_terms=False`` returns only the total seconds (terms empty), for the search.
    ``capacity``: the cores of the replica's slowest device, on a cluster with
    ``device_cores`` (default: the cluster's slowest device)."""
    links = _Links.of(cluster, tp * pp * dp, pp_inter, dp_inter, capacity)
    n_r = _ceil_div(work.sequences, dp)
    terms = _Terms(eff, keep_terms, formulas)
    if stage.kind == "generation":
        _generation_terms(terms, model, work, eff, links, tp, pp, n_r, waves)
    else:
        _pass_terms(
            terms, stage.kind == "training", model, work, eff, links, tp, pp, dp, n_r, recompute
        )
    return StageCost(stage.name, tp, pp, dp, tuple(terms.terms), terms.total)


def _generation_terms(
    terms: _Terms,
    model: ModelShape,
    work: Workload,
    eff: Efficiency,
    links: _Links,
    tp: int,
    pp: int,
    n_r: int,
    waves: int,
) -> None:
    """Prefill, decode (memory- or compute-bound, whichever is slower), the fixed cost
    of every forward pass, and the TP and PP traffic of one generation replica."""
    add, peak, mem_bw = terms.add, links.peak, links.mem_bw
    bw_tp, a_tp, bw_pp, a_pp = links.bw_tp, links.a_tp, links.bw_pp, links.a_pp
    h, L, b = model.hidden_size, model.num_layers, model.bytes_per_param
    n = model.num_params
    prompt, mean, steps = work.prompt_length, work.lengths.mean, work.lengths.max
    t_prompt, t_gen = n_r * prompt, n_r * mean
    add(
        "prefill",
        (
            ("gemm", 2 * n * t_prompt / (tp * peak)),
            ("attention", 2 * L * h * prompt**2 * n_r / (tp * peak)),
        ),
        (
            "2·N·{:.3g} tok/(tp·peak) + 2·L·h·s²·{} seq/(tp·peak), N={:.3g}, s={}",
            (t_prompt, n_r, n, prompt),
        ),
    )
    kv_shards = min(tp, model.num_kv_heads)
    ctx = prompt + mean / 2
    stream = (
        waves * steps * n * b / tp / mem_bw
        + t_gen * ctx * model.kv_bytes_per_token / kv_shards / mem_bw
    )
    compute = 2 * n * t_gen / (tp * peak)
    attn = 4 * L * h * ctx * t_gen / (tp * peak)
    if stream / eff.decode >= compute / eff.gemm + attn / eff.attention:
        add(
            "decode",
            (("decode", stream),),
            (
                (
                    "memory-bound: ({} waves·{} steps·{:.3g} B weights + {:.3g} tok·{:.0f} "
                    "ctx·{:.3g} B KV)/{:.3g} B/s"
                ),
                (
                    waves,
                    steps,
                    n * b / tp,
                    t_gen,
                    ctx,
                    model.kv_bytes_per_token / kv_shards,
                    mem_bw,
                ),
            ),
        )
    else:
        add(
            "decode",
            (("gemm", compute), ("attention", attn)),
            (
                "compute-bound: 2·N·{:.3g} tok/(tp·peak) + 4·L·h·{:.0f}·{:.3g}/(tp·peak)",
                (t_gen, ctx, t_gen),
            ),
        )
    # the batch goes stage after stage: every layer runs once per forward pass
    add(
        "layer passes",
        (("layer_passes", waves * (1 + steps) * L / links.busy),),
        (
            "{} waves·{} forward passes·{} layers·{:.2g} s fixed cost",
            (waves, 1 + steps, L, eff.layer_pass_s),
        ),
    )
    if tp > 1:
        nbytes = 2 * L * (t_prompt + t_gen) * h * b
        add(
            "tp collectives",
            (
                (
                    "allreduce_intra",
                    _ring(tp, nbytes, bw_tp) + 2 * L * waves * (1 + steps) * links.hops(tp) * a_tp,
                ),
            ),
            (
                "ring 2(tp-1)/tp·{:.3g} B/{:.3g} B/s + {} all-reduces·2·log2(tp)·{:.1e} s",
                (nbytes, bw_tp, 2 * L * waves * (1 + steps), a_tp),
            ),
        )
    if pp > 1:
        nbytes = (pp - 1) * (t_prompt + t_gen) * h * b
        add(
            "pp p2p",
            ((links.pp_cls, nbytes / bw_pp + (pp - 1) * waves * (1 + steps) * a_pp),),
            (
                "(pp-1)·{:.3g} tok·h·b/{:.3g} B/s + {} sends·{:.1e} s",
                (t_prompt + t_gen, bw_pp, (pp - 1) * waves * (1 + steps), a_pp),
            ),
        )


def _pass_terms(
    terms: _Terms,
    training: bool,
    model: ModelShape,
    work: Workload,
    eff: Efficiency,
    links: _Links,
    tp: int,
    pp: int,
    dp: int,
    n_r: int,
    recompute: bool,
) -> None:
    """Forward (inference) or forward and backward (training) passes over the step's
    sequences: compute, the fixed cost of every pass, TP and PP traffic and the pipeline
    bubble; training adds the DP gradient sync and the optimizer update."""
    add, peak, mem_bw = terms.add, links.peak, links.mem_bw
    bw_tp, a_tp, bw_pp, a_pp = links.bw_tp, links.a_tp, links.bw_pp, links.a_pp
    h, L, b = model.hidden_size, model.num_layers, model.bytes_per_param
    seq = work.prompt_length + work.lengths.mean
    passes = work.epochs if training else 1
    tokens = n_r * seq * passes
    mult = (4 if recompute else 3) if training else 1
    layers = _ceil_div(L, pp)
    p_compute = _stage_params(model, pp, for_memory=False)
    opt_steps = work.optimizer_steps if training else 1
    micro = _ceil_div(_ceil_div(work.batch if training else work.sequences, dp), work.micro_batch)
    micro_total = micro * opt_steps
    body: list[tuple[tuple[str, float], ...]] = []

    def add_body(
        name: str, ideal: tuple[tuple[str, float], ...], formula: tuple[str, tuple]
    ) -> None:
        if add(name, ideal, formula):
            body.append(ideal)

    kind = str(2 * mult)
    add_body(
        "compute",
        (
            ("gemm", mult * 2 * p_compute * tokens / (tp * peak)),
            ("attention", mult * 2 * layers * h * seq**2 * n_r * passes / (tp * peak)),
        ),
        (
            "{}·{:.3g} params/stage·{:.3g} tok/(tp·peak)"
            " + attention {}·2·{}·h·s²·{} seq/(tp·peak), s={:.0f}",
            (kind, p_compute, tokens, mult, layers, n_r, seq),
        ),
    )
    # a recomputed layer costs its checkpointing's fixed cost, not one bare forward
    fixed_passes = (3 + eff.recompute_passes if recompute else 3) if training else 1
    # every micro-batch's embedding, head and loss (a forward-only pass: a third of them)
    ends = eff.micro_batch_passes * (1.0 if training else 1.0 / 3)
    passes = micro_total * (fixed_passes * layers + ends)
    add_body(
        "layer passes",
        (("layer_passes", passes / links.busy),),
        (
            "{} micro-batches·({:.3g} passes·{} layers + {:.3g} ends)·{:.2g} s fixed cost",
            (micro_total, fixed_passes, layers, ends, eff.layer_pass_s),
        ),
    )
    if tp > 1:
        per_layer = (6 if recompute else 4) if training else 2
        nbytes = per_layer * layers * tokens * h * b
        add_body(
            "tp collectives",
            (
                (
                    "allreduce_intra",
                    _ring(tp, nbytes, bw_tp)
                    + per_layer * layers * micro_total * links.hops(tp) * a_tp,
                ),
            ),
            (
                "ring 2(tp-1)/tp·{}·{} layers·{:.3g} tok·h·b/{:.3g} B/s",
                (per_layer, layers, tokens, bw_tp),
            ),
        )
    if pp > 1:
        dirs = 2 if training else 1
        nbytes = dirs * tokens * h * b
        add_body(
            "pp p2p",
            ((links.pp_cls, nbytes / bw_pp + dirs * micro_total * a_pp),),
            (
                "{}·{:.3g} tok·h·b/{:.3g} B/s + {} sends·{:.1e} s",
                (dirs, tokens, bw_pp, dirs * micro_total, a_pp),
            ),
        )
        frac = (pp - 1) / micro
        bubble: dict[str, float] = {}
        for ideal in body:
            for c, t in ideal:
                bubble[c] = bubble.get(c, 0.0) + t * frac
        add(
            "pipeline bubble",
            tuple(bubble.items()),
            ("(pp-1)/M = {}/{} of the stage time above", (pp - 1, micro)),
        )
    if training:
        p_dev = _ceil_div(_stage_params(model, pp, for_memory=True), tp)
        if dp > 1:
            nbytes = p_dev * b  # the engines all-reduce gradients in the parameters' dtype
            add(
                "dp sync",
                (
                    (
                        links.dp_cls,
                        opt_steps * (_ring(dp, nbytes, links.bw_dp) + links.hops(dp) * links.a_dp),
                    ),
                ),
                (
                    "{} updates·ring 2(dp-1)/dp·{:.3g} B grads/{:.3g} B/s",
                    (opt_steps, nbytes, links.bw_dp),
                ),
            )
        add(
            "optimizer",
            (("decode", opt_steps * p_dev * UPDATE_BYTES / mem_bw),),
            ("{} updates·{:.3g} params·{} B/{:.3g} B/s", (opt_steps, p_dev, UPDATE_BYTES, mem_bw)),
        )
