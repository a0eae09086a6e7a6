"""copy_into: dst.copy_(src)'s meaning, whichever way the bytes go."""

from __future__ import annotations

import pytest
import torch

from nereus.transfer import copy_into
from nereus.transfer._copy import MEMMOVE_MIN_BYTES

BIG = MEMMOVE_MIN_BYTES // 4 * 3  # float32 elements: above the memmove size


def _reference(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    out = dst.clone()
    out.copy_(src)
    return out


@pytest.mark.parametrize("case", ["contiguous", "rows of a larger tensor", "strided dst", "strided src",
                                  "small", "other dtype"])
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
    mask.as_strided(view.shape, view.stride(), view.storage_offset() - outer.storage_offset()).fill_(True)
    return mask.view(outer.shape)


def test_shapes_that_differ_are_refused_like_copy():
    dst, src = torch.zeros(BIG // 64, 64), torch.ones(64, BIG // 64)
    with pytest.raises(RuntimeError):
        copy_into(dst, src)
    assert not dst.any()
