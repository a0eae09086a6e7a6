"""Actor call cost, nereus vs Ray, side by side in one run.

    python -m benchmarks.actor_rpc [--calls 3000] [--pipelined 5000] [--reps 5]

Measures, for each framework, on one actor in its own worker process:
- sync no-op round trip: ``await ref.noop.call_one()`` one after the other vs
  ``ray.get(actor.noop.remote())``; median and p99 over ``--calls`` calls per
  repetition (the figures are the median over repetitions, spread = min..max);
- pipelined no-op calls per second: submit ``--pipelined`` calls, then wait for all
  (nereus: futures + gather; Ray: N ``.remote()`` then ``ray.get``);
- a 64 MiB float32 CPU torch tensor argument echoed back (round trip seconds).

Repetitions alternate between the two sides so a change in machine load hits both.
Warm-up calls come first. Threads: each side's actor runs with 1 torch/OMP thread;
the nereus driver runs uvloop; Ray runs with ``num_cpus=2`` and its defaults (its
default torch serializer, which a user gets without extra setup).

The last line printed is one JSON object with nereus_rtt_us, ray_rtt_us, rtt_ratio
(Ray/nereus), nereus_calls_per_s, ray_calls_per_s, throughput_ratio, and the p99,
spread and tensor figures. Exits 1 if Ray cannot be imported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from nereus.actors import Actor, Cluster, endpoint, run  # noqa: E402

TENSOR_BYTES = 64 * 2**20


class Noop(Actor):
    def __init__(self) -> None:
        torch.set_num_threads(1)

    @endpoint
    async def noop(self) -> None:
        return None

    @endpoint
    async def echo(self, x):
        return x


def _ray_actor_class():
    import ray

    @ray.remote(num_cpus=1)
    class RayNoop:
        def __init__(self) -> None:
            torch.set_num_threads(1)

        def noop(self) -> None:
            return None

        def echo(self, x):
            return x

    return RayNoop


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def _nereus_rep(mesh, calls: int, pipelined: int, tensor: torch.Tensor) -> dict:
    ep = mesh.noop
    lat = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await ep.call_one()
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    futs = [ep.call_one() for _ in range(pipelined)]
    await asyncio.gather(*futs)
    rate = pipelined / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    back = await mesh.echo.call_one(tensor)
    tensor_s = time.perf_counter() - t0
    assert back.shape == tensor.shape and back[-1] == tensor[-1]
    return {"rtt": statistics.median(lat), "p99": _percentile(lat, 0.99), "rate": rate,
            "tensor_s": tensor_s}


def _ray_rep(ray, actor, calls: int, pipelined: int, tensor: torch.Tensor) -> dict:
    lat = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(actor.noop.remote())
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    refs = [actor.noop.remote() for _ in range(pipelined)]
    ray.get(refs)
    rate = pipelined / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    back = ray.get(actor.echo.remote(tensor))
    tensor_s = time.perf_counter() - t0
    assert back.shape == tensor.shape and back[-1] == tensor[-1]
    return {"rtt": statistics.median(lat), "p99": _percentile(lat, 0.99), "rate": rate,
            "tensor_s": tensor_s}


def _summary(reps: list[dict]) -> dict:
    out = {}
    for k in ("rtt", "p99", "rate", "tensor_s"):
        vals = [r[k] for r in reps]
        out[k] = statistics.median(vals)
        out[k + "_min"] = min(vals)
        out[k + "_max"] = max(vals)
    return out


async def main_async(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError as e:
        print(f"Ray cannot be imported ({e}); install it with `pip install nereus[bench]`",
              file=sys.stderr)
        return 1
    tensor = torch.arange(TENSOR_BYTES // 4, dtype=torch.float32)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        actor = _ray_actor_class().remote()
        ray.get([actor.noop.remote() for _ in range(args.warmup)])
        ray.get(actor.echo.remote(tensor))
        async with Cluster.local(devices=1, heartbeat_timeout_s=120,
                                 span_sample_every=0) as cluster:
            mesh = await cluster.spawn("bench", Noop, devices=[0])
            for _ in range(args.warmup):
                await mesh.noop.call_one()
            await mesh.echo.call_one(tensor)
            ours, theirs = [], []
            for rep in range(args.reps):
                ours.append(await _nereus_rep(mesh, args.calls, args.pipelined, tensor))
                # Ray's sync API blocks; run it off the loop so the embedded controller
                # and node keep answering meanwhile
                theirs.append(await asyncio.to_thread(_ray_rep, ray, actor, args.calls,
                                                      args.pipelined, tensor))
                o, t = ours[-1], theirs[-1]
                print(f"rep {rep}: nereus rtt {o['rtt'] * 1e6:7.1f} us p99 {o['p99'] * 1e6:7.1f} "
                      f"| {o['rate']:8.0f} calls/s | 64MiB {o['tensor_s'] * 1e3:6.1f} ms   "
                      f"ray rtt {t['rtt'] * 1e6:7.1f} us p99 {t['p99'] * 1e6:7.1f} "
                      f"| {t['rate']:8.0f} calls/s | 64MiB {t['tensor_s'] * 1e3:6.1f} ms",
                      flush=True)
    finally:
        ray.shutdown()
    n, r = _summary(ours), _summary(theirs)
    result = {
        "nereus_rtt_us": round(n["rtt"] * 1e6, 1),
        "ray_rtt_us": round(r["rtt"] * 1e6, 1),
        "rtt_ratio": round(r["rtt"] / n["rtt"], 2),
        "nereus_p99_us": round(n["p99"] * 1e6, 1),
        "ray_p99_us": round(r["p99"] * 1e6, 1),
        "nereus_rtt_us_spread": [round(n["rtt_min"] * 1e6, 1), round(n["rtt_max"] * 1e6, 1)],
        "ray_rtt_us_spread": [round(r["rtt_min"] * 1e6, 1), round(r["rtt_max"] * 1e6, 1)],
        "nereus_calls_per_s": round(n["rate"]),
        "ray_calls_per_s": round(r["rate"]),
        "throughput_ratio": round(n["rate"] / r["rate"], 2),
        "nereus_calls_per_s_spread": [round(n["rate_min"]), round(n["rate_max"])],
        "ray_calls_per_s_spread": [round(r["rate_min"]), round(r["rate_max"])],
        "nereus_tensor_64mib_s": round(n["tensor_s"], 4),
        "ray_tensor_64mib_s": round(r["tensor_s"], 4),
        "tensor_ratio": round(r["tensor_s"] / n["tensor_s"], 2),
        "calls": args.calls, "pipelined": args.pipelined, "reps": args.reps,
        "threads": "1 torch/OMP thread per actor process on each side; drivers single-threaded",
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.actor_rpc")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--pipelined", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=500)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    return run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
