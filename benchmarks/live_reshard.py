"""Change a running job's layout: TP 2->4, TP 4->2 and DP 1->2 of policy-training, three ways.

    python -m benchmarks.live_reshard [--reps 3] [--ckpt-reps 1] [--layers 12] [--hidden 768]

A GRPO job on a local cluster of 4 CPU worker processes whose policy is the reshard
benchmark's model (``benchmarks.reshard``: 12 layers, hidden 768, vocabulary 32,000,
124.7M parameters) trains with AdamW, so every policy-training EMU holds the weights
and both float32 moments (3 x 499 MB). Policy-generation runs on device 3. The job
takes a step, then its policy-training goes TP 2 (devices 0,1) -> TP 4 (0-3) -> TP 2
-> DP 2 (TP 2 on 0,1 and 2,3) -> TP 2, ``--reps`` times; the three first changes are
timed, after one round that warms up (first page touches, arena pools, groups). Each
change is made:

- live: ``RLJob.apply_plan`` inside the running job: planning and budget checks,
  engines stopped, the primitives run on the workers over the state they hold, a new
  layout epoch, every engine started again (new groups), the old epoch's groups
  released, the sync plans rebuilt. Its breakdown is printed.
- standalone: the same transition on plain shard stores (``ShardHolder``, the reshard
  benchmark's path), the same tensors, including making the new epoch's groups the
  target's engines need (``stage_groups``): no engines, no job.
- checkpoint-restart: the job saves its checkpoint (every worker writes its shards,
  fsynced), its model-stages stop, start again in the new layout (every model-stage
  loads its initial weights, as a restarted job does), and the checkpoint is loaded
  into the new layout; with the checkpoint on disk and on tmpfs (/dev/shm). The
  speedup is against the faster.

Bytes: ``bytes_measured`` sums the workers' transfer counters (``bytes_sent`` of every
part, the counters ``benchmarks.reshard`` reports); ``bytes_minimum`` is the analytic
minimum of the targets (``nereus.state.bytes_minimum``: target boxes not already on
their device). Medians over the repetitions; workers 1 torch thread each. The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from nereus.actors import Cluster, endpoint
from nereus.config import from_dict
from nereus.data.tasks import make_task
from nereus.data.vocab import Codec
from nereus.engines.stage import stage_groups
from nereus.job.change import stage_emus
from nereus.job.cluster_stages import ClusterStages
from nereus.job.config import JobConfig, Placement
from nereus.job.loop import RLJob
from nereus.models import ModelConfig, model_spec, save_tiny_model
from nereus.planner import Plan, StagePlan
from nereus.state import (
    DeviceSet,
    LogicalState,
    ShardHolder,
    bytes_minimum,
    emu_to_plain,
    execute_step,
    plan_stage_transition,
    training_slots,
)
from nereus.transfer import release_groups

DEVICES = 4
TRAIN = "policy_training"
GEN = (1, 1, [[3]])
A = (2, 1, [[0, 1]])
CASES = {
    "tp2->tp4": (4, 1, [[0, 1, 2, 3]]),
    "tp4->tp2": A,
    "dp1->dp2": (2, 1, [[0, 1], [2, 3]]),
    "dp2->dp1": A,
}
TIMED = ("tp2->tp4", "tp4->tp2", "dp1->dp2")


def _plan(train: tuple[int, int, list[list[int]]]) -> Plan:
    def sp(t):
        tp, pp, devs = t
        return StagePlan(tp, pp, len(devs), tuple(tuple(d) for d in devs))

    return Plan((("policy_generation", sp(GEN)), (TRAIN, sp(train))))


def _placements(plan: Plan) -> dict[str, Placement]:
    return {n: Placement([d for e in sp.devices for d in e], sp.tp, sp.pp, sp.dp) for n, sp in plan}


class FillHolder(ShardHolder):
    """A shard store the standalone runs fill with random tensors of an EMU's shapes."""

    @endpoint
    async def fill(self, emu: dict) -> int:
        from nereus.state import emu_from_plain

        desc = emu_from_plain(emu)
        tensors = {
            k: torch.rand(s.shape) for k, (s, _) in desc.shards_on(self.device.index).items()
        }
        self._reserve_new(desc.name, sum(t.numel() * 4 for t in tensors.values()))
        self.shards[desc.name] = tensors
        self.states[desc.name] = desc.state
        self._account()
        return self.held_bytes()


def _model(folder: str, args) -> tuple[str, Codec]:
    codec = Codec.for_alphabet(make_task("reverse", letters="abc", min_len=2, max_len=3).alphabet)
    config = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
    )
    save_tiny_model(folder, config, seed=0)
    codec.save(folder)
    return folder, codec


