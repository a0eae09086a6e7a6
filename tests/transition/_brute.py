"""Brute force over a small transition DAG's orders, the reference the list scheduler is
checked against.

Only the DAG's data and reader edges bind here (``deps`` less ``resource_deps``: resource
edges are the scheduler's own choice), every device's bytes start at ``dag.initial`` and
move by each node's ``alloc`` when it starts and ``release`` when it ends, and a node
starts only when each of its devices stays within ``caps``.

- ``serial_order(dag, caps)``: some order that runs the nodes one at a time within the
  caps (depth first over topological orders), or None when there is none;
- ``best_makespan(dag, caps, duration)``: the shortest makespan over every serial order
  and every list schedule (a priority per permutation of the nodes: at each event, start
  in that order every ready node whose devices are idle and whose bytes fit), with
  ``duration(node)`` seconds per node; ``inf`` when no order fits.

Exponential: meant for DAGs of up to 8 nodes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from itertools import permutations

__all__ = ["serial_order", "best_makespan"]


def _deps(dag) -> dict[int, set[int]]:
    return {n.id: set(n.deps) - set(n.resource_deps) for n in dag.nodes}


def _fits(node, used: dict[int, int], caps: Mapping[int, int | None]) -> bool:
    for d, extra in node.alloc.items():
        cap = caps.get(d)
        if cap is not None and extra > 0 and used.get(d, 0) + extra > cap:
            return False
    return True


def serial_order(dag, caps: Mapping[int, int | None]) -> list[int] | None:
    deps = _deps(dag)
    nodes = {n.id: n for n in dag.nodes}
    seen: set[tuple[frozenset[int], tuple]] = set()

    def walk(done: list[int], used: dict[int, int]) -> list[int] | None:
        if len(done) == len(nodes):
            return done
        key = (frozenset(done), tuple(sorted(used.items())))
        if key in seen:
            return None
        seen.add(key)
        for nid, node in nodes.items():
            if nid in done or not deps[nid] <= set(done) or not _fits(node, used, caps):
                continue
            after = dict(used)
            for d, v in node.alloc.items():
                after[d] = after.get(d, 0) + v
            for d, v in node.release.items():
                after[d] = after.get(d, 0) - v
            got = walk([*done, nid], after)
            if got is not None:
                return got
        return None

    return walk([], dict(dag.initial))


def _list_schedule(
    dag,
    deps: dict[int, set[int]],
    order: tuple[int, ...],
    caps: Mapping[int, int | None],
    seconds: dict[int, float],
) -> float:
    nodes = {n.id: n for n in dag.nodes}
    used = dict(dag.initial)
    done: set[int] = set()
    running: set[int] = set()
    busy: set[int] = set()
    events: list[tuple[float, int]] = []
    clock = 0.0
    while len(done) < len(nodes):
        for nid in order:
            node = nodes[nid]
            if (
                nid in done
                or nid in running
                or not deps[nid] <= done
                or not busy.isdisjoint(node.devices)
            ):
                continue
            if not _fits(node, used, caps):
                continue
            running.add(nid)
            busy.update(node.devices)
            for d, v in node.alloc.items():
                used[d] = used.get(d, 0) + v
            heapq.heappush(events, (clock + seconds[nid], nid))
        if not events:
            return math.inf  # stuck: nothing runs and nothing can start
        clock, nid = heapq.heappop(events)
        node = nodes[nid]
        running.discard(nid)
        busy.difference_update(node.devices)
        done.add(nid)
        for d, v in node.release.items():
            used[d] = used.get(d, 0) - v
    return clock


def best_makespan(dag, caps: Mapping[int, int | None], duration: Callable) -> float:
    deps = _deps(dag)
    seconds = {n.id: float(duration(n)) for n in dag.nodes}
    best = math.inf
    if serial_order(dag, caps) is not None:
        best = sum(seconds.values())
    for order in permutations([n.id for n in dag.nodes]):
        best = min(best, _list_schedule(dag, deps, order, caps, seconds))
    return best
