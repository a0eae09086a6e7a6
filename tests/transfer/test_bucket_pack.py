"""``pack_buckets``: views laid out in buckets as ``exchange`` sends them (what
benchmarks.gpu times against ``torch.Tensor.copy_`` on a GPU)."""

from __future__ import annotations

import pytest
import torch

from nereus.errors import ConfigError
from nereus.transfer.bucket import bucket_layout, pack_buckets


def test_packed_buckets_hold_every_view_at_its_layout_offset():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 64, generator=g)  # 76,800 bytes: cut across buckets
    views = [
        torch.arange(10, dtype=torch.int64),
        big,
        torch.randn(8, 6, generator=g)[:, ::2],
        torch.zeros(0),
        torch.randn(5, generator=g).to(torch.bfloat16),
    ]
    buckets = pack_buckets(views, 32 << 10)
    sizes = [v.numel() * v.element_size() for v in views]
    pieces, used = bucket_layout(sizes, 32 << 10)
    assert [b.numel() for b in buckets] == used and len(buckets) >= 3
    for p in pieces:
        flat = views[p.index].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(
            buckets[p.bucket][p.offset : p.offset + p.stop - p.start], flat[p.start : p.stop]
        )


def test_a_bucket_that_is_one_contiguous_view_is_that_view_itself():
    whole = torch.randn(1024)  # exactly one bucket
    (bucket,) = pack_buckets([whole], 4096)
    assert bucket.data_ptr() == whole.data_ptr() and bucket.numel() == 4096
    with pytest.raises(ConfigError, match="bucket_bytes"):
        pack_buckets([whole], 8)
