"""The thin shell around the pure planner: measure this CPU machine once and cache it.

``local_cpu_probe()`` times a float32 matmul (FLOP/s), a large memcpy (bytes/s) and
the fixed cost of one layer pass of the project's decoder in training (and the passes a
recomputed layer and a micro-batch's ends add) in this process, torch at one thread as
every worker runs, a few seconds in all, and caches the figures as JSON under
``$XDG_CACHE_HOME/nereus`` (``~/.cache/nereus``) keyed by host name and CPU count, so
later calls read the file. The exchange bandwidth between worker processes (shared
memory hand-off) is not timed here (it needs two processes); it is taken as 0.85 x
the memcpy rate, the ratio measured on the project's machines (PLATFORM.md).

``local_cpu_cluster_probed(devices, memory_bytes)`` builds the ``local-cpu`` preset;
``local_cpu_efficiency()`` is the prior ``Efficiency`` with the measured layer-pass cost,
recompute passes and micro-batch passes.

Devices with a CPU limit (``device_cores``): the matmul and memcpy rates are measured in
a child process under that limit (a cgroup quota, as a worker runs), sustained over
about a second of wall time (many quota periods: a best-of time would catch the quota's
unthrottled bursts), and divided by the limit; the layer costs are one full core's,
timed without a limit (best-of timings of 1-3 ms steps: under a quota each met a
throttle or not), since a quota runs any work at its cores' rate. So the cluster spec
holds one full core's rates and each device gets its cores' worth. Cached per limit.
This is the only planner module that reads a clock, touches a file or starts a process.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from nereus.errors import ConfigError
from nereus.planner.cluster import ClusterSpec, local_cpu_cluster
from nereus.planner.cost import CONSERVATIVE, Efficiency

__all__ = ["local_cpu_probe", "local_cpu_cluster_probed", "local_cpu_efficiency", "capped_probe"]

log = logging.getLogger("nereus.planner")
_EXCHANGE_OVER_MEMCPY = 0.85
# what a cached entry must hold (an older cache without one is measured again)
_FIGURES = (
    "flops_per_device",
    "memory_bandwidth",
    "exchange_bandwidth",
    "layer_pass_s",
    "recompute_passes",
    "micro_batch_passes",
)
# part of the cache key: figures measured by an earlier probe are measured again (2: the
# matmul and the layer pass on torch at one thread, as workers run, not numpy's BLAS and
# torch's default threads, which put the fixed cost of a layer pass at 3-8x a worker's;
# 3: the figures under a CPU limit copy 64 MiB as the unlimited ones do, not 8 MiB;
# 4: the layer pass timed on the project's decoder in training, not a one-token imitation
# of a layer's forward, which put it at a fifth of what the engines pay, and the layer
# passes recompute adds and a micro-batch's ends cost; 5: under a limit, those passes
# timed best-of and the layer pass stretched by the quota's sustained ratio, not
# differences of quarter-second windows; 6: under the 10 ms quota period, the layer
# costs timed without a limit)
_PROBE_VERSION = 6


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
        layers = _layer_costs()
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
    return {
        "flops_per_device": flops,
        "memory_bandwidth": memcpy,
        "exchange_bandwidth": memcpy * _EXCHANGE_OVER_MEMCPY,
        **layers,
    }


# The probe's decoder: the project's own layers (nereus.models.decoder) at the demo's
# width, on one training micro-batch of 2 rows x 16 tokens, where FLOPs are a small part.
_PROBE_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 32,
}
_PROBE_ROWS, _PROBE_TOKENS = 2, 16


def _stage_step(layers: int, recompute: bool) -> Callable[[], None]:
    """One forward and backward of a training micro-batch through a ``layers``-layer
    stage of the project's decoder (``recompute``: activation checkpointing, as a
    training engine with ``recompute`` runs it)."""
    # here, as _measure imports torch: the planner stays importable without torch
    import torch

    from nereus.models import build_stage
    from nereus.models.tiny import tiny_config

    torch.manual_seed(0)
    stage = build_stage(tiny_config(num_hidden_layers=layers, **_PROBE_MODEL))
    stage.recompute_activations = recompute
    x = torch.randint(0, _PROBE_MODEL["vocab_size"], (_PROBE_ROWS, _PROBE_TOKENS))
    pos = torch.arange(_PROBE_TOKENS).expand(_PROBE_ROWS, _PROBE_TOKENS)

    def step() -> None:
        stage(x, pos).float().mean().backward()

    return step


def _seconds_per_call(
    fn: Callable[[], None], warm: int = 3, calls: int = 8, rounds: int = 3
) -> float:
    """``fn``'s time per call: the best of ``rounds`` x ``calls`` (one unthrottled core)."""
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def _layer_costs(rounds: int = 3) -> dict[str, float]:
    """The fixed cost of one layer pass, what recomputing a layer adds, and what a
    micro-batch costs beyond its layers, timed on the project's decoder: a 1-layer and a
    3-layer stage's micro-batch step differ by two layers' forward and backward (the
    embedding, head and loss cancel), which the cost model counts as 3 layer passes each
    (a forward, a backward of twice its FLOPs). The same difference with activation
    checkpointing, over the plain one's, gives the layer passes a recomputed layer costs
    beyond those 3 (``recompute_passes``): a bare second forward would be 1;
    checkpointing's saved-tensor hooks make it more. The 1-layer step less its layer is
    the micro-batch's ends (embedding, LM head, loss, their backward), in layer passes
    (``micro_batch_passes``)."""
    step = {}
    for rec in (False, True):
        step[rec, 1] = _seconds_per_call(_stage_step(1, rec), calls=4, rounds=rounds)
        step[rec, 3] = _seconds_per_call(_stage_step(3, rec), calls=4, rounds=rounds)
    per_layer = {rec: max(step[rec, 3] - step[rec, 1], 1e-7) / 2 for rec in (False, True)}
    layer_pass = per_layer[False] / 3
    extra = (per_layer[True] - per_layer[False]) / layer_pass
    ends = max(0.0, step[False, 1] - per_layer[False]) / layer_pass
    return {
        "layer_pass_s": layer_pass,
        "recompute_passes": min(20.0, max(1.0, extra)),
        "micro_batch_passes": min(50.0, ends),
    }


