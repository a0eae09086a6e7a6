"""A plan's layout rescaled to another device count: DP follows the pool (docs/design.md §6).

``rescaled(plan, work, cluster)`` keeps every model-stage's TP, PP and recompute
setting, its generation engines' concurrency (the sequences a replica decodes at once)
and the grouping of model-stages into pools (model-stages whose devices overlap share a
pool), and gives each pool the largest valid size up to its share of ``cluster``'s
devices (the search's pool sizes: powers of two within a node or whole nodes, a
multiple of each member's TP x PP, a DP dividing the optimizer batch); devices that
rounding leaves idle go to the pools it served worst, while a valid size fits. Pools
are laid out from slot 0, largest first, as the search lays out its plans.

Why it exists: a move that changes only DP is a set of Extends and Destroys, which the
transition DAG can schedule whenever the new devices are free, while the search's best
plan may change TP or PP in place and need more memory mid-transition than a device
has. The Replanner offers the rescaled plan beside the search's targets, so a grown or
shrunk pool is used even when the best plan cannot be reached. The simulator's fixed
layouts scale with the pool through the same function.

Returns None when some pool gets no valid size. Checks no memory: the caller explains
the plan (``explain(...).fits``). Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nereus.planner.candidates import pool_sizes
from nereus.planner.cluster import ClusterSpec
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import Workload

__all__ = ["Layout", "layout_of", "rescaled", "rescaled_layout"]


@dataclass(frozen=True)
class Layout:
    """What a rescale keeps of a plan: per model-stage (tp, pp, recompute, concurrency:
    for generation the sequences a replica decodes at once, else 0), its pools (names of
    the model-stages sharing devices, and how many devices the pool had), the plan's
    model-stage order, and the device count the pools' shares are taken of."""

    stages: Mapping[str, tuple[int, int, bool, int]]
    pools: tuple[tuple[tuple[str, ...], int], ...]
    order: tuple[str, ...]
    devices: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def layout_of(
    plan: Plan,
    work: Workload,
    pools: Sequence[Sequence[str]] | None = None,
    devices: int | None = None,
) -> Layout:
    """The layout of ``plan``; ``pools`` (model-stage names per pool) default to the
    groups of model-stages whose device sets overlap; ``devices`` (the pool the plan was
    made for) defaults to the devices the plan uses."""
    kinds = {s.name: s.kind for s in work.stages}
    stages = {
        n: (
            sp.tp,
            sp.pp,
            sp.recompute,
            _ceil_div(_ceil_div(work.sequences, sp.dp), sp.waves)
            if kinds[n] == "generation"
            else 0,
        )
        for n, sp in plan
    }
    if pools is None:
        groups: list[tuple[set[str], set[int]]] = []
        for name, sp in plan:
            names, used = {name}, set(sp.device_set)
            for g in [g for g in groups if g[1] & used]:
                groups.remove(g)
                names |= g[0]
                used |= g[1]
            groups.append((names, used))
        sized = [(tuple(n for n in plan.names if n in g[0]), len(g[1])) for g in groups]
    else:
        sized = [(tuple(g), len(set().union(*(plan[n].device_set for n in g)))) for g in pools]
    return Layout(
        stages, tuple(sized), tuple(plan.names), len(plan.devices) if devices is None else devices
    )


def rescaled_layout(
    layout: Layout, work: Workload, cluster: ClusterSpec, devices: int | None = None
) -> Plan | None:
    """``layout`` with each pool at the largest valid size up to its share of ``devices``
    (default: all of ``cluster``'s), idle devices given to the pools rounding served
    worst, on slots from 0, largest pool first; None when a pool gets no valid size."""
    devices = cluster.num_devices if devices is None else devices
    sizes = pool_sizes(cluster, devices)

    def valid(names: tuple[str, ...]) -> list[int]:
        return [
            n
            for n in sizes
            if all(
                n % (layout.stages[s][0] * layout.stages[s][1]) == 0
                and work.batch % (n // (layout.stages[s][0] * layout.stages[s][1])) == 0
                for s in names
            )
        ]

    chosen: list[tuple[tuple[str, ...], int]] = []
    wanted: list[float] = []
    left = devices
    for names, base in sorted(layout.pools, key=lambda p: -p[1]):
        share = base * devices / layout.devices
        ok = [n for n in valid(names) if n <= min(left, int(share + 1e-9))]
        if not ok:
            return None
        chosen.append((names, ok[-1]))
        wanted.append(share)
        left -= ok[-1]
    # Rounding each share down to a valid size can leave devices idle (pools of 2 and 1
    # on 3 devices rescaled to 4 get 2 and 1): they go to the pool the rounding served
    # worst, at its next valid size, while one fits.
    while left > 0:
        for k in sorted(range(len(chosen)), key=lambda k: chosen[k][1] / wanted[k]):
            names, n = chosen[k]
            bigger = [m for m in valid(names) if n < m <= n + left]
            if bigger:
                chosen[k] = (names, bigger[0])
                left -= bigger[0] - n
                break
        else:
            break
    start, by_stage = 0, {}
    for names, n in chosen:
        for s in names:
            tp, pp, recompute, concurrency = layout.stages[s]
            dp = n // (tp * pp)
            # a fixed engine concurrency: more sequences per replica decode in more waves
            waves = _ceil_div(_ceil_div(work.sequences, dp), concurrency) if concurrency else 1
            by_stage[s] = StagePlan.on_range(tp, pp, dp, start, recompute=recompute, waves=waves)
        start += n
    return Plan(tuple((s, by_stage[s]) for s in layout.order))


def rescaled(plan: Plan, work: Workload, cluster: ClusterSpec) -> Plan | None:
    """``plan``'s layout rescaled to all of ``cluster``'s devices (see the module doc)."""
    return rescaled_layout(layout_of(plan, work), work, cluster)
