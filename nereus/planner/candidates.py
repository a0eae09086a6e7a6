"""The candidate layouts of one model-stage on a pool of n devices, each priced by the
cost and memory model: the first step of the plan search (``nereus.planner.search``).

A layout is (tp, pp, dp) with tp * pp * dp = n, tp within a node and dividing the heads,
pp no more than the layers, dp dividing the batch, and an EMU that packs into nodes;
training may also recompute its activations, generation decode in 1, 2, 4 ...
``MAX_WAVES`` successive batches. ``pool_sizes`` lists the pool sizes of the space.

Promises: with ``prune``, only layouts that fit a device alone and that no other layout
beats in seconds, resident and transient bytes at once. Pure arithmetic, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import Efficiency, stage_cost, stage_memory, usable_bytes
from nereus.planner.workload import Workload

__all__ = ["MAX_WAVES", "Candidate", "admits_layout", "pool_sizes", "stage_candidates"]

MAX_WAVES = 8


class Candidate(NamedTuple):
    """One valid layout of one model-stage at one pool size, with its time and bytes."""

    tp: int
    pp: int
    dp: int
    seconds: float
    resident: int
    transient: int
    recompute: bool = False
    waves: int = 1


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def pool_sizes(cluster: ClusterSpec, budget: int) -> list[int]:
    """Every pool size of the space up to ``budget`` devices, ascending: powers of two
    below a node (dividing it, so pools pack into nodes; on a single node any power of
    two fits, e.g. 2 of 3 devices left after one died), then whole nodes."""
    per = cluster.devices_per_node
    small = [
        s
        for s in _powers_of_two(per)
        if (per % s == 0 or cluster.nodes == 1) and s < per and s <= budget
    ]
    return small + [k * per for k in range(1, budget // per + 1)]


def _is_valid_layout(
    work: Workload, model_heads: int, layers: int, per_node: int, tp: int, pp: int, n: int
) -> bool:
    if n % (tp * pp):
        return False
    dp = n // (tp * pp)
    emu = tp * pp
    return (
        tp <= per_node
        and model_heads % tp == 0
        and pp <= layers
        and work.batch % dp == 0
        and (per_node % emu == 0 or emu % per_node == 0)
    )


def admits_layout(n: int, batch: int) -> bool:
    """Whether n = (power of two) x dp with dp dividing the batch, for some split."""
    e = 1
    while e <= n:
        if n % e == 0 and batch % (n // e) == 0:
            return True
        e *= 2
    return False


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _variants(kind: str, sequences_per_replica: int) -> list[tuple[bool, int]]:
    """(recompute, waves) options of a model-stage kind: training may recompute its
    activations; generation may decode in 1, 2, 4 ... MAX_WAVES successive batches."""
    if kind == "training":
        return [(False, 1), (True, 1)]
    if kind == "generation":
        return [(False, w) for w in _powers_of_two(min(MAX_WAVES, sequences_per_replica))]
    return [(False, 1)]


def stage_candidates(
    work: Workload,
    cluster: ClusterSpec,
    eff: Efficiency,
    stage_index: int,
    n: int,
    *,
    prune: bool = True,
) -> list[Candidate]:
    """Valid layouts of model-stage ``stage_index`` on a pool of ``n`` devices.

    With ``prune``, drops layouts that do not fit alone and those dominated in
    (seconds, resident, transient)."""
    stage = work.stages[stage_index]
    model = work.models[stage.model]
    per = cluster.devices_per_node
    cap = usable_bytes(cluster) - cluster.workspace_bytes
    out: list[Candidate] = []
    for tp in _powers_of_two(min(per, n)):
        for pp in _powers_of_two(n // tp):
            if not _is_valid_layout(work, model.num_heads, model.num_layers, per, tp, pp, n):
                continue
            dp = n // (tp * pp)
            for recompute, waves in _variants(stage.kind, _ceil_div(work.sequences, dp)):
                mem = stage_memory(
                    stage,
                    model,
                    work,
                    tp,
                    pp,
                    dp,
                    recompute=recompute,
                    waves=waves,
                    scale=eff.memory_scale,
                    fixed=eff.memory_fixed_bytes,
                    flash_attention=cluster.flash_attention,
                )
                if prune and mem.resident + mem.transient > cap:
                    continue
                cost = stage_cost(
                    stage,
                    model,
                    work,
                    cluster,
                    eff,
                    tp,
                    pp,
                    dp,
                    pp_inter=tp * pp > per,
                    dp_inter=n > per,
                    recompute=recompute,
                    waves=waves,
                    keep_terms=False,
                )
                out.append(
                    Candidate(
                        tp, pp, dp, cost.seconds, mem.resident, mem.transient, recompute, waves
                    )
                )
    if not prune:
        return out
    out.sort(key=lambda c: (c.seconds, c.resident, c.transient))
    kept: list[Candidate] = []
    for c in out:
        if not any(
            k.seconds <= c.seconds and k.resident <= c.resident and k.transient <= c.transient
            for k in kept
        ):
            kept.append(c)
    return kept
