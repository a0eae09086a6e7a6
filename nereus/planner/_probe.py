"""The thin shell around the pure planner: measure this CPU machine once and cache it.

``local_cpu_probe()`` times a float32 matmul (FLOP/s), a large memcpy (bytes/s) and
the fixed cost of one small decoder layer's operations (seconds per layer pass) in this
process, torch at one thread as every worker runs, about a second in all, and caches the figures as JSON under
``$XDG_CACHE_HOME/nereus`` (``~/.cache/nereus``) keyed by host name and CPU count, so
later calls read the file. The exchange bandwidth between worker processes (shared
memory hand-off) is not timed here (it needs two processes); it is taken as 0.85 x
the memcpy rate, the ratio measured on the project's machines (PLATFORM.md).

``local_cpu_cluster_probed(devices, memory_bytes)`` builds the ``local-cpu`` preset;
``local_cpu_efficiency()`` is the prior ``Efficiency`` with the measured layer-pass cost.
This is the only planner module that reads a clock or touches a file.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path

from nereus.planner.cluster import ClusterSpec, local_cpu_cluster
from nereus.planner.cost import CONSERVATIVE, Efficiency

__all__ = ["local_cpu_probe", "local_cpu_cluster_probed", "local_cpu_efficiency"]

log = logging.getLogger("nereus.planner")
_EXCHANGE_OVER_MEMCPY = 0.85
# what a cached entry must hold (an older cache without one is measured again)
_FIGURES = ("flops_per_device", "memory_bandwidth", "exchange_bandwidth", "layer_pass_s")
# part of the cache key: figures measured by an earlier probe are measured again (2: the
# matmul and the layer pass on torch at one thread, as workers run, not numpy's BLAS and
# torch's default threads, which put the fixed cost of a layer pass at 3-8x a worker's)
_PROBE_VERSION = 2


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


def _layer_pass_seconds() -> float:
    """What one pass through one small decoder layer costs beyond its FLOPs here: the
    ~25 framework operations of a layer (7 projections, 2 RMS norms, rotary, attention,
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

    for _ in range(20):
        layer(x)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50):
            layer(x)
        best = min(best, (time.perf_counter() - t) / 50)
    return best


def local_cpu_efficiency(prior: Efficiency = CONSERVATIVE, refresh: bool = False) -> Efficiency:
    """``prior`` with this machine's measured fixed cost per layer pass."""
    p = local_cpu_probe(refresh)
    return prior.replace(layer_pass_s=min(10.0, float(p["layer_pass_s"])))


def local_cpu_probe(refresh: bool = False, cache: Path | None = None) -> dict[str, float]:
    """Probe figures of this machine, from the cache unless ``refresh`` or missing."""
    path = cache or _cache_path()
    key = f"{platform.node()}/{os.cpu_count()}/{_PROBE_VERSION}"
    table: dict[str, dict[str, float]] = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            log.warning("ignoring unreadable CPU probe cache %s: %s", path, e)
            table = {}
    if not refresh and isinstance(table.get(key), dict) and set(table[key]) >= set(_FIGURES):
        return table[key]
    figures = _measure()
    table[key] = figures
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1))
    except OSError as e:
        log.warning("could not cache the CPU probe at %s: %s", path, e)
    log.info("local CPU probe: %s", figures)
    return figures


def local_cpu_cluster_probed(devices: int, memory_bytes: int, *, refresh: bool = False,
                             cores: int | None = None, headroom: float = 0.10) -> ClusterSpec:
    """This machine as ``devices`` worker processes of ``memory_bytes`` each, sharing
    ``cores`` cores (default: this machine's)."""
    p = local_cpu_probe(refresh)
    return local_cpu_cluster(devices, memory_bytes, flops_per_device=p["flops_per_device"],
                             memory_bandwidth=p["memory_bandwidth"], exchange_bandwidth=p["exchange_bandwidth"],
                             cores=cores or os.cpu_count() or 1, headroom=headroom)
