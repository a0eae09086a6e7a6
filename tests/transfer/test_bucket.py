"""Bucketed exchange: the layout (pure, property-tested) and real transfers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError
from nereus.transfer.bucket import bucket_layout


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=30), bucket=st.integers(16, 4096))
def test_layout_covers_every_byte_once_inside_buckets(sizes, bucket):
    pieces, used = bucket_layout(sizes, bucket)
    for i, n in enumerate(sizes):
        mine = sorted((p.start, p.stop) for p in pieces if p.index == i)
        covered = 0
        for start, stop in mine:
            assert start == covered and stop > start
            covered = stop
        assert covered == n
    for b, u in enumerate(used):
        assert 0 < u <= bucket
        spans = sorted((p.offset, p.offset + p.stop - p.start) for p in pieces if p.bucket == b)
        assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:], strict=False))
        assert spans[-1][1] <= u
        assert all(off % 16 == 0 for off, _ in spans)
    # a view that fits in one bucket is never cut
    for i, n in enumerate(sizes):
        if 0 < n <= bucket:
            assert sum(1 for p in pieces if p.index == i) == 1


def test_layout_is_a_function_of_sizes_alone():
    assert bucket_layout([10, 0, 300, 7], 64) == bucket_layout([10, 0, 300, 7], 64)


def test_layout_refuses_tiny_buckets():
    with pytest.raises(ConfigError, match="bucket_bytes=8"):
        bucket_layout([1], 8)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_exchange_many_views_in_small_buckets(workers):
    # 8 KiB buckets pass the 64 KiB ring slots; 256 KiB buckets are handed off
    results = workers.run("exchange", 3, bucket_bytes=[8192, 262144])
    for r in results:
        small, large = r["by_bucket"]["8192"], r["by_bucket"]["262144"]
        assert small["checked"] == large["checked"] == 2 * 5 * 4
        assert small["rounds"] > 3  # the views did not fit one bucket: double buffering ran
        assert r["handoff_segments"] >= 1
