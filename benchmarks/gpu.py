"""The GPU machine's figures: NCCL p2p against the device's own copy, a few GRPO steps.

    python -m benchmarks.gpu          (``make test-gpu`` runs it after the gpu test tier)

- ``device_copy_gbps``: one GPU copying 1 GiB into another buffer on itself (CUDA events,
  median of 5 after a warm-up): the ceiling any transfer on this machine is judged by.
- ``nccl_p2p_gbps``: NCCL send/recv of 1 GiB between two worker-like processes, each
  seeing one GPU as ``cuda:0`` (through ``nereus.transfer.nccl``), median of 5; null with
  ``nccl_p2p_skipped`` on a machine with one GPU (NCCL refuses two ranks on one GPU).
- ``grpo_steps``: steps of ``examples/grpo_tiny.toml`` completed on GPU workers (a
  controller and a ``--gpus all`` node daemon in this process, the job attached to them),
  generating on vLLM (weights written in place from the generation EMUs' shards after
  every sync) where vLLM is installed, else on the built-in engine (``grpo_engine`` says
  which); a failure is reported in ``grpo_error`` instead of raised.
- ``weight_load_s``: writing a tiny model's weights in place into a vLLM engine on the
  GPU (``VllmGenerationEngine.load_named``), median of 3; null with
  ``weight_load_skipped`` where vLLM is not installed.

The last line printed is one JSON object with those keys. Needs CUDA; every part has a
deadline, so a hang shows as an error, not a stuck run.
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
from pathlib import Path
from typing import Any

import tomllib
import torch

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def device_copy_gbps(nbytes: int = GIB, reps: int = 5) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    assert bool(dst[-1] == 1)
    return nbytes / statistics.median(times) / 1e9


def _p2p_rank(rank: int, port: int, uid: str, nbytes: int, reps: int) -> None:
    """One rank of the p2p measurement (a subprocess seeing one GPU)."""
    from nereus.transfer.nccl import NcclCommunicator

    comm = NcclCommunicator("p2p", rank, 2, bytes.fromhex(uid), timeout_s=60.0,
                            store_host="127.0.0.1", store_port=port)
    buf = torch.full((nbytes,), rank + 1, dtype=torch.uint8, device="cuda:0")
    times = []
    for i in range(reps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        comm.send(buf, 1) if rank == 0 else comm.recv(buf, 0)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    if rank == 1:
        assert bool(buf[-1] == 1), "rank 1 did not receive rank 0's bytes"
    comm.destroy()
    print(json.dumps({"rank": rank, "seconds": statistics.median(times)}), flush=True)


def nccl_p2p_gbps(nbytes: int = GIB, reps: int = 5) -> tuple[float | None, str]:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return None, f"needs 2 GPUs (one per rank); this machine has {gpus}"
    import datetime

    from torch.distributed import TCPStore

    from nereus.transfer.nccl import unique_id

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    uid = unique_id().hex()
    procs = []
    for rank in range(2):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank), "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gpu", "--p2p-rank", str(rank), "--port",
             str(store.port), "--uid", uid, "--bytes", str(nbytes), "--reps", str(reps)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    seconds = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        if p.returncode != 0:
            return None, f"rank exited {p.returncode}: {err.strip()[-300:]}"
        seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
    return nbytes / max(seconds) / 1e9, ""


async def grpo_steps(steps: int = 3, timeout_s: float = 150.0, engine: str = "builtin") -> tuple[int, str]:
    """Run ``steps`` steps of the tiny GRPO job on GPU workers, generating on ``engine``;
    (steps done, error)."""
    from nereus.actors import Controller, NodeDaemon
    from nereus.actors._keys import generate_key
    from nereus.config import from_dict
    from nereus.job.config import JobConfig
    from nereus.job.loop import run_job

    data = tomllib.loads((ROOT / "examples" / "grpo_tiny.toml").read_text())
    key = generate_key()
    key_file = Path(tempfile.mkdtemp(prefix="nereus-gpu-")) / "key"
    key_file.write_bytes(key)
    controller = await Controller(key).start()
    node = NodeDaemon(controller.address, key, gpus="all", transport="ipc", node_id="gpu")
    done = 0
    try:
        await node.start()
        n = len(node.workers)
        data["cluster"] = {"mode": "connect", "address": controller.address,
                           "key_file": str(key_file), "devices": n}
        data["plan"] = {"policy_generation": {"devices": list(range(n)), "dp": n},
                        "policy_training": {"devices": [0], "dp": 1}}
        data["run"] = {**data["run"], "steps": steps, "checkpoint_every": 0,
                       "out_dir": str(key_file.parent / "run")}
        data["sampling"] = {**data["sampling"], "engine": engine}
        if engine == "vllm":  # head_dim 32: a size every vLLM attention backend takes
            data["model"] = {**data["model"], "hidden_size": 128, "intermediate_size": 256}
        records = await asyncio.wait_for(run_job(from_dict(JobConfig, data)), timeout_s)
        done = len(records)
        return done, ""
    except Exception as e:  # reported, not raised: the other figures still print
        return done, f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        await node.stop()
        await controller.close()


def weight_load_s(reps: int = 3) -> tuple[float | None, str]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed"
    from nereus.engines import GenerationEngine
    from nereus.engines.memory import MemoryLedger
    from nereus.engines.vllm_adapter import VllmGenerationEngine
    from nereus.models import save_tiny_model, tiny_config

    config = tiny_config(num_hidden_layers=2, hidden_size=128, tie_word_embeddings=True)
    folder = save_tiny_model(Path(tempfile.mkdtemp(prefix="nereus-vllm-")) / "m", config,
                             seed=1)
    engine = VllmGenerationEngine(config, folder, max_model_len=64, kv_cache_bytes=64 << 20,
                                  ledger=MemoryLedger("gpu-bench-vllm", None))
    try:
        # the built-in engine names weights as vLLM does (fused qkv and gate_up)
        reference = GenerationEngine(config, model_dir=folder,
                                     ledger=MemoryLedger("gpu-bench-ref", None), name="ref")
        shards = {k: v.to("cuda:0") for k, v in reference.named_weights().items()}
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            engine.load_named(shards)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), ""
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    ap.add_argument("--p2p-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--uid", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=GIB, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--grpo-steps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.p2p_rank is not None:
        _p2p_rank(args.p2p_rank, args.port, args.uid, args.bytes, args.reps)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0),
                              "gpus": torch.cuda.device_count()}
    result["device_copy_gbps"] = round(device_copy_gbps(), 1)
    print(f"device copy: {result['device_copy_gbps']} GB/s", flush=True)
    p2p, why = nccl_p2p_gbps()
    result["nccl_p2p_gbps"] = None if p2p is None else round(p2p, 1)
    if why:
        result["nccl_p2p_skipped"] = why
    print(f"nccl p2p: {result['nccl_p2p_gbps']} GB/s {why}", flush=True)
    import importlib.util

    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "builtin"
    steps, error = asyncio.run(grpo_steps(args.grpo_steps, engine=engine))
    result["grpo_steps"] = steps
    result["grpo_engine"] = engine
    if error:
        result["grpo_error"] = error
    print(f"grpo: {steps} steps on {engine} {error}", flush=True)
    load, why = weight_load_s()
    result["weight_load_s"] = None if load is None else round(load, 4)
    if why:
        result["weight_load_skipped"] = why
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
