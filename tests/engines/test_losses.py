"""Batch format checks, micro-batch splitting, loss resolution and the built-in losses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.engines.losses import (
    nll_loss,
    normalize_batch,
    resolve_callable,
    split_batch,
    value_mse_loss,
)
from nereus.errors import ConfigError


def test_defaults_fill_masks():
    ids = torch.arange(6).view(2, 3)
    b = normalize_batch({"input_ids": ids})
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]
    assert b["response_mask"].tolist() == [[0, 1, 1], [0, 1, 1]]
    b = normalize_batch({"input_ids": ids.tolist(), "attention_mask": [[1, 1, 0], [1, 0, 0]]})
    assert b["input_ids"].dtype == torch.long
    assert b["response_mask"].tolist() == [[0, 1, 0], [0, 0, 0]]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), mbs=st.integers(1, 10))
def test_split_covers_rows_in_order(rows, mbs):
    batch = {"input_ids": torch.arange(rows * 2).view(rows, 2), "adv": torch.arange(rows).float()}
    parts = split_batch(batch, mbs)
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert torch.equal(torch.cat([p["adv"] for p in parts]), batch["adv"])
    assert all(p["input_ids"].shape[0] <= mbs for p in parts)


def test_resolve_callable_errors_name_the_path():
    assert resolve_callable("nereus.engines.losses:nll_loss") is nll_loss
    with pytest.raises(ConfigError, match="import path"):
        resolve_callable("nll_loss")
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_callable("nereus.no_such_module:f")
    with pytest.raises(ConfigError, match="no attribute"):
        resolve_callable("nereus.engines.losses:missing")
    with pytest.raises(ConfigError, match="callable"):
        resolve_callable("nereus.engines.losses:__all__")


def test_builtin_losses():
    lp = torch.tensor([[0.0, -1.0, -3.0], [0.0, -2.0, -5.0]], requires_grad=True)
    batch = {"response_mask": torch.tensor([[0, 1, 1], [0, 1, 0]]), "returns": torch.ones(2, 3)}
    loss, m = nll_loss({"logprobs": lp}, batch)
    assert float(loss.detach()) == pytest.approx(2.0) and m["nll"] == pytest.approx(2.0)
    loss.backward()
    assert lp.grad is not None and float(lp.grad[1, 2]) == 0.0
    v = torch.tensor([[9.0, 3.0, 1.0], [9.0, 0.0, 9.0]])
    loss, m = value_mse_loss({"values": v}, batch)
    assert float(loss) == pytest.approx(0.5 * (4 + 0 + 1) / 3)
    with pytest.raises(ConfigError, match="returns"):
        value_mse_loss({"values": v}, {"response_mask": batch["response_mask"]})
