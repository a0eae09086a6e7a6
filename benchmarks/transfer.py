"""Intra-host tensor hand-off between two processes: nereus p2p vs memcpy, gloo and Ray.

    .venv/bin/python -m benchmarks.transfer [--reps 7] [--sizes-mib 1,16,64,256] [--no-ray]

For each payload size (MiB):
- nereus p2p (hand-off): two worker processes with a CpuCommunicator; rank 0 sends
  N bytes, rank 1 ``recv_new``s them (the sender copies once into a pooled
  shared-memory segment that becomes the receiver's tensor: zero copy on the reading
  side, like Ray's numpy path). Time: from just before the send on rank 0 to the
  tensor in hand on rank 1 (both read CLOCK_MONOTONIC); GB/s = N / time.
- nereus p2p into a tensor: the same with ``recv`` into a ready tensor (pipelined
  ring: the sender copies into slots while the receiver copies out).
- gloo p2p: the same with ``use_shm=False`` (torch ProcessGroupGloo send/recv).
- memcpy: ``dst.copy_(src)`` into a ready tensor (its pages mapped already) in one
  process, the physical limit, sampled right after each transfer in the receiving
  process (and in the driver between Ray transfers), so limit and transfer see the
  same machine load; ``fraction_of_memcpy`` is against it.
- memcpy into fresh memory: ``torch.empty(n).copy_(src)``, allocation and first-touch
  page faults included (what a receiver that gets a new tensor pays), sampled the same
  way; ``fraction_of_fresh_memcpy`` is against it.
- Ray (object store) fastest path: ``ray.put(numpy array)`` then an actor reads it
  (zero-copy on the reading side, the actor touches one element).
- Ray with a plain torch tensor: Ray's default path (pickled; copied).

Every side is timed one way, the same way: from just before the sender starts (the
send, ``ray.put``, the call) to the moment the receiver holds the data (after
``recv``; at the top of the Ray actor's method, its argument in hand), both stamps on
CLOCK_MONOTONIC (one clock for every process of the host); the reply is not timed.
GB/s = N / time.

Every side gets one thread (torch.set_num_threads(1), OMP_NUM_THREADS=1; Ray:
num_cpus=2, one actor). Warm-up first, then ``--reps`` repetitions; median and
[min, max] are printed. The machine is shared: figures are noisy. The LAST line is
one JSON object with p2p_256MiB_GBps, memcpy_GBps, fraction_of_memcpy,
memcpy_fresh_GBps, fraction_of_fresh_memcpy, ray_GBps, ratio_vs_ray, ray_torch_GBps,
ratio_vs_ray_torch (all at the largest size), the per-size medians and the load
average at start.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from nereus.transfer.cpu import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS

MiB = 2**20


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# ------------------------------------------------------------------ worker side


def _worker(
    rank: int, port: int, mode: str, sizes: list[int], reps: int, slot: int, slots: int
) -> None:
    from nereus.transfer import CpuCommunicator

    torch.set_num_threads(1)
    comm = CpuCommunicator(
        f"bench-{mode}",
        rank,
        2,
        "127.0.0.1",
        port,
        timeout_s=120.0,
        use_shm=(mode != "gloo"),
        slot_bytes=slot,
        slots=slots,
    )
    into_tensor = mode != "handoff"
    out = {}
    stamp = torch.zeros(1, dtype=torch.float64)
    for n in sizes:
        a = torch.arange(n, dtype=torch.int64).to(torch.uint8)
        b = torch.empty(n, dtype=torch.uint8)
        # memcpy into a ready tensor, sampled right after each transfer in the same
        # process, so the limit and the transfer see the same machine load
        c = torch.ones(n, dtype=torch.uint8)
        d = torch.empty(n, dtype=torch.uint8)
        d.copy_(c)
        times, copies, fresh = [], [], []
        for i in range(reps + 2):  # two warm-up transfers
            comm.barrier()
            if rank == 0:
                # perf_counter is CLOCK_MONOTONIC: one clock for every process of the host
                t0 = time.perf_counter()
                comm.send(a, 1)
                comm.send(torch.tensor([t0], dtype=torch.float64), 1)
            else:
                if into_tensor:
                    comm.recv(b, 0)
                    got = b
                else:
                    got = comm.recv_new((n,), torch.uint8, 0)
                t1 = time.perf_counter()
                comm.recv(stamp, 0)
                if i >= 2:
                    times.append(n / (t1 - stamp.item()) / 1e9)
                    t2 = time.perf_counter()
                    d.copy_(c)
                    copies.append(n / (time.perf_counter() - t2) / 1e9)
                    t2 = time.perf_counter()
                    e = torch.empty(n, dtype=torch.uint8)
                    e.copy_(c)
                    fresh.append(n / (time.perf_counter() - t2) / 1e9)
                    del e
                if i == reps + 1:
                    assert torch.equal(got, torch.arange(n, dtype=torch.int64).to(torch.uint8))
                del got  # a handed-off segment goes back to the sender's pool
        out[n] = {"p2p": times, "memcpy": copies, "memcpy_fresh": fresh}
    comm.destroy()
    if rank == 1:
        print(json.dumps({str(k): v for k, v in out.items()}), flush=True)


def run_p2p(
    mode: str,
    sizes: list[int],
    reps: int,
    slot: int = DEFAULT_SLOT_BYTES,
    slots: int = DEFAULT_SLOTS,
) -> dict[int, dict[str, list[float]]]:
    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.transfer",
        "--worker",
        mode,
        str(store.port),
        ",".join(map(str, sizes)),
        str(reps),
        str(slot),
        str(slots),
    ]
    procs = [
        subprocess.Popen([*cmd, str(r)], stdout=subprocess.PIPE, text=True, env=env)
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode} workers failed: {[p.returncode for p in procs]}")
    data = json.loads(outs[1].strip().splitlines()[-1])
    return {int(k): v for k, v in data.items()}


# ------------------------------------------------------------------ Ray


def run_ray(sizes: list[int], reps: int) -> tuple[dict, dict, dict]:
    import numpy as np
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=2 * 2**30,
        logging_level="ERROR",
    )
    try:

        @ray.remote(num_cpus=1)
        class Reader:
            def __init__(self) -> None:
                torch.set_num_threads(1)

            def touch(self, arr) -> tuple[int, float]:
                # the argument is in hand here (numpy from the object store is a
                # zero-copy read-only view): stamp the one-way time first
                t1 = time.perf_counter()
                return int(arr[0]) + int(arr[-1]), t1

        reader = Reader.remote()
        ray.get(reader.touch.remote(np.ones(8, dtype=np.uint8)))

        def one_way(arg_of) -> float:
            """Seconds from before the sender starts to the actor holding the data."""
            t0 = time.perf_counter()
            total, t1 = ray.get(reader.touch.remote(arg_of()))
            assert total == 2
            return t1 - t0

        fast, slow, copies = {}, {}, {}
        for n in sizes:
            arr = np.ones(n, dtype=np.uint8)
            src = torch.ones(n, dtype=torch.uint8)
            dst = torch.empty(n, dtype=torch.uint8)
            dst.copy_(src)
            copies[n] = []
            times = []
            for i in range(reps + 1):
                dt = one_way(lambda arr=arr: ray.put(arr))
                if i:
                    times.append(n / dt / 1e9)
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    copies[n].append(n / (time.perf_counter() - t0) / 1e9)
            fast[n] = times
            ten = torch.ones(n, dtype=torch.uint8)
            times = []
            torch_reps = max(2, reps // 2) if n >= 64 * MiB else reps
            for i in range(torch_reps + 1):
                dt = one_way(lambda ten=ten: ten)
                if i:
                    times.append(n / dt / 1e9)
            slow[n] = times
        return fast, slow, copies
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ driver


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, port, sizes, reps, slot, slots, rank = sys.argv[2:9]
        _worker(
            int(rank),
            int(port),
            mode,
            [int(s) for s in sizes.split(",")],
            int(reps),
            int(slot),
            int(slots),
        )
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes-mib", default="1,16,64,256")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument(
        "--slot-kib",
        type=int,
        default=DEFAULT_SLOT_BYTES // 1024,
        help="shared-memory ring slot size (CpuCommunicator slot_bytes)",
    )
    ap.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="slots per ring")
    args = ap.parse_args()
    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    load_at_start = round(os.getloadavg()[0], 2)
    print(
        f"transfer benchmark: {os.cpu_count()} cores, load {load_at_start}, reps={args.reps}, "
        "one thread per side; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    handoff = run_p2p("handoff", sizes, args.reps, args.slot_kib * 1024, args.slots)
    ring = run_p2p("ring", sizes, args.reps, args.slot_kib * 1024, args.slots)
    gloo = run_p2p("gloo", sizes, args.reps)
    results = {
        "memcpy": {n: handoff[n]["memcpy"] for n in sizes},
        "memcpy_fresh": {n: handoff[n]["memcpy_fresh"] for n in sizes},
        "nereus_p2p": {n: handoff[n]["p2p"] for n in sizes},
        "memcpy_during_ring": {n: ring[n]["memcpy"] for n in sizes},
        "nereus_p2p_into_tensor": {n: ring[n]["p2p"] for n in sizes},
        "gloo_p2p": {n: gloo[n]["p2p"] for n in sizes},
    }
    if not args.no_ray:
        results["ray_numpy"], results["ray_torch"], results["memcpy_during_ray"] = run_ray(
            sizes, args.reps
        )
    print(f"{'GB/s median [min, max]':<24}" + "".join(f"{n // MiB:>8} MiB{'':13}" for n in sizes))
    for name, per in results.items():
        cells = []
        for n in sizes:
            s = _summary(per[n])
            cells.append(f"{s['median']:7.2f} [{s['min']:5.2f},{s['max']:6.2f}]")
        print(f"{name:<24}" + "  ".join(cells), flush=True)
    top = sizes[-1]
    med = {
        name: {n // MiB: statistics.median(per[n]) for n in sizes} for name, per in results.items()
    }
    top_mib = top // MiB
    summary = {
        f"p2p_{top_mib}MiB_GBps": med["nereus_p2p"][top_mib],
        "memcpy_GBps": med["memcpy"][top_mib],
        "fraction_of_memcpy": med["nereus_p2p"][top_mib] / med["memcpy"][top_mib],
        "memcpy_fresh_GBps": med["memcpy_fresh"][top_mib],
        "fraction_of_fresh_memcpy": med["nereus_p2p"][top_mib] / med["memcpy_fresh"][top_mib],
        "p2p_into_tensor_GBps": med["nereus_p2p_into_tensor"][top_mib],
        "gloo_p2p_GBps": med["gloo_p2p"][top_mib],
    }
    if not args.no_ray:
        summary.update(
            {
                "ray_GBps": med["ray_numpy"][top_mib],
                "ratio_vs_ray": med["nereus_p2p"][top_mib] / med["ray_numpy"][top_mib],
                "ray_torch_GBps": med["ray_torch"][top_mib],
                "ratio_vs_ray_torch": med["nereus_p2p"][top_mib] / med["ray_torch"][top_mib],
            }
        )
    summary["median_GBps_by_size_MiB"] = med
    summary["threads_per_side"] = 1
    summary["timing"] = "one way on every side: sender start to data in the receiver's hand"
    summary["load_avg_1min_at_start"] = load_at_start
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
