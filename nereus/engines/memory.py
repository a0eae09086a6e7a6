"""Memory accounting for engines: the device's ``MemoryLedger`` and tensor byte counts.

The ledger itself lives in the state layer (``nereus.state.ledger``): one per device per
process, shared by the shard store and every engine, with a high-water mark. Engines
reserve in it, before they allocate, what they hold beyond the store's tensors:
gradients, KV caches, activations of a step (and, for an engine built on its own rather
than over a store, its weights and optimizer state). Exceeding the budget raises
``nereus.errors.OutOfMemory`` naming the device, the need and the budget.
"""

from __future__ import annotations

import torch

from nereus.state.ledger import MemoryLedger, device_ledger

__all__ = ["MemoryLedger", "device_ledger", "tensor_bytes", "tensors_bytes"]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (not of its storage: views count what they show)."""
    return t.numel() * t.element_size()


def tensors_bytes(tensors) -> int:
    """Bytes of every tensor in an iterable (parameters, buffers, a state dict's values)."""
    return sum(tensor_bytes(t) for t in tensors)
