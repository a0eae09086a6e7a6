"""A GPU device's memory budget: the GPU's memory less what no ledger entry sees.

A GPU worker's budget (the ``memory_bytes`` its node reports, which the planner plans
against and the worker's ``MemoryLedger`` enforces) must leave room for what the
process holds that nereus never reserves itself: the CUDA context (with cuBLAS and
cuDNN handles and the caching allocator's slack) and NCCL's buffers for the groups of
a layout epoch. ``GpuReserve`` names those; ``gpu_budget_bytes(total)`` is what is
left. vLLM's own workspace (its profiling forward pass, sampler and logits buffers)
is reserved in the ledger by the vLLM engine that needs it (``VLLM_WORKSPACE_BYTES``),
so a device without vLLM does not pay for it.

Pure arithmetic, no CUDA calls. Refuses (``ConfigError``): negative reserves, a
reserve that leaves less than ``MIN_BUDGET_BYTES`` of the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.config import require

__all__ = [
    "GpuReserve",
    "gpu_budget_bytes",
    "CUDA_CONTEXT_BYTES",
    "NCCL_BYTES",
    "VLLM_WORKSPACE_BYTES",
    "MIN_BUDGET_BYTES",
]

GIB = 1 << 30
# The CUDA context of a worker with torch, cuBLAS and cuDNN loaded is 0.5-0.8 GiB on
# recent GPUs; the rest covers the caching allocator's fragmentation.
CUDA_CONTEXT_BYTES = 1 * GIB
# NCCL's buffers: NCCL_BUFFSIZE (4 MiB) per channel and peer, both directions, for the
# handful of communicators one layout epoch keeps on a device.
NCCL_BYTES = 1 * GIB
# vLLM's workspace beside its weights and KV cache (reserved by the vLLM engine).
VLLM_WORKSPACE_BYTES = 2 * GIB
MIN_BUDGET_BYTES = 1 * GIB


@dataclass(frozen=True)
class GpuReserve:
    """Bytes of each GPU kept out of its device's budget."""

    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    """The worker's CUDA context, library handles and the allocator's slack."""
    nccl_bytes: int = NCCL_BYTES
    """NCCL's communicator buffers."""

    def __post_init__(self) -> None:
        for name in ("cuda_context_bytes", "nccl_bytes"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= 0,
                f"GpuReserve.{name}",
                value,
                "must be an int >= 0 bytes",
            )

    @property
    def total_bytes(self) -> int:
        return self.cuda_context_bytes + self.nccl_bytes


def gpu_budget_bytes(total_bytes: int, reserve: GpuReserve | None = None) -> int:
    """The budget of a GPU with ``total_bytes`` of memory: its memory less ``reserve``
    (default ``GpuReserve()``)."""
    reserve = reserve or GpuReserve()
    require(
        isinstance(total_bytes, int) and total_bytes > 0,
        "total_bytes",
        total_bytes,
        "must be the GPU's memory in bytes (> 0)",
    )
    budget = total_bytes - reserve.total_bytes
    require(
        budget >= MIN_BUDGET_BYTES,
        "GpuReserve",
        reserve,
        f"leaves {budget} of the GPU's {total_bytes} bytes; at least {MIN_BUDGET_BYTES} "
        "must remain for the device's budget",
    )
    return budget
