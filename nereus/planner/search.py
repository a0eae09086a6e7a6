"""Plan search: the fastest feasible plan of a workload on a device budget (docs/design.md §6).

The search: per (model-stage, size) candidates (``nereus.planner.candidates``),
dropping the infeasible and the dominated (slower and no smaller); per (pool, size) the
Pareto set of per-phase time vectors over candidate combinations that fit; then dynamic
programming over subsets of model-stages: F(S) = Pareto over (devices, per-phase
vector) of pool(G) ⊕ F(S \\ G), G the pool holding S's first model-stage, ⊕ adding
devices and taking per-phase maxima.
Every step keeps exactly the non-dominated entries of a monotone objective, so the
result is the optimum of the space. To keep it fast, a quick search (each model-stage's
fastest and smallest layout) first finds a valid plan; every partial choice whose
optimistic completion (the fastest the remaining model-stages can be on the devices
left) is slower than a bound is dropped; the bound is first halfway between that floor
and the quick plan, then 80% of the way (exact whenever a plan is found under it),
else the quick plan.

Devices of unlike capacity (``ClusterSpec.device_cores``, one node): the search above
prices every pool at the slowest device's capacity; the chosen pools are then placed
on the devices by trying every order of the pools over the devices sorted fastest
first, each model-stage priced at its own devices' capacity (``explain``), so the
heavier pool gets the faster devices where that pays.

Raises ``InfeasiblePlan`` when no plan fits (names the budget and the usable memory).

More (how it works): docs/plans-and-adaptation.md.
"""

from __future__ import annotations

import itertools
import logging
import math
from bisect import bisect_right
from dataclasses import dataclass
from operator import le

from nereus.config import require
from nereus.errors import InfeasiblePlan
from nereus.planner.candidates import (
    Candidate,
    admits_layout,
    pool_sizes,
    stage_candidates,
)
from nereus.planner.cluster import ClusterSpec
from nereus.planner.cost import CONSERVATIVE, Efficiency, usable_bytes
from nereus.planner.explain import explain
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import Workload, phases

__all__ = [
    "SearchResult",
    "Alternative",
    "search",
    "place_by_capacity",
    "NAMED_PLACEMENTS",
]

log = logging.getLogger("nereus.planner")


@dataclass(frozen=True)
class Alternative:
    """A runner-up plan and how it was chosen (``label`` names its placement)."""

    label: str
    plan: Plan
    step_seconds: float


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    step_seconds: float
    pools: tuple[tuple[str, ...], ...]
    alternatives: tuple[Alternative, ...]


QUICK_KEEP = 2
# Guessed bounds, as fractions of the way from the lower bound to the incumbent.
GUESS: tuple[float, ...] = (0.5, 0.8)


def _pareto(entries: list[tuple]) -> list[tuple]:
    """Entries (key, payload) whose key no other entry's key is <= in every component.

    Sorting by the sum of the key puts every dominating key before what it dominates
    (a <= b componentwise implies sum(a) <= sum(b), whatever the units), so one pass
    against the kept keys suffices."""
    entries.sort(key=lambda e: sum(e[0]))
    kept_keys: list[tuple] = []
    kept: list[tuple] = []
    for e in entries:
        k = e[0]
        for q in kept_keys:
            if all(map(le, q, k)):
                break
        else:
            kept_keys.append(k)
            kept.append(e)
    return kept


