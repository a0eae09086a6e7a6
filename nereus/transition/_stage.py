"""One model-stage's share of the transition DAG: its nodes and every device's role.

A ``StagePart`` is what ``build_dag`` joins: the model-stage's nodes in the order its
primitives run (kind, how many primitives, bytes, bytes per link, groups made, the
nodes of the same model-stage each waits for), and, for every device, a *role*: the
bytes the model-stage holds there before the transition and, per node that touches the
device, what it allocates when it starts, releases when it ends and receives. Devices
with one role are alike for this model-stage; ``nereus.transition._classes`` joins the
model-stages' roles into classes of devices that are alike for the whole DAG, which is
what the scheduler counts memory over.

``general_part`` makes a part from the state layer's ``stage_ops`` (the structure the
runtime executes) op by op: consecutive ops of one kind on disjoint devices share a node
(unless one waits for the other); data edges by EMU, reader edges (a primitive that frees
an EMU waits for every one that reads it). ``_regular`` makes the same part without
listing the ops when the placements repeat; both price ops with ``Effects``.

``Effects.of(op)``: per device, the target shards it allocates (less the shards a Split
or Merge adopts from the source it frees), what it releases (freed sources), what it
receives (what its source on that device does not hold) and over which link, the most
one device copies from a source it holds (held there, not adopted); and one
transfer bucket on every device that sends or receives (an upper bound of the state
layer's ``min(bucket, bytes moved)``, equal once a device moves a bucket). Pure: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from nereus.planner.plan import StagePlan
from nereus.state.layout import Layout
from nereus.state.transition import Op, Rep, stage_ops
from nereus.transition.analytic import SpecBytes

__all__ = ["NodeSpec", "StagePart", "Roles", "Effects", "general_part", "unchanged_part", "reps_of"]

# a device's role for one model-stage: bytes held before, and per node of the
# model-stage touching it (local index, alloc, release, moved in)
Role = tuple[int, tuple[tuple[int, int, int, int], ...]]
# a list of per-device values as runs: (pattern, how many times it repeats), in order
Runs = list[tuple[list, int]]
_NODE = itemgetter(0)


class NodeSpec:
    """One node of a model-stage before it joins the DAG (deps: local indices). The
    general path also sets its ops, devices and per-device effects."""

    __slots__ = (
        "kind",
        "count",
        "bytes",
        "links",
        "groups",
        "deps",
        "ops",
        "devices",
        "alloc",
        "release",
        "moved",
        "max_moved",
        "max_copied",
        "acquires",
    )

    def __init__(
        self,
        kind: str,
        count: int,
        bytes: int,
        links: dict[str, int],
        groups: int,
        deps: set[int] | None = None,
        ops: tuple[Op, ...] | None = None,
        devices: set[int] | None = None,
        alloc: dict[int, int] | None = None,
        release: dict[int, int] | None = None,
        moved: dict[int, int] | None = None,
    ) -> None:
        self.kind, self.count, self.bytes, self.links, self.groups = (
            kind,
            count,
            bytes,
            links,
            groups,
        )
        self.deps = set() if deps is None else deps
        self.ops, self.devices, self.alloc, self.release, self.moved = (
            ops,
            devices,
            alloc,
            release,
            moved,
        )
        # the most one device receives, and whether it allocates anything anywhere
        self.max_moved = max(moved.values(), default=0) if moved is not None else 0
        self.max_copied = 0  # the most one device copies from a source it holds
        self.acquires = any(v > 0 for v in alloc.values()) if alloc is not None else False


@dataclass
class StagePart:
    """A model-stage's nodes, every device's role code (0: untouched, nothing held) as
    runs over devices ``0 .. size-1``, the roles (``Roles``), and -- for the executor,
    built on first use -- each node's ops and the replicas after the transition."""

    stage: str
    nodes: list[NodeSpec]
    codes: Runs
    roles: Roles
    materialize: Callable[[], tuple[list[tuple[Op, ...]], tuple[Rep, ...]]] | None = None
    results: tuple[Rep, ...] | None = None


