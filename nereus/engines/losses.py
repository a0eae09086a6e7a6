"""The training batch format, loss resolution by import path, and the built-in losses.

Batch (a plain dict of CPU tensors, as it crosses the wire):

- ``input_ids`` ``[B, T]`` int64: prompt and response, right-padded.
- ``attention_mask`` ``[B, T]`` (optional, default all ones): 1 on real tokens. Padding
  must be on the right: row ``b`` is ``input_ids[b, :attention_mask[b].sum()]``.
- ``response_mask`` ``[B, T]`` (optional, default ``attention_mask`` without the first
  token): 1 on the tokens that carry a loss.
- per-token tensors ``[B, T]`` the loss reads: ``old_logprobs``, ``ref_logprobs``,
  ``advantages``, ``returns``, ``old_values``...; any other ``[B, ...]`` tensors ride along
  and are split into micro-batches the same way.

Model outputs handed to a loss (``outputs``): ``logprobs`` ``[B, T]`` where
``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` (``t = 0`` is 0), or for a
critic ``values`` ``[B, T]`` (the value head on the hidden state at ``t``).

Refuses (``ConfigError``): a path without ``:``, a module or attribute that does not exist,
a non-callable, a batch without ``input_ids`` or with tensors whose first dim differs.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from nereus.config import require
from nereus.errors import ConfigError

__all__ = [
    "LossFn",
    "even_slices",
    "resolve_callable",
    "normalize_batch",
    "split_batch",
    "nll_loss",
    "value_mse_loss",
]

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

_CACHE: dict[str, Callable[..., Any]] = {}


def resolve_callable(path: str, field: str = "loss") -> Callable[..., Any]:
    """Import ``"module:qualname"`` and return the callable it names (cached)."""
    if path in _CACHE:
        return _CACHE[path]
    require(
        isinstance(path, str) and ":" in path,
        field,
        path,
        "must be an import path 'module:function'",
    )
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field}={path!r}: cannot import module {module_name!r}: {e}") from e
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{field}={path!r}: module {module_name!r} has no attribute {qualname!r}"
            )
        obj = getattr(obj, part)
    require(callable(obj), field, path, "must name a callable")
    _CACHE[path] = obj
    return obj


def normalize_batch(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Check a batch and fill in the default masks (see the module docstring)."""
    require(
        isinstance(batch, dict) and "input_ids" in batch,
        "batch",
        sorted(batch) if isinstance(batch, dict) else type(batch).__name__,
        "must be a dict with 'input_ids'",
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        out[key] = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    ids = out["input_ids"]
    require(ids.dim() == 2, "batch.input_ids", tuple(ids.shape), "must be [B, T]")
    out["input_ids"] = ids.long()
    rows = ids.shape[0]
    for key, value in out.items():
        require(
            value.dim() >= 1 and value.shape[0] == rows,
            f"batch.{key}",
            tuple(value.shape),
            f"must have first dim B={rows}",
        )
    if "attention_mask" not in out:
        out["attention_mask"] = torch.ones_like(ids)
    mask = out["attention_mask"]
    require(
        tuple(mask.shape) == tuple(ids.shape),
        "batch.attention_mask",
        tuple(mask.shape),
        f"must match input_ids {tuple(ids.shape)}",
    )
    lengths = mask.sum(dim=1)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    require(
        bool(((positions < lengths.unsqueeze(1)) == mask.bool()).all()),
        "batch.attention_mask",
        "left or inner padding",
        "must be right padding (ones then zeros per row)",
    )
    if "response_mask" not in out:
        resp = mask.clone()
        resp[:, 0] = 0
        out["response_mask"] = resp
    return out


def split_batch(
    batch: dict[str, torch.Tensor], micro_batch_size: int
) -> list[dict[str, torch.Tensor]]:
    """Cut a batch into consecutive micro-batches of ``micro_batch_size`` rows (the last
    may be shorter)."""
    require(micro_batch_size >= 1, "micro_batch_size", micro_batch_size, "must be >= 1")
    rows = batch["input_ids"].shape[0]
    return [
        {k: v[start : start + micro_batch_size] for k, v in batch.items()}
        for start in range(0, rows, micro_batch_size)
    ]


def even_slices(rows: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering ``range(rows)`` as evenly as possible (the
    first ``rows % parts`` get one row more): how rows are split across DP replicas."""
    require(parts >= 1, "parts", parts, "must be >= 1")
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def nll_loss(
    outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning: mean negative log-likelihood of the response tokens."""
    logprobs = outputs["logprobs"]
    mask = batch["response_mask"]
    loss = -_masked_mean(logprobs, mask)
    return loss, {"nll": float(loss.detach())}


def value_mse_loss(
    outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic regression without clipping: 0.5 * mean (value - returns)^2 over response tokens."""
    require("returns" in batch, "batch", sorted(batch), "must hold 'returns' for value_mse_loss")
    err = outputs["values"] - batch["returns"].to(outputs["values"].dtype)
    loss = 0.5 * _masked_mean(err * err, batch["response_mask"])
    return loss, {"value_mse": float(loss.detach())}
