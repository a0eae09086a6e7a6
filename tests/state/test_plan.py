"""Reshard plans by box intersection: A -> B -> A is bitwise, bytes are minimal, logical
state survives, sources are chosen by tier and balanced across replicas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.errors import StateError
from nereus.state import (
    EMU,
    OPTIMIZER_SLOTS,
    PLAN_CACHE_SIZE,
    DeviceSet,
    Layout,
    LogicalState,
    apply_plan,
    bytes_minimum,
    plan_part,
    plan_reshard,
)
from tests.state.helpers import (
    POW2,
    brute_force_minimum,
    global_tensors,
    layouts,
    shard_store,
    spec_for,
)

SLOTS = ("param", *OPTIMIZER_SLOTS)


@st.composite
def reshard_cases(draw):
    spec = spec_for(
        kv_heads=draw(POW2),
        tied=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
    )
    a, b = draw(layouts()), draw(layouts())
    dp = draw(st.sampled_from([1, 2]))
    pool = max(a.size * dp, b.size) * 2
    perm = draw(st.permutations(range(pool)))
    sources = [
        EMU(
            f"a{i}",
            "policy-training",
            spec,
            a,
            tuple(perm[i * a.size : (i + 1) * a.size]),
            SLOTS,
            LogicalState(7, 3, 1234),
        )
        for i in range(dp)
    ]
    # the target lands partly on the sources' devices, partly elsewhere
    shift = draw(st.integers(0, pool - b.size))
    target = EMU("b", "policy-training", spec, b, tuple(range(shift, shift + b.size)), SLOTS)
    hosts = tuple(draw(st.lists(st.integers(0, 2), min_size=pool, max_size=pool)))
    return sources, target, DeviceSet(hosts)


def _stores(emus: list[EMU], full) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    stores: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for e in emus:
        for d, tensors in shard_store(e, full).items():
            stores.setdefault(d, {})[e.name] = tensors
    return stores


def _assert_equal_stores(
    got: dict[int, dict[str, torch.Tensor]], want: dict[int, dict[str, torch.Tensor]]
):
    assert set(got) == set(want)
    for d in want:
        assert set(got[d]) == set(want[d]), d
        for k, t in want[d].items():
            assert got[d][k].dtype == t.dtype and torch.equal(got[d][k], t), (d, k)


@pytest.mark.timeout(400)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases())
def test_a_to_b_to_a_is_bitwise_and_minimal(case):
    sources, target, devices = case
    full = global_tensors(sources[0], seed=1)
    stores = _stores(sources, full)

    ab = plan_reshard(sources, target, devices)
    assert ab.bytes_moved == bytes_minimum(sources, target) == brute_force_minimum(sources, target)
    got_b = apply_plan(ab, stores)
    _assert_equal_stores(got_b, shard_store(target, full))
    assert ab.target.state == LogicalState(7, 3, 1234)

    back = sources[0].with_(name="a-again")
    ba = plan_reshard([ab.target], back, devices)
    assert ba.bytes_moved == brute_force_minimum([ab.target], back)
    got_a = apply_plan(ba, {d: {"b": t} for d, t in got_b.items()})
    _assert_equal_stores(got_a, {d: t for d, t in shard_store(back, full).items()})
    _assert_equal_stores(got_a, {d: stores[d]["a0"] for d in back.devices})
    assert ba.target.state == LogicalState(7, 3, 1234)


def test_bytes_already_on_the_target_device_are_not_moved():
    spec = spec_for()
    a = EMU("a", "policy-training", spec, Layout(2, 1), (0, 1))
    b = EMU("b", "policy-training", spec, Layout(4, 1), (0, 2, 1, 3))
    plan = plan_reshard([a], b)
    # devices 0 and 1 hold their new quarter already; only 2 and 3 receive
    assert {m.dst_device for m in plan.remote_moves()} == {2, 3}
    assert plan.bytes_moved == brute_force_minimum([a], b)
    same = plan_reshard([a], a.with_(name="a2"), reuse=True)
    assert same.bytes_moved == 0 and same.bytes_local == 0 and same.bytes_kept == a.nbytes


def test_sources_by_tier_then_balanced_across_replicas():
    spec = spec_for()
    # replicas on host 0 (devices 0,1) and host 1 (devices 2,3); target on host 1
    devices = DeviceSet((0, 0, 1, 1, 1, 1))
    r0 = EMU("r0", "policy-generation", spec, Layout(2, 1), (0, 1))
    r1 = EMU("r1", "policy-generation", spec, Layout(2, 1), (2, 3))
    t = EMU("t", "policy-generation", spec, Layout(2, 1), (4, 5))
    plan = plan_reshard([r0, r1], t, devices)
    assert {m.src_device for m in plan.moves} == {2, 3}  # same host wins
    # rank-aligned pairs: position i sends to position i
    assert all((m.src_device, m.dst_device) in {(2, 4), (3, 5)} for m in plan.moves)
    # one host: the load is spread across both replicas
    flat = plan_reshard([r0, r1], t, DeviceSet((0,) * 6))
    sent = {d: sum(m.nbytes for m in flat.moves if m.src_device == d) for d in range(4)}
    assert all(v > 0 for v in sent.values())
    assert max(sent.values()) <= 2 * min(sent.values())


def test_sources_must_agree_on_logical_state():
    spec = spec_for()
    r0 = EMU("r0", "policy-training", spec, Layout(1, 1), (0,), state=LogicalState(1, 1, 10))
    r1 = EMU("r1", "policy-training", spec, Layout(1, 1), (1,), state=LogicalState(2, 1, 10))
    with pytest.raises(StateError, match="disagree on logical state"):
        plan_reshard([r0, r1], EMU("t", "policy-training", spec, Layout(2, 1), (2, 3)))


def test_a_tensor_no_source_holds_is_refused():
    spec = spec_for()
    gen = EMU("g", "policy-generation", spec, Layout(1, 1), (0,))
    train = EMU("t", "policy-training", spec, Layout(1, 1), (1,), SLOTS)
    with pytest.raises(StateError, match="no source EMU .* holds .*:exp_avg"):
        plan_reshard([gen], train)
    # the other way round is a weight sync: only parameters move
    sync = plan_reshard([train], gen.with_(name="g2", devices=(2,)))
    assert sync.bytes_moved == spec.nbytes


def test_a_repeated_transition_is_planned_once():
    spec = spec_for()
    a = EMU("a", "policy-training", spec, Layout(2, 1), (0, 1), state=LogicalState(1, 1, 10))
    b = EMU("b", "policy-generation", spec, Layout(4, 1), (0, 1, 2, 3))
    first = plan_reshard([a], b)
    part = plan_part(first, 2)
    # the same geometry later (the sources have moved on): the same moves and parts,
    # the new logical state
    again = plan_reshard([a.with_(state=LogicalState(2, 2, 20))], b)
    assert again.moves is first.moves and again.keeps is first.keeps
    assert plan_part(again, 2) is part
    assert again.target.state == LogicalState(2, 2, 20)
    # anything a plan depends on makes another plan: hosts, names, reuse, layout
    assert plan_reshard([a], b, DeviceSet((0, 0, 1, 1))).moves is not first.moves
    renamed = plan_reshard([a.with_(name="a2")], b)
    assert renamed.moves is not first.moves and {m.src_emu for m in renamed.moves} == {"a2"}
    assert plan_reshard([a], b, reuse=True).moves is not first.moves
    assert plan_reshard([a], b.with_(layout=Layout(1, 1), devices=(3,))).moves is not first.moves
    # the memo is bounded: after PLAN_CACHE_SIZE other geometries the first is planned afresh
    for i in range(PLAN_CACHE_SIZE):
        plan_reshard([a], b.with_(name=f"b{i}"))
    fresh = plan_reshard([a], b)
    assert fresh.moves is not first.moves and fresh.moves == first.moves
