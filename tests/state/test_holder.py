"""Plans executed on real worker processes through the data plane (gloo + shared memory):
A -> B -> A bitwise for a sample of layouts, logical state carried, refusals that free
nothing, and the checkpoint fallback written and read by the workers themselves."""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch

from nereus.actors import Cluster
from nereus.errors import OutOfMemory, RemoteError, StateError
from nereus.state import (
    EMU,
    OPTIMIZER_SLOTS,
    DeviceSet,
    Layout,
    LogicalState,
    destroy,
    extend,
    plan_reshard,
    plan_stage_transition,
)
from nereus.state.executor import execute, execute_step, load_from_disk, save_to_disk
from nereus.state.holder import ShardHolder
from tests._leaks import children, shm_segments, wait_gone
from tests.state.helpers import global_tensors, shard_store, spec_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(120),
]

SLOTS = ("param", *OPTIMIZER_SLOTS)
BUDGET = 64 * 2**20


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def holders():
    before, segments = children(), shm_segments()
    # the node daemon shares this event loop with the test's own tensor work: be patient
    async with Cluster.local(
        devices=4, memory_per_device=BUDGET, heartbeat_timeout_s=30.0
    ) as cluster:
        mesh = await cluster.spawn(
            "shards", ShardHolder, devices=[0, 1, 2, 3], kwargs={"bucket_bytes": 1 << 20}
        )
        yield cluster, {ref.device: ref for ref in mesh.refs}
        await cluster.stop_mesh(mesh)
    assert not wait_gone(children() - before, timeout_s=10), "leaked worker processes"
    assert shm_segments() <= segments, f"leaked shared memory {shm_segments() - segments}"


async def _put(refs, emu: EMU, full) -> None:
    state = vars(emu.state).copy()
    for d, tensors in shard_store(emu, full).items():
        await refs[d].put_shards.call_one(emu.name, tensors, state)


async def _assert_holds(refs, emu: EMU, full) -> None:
    want = shard_store(emu, full)
    for d in emu.devices:
        got = await refs[d].get_shards.call_one(emu.name)
        assert set(got) == set(want[d])
        for k, t in want[d].items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), (emu.name, d, k)
        assert await refs[d].get_state.call_one(emu.name) == vars(emu.state)


async def _drop_all(refs) -> None:
    for ref in refs.values():
        held = await ref.held.call_one()
        await ref.drop_shards.call_one(list(held))


CASES = [
    # (layout A, devices A, layout B, devices B, kv heads, tied, dtype)
    (Layout(4, 1), (0, 1, 2, 3), Layout(2, 1), (0, 1), 2, False, "float32"),
    (Layout(2, 1), (0, 1), Layout(4, 1), (3, 2, 1, 0), 1, True, "bfloat16"),
    (Layout(1, 2, (5,)), (2, 3), Layout(1, 1), (0,), 2, True, "float32"),
    (Layout(2, 2), (0, 1, 2, 3), Layout(1, 4, (1, 2, 6)), (1, 3, 0, 2), 4, False, "float32"),
    (Layout(2, 1), (0, 1), Layout(2, 1), (2, 3), 2, False, "bfloat16"),  # an Extend
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[2]}")
async def test_a_to_b_to_a_on_workers_is_bitwise(holders, case):
    cluster, refs = holders
    la, da, lb, db, kv, tied, dtype = case
    spec = spec_for(kv_heads=kv, tied=tied, dtype=dtype)
    a = EMU("a", "policy-training", spec, la, da, SLOTS, LogicalState(9, 4, 321))
    b = EMU("b", "policy-training", spec, lb, db, SLOTS)
    full = global_tensors(a, seed=5)
    try:
        await _put(refs, a, full)
        ab = plan_reshard([a], b)
        stats = await execute(ab, refs, cluster, free=[a])
        assert stats.bytes_moved == ab.bytes_moved
        # the workers' own counters agree with the plan: every moved byte sent once
        assert stats.bytes_sent_measured == ab.bytes_moved
        await _assert_holds(refs, ab.target, full)
        for d in a.devices:
            assert "a" not in await refs[d].held.call_one()  # freed once B was built
        ba = plan_reshard([ab.target], a.with_(name="a2"))
        await execute(ba, refs, cluster, free=[ab.target])
        await _assert_holds(refs, ba.target, full)
        assert ba.target.state == LogicalState(9, 4, 321)
        await _drop_all(refs)
        for d, ref in refs.items():  # dropped targets give their arenas back at once
            assert (await ref.arena_stats.call_one())["busy_bytes"] == 0, d
    finally:
        await _drop_all(refs)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: f"{c[0]}->{c[2]}")
async def test_holders_without_direct_transfers_move_through_buckets_alike(holders, case):
    cluster, _ = holders
    mesh = await cluster.spawn(
        "buckets",
        ShardHolder,
        devices=[0, 1, 2, 3],
        kwargs={"bucket_bytes": 1 << 20, "direct": False},
    )
    refs = {ref.device: ref for ref in mesh.refs}
    try:
        la, da, lb, db, kv, tied, dtype = case
        spec = spec_for(kv_heads=kv, tied=tied, dtype=dtype)
        a = EMU("a", "policy-training", spec, la, da, SLOTS, LogicalState(2, 1, 7))
        full = global_tensors(a, seed=11)
        await _put(refs, a, full)
        ab = plan_reshard([a], EMU("b", "policy-training", spec, lb, db, SLOTS))
        await execute(ab, refs, cluster, free=[a], epoch=3)
        await _assert_holds(refs, ab.target, full)
    finally:
        await _drop_all(refs)
        await cluster.stop_mesh(mesh)


