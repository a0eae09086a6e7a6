"""Brute force over the planner's plan space, written apart from the search.

It enumerates every set partition of the model-stages into pools, every assignment of
pool sizes, and every layout of every model-stage, lays the pools out on devices,
and evaluates each plan from its device sets: which links the EMUs' groups cross
(from device -> node), which model-stages of a phase share a device (they serialize),
and the memory of every single device. It shares only the per-model-stage cost and
memory formulas (``stage_cost``/``stage_memory``) with the search: "the same cost
model". No pruning, no Pareto sets, no dynamic programming.
"""

from __future__ import annotations

import itertools

from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import Efficiency, stage_cost, stage_memory
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import Workload, phases


def set_partitions(n: int):
    """Every partition of range(n), as lists of blocks (restricted growth strings)."""

    def grow(i: int, labels: list[int], top: int):
        if i == n:
            blocks: dict[int, list[int]] = {}
            for item, lab in enumerate(labels):
                blocks.setdefault(lab, []).append(item)
            yield list(blocks.values())
            return
        for lab in range(top + 1):
            yield from grow(i + 1, labels + [lab], max(top, lab + 1) if lab == top else top)

    yield from grow(0, [], 0)


def _sizes(cluster: ClusterSpec, budget: int) -> list[int]:
    per = cluster.devices_per_node
    out = [s for s in range(1, per) if per % s == 0 and (s & (s - 1)) == 0 and s <= budget]
    return out + list(range(per, budget + 1, per))


def _layouts(
    work: Workload, cluster: ClusterSpec, stage_index: int, n: int
) -> list[tuple[int, int, int]]:
    model = work.models[work.stages[stage_index].model]
    per = cluster.devices_per_node
    out = []
    for tp in (1, 2, 4, 8, 16, 32, 64):
        for pp in (1, 2, 4, 8, 16, 32, 64, 128):
            if tp * pp > n or n % (tp * pp):
                continue
            dp = n // (tp * pp)
            emu = tp * pp
            if tp > per or model.num_heads % tp or pp > model.num_layers or work.batch % dp:
                continue
            if per % emu and emu % per:
                continue
            kind = work.stages[stage_index].kind
            per_replica = -(-work.sequences // dp)
            if kind == "training":
                out += [(tp, pp, dp, False, 1), (tp, pp, dp, True, 1)]
            elif kind == "generation":
                out += [(tp, pp, dp, False, w) for w in (1, 2, 4, 8) if w <= per_replica]
            else:
                out.append((tp, pp, dp, False, 1))
    return out


def brute_force(work: Workload, cluster: ClusterSpec, eff: Efficiency, budget: int | None = None):
    """(best step seconds, a best plan, plans evaluated) or (inf, None, count)."""
    budget = cluster.num_devices if budget is None else budget
    stages = work.stages
    level = phases(stages)
    per = cluster.devices_per_node
    usable = int(cluster.device_memory_bytes * 0.9)
    node = lambda d: d // per  # noqa: E731
    cost_cache: dict = {}
    best, best_plan, count = float("inf"), None, 0

    def cost(i: int, tp: int, pp: int, dp: int, recompute: bool, waves: int, start: int):
        emus = [list(range(start + r * tp * pp, start + (r + 1) * tp * pp)) for r in range(dp)]
        pp_inter = any(len({node(d) for d in e}) > 1 for e in emus)
        dp_inter = any(len({node(e[k]) for e in emus}) > 1 for k in range(tp * pp))
        key = (i, tp, pp, dp, recompute, waves, pp_inter, dp_inter)
        if key not in cost_cache:
            st = stages[i]
            m = work.models[st.model]
            c = stage_cost(
                st,
                m,
                work,
                cluster,
                eff,
                tp,
                pp,
                dp,
                pp_inter=pp_inter,
                dp_inter=dp_inter,
                recompute=recompute,
                waves=waves,
            )
            mem = stage_memory(
                st,
                m,
                work,
                tp,
                pp,
                dp,
                recompute=recompute,
                waves=waves,
                scale=eff.memory_scale,
                fixed=eff.memory_fixed_bytes,
            )
            cost_cache[key] = (c.seconds, mem.resident, mem.transient)
        return cost_cache[key]

    for blocks in set_partitions(len(stages)):
        for sizes in itertools.product(_sizes(cluster, budget), repeat=len(blocks)):
            if sum(sizes) > budget:
                continue
            order = sorted(range(len(blocks)), key=lambda b: (-sizes[b], min(blocks[b])))
            span: dict[int, tuple[int, int]] = {}
            at = 0
            for b in order:
                for i in blocks[b]:
                    span[i] = (at, at + sizes[b])
                at += sizes[b]
            options = [
                _layouts(work, cluster, i, span[i][1] - span[i][0]) for i in range(len(stages))
            ]
            # Components: model-stages connected by sharing any device, found from the
            # spans. Memory and the serialized groups of a phase never cross components,
            # so each component's layouts are enumerated on their own, then every
            # combination of the components' (feasible) choices is evaluated.
            comp = {i: i for i in range(len(stages))}

            def find(i: int, comp=comp) -> int:
                while comp[i] != i:
                    i = comp[i]
                return i

            for a, b in itertools.combinations(range(len(stages)), 2):
                if span[a][0] < span[b][1] and span[b][0] < span[a][1]:
                    comp[find(a)] = find(b)
            members: dict[int, list[int]] = {}
            for i in range(len(stages)):
                members.setdefault(find(i), []).append(i)
            per_component = []
            for mem in members.values():
                devices = sorted({d for i in mem for d in range(*span[i])})
                feasible = []
                for choice in itertools.product(*(options[i] for i in mem)):
                    count += 1
                    rows = {
                        i: cost(i, *lay, span[i][0]) for i, lay in zip(mem, choice, strict=True)
                    }
                    ok = True
                    for d in devices:
                        here = [rows[i] for i in mem if span[i][0] <= d < span[i][1]]
                        if (
                            cluster.workspace_bytes
                            + sum(r[1] for r in here)
                            + max(r[2] for r in here)
                            > usable
                        ):
                            ok = False
                            break
                    if not ok:
                        continue
                    # per phase: the longest serialized group of this component
                    vec = {}
                    for p in set(level[i] for i in mem):
                        in_phase = [i for i in mem if level[i] == p]
                        group = {i: i for i in in_phase}

                        def root(i: int, group=group) -> int:
                            while group[i] != i:
                                i = group[i]
                            return i

                        for a, b in itertools.combinations(in_phase, 2):
                            if span[a][0] < span[b][1] and span[b][0] < span[a][1]:
                                group[root(a)] = root(b)
                        totals: dict[int, float] = {}
                        for i in in_phase:
                            totals[root(i)] = totals.get(root(i), 0.0) + rows[i][0]
                        vec[p] = max(totals.values())
                    feasible.append((vec, dict(zip(mem, choice, strict=True))))
                per_component.append(feasible)
            for picks in itertools.product(*per_component):
                step = sum(max(v.get(p, 0.0) for v, _ in picks) for p in sorted(set(level)))
                if step < best:
                    best = step
                    layout = {i: lay for _, ch in picks for i, lay in ch.items()}
                    best_plan = Plan(
                        tuple(
                            (
                                stages[i].name,
                                StagePlan.on_range(
                                    *layout[i][:3],
                                    span[i][0],
                                    recompute=layout[i][3],
                                    waves=layout[i][4],
                                ),
                            )
                            for i in range(len(stages))
                        )
                    )
    return best, best_plan, count
