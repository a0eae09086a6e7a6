"""``relabel``: a target plan moved onto the devices the current plan uses.

The search lays pools out from device 0 (``nereus.planner.search``); the running job's
plan may sit anywhere (its pools were laid out for another budget, nodes came and went).
Moving a model-stage to devices that hold none of its shards costs a whole copy, so before
a transition is priced or built the target is relabelled: its nodes are permuted onto the
available nodes, each target node onto the node that already holds most of what it
will hold (per model-stage, the devices at the same place in the node that the
model-stage uses now and will use then; between nodes that keep as much so, the
devices that hold the same shard: the same rank in an EMU of the same TP x PP, so an EMU
spread over nodes is matched node for node), the most in place over all nodes (a
min-cost flow over the kinds of nodes, so it is exact), then onto empty nodes before
busy ones; within each kind of node the nodes keeping something go to the first target
nodes, in ascending order, so the nodes of one current EMU become one target EMU and
EMUs laid out back to back stay so; a target that already keeps as much in place stays
as it is.

Promises: the result is the same plan -- every model-stage's tp, pp, dp, recompute and
waves, and its EMUs' device order -- under a permutation of whole nodes that keeps every
device's place in its node (so a TP group inside a node stays inside one), onto nodes
``0 .. devices // devices_per_node - 1``. A target that already matches the current plan
comes back unchanged. Pure: no I/O.

Refuses (``ConfigError``): a target that needs more nodes than there are, a
``devices_per_node`` that is not a positive integer.
"""

from __future__ import annotations

from collections import defaultdict

from nereus.config import require
from nereus.planner.plan import Plan, StagePlan

__all__ = ["relabel"]


