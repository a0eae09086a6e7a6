"""Direct transfers into receivers' arenas (``exchange_direct``) and the arena pool."""

from __future__ import annotations

import gc
import glob

import pytest
import torch

from nereus.transfer import _arena
from nereus.transfer.direct import arena_empty

pytestmark = pytest.mark.integration

VIEWS_PER_PEER = 5 * 5  # dtypes x shapes in the worker scenario


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eager", [True, False], ids=["records-eager", "records-in-one-batch"])
def test_senders_write_into_arenas_and_the_rest_goes_through_buckets(workers, eager):
    results = workers.run("direct", 3, **({} if eager else {"eager_bytes": 0}))
    for r in results:
        for run in r["runs"]:
            assert run["checked"] == 2 * VIEWS_PER_PEER
            assert run["direct_sent"] > 0 and run["direct_received"] > 0
            # every 4th view is plain memory and one reshaped view is strided: buckets carry them
            assert run["bucket_events"] > 0
            assert run["bytes_received"] > run["direct_received"]
        assert r["runs"][0]["direct_received"] == r["runs"][1]["direct_received"]
        # the second run's arenas came from the pool: only the first run's were made
        assert r["pool"]["busy_arenas"] == 0
        assert r["pool"]["made"] == 3  # one per peer and one for the local pair


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_map_arenas_falls_back_to_buckets(workers):
    results = workers.run("direct", 3, deny_map=1)
    for r in results:
        for run in r["runs"]:
            assert run["checked"] == 2 * VIEWS_PER_PEER  # every view arrived intact
    assert all(run["direct_sent"] == 0 for run in results[1]["runs"])
    assert all(run["direct_sent"] > 0 for run in results[0]["runs"])


@pytest.mark.timeout(120)
def test_sizes_that_disagree_fail_both_sides_before_the_deadline(workers):
    results = workers.run("direct_mismatch", 2, deadline_s=60.0)
    assert "400" in results[0]["message"] and "200" in results[0]["message"]
    # rank 1 hears of the mismatch, or of rank 0 leaving after it raised: either way it fails fast
    for r in results:
        assert r["raised"] in ("TransferError", "PeerDied") and r["seconds"] < 30, r
    assert results[0]["raised"] == "TransferError"


def test_arena_pool_reuses_freed_arenas_and_trims_to_its_cap():
    _arena.set_keep_free_bytes(64 * 2**20)
    try:
        before = _arena.pool_stats()
        a = arena_empty(3 * 2**20 + 5)
        view = a[4096:8192].view(torch.float32)
        ref = _arena.describe(view)
        assert ref is not None and ref.offset == 4096 and ref.nbytes == 4 * 2**20
        assert _arena.describe(torch.empty(4)) is None
        assert _arena.pool_stats()["busy_arenas"] == before["busy_arenas"] + 1
        serial = ref.serial
        del a
        assert _arena.describe(view).serial == serial  # a view keeps the arena busy
        del view
        gc.collect()
        assert _arena.pool_stats()["busy_arenas"] == before["busy_arenas"]
        again = arena_empty(2**20)  # best fit: the freed 4 MiB arena, not a new one
        assert _arena.describe(again).serial == serial
        again.fill_(7)
        del again
        big = arena_empty(80 * 2**20)  # freed, it exceeds the cap and is unmapped
        big_serial = _arena.describe(big).serial
        del big
        gc.collect()
        assert big_serial not in _arena._pool.free
        assert _arena.pool_stats()["free_bytes"] <= 64 * 2**20
        assert not glob.glob("/dev/shm/nereus-arena-*")  # memfds have no names to leak
    finally:
        _arena.set_keep_free_bytes(2**30)


def test_own_arena_maps_like_a_peers():
    a = arena_empty(2**20)
    a.zero_()
    ref = _arena.describe(a)
    mapped = _arena.map_peer(ref)
    mapped[:16].fill_(5)  # the same memory through another mapping
    assert int(a[:16].sum()) == 80 and int(a[16:].sum()) == 0
    assert _arena.map_peer(ref).data_ptr() == mapped.data_ptr()  # cached