_SUSTAIN_S = 1.0  # wall seconds each sustained figure spans (a hundred 10 ms quota periods)


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
    return {
        "flops_per_device": flops,
        "memory_bandwidth": memcpy,
        "exchange_bandwidth": memcpy * _EXCHANGE_OVER_MEMCPY,
    }


def capped_probe(
    cores: float, refresh: bool = False, cache: Path | None = None, cgroup_root: str | None = None
) -> dict[str, float]:
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
        out = subprocess.run(
            [sys.executable, "-m", "nereus.planner._probe", "--sustained"],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=limits.preexec(0),
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
    finally:
        limits.close()
    if out.returncode != 0:
        raise ConfigError(f"the probe under cores_per_device={cores} failed: {out.stderr[-400:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the layer costs are one full core's, timed without a limit in a fresh process: under
    # a quota a step of 1-3 ms meets a throttle or not, and the passes (differences of
    # step times) moved by 3-7x between probes; a quota runs them at its cores' rate
    free = subprocess.run(
        [sys.executable, "-m", "nereus.planner._probe", "--layers"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    if free.returncode != 0:
        raise ConfigError(f"the probe's layer costs failed: {free.stderr[-400:]}")
    core = json.loads(free.stdout.strip().splitlines()[-1])
    figures = {
        "flops_per_device": got["flops_per_device"] / cores,
        "memory_bandwidth": got["memory_bandwidth"] / cores,
        "exchange_bandwidth": got["exchange_bandwidth"] / cores,
        **{k: core[k] for k in ("layer_pass_s", "recompute_passes", "micro_batch_passes")},
    }
    table[key] = figures
    _write_cache(path, table)
    log.info("local CPU probe under %g cores (per full core): %s", cores, figures)
    return figures


def local_cpu_efficiency(
    prior: Efficiency = CONSERVATIVE, refresh: bool = False, cores: float | None = None
) -> Efficiency:
    """``prior`` with this machine's measured fixed cost per layer pass (one full core's,
    measured under a limit of ``cores`` where given)."""
    p = local_cpu_probe(refresh) if cores is None else capped_probe(cores, refresh)
    return prior.replace(
        layer_pass_s=min(10.0, float(p["layer_pass_s"])),
        recompute_passes=float(p["recompute_passes"]),
        micro_batch_passes=float(p["micro_batch_passes"]),
    )


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


def local_cpu_cluster_probed(
    devices: int,
    memory_bytes: int,
    *,
    refresh: bool = False,
    cores: int | None = None,
    headroom: float = 0.10,
    device_cores: Sequence[float] | None = None,
) -> ClusterSpec:
    """This machine as ``devices`` worker processes of ``memory_bytes`` each, sharing
    ``cores`` cores (default: this machine's); ``device_cores``: each one's CPU limit
    (the rates are then measured under the smallest of them)."""
    if device_cores is not None:
        p = capped_probe(min(device_cores), refresh)
    else:
        p = local_cpu_probe(refresh)
    return local_cpu_cluster(
        devices,
        memory_bytes,
        flops_per_device=p["flops_per_device"],
        memory_bandwidth=p["memory_bandwidth"],
        exchange_bandwidth=p["exchange_bandwidth"],
        cores=cores or os.cpu_count() or 1,
        headroom=headroom,
        device_cores=list(device_cores) if device_cores is not None else None,
    )


def _free_layer_costs() -> dict[str, float]:
    """``_layer_costs`` at one torch thread, best of enough rounds (the passes are
    differences of step times), in the process that runs ``--layers``."""
    import torch

    torch.set_num_threads(1)
    return _layer_costs(rounds=9)


if __name__ == "__main__" and sys.argv[1:] == ["--sustained"]:
    print(json.dumps(_sustained()), flush=True)
if __name__ == "__main__" and sys.argv[1:] == ["--layers"]:
    print(json.dumps(_free_layer_costs()), flush=True)
