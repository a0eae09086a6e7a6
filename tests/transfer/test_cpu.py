"""CpuCommunicator on real worker processes: every operation against torch references."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [3])
def test_collectives_match_torch(workers, size):
    results = workers.run("collectives", size)
    assert all(r["checked"] > 100 for r in results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,shm", [(4, True), (3, False)])
def test_batch_p2p_all_pairs_any_order(workers, size, shm):
    results = workers.run("p2p", size, shm=shm)
    assert [r["checked"] for r in results] == [2 * 5 * (size - 1)] * size


@pytest.mark.timeout(60)
def test_p2p_size_mismatch_is_an_error(workers):
    results = workers.run("mismatch", 2)
    for path in ("shm", "gloo"):
        assert results[1][path]["raised"] == "TransferError", results
        assert "expected 48 bytes" in results[1][path]["message"], results


@pytest.mark.timeout(120)
def test_stuck_operation_names_missing_rank(workers):
    deadline = 2.0
    ops = ["all_reduce", "p2p", "p2p_gloo"]
    results = workers.run("stuck", 3, missing=2, ops=ops, deadline_s=deadline)
    assert all(results[2][op]["role"] == "missing" for op in ops)
    for r in results[:2]:
        for op in ops:
            got = r[op]
            assert got["role"] == "waiter" and got["missing_ranks"] == [2], got
            assert deadline <= got["seconds"] < deadline + 5, got
            assert got["op"] == ("batch_p2p" if op.startswith("p2p") else op)
            assert got["after"] == "TransferError"  # the group is aborted once stuck


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["all_reduce", "inside", "p2p"])
def test_dead_rank_never_hangs_survivors_and_is_named(workers, op):
    deadline = 20.0
    results = workers.run("die", 3, victim=1, op=op, deadline_s=deadline, expect_rc={1: 3})
    for r in (results[0], results[2]):
        # a dead peer is noticed at once (closed socket, pidfd), long before the deadline
        assert r["seconds"] < deadline / 2, r
        # and named: a rank that never entered by StuckCollective, one that died in the
        # operation by PeerDied
        assert r["raised"] in ("PeerDied", "StuckCollective"), r
        # (in the p2p case rank 2 waits in a barrier that rank 0 never joins either)
        assert 1 in (r["dead_ranks"] or r["missing_ranks"]), r
        if r["raised"] == "PeerDied":
            assert r["dead_ranks"] == [1], r
            assert "rank 1 (device 101) died" in r["message"], r
    if op == "inside":  # every survivor saw it enter, then die
        assert all(r["raised"] == "PeerDied" for r in (results[0], results[2])), results


@pytest.mark.timeout(150)
def test_groups_over_subsets_created_and_destroyed_leak_nothing(workers):
    subsets = [[0, 1], [1, 2, 3], [0, 3], [0, 1, 2, 3], [2]]
    results = workers.run("churn", 4, subsets=subsets, iterations=3)
    for r in results:
        fds = [c[0] for c in r["counts"]]
        threads = [c[1] for c in r["counts"]]
        # after the first round (lazy imports, allocator threads), nothing grows
        assert fds[1:] == [fds[1]] * (len(fds) - 1), r
        assert threads[1:] == [threads[1]] * (len(threads) - 1), r


@pytest.mark.timeout(90)
def test_recv_new_hands_off_shared_memory_and_reuses_it(workers):
    results = workers.run("handoff", 2)
    # three large transfers per round need at most three segments, and the rounds after
    # the first reuse them instead of making new ones
    segments = results[0]["segments"]
    assert 1 <= segments[0] <= 3 and segments == [segments[0]] * 3, segments
