"""plan_reshard replays the steps of target shards cut like an earlier one; the plan must
equal, move for move and in order, a direct planner that works out every shard afresh
(the reference below), load-balanced source choices included."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.state import EMU, OPTIMIZER_SLOTS, DeviceSet, Layout, LogicalState, plan_reshard
from nereus.state.layout import box_intersect, box_numel, box_subtract
from nereus.state.reshard import Keep, Move, host_lookup
from nereus.state.spec import DTYPE_BYTES
from tests.state.helpers import POW2, layouts, spec_for


def reference_plan(
    sources: list[EMU], target: EMU, devices, reuse: bool
) -> tuple[list[Move], list[Keep]]:
    """Every target piece: first what its device holds, then each remaining box from the
    source ranked best by (same host, rank-aligned, load so far, device); on a full tie
    the first source piece wins, pieces taken in order of their box's first holder."""
    host_of = host_lookup(devices)
    cands = defaultdict(list)
    for emu in sources:
        for i, device in enumerate(emu.devices):
            for key, (shard, dtype) in emu.shards_on(device).items():
                cands[key] += [
                    (emu, device, piece, dtype, shard, emu.layout.position(i))
                    for piece in shard.pieces
                ]
    load: dict[int, int] = defaultdict(int)
    moves, keeps = [], []
    for t_index, device in enumerate(target.devices):
        t_pos, host = target.layout.position(t_index), host_of(device)
        for key, (shard, dtype) in target.shards_on(device).items():
            itemsize = DTYPE_BYTES[dtype]
            local = [c for c in cands[key] if c[1] == device]
            same = [c for c in local if c[4] == shard and c[3] == dtype]
            if reuse and same:
                keeps.append(Keep(same[0][0].name, device, key, shard.numel * itemsize))
                continue
            for piece in shard.pieces:
                need = [piece.box]
                for emu, _, sp, _, _, _ in local:
                    still = []
                    for box in need:
                        inter = box_intersect(box, sp.box)
                        if inter is None:
                            still.append(box)
                            continue
                        moves.append(
                            Move(
                                emu.name,
                                device,
                                device,
                                key,
                                inter,
                                sp.to_local(inter),
                                piece.to_local(inter),
                                box_numel(inter) * itemsize,
                            )
                        )
                        still += box_subtract(box, inter)
                    need = still
                while need:
                    box = need.pop()
                    best = None
                    first = {}
                    for c in cands[key]:
                        first.setdefault(c[2].box, len(first))
                    for emu, src_dev, sp, _, _, s_pos in sorted(
                        cands[key], key=lambda c: first[c[2].box]
                    ):
                        inter = box_intersect(box, sp.box)
                        if inter is None or src_dev == device:
                            continue
                        aligned = s_pos == t_pos and emu.layout == target.layout
                        rank = (host_of(src_dev) != host, not aligned, load[src_dev], src_dev)
                        if best is None or rank < best[0]:
                            best = (rank, emu, src_dev, sp, inter)
                    assert best is not None, (key, box)
                    _, emu, src_dev, sp, inter = best
                    nbytes = box_numel(inter) * itemsize
                    load[src_dev] += nbytes
                    moves.append(
                        Move(
                            emu.name,
                            src_dev,
                            device,
                            key,
                            inter,
                            sp.to_local(inter),
                            piece.to_local(inter),
                            nbytes,
                        )
                    )
                    need += box_subtract(box, inter)
    return moves, keeps


@st.composite
def replica_cases(draw):
    """Up to three source replicas (so load decides between tied sources), sometimes on
    one host, sometimes spread; the target partly on their devices."""
    spec = spec_for(
        kv_heads=draw(POW2),
        tied=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
    )
    a, b = draw(layouts()), draw(layouts())
    dp = draw(st.integers(1, 3))
    pool = max(a.size * dp, b.size) * 2
    perm = draw(st.permutations(range(pool)))
    slots = draw(st.sampled_from([("param",), ("param", *OPTIMIZER_SLOTS)]))
    sources = [
        EMU(
            f"a{i}",
            "policy-training",
            spec,
            a,
            tuple(perm[i * a.size : (i + 1) * a.size]),
            slots,
            LogicalState(1, 1, 1),
        )
        for i in range(dp)
    ]
    shift = draw(st.integers(0, pool - b.size))
    target = EMU("b", "policy-training", spec, b, tuple(range(shift, shift + b.size)), slots)
    hosts = draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(0, 2), min_size=pool, max_size=pool).map(
                lambda h: DeviceSet(tuple(h))
            ),
        )
    )
    return sources, target, hosts, draw(st.booleans())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replica_cases())
def test_plan_equals_the_direct_reference(case):
    sources, target, devices, reuse = case
    plan = plan_reshard(sources, target, devices, reuse=reuse)
    moves, keeps = reference_plan(sources, target, devices, reuse)
    assert list(plan.keeps) == keeps
    assert list(plan.moves) == moves


def test_replicas_on_one_host_are_balanced_like_the_reference():
    # every layer is cut alike, but the load on the two replicas changes from one layer
    # to the next: replayed steps must still pick the source the reference picks
    spec = spec_for(layers=8)
    r0 = EMU("r0", "policy-generation", spec, Layout(2, 1), (0, 1))
    r1 = EMU("r1", "policy-generation", spec, Layout(4, 1), (2, 3, 4, 5))
    t = EMU("t", "policy-generation", spec, Layout(1, 1), (6,))
    for devices in (None, DeviceSet((0, 0, 0, 0, 0, 0, 1))):
        plan = plan_reshard([r0, r1], t, devices)
        moves, _ = reference_plan([r0, r1], t, devices, reuse=False)
        assert list(plan.moves) == moves
        assert len({m.src_device for m in plan.moves}) == 6