class Roles:
    """Interns roles: the same role always gets the same code; code 0 is untouched. Per
    code it also keeps the bytes held before (``held``), the most the device could hold
    (``grows``: before, plus every allocation) and the nodes that touch it (``touch``)."""

    def __init__(self) -> None:
        self.roles: list[Role] = [(0, ())]
        self.held: list[int] = [0]
        self.grows: list[int] = [0]
        self.touch: list[tuple[int, ...]] = [()]
        self._code: dict[Role, int] = {(0, ()): 0}

    def code(self, initial: int, entries: Sequence[tuple[int, int, int, int]] = ()) -> int:
        role = (initial, tuple(sorted(entries)) if len(entries) > 1 else tuple(entries))
        c = self._code.get(role)
        if c is None:
            c = self._code[role] = len(self.roles)
            self.roles.append(role)
            self.held.append(initial)
            grows = initial
            for _, a, _, _ in role[1]:
                if a > 0:
                    grows += a
            self.grows.append(grows)
            self.touch.append(tuple(map(_NODE, role[1])))
        return c


def reps_of(stage: str, sp: StagePlan, names: Sequence[str] | None, tag: str = "") -> list[Rep]:
    layout = Layout(sp.tp, sp.pp)
    if names is not None:
        return [Rep(names[i], layout, tuple(devs)) for i, devs in enumerate(sp.devices)]
    return [Rep(f"{stage}.{tag}{i}", layout, tuple(devs)) for i, devs in enumerate(sp.devices)]


