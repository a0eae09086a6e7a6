"""Reshard a 100-300M-parameter model on 4 CPU worker processes, three ways, in one run.

    python -m benchmarks.reshard [--reps 5] [--layers 12] [--hidden 768]

Cases (each a source EMU already resident on the workers and a target EMU to build):
TP 4->2 (tp4 on devices 0-3 -> tp2 on 0,1), TP 2->4 (tp2 on 0,1 -> tp4 on 0-3),
PP 2->1 (tp2 pp2 on 0-3 -> tp2 pp1 on 0,1), each freeing the source once the target is
built, and Extend from 2 to 4 devices (tp2 on 0,1 -> a second tp2 replica on 2,3),
which keeps it. Each is built by:

- nereus: ``plan_reshard`` (box intersection, minimal bytes) and ``execute``: one
  message per worker, local copies + one bucketed ``exchange``; a shard that does not
  change stays in place when the source is freed (``reuse``). ``plan_reshard`` is in
  the timed region; after the warm-up the plan comes from its memo, as for any
  repeated transition, so each case also reports ``plan_s``: planning the same
  transition afresh (a target of another name), and ``speedup_vs_checkpoint_replan``
  (the checkpoint time over ``reshard_s + plan_s``);
- gather-scatter: per tensor, every distinct source shard is sent to rank 0, which
  assembles the full tensor and sends each target rank its shard (the per-tensor
  pattern many RL frameworks use), over the same communicator (gloo + shared memory);
- checkpoint: every source worker writes its safetensors shard file (fsynced: a
  fallback must survive the machine) plus a manifest, then every target worker reads
  its slices back (``save_to_disk`` / ``load_from_disk``, files under the system temp
  directory, on disk here);
- checkpoint to tmpfs: the same without fsync, under /dev/shm (memory), the most a
  checkpoint could be sped up by a faster disk (``speedup_vs_checkpoint_tmpfs``).

Every result is verified element by element against the deterministic content the
sources were filled with, after the warm-up and again after the last timed run. Next
to the plan's ``bytes_moved`` each case reports ``bytes_sent_counted``: what the
workers' exchanges counted sending in the last timed run. The floor of each case (``floor_s``) is
one copy of every byte its target must have written (moved from another device, or copied within
one: a target
shard that differs from every source shard on its device is new memory either way),
between ready buffers, half on each of two workers (the cores here); the
checkpoint time over it (``speedup_ceiling_vs_checkpoint``, the minimum over cases) is
the most any reshard could reach against the checkpoint on this machine. Warm-up first (one run per
method per case, which also makes the cached groups), then ``--reps`` timed runs; medians and
min-max spread.
Workers use 1 torch thread each; the driver process runs the controller, node daemon
and planning. Workers inherit ``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU allocator then
asks for transparent huge pages for large tensors: a fresh 240 MB tensor is written
~4x faster than with 4 KiB page faults) unless ``--no-thp``; all three methods run in
the same workers, so it applies to each alike. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib
from typing import Any

import torch

from nereus.actors import Cluster, endpoint
from nereus.models.config import ModelConfig
from nereus.models.spec import model_spec
from nereus.state import EMU, Layout, bytes_minimum, emu_from_plain, emu_to_plain, plan_reshard
from nereus.state.apply import box_slices
from nereus.state.executor import ExecuteStats, execute, load_from_disk, save_to_disk
from nereus.state.holder import ShardHolder
from nereus.transfer import P2POp, copy_into, get_communicator, make_group

DEVICES = 4


def _expected(key: str, box) -> torch.Tensor:
    """Deterministic content of global ``box`` of tensor ``key`` (exact in float32)."""
    h = zlib.crc32(key.encode()) % 65521
    idx = [torch.arange(lo, hi, dtype=torch.int64) for lo, hi in box]
    val = idx[0] * 7919 + h
    if len(idx) == 2:
        val = val[:, None] + idx[1][None, :] * 104729
    return (val % 65521).to(torch.float32)


class BenchHolder(ShardHolder):
    """A ShardHolder that can fill and verify shards, and run the gather-scatter baseline."""

    @endpoint
    async def fill(self, emu: dict) -> int:
        desc = emu_from_plain(emu)
        out = {}
        for key, (shard, _dtype) in desc.shards_on(self.device.index).items():
            t = torch.empty(shard.shape, dtype=torch.float32)
            for piece in shard.pieces:
                t[box_slices(piece.local)] = _expected(key, piece.box)
            out[key] = t
        self.shards[desc.name] = out
        return self.held_bytes()

    @endpoint
    async def verify(self, emu: dict) -> int:
        """Number of elements of ``emu``'s shards on this device that are wrong."""
        desc = emu_from_plain(emu)
        held = self.shards.get(desc.name, {})
        bad = 0
        for key, (shard, _dtype) in desc.shards_on(self.device.index).items():
            t = held.get(key)
            if t is None or tuple(t.shape) != shard.shape:
                bad += shard.numel
                continue
            for piece in shard.pieces:
                bad += int((t[box_slices(piece.local)] != _expected(key, piece.box)).sum())
        return bad

    @endpoint
    async def memcpy_s(self, nbytes: int) -> float:
        """Seconds of one copy of ``nbytes`` between two ready buffers of this worker
        (pages already faulted in), the fastest way this worker copies (``copy_into``):
        the floor for moving those bytes."""
        if getattr(self, "_floor", None) is None or self._floor[0].numel() < nbytes:
            self._floor = (
                torch.ones(nbytes, dtype=torch.uint8),
                torch.zeros(nbytes, dtype=torch.uint8),
            )
        src, dst = self._floor
        t0 = time.perf_counter()
        copy_into(dst[:nbytes], src[:nbytes])
        return time.perf_counter() - t0

    @endpoint
    async def drop_floor(self) -> None:
        self._floor = None

    @endpoint
    async def gather_scatter(
        self, src: dict, dst: dict, root: int, group: str, group_devices: list[int]
    ) -> int:
        return await asyncio.to_thread(
            self._gather_scatter,
            emu_from_plain(src),
            emu_from_plain(dst),
            root,
            group,
            group_devices,
        )

    def _gather_scatter(
        self, src: EMU, dst: EMU, root: int, group: str, group_devices: list[int]
    ) -> int:
        comm = get_communicator(group)
        rank = {d: r for r, d in enumerate(group_devices)}
        me = self.device.index
        mine = self.shards.get(src.name, {})
        out: dict[str, torch.Tensor] = {}
        for key in dst.keys():
            param = src.spec[key]
            # gather: one holder per distinct shard sends it whole to the root
            holders: list[tuple[int, Any]] = []
            for d in src.devices:
                held = src.shards_on(d).get(key)
                if held is not None and all(held[0] != s for _, s in holders):
                    holders.append((d, held[0]))
            if me == root:
                full = torch.empty(param.shape, dtype=torch.float32)
                ops, placed = [], []
                for d, shard in holders:
                    buf = mine[key] if d == me else torch.empty(shard.shape, dtype=torch.float32)
                    if d != me:
                        ops.append(P2POp("recv", buf, rank[d]))
                    placed.append((buf, shard))
                if ops:
                    comm.batch_p2p(ops)
                for buf, shard in placed:
                    for piece in shard.pieces:
                        full[box_slices(piece.box)] = buf[box_slices(piece.local)]
            elif any(d == me for d, _ in holders):
                comm.batch_p2p([P2POp("send", mine[key].contiguous(), rank[root])])
            # scatter: the root cuts and sends each target rank its shard
            targets = [
                (d, dst.shards_on(d)[key][0]) for d in dst.devices if key in dst.shards_on(d)
            ]
            if me == root:
                ops = []
                for d, shard in targets:
                    part = torch.empty(shard.shape, dtype=torch.float32)
                    for piece in shard.pieces:
                        part[box_slices(piece.local)] = full[box_slices(piece.box)]
                    if d == me:
                        out[key] = part
                    else:
                        ops.append(P2POp("send", part, rank[d]))
                if ops:
                    comm.batch_p2p(ops)
            else:
                for d, shard in targets:
                    if d == me:
                        out[key] = torch.empty(shard.shape, dtype=torch.float32)
                        comm.batch_p2p([P2POp("recv", out[key], rank[root])])
        if me in dst.devices:
            self.shards[dst.name] = out
        return self.held_bytes()


