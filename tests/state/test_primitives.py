"""The four primitives: what they create and free, their memory effect, their refusals,
and per-model-stage transitions (Split -> Destroy -> Extend -> Merge) run on tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.errors import OutOfMemory, StateError
from nereus.state import (
    EMU,
    OPTIMIZER_SLOTS,
    DeviceSet,
    Layout,
    LogicalState,
    apply_step,
    bytes_minimum,
    destroy,
    extend,
    merge,
    plan_stage_transition,
    split,
    sub_layout,
)
from nereus.state.transition import smaller_subs
from tests.state.helpers import global_tensors, shard_store, spec_for

SLOTS = ("param", *OPTIMIZER_SLOTS)
STAGE = "policy-training"


def _emu(name, layout, devices, spec=None, **kw):
    return EMU(name, STAGE, spec or spec_for(), layout, tuple(devices), SLOTS, **kw)


def _stores(emus, full):
    stores: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for e in emus:
        for d, tensors in shard_store(e, full).items():
            stores.setdefault(d, {})[e.name] = tensors
    return stores


def _check_holds(stores, emu, full):
    want = shard_store(emu, full)
    for d in emu.devices:
        got = stores[d][emu.name]
        assert set(got) == set(want[d])
        for k, t in want[d].items():
            assert torch.equal(got[k], t), (emu.name, d, k)


def test_sub_layout_is_min_tp_min_pp_cut_like_the_smaller_pp():
    assert sub_layout(Layout(4, 1), Layout(2, 2, (3,))) == Layout(2, 1)
    assert sub_layout(Layout(2, 4, (1, 2, 3)), Layout(8, 2, (5,))) == Layout(2, 2, (5,))
    with pytest.raises(StateError, match="smaller tp=3 must divide the larger tp=4"):
        sub_layout(Layout(4, 1), Layout(3, 1))


def test_split_memory_effect_counts_sources_until_the_end_and_one_bucket():
    spec = spec_for()
    a = _emu("a", Layout(2, 1), (0, 1), spec)
    step = split(a, Layout(1, 1), bucket_bytes=1024)
    assert [e.devices for e in step.created] == [(0,), (1,)]
    assert step.freed == (a,)
    for d in (0, 1):
        half, whole = a.bytes_on(d), step.created[d].bytes_on(d)
        kept = sum(k.nbytes for p in step.plans for k in p.keeps if k.device == d)
        assert kept > 0  # replicated norms stay in place
        assert step.memory.before[d] == half
        assert step.memory.peak[d] == half + whole - kept + 1024
        assert step.memory.after[d] == whole
    full = global_tensors(a)
    stores = _stores([a], full)
    apply_step(step, stores)
    for e in step.created:
        _check_holds(stores, e, full)
    assert all("a" not in stores[d] for d in (0, 1))


def test_merge_copies_local_shards_and_sends_only_the_rest():
    spec = spec_for()
    r0, r1 = _emu("r0", Layout(2, 1), (0, 2), spec), _emu("r1", Layout(2, 1), (1, 3), spec)
    step = merge([r0, r1], Layout(4, 1), (0, 1, 2, 3))
    assert step.bytes_moved == 0  # strided halves already hold every quarter
    assert set(step.freed) == {r0, r1}
    full = global_tensors(r0)
    stores = _stores([r0, r1], full)
    apply_step(step, stores)
    _check_holds(stores, step.created[0], full)


def test_extend_is_rank_aligned_and_sends_each_shard_once():
    spec = spec_for()
    a = _emu("a", Layout(2, 2), (0, 1, 2, 3), spec, state=LogicalState(5, 2, 77))
    step = extend(a, (4, 5, 6, 7))
    plan = step.plans[0]
    assert all(
        a.position(m.src_device) == step.created[0].position(m.dst_device) for m in plan.moves
    )
    assert step.bytes_moved == a.nbytes and step.freed == ()
    assert step.created[0].state == LogicalState(5, 2, 77)
    assert all(
        step.memory.after[d] == step.memory.before.get(d, 0) + a.bytes_on(d - 4)
        for d in range(4, 8)
    )


def test_extend_onto_devices_that_are_not_disjoint_is_refused():
    a = _emu("a", Layout(2, 1), (0, 1))
    with pytest.raises(
        StateError, match=r"devices \[1\] already hold a; Extend needs disjoint devices"
    ):
        extend(a, (1, 2))


def test_destroying_the_last_copy_is_refused_and_frees_nothing():
    spec = spec_for()
    a = _emu("a", Layout(2, 1), (0, 1), spec)
    b = _emu("b", Layout(1, 2), (2, 3), spec)
    gen = EMU("g", "policy-generation", spec, Layout(1, 1), (4,))
    full = global_tensors(a)
    stores = _stores([a, b], full)
    with pytest.raises(StateError, match="destroy a refused: it holds the last copy"):
        destroy(a, [])
    with pytest.raises(StateError, match="last copy .*:exp_avg"):
        destroy(a, [gen])  # a generation replica has no optimizer state
    _check_holds(stores, a, full)  # refusal happened before anything ran
    step = destroy(a, [b])
    assert step.memory.after[0] == 0 and step.memory.peak[0] == a.bytes_on(0)
    apply_step(step, stores)
    assert "a" not in stores[0] and "a" not in stores[1]
    _check_holds(stores, b, full)


def test_a_target_that_cannot_fit_a_device_is_refused():
    spec = spec_for()
    a = _emu("a", Layout(1, 1), (0,), spec)
    need = a.nbytes
    devices = DeviceSet((0, 0), (need * 2, need // 2))
    with pytest.raises(OutOfMemory) as info:
        extend(a, (1,), devices, bucket_bytes=0)
    assert (
        info.value.device == 1
        and info.value.need_bytes == need
        and info.value.budget_bytes == need // 2
    )
    # a split whose peak (old + new shards) exceeds the budget, counting what else is there
    b = _emu("b", Layout(2, 1), (0, 1), spec)
    tight = DeviceSet((0, 0), (b.bytes_on(0) * 3, b.bytes_on(1) * 3))
    split(b, Layout(1, 1), tight, bucket_bytes=0)
    with pytest.raises(OutOfMemory, match="out of memory on device 0 for split"):
        split(b, Layout(1, 1), tight, used={0: b.bytes_on(0) * 2}, bucket_bytes=0)


def test_without_a_disjoint_source_the_transition_retries_with_a_smaller_t_sub():
    a = _emu("a", Layout(2, 1), (0, 1))
    t = _emu("t", Layout(2, 1), (1, 2))
    plan = plan_stage_transition([a], [t])
    assert plan.sub == Layout(1, 1)
    # one replica on device 1 (what it lacks comes from device 0), then a Merge onto (1, 2):
    # every byte moved once, where it is needed
    assert [s.kind for s in plan.steps] == ["split", "merge"]
    assert plan.bytes_moved == bytes_minimum([a], t)
    assert [(x.tp, x.pp) for x in smaller_subs(Layout(4, 2, (3,)))] == [
        (4, 2),
        (2, 2),
        (1, 2),
        (1, 1),
    ]
    assert smaller_subs(Layout(1, 4, (1, 2, 3)))[-2:] == [Layout(1, 2, (2,)), Layout(1, 1)]


POW2 = st.sampled_from([1, 2, 4])


@st.composite
def transition_cases(draw):
    spec = spec_for(kv_heads=draw(st.sampled_from([1, 2, 4])), tied=draw(st.booleans()))
    a, b = Layout(draw(POW2), draw(POW2)), Layout(draw(POW2), draw(POW2))
    dp_a, dp_b = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    pool = max(a.size * dp_a, b.size * dp_b)
    offset = draw(st.sampled_from([0, pool]))  # same devices, or all new ones
    cur = [
        _emu(f"c{i}", a, range(i * a.size, (i + 1) * a.size), spec, state=LogicalState(3, 4, 99))
        for i in range(dp_a)
    ]
    tgt = [
        _emu(f"t{i}", b, range(offset + i * b.size, offset + (i + 1) * b.size), spec)
        for i in range(dp_b)
    ]
    return cur, tgt


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transition_cases())
def test_stage_transition_runs_split_destroy_extend_merge_and_keeps_everything(case):
    cur, tgt = case
    full = global_tensors(cur[0], seed=3)
    stores = _stores(cur, full)
    plan = plan_stage_transition(cur, tgt)
    order = {"split": 0, "destroy": 1, "extend": 2, "merge": 3}
    kinds = [order[s.kind] for s in plan.steps]
    # Split, Destroy, Extend, (Destroy of extend sources), Merge
    assert all(k in (0,) for k in kinds[: kinds.count(0)])
    assert all(k == 3 for k in kinds[len(kinds) - kinds.count(3) :])
    # no target box crosses devices twice, and none that was already in place
    assert plan.bytes_moved <= sum(bytes_minimum(cur, t) for t in tgt) + sum(
        s.bytes_moved for s in plan.steps if s.kind == "split"
    ), plan.steps
    live = {e.name for e in cur}
    for step in plan.steps:
        if step.kind == "destroy":
            assert len(live) > 1  # never the last copy
        apply_step(step, stores)
        live -= {e.name for e in step.freed}
        live |= {e.name for e in step.created}
    assert live == {e.name for e in plan.result}
    assert [(e.layout, e.devices) for e in plan.result] == [(t.layout, t.devices) for t in tgt]
    for e in plan.result:
        assert e.state == LogicalState(3, 4, 99)
        _check_holds(stores, e, full)
    for d, held in stores.items():
        assert set(held) <= live, (d, held.keys())
