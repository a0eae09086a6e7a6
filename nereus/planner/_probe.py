"""The thin shell around the pure planner: measure this CPU machine once and cache it.

``local_cpu_probe()`` times a float32 matmul (FLOP/s) and a large memcpy (bytes/s) in
this process, about a second in all, and caches the figures as JSON under
``$XDG_CACHE_HOME/nereus`` (``~/.cache/nereus``) keyed by host name and CPU count, so
later calls read the file. The exchange bandwidth between worker processes (shared
memory hand-off) is not timed here (it needs two processes); it is taken as 0.85 x
the memcpy rate, the ratio measured on the project's machines (PLATFORM.md).

``local_cpu_cluster_probed(devices, memory_bytes)`` builds the ``local-cpu`` preset.
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

__all__ = ["local_cpu_probe", "local_cpu_cluster_probed"]

log = logging.getLogger("nereus.planner")
_EXCHANGE_OVER_MEMCPY = 0.85


def _cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "nereus" / "cpu_probe.json"


def _measure() -> dict[str, float]:
    import numpy as np

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.copy()
    a @ b  # warm-up
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    flops = 2 * n**3 / best
    src = np.ones(64 * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    memcpy = src.nbytes / best
    return {"flops_per_device": flops, "memory_bandwidth": memcpy, "exchange_bandwidth": memcpy * _EXCHANGE_OVER_MEMCPY}


def local_cpu_probe(refresh: bool = False, cache: Path | None = None) -> dict[str, float]:
    """Probe figures of this machine, from the cache unless ``refresh`` or missing."""
    path = cache or _cache_path()
    key = f"{platform.node()}/{os.cpu_count()}"
    table: dict[str, dict[str, float]] = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            log.warning("ignoring unreadable CPU probe cache %s: %s", path, e)
            table = {}
    if not refresh and isinstance(table.get(key), dict):
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
