"""copy_into and copy_pairs: dst.copy_(src)'s meaning, whichever way the bytes go."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from nereus.transfer import copy_into
from nereus.transfer._copy import MEMMOVE_MIN_BYTES, copy_pairs, row_blocks_available, source_rows

BIG = MEMMOVE_MIN_BYTES // 4 * 3  # float32 elements: above the memmove size


def _reference(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    out = dst.clone()
    out.copy_(src)
    return out


@pytest.mark.parametrize(
    "case",
    ["contiguous", "rows of a larger tensor", "strided dst", "strided src", "small", "other dtype"],
)
def test_matches_copy_and_writes_nothing_else(case):
    g = torch.Generator().manual_seed(0)
    outer = torch.randn(4, 2 * BIG // 64, 64, generator=g)  # the memory around dst
    src_outer = torch.randn(4, 2 * BIG // 64, 64, generator=g)
    if case == "contiguous":
        dst, src = outer[1], src_outer[2]
    elif case == "rows of a larger tensor":  # a view at an offset, contiguous
        dst, src = outer[1, 3 : 3 + BIG // 64], src_outer[0, 5 : 5 + BIG // 64]
    elif case == "strided dst":
        dst, src = outer[1, :, :32], src_outer[2, :, 32:].contiguous()
    elif case == "strided src":
        dst, src = outer[1, :, :32].contiguous(), src_outer[2, :, 32:]
        outer = dst  # dst is its own memory here
    elif case == "small":
        dst, src = outer[1, :2], src_outer[2, :2]
    else:
        dst, src = outer[1], src_outer[2].to(torch.float64)
    before = outer.clone()
    want = _reference(dst, src)
    assert copy_into(dst, src) is dst
    assert torch.equal(dst, want)
    outside = ~_index_of(outer, dst)
    assert torch.equal(outer[outside], before[outside])


def _index_of(outer: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """A boolean mask over contiguous ``outer``: True where ``view`` (of the same storage) lies."""
    mask = torch.zeros(outer.numel(), dtype=torch.bool)
    mask.as_strided(
        view.shape, view.stride(), view.storage_offset() - outer.storage_offset()
    ).fill_(True)
    return mask.view(outer.shape)


def test_shapes_that_differ_are_refused_like_copy():
    dst, src = torch.zeros(BIG // 64, 64), torch.ones(64, BIG // 64)
    with pytest.raises(RuntimeError):
        copy_into(dst, src)
    assert not dst.any()


def test_the_row_block_copy_was_built_where_a_compiler_is():
    # make setup builds nereus/transfer/_rows.c when a C compiler is present
    assert (
        row_blocks_available()
        or shutil.which("cc") is None
        or os.environ.get("NEREUS_ROW_BLOCKS") == "0"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("dst_kind", ["contiguous", "strided", "unaligned"])
def test_copy_pairs_matches_copy_and_writes_nothing_else(dtype, dst_kind):
    g = torch.Generator().manual_seed(1)
    src = (torch.rand(300, 97, generator=g) * 1000).to(dtype)
    # column blocks of one source's rows (overlapping ones too: a box sent to two
    # peers), another row range, a whole contiguous tensor, and a 1-D view
    blocks = [
        (slice(0, 300), slice(0, 40)),
        (slice(0, 300), slice(40, 97)),
        (slice(0, 300), slice(13, 29)),
        (slice(7, 200), slice(3, 50)),
        (slice(7, 200), slice(50, 96)),
        (slice(0, 300), slice(0, 97)),
    ]
    other = (torch.rand(64, 33, generator=g) * 1000).to(dtype)
    pairs_src = [src[r, c] for r, c in blocks] + [other, other[:, 1:], src.view(-1)[5:1005]]
    outers, pairs = [], []
    for s in pairs_src:
        if dst_kind == "contiguous" or s.dim() == 1:
            outer = torch.zeros(s.numel() + 64, dtype=dtype)
            dst = outer[16 : 16 + s.numel()].view(s.shape)
        elif dst_kind == "strided":
            outer = torch.zeros(s.shape[0], s.shape[1] + 5, dtype=dtype)
            dst = outer[:, 2 : 2 + s.shape[1]]
        else:  # rows not 16-byte aligned
            outer = torch.zeros(s.numel() + 64, dtype=dtype)
            dst = outer[1 : 1 + s.numel()].view(s.shape)
        outers.append((outer, outer.clone(), dst))
        pairs.append((s, dst))
    before = src.clone()
    copy_pairs(pairs)
    assert torch.equal(src, before)
    for (s, dst), (outer, outer_before, _) in zip(pairs, outers, strict=True):
        assert torch.equal(dst, s)
        outside = ~_index_of(outer, dst)
        assert torch.equal(outer[outside], outer_before[outside])


def test_source_rows_groups_column_blocks_of_the_same_rows():
    t = torch.zeros(8, 16)
    assert source_rows(t[:, :4]) == source_rows(t[:, 4:12]) != source_rows(t[1:, :4])
    assert source_rows(t) is None and source_rows(t[:4]) is None  # contiguous: nothing shared
    assert source_rows(t[:, ::2]) is None and source_rows(t.view(-1)) is None
