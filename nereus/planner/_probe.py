"""The thin shell around the pure planner: measure this CPU machine once and cache it.

``local_cpu_probe()`` times a float32 matmul (FLOP/s), a large memcpy (bytes/s) and
the fixed cost of one small decoder layer's operations (seconds per layer pass) in this
process, torch at one thread as every worker runs, about a second in all, and caches the figures as
JSON under ``$XDG_CACHE_HOME/nereus`` (``~/.cache/nereus``) keyed by host name and CPU count, so
later calls read the file. The exchange bandwidth between worker processes (shared
memory hand-off) is not timed here (it needs two processes); it is taken as 0.85 x
the memcpy rate, the ratio measured on the project's machines (PLATFORM.md).

``local_cpu_cluster_probed(devices, memory_bytes)`` builds the ``local-cpu`` preset;
``local_cpu_efficiency()`` is the prior ``Efficiency`` with the measured layer-pass cost.

Devices with a CPU limit (``device_cores``): the figures are measured in a child process
under that limit (a cgroup quota, as a worker runs), sustained over about a second of
wall time (many quota periods: a best-of time would catch the quota's unthrottled
bursts), and divided by the limit, so the cluster spec holds one full core's rates and
each device gets its cores' worth. Cached per limit. This is the only planner module that
reads a clock, touches a file or starts a process.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nereus.errors import ConfigError
from nereus.planner.cluster import ClusterSpec, local_cpu_cluster
from nereus.planner.cost import CONSERVATIVE, Efficiency

__all__ = ["local_cpu_probe", "local_cpu_cluster_probed", "local_cpu_efficiency", "capped_probe"]

log = logging.getLogger("nereus.planner")
_EXCHANGE_OVER_MEMCPY = 0.85
# what a cached entry must hold (an older cache without one is measured again)
_FIGURES = ("flops_per_device", "memory_bandwidth", "exchange_bandwidth", "layer_pass_s")
# part of the cache key: figures measured by an earlier probe are measured again (2: the
# matmul and the layer pass on torch at one thread, as workers run, not numpy's BLAS and
# torch's default threads, which put the fixed cost of a layer pass at 3-8x a worker's;
# 3: the figures under a CPU limit copy 64 MiB as the unlimited ones do, not 8 MiB)
_PROBE_VERSION = 3


def _cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "nereus" / "cpu_probe.json"


def _measure() -> dict[str, float]:
    import numpy as np
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker computes (nereus.engines.host): one thread per device
    try:
        n = 512
        a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
        b = a.clone()
        a @ b  # warm-up
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        flops = 2 * n**3 / best
        layer_pass = _layer_pass_seconds()
    finally:
        torch.set_num_threads(threads)
    src = np.ones(64 * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    memcpy = src.nbytes / best
    return {"flops_per_device": flops, "memory_bandwidth": memcpy, "exchange_bandwidth": memcpy * _EXCHANGE_OVER_MEMCPY,
            "layer_pass_s": layer_pass}


def _layer() -> tuple:
    """One small decoder layer and its input, to time what a layer pass costs here beyond
    its FLOPs: the ~25 framework operations of a layer (7 projections, 2 RMS norms, rotary,
    attention,
    SwiGLU, residuals) on one token, with autograd recording, timed with torch."""
    import torch

    torch.manual_seed(0)
    h, heads = 64, 4
    w = [torch.randn(h, h, requires_grad=True) for _ in range(7)]
    x = torch.randn(1, 1, h)

    def layer(x: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = (torch.nn.functional.linear(n, w[i]).view(1, 1, heads, h // heads).transpose(1, 2) for i in range(3))
        q, k = q * 0.5 + q.flip(-1) * 0.5, k * 0.5 + k.flip(-1) * 0.5
        a = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v
        x = x + torch.nn.functional.linear(a.transpose(1, 2).reshape(1, 1, h), w[3])
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        g = torch.nn.functional.silu(torch.nn.functional.linear(n, w[4])) * torch.nn.functional.linear(n, w[5])
        return x + torch.nn.functional.linear(g, w[6])

    return layer, x


def _layer_pass_seconds(passes: int = 50, rounds: int = 5, warm: int = 20) -> float:
    """One layer pass's best time over ``rounds`` of ``passes`` (see ``_layer``)."""
    layer, x = _layer()

    for _ in range(warm):
        layer(x)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(passes):
            layer(x)
        best = min(best, (time.perf_counter() - t) / passes)
    return best


_SUSTAIN_S = 1.0  # wall seconds each sustained figure spans (ten quota periods)


