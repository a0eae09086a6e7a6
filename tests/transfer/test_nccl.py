"""The NCCL backend (GPU tier): the CPU tests' scenarios over NcclCommunicator.

The GPU tests are marked ``gpu``: tests/conftest.py skips them only when CUDA or cupy is absent. The
multi-rank tests need one GPU per rank (NCCL refuses two ranks on one GPU) and skip
with that reason on a single-GPU machine; the single-rank test runs on any GPU."""

from __future__ import annotations

import sys

import pytest
import torch


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(_gpus() < n, reason=f"GPU tier: needs {n} GPUs (one per rank), this machine has {_gpus()}")


def test_importing_nereus_never_imports_cupy():
    import subprocess

    code = "import sys, nereus, nereus.transfer; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_single_rank_group_runs_every_operation():
    from nereus.transfer import P2POp  # noqa: F401 - the contract's types
    from nereus.transfer.nccl import NcclCommunicator, unique_id

    comm = NcclCommunicator("solo", 0, 1, unique_id(), device=0, timeout_s=30.0)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
            x = (torch.arange(12, device="cuda:0") % 3).to(dtype).reshape(3, 4)
            ref = x.clone()
            comm.all_reduce(x)
            assert torch.equal(x, ref)
            view = torch.zeros(3, 8, dtype=dtype, device="cuda:0")[:, ::2]
            view.copy_(ref)
            comm.broadcast(view, 0)
            assert torch.equal(view, ref)
            out = torch.empty(1, 3, 4, dtype=dtype, device="cuda:0")
            comm.all_gather(out, ref)
            assert torch.equal(out[0], ref)
            rs = torch.empty(3, 4, dtype=dtype, device="cuda:0")
            comm.reduce_scatter(rs, ref, "max")
            assert torch.equal(rs, ref)
        comm.barrier()
        with pytest.raises(Exception, match="works on cuda"):
            comm.all_reduce(torch.ones(2))
    finally:
        comm.destroy()


@pytest.mark.gpu
@_needs_gpus(2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", ["collectives", "p2p"])
def test_multi_rank_scenarios_over_nccl(workers, scenario):
    from nereus.transfer.nccl import unique_id

    size = min(_gpus(), 4)
    results = workers.run(scenario, size, backend="nccl", nccl_id=unique_id().hex(), shm=False)
    assert all(r["checked"] > 0 for r in results)


@pytest.mark.gpu
@_needs_gpus(3)
@pytest.mark.timeout(120)
def test_stuck_nccl_collective_names_missing_rank(workers):
    from nereus.transfer.nccl import unique_id

    results = workers.run("stuck", 3, missing=2, ops=["all_reduce"], deadline_s=3.0,
                          backend="nccl", nccl_id=unique_id().hex())
    for r in results[:2]:
        assert r["all_reduce"]["missing_ranks"] == [2], r