class _Searcher:
    """One search: caches per (model-stage, size), per pool and per subset.

    ``keep`` truncates each candidate list to its keep-1 fastest layouts plus its
    smallest one (a quick search whose result is a valid plan, used as the incumbent);
    ``bound`` drops every partial choice whose optimistic completion is slower.

    Entries are (pareto key, per-phase seconds, payload). The Pareto key sums the
    phases whose model-stages are all inside the pool (or subset) at hand: no other
    pool has time there, so the objective adds those phases as they are."""

    def __init__(
        self,
        work: Workload,
        cluster: ClusterSpec,
        eff: Efficiency,
        budget: int,
        keep: int | None = None,
        bound: float = float("inf"),
        cands: dict[tuple[int, int], list[Candidate]] | None = None,
    ) -> None:
        self.work, self.cluster, self.eff, self.budget = work, cluster, eff, budget
        self.keep, self.bound = keep, bound
        self.stages = work.stages
        self.phase = phases(work.stages)
        self.num_phases = max(self.phase) + 1
        self.phase_masks = [
            sum(1 << i for i, p in enumerate(self.phase) if p == q) for q in range(self.num_phases)
        ]
        self.cap = usable_bytes(cluster) - cluster.workspace_bytes
        self.sizes = [n for n in pool_sizes(cluster, budget) if admits_layout(n, work.batch)]
        self.cands = cands if cands is not None else {}
        self._mine: dict[tuple[int, int], list[Candidate]] = {}
        self._least: dict[tuple[int, int], tuple[int, int]] = {}  # (min resident, min transient)
        self.pool_cache: dict[int, list[tuple]] = {}
        self.subset_cache: dict[int, list[tuple]] = {}
        # The fastest each model-stage can be on at most sizes[k] devices (a running
        # minimum): the model-stages outside a partial plan get at most the devices it
        # leaves, so per phase the slowest of their fastest times bounds that phase
        # from below; Σ_p max(partial[p], floor[p]) bounds every completion.
        self._fastest: list[list[float]] = []
        for i in range(len(self.stages)):
            best, run = math.inf, []
            for n in self.sizes:
                cs = self.candidates(i, n)
                if cs:
                    best = min(best, cs[0].seconds)
                run.append(best)
            self._fastest.append(run)
        self._floor_cache: dict[tuple[int, int], list[float]] = {}

    def floor_for(self, inside: int, used: int) -> list[float]:
        """Per-phase lower bounds for the model-stages outside ``inside`` on the devices
        left after ``used`` (inf when one of them cannot run on what is left)."""
        key = (inside, used)
        found = self._floor_cache.get(key)
        if found is None:
            k = bisect_right(self.sizes, self.budget - used)
            found = [0.0] * self.num_phases
            for i, p in enumerate(self.phase):
                if not inside >> i & 1:
                    found[p] = max(found[p], self._fastest[i][k - 1] if k else math.inf)
            self._floor_cache[key] = found
        return found

    def candidates(self, s: int, n: int) -> list[Candidate]:
        key = (s, n)
        mine = self._mine.get(key)
        if mine is not None:
            return mine
        if key not in self.cands:
            self.cands[key] = stage_candidates(self.work, self.cluster, self.eff, s, n)
        mine = found = self.cands[key]
        if self.keep and len(found) > self.keep:
            # the fastest layouts, and the smallest one, so a quick search still fits
            smallest = min(found, key=lambda c: (c.resident + c.transient, c.seconds))
            head = found[: self.keep - 1]
            mine = head if smallest in head else [*head, smallest]
        self._mine[key] = mine
        if mine:
            self._least[key] = (min(c.resident for c in mine), min(c.transient for c in mine))
        return mine

    def _hopeless(self, vec, floor: list[float]) -> bool:
        """True when every completion of per-phase seconds ``vec`` is slower than the bound."""
        return sum(max(v, f) for v, f in zip(vec, floor, strict=True)) > self.bound * (1 + 1e-9)

    def _key(self, mask: int, head: tuple, vec) -> tuple:
        owned = 0.0
        rest = []
        for p, v in enumerate(vec):
            if self.phase_masks[p] & ~mask:
                rest.append(v)
            else:
                owned += v
        return (*head, owned, *rest)

    def pool_options(self, mask: int) -> list[tuple]:
        """[(key, per-phase seconds, (n, choice))] Pareto-optimal for pool ``mask``."""
        if mask in self.pool_cache:
            return self.pool_cache[mask]
        members = [i for i in range(len(self.stages)) if mask >> i & 1]
        entries: list[tuple] = []
        for n in self.sizes:
            lists = [self.candidates(i, n) for i in members]
            if any(not c for c in lists):
                continue
            least = [self._least[(i, n)] for i in members]
            if sum(r for r, _ in least) + max(t for _, t in least) > self.cap:
                continue
            fastest = [cs[0] for cs in lists]
            low = [0.0] * self.num_phases
            for i, c in zip(members, fastest, strict=True):
                low[self.phase[i]] += c.seconds
            floor = self.floor_for(mask, n)
            if self._hopeless(low, floor):
                continue  # even each member at its fastest cannot beat the incumbent
            if sum(c.resident for c in fastest) + max(c.transient for c in fastest) <= self.cap:
                combos = [
                    tuple(fastest)
                ]  # each member at its fastest: dominates every other combination
            else:
                combos = self._fitting_combos(mask, members, lists, floor)
            for combo in combos:
                vec = [0.0] * self.num_phases
                for i, c in zip(members, combo, strict=False):
                    vec[self.phase[i]] += c.seconds
                if self._hopeless(vec, floor):
                    continue
                entries.append(
                    (
                        self._key(mask, (n,), vec),
                        tuple(vec),
                        (n, tuple(zip(members, combo, strict=False))),
                    )
                )
        self.pool_cache[mask] = _pareto(entries)
        return self.pool_cache[mask]

    def _fitting_combos(
        self, mask: int, members: list[int], lists: list[list[Candidate]], floor: list[float]
    ) -> list[tuple[Candidate, ...]]:
        """Combinations that fit, Pareto-pruned member by member on (Σ resident, max
        transient, per-phase seconds): all only grow as members are added and the
        objective and the memory test are monotone in them, so pruning early is exact."""
        states: list[tuple] = [((), (0.0,) * self.num_phases, (0, 0, ()))]
        # What the members not yet chosen add at least (fastest; least memory) and at
        # most (most memory), to drop hopeless states and to forget the memory of
        # states that fit whatever comes next (then only their seconds matter).
        rest = [0.0] * self.num_phases
        for i, cands in zip(members, lists, strict=False):
            rest[self.phase[i]] += cands[0].seconds
        suffix = []
        r_min = r_max = t_min = t_max = 0
        for cands in reversed(lists):
            suffix.append((r_min, r_max, t_min, t_max))
            r_min += min(c.resident for c in cands)
            r_max += max(c.resident for c in cands)
            t_min = max(t_min, min(c.transient for c in cands))
            t_max = max(t_max, max(c.transient for c in cands))
        suffix.reverse()
        cap = self.cap
        for k, (i, cands) in enumerate(zip(members, lists, strict=False)):
            p = self.phase[i]
            rest[p] -= cands[0].seconds
            r_min, r_max, t_min, t_max = suffix[k]
            grown = []
            limit = self.bound * (1 + 1e-9)
            for _, vec, (res0, tr0, combo) in states:
                # lower bound of the step with this state, all but phase p's term fixed
                base = [max(v + r, f) for v, r, f in zip(vec, rest, floor, strict=True)]
                others = sum(base) - base[p]
                start = vec[p] + rest[p]
                for c in cands:
                    if others + max(start + c.seconds, floor[p]) > limit:
                        continue
                    res, trans = res0 + c.resident, max(tr0, c.transient)
                    if res + r_min + max(trans, t_min) > cap:
                        continue
                    if res + r_max + max(trans, t_max) <= cap:
                        res, trans = -1, -1  # fits whatever comes next
                    new = list(vec)
                    new[p] += c.seconds
                    grown.append(
                        (self._key(mask, (res, trans), new), tuple(new), (res, trans, (*combo, c)))
                    )
            states = _pareto(grown)
        return [combo for _, _, (_, _, combo) in states]

    def _join(self, mask: int, left: list[tuple], right: list[tuple]) -> list[tuple]:
        entries = []
        for lk, lv, lp in left:
            for rk, rv, rp in right:
                dev = lk[0] + rk[0]
                if dev > self.budget:
                    continue
                vec = tuple(map(max, lv, rv))
                if self._hopeless(vec, self.floor_for(mask, dev)):
                    continue
                entries.append((self._key(mask, (dev,), vec), vec, (*lp, *rp)))
        return _pareto(entries)

    def cover(self, remaining: int) -> list[tuple]:
        """Pareto set of (devices, phase maxima) covering the model-stages in ``remaining``."""
        if remaining == 0:
            return [((0,), (0.0,) * self.num_phases, ())]
        if remaining in self.subset_cache:
            return self.subset_cache[remaining]
        low = remaining & -remaining
        rest = remaining ^ low
        entries: list[tuple] = []
        sub = rest
        while True:
            group = sub | low
            pool = self.pool_options(group)
            if pool:
                tail = self.cover(remaining ^ group)
                entries += self._join(remaining, [(k, v, (p,)) for k, v, p in pool], tail)
            if sub == 0:
                break
            sub = (sub - 1) & rest
        self.subset_cache[remaining] = _pareto(entries)
        return self.subset_cache[remaining]

    def best(self, partition: list[int] | None = None) -> tuple[float, tuple] | None:
        """Best (step seconds, pools) over all partitions, or over one given partition."""
        every = (1 << len(self.stages)) - 1
        if partition is None:
            front = self.cover(every)
        else:
            front = [((0,), (0.0,) * self.num_phases, ())]
            covered = 0
            for group in partition:
                covered |= group
                pool = [(k, v, (p,)) for k, v, p in self.pool_options(group)]
                front = self._join(covered, front, pool)
        if not front:
            return None
        _, vec, pools = min(front, key=lambda e: (sum(e[1]), e[0][0]))
        return sum(vec), pools

    def to_plan(self, pools: tuple) -> tuple[Plan, tuple[tuple[str, ...], ...]]:
        ordered = sorted(pools, key=lambda p: (-p[0], min(i for i, _ in p[1])))
        start = 0
        by_stage: dict[int, StagePlan] = {}
        names: list[tuple[str, ...]] = []
        for n, choice in ordered:
            for i, c in choice:
                by_stage[i] = StagePlan.on_range(
                    c.tp, c.pp, c.dp, start, recompute=c.recompute, waves=c.waves
                )
            names.append(tuple(self.stages[i].name for i, _ in sorted(choice)))
            start += n
        plan = Plan(tuple((self.stages[i].name, by_stage[i]) for i in range(len(self.stages))))
        return plan, tuple(names)


