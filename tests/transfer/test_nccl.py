"""The NCCL backend (GPU tier): the CPU tests' scenarios over NcclCommunicator.

The GPU tests are marked ``gpu``: tests/conftest.py skips them only when CUDA or libnccl is absent.
The multi-rank tests need one GPU per rank (NCCL refuses two ranks on one GPU) and skip
with that reason on a single-GPU machine; the single-rank test runs on any GPU."""

from __future__ import annotations

import datetime
import sys
import time

import pytest
import torch

from nereus.errors import StuckCollective, TransferError
from nereus.transfer import _libnccl

pytestmark = pytest.mark.integration


def _libnccl_missing() -> str:
    try:
        _libnccl.library()
    except TransferError as e:
        return str(e)
    return ""


needs_libnccl = pytest.mark.skipif(
    bool(_libnccl_missing()), reason=f"libnccl is not installed: {_libnccl_missing()}"
)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        _gpus() < n, reason=f"GPU tier: needs {n} GPUs (one per rank), this machine has {_gpus()}"
    )


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

    results = workers.run(
        "stuck",
        3,
        missing=2,
        ops=["all_reduce"],
        deadline_s=3.0,
        backend="nccl",
        nccl_id=unique_id().hex(),
    )
    for r in results[:2]:
        assert r["all_reduce"]["missing_ranks"] == [2], r


@needs_libnccl
def test_the_library_loads_and_makes_unique_ids_without_a_gpu():
    assert _libnccl.version() >= 21400  # non-blocking communicators
    a, b = _libnccl.unique_id(), _libnccl.unique_id()
    assert len(a) == len(b) == 128 and a != b
    with pytest.raises(TransferError, match="128 bytes"):
        _libnccl.Comm(2, a[:100], 0, time.monotonic() + 5)


@needs_libnccl
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_creating_a_communicator_without_a_gpu_fails_at_once():
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="ncclCommInitRankConfig"):
        _libnccl.Comm(2, _libnccl.unique_id(), 0, time.monotonic() + 30)
    assert time.monotonic() - t0 < 10  # an error, not a wait for the peer


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_is_named_by_the_deadline():
    from torch.distributed import TCPStore

    from nereus.transfer.nccl import NcclCommunicator, unique_id

    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    t0 = time.monotonic()
    with pytest.raises(StuckCollective) as info:
        NcclCommunicator(
            "lonely",
            0,
            2,
            unique_id(),
            timeout_s=3.0,
            store_host="127.0.0.1",
            store_port=store.port,
        )
    assert info.value.op == "create" and info.value.missing_ranks == [1]
    assert time.monotonic() - t0 < 30


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_single_rank_broadcast_of_more_than_2_gib():
    from nereus.transfer.nccl import NcclCommunicator, unique_id

    comm = NcclCommunicator("big", 0, 1, unique_id(), timeout_s=60.0)
    try:
        x = torch.ones((2**31 + 4096) // 4, dtype=torch.float32, device="cuda:0")
        comm.broadcast(x, 0)  # 2 GiB + 4 KiB: more bytes than a C int counts
        comm.synchronize()
        assert x.numel() * 4 > 2**31 - 1 and bool(x[-1] == 1)
    finally:
        comm.destroy()


@pytest.mark.gpu
@_needs_gpus(2)
@pytest.mark.timeout(240)
def test_broadcast_and_p2p_of_more_than_2_gib_between_two_ranks(workers):
    from nereus.transfer.nccl import unique_id

    results = workers.run("big", 2, timeout_s=200.0, backend="nccl", nccl_id=unique_id().hex())
    assert [r["checked"] for r in results] == [6, 6]
    assert all(r["bytes"] > 2 * (2**31 - 1) for r in results)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_operations_run_on_the_communication_stream_without_a_host_wait():
    """The caller's stream is busy (a sleep kernel); the all-reduce returns while its
    event is still pending, runs after the caller's work, and the caller's later work
    sees its result."""
    from nereus.transfer.nccl import NcclCommunicator, unique_id

    comm = NcclCommunicator("streams", 0, 1, unique_id(), timeout_s=60.0)
    try:
        caller = torch.cuda.current_stream()
        assert comm.stream != caller and comm.stream.device == torch.device("cuda", 0)
        x = torch.zeros(1 << 20, device="cuda:0")
        torch.cuda._sleep(5_000_000_000)  # seconds of GPU time on the caller's stream
        x.fill_(3.0)  # only after the sleep
        comm.all_reduce(x)
        pending = list(comm._pending)
        assert pending and not pending[-1].done.query(), "the host waited for the GPU"
        y = x * 2  # on the caller's stream: after the all-reduce's event
        comm.synchronize()
        assert not comm._pending
        assert float(y[-1]) == 6.0 and float(x[0]) == 3.0
    finally:
        comm.destroy()


@pytest.mark.gpu
@pytest.mark.timeout(240)
@_needs_gpus(2)
async def test_make_group_forms_nccl_groups_on_a_multi_gpu_node():
    """Each worker sees one GPU as cuda:0, whatever its index on the node."""
    from nereus.actors import Cluster, Controller, NodeDaemon
    from nereus.actors._keys import generate_key
    from nereus.transfer import make_group
    from tests.transfer._actors import CudaMember

    key = generate_key()
    controller = await Controller(key).start()
    node = NodeDaemon(controller.address, key, gpus="all", transport="ipc", node_id="gpus")
    try:
        await node.start()
        n = min(_gpus(), 4)
        async with Cluster.connect(controller.address, key=key, min_devices=n) as cluster:
            mesh = await cluster.spawn("cuda", CudaMember, devices=list(range(n)))
            group = await make_group(cluster, devices=list(range(n)), epoch=1)
            assert group.backend == "nccl"
            got = await mesh.all_reduce.call(group.group_id, 1.0)
            assert got == [[r, "cuda:0", 1, float(n)] for r in range(n)]
            await group.destroy()
    finally:
        await node.stop()
        await controller.close()