def _usage(plan: Plan, per_node: int) -> dict[int, frozenset[tuple]]:
    """node -> what the plan puts on it: (model-stage, place in the node) pairs, and
    (model-stage, tp, pp, rank in the EMU) for the shard each device holds."""
    out: dict[int, set[tuple]] = defaultdict(set)
    for name, sp in plan:
        for emu in sp.devices:
            for rank, d in enumerate(emu):
                out[d // per_node].update(((name, d % per_node), (name, sp.tp, sp.pp, rank)))
    return {n: frozenset(u) for n, u in out.items()}


def _in_place(w: frozenset, h: frozenset, weight: int) -> int:
    """What a node holding ``h`` keeps in place of ``w``: model-stages at their place in
    the node first (``weight`` each), then shards, which only break ties between those."""
    common = w & h
    shards = sum(1 for x in common if len(x) == 4)
    return weight * (len(common) - shards) + shards


def relabel(
    current: Plan, target: Plan, *, devices_per_node: int = 1, devices: int | None = None
) -> Plan:
    """``target`` with its nodes permuted onto the nodes ``current`` uses (see the module
    docstring). ``devices``: how many devices there are (default: enough for both plans)."""
    per = devices_per_node
    require(isinstance(per, int) and per >= 1, "devices_per_node", per, "must be an integer >= 1")
    want, have = _usage(target, per), _usage(current, per)
    top = max(
        [d for _, sp in target for e in sp.devices for d in e]
        + [d for _, sp in current for e in sp.devices for d in e]
    )
    count = (devices if devices is not None else top + 1) // per
    require(
        len(want) <= count,
        "target plan",
        f"{len(want)} nodes of {per} devices",
        f"must fit the {count} nodes available",
    )
    # nodes alike for this question share a kind: (what the target puts there) and (what is there
    # now)
    wanted: dict[frozenset, list[int]] = defaultdict(list)
    for n in sorted(want):
        wanted[want[n]].append(n)
    there: dict[frozenset, list[int]] = defaultdict(list)
    for n in range(count):
        there[have.get(n, frozenset())].append(n)
    weight = 1 + sum(1 for w in want.values() for x in w if len(x) == 4)
    flow = _most_in_place(wanted, there, weight)
    moved: dict[int, int] = {}
    for w, need in wanted.items():
        held: list[int] = []  # nodes that keep some of it in place
        empty: list[int] = []
        for h, k in flow.get(w, {}).items():
            free = there[h]
            stay = [n for n in free if n in set(need)]  # a node that can stay where it is does
            pick = (stay + [n for n in free if n not in set(stay)])[:k]
            there[h] = [n for n in free if n not in set(pick)]
            (held if w & h else empty).extend(pick)
        # in order, the nodes keeping something first: the first target EMUs of every kind
        # take the nodes of the same current EMUs (an EMU over several nodes stays whole),
        # and EMUs laid out back to back stay so
        moved.update(zip(need, sorted(held) + sorted(empty), strict=True))
    if all(t == p for t, p in moved.items()):
        return target
    none: frozenset = frozenset()
    kept = (
        sum(_in_place(w, have.get(n, none), weight) for n, w in want.items())
        if max(want) < count
        else -1
    )
    if kept >= sum(_in_place(want[t], have.get(p, none), weight) for t, p in moved.items()):
        return target  # as much in place already: the target stays as it is (relabel is idempotent)
    return Plan(tuple((name, _moved(sp, moved, per)) for name, sp in target))


def _most_in_place(
    wanted: dict[frozenset, list[int]], there: dict[frozenset, list[int]], weight: int
) -> dict[frozenset, dict]:
    """How many nodes of each wanted kind go onto each kind of node there, keeping the
    most in place (``_in_place``), then using empty nodes before busy ones: a min-cost
    flow over the kinds (successive shortest paths; a handful of kinds)."""
    ws, hs = list(wanted), list(there)
    # the empty-node preference (one a node) never outweighs a unit kept in place
    big = 1 + 2 * sum(len(nodes) for nodes in wanted.values())
    # nodes: 0 source, 1..W wanted kinds, W+1..W+H kinds there, W+H+1 sink
    sink = len(ws) + len(hs) + 1
    cap: dict[tuple[int, int], int] = {}
    cost: dict[tuple[int, int], int] = {}

    def arc(u: int, v: int, c: int, k: int) -> None:
        cap[(u, v)], cost[(u, v)] = k, c
        cap[(v, u)], cost[(v, u)] = 0, -c

    for i, w in enumerate(ws, 1):
        arc(0, i, 0, len(wanted[w]))
        for j, h in enumerate(hs, len(ws) + 1):
            arc(i, j, -big * _in_place(w, h, weight) + (1 if h else 0), len(wanted[w]))
    for j, h in enumerate(hs, len(ws) + 1):
        arc(j, sink, 0, len(there[h]))
    out: dict[int, list[int]] = defaultdict(list)
    for u, v in cap:
        out[u].append(v)
    left = sum(len(wanted[w]) for w in ws)
    while left:
        dist, back = {0: 0}, {}
        for _ in range(sink + 1):  # Bellman-Ford: costs can be negative
            changed = False
            for u in list(dist):
                for v in out[u]:
                    if cap[(u, v)] > 0 and dist[u] + cost[(u, v)] < dist.get(v, 1 << 62):
                        dist[v], back[v] = dist[u] + cost[(u, v)], u
                        changed = True
            if not changed:
                break
        path, v = [], sink
        while v != 0:
            path.append((back[v], v))
            v = back[v]
        k = min(cap[e] for e in path)
        for u, v in path:
            cap[(u, v)] -= k
            cap[(v, u)] += k
        left -= k
    flow: dict[frozenset, dict] = {}
    for i, w in enumerate(ws, 1):
        for j, h in enumerate(hs, len(ws) + 1):
            if cap[(j, i)]:
                flow.setdefault(w, {})[h] = cap[(j, i)]
    return flow


def _moved(sp: StagePlan, onto: dict[int, int], per: int) -> StagePlan:
    emus = tuple(tuple(onto[d // per] * per + d % per for d in emu) for emu in sp.devices)
    return StagePlan(sp.tp, sp.pp, sp.dp, emus, sp.recompute, sp.waves)
