"""The memory ledger: reservations count against one budget per device, and going past it
raises OutOfMemory naming the device, the need and the budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.engines.memory import MemoryLedger, device_ledger
from nereus.errors import ConfigError, OutOfMemory


def test_reserve_release_and_breakdown():
    ledger = MemoryLedger(3, 1000)
    ledger.reserve("gen/weights", 400)
    ledger.reserve("gen/kv_cache", 500)
    assert ledger.used_bytes == 900
    assert ledger.free_bytes == 100
    assert ledger.breakdown() == {"gen/weights": 400, "gen/kv_cache": 500}
    # A re-reservation replaces the earlier size instead of adding to it.
    ledger.reserve("gen/kv_cache", 550)
    assert ledger.used_bytes == 950
    assert ledger.release("gen/kv_cache") == 550
    assert ledger.release("gen/kv_cache") == 0
    assert ledger.used_bytes == 400


def test_out_of_memory_names_device_need_and_budget_and_keeps_state():
    ledger = MemoryLedger(2, 1000)
    ledger.reserve("train/params", 600)
    with pytest.raises(OutOfMemory) as info:
        ledger.reserve("train/optimizer", 500)
    err = info.value
    assert err.device == 2 and err.need_bytes == 1100 and err.budget_bytes == 1000
    assert "device 2" in str(err) and "train/optimizer" in str(err) and "1000" in str(err)
    assert ledger.breakdown() == {"train/params": 600}


def test_exactly_at_budget_fits():
    ledger = MemoryLedger("d", 1000)
    ledger.reserve("a", 1000)
    assert not ledger.fits(1)
    assert ledger.fits(1000, key="a")


def test_unlimited_and_bad_sizes():
    ledger = MemoryLedger("x", None)
    ledger.reserve("big", 1 << 50)
    assert ledger.free_bytes is None
    with pytest.raises(ConfigError, match="nbytes"):
        ledger.reserve("neg", -1)
    with pytest.raises(ConfigError, match="budget_bytes"):
        MemoryLedger("y", 0)


def test_release_prefix():
    ledger = MemoryLedger(0, None)
    ledger.reserve("gen/a", 1)
    ledger.reserve("gen/b", 2)
    ledger.reserve("train/a", 4)
    assert ledger.release_prefix("gen/") == 3
    assert ledger.breakdown() == {"train/a": 4}


def test_device_ledger_is_shared_and_budget_conflicts_are_refused():
    a = device_ledger("test-shared-device", 5000)
    b = device_ledger("test-shared-device")
    assert a is b and b.budget_bytes == 5000
    with pytest.raises(ConfigError, match="budget"):
        device_ledger("test-shared-device", 6000)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 10_000), sizes=st.lists(st.integers(0, 4000), max_size=12))
def test_used_never_exceeds_budget(budget, sizes):
    ledger = MemoryLedger(0, budget)
    for i, size in enumerate(sizes):
        key = f"k{i % 4}"
        before = ledger.breakdown()
        try:
            ledger.reserve(key, size)
        except OutOfMemory as e:
            assert e.need_bytes > budget
            assert ledger.breakdown() == before
        assert ledger.used_bytes <= budget