def _config(model_dir: str, out: str, plan: Plan) -> JobConfig:
    cfg = from_dict(
        JobConfig,
        {
            "model": {"kind": "hf", "path": model_dir},
            "task": {"name": "reverse", "options": {"letters": "abc", "min_len": 2, "max_len": 3}},
            "algorithm": {"prompts_per_step": 2, "samples_per_prompt": 2},
            "sampling": {"max_new_tokens": 4},
            "optim": {"lr": 1e-4, "micro_batch_size": 4},
            "cluster": {"mode": "local", "devices": DEVICES, "memory_per_device": "8GiB"},
            "plan": {"policy_generation": {"devices": [3]}, TRAIN: {"devices": [0, 1], "tp": 2}},
            "run": {"steps": 100, "out_dir": out, "progress": False},
        },
    )
    return dataclasses.replace(cfg, plan=_placements(plan))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def _live(cluster: Cluster, model_dir: str, out: str, args) -> dict[str, Any]:
    rl = RLJob(_config(model_dir, out, _plan(A)))
    await rl.start(cluster=cluster)
    results: dict[str, dict[str, list]] = {c: {} for c in CASES}
    try:
        await rl.run_step()
        for rep in range(args.reps + 1):  # the first round warms up (first touches, arenas, groups)
            for case, train in CASES.items():
                target = _plan(train)
                current = rl.stages.emus[TRAIN]
                wanted = stage_emus(
                    TRAIN, target[TRAIN], current[0].spec, current[0].slots, "probe"
                )
                minimum = sum(bytes_minimum(current, t) for t in wanted)
                report = await rl.apply_plan(target)
                if rep == 0:
                    continue
                row = results[case]
                for key in (
                    "seconds",
                    "plan_s",
                    "engines_stop_s",
                    "moves_s",
                    "groups_s",
                    "engines_s",
                    "sync_plans_s",
                ):
                    row.setdefault(key, []).append(report[key])
                row.setdefault("bytes_measured", []).append(report["bytes_measured"])
                row.setdefault("bytes_minimum", []).append(minimum)
        after = await rl.run_step()
        ckpt: dict[str, dict[str, list[float]]] = {c: {} for c in CASES}
        for medium, root in (("disk", args.disk_dir), ("tmpfs", "/dev/shm")):
            for _ in range(args.ckpt_reps):
                for case, train in CASES.items():
                    target = _plan(train)
                    folder = tempfile.mkdtemp(prefix="nereus-live-ckpt-", dir=root)
                    try:
                        t0 = time.perf_counter()
                        await rl.stages.save(folder)  # every worker writes its shards, fsynced
                        await rl.stages.close()  # the model-stages stop; the cluster stays
                        cfg = dataclasses.replace(rl.cfg, plan=_placements(target))
                        rl.stages = await ClusterStages.start(
                            cfg, rl.model_config, rl.model_dir, cluster=cluster
                        )
                        await rl.stages.load(folder)
                        ckpt[case].setdefault(medium, []).append(time.perf_counter() - t0)
                    finally:
                        shutil.rmtree(folder, ignore_errors=True)
        final = await rl.run_step()
    finally:
        await rl.close()
    return {
        "live": results,
        "checkpoint": ckpt,
        "reward_after": after["reward_mean"],
        "reward_final": final["reward_mean"],
    }


async def _standalone(cluster: Cluster, spec, args) -> dict[str, dict[str, list[float]]]:
    slots = training_slots("float32")
    mesh = await cluster.spawn("standalone", FillHolder, devices=list(range(DEVICES)))
    holders = {r.device: r for r in mesh.refs}
    devices = DeviceSet.single_host(DEVICES)
    times: dict[str, dict[str, list[float]]] = {c: {} for c in TIMED}
    epoch = 100
    current = stage_emus(TRAIN, _plan(A)[TRAIN], spec, slots, f"e{epoch}-", LogicalState())
    await asyncio.gather(
        *(holders[d].fill.call_one(emu_to_plain(e)) for e in current for d in e.devices)
    )
    for rep in range(args.reps + 1):  # the first round warms up, as the live runs do
        for case, train in CASES.items():
            epoch += 1
            target = stage_emus(
                TRAIN, _plan(train)[TRAIN], spec, slots, f"e{epoch}-", LogicalState()
            )
            t0 = time.perf_counter()
            tr = plan_stage_transition(current, target, devices, bucket_bytes=0)
            t1 = time.perf_counter()
            for step in tr.steps:
                await execute_step(step, holders, cluster, epoch=epoch)
            await release_groups(cluster, epoch)  # the transition's own groups
            t2 = time.perf_counter()
            await stage_groups(cluster, "training", list(tr.result), epoch=epoch)  # the new epoch's
            await release_groups(cluster, epoch - 1)
            t3 = time.perf_counter()
            if case in times and rep > 0:
                for key, value in (
                    ("seconds", t3 - t0),
                    ("plan_s", t1 - t0),
                    ("moves_s", t2 - t1),
                    ("groups_s", t3 - t2),
                ):
                    times[case].setdefault(key, []).append(value)
            current = list(tr.result)
    await release_groups(cluster, epoch)
    await cluster.stop_mesh(mesh)
    return times


