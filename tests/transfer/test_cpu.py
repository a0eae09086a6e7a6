"""CpuCommunicator on real worker processes: every operation against torch references."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 3])
def test_collectives_match_torch(workers, size):
    results = workers.run("collectives", size)
    assert all(r["checked"] > 100 for r in results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,shm", [(2, True), (4, True), (3, False)])
def test_batch_p2p_all_pairs_any_order(workers, size, shm):
    results = workers.run("p2p", size, shm=shm)
    assert [r["checked"] for r in results] == [2 * 5 * (size - 1)] * size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [True, False])
def test_p2p_size_mismatch_is_an_error(workers, shm):
    results = workers.run("mismatch", 2, shm=shm)
    assert results[1]["raised"] == "TransferError", results
    if shm:
        assert "expected 48 bytes" in results[1]["message"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["all_reduce", "p2p"])
def test_stuck_operation_names_missing_rank(workers, op):
    deadline = 2.0
    results = workers.run("stuck", 3, missing=2, op=op, deadline_s=deadline)
    waiters = [r for r in results if r["role"] == "waiter"]
    want = [0, 1] if op == "all_reduce" else [0, 1]
    assert [r["rank"] for r in waiters] == want
    for r in waiters:
        assert r["missing_ranks"] == [2], r
        assert deadline <= r["seconds"] < deadline + 5, r
        assert r["after"] == "TransferError"  # the group is aborted after a stuck operation


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["all_reduce", "p2p"])
def test_dead_rank_never_hangs_survivors(workers, op):
    deadline = 20.0
    results = workers.run("die", 3, victim=1, op=op, deadline_s=deadline, expect_rc={1: 3})
    for r in (results[0], results[2]):
        assert r["raised"] in ("TransferError", "StuckCollective"), r
        # a dead peer is noticed at once (closed socket, pidfd), long before the deadline
        assert r["seconds"] < deadline / 2, r


@pytest.mark.timeout(150)
def test_groups_over_subsets_created_and_destroyed_leak_nothing(workers):
    subsets = [[0, 1], [1, 2, 3], [0, 3], [0, 1, 2, 3], [2]]
    results = workers.run("churn", 4, subsets=subsets, iterations=4)
    for r in results:
        fds = [c[0] for c in r["counts"]]
        threads = [c[1] for c in r["counts"]]
        # after the first round (lazy imports, allocator threads), nothing grows
        assert fds[1:] == [fds[1]] * (len(fds) - 1), r
        assert threads[1:] == [threads[1]] * (len(threads) - 1), r
