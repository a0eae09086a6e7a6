"""Received buckets that become target storage (``exchange(adopt=True)``): a target tensor
that one receive fills whole takes the received memory instead of a copy. On real
workers with buckets larger than a shared-memory slot, so buckets are handed off: an
adopted target must stay intact while later reshards reuse the sender's segment pool,
and must be a tensor of its own (no aliasing with other targets)."""

from __future__ import annotations

from collections import Counter

import pytest
import pytest_asyncio
import torch

from nereus.actors import Cluster, endpoint
from nereus.state import EMU, Layout, plan_reshard
from nereus.state.apply import plan_part, run_part
from nereus.state.executor import execute
from nereus.state.holder import ShardHolder
from tests._leaks import children, shm_segments, wait_gone
from tests.state.helpers import global_tensors, shard_store, spec_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BUCKET = 24 * 2**20  # > the 16 MiB shared-memory slot: buckets are handed off


class ProbeHolder(ShardHolder):
    @endpoint
    async def bump(self, emu: str, key: str) -> float:
        """Add 1 to one element of one tensor of ``emu``; returns the new value."""
        t = self.shards[emu][key]
        t.view(-1)[0] += 1
        return float(t.view(-1)[0])

    @endpoint
    async def adopted(self, emu: str) -> int:
        """Tensors of ``emu`` living in a larger storage: a received bucket they took."""
        return sum(
            1
            for t in self.shards[emu].values()
            if t.untyped_storage().nbytes() > t.numel() * t.element_size()
        )

    @endpoint
    async def storages(self, emu: str) -> list[int]:
        return [
            t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            for t in self.shards[emu].values()
            if t.numel()
        ]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def holders():
    before, segments = children(), shm_segments()
    async with Cluster.local(
        devices=2, memory_per_device="1GiB", heartbeat_timeout_s=30.0
    ) as cluster:
        # buckets even between these same-host processes: adoption is what is tested
        mesh = await cluster.spawn(
            "adopt", ProbeHolder, devices=[0, 1], kwargs={"bucket_bytes": BUCKET, "direct": False}
        )
        yield cluster, {ref.device: ref for ref in mesh.refs}
        await cluster.stop_mesh(mesh)
    assert not wait_gone(children() - before, timeout_s=10), "leaked worker processes"
    assert shm_segments() <= segments


async def _holds(ref, emu: EMU, device: int, full) -> None:
    got = await ref.get_shards.call_one(emu.name)
    want = shard_store(emu, full)[device]
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), (emu.name, k)


@pytest.mark.asyncio(loop_scope="module")
async def test_adopted_targets_survive_segment_reuse_and_do_not_alias(holders):
    cluster, refs = holders
    # 24 MiB embedding and head (a bucket each: sent from the source itself and
    # adopted whole); the layers' tensors packed several per bucket
    spec = spec_for(layers=2, heads=8, head_dim=32, intermediate=1024, vocab=24576)
    a = EMU("a", "policy-training", spec, Layout(1, 1), (0,))
    full = global_tensors(a, seed=11)
    try:
        await refs[0].put_shards.call_one("a", shard_store(a, full)[0])
        copies = [a.with_(name=n, devices=(1,)) for n in ("b", "c", "d")]
        # b is built, then c while b lives (the sender's segments under b stay taken),
        # then b is dropped (its segments go back to the pool) and d reuses them
        await execute(plan_reshard([a], copies[0]), refs, cluster, epoch=3)
        await execute(plan_reshard([a], copies[1]), refs, cluster, epoch=3)
        await _holds(refs[1], copies[0], 1, full)
        await refs[1].drop_shards.call_one(["b"])
        await execute(plan_reshard([a], copies[2]), refs, cluster, epoch=3)
        await _holds(refs[1], copies[1], 1, full)
        await _holds(refs[1], copies[2], 1, full)
        # every tensor has memory of its own: writing one changes no other
        key = "model.embed_tokens.weight"
        first = float(full[key].view(-1)[0])
        assert await refs[1].bump.call_one("c", key) == first + 1
        await _holds(refs[1], copies[2], 1, full)
        assert await refs[0].bump.call_one("a", "model.layers.0.mlp.down_proj.weight") != 0
        await _holds(refs[1], copies[2], 1, full)
        for name in ("c", "d"):
            assert await refs[1].adopted.call_one(name) >= 2  # small tensors packed in a bucket
            ptrs = await refs[1].storages.call_one(name)
            assert len(set(ptrs)) == len(ptrs)
    finally:
        for ref in refs.values():
            await ref.drop_shards.call_one(list(await ref.held.call_one()))


def _check_handover(part, sources) -> int:
    """Run ``part`` with a recording exchange; returns how many receives were whole."""
    seen = []
    out = run_part(
        part, sources, lambda sends, recvs: seen.extend(t for ts in recvs.values() for t in ts)
    )
    assert len(seen) == len(part["recvs"])
    pieces = Counter(key for _, key, _ in part["recvs"]) + Counter(
        key for _, key, _, _ in part["copies"]
    )
    whole = 0
    for t, (_, key, box) in zip(seen, part["recvs"], strict=True):
        fills = pieces[key] == 1 and [hi - lo for lo, hi in box] == list(out[key].shape)
        assert (t is out[key]) == fills, key  # the target itself exactly when one receive fills it
        assert fills or t._base is out[key]
        whole += fills
    return whole


def test_run_part_hands_whole_targets_over_and_views_otherwise():
    spec = spec_for(layers=2)
    src = EMU("s", "policy-training", spec, Layout(2, 1), (0, 1))
    stores = shard_store(src, global_tensors(src))
    extend = plan_reshard([src], EMU("w", "policy-training", spec, Layout(2, 1), (2, 3)))
    assert _check_handover(plan_part(extend, 2), {}) > 0
    merge = plan_reshard([src], EMU("h", "policy-training", spec, Layout(1, 1), (0,)))
    assert _check_handover(plan_part(merge, 0), {"s": stores[0]}) == 0  # local + remote pieces


def test_run_part_allocates_new_targets_in_one_buffer_and_hands_local_copies_over():
    spec = spec_for(layers=2)
    src = EMU("s", "policy-training", spec, Layout(2, 1), (0, 1))
    full = global_tensors(src)
    stores = shard_store(src, full)
    merge = plan_reshard([src], EMU("h", "policy-training", spec, Layout(1, 1), (0,)))
    part = plan_part(merge, 0)
    buffers, handed = [], []

    def alloc(nbytes: int) -> torch.Tensor:
        buffers.append(torch.full((nbytes,), 255, dtype=torch.uint8))
        return buffers[-1]

    def record(sends, recvs, copies):
        handed.extend(copies)
        for dst in recvs[1]:  # stand in for device 1: its shard, sliced as the plan says
            dst.fill_(0)

    out = run_part(part, {"s": stores[0]}, record, alloc=alloc, local_in_exchange=True)
    assert len(buffers) == 1 and len(handed) == len(part["copies"]) > 0
    base = buffers[0].data_ptr()
    for key, t in out.items():
        assert t.untyped_storage().data_ptr() == base, key
        assert (t.data_ptr() - base) % 64 == 0, key
    assert all(int(dst.view(torch.uint8).min()) == 255 for _, dst in handed)  # not copied yet
    for src_view, dst in handed:
        dst.copy_(src_view)
    plain = run_part(part, {"s": stores[0]}, lambda sends, recvs: [d.fill_(0) for d in recvs[1]])
    for key in out:
        assert torch.equal(out[key], plain[key]), key