def place_by_capacity(
    plan: Plan, work: Workload, cluster: ClusterSpec, eff: Efficiency, budget: int | None = None
) -> tuple[Plan, float]:
    """``plan``'s pools (model-stages on the same devices) placed on the first ``budget``
    devices of a one-node cluster, in the order of pools that makes the step fastest
    with each device's own capacity; the devices are taken fastest first."""
    budget = cluster.num_devices if budget is None else budget
    pools: list[tuple[int, ...]] = []
    for _, sp in plan:
        devs = tuple(sorted(d for emu in sp.devices for d in emu))
        if devs not in pools:
            pools.append(devs)
    cores = cluster.device_cores or (1.0,) * cluster.num_devices
    fastest = sorted(range(budget), key=lambda d: (-cores[d], d))
    best: tuple[float, str, Plan] | None = None
    for order in itertools.permutations(range(len(pools))):
        onto: dict[int, int] = {}
        at = 0
        for k in order:
            for d in pools[k]:
                onto[d] = fastest[at]
                at += 1
        moved = Plan(
            tuple(
                (
                    name,
                    StagePlan(
                        sp.tp,
                        sp.pp,
                        sp.dp,
                        tuple(tuple(onto[d] for d in emu) for emu in sp.devices),
                        recompute=sp.recompute,
                        waves=sp.waves,
                    ),
                )
                for name, sp in plan
            )
        )
        seconds = explain(moved, work, cluster, eff).step_seconds
        if best is None or (seconds, str(moved)) < best[:2]:
            best = (seconds, str(moved), moved)
    assert best is not None
    return best[2], best[0]