async def test_a_target_over_budget_is_refused_and_nothing_is_freed(holders):
    cluster, refs = holders
    spec = spec_for(layers=4, heads=8, head_dim=64, intermediate=1024, vocab=4096)  # ~34 MiB fp32
    a = EMU("big", "policy-training", spec, Layout(4, 1), (0, 1, 2, 3))
    full = global_tensors(a, seed=6)
    pad = EMU("pad", "policy-training", spec, Layout(1, 1), (0,))
    try:
        await _put(refs, a, full)
        await _put(refs, pad, full)
        # a second full copy on device 0 beside its quarter exceeds the 64 MiB budget
        whole = EMU("whole", "policy-training", spec, Layout(1, 1), (0,))
        with pytest.raises(RemoteError) as info:
            await execute(plan_reshard([a], whole), refs, cluster, free=[a])
        assert info.value.remote_type == "OutOfMemory"
        assert "out of memory on device 0" in str(info.value) and "budget is 67108864 bytes" in str(
            info.value
        )
        await _assert_holds(refs, a, full)  # the sources are all still there
        assert "whole" not in await refs[0].held.call_one()
        # the same refusal on the driver, before any message, from the memory model
        with pytest.raises(OutOfMemory) as oom:
            await execute(
                plan_reshard([a], whole),
                refs,
                cluster,
                free=[a],
                devices=DeviceSet.single_host(4, BUDGET),
                used={0: pad.bytes_on(0)},
            )
        assert oom.value.device == 0 and oom.value.budget_bytes == BUDGET
        assert oom.value.need_bytes > BUDGET
        await _assert_holds(refs, a, full)
    finally:
        await _drop_all(refs)


async def test_execute_needs_a_holder_on_every_device(holders):
    cluster, refs = holders
    spec = spec_for()
    a = EMU("a", "policy-training", spec, Layout(1, 1), (0,))
    with pytest.raises(StateError, match="no ShardHolder on devices \\[7\\]"):
        await execute(plan_reshard([a], a.with_(name="b", devices=(7,))), refs, cluster)


async def test_checkpoint_written_and_read_by_the_workers(holders, tmp_path):
    cluster, refs = holders
    spec = spec_for(kv_heads=2, tied=True)
    a = EMU(
        "a", "policy-training", spec, Layout(2, 2), (0, 1, 2, 3), SLOTS, LogicalState(3, 2, 1000)
    )
    full = global_tensors(a, seed=7)
    try:
        await _put(refs, a, full)
        await save_to_disk(str(tmp_path), a, refs)
        await _drop_all(refs)
        b = EMU("b", "policy-training", spec, Layout(4, 1), (3, 2, 1, 0), SLOTS)
        loaded = await load_from_disk(str(tmp_path), b, refs)
        assert loaded.state == LogicalState(3, 2, 1000)
        await _assert_holds(refs, loaded, full)
    finally:
        await _drop_all(refs)


@pytest.mark.parametrize(
    "current,target",
    [
        ([(Layout(4, 1), (0, 1, 2, 3))], [(Layout(2, 1), (0, 1)), (Layout(2, 1), (2, 3))]),  # Split
        ([(Layout(2, 1), (0, 1))], [(Layout(2, 2), (0, 1, 2, 3))]),  # Extend + Merge
        (
            [(Layout(1, 2), (0, 1)), (Layout(1, 2), (2, 3))],
            [(Layout(2, 1), (3, 1))],
        ),  # Destroy + Merge
    ],
    ids=["split", "extend-merge", "destroy-merge"],
)
async def test_stage_transition_steps_on_workers(holders, current, target):
    cluster, refs = holders
    spec = spec_for(kv_heads=2, tied=True)
    cur = [
        EMU(f"c{i}", "policy-training", spec, lay, devs, SLOTS, LogicalState(1, 1, 64))
        for i, (lay, devs) in enumerate(current)
    ]
    tgt = [
        EMU(f"t{i}", "policy-training", spec, lay, devs, SLOTS)
        for i, (lay, devs) in enumerate(target)
    ]
    full = global_tensors(cur[0], seed=8)
    try:
        for e in cur:
            await _put(refs, e, full)
        plan = plan_stage_transition(cur, tgt)
        moved = 0
        for step in plan.steps:
            moved += (await execute_step(step, refs, cluster)).bytes_moved
        assert moved == plan.bytes_moved
        names = {e.name for e in plan.result}
        for e in plan.result:
            await _assert_holds(refs, e, full)
        for d, ref in refs.items():
            assert set(await ref.held.call_one()) <= names, d  # everything else was freed
    finally:
        await _drop_all(refs)


async def test_refused_primitives_leave_the_workers_untouched(holders):
    cluster, refs = holders
    spec = spec_for(kv_heads=2)
    a = EMU("a", "policy-training", spec, Layout(2, 1), (0, 1), SLOTS, LogicalState(2, 2, 2))
    full = global_tensors(a, seed=9)
    try:
        await _put(refs, a, full)
        with pytest.raises(StateError, match="tp=3 must divide num_attention_heads=8"):
            plan_stage_transition([a], [EMU("t", "policy-training", spec, Layout(3, 1), (0, 1, 2))])
        with pytest.raises(StateError, match="Extend needs disjoint devices"):
            extend(a, (1, 2))
        with pytest.raises(StateError, match="last copy"):
            destroy(a, [])
        await _assert_holds(refs, a, full)
    finally:
        await _drop_all(refs)