async def _standalone_only(args) -> None:
    """Only the standalone runs, with their parts (``--standalone-only``)."""
    config = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    async with Cluster.local(
        devices=DEVICES, memory_per_device="8GiB", heartbeat_timeout_s=60.0
    ) as cluster:
        times = await _standalone(cluster, model_spec(config), args)
    for case, parts in times.items():
        print(case, {k: [round(x, 3) for x in v] for k, v in parts.items()})


async def _run(args) -> dict[str, Any]:
    config_probe = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    spec = model_spec(config_probe)
    params = sum(p.numel for p in spec.params)
    print(
        f"model: {params / 1e6:.1f}M parameters; a training EMU holds "
        f"{3 * spec.nbytes / 2**20:.0f} MiB "
        f"(fp32 weights + AdamW moments); {DEVICES} worker processes, 1 torch thread each; "
        f"{args.reps} reps, checkpoint-restart {args.ckpt_reps} per medium; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    work = tempfile.mkdtemp(prefix="nereus-live-reshard-")
    try:
        model_dir, _ = _model(os.path.join(work, "model"), args)
        async with Cluster.local(
            devices=DEVICES, memory_per_device="8GiB", heartbeat_timeout_s=60.0
        ) as cluster:
            standalone = await _standalone(cluster, spec, args)
            live = await _live(cluster, model_dir, os.path.join(work, "run"), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cases = {}
    for case in TIMED:
        row = live["live"][case]
        ck = live["checkpoint"][case]
        c = {k: _median(v) for k, v in row.items()}
        c["standalone_s"] = _median(standalone[case]["seconds"])
        c["standalone_parts"] = {
            k: _median(v) for k, v in standalone[case].items() if k != "seconds"
        }
        c["checkpoint_restart_disk_s"] = _median(ck.get("disk", []))
        c["checkpoint_restart_tmpfs_s"] = _median(ck.get("tmpfs", []))
        c["checkpoint_restart_s"] = min(
            c["checkpoint_restart_disk_s"], c["checkpoint_restart_tmpfs_s"]
        )
        c["ratio_vs_standalone"] = c["seconds"] / c["standalone_s"]
        c["speedup_vs_checkpoint_restart"] = c["checkpoint_restart_s"] / c["seconds"]
        c["bytes_exact"] = all(
            m == n for m, n in zip(row["bytes_measured"], row["bytes_minimum"], strict=True)
        )
        cases[case] = c
        print(
            f"{case:9s} live {c['seconds']:.3f} s (plan {c['plan_s']:.3f}, engines stop "
            f"{c['engines_stop_s']:.3f}, "
            f"copies {c['moves_s']:.3f}, groups {c['groups_s']:.3f}, engines {c['engines_s']:.3f}, "
            f"sync plans {c['sync_plans_s']:.3f})  standalone {c['standalone_s']:.3f} s "
            f"(plan {c['standalone_parts']['plan_s']:.3f}, copies "
            f"{c['standalone_parts']['moves_s']:.3f}, "
            f"groups {c['standalone_parts']['groups_s']:.3f})  "
            f"checkpoint-restart disk {c['checkpoint_restart_disk_s']:.2f} s / tmpfs "
            f"{c['checkpoint_restart_tmpfs_s']:.2f} s  moved {c['bytes_measured'] / 2**20:.0f} MiB "
            f"(minimum {c['bytes_minimum'] / 2**20:.0f} MiB)  x{c['ratio_vs_standalone']:.2f} "
            "of standalone, "
            f"x{c['speedup_vs_checkpoint_restart']:.1f} vs checkpoint-restart",
            flush=True,
        )
    return {
        "benchmark": "live_reshard",
        "model_params": params,
        "devices": DEVICES,
        "threads_per_worker": 1,
        "reps": args.reps,
        "load_average": os.getloadavg()[0],
        "live_s": sum(c["seconds"] for c in cases.values()),
        "standalone_s": sum(c["standalone_s"] for c in cases.values()),
        "checkpoint_restart_s": sum(c["checkpoint_restart_s"] for c in cases.values()),
        "ratio_vs_standalone": max(c["ratio_vs_standalone"] for c in cases.values()),
        "speedup_vs_checkpoint_restart": min(
            c["speedup_vs_checkpoint_restart"] for c in cases.values()
        ),
        "bytes_measured": sum(int(c["bytes_measured"]) for c in cases.values()),
        "bytes_minimum": sum(int(c["bytes_minimum"]) for c in cases.values()),
        "bytes_exact_every_rep": all(c["bytes_exact"] for c in cases.values()),
        "reward_after_changes": live["reward_after"],
        "cases": cases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--ckpt-reps", type=int, default=1, help="checkpoint-restart runs per case and medium"
    )
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--disk-dir", default=tempfile.gettempdir(), help="where the on-disk checkpoint goes"
    )
    ap.add_argument(
        "--standalone-only", action="store_true", help="only the standalone runs, with their parts"
    )
    args = ap.parse_args()
    os.environ.setdefault(
        "THP_MEM_ALLOC_ENABLE", "1"
    )  # as benchmarks.reshard: read by the workers' torch
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.standalone_only:
        asyncio.run(_standalone_only(args))
        return
    out = asyncio.run(_run(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
