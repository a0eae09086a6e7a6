"""Measure what the simulator's ground truth says of a CPU worker of a fixed capacity.

``python -m benchmarks.cpu_truth [--cores 0.45] [--sequences 8,16,32] [--lengths 4,16,32,48]``
``[--steps 2] [--ranks 2,4] [--bytes 4096,...] [--reps 5]``

The figures behind the ``[cpu]`` table of ``nereus/sim/ground_truth.toml``: the project's
own engines (generation, inference, training: the ones a worker runs) on the policies
benchmark's model (``benchmarks.policies.MODEL``: hidden 128, 4 layers, float32) and task,
a PPO step with a critic and a reference, run in one child process under a kernel CPU
quota of ``--cores`` (``nereus.actors.CpuLimits``, as a worker of ``cores_per_device``
runs) at one torch thread. For every ``--sequences`` (the sequences one replica
handles) x ``--lengths`` (new tokens, end-of-sequence ignored, so every response is that
long), one warm-up step then ``--steps`` measured steps, each model-stage on a device of
its own (its own memory ledger): the median CPU seconds each model-stage's work took
(and its wall seconds under the quota, for the record: a quota lets a short burst run at
a full core, so wall seconds depend on how the work falls into the kernel's periods,
which the ground truth models apart), its ledger peak during the step, the CPU seconds
of the step besides its model-stages (the controller's own work); and before the first
step, what each model-stage's ledger holds (weights, gradients, optimizer moments).

Then the transfer plane between such workers: ``--ranks`` processes, each under its own
quota of ``--cores``, make one gloo group (``nereus.transfer.cpu.CpuCommunicator``, the
one a worker makes; its set-up timed) and time an all-reduce and a broadcast of each of
``--bytes`` (medians of ``--reps``); and the seconds to start each kind of engine over
the model (what a move that places a model-stage on a worker pays for it).

Nothing here reads the planner's cost or memory model, and nothing here runs the
policies benchmark's job under its traces (the truth is not fitted to the runs it is
compared with). Every figure is this machine's, under its load at the time: the command
and the date go into the toml's comments. The last line is one JSON object with every
point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STAGES = (
    "policy_generation",
    "reference_inference",
    "critic_inference",
    "policy_training",
    "critic_training",
)
# each model-stage on a device of its own, so each has its own ledger
PLAN = {name: {"devices": [i]} for i, name in enumerate(STAGES)}
PROMPTS_PER_SAMPLE = 4  # samples per prompt, as the policies benchmark's job


def _job(sequences: int, length: int, out_dir: str) -> Any:
    from benchmarks.policies import workload_data
    from nereus.config import from_dict
    from nereus.job.config import JobConfig

    data = {
        **workload_data(sequences // PROMPTS_PER_SAMPLE, PROMPTS_PER_SAMPLE),
        "sampling": {"max_new_tokens": length, "ignore_eos": True},
        "cluster": {"mode": "in_process", "devices": len(STAGES), "memory_per_device": "4GiB"},
        "plan": PLAN,
        "run": {"steps": 1000, "out_dir": out_dir, "progress": False, "seed": 0},
    }
    return from_dict(JobConfig, data)


async def _point(sequences: int, length: int, steps: int) -> dict[str, Any]:
    """One (sequences, length) point in this process (the child under the quota)."""
    from nereus.job.loop import RLJob

    with tempfile.TemporaryDirectory(prefix="nereus-cpu-truth-") as out:
        rl = RLJob(_job(sequences, length, out))
        await rl.start()
        try:
            prompt = rl.max_prompt_tokens()
            cpu = _count_cpu_seconds(rl.stages)
            # before any step: what each model-stage holds whatever it runs (weights, and
            # for training its gradients and optimizer moments)
            resident = {d: r["used_bytes"] for d, r in (await rl.stages.memory()).items()}
            rows = []
            for _ in range(steps + 1):  # the first is the warm-up
                cpu.clear()
                t0, c0 = time.perf_counter(), time.process_time()
                record = await rl.run_step()
                wall, used = time.perf_counter() - t0, time.process_time() - c0
                rows.append((wall, record, dict(cpu), used))
            starts = _engine_starts(rl)
        finally:
            await rl.close()
    rows = rows[1:]
    seconds = {
        s: statistics.median(r[1]["model_stage_seconds"].get(s, 0.0) for r in rows) for s in STAGES
    }
    cpu_seconds = {s: statistics.median(r[2].get(s, 0.0) for r in rows) for s in STAGES}
    controller_cpu = statistics.median(r[3] - sum(r[2].values()) for r in rows)
    peaks = {
        s: max(int(r[1]["device_peak_bytes"].get(str(i), 0)) for r in rows)
        for i, s in enumerate(STAGES)
    }
    held = {s: int(resident.get(i, 0)) for i, s in enumerate(STAGES)}
    controller = statistics.median(r[0] - sum(r[1]["model_stage_seconds"].values()) for r in rows)
    lengths = [r[1]["response_len_mean"] for r in rows]
    return {
        "sequences": sequences,
        "length": length,
        "prompt_tokens": prompt,
        "response_len_mean": statistics.mean(lengths),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "peak_bytes": peaks,
        "resident_bytes": held,
        "controller_s": controller,
        "controller_cpu_s": controller_cpu,
        "engine_start_s": starts,
        "step_s": statistics.median(r[0] for r in rows),
    }


def _count_cpu_seconds(stages: Any) -> dict[str, float]:
    """Count the CPU seconds each model-stage's work takes (``ModelStages.timed`` blocks:
    the process's CPU time, the engines at one thread) into the returned dict, beside
    the wall seconds the stages count themselves."""
    counted: dict[str, float] = {}
    wall_timed = stages.timed

    @contextmanager
    def timed(stage: str) -> Iterator[None]:
        c0 = time.process_time()
        try:
            with wall_timed(stage):
                yield
        finally:
            counted[stage] = counted.get(stage, 0.0) + time.process_time() - c0

    stages.timed = timed
    return counted


def _engine_starts(rl: Any, reps: int = 3) -> dict[str, float]:
    """Median seconds to start each kind of engine over the job's model folder (what a
    worker pays for a model-stage that a move places on it), its ledger unlimited."""
    from nereus.engines.generation import GenerationEngine
    from nereus.engines.inference import InferenceEngine
    from nereus.engines.memory import MemoryLedger
    from nereus.engines.options import EngineOptions
    from nereus.engines.training import TrainingEngine

    cfg = rl.cfg

    def options(name: str) -> EngineOptions:
        ledger = MemoryLedger(name, None)
        return EngineOptions(
            model_dir=rl.model_dir, dtype=cfg.model.dtype, ledger=ledger, name=name
        )

    kinds = {
        "generation": lambda: GenerationEngine(rl.model_config, options=options("g")),
        "inference": lambda: InferenceEngine(
            rl.model_config, options=options("i"), micro_batch_size=cfg.optim.micro_batch_size
        ),
        "training": lambda: TrainingEngine(
            rl.model_config, options=options("t"), optim=cfg.optim.for_engine()
        ),
    }
    out = {}
    for kind, make in kinds.items():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            make()
            times.append(time.perf_counter() - t0)
        out[kind] = statistics.median(times)
    return out


def _collective_rank(args: argparse.Namespace) -> None:
    """One rank of the collectives measurement (a child under its own quota): the group's
    set-up, then for every size an all-reduce and a broadcast from rank 0, one warm-up
    then ``--reps`` timed, each after an all-reduce of one element that lines the ranks
    up. Rank 0 prints its medians."""
    import torch

    from nereus.transfer.cpu import CpuCommunicator

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    comm = CpuCommunicator(f"truth{args.size}", args.rank, args.size, "127.0.0.1", args.port)
    setup = time.perf_counter() - t0
    line = torch.zeros(1)
    out: dict[str, Any] = {
        "ranks": args.size,
        "group_setup_s": setup,
        "allreduce": [],
        "broadcast": [],
    }
    try:
        for nbytes in args.bytes:
            x = torch.ones(max(1, nbytes // 4))
            for op in ("allreduce", "broadcast"):
                times = []
                for _ in range(args.reps + 1):
                    comm.all_reduce(line)
                    t0 = time.perf_counter()
                    if op == "allreduce":
                        comm.all_reduce(x)
                    else:
                        comm.broadcast(x, 0)
                    times.append(time.perf_counter() - t0)
                out[op].append([args.size, x.numel() * 4, statistics.median(times[1:])])
    finally:
        comm.destroy()
    if args.rank == 0:
        print(json.dumps(out), flush=True)


def _collectives(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``_collective_rank`` over 2 .. ``--ranks`` capped processes, one group size at a time."""
    import torch.distributed as dist

    from nereus.actors import CpuLimits

    results = []
    for size in args.ranks:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        limits = CpuLimits([args.cores] * size, owner="cpu-truth")
        cmd = [sys.executable, "-m", "benchmarks.cpu_truth", "--collective-rank"]
        cmd += ["--size", str(size), "--port", str(store.port), "--reps", str(args.reps)]
        cmd += ["--bytes", ",".join(map(str, args.bytes))]
        procs = []
        try:
            for rank in range(size):
                procs.append(
                    subprocess.Popen(
                        [*cmd, "--rank", str(rank)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        preexec_fn=limits.preexec(rank),
                        env=os.environ | {"OMP_NUM_THREADS": "1"},
                    )
                )
            outs = [p.communicate(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            limits.close()
        failed = [e for p, (_, e) in zip(procs, outs, strict=True) if p.returncode]
        if failed:
            raise SystemExit(f"the collectives of {size} ranks failed: {failed[0][-2000:]}")
        results.append(json.loads(outs[0][0].strip().splitlines()[-1]))
    return results


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # as a worker of under one core computes
    for n in args.sequences:
        for length in args.lengths:
            print(json.dumps(asyncio.run(_point(n, length, args.steps))), flush=True)


def _parent(args: argparse.Namespace) -> dict[str, Any]:
    from nereus.actors import CpuLimits

    limits = CpuLimits([args.cores], owner="cpu-truth")
    cmd = [sys.executable, "-m", "benchmarks.cpu_truth", "--child"]
    cmd += ["--sequences", ",".join(map(str, args.sequences))]
    cmd += ["--lengths", ",".join(map(str, args.lengths)), "--steps", str(args.steps)]
    started = time.time()
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            preexec_fn=limits.preexec(0),
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
    finally:
        limits.close()
    if out.returncode != 0:
        raise SystemExit(f"the measurement under {args.cores} cores failed:\n{out.stderr[-2000:]}")
    points = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for p in points:
        print(json.dumps(p), flush=True)
    collectives = _collectives(args)
    for c in collectives:
        print(json.dumps(c), flush=True)
    from benchmarks.policies import MODEL

    return {
        "model": MODEL,
        "cores": args.cores,
        "started_unix_s": started,
        "load_average_1m": os.getloadavg()[0],
        "points": points,
        "collectives": collectives,
    }


KINDS = {
    "generation": ("policy_generation",),
    "inference": ("reference_inference", "critic_inference"),
    "training": ("policy_training", "critic_training"),
}
MICRO_BATCH = 2  # the job's optim.micro_batch_size (rows of an inference or training pass)


def _lstsq(rows: list[list[float]], ys: list[float], names: list[str]) -> dict[str, float]:
    """Least squares with every coefficient >= 0: a feature whose coefficient comes out
    negative (noise: it explains nothing the others do not) is dropped and the rest
    fitted again."""
    import numpy as np

    keep = list(range(len(names)))
    while True:
        a = np.array([[r[i] for i in keep] for r in rows], dtype=float)
        coef, *_ = np.linalg.lstsq(a, np.array(ys, dtype=float), rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = dict.fromkeys(names, 0.0)
            out.update({names[i]: max(0.0, float(c)) for i, c in zip(keep, coef, strict=True)})
            return out
        keep.pop(int(np.argmin(coef)))


def fit(result: dict[str, Any]) -> dict[str, float]:
    """The ``[cpu]`` table's figures from the measured points (least squares, each
    coefficient >= 0): per-token and per-pass CPU seconds of each engine kind, the ledger's
    bytes per token, bytes per parameter held, the collectives' per-step latency and
    per-byte seconds, the group set-up per rank and the engine start seconds."""
    points = result["points"]
    prompt = points[0]["prompt_tokens"]

    def kind_mean(p: dict[str, Any], key: str, kind: str) -> float:
        return sum(p[key][s] for s in KINDS[kind]) / len(KINDS[kind])

    from nereus.actors._cpulimit import PERIOD_US  # the period worker quotas are set on

    out: dict[str, float] = {
        "cores": result["cores"],
        "period_s": PERIOD_US / 1e6,
        "prompt_tokens": prompt,
    }
    first = points[0]
    out["params"] = first["resident_bytes"]["policy_generation"] / 4  # float32 weights
    out["hidden_size"] = result["model"]["hidden_size"]
    out["num_layers"] = result["model"]["num_layers"]
    for kind in KINDS:
        held = kind_mean(first, "resident_bytes", kind)
        out[f"{kind}_resident_bytes_per_param"] = held / out["params"]
        out[f"{kind}_start_s"] = statistics.median(p["engine_start_s"][kind] for p in points)
    n = [p["sequences"] for p in points]
    new = [p["length"] for p in points]
    seq_len = [prompt + x for x in new]
    tokens = [a * b for a, b in zip(n, seq_len, strict=True)]
    micro = [-(-a // MICRO_BATCH) for a in n]
    secs = {k: [kind_mean(p, "cpu_seconds", k) for p in points] for k in KINDS}
    out |= _lstsq(
        [[1.0, x, x * a] for x, a in zip(new, n, strict=True)],
        secs["generation"],
        ["generation_call_s", "decode_step_s", "decode_row_s"],
    )
    out |= _lstsq(
        [[m, t] for m, t in zip(micro, tokens, strict=True)],
        secs["inference"],
        ["inference_micro_batch_s", "inference_token_s"],
    )
    out |= _lstsq(
        [[1.0, m, t] for m, t in zip(micro, tokens, strict=True)],
        secs["training"],
        ["training_step_s", "training_micro_batch_s", "training_token_s"],
    )
    out |= _lstsq(
        [[1.0, t] for t in tokens],
        [p["controller_cpu_s"] for p in points],
        ["controller_step_s", "controller_token_s"],
    )

    def transient(p: dict[str, Any], kind: str) -> float:
        return kind_mean(p, "peak_bytes", kind) - kind_mean(p, "resident_bytes", kind)

    out |= _lstsq(
        [[t] for t in tokens],
        [transient(p, "generation") for p in points],
        ["generation_bytes_per_token"],
    )
    for kind in ("inference", "training"):
        out |= _lstsq(
            [[MICRO_BATCH * x, MICRO_BATCH * x * x] for x in seq_len],
            [transient(p, kind) for p in points],
            [f"{kind}_bytes_per_token", f"{kind}_bytes_per_token_squared"],
        )
    rows_ar, ys_ar, rows_bc, ys_bc, setup = [], [], [], [], []
    for c in result["collectives"]:
        r = c["ranks"]
        setup.append([float(r), c["group_setup_s"]])
        for _, nbytes, t in c["allreduce"]:
            rows_ar.append([2.0 * (r - 1), 2.0 * (r - 1) / r * nbytes])
            ys_ar.append(t)
        for _, nbytes, t in c["broadcast"]:
            rows_bc.append([1.0, float(nbytes)])
            ys_bc.append(t)
    out |= _lstsq(rows_ar, ys_ar, ["allreduce_step_s", "allreduce_byte_s"])
    out |= _lstsq(rows_bc, ys_bc, ["broadcast_s", "broadcast_byte_s"])
    out |= _lstsq([[1.0, r] for r, _ in setup], [t for _, t in setup], ["group_s", "group_rank_s"])
    return out


def toml_block(result: dict[str, Any], command: str, commit: str) -> str:
    """The ``[cpu]`` table of ``ground_truth.toml`` for ``result``: its source, the
    measured points as comments, the fitted figures."""
    f = result["fit"]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(result["started_unix_s"]))
    lines = [
        "[cpu]",
        f"# measured {when}, commit {commit}, 1-minute load average "
        f"{result['load_average_1m']:.1f} at the end",
        "# (a shared 2-core machine):",
        f"#   {command}",
        "# points: [sequences of one replica, new tokens] -> CPU seconds (and wall seconds",
        "# under the quota) of generation / inference / training (means of the model-stages",
        "# of a kind), ledger peak over resident bytes of each kind:",
    ]
    for p in result["points"]:
        sec = {k: sum(p["seconds"][s] for s in v) / len(v) for k, v in KINDS.items()}
        cpu = {k: sum(p["cpu_seconds"][s] for s in v) / len(v) for k, v in KINDS.items()}
        extra = {
            k: sum(p["peak_bytes"][s] - p["resident_bytes"][s] for s in v) / len(v)
            for k, v in KINDS.items()
        }
        lines.append(
            f"#   [{p['sequences']}, {p['length']}]: "
            + " / ".join(f"{cpu[k]:.4f}" for k in KINDS)
            + " cpu s ("
            + " / ".join(f"{sec[k]:.4f}" for k in KINDS)
            + " wall),"
        )
        lines.append(
            "#     "
            + " / ".join(f"{extra[k]:.0f}" for k in KINDS)
            + f" B; controller {p['controller_cpu_s']:.4f} cpu s"
        )
    lines.append("# collectives [ranks, bytes, seconds] and group set-up:")
    for c in result["collectives"]:
        ar = ", ".join(f"[{b}, {t:.5f}]" for _, b, t in c["allreduce"])
        bc = ", ".join(f"[{b}, {t:.5f}]" for _, b, t in c["broadcast"])
        lines.append(f"#   {c['ranks']} ranks, set-up {c['group_setup_s']:.4f} s; all-reduce")
        lines.append(f"#     {ar};")
        lines.append(f"#     broadcast {bc}")
    lines.append(
        'source = "measurement: python -m benchmarks.cpu_truth (the commands and points '
        "above): the project's engines of the policies benchmark's model on one worker "
        f"under a kernel quota of {result['cores']:g} cores (CPU seconds of their work), "
        "its transfer plane between such workers (wall seconds); every figure a "
        "least-squares fit (coefficients >= 0) of the points. A device of q cores runs "
        "q x period_s of CPU work per period of the kernel's scheduler (nereus.actors."
        "_cpulimit.PERIOD_US), each model-stage from a full budget (assumption: its "
        "worker idled while the others worked). Other models: CPU seconds by parameters, "
        "bytes per token by hidden size x layers (assumptions); TP, PP and DP add the "
        'measured collectives (assumption: as a ring of gloo steps and sends)."'
    )
    for key, value in f.items():
        lines.append(f"{key} = {value:.6g}")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_truth", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--cores", type=float, default=0.45)
    ap.add_argument("--sequences", type=_ints, default=[8, 16, 32])
    ap.add_argument("--lengths", type=_ints, default=[4, 16, 32, 48])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ranks", type=_ints, default=[2, 4], help="collective group sizes")
    ap.add_argument(
        "--bytes", type=_ints, default=[4096, 2**18, 2**21, 2**23], help="collective sizes"
    )
    ap.add_argument("--reps", type=int, default=5, help="timed collectives per size")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--toml", default="", help="write the [cpu] table to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--collective-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.collective_rank:
        _collective_rank(args)
        return
    bad = [n for n in args.sequences if n < PROMPTS_PER_SAMPLE or n % PROMPTS_PER_SAMPLE]
    if bad:
        raise SystemExit(f"--sequences {bad}: each must be a multiple of {PROMPTS_PER_SAMPLE}")
    if args.child:
        _child(args)
        return
    result = _parent(args)
    result["fit"] = fit(result)
    if args.toml:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        command = "python -m benchmarks.cpu_truth " + " ".join(argv or sys.argv[1:])
        with open(args.toml, "w") as out:
            out.write(toml_block(result, command, commit or "unknown"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
