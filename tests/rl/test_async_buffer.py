"""The async ledger on its own: the gate, batches in sample order with stragglers carried,
the staleness bound on every token, no sample twice or skipped, resume."""

from __future__ import annotations

import random

import pytest

from nereus.errors import StateError
from nereus.rl.async_buffer import AsyncLedger, Group


def _group(position: int, versions: list[list[int]], start: int) -> Group:
    return Group(
        position,
        position,
        [1],
        [[0] * len(v) for v in versions],
        [[0.0] * len(v) for v in versions],
        versions,
        start,
        [0.0] * len(versions),
    )


def _simulate(
    seed: int,
    k: int,
    B: int = 4,
    updates: int = 30,
    workers: int = 3,
    partial: bool = True,
    straggler: int | None = None,
    ledger: AsyncLedger | None = None,
    version: int = 0,
):
    """Random producers and one trainer over a ledger; returns (batches, ledger)."""
    rng = random.Random(seed)
    led = ledger or AsyncLedger(B, k, 0, B * updates)
    running: dict[int, list] = {}  # position -> [rows' versions, tokens left]
    batches = []
    weights = [version] * workers
    busy: dict[int, list[int]] = {w: [] for w in range(workers)}
    while led.remaining():
        for w in range(workers):
            if not busy[w]:
                busy[w] = led.take(weights[w], 2)
                for p in busy[w]:
                    length = 40 if p == straggler else rng.randint(1, 6)
                    running[p] = [[[] for _ in range(2)], length]
        # one decode step on every worker
        for w in range(workers):
            for p in list(busy[w]):
                rows, left = running[p]
                for r in rows:
                    r.append(weights[w])
                running[p][1] -= 1
                if running[p][1] == 0:
                    led.finish(_group(p, rows, min(v for r in rows for v in r)))
                    busy[w].remove(p)
        batch = led.batch_for(version)
        if batch is not None:
            if straggler is not None and straggler in led.in_flight:
                # training goes on without the straggler until its deadline
                assert led.in_flight[straggler] + k > version
            led.commit(batch, version)
            batches.append((version, [g.position for g in batch]))
            version += 1
            for w in range(workers):
                if partial or not busy[w]:
                    weights[w] = version
    return batches, led


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("partial", [True, False])
def test_bound_order_and_coverage_over_random_runs(k, partial):
    for seed in range(5):
        batches, led = _simulate(seed, k, partial=partial)
        positions = [p for _, ps in batches for p in ps]
        assert sorted(positions) == list(range(4 * 30)), "a position trained twice or skipped"
        assert all(len(ps) == 4 and ps == sorted(ps) for _, ps in batches)
        assert max(led.staleness) <= k and min(led.staleness) >= 0
        assert not led.finished and not led.in_flight


def test_a_straggler_is_carried_and_trained_by_its_deadline_never_dropped():
    k = 2
    batches, led = _simulate(3, k, straggler=5)
    where = next(v for v, ps in batches if 5 in ps)
    assert where > 1, "the straggler was not carried past its own batch"
    assert sorted(p for _, ps in batches for p in ps) == list(range(120))
    assert max(led.staleness) <= k


def test_the_gate_holds_generation_back_instead_of_dropping():
    led = AsyncLedger(2, 1, 0, 100)
    assert led.take(0, 10) == [0, 1, 2, 3]  # (0 + 1 + 1) * 2 positions may start at version 0
    assert led.take(0, 10) == []
    assert led.take(1, 10) == [4, 5]


def test_commit_refuses_a_stale_token_and_a_second_training():
    led = AsyncLedger(1, 1, 0, 10)
    (p,) = led.take(0, 1)
    led.finish(_group(p, [[0, 0]], 0))
    with pytest.raises(StateError, match="staleness 2"):
        led.commit([led.finished[p]], 2)
    g = led.finished[p]
    led.commit([g], 1)
    with pytest.raises(StateError, match="twice"):
        led.commit([g], 1)


def test_lost_positions_are_issued_again_first():
    led = AsyncLedger(4, 1, 0, 40)
    taken = led.take(0, 6)
    led.lose(taken[2:4])
    assert led.regenerated_groups == 2
    assert led.take(0, 3) == [2, 3, 6]


def test_resume_trains_the_positions_the_uninterrupted_run_would():
    full, _ = _simulate(11, 1, updates=20)
    # interrupt a run after 8 updates, with work in flight and finished but untrained
    led = AsyncLedger(4, 1, 0, 80)
    rng = random.Random(5)
    version = 0
    trained_before: list[int] = []
    while version < 8:
        for _ in range(3):
            for p in led.take(version, 2):
                led.finish(_group(p, [[version]], version))
        batch = led.batch_for(version)
        if batch is not None:
            rng.shuffle(batch)
            led.commit(batch, version)
            trained_before += [g.position for g in batch]
            version += 1
    in_flight = led.take(version, 3)
    assert in_flight
    state = led.state_dict()
    again = AsyncLedger(4, 1, 0, 80)
    again.load_state_dict(state)
    after, _ = _simulate(12, 1, updates=20, ledger=again, version=version)
    positions = trained_before + [p for _, ps in after for p in ps]
    assert sorted(positions) == sorted(p for _, ps in full for p in ps) == list(range(80))


def test_a_baseline_row_counts_for_the_deadline_and_the_bound_but_not_the_histogram():
    led = AsyncLedger(2, 1, 0, 4)
    assert led.take(0, 2) == [0, 1]
    # ReMax's entry: the trained rows are of version 1, its greedy row began at version 0
    remax = _group(0, [[1, 1]], 0)
    remax.baseline_ids, remax.baseline_versions = [5, 6], [0, 1]
    led.finish(remax)
    assert remax.oldest_version == 0
    led.finish(_group(1, [[1]], 0))
    batch = led.batch_for(1)
    assert [g.position for g in batch] == [0, 1]
    assert led.commit(batch, 1) == {0: 3}  # trained tokens only: the baseline's are not
    # a baseline token beyond the bound is refused like a trained one
    assert led.take(1, 2) == [2, 3]
    late = _group(2, [[3]], 1)
    late.baseline_ids, late.baseline_versions = [5], [1]
    led.finish(late)
    led.finish(_group(3, [[3]], 1))
    with pytest.raises(StateError, match="staleness 2"):
        led.commit(led.batch_for(3), 3)
