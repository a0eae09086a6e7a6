"""PromptDataset: one global order, resumable position, DP slicing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.data.prompts import PromptDataset
from nereus.data.tasks import ReverseTask, Sample
from nereus.errors import ConfigError


def test_each_epoch_visits_every_sample_once():
    ds = PromptDataset(ReverseTask(), size=17, seed=5)
    first = [s.index for s in ds.take(17)]
    second = [s.index for s in ds.take(17)]
    assert sorted(first) == sorted(second) == list(range(17))
    assert first != second  # a new permutation per epoch
    assert ds.epoch == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(0, 5))
def test_resume_gives_the_same_sequence(batches, cut):
    cut = min(cut, len(batches))
    ref = PromptDataset(ReverseTask(), size=13, seed=2)
    expected = [ref.take(n) for n in batches]
    a = PromptDataset(ReverseTask(), size=13, seed=2)
    for n in batches[:cut]:
        a.take(n)
    b = PromptDataset(ReverseTask(), size=13, seed=2)
    b.load_state_dict(a.state_dict())
    assert [b.take(n) for n in batches[cut:]] == expected[cut:]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 16), st.integers(1, 4), st.integers(0, 40))
def test_dp_ranks_partition_the_global_batch(n, dp, position):
    ds = PromptDataset(ReverseTask(), size=11, seed=0)
    whole = ds.global_batch(n, position)
    parts = [ds.global_batch(n, position, r, dp) for r in range(dp)]
    assert sorted((s.index, s.prompt) for p in parts for s in p) == sorted(
        (s.index, s.prompt) for s in whole
    )
    assert ds.position == 0


def test_fixed_samples_and_refusals():
    samples = [Sample(i, f"p{i}", "a") for i in range(3)]
    ds = PromptDataset(samples=samples, shuffle=False)
    assert [s.prompt for s in ds.take(4)] == ["p0", "p1", "p2", "p0"]
    with pytest.raises(ConfigError, match="needs exactly one of task or samples"):
        PromptDataset()
    with pytest.raises(ConfigError, match="PromptDataset.seed"):
        PromptDataset(ReverseTask(), seed=1).load_state_dict(ds.state_dict())
    with pytest.raises(ConfigError, match="PromptDataset.dp_rank=2"):
        ds.global_batch(4, dp_rank=2, dp_size=2)