def _cases(spec) -> list[tuple[str, EMU, EMU, bool]]:
    """(name, source, target, whether the source is freed once the target is built)."""

    def emu(name, tp, pp, devices):
        return EMU(name, "policy-training", spec, Layout(tp, pp), tuple(devices))

    return [
        ("tp4->tp2", emu("src", 4, 1, [0, 1, 2, 3]), emu("dst", 2, 1, [0, 1]), True),
        ("tp2->tp4", emu("src", 2, 1, [0, 1]), emu("dst", 4, 1, [0, 1, 2, 3]), True),
        ("pp2->pp1", emu("src", 2, 2, [0, 1, 2, 3]), emu("dst", 2, 1, [0, 1]), True),
        ("extend 2->4", emu("src", 2, 1, [0, 1]), emu("dst", 2, 1, [2, 3]), False),
    ]


def _summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


async def _run(args) -> dict:
    config = ModelConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    spec = model_spec(config)
    params = sum(p.numel for p in spec.params)
    print(
        f"model: {spec.name}, {params / 1e6:.1f}M parameters, {spec.nbytes / 2**20:.0f} MiB fp32; "
        f"{DEVICES} worker processes, 1 torch thread each; {args.reps} reps after 1 warm-up; "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    results: dict[str, Any] = {}
    ckpt_root = tempfile.mkdtemp(prefix="nereus-bench-ckpt-")
    # not "nereus-*": test suites running beside it count those names as leaked segments
    tmpfs_root = tempfile.mkdtemp(prefix="bench-ckpt-tmpfs-", dir="/dev/shm")
    try:
        async with Cluster.local(
            devices=DEVICES, memory_per_device="6GiB", heartbeat_timeout_s=60.0
        ) as cluster:
            mesh = await cluster.spawn(
                "bench",
                BenchHolder,
                devices=list(range(DEVICES)),
                kwargs={"bucket_bytes": args.bucket_mib << 20},
            )
            refs = {r.device: r for r in mesh.refs}
            everyone = sorted(refs)
            for name, src, dst, frees in _cases(spec):
                src_plain, dst_plain = emu_to_plain(src), emu_to_plain(dst)

                async def fill(src=src, src_plain=src_plain):
                    await asyncio.gather(*(refs[d].fill.call_one(src_plain) for d in src.devices))

                async def drop_src(src=src, frees=frees):
                    if frees:
                        await asyncio.gather(
                            *(refs[d].drop_shards.call_one([src.name]) for d in src.devices)
                        )

                await fill()
                group_devices = sorted(set(src.devices) | set(dst.devices))

                async def drop_dst(dst=dst):
                    await asyncio.gather(
                        *(refs[d].drop_shards.call_one([dst.name]) for d in everyone)
                    )

                async def check(method: str, dst=dst, dst_plain=dst_plain, name=name) -> None:
                    bad = sum(
                        await asyncio.gather(
                            *(refs[d].verify.call_one(dst_plain) for d in dst.devices)
                        )
                    )
                    if bad:
                        raise SystemExit(f"{name}: {method} produced {bad} wrong elements")

                async def ours(src=src, dst=dst, frees=frees) -> ExecuteStats:
                    # a source that is freed afterwards lends the target its unchanged shards
                    plan = plan_reshard([src], dst, reuse=frees)
                    return await execute(plan, refs, cluster, epoch=1, free=[src] if frees else [])

                async def gather(
                    src_plain=src_plain, dst_plain=dst_plain, group_devices=group_devices
                ):
                    group = await make_group(cluster, devices=group_devices, epoch=1)
                    await asyncio.gather(
                        *(
                            refs[d].gather_scatter.call_one(
                                src_plain,
                                dst_plain,
                                group_devices[0],
                                group.group_id,
                                group_devices,
                            )
                            for d in group_devices
                        )
                    )
                    await drop_src()

                async def checkpoint(src=src, dst=dst, root=ckpt_root, durable=True):
                    directory = tempfile.mkdtemp(dir=root)
                    try:
                        await save_to_disk(directory, src, refs, durable=durable)
                        await drop_src()
                        await load_from_disk(directory, dst, refs)
                    finally:
                        shutil.rmtree(directory)

                async def checkpoint_tmpfs(checkpoint=checkpoint):
                    await checkpoint(root=tmpfs_root, durable=False)

                methods = {
                    "reshard": ours,
                    "gather_scatter": gather,
                    "checkpoint": checkpoint,
                    "checkpoint_tmpfs": checkpoint_tmpfs,
                }
                times: dict[str, list[float]] = {m: [] for m in methods}
                moved = local = counted = 0
                for rep in range(args.reps + 1):
                    for method, fn in methods.items():
                        if frees:
                            await (
                                fill()
                            )  # untimed: every method starts from the same resident source
                        t0 = time.perf_counter()
                        got = await fn()
                        dt = time.perf_counter() - t0
                        if method == "reshard":
                            moved, local = got.bytes_moved, got.bytes_local
                            counted = got.bytes_sent_measured
                        if rep in (0, args.reps):  # after the warm-up and the last timed run
                            await check(method)
                        if rep:
                            times[method].append(dt)
                        await drop_dst()
                        await drop_src()
                await asyncio.gather(*(refs[d].drop_shards.call_one([src.name]) for d in everyone))
                plan_s = []
                for rep in range(args.reps):
                    t0 = time.perf_counter()
                    plan_reshard([src], dst.with_(name=f"dst-fresh-{rep}"), reuse=frees)
                    plan_s.append(time.perf_counter() - t0)
                # the floor: every byte the target writes (moved or copied locally) copied
                # once, half by each of two workers
                written = moved + local
                floor = []
                for rep in range(args.reps + 1):
                    half = [written // 2, written - written // 2]
                    got = await asyncio.gather(
                        *(
                            refs[d].memcpy_s.call_one(n)
                            for d, n in zip(everyone[:2], half, strict=True)
                        )
                    )
                    if rep:
                        floor.append(max(got))
                await asyncio.gather(*(refs[d].drop_floor.call_one() for d in everyone))
                r = {m: _summary(ts) for m, ts in times.items()}
                case = {
                    "reshard_s": r["reshard"]["median"],
                    "gather_scatter_s": r["gather_scatter"]["median"],
                    "checkpoint_s": r["checkpoint"]["median"],
                    "checkpoint_tmpfs_s": r["checkpoint_tmpfs"]["median"],
                    "spread_s": {m: [round(v["min"], 4), round(v["max"], 4)] for m, v in r.items()},
                    "bytes_moved": moved,
                    "bytes_sent_counted": counted,
                    "bytes_minimum": bytes_minimum([src], dst),
                    "bytes_local": local,
                    "floor_s": statistics.median(floor),
                    "plan_s": statistics.median(plan_s),
                }
                case["speedup_vs_checkpoint"] = case["checkpoint_s"] / case["reshard_s"]
                case["speedup_vs_checkpoint_tmpfs"] = case["checkpoint_tmpfs_s"] / case["reshard_s"]
                case["speedup_vs_checkpoint_replan"] = case["checkpoint_s"] / (
                    case["reshard_s"] + case["plan_s"]
                )
                case["speedup_vs_gather"] = case["gather_scatter_s"] / case["reshard_s"]
                results[name] = case
                print(
                    f"{name:12s} reshard {case['reshard_s']:.3f} s  gather-scatter "
                    f"{case['gather_scatter_s']:.3f} s  "
                    f"checkpoint {case['checkpoint_s']:.3f} s (tmpfs, no fsync "
                    f"{case['checkpoint_tmpfs_s']:.3f} s, "
                    f"x{case['speedup_vs_checkpoint_tmpfs']:.1f})  moved {moved / 2**20:.0f} MiB "
                    f"(counted {counted / 2**20:.0f} MiB, minimum "
                    f"{case['bytes_minimum'] / 2**20:.0f} MiB)  "
                    f"x{case['speedup_vs_checkpoint']:.1f} "
                    f"vs checkpoint, x{case['speedup_vs_gather']:.1f} vs gather; planning "
                    f"afresh {case['plan_s'] * 1e3:.1f} ms "
                    f"(x{case['speedup_vs_checkpoint_replan']:.1f}); floor {case['floor_s']:.3f} s "
                    f"(x{case['checkpoint_s'] / case['floor_s']:.1f} vs checkpoint at best)",
                    flush=True,
                )
            await cluster.stop_mesh(mesh)
    finally:
        shutil.rmtree(ckpt_root, ignore_errors=True)
        shutil.rmtree(tmpfs_root, ignore_errors=True)
    total = {
        k: sum(c[k] for c in results.values())
        for k in (
            "reshard_s",
            "gather_scatter_s",
            "checkpoint_s",
            "checkpoint_tmpfs_s",
            "bytes_moved",
            "bytes_sent_counted",
            "bytes_minimum",
            "floor_s",
            "plan_s",
        )
    }
    return {
        "benchmark": "reshard",
        "model_params": params,
        "devices": DEVICES,
        "threads_per_worker": 1,
        "reps": args.reps,
        "bucket_bytes": args.bucket_mib << 20,
        "thp_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1",
        "load_average": os.getloadavg()[0],
        **total,
        "speedup_vs_checkpoint": min(c["speedup_vs_checkpoint"] for c in results.values()),
        "speedup_vs_checkpoint_tmpfs": min(
            c["speedup_vs_checkpoint_tmpfs"] for c in results.values()
        ),
        "speedup_vs_gather": min(c["speedup_vs_gather"] for c in results.values()),
        "speedup_vs_checkpoint_replan": min(
            c["speedup_vs_checkpoint_replan"] for c in results.values()
        ),
        # what speedup_vs_checkpoint would be if the reshard cost only one copy of the moved bytes
        "speedup_ceiling_vs_checkpoint": min(
            c["checkpoint_s"] / c["floor_s"] for c in results.values()
        ),
        "bytes_minimal_every_case": all(
            c["bytes_moved"] == c["bytes_minimum"] for c in results.values()
        ),
        "cases": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument(
        "--bucket-mib", type=int, default=32, help="exchange bucket size of the nereus reshard"
    )
    ap.add_argument(
        "--no-thp",
        action="store_true",
        help="do not set THP_MEM_ALLOC_ENABLE=1 for the workers (4 KiB pages)",
    )
    args = ap.parse_args()
    if not args.no_thp:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read by the workers' torch at start
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    out = asyncio.run(_run(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