def _named_partitions(work: Workload) -> dict[str, list[int]]:
    n = len(work.stages)
    every = (1 << n) - 1
    by_model: dict[str, int] = {}
    for i, s in enumerate(work.stages):
        by_model[s.model] = by_model.get(s.model, 0) | 1 << i
    gen = next(i for i, s in enumerate(work.stages) if s.kind == "generation")
    return {
        "colocated": [every],
        "separated": [1 << i for i in range(n)],
        "per-model": list(by_model.values()),
        "generation apart": [1 << gen, every ^ (1 << gen)],
    }


NAMED_PLACEMENTS = ("colocated", "separated", "per-model", "generation apart")


def search(
    work: Workload,
    cluster: ClusterSpec,
    eff: Efficiency = CONSERVATIVE,
    *,
    budget: int | None = None,
    alternatives: bool = True,
) -> SearchResult:
    """The fastest feasible plan of ``work`` on the first ``budget`` devices of ``cluster``.

    ``alternatives`` adds, fastest first, the best plan of each named placement
    (colocated, separated, per-model, generation apart) that differs from the chosen
    one, searched over each model-stage's fastest and smallest layout per pool size.
    Raises InfeasiblePlan when nothing fits."""
    budget = cluster.num_devices if budget is None else budget
    require(
        1 <= budget <= cluster.num_devices,
        "budget",
        budget,
        f"must be in [1, {cluster.num_devices}] devices",
    )
    # The named placements with each model-stage's fastest and smallest layouts give
    # valid plans quickly; the best of them bounds the exact search, which skips what cannot beat
    # it. Without alternatives, each named placement is searched under the best so far.
    quick = quick_named = _Searcher(work, cluster, eff, budget, keep=2)
    named: dict[str, tuple[float, tuple] | None] = {}
    incumbent = None
    for label, partition in _named_partitions(work).items():
        if not alternatives and incumbent is not None:
            quick.bound = incumbent[0]
            quick.pool_cache.clear()
        named[label] = got = quick.best(partition)
        if got is not None and (incumbent is None or got[0] < incumbent[0]):
            incumbent = got
    quick.bound = float("inf")
    inf = float("inf")
    quick_all = _Searcher(
        work,
        cluster,
        eff,
        budget,
        keep=QUICK_KEEP,
        bound=incumbent[0] if incumbent else inf,
        cands=quick.cands,
    )
    got = quick_all.best()
    if got is not None and (incumbent is None or got[0] < incumbent[0]):
        incumbent, quick = got, quick_all
    # The exact search under guessed bounds between the lower bound and the incumbent:
    # a plan found at or under a guess is optimal (nothing better was pruned); if none
    # is found, the next guess, and last the incumbent itself.
    found = None
    if incumbent is not None:
        low = sum(quick.floor_for(0, 0))
        for bound in [low + g * (incumbent[0] - low) for g in GUESS] + [incumbent[0]]:
            s = _Searcher(work, cluster, eff, budget, bound=bound, cands=quick.cands)
            found = s.best()
            if found is not None:
                break
    else:
        s = _Searcher(work, cluster, eff, budget, cands=quick.cands)
        found = s.best()
    if found is None or (incumbent is not None and incumbent[0] < found[0]):
        found, s = incumbent, quick
    if found is None:
        raise InfeasiblePlan(
            f"no plan of {work.algorithm} with {sorted(work.models)} fits {budget} devices of "
            f"{cluster.name} "
            f"({usable_bytes(cluster) / 2**30:.1f} GiB usable per device after "
            f"{cluster.headroom:.0%} headroom)"
        )
    step, pools = found
    plan, groups = s.to_plan(pools)
    if cluster.is_heterogeneous and cluster.nodes == 1:
        plan, step = place_by_capacity(plan, work, cluster, eff, budget)
    alts: list[Alternative] = []
    if alternatives:
        chosen = sorted(sorted(g) for g in groups)
        named_plans = {
            label: quick_named.to_plan(g[1])[0] for label, g in named.items() if g is not None
        }
        for label, got in named.items():
            same_placement = (
                sorted(
                    sorted(work.stages[i].name for i in range(len(work.stages)) if m >> i & 1)
                    for m in _named_partitions(work)[label]
                )
                == chosen
            )
            if got is None or same_placement or any(a.plan == named_plans[label] for a in alts):
                continue
            alts.append(Alternative(label, named_plans[label], got[0]))
        alts.sort(key=lambda a: a.step_seconds)
    log.debug(
        "search %s on %d devices: %.3f s/step, pools %s", work.algorithm, budget, step, groups
    )
    return SearchResult(plan, step, groups, tuple(alts))