def _sustained() -> dict[str, float]:
    """Figures over ``_SUSTAIN_S`` of wall time each (what a capped device sustains)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    n = 256
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    a @ a
    t, end, count = time.perf_counter(), time.perf_counter() + _SUSTAIN_S, 0
    while time.perf_counter() < end:
        a @ a
        count += 1
    flops = 2 * n**3 * count / (time.perf_counter() - t)
    src = np.ones(64 * 2**20, dtype=np.uint8)  # as _measure: past the caches
    dst = np.empty_like(src)
    t, end, count = time.perf_counter(), time.perf_counter() + _SUSTAIN_S, 0
    while time.perf_counter() < end:
        np.copyto(dst, src)
        count += 1
    memcpy = src.nbytes * count / (time.perf_counter() - t)
    best = _layer_pass_seconds()  # one core's unthrottled cost, then what the quota sustains:
    layer, x = _layer()
    t, end, count = time.perf_counter(), time.perf_counter() + _SUSTAIN_S, 0
    while time.perf_counter() < end:
        layer(x)
        count += 1
    per_pass = (time.perf_counter() - t) / count
    return {"flops_per_device": flops, "memory_bandwidth": memcpy,
            "exchange_bandwidth": memcpy * _EXCHANGE_OVER_MEMCPY,
            "layer_pass_s": max(per_pass, best)}


def capped_probe(cores: float, refresh: bool = False, cache: Path | None = None,
                 cgroup_root: str | None = None) -> dict[str, float]:
    """One full core's figures measured under a limit of ``cores`` (see the module
    docstring): rates divided by ``cores``, the layer-pass cost multiplied by it.
    Raises ``ConfigError`` (naming ``cores_per_device``) where no limit can be set."""
    path = cache or _cache_path()
    key = f"{platform.node()}/{os.cpu_count()}/{_PROBE_VERSION}/capped-{cores:g}"
    table = _read_cache(path)
    if not refresh and isinstance(table.get(key), dict) and set(table[key]) >= set(_FIGURES):
        return table[key]
    # here, not at the top: importing the actor runtime brings numpy, and the planner
    # must stay importable without it (as _measure imports torch only to measure)
    from nereus.actors import CpuLimits

    limits = CpuLimits([cores], owner="probe", root=cgroup_root)
    try:
        out = subprocess.run([sys.executable, "-m", "nereus.planner._probe", "--sustained"],
                             capture_output=True, text=True, timeout=120,
                             preexec_fn=limits.preexec(0),
                             env=os.environ | {"OMP_NUM_THREADS": "1"})
    finally:
        limits.close()
    if out.returncode != 0:
        raise ConfigError(f"the probe under cores_per_device={cores} failed: {out.stderr[-400:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    figures = {"flops_per_device": got["flops_per_device"] / cores,
               "memory_bandwidth": got["memory_bandwidth"] / cores,
               "exchange_bandwidth": got["exchange_bandwidth"] / cores,
               "layer_pass_s": got["layer_pass_s"] * cores}
    table[key] = figures
    _write_cache(path, table)
    log.info("local CPU probe under %g cores (per full core): %s", cores, figures)
    return figures


def local_cpu_efficiency(prior: Efficiency = CONSERVATIVE, refresh: bool = False,
                         cores: float | None = None) -> Efficiency:
    """``prior`` with this machine's measured fixed cost per layer pass (one full core's,
    measured under a limit of ``cores`` where given)."""
    p = local_cpu_probe(refresh) if cores is None else capped_probe(cores, refresh)
    return prior.replace(layer_pass_s=min(10.0, float(p["layer_pass_s"])))


def local_cpu_probe(refresh: bool = False, cache: Path | None = None) -> dict[str, float]:
    """Probe figures of this machine, from the cache unless ``refresh`` or missing."""
    path = cache or _cache_path()
    key = f"{platform.node()}/{os.cpu_count()}/{_PROBE_VERSION}"
    table = _read_cache(path)
    if not refresh and isinstance(table.get(key), dict) and set(table[key]) >= set(_FIGURES):
        return table[key]
    figures = _measure()
    table[key] = figures
    _write_cache(path, table)
    log.info("local CPU probe: %s", figures)
    return figures


def _read_cache(path: Path) -> dict[str, dict[str, float]]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("ignoring unreadable CPU probe cache %s: %s", path, e)
        return {}


def _write_cache(path: Path, table: dict[str, dict[str, float]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1))
    except OSError as e:
        log.warning("could not cache the CPU probe at %s: %s", path, e)


def local_cpu_cluster_probed(devices: int, memory_bytes: int, *, refresh: bool = False,
                             cores: int | None = None, headroom: float = 0.10,
                             device_cores: Sequence[float] | None = None) -> ClusterSpec:
    """This machine as ``devices`` worker processes of ``memory_bytes`` each, sharing
    ``cores`` cores (default: this machine's); ``device_cores``: each one's CPU limit
    (the rates are then measured under the smallest of them)."""
    if device_cores is not None:
        p = capped_probe(min(device_cores), refresh)
    else:
        p = local_cpu_probe(refresh)
    return local_cpu_cluster(devices, memory_bytes, flops_per_device=p["flops_per_device"],
                             memory_bandwidth=p["memory_bandwidth"], exchange_bandwidth=p["exchange_bandwidth"],
                             cores=cores or os.cpu_count() or 1, headroom=headroom,
                             device_cores=list(device_cores) if device_cores is not None else None)


if __name__ == "__main__" and sys.argv[1:] == ["--sustained"]:
    print(json.dumps(_sustained()), flush=True)
