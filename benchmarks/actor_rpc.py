"""Actor call cost, nereus vs Ray, side by side in one run.

    python -m benchmarks.actor_rpc [--calls 3000] [--pipelined 5000] [--reps 5]

Measures, for each framework, on one actor in its own worker process:
- sync no-op round trip: ``await ref.noop.call_one()`` one after the other vs
  ``ray.get(actor.noop.remote())``; median and p99 over ``--calls`` calls per
  repetition (the figures are the median over repetitions, spread = min..max);
- pipelined no-op calls per second: submit ``--pipelined`` calls, then wait for all
  (nereus: futures + gather; Ray: N ``.remote()`` then ``ray.get``);
- a 64 MiB float32 CPU torch tensor argument echoed back (round trip seconds).

Each side's driver runs in a process of its own (Ray's blocking driver never runs
beside nereus's live event loop), and one repetition at a time runs on one side: the
sides take turns, and which goes first alternates from one repetition to the next, so
a change in machine load hits both. Warm-up calls come first. Threads: each side's
actor runs with 1 torch/OMP thread; the nereus driver runs uvloop; Ray runs with
``num_cpus=2`` and its defaults (its default torch serializer, which a user gets
without extra setup).

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
import subprocess
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
    return {
        "rtt": statistics.median(lat),
        "p99": _percentile(lat, 0.99),
        "rate": rate,
        "tensor_s": tensor_s,
    }


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
    return {
        "rtt": statistics.median(lat),
        "p99": _percentile(lat, 0.99),
        "rate": rate,
        "tensor_s": tensor_s,
    }


def _summary(reps: list[dict]) -> dict:
    out = {}
    for k in ("rtt", "p99", "rate", "tensor_s"):
        vals = [r[k] for r in reps]
        out[k] = statistics.median(vals)
        out[k + "_min"] = min(vals)
        out[k + "_max"] = max(vals)
    return out


# Each side runs in a process of its own, driven over stdin/stdout one repetition at a
# time: Ray's blocking driver never shares a process (or the GIL) with nereus's live
# event loop, and only one side works at any moment.


async def _nereus_side(args: argparse.Namespace) -> None:
    tensor = torch.arange(TENSOR_BYTES // 4, dtype=torch.float32)
    loop = asyncio.get_running_loop()
    async with Cluster.local(devices=1, heartbeat_timeout_s=120, span_sample_every=0) as cluster:
        mesh = await cluster.spawn("bench", Noop, devices=[0])
        for _ in range(args.warmup):
            await mesh.noop.call_one()
        await mesh.echo.call_one(tensor)
        print("ready", flush=True)
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "rep":
            rep = await _nereus_rep(mesh, args.calls, args.pipelined, tensor)
            print(json.dumps(rep), flush=True)


def _ray_side(args: argparse.Namespace) -> None:
    import ray

    tensor = torch.arange(TENSOR_BYTES // 4, dtype=torch.float32)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        actor = _ray_actor_class().remote()
        ray.get([actor.noop.remote() for _ in range(args.warmup)])
        ray.get(actor.echo.remote(tensor))
        print("ready", flush=True)
        while sys.stdin.readline().strip() == "rep":
            print(json.dumps(_ray_rep(ray, actor, args.calls, args.pipelined, tensor)), flush=True)
    finally:
        ray.shutdown()


class _Side:
    """One side's process: ``rep()`` runs one repetition there and returns its figures."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.actor_rpc",
            "--side",
            name,
            "--calls",
            str(args.calls),
            "--pipelined",
            str(args.pipelined),
            "--warmup",
            str(args.warmup),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"the {self.name} side exited ({self.proc.wait()}) before saying {what!r}"
                )
            if what == "json" and line.startswith("{") or line.strip() == what:
                return line

    def rep(self) -> dict:
        self.proc.stdin.write("rep\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("json"))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def compare(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401 - only to fail early with a clear message
    except ImportError as e:
        print(
            f"Ray cannot be imported ({e}); install it with `pip install nereus[bench]`",
            file=sys.stderr,
        )
        return 1
    load_at_start = round(os.getloadavg()[0], 2)
    sides = {}
    try:
        sides["nereus"] = _Side("nereus", args)
        sides["ray"] = _Side("ray", args)
        ours, theirs = [], []
        for rep in range(args.reps):
            # alternate which side goes first, so a trend in the machine's load hits both
            order = ("nereus", "ray") if rep % 2 == 0 else ("ray", "nereus")
            got = {name: sides[name].rep() for name in order}
            ours.append(got["nereus"])
            theirs.append(got["ray"])
            o, t = got["nereus"], got["ray"]
            print(
                f"rep {rep} ({order[0]} first): nereus rtt {o['rtt'] * 1e6:7.1f} us p99 "
                f"{o['p99'] * 1e6:7.1f} | {o['rate']:8.0f} calls/s | 64MiB "
                f"{o['tensor_s'] * 1e3:6.1f} ms   ray rtt {t['rtt'] * 1e6:7.1f} us p99 "
                f"{t['p99'] * 1e6:7.1f} | {t['rate']:8.0f} calls/s | 64MiB "
                f"{t['tensor_s'] * 1e3:6.1f} ms",
                flush=True,
            )
    finally:
        for side in sides.values():
            side.close()
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
        "calls": args.calls,
        "pipelined": args.pipelined,
        "reps": args.reps,
        "threads": "1 torch/OMP thread per actor process on each side; each driver in a "
        "process of its own, single-threaded; sides alternate going first",
        "load_avg_1min": load_at_start,
    }
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.actor_rpc")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--pipelined", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--side", choices=("nereus", "ray"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.side == "nereus":
        run(_nereus_side(args))
        return 0
    if args.side == "ray":
        _ray_side(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
