"""A model-stage's part of the DAG without listing its primitives, when placements repeat.

The search lays every model-stage out back to back on a range of devices
(``StagePlan.start``). When the current and the target plan of a model-stage start on
the same device, its transition repeats: with ``L`` the larger EMU size, every ``L``
devices of the range both plans cover (the *overlap*) see the same Splits, Destroys
and Merges, translated; beyond it, either the target grows (each new EMU is Extended
from ``DONORS`` replicas taken round robin, in the order they came to exist, from the
overlap) or the current plan shrinks (each EMU left there is destroyed). This module
asks the state layer's ``stage_ops`` -- the one structure the runtime executes -- for
one period of the overlap, and derives the rest in closed form: which Extends share a
node (the first-fit grouping of consecutive, device-disjoint Extends), which replicas
each node reads, and every device's role, by tiling per-period and per-EMU patterns.
So the work grows with the number of distinct roles, not with devices or EMUs.

A model-stage that keeps its layout and moves to devices disjoint from its own, with as
many EMUs or more (a swap of halves of the cluster), is priced alike, by EMUs.

``regular_part`` returns None -- the caller then lists the ops (``general_part``) --
whenever a premise fails: plans not back to back, an overlap that is not
whole periods, hosts that do not repeat with the period, a period whose ops would not
be the same in the whole (an Extend or, beside a growing target, a Destroy). The part
it returns equals ``general_part``'s node for node and device for device (a property
test holds them to it); the ops themselves are listed on first use, from ``stage_ops``.
Pure: no I/O.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import chain, repeat

from nereus.planner.plan import StagePlan
from nereus.state.layout import Layout
from nereus.state.primitives import sub_layout
from nereus.state.transition import DONORS, Rep, stage_ops
from nereus.transition._stage import Effects, NodeSpec, Roles, Runs, StagePart, general_part
from nereus.transition.analytic import SpecBytes

__all__ = ["Hosts", "regular_part"]


class Hosts:
    """Which host each device is on, and whether hosts repeat along a range of devices:
    every host holds ``per_host`` consecutive devices (or one host holds them all)."""

    def __init__(
        self, host_of: Callable[[int], int], hosts: Sequence[int] | None, size: int
    ) -> None:
        self.of = host_of
        self.per_host: int | None = None
        self.single = False
        self.hosts: list[int] | None = None
        if hosts is None:
            return
        hosts = self.hosts = list(hosts[:size])
        if not hosts:
            return
        first = hosts[0]
        m = next(
            (i for i, h in enumerate(hosts) if h != first), None
        )  # the first device of another host
        if m is None:
            self.single = True
            return
        # hosts first, first+1, ... each ``m`` devices long: every ``m``-th device counts
        # up by one, and the devices at each place in a host say the same
        heads = hosts[::m]
        if heads == list(range(first, first + len(heads))) and all(
            hosts[j::m] == heads[: len(hosts[j::m])] for j in range(1, m)
        ):
            self.per_host = m

    def periodic(self, start: int, period: int) -> bool:
        """Whether moving by ``period`` devices from ``start`` keeps which devices share a host."""
        if self.single:
            return True
        m = self.per_host
        return m is not None and (
            (period % m == 0 and start % m == 0) or (m % period == 0 and start % period == 0)
        )

    def link_across(self, start: int, boundary: int, end: int) -> str | None:
        """``intra`` when ``[start, end)`` is on one host, ``inter`` when no host holds
        devices on both sides of ``boundary``, else None."""
        if self.single:
            return "intra"
        m = self.per_host
        if m is None:
            return None
        if start // m == (end - 1) // m:
            return "intra"
        return "inter" if boundary % m == 0 else None


def regular_part(
    stage: str,
    a: StagePlan,
    b: StagePlan,
    table: SpecBytes,
    hosts: Hosts,
    bucket: int,
    size: int,
    names: Sequence[str] | None,
    layout: Callable[[int, int], Layout] = Layout,
) -> StagePart | None:
    """The part of a model-stage whose plans repeat (see the module docstring), or None.
    ``layout(tp, pp)`` makes (or reuses) a ``Layout``."""
    x = a.start
    if x is None or b.start is None:
        return None
    if x != b.start:
        return _moved_part(stage, a, b, table, hosts, bucket, size, names)
    la, lb = layout(a.tp, a.pp), layout(b.tp, b.pp)
    same = (a.tp, a.pp) == (b.tp, b.pp)
    sa, sb = a.tp * a.pp, b.tp * b.pp
    na, nb = sa * a.dp, sb * b.dp
    period = sa if sa > sb else sb
    overlap = na if na < nb else nb
    if overlap % period or not hosts.periodic(x, period):
        return None
    periods, grow, shrink = overlap // period, (nb - overlap) // sb, (na - overlap) // sa
    link = hosts.link_across(x, x + overlap, x + nb) if grow else "intra"
    if link is None:
        return None
    ops: tuple = ()  # a period whose EMUs already are its targets needs no op
    nodes: list[NodeSpec] = []
    index: dict[str, int] = {}
    per_offset: list[list[tuple[int, int, int, int]]] = [[] for _ in range(period)]
    made_by_split: set[str] = set()
    if same:  # the period is one EMU, which the Extends read; beyond the overlap EMUs go
        per_period, member_at = 1, [0] * period
        if shrink:
            index["destroy"] = 0
            nodes.append(NodeSpec("destroy", shrink, 0, {"intra": 0, "inter": 0}, 0))
    else:  # both layouts cut evenly: tp and pp say which
        cur = [Rep(f"c{i}", la, tuple(range(i * sa, (i + 1) * sa))) for i in range(period // sa)]
        planned = stage_ops(
            cur, [Rep(f"t{j}", lb, tuple(range(j * sb, (j + 1) * sb))) for j in range(period // sb)]
        )
        if planned.sub != sub_layout(la, lb):
            return None
        ops = planned.ops
        kinds = {op.kind for op in ops}
        if "extend" in kinds or (grow and "destroy" in kinds):
            return None
        rel = (
            hosts.hosts[x : x + period]
            if hosts.hosts is not None
            else [hosts.of(x + o) for o in range(period)]
        )
        effects = Effects(table, rel.__getitem__, bucket)
        # local nodes: split, destroy, the Extends' groups, merge (those that exist)
        for kind in ("split", "destroy", "merge"):
            mine = [op for op in ops if op.kind == kind]
            if mine or (kind == "destroy" and shrink):
                index[kind] = len(nodes)
                nodes.append(
                    NodeSpec(
                        kind, shrink if kind == "destroy" else 0, 0, {"intra": 0, "inter": 0}, 0
                    )
                )
            for op in mine:
                _add_period_op(nodes[index[kind]], index[kind], op, effects, periods, per_offset)
                if kind == "split":
                    made_by_split.update(e.name for e in op.created)
        # the replicas the Extends read (after the Splits), in the order they came to exist
        live = {e.name: e for e in cur}
        for op in ops:
            if op.kind == "split":
                live.pop(op.inputs[0].name)
                live.update((e.name, e) for e in op.created)
        pool = list(live.values())
        per_period = len(pool)
        member_at = [0] * period
        for j, e in enumerate(pool):
            for o in e.devices:
                member_at[o] = j
    merge = nodes.pop() if "merge" in index else None  # it comes after the Extends
    extend_groups: list[tuple[int, list[tuple[int, int]]]] = []  # (count, pool intervals read)
    group_of: list[int] = []
    first = len(nodes)
    if grow:
        extend_groups, group_of = _extend_groups(grow, periods * per_period)
        held = _per_device(table, lb)
        total = sum(held)
        deps = {index["split"]} if made_by_split else set()
        for count, _ in extend_groups:
            links = {"intra": 0, "inter": 0}
            links[link] = count * total
            n = NodeSpec("extend", count, count * total, links, count if total else 0, set(deps))
            n.max_moved, n.acquires = max(held), total > 0
            nodes.append(n)
    if merge is not None:
        m = len(nodes)
        nodes.append(merge)
        freed = {e.name for op in ops if op.kind == "merge" for e in op.freed}
        merge.deps = {index["split"]} if freed & made_by_split else set()
        freed_at = sorted(j for j, e in enumerate(pool) if e.name in freed)
        merge.deps.update(
            first + g
            for g, (_, read) in enumerate(extend_groups)
            if _reads_any(read, freed_at, per_period)
        )
        for entries in per_offset:  # its local index moved past the Extends'
            entries[:] = [(m if li == index["merge"] else li, *rest) for li, *rest in entries]

    # every device's role
    roles = Roles()
    initial = _per_device(table, la) * (period // sa)
    codes: Runs = [([0], x)]
    if grow:
        bkt = bucket if total else 0
        reading = [
            (lo, hi, first + g) for g, (_, read) in enumerate(extend_groups) for lo, hi in read
        ]
        codes += _overlap_codes(
            roles, initial, per_offset, member_at, per_period, periods, reading, bkt
        )
        pattern = []
        alike = set(held)
        for g in range(first, first + len(extend_groups)):
            code = {h: roles.code(0, ((g, h + bkt, bkt, h),)) for h in alike}
            pattern.append(list(map(code.__getitem__, held)))
        if group_of:
            codes.append(([c for g in group_of for c in pattern[g]], 1))
        else:  # round r of P targets cycles through groups r*W .. r*W + W-1
            pool_size, w = periods * per_period, min(DONORS, periods * per_period)
            for r in range(-(-grow // pool_size)):
                count = min(pool_size, grow - r * pool_size)
                block = list(chain.from_iterable(pattern[r * w : r * w + min(w, count)]))
                reps, rest = divmod(count, w)
                codes += [(block, reps), (block[: rest * sb], 1)]
    else:
        codes.append(([roles.code(initial[o], per_offset[o]) for o in range(period)], periods))
        if shrink:
            d = index["destroy"]
            codes.append(([roles.code(h, ((d, 0, h, 0),)) for h in initial[:sa]], shrink))
    codes.append(([0], size - x - max(na, nb)))

    def materialize():
        part = general_part(stage, a, b, table, hosts.of, bucket, size, names)
        if [(n.kind, n.count) for n in part.nodes] != [(n.kind, n.count) for n in nodes]:
            raise AssertionError(
                f"{stage}: the listed ops group as {[(n.kind, n.count) for n in part.nodes]}, "
                f"the regular part as {[(n.kind, n.count) for n in nodes]}"
            )
        return [n.ops for n in part.nodes], part.results

    return StagePart(stage, nodes, codes, roles, materialize)


def _moved_part(
    stage: str,
    a: StagePlan,
    b: StagePlan,
    table: SpecBytes,
    hosts: Hosts,
    bucket: int,
    size: int,
    names: Sequence[str] | None,
) -> StagePart | None:
    """The part of a model-stage that keeps its layout and moves to devices disjoint from
    the ones it is on, with at least as many EMUs (else None): no target has a replica
    inside it, so every target is Extended from ``DONORS`` current EMUs taken round robin
    (the k-th reads ``k .. k+W-1`` mod their number, all of them kept until read) and
    every current EMU is destroyed once its readers are done. Node for node, device for
    device what ``general_part`` lists, with the work in EMUs rather than primitives."""
    if (a.tp, a.pp) != (b.tp, b.pp):
        return None
    xa, xb, s = a.start, b.start, a.tp * a.pp
    na, nb = s * a.dp, s * b.dp
    # overlapping ranges, or fewer targets than donors (some destroyed before they are read)
    if not (xa + na <= xb or xb + nb <= xa) or b.dp < a.dp:
        return None
    pool, grow = a.dp, b.dp
    groups, group_of = _extend_groups(grow, pool)
    w = min(DONORS, pool)
    held = _per_device(table, Layout(a.tp, a.pp))
    total = sum(held)
    bkt = bucket if total else 0  # an Extend that moves nothing takes no bucket
    at = hosts.hosts if hosts.hosts is not None else [hosts.of(d) for d in range(size)]
    src_hosts = [set(at[xa + i * s : xa + (i + 1) * s]) for i in range(pool)]
    # which group each target is in: listed, or by rounds of ``pool`` targets (W groups each)
    of = group_of or [(k // pool) * w + (k % pool) % w for k in range(grow)]
    nodes = [
        NodeSpec("extend", count, count * total, {"intra": 0, "inter": 0}, count if total else 0)
        for count, _ in groups
    ]
    for k in range(grow):
        links = nodes[of[k]].links
        sources = src_hosts[k % pool].union(*(src_hosts[(k + i) % pool] for i in range(1, w)))
        if len(sources) > 1:
            links["inter"] += total
            continue
        (h,) = sources
        t = xb + k * s
        intra = sum(v for o, v in enumerate(held) if at[t + o] == h)
        links["intra"] += intra
        links["inter"] += total - intra
    for n in nodes:
        n.max_moved, n.acquires = max(held), total > 0
    last = len(nodes)
    nodes.append(NodeSpec("destroy", pool, 0, {"intra": 0, "inter": 0}, 0, set(range(last))))
    # every device's role: a current EMU's devices are read by the groups that read it,
    # then destroyed; a target's devices are made by its group
    roles = Roles()
    readers: list[list[int]] = [[] for _ in range(pool)]
    for g, (_, read) in enumerate(groups):
        for lo, hi in read:
            for i in range(lo, hi):
                readers[i].append(g)
    by_readers: dict[tuple[int, ...], list[int]] = {}
    source_codes: list[int] = []
    for r in readers:
        key = tuple(r)
        got = by_readers.get(key)
        if got is None:
            reads = tuple((g, bkt, bkt, 0) for g in key)
            got = by_readers[key] = [roles.code(h, (*reads, (last, 0, h, 0))) for h in held]
        source_codes += got
    made = [
        [roles.code(0, ((g, h + bkt, bkt, h),) if h else ((g, 0, 0, 0),)) for h in held]
        for g in range(last)
    ]
    target_codes = list(chain.from_iterable(map(made.__getitem__, of)))
    first, second = (source_codes, target_codes) if xa < xb else (target_codes, source_codes)
    lo, hi = min(xa, xb), max(xa, xb)
    codes: Runs = [
        ([0], lo),
        (first, 1),
        ([0], hi - lo - len(first)),
        (second, 1),
        ([0], size - hi - len(second)),
    ]

    def materialize():
        part = general_part(stage, a, b, table, hosts.of, bucket, size, names)
        listed, moved = [(n.kind, n.count) for n in part.nodes], [(n.kind, n.count) for n in nodes]
        if listed != moved:
            raise AssertionError(
                f"{stage}: the listed ops group as {listed}, the moved part as {moved}"
            )
        return [n.ops for n in part.nodes], part.results

    return StagePart(stage, nodes, codes, roles, materialize)


def _per_device(table: SpecBytes, layout: Layout) -> list[int]:
    """Bytes each device of one ``layout`` EMU holds, in device order (pp-major)."""
    tp = layout.tp
    return list(
        chain.from_iterable(repeat(h, tp) for h in table.held_ranks(tp, layout.pp, layout.cuts))
    )


def _add_period_op(
    node: NodeSpec,
    li: int,
    op,
    effects: Effects,
    periods: int,
    per_offset: list[list[tuple[int, int, int, int]]],
) -> None:
    alloc, release, moved, links, copied = effects.of(op)
    node.count += periods
    node.bytes += periods * sum(moved.values())
    node.groups += periods if moved else 0
    node.max_moved = max(node.max_moved, max(moved.values(), default=0))
    node.max_copied = max(node.max_copied, copied)
    node.acquires = node.acquires or any(v > 0 for v in alloc.values())
    for k, v in links.items():
        node.links[k] += periods * v
    devs = {d for e in op.inputs for d in e.devices} | {d for e in op.created for d in e.devices}
    for d in devs:
        per_offset[d].append((li, alloc.get(d, 0), release.get(d, 0), moved.get(d, 0)))


def _extend_groups(
    count: int, pool: int
) -> tuple[list[tuple[int, list[tuple[int, int]]]], list[int]]:
    """The first-fit grouping of ``count`` Extends, the k-th reading pool replicas
    ``k .. k+W-1`` (mod ``pool``): per group, how many and the pool intervals it reads;
    and each Extend's group when no closed form applies (else [])."""
    w = min(DONORS, pool)
    out: list[tuple[int, list[tuple[int, int]]]] = []
    if pool % w == 0:
        for r in range(-(-count // pool)):
            n = min(pool, count - r * pool)
            for q in range(min(w, n)):
                k = len(range(q, n, w))
                hi = q + w * k
                read = (
                    [(0, pool)]
                    if hi - q >= pool
                    else [(q, hi)]
                    if hi <= pool
                    else [(q, pool), (0, hi - pool)]
                )
                out.append((k, read))
        return out, []
    used: list[set[int]] = []
    group_of = []
    for k in range(count):
        window = {(k + i) % pool for i in range(w)}
        g = next((i for i, u in enumerate(used) if u.isdisjoint(window)), None)
        if g is None:
            g = len(used)
            used.append(set())
        used[g] |= window
        group_of.append(g)
    for g, u in enumerate(used):
        read, lo = [], None
        for m in range(pool + 1):
            if m < pool and m in u:
                lo = m if lo is None else lo
            elif lo is not None:
                read.append((lo, m))
                lo = None
        out.append((group_of.count(g), read))
    return out, group_of


def _reads_any(read: list[tuple[int, int]], freed_at: list[int], per_period: int) -> bool:
    """Whether pool intervals ``read`` hold a replica whose place in its period is freed."""
    if not freed_at:
        return False
    for lo, hi in read:
        if hi - lo >= per_period:
            return True
        if any((m % per_period) in freed_at for m in range(lo, hi)):
            return True
    return False


def _overlap_codes(
    roles: Roles,
    initial: list[int],
    per_offset: list[list[tuple[int, int, int, int]]],
    member_at: list[int],
    per_period: int,
    periods: int,
    reading: list[tuple[int, int, int]],
    bkt: int,
) -> Runs:
    """Role codes of the overlap's devices: the period's own ops, plus the Extend nodes
    that read each device's replica (``reading``: pool interval -> node)."""
    pool = periods * per_period
    cuts = sorted({0, pool} | {lo for lo, _, _ in reading} | {hi for _, hi, _ in reading})
    # ``reading`` lists the nodes in ascending order: so do the segments' readers
    segments = [
        (lo, hi, tuple([n for rlo, rhi, n in reading if rlo <= lo < rhi]))
        for lo, hi in zip(cuts, cuts[1:], strict=False)
    ]
    keys = list(zip(initial, map(tuple, per_offset), strict=True))
    bases = list(dict.fromkeys(keys))  # offsets alike share a role
    base_of = list(map({k: i for i, k in enumerate(bases)}.__getitem__, keys))
    memo: dict[tuple, int] = {}

    def code(base: int, readers: tuple[int, ...]) -> int:
        got = memo.get((base, readers))
        if got is None:
            held, entries = bases[base]
            got = memo[(base, readers)] = roles.code(
                held, entries + tuple((n, bkt, bkt, 0) for n in readers)
            )
        return got

    starts = [lo for lo, _, _ in segments]
    pairs = set(zip(base_of, member_at, strict=True))
    out: Runs = []
    p = 0
    while p < periods:
        m0 = p * per_period
        lo, hi, readers = segments[bisect_right(starts, m0) - 1]
        if m0 + per_period <= hi:  # whole periods inside one segment
            q = min(periods, hi // per_period)
            each = [code(base, readers) for base in range(len(bases))]
            out.append((list(map(each.__getitem__, base_of)), q - p))
            p = q
            continue
        by_member = [segments[bisect_right(starts, m0 + j) - 1][2] for j in range(per_period)]
        each = {(b, j): code(b, by_member[j]) for b, j in pairs}
        out.append((list(map(each.__getitem__, zip(base_of, member_at, strict=True))), 1))
        p += 1
    return out
