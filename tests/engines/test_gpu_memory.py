"""GPU memory arithmetic on CPU: a GPU device's budget (its memory less the CUDA
context's and NCCL's reserve), the ``gpu_memory_utilization`` vLLM is started with (what
the ledger reserved for it, not a share of the whole GPU) and vLLM's start arguments at
TP > 1 on GPUs (custom all-reduce off)."""

from __future__ import annotations

import pytest

from nereus.actors import NodeDaemon
from nereus.actors.gpu_memory import (
    CUDA_CONTEXT_BYTES,
    MIN_BUDGET_BYTES,
    NCCL_BYTES,
    VLLM_WORKSPACE_BYTES,
    GpuReserve,
    gpu_budget_bytes,
)
from nereus.engines.vllm_adapter import vllm_engine_args, vllm_memory_utilization
from nereus.errors import ConfigError

GIB = 1 << 30
H100 = 85_520_809_984  # what torch reports for an 80 GB H100


def test_a_gpu_budget_leaves_out_the_cuda_context_and_nccl():
    assert gpu_budget_bytes(H100) == H100 - CUDA_CONTEXT_BYTES - NCCL_BYTES
    reserve = GpuReserve(cuda_context_bytes=512 << 20, nccl_bytes=256 << 20)
    assert gpu_budget_bytes(16 * GIB, reserve) == 16 * GIB - (768 << 20)
    assert (
        GpuReserve(0, 0).total_bytes == 0 and gpu_budget_bytes(8 * GIB, GpuReserve(0, 0)) == 8 * GIB
    )


def test_a_reserve_that_leaves_too_little_is_refused():
    with pytest.raises(ConfigError, match="GpuReserve"):
        gpu_budget_bytes(CUDA_CONTEXT_BYTES + NCCL_BYTES + MIN_BUDGET_BYTES - 1)
    with pytest.raises(ConfigError, match="nccl_bytes"):
        GpuReserve(nccl_bytes=-1)
    with pytest.raises(ConfigError, match="total_bytes"):
        gpu_budget_bytes(0)


def test_a_gpu_node_reports_the_budget_not_the_whole_gpu(monkeypatch):
    monkeypatch.setattr(NodeDaemon, "_gpu_memory", staticmethod(lambda gpu: H100))
    node = NodeDaemon("tcp://127.0.0.1:1", b"k" * 32, gpus="0,1", transport="ipc")
    assert node.kind == "cuda"
    assert node.memory_bytes == [gpu_budget_bytes(H100)] * 2
    given = NodeDaemon("tcp://127.0.0.1:1", b"k" * 32, gpus="0", memory_per_device="40GiB")
    assert given.memory_bytes == [40 * GIB]  # an explicit budget is taken as it is


def test_vllm_is_asked_for_what_the_ledger_reserved():
    weights, cache = 300 << 20, 2 * GIB
    reserved = weights + cache + VLLM_WORKSPACE_BYTES
    util = vllm_memory_utilization(H100, reserved)
    # vLLM's start check: ceil(total * util) bytes free. That is the reservation, rounded
    # up by at most 1e-4 of the GPU; far from the 0.5 (half the GPU) it used to demand.
    assert reserved <= H100 * util < reserved + H100 * 1e-4
    assert util < 0.06
    assert vllm_memory_utilization(H100, H100) == 1.0
    for bad in (0, H100 + 1):
        with pytest.raises(ConfigError, match="reserved_bytes"):
            vllm_memory_utilization(H100, bad)


def _args(tp: int, on_cpu: bool) -> dict:
    return vllm_engine_args(
        model_dir="/m",
        dtype="bfloat16",
        tp_size=tp,
        max_model_len=64,
        seed=0,
        kv_cache_bytes=1 << 28,
        gpu_memory_utilization=0.05,
        enable_sleep_mode=False,
        on_cpu=on_cpu,
    )


def test_custom_all_reduce_is_off_where_each_rank_sees_one_gpu():
    gpu_tp2 = _args(2, on_cpu=False)
    assert gpu_tp2["disable_custom_all_reduce"] is True
    assert gpu_tp2["distributed_executor_backend"] == "external_launcher"
    assert gpu_tp2["gpu_memory_utilization"] == 0.05 and gpu_tp2["kv_cache_memory_bytes"] == 1 << 28
    assert "disable_custom_all_reduce" not in _args(1, on_cpu=False)  # no TP group at all
    assert "disable_custom_all_reduce" not in _args(2, on_cpu=True)  # vLLM's CPU backend has none
    assert "distributed_executor_backend" not in _args(1, on_cpu=False)
