"""The GPU machine's figures, on one GPU (and NCCL p2p where there are two or more).

    python -m benchmarks.gpu                        (``make test-gpu`` runs it after the tier)
    python -m benchmarks.gpu --bytes 268435456 --reps 3 --grpo-steps 2      (a shorter run)

- ``device_copy_gbps`` against ``torch_copy_gbps``: nereus packing 1 GiB of tensors
  (256 of 4 MiB) into 256 MiB transfer buckets on the device (``pack_buckets``, what a
  bucketed exchange copies) against one ``torch.Tensor.copy_`` of the same bytes; CUDA
  events, median of ``--reps`` after a warm-up.
- ``nccl_allreduce_us``: a single-rank NCCL all-reduce of 1 KiB through
  ``NcclCommunicator`` (its own stream, events both ways): GPU time from an event on the
  caller's stream before the call to one after it (median of 200), and
  ``nccl_enqueue_us``, the host's time per call (it does not wait for the GPU).
- ``grpo_step_seconds`` and ``grpo_stage_seconds``: the last of ``--grpo-steps`` steps of
  ``examples/grpo_tiny.toml`` on GPU workers (a controller and a ``--gpus all`` node daemon
  in this process), generation and training on GPU 0 (generation on GPU 1 where there is
  one), seconds by model-stage as the step record gives them; vLLM generates where it is
  importable (``grpo_engine`` says which). A failure goes to ``grpo_error``.
- ``weight_load_s``: writing a tiny policy's weights in place into a vLLM engine on the
  GPU (``VllmGenerationEngine.load_named``), median of 3; null with ``weight_load_skipped``
  where vLLM is not importable.
- ``nccl_p2p_gbps``: NCCL send/recv of ``--bytes`` between two processes each seeing one
  GPU as ``cuda:0``, median of ``--reps``, with ``p2p_peer_access`` (whether the GPUs reach
  each other directly); null with ``nccl_p2p_skipped`` on one GPU.

Every part has a deadline. The last line printed is one JSON object with those keys.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project claims Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
BUCKET = 256 << 20


def _gpu_seconds(fn: Any, reps: int) -> list[float]:
    """Seconds of GPU time of ``fn()`` on the current stream, ``reps`` times after a warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def device_copy(nbytes: int, reps: int) -> dict[str, float]:
    """nereus's bucket packing against ``copy_`` of the same bytes (GB/s)."""
    from nereus.transfer.bucket import pack_buckets

    piece = 4 << 20
    sources = [
        torch.full((piece,), i % 251, dtype=torch.uint8, device="cuda:0")
        for i in range(max(nbytes // piece, 1))
    ]
    total = piece * len(sources)
    whole = torch.ones(total, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(whole)
    packed = _gpu_seconds(lambda: pack_buckets(sources, BUCKET), reps)
    plain = _gpu_seconds(lambda: dst.copy_(whole), reps)
    buckets = pack_buckets(sources, BUCKET)
    assert int(buckets[-1][-1]) == (len(sources) - 1) % 251, "the last piece was not packed"
    return {
        "device_copy_gbps": round(total / statistics.median(packed) / 1e9, 1),
        "torch_copy_gbps": round(total / statistics.median(plain) / 1e9, 1),
        "device_copy_bytes": total,
    }


def nccl_allreduce(reps: int = 200) -> dict[str, float]:
    """Single-rank NCCL all-reduce of 1 KiB: GPU latency and host enqueue time (µs)."""
    from nereus.transfer.nccl import NcclCommunicator, unique_id

    comm = NcclCommunicator("bench-allreduce", 0, 1, unique_id(), timeout_s=30.0)
    try:
        x = torch.ones(256, dtype=torch.float32, device="cuda:0")
        gpu, host = [], []
        for i in range(reps + 10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            comm.all_reduce(x)
            t1 = time.perf_counter()
            end.record()  # the caller's stream waited for the all-reduce's event
            comm.synchronize()
            end.synchronize()
            if i >= 10:
                gpu.append(start.elapsed_time(end) * 1e3)
                host.append((t1 - t0) * 1e6)
        assert float(x[0]) == 1.0
        return {
            "nccl_allreduce_us": round(statistics.median(gpu), 1),
            "nccl_enqueue_us": round(statistics.median(host), 1),
        }
    finally:
        comm.destroy()


def _p2p_rank(rank: int, port: int, uid: str, nbytes: int, reps: int) -> None:
    """One rank of the p2p measurement (a subprocess seeing one GPU)."""
    from nereus.transfer.nccl import NcclCommunicator

    comm = NcclCommunicator(
        "p2p", rank, 2, bytes.fromhex(uid), timeout_s=60.0, store_host="127.0.0.1", store_port=port
    )
    buf = torch.full((nbytes,), rank + 1, dtype=torch.uint8, device="cuda:0")
    times = []
    for i in range(reps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        comm.send(buf, 1) if rank == 0 else comm.recv(buf, 0)
        comm.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    if rank == 1:
        assert bool(buf[-1] == 1), "rank 1 did not receive rank 0's bytes"
    comm.destroy()
    print(json.dumps({"rank": rank, "seconds": statistics.median(times)}), flush=True)


def nccl_p2p(nbytes: int, reps: int, timeout_s: float) -> dict[str, Any]:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {
            "nccl_p2p_gbps": None,
            "nccl_p2p_skipped": f"needs 2 GPUs (one per rank); this machine has {gpus}",
        }
    from torch.distributed import TCPStore

    from nereus.transfer.nccl import unique_id

    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    uid = unique_id().hex()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": str(rank),
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.gpu",
                    "--p2p-rank",
                    str(rank),
                    "--port",
                    str(store.port),
                    "--uid",
                    uid,
                    "--bytes",
                    str(nbytes),
                    "--reps",
                    str(reps),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    seconds = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                return {
                    "nccl_p2p_gbps": None,
                    "nccl_p2p_error": f"rank exited {p.returncode}: {err.strip()[-300:]}",
                }
            seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {
        "nccl_p2p_gbps": round(nbytes / max(seconds) / 1e9, 1),
        "nccl_p2p_bytes": nbytes,
        "p2p_peer_access": torch.cuda.can_device_access_peer(0, 1),
    }


async def grpo(steps: int, timeout_s: float, engine: str) -> dict[str, Any]:
    """``steps`` steps of the tiny GRPO job on GPU workers; the last step's seconds."""
    from nereus.actors import Controller, NodeDaemon
    from nereus.actors._keys import generate_key
    from nereus.config import from_dict
    from nereus.job.config import JobConfig
    from nereus.job.loop import RLJob

    data = tomllib.loads((ROOT / "examples" / "grpo_tiny.toml").read_text())
    folder = Path(tempfile.mkdtemp(prefix="nereus-gpu-"))
    key = generate_key()
    (folder / "key").write_bytes(key)
    controller = await Controller(key).start()
    node = NodeDaemon(controller.address, key, gpus="all", transport="ipc", node_id="gpu")
    out: dict[str, Any] = {"grpo_engine": engine, "grpo_steps": 0}
    try:
        await node.start()
        n = len(node.workers)
        gen = min(n, 2) - 1
        data["cluster"] = {
            "mode": "connect",
            "address": controller.address,
            "key_file": str(folder / "key"),
            "devices": gen + 1,
        }
        data["plan"] = {
            "policy_generation": {"devices": [gen]},
            "policy_training": {"devices": [0]},
        }
        data.pop("adapt", None)
        data["run"] = {
            **data.get("run", {}),
            "steps": steps,
            "checkpoint_every": 0,
            "out_dir": str(folder / "run"),
            "progress": False,
        }
        data["sampling"] = {**data["sampling"], "engine": engine}
        if engine == "vllm":  # head_dim 32: a size every vLLM attention backend takes
            data["model"] = {**data["model"], "hidden_size": 128, "intermediate_size": 256}
        job = RLJob(from_dict(JobConfig, data))

        async def run() -> dict[str, Any]:
            await job.start()
            try:
                record: dict[str, Any] = {}
                for _ in range(steps):
                    record = await job.run_step()
                    out["grpo_steps"] += 1
                return record
            finally:
                await job.close()

        record = await asyncio.wait_for(run(), timeout_s)
        out["grpo_dtype"] = job.cfg.model.dtype
        out["grpo_step_seconds"] = round(record["step_seconds"], 4)
        out["grpo_stage_seconds"] = {
            k: round(v, 4) for k, v in record["model_stage_seconds"].items()
        }
        out["grpo_record_seconds"] = {
            k: round(v, 4)
            for k, v in record.items()
            if k.endswith("_seconds") and isinstance(v, (int, float))
        }
    except Exception as e:  # reported, not raised: the other figures still print
        out["grpo_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        await node.stop()
        await controller.close()
    return out


def weight_load(reps: int = 3) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        return {"weight_load_s": None, "weight_load_skipped": "vllm is not importable"}
    from nereus.engines import GenerationEngine
    from nereus.engines.memory import MemoryLedger
    from nereus.engines.options import EngineOptions
    from nereus.engines.vllm_adapter import VllmGenerationEngine
    from nereus.models import save_tiny_model, tiny_config

    config = tiny_config(num_hidden_layers=2, hidden_size=128, tie_word_embeddings=True)
    folder = save_tiny_model(Path(tempfile.mkdtemp(prefix="nereus-vllm-")) / "m", config, seed=1)
    engine = VllmGenerationEngine(
        config,
        folder,
        options=EngineOptions(dtype="bfloat16", ledger=MemoryLedger("gpu-bench-vllm", None)),
        max_model_len=64,
        kv_cache_bytes=64 << 20,
    )
    try:
        # the built-in engine names weights as vLLM does (fused qkv and gate_up)
        reference = GenerationEngine(
            config,
            options=EngineOptions(
                model_dir=folder, ledger=MemoryLedger("gpu-bench-ref", None), name="ref"
            ),
        )
        shards = {k: v.to("cuda:0", torch.bfloat16) for k, v in reference.named_weights().items()}
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            engine.load_named(shards)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return {
            "weight_load_s": round(statistics.median(times), 4),
            "weight_load_bytes": sum(t.numel() * t.element_size() for t in shards.values()),
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--p2p-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--uid", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=GIB, help="bytes per copy and per p2p transfer")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    ap.add_argument("--grpo-steps", type=int, default=2, help="GRPO steps (0: skip)")
    ap.add_argument("--grpo-timeout-s", type=float, default=75.0)
    args = ap.parse_args(argv)
    if args.p2p_rank is not None:
        _p2p_rank(args.p2p_rank, args.port, args.uid, args.bytes, args.reps)
        return 0
    if not torch.cuda.is_available():
        print(
            f"benchmarks.gpu: NO GPU: no CUDA device is visible to torch {torch.__version__}",
            file=sys.stderr,
        )
        return 3
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
    }
    result.update(device_copy(args.bytes, args.reps))
    print(
        f"device copy: nereus {result['device_copy_gbps']} GB/s, "
        f"torch copy_ {result['torch_copy_gbps']} GB/s",
        flush=True,
    )
    result.update(nccl_allreduce())
    print(
        f"nccl all-reduce 1 KiB: {result['nccl_allreduce_us']} us on the GPU, "
        f"{result['nccl_enqueue_us']} us to enqueue",
        flush=True,
    )
    if args.grpo_steps > 0:
        engine = "vllm" if importlib.util.find_spec("vllm") is not None else "builtin"
        result.update(asyncio.run(grpo(args.grpo_steps, args.grpo_timeout_s, engine)))
        print(
            f"grpo: {result['grpo_steps']} steps on {engine}, last "
            f"{result.get('grpo_step_seconds')} s {result.get('grpo_stage_seconds', '')} "
            f"{result.get('grpo_error', '')}",
            flush=True,
        )
    result.update(weight_load())
    result.update(nccl_p2p(args.bytes, args.reps, timeout_s=60.0))
    print(json.dumps(result), flush=True)
    return 1 if "grpo_error" in result or "nccl_p2p_error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