class Effects:
    """Per-op memory effect and traffic from analytic bytes (see the module docstring)."""

    def __init__(self, table: SpecBytes, host_of: Callable[[int], int], bucket_bytes: int) -> None:
        self.table, self.host_of, self.bucket = table, host_of, bucket_bytes

    def of(
        self, op: Op
    ) -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[str, int], int]:
        t, host_of = self.table, self.host_of
        alloc: dict[int, int] = {}
        release: dict[int, int] = {}
        moved: dict[int, int] = {}
        links = {"intra": 0, "inter": 0}
        copied = 0
        at = {
            d: (e.layout, divmod(i, e.layout.tp))
            for e in op.inputs
            for i, d in enumerate(e.devices)
        }
        sources = {host_of(d) for d in at}
        reuse = op.kind in (
            "split",
            "merge",
        )  # their sources are freed: unchanged shards are adopted
        for made in op.created:
            layout = made.layout
            tp = layout.tp
            ranks = t.held_ranks(tp, layout.pp, layout.cuts)
            for i, d in enumerate(made.devices):
                pos = divmod(i, tp)
                held = ranks[pos[0]]
                src = at.get(d)
                local, kept = (0, 0) if src is None else t.local_kept(src[0], src[1], layout, pos)
                if not reuse:
                    kept = 0
                if local - kept > copied:
                    copied = local - kept
                alloc[d] = alloc.get(d, 0) + held - kept
                if kept:
                    release[d] = (
                        release.get(d, 0) - kept
                    )  # the adopted shard stays; its source does not give it back
                if held - local:
                    moved[d] = moved.get(d, 0) + held - local
                    # intra when every other source device is on this device's host
                    intra = not sources or (len(sources) == 1 and host_of(d) in sources)
                    links["intra" if intra else "inter"] += held - local
        for e in op.freed:
            layout = e.layout
            tp = layout.tp
            ranks = t.held_ranks(tp, layout.pp, layout.cuts)
            for i, d in enumerate(e.devices):
                release[d] = release.get(d, 0) + ranks[i // tp]
        if moved and self.bucket:
            for d in set(moved) | set(at):
                alloc[d] = alloc.get(d, 0) + self.bucket
                release[d] = release.get(d, 0) + self.bucket
        return alloc, release, moved, links, copied


def _devices(op: Op) -> set[int]:
    out = {d for e in op.inputs for d in e.devices}
    out.update(d for e in op.created for d in e.devices)
    return out


def group_ops(ops: Sequence[Op], effects: Effects) -> list[NodeSpec]:
    """Nodes of one model-stage's ops, grouped: consecutive ops of one kind on disjoint
    devices share a node unless one waits for the other. Edges by data and by readers."""
    nodes: list[NodeSpec] = []
    made_by: dict[str, int] = {}  # EMU name -> node that creates it
    readers: dict[str, set[int]] = defaultdict(set)  # EMU name -> nodes that read it
    groups: list[tuple[int, set[int]]] = []  # open groups of the current run: (node, devices)
    run_kind = None
    for op in ops:
        if op.kind != run_kind:
            groups, run_kind = [], op.kind
        devs = _devices(op)
        deps = {made_by[e.name] for e in op.inputs if e.name in made_by}
        for e in op.freed:
            deps |= readers.get(e.name, set())
        at = next(
            (
                i
                for i, (nid, used) in enumerate(groups)
                if used.isdisjoint(devs) and nid not in deps
            ),
            None,
        )
        alloc, release, moved, links, copied = effects.of(op)
        moves = 1 if moved else 0
        if at is None:
            node = NodeSpec(
                op.kind,
                1,
                sum(moved.values()),
                links,
                moves,
                deps,
                (op,),
                set(devs),
                alloc,
                release,
                moved,
            )
            node.max_copied = copied
            groups.append((len(nodes), set(devs)))
            nodes.append(node)
            nid = len(nodes) - 1
        else:
            nid, used = groups[at]
            used |= devs
            node = nodes[nid]
            node.ops = (*node.ops, op)  # type: ignore[misc]
            node.count += 1
            node.devices |= devs  # type: ignore[operator]
            for src, dst in ((alloc, node.alloc), (release, node.release), (moved, node.moved)):
                for d, v in src.items():
                    dst[d] = dst.get(d, 0) + v  # type: ignore[index,union-attr]
            node.bytes += sum(moved.values())
            for k, v in links.items():
                node.links[k] = node.links.get(k, 0) + v
            node.groups += moves
            node.max_moved = max(node.max_moved, max(moved.values(), default=0))
            node.max_copied = max(node.max_copied, copied)
            node.acquires = node.acquires or any(v > 0 for v in alloc.values())
            node.deps |= deps
        node.deps.discard(nid)
        for e in op.created:
            made_by[e.name] = nid
        for e in op.inputs:
            readers[e.name].add(nid)
    return nodes


def general_part(
    stage: str,
    a: StagePlan,
    b: StagePlan,
    table: SpecBytes,
    host_of: Callable[[int], int],
    bucket: int,
    size: int,
    names: Sequence[str] | None,
) -> StagePart:
    """The part of a model-stage that moves, op by op from ``stage_ops`` (``size``: how
    many devices the DAG numbers)."""
    cur = reps_of(stage, a, names)
    planned = stage_ops(cur, reps_of(stage, b, None, "next"))
    nodes = group_ops(planned.ops, Effects(table, host_of, bucket))
    roles = Roles()
    initial = _initial(cur, table)
    touched: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for li, n in enumerate(nodes):
        for d in n.devices:  # type: ignore[union-attr]
            touched[d].append((li, n.alloc.get(d, 0), n.release.get(d, 0), n.moved.get(d, 0)))  # type: ignore[union-attr]
    codes = [0] * size
    for d in set(initial) | set(touched):
        codes[d] = roles.code(initial.get(d, 0), touched.get(d, ()))
    return StagePart(stage, nodes, [(codes, 1)], roles, results=planned.result)


def unchanged_part(stage: str, a: StagePlan, table: SpecBytes, size: int) -> StagePart:
    """A model-stage that does not move: only what it holds on each device."""
    roles = Roles()
    layout = Layout(a.tp, a.pp)
    pattern = [roles.code(table.held(layout, layout.position(i))) for i in range(layout.size)]
    if a.start is not None:
        runs: Runs = [([0], a.start), (pattern, a.dp), ([0], size - a.start - a.num_devices)]
    else:
        codes = [0] * size
        for devs in a.devices:
            for i, d in enumerate(devs):
                codes[d] = pattern[i]
        runs = [(codes, 1)]
    return StagePart(stage, [], runs, roles)


def _initial(reps: Sequence[Rep], table: SpecBytes) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in reps:
        for i, d in enumerate(e.devices):
            out[d] = out.get(d, 0) + table.held(e.layout, e.layout.position(i))
    return out
