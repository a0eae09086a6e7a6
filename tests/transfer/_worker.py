"""A worker process for the transfer tests: ``python -m tests.transfer._worker SCENARIO ARGS``.

ARGS is one JSON object with at least rank, size, port (of the test's TCPStore).
Each scenario builds real communicators, checks every result against a torch
reference computed locally (every rank can rebuild every rank's input from the
seed), and prints one JSON line of facts on success; any failure exits non-zero
with the traceback on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from nereus.errors import NereusError, StuckCollective, TransferError
from nereus.transfer._shm import _RECORD
from nereus.transfer.communicator import P2POp
from nereus.transfer.cpu import CpuCommunicator

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
}


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding a copy of ``t`` (every other column of a wider base)."""
    flat = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    base = torch.zeros((flat.shape[0], 2 * flat.shape[1]), dtype=t.dtype, device=t.device)
    view = base[:, ::2]
    view.copy_(flat)
    assert not view.is_contiguous() or view.numel() <= 1
    return view


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype in (torch.bfloat16, torch.float16):
        ok = torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    elif a.dtype.is_floating_point:
        ok = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
        ok = torch.equal(a, b)
    assert ok, f"{what}: got {a.flatten()[:6]} expected {b.flatten()[:6]}"


def comm_from(a: dict, group: str, **kw):
    kw.setdefault("timeout_s", a.get("timeout_s", 30.0))
    if a.get("backend") == "nccl":
        from nereus.transfer.nccl import NcclCommunicator

        torch.cuda.set_device(a["rank"])
        return NcclCommunicator(
            group,
            a["rank"],
            a["size"],
            bytes.fromhex(a["nccl_id"]),
            device=a["rank"],
            timeout_s=kw["timeout_s"],
            store_host="127.0.0.1",
            store_port=a["port"],
        )
    return CpuCommunicator(group, a["rank"], a["size"], "127.0.0.1", a["port"], **kw)


def reference(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    if xs[0].dtype == torch.bool:
        stack = torch.stack(xs)
        return {"sum": stack.any(0), "max": stack.any(0), "min": stack.all(0)}[op]
    stack = torch.stack([x.double() if x.dtype.is_floating_point else x for x in xs])
    out = {
        "sum": stack.sum(0),
        "max": stack.amax(0),
        "min": stack.amin(0),
        "avg": stack.mean(0) if stack.dtype.is_floating_point else None,
    }[op]
    return out.to(xs[0].dtype)


def scenario_collectives(a: dict) -> dict:
    r, n = a["rank"], a["size"]
    comm = comm_from(a, a["group"])
    dev = torch.device(f"cuda:{r}") if a.get("backend") == "nccl" else torch.device("cpu")
    checked = 0
    for name, dtype in DTYPES.items():
        for shape in [(6, 5), (0, 3), (3, 1)]:
            for noncontig in (False, True):

                def wrap(t: torch.Tensor, noncontig: bool = noncontig) -> torch.Tensor:
                    t = t.to(dev)
                    return strided(t) if noncontig else t.clone()

                xs = [make(shape, dtype, 100 * p + len(name)) for p in range(n)]
                ops = ["sum", "max", "min"] + (["avg"] if dtype.is_floating_point else [])
                for op in ops:
                    t = wrap(xs[r])
                    comm.all_reduce(t, op)
                    close(t.reshape(shape), reference(op, xs), f"all_reduce {op} {name} {shape}")
                    checked += 1
                for src in range(n):
                    t = wrap(xs[r])
                    comm.broadcast(t, src)
                    close(t.reshape(shape), xs[src], f"broadcast {src} {name}")
                    checked += 1
                out = torch.empty((n, *shape), dtype=dtype, device=dev)
                comm.all_gather(out, wrap(xs[r]))
                close(out, torch.stack(xs), f"all_gather {name} {shape}")
                rows = [make((n * 2, 3), dtype, 7 * p + 1) for p in range(n)]
                out = wrap(torch.zeros((2, 3), dtype=dtype))
                rs_op = "max" if dtype == torch.bool else "sum"
                comm.reduce_scatter(out, wrap(rows[r]), rs_op)
                close(
                    out.reshape(2, 3),
                    reference(rs_op, rows)[2 * r : 2 * r + 2],
                    f"reduce_scatter {name}",
                )
                checked += 2
    comm.barrier()
    comm.destroy()
    return {"checked": checked}


def scenario_p2p(a: dict) -> dict:
    """Every rank sends several tensors to every other rank in one batch, listing its
    ops in an order that would deadlock with blocking sends."""
    r, n = a["rank"], a["size"]
    if a.get("backend") == "nccl":
        comm = comm_from(a, a["group"])
        dev = torch.device(f"cuda:{r}")
    else:
        comm = comm_from(
            a,
            a["group"],
            use_shm=a["shm"],
            slot_bytes=a.get("slot_bytes", 1 << 16),
            slots=a.get("slots", 2),
        )
        dev = torch.device("cpu")
    checked = 0
    for rnd in range(a.get("rounds", 2)):
        ops, expect = [], []
        for peer in range(n):
            if peer == r:
                continue
            for k, (name, dtype) in enumerate(DTYPES.items()):
                # sizes from empty to several slots of the ring
                shape = [(0,), (3, 7), (257, 129), (1,), (40000,)][(k + rnd + r + peer) % 5]
                noncontig = (k + rnd) % 2 == 1 and len(shape) == 2
                out_t = make(shape, dtype, 1000 * r + 10 * peer + k + rnd).to(dev)
                in_ref = make(shape, dtype, 1000 * peer + 10 * r + k + rnd).to(dev)
                send = strided(out_t) if noncontig else out_t
                recv = strided(torch.zeros_like(in_ref)) if noncontig else torch.zeros_like(in_ref)
                ops.append(P2POp("send", send, peer))
                ops.append(P2POp("recv", recv, peer))
                expect.append((recv, in_ref, f"{name} from {peer}"))
        # Even ranks list receives first, odd ranks sends first; peers in reverse order.
        ops.sort(key=lambda o: (o.kind == ("send" if r % 2 == 0 else "recv"), -o.peer))
        comm.batch_p2p(ops)
        for got, ref, what in expect:
            close(got.reshape(ref.shape), ref, what)
            checked += 1
    comm.destroy()
    return {"checked": checked}


def scenario_handoff(a: dict) -> dict:
    """recv_new: large transfers are adopted (zero copy), segments come back to the pool."""
    import gc

    r = a["rank"]
    comm = comm_from(a, a["group"], slot_bytes=1 << 16, slots=2)
    shapes = [(10,), (300, 1000), (0,), (2, 70000), (300, 1000)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]
    segments = []
    for rnd in range(3):
        for k, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            ref = make(shape, dtype, 50 * rnd + k)
            if r == 0:
                # a non-contiguous source is fine too
                comm.send(strided(ref) if len(shape) == 2 else ref, 1)
            else:
                got = comm.recv_new(shape, dtype, 0)
                close(got, ref, f"recv_new {shape} {dtype}")
                got.add_(0) if dtype.is_floating_point else None  # ours to use
                del got
                gc.collect()
        comm.barrier()  # the releases of this round are in flight before the next one
        if r == 0:
            segments.append(len(comm._shm._out[1].own_segments))
    comm.destroy()
    return {"segments": segments}


def scenario_mismatch(a: dict) -> dict:
    """Sizes that disagree are an error, over shared memory and over gloo."""
    r = a["rank"]
    out = {}
    for shm in (True, False):
        comm = comm_from(a, f"{a['group']}-{shm}", use_shm=shm)
        raised, message = None, ""
        try:
            if r == 0:
                # the receiver refuses at once and leaves: the sender need not wait long
                # for a receive that will not come (the next group's rendezvous waits on it)
                comm.send(torch.ones(10), 1, timeout_s=3.0)
            else:
                comm.recv(torch.ones(12), 0, timeout_s=10.0)
        except NereusError as e:
            raised, message = type(e).__name__, str(e)
        finally:
            comm.destroy()
        out["shm" if shm else "gloo"] = {"raised": raised, "message": message}
    return out


def scenario_stuck(a: dict) -> dict:
    """Rank ``missing`` never enters the operations; the others must report it.

    One group per operation kind, one after the other in the same processes."""
    r = a["rank"]
    dev = torch.device(f"cuda:{r}") if a.get("backend") == "nccl" else torch.device("cpu")
    out = {}
    for op in a["ops"]:
        kw = {"use_shm": False} if op == "p2p_gloo" else {}
        comm = comm_from(a, f"{a['group']}-{op}", timeout_s=30.0, **kw)
        comm.barrier()
        if r == a["missing"]:
            # Stay alive (a stuck rank, not a dead one) until the others reported.
            comm._kv.wait([f"reported/{p}" for p in range(a["size"]) if p != r])
            comm.destroy()
            out[op] = {"role": "missing"}
            continue
        t0 = time.monotonic()
        try:
            if op.startswith("p2p"):
                comm.recv(torch.empty(1000, device=dev), a["missing"], timeout_s=a["deadline_s"])
            else:
                comm.all_reduce(torch.ones(1000, device=dev), timeout_s=a["deadline_s"])
            comm.synchronize()  # NCCL returns once enqueued; the wait is where it fails
            raise AssertionError(f"{op} did not fail")
        except StuckCollective as e:
            took = time.monotonic() - t0
            after = None
            try:
                comm.barrier()
            except TransferError as e2:
                after = type(e2).__name__
            comm._kv.set(f"reported/{r}", "1")
            comm.destroy()
            out[op] = {
                "role": "waiter",
                "missing_ranks": e.missing_ranks,
                "seconds": took,
                "op": e.op,
                "after": after,
            }
    return out


def scenario_big(a: dict) -> dict:
    """More than 2 GiB in one broadcast and one send/recv between two ranks (counts past
    a C int); both ranks take part and the receiver checks the ends and the middle."""
    r = a["rank"]
    comm = comm_from(a, a["group"], timeout_s=120.0)
    dev = torch.device(f"cuda:{r}")
    n = (2**31 + 4096) // 4
    x = torch.full((n,), 7.0 if r == 0 else 0.0, dtype=torch.float32, device=dev)
    comm.broadcast(x, 0)
    raw = torch.full((2**31 + 8,), 5 if r == 0 else 0, dtype=torch.uint8, device=dev)
    comm.send(raw, 1) if r == 0 else comm.recv(raw, 0)
    comm.synchronize()
    checked = 0
    for t, want in ((x, 7.0), (raw, 5)):
        for i in (0, t.numel() // 2, t.numel() - 1):
            assert float(t[i]) == want, f"{t.dtype} element {i}: {float(t[i])} != {want}"
            checked += 1
    comm.destroy()
    return {"checked": checked, "bytes": x.numel() * 4 + raw.numel()}


def scenario_die(a: dict) -> dict:
    """Rank ``victim`` exits abruptly inside the operation; survivors must fail fast."""
    r = a["rank"]
    comm = comm_from(
        a,
        a["group"],
        timeout_s=a["deadline_s"],
        use_shm=a.get("shm", True),
        slot_bytes=1 << 16,
        slots=2,
        devices=tuple(range(100, 100 + a["size"])),
    )
    comm.barrier()
    big = torch.ones(4 << 20)
    if r == a["victim"]:
        if a["op"] == "inside":
            # Enter the all_reduce (its watchdog entry says so), then die in it.
            comm._seq += 1
            comm._kv.set(f"c/{r}", str(comm._seq))
            os._exit(3)
        if a["op"] == "p2p":
            # Deliver the first chunk of a transfer, then die with it half done.
            ch = comm._shm._out[0]
            ch.slot(ch.slot_bytes).fill_(1)
            os.write(ch.full_fd, _RECORD.pack(big.numel() * 4, ch.slot_bytes, -1, 0))
        os._exit(3)
    t0 = time.monotonic()
    try:
        if a["op"] == "p2p":
            comm.recv(big, a["victim"]) if r == 0 else comm.barrier()
        else:
            comm.all_reduce(big)
    except NereusError as e:
        took = time.monotonic() - t0
        comm.destroy()
        return {
            "raised": type(e).__name__,
            "seconds": took,
            "message": str(e)[:300],
            "dead_ranks": getattr(e, "dead_ranks", None),
            "missing_ranks": getattr(e, "missing_ranks", None),
        }
    raise AssertionError("survivor did not fail")


def scenario_exchange(a: dict) -> dict:
    """Every rank exchanges a mixed list of views with every other rank in small buckets."""
    from nereus.transfer import _tap
    from nereus.transfer.bucket import exchange

    r, n = a["rank"], a["size"]
    events = []
    _tap.add_listener(events.append)
    comm = comm_from(a, a["group"], slot_bytes=1 << 16, slots=2)

    def views_between(src: int, dst: int, fill: bool) -> list[torch.Tensor]:
        out = []
        for k, dtype in enumerate(DTYPES.values()):
            for j, shape in enumerate([(0, 4), (33, 17), (5000,), (2, 3)]):
                seed = 10000 * src + 100 * dst + 10 * k + j
                t = make(shape, dtype, seed) if fill else torch.zeros(shape, dtype=dtype)
                out.append(strided(t) if (k + j) % 2 and len(shape) == 2 else t)
        return out

    out = {}
    for bucket_bytes in a["bucket_bytes"]:
        events.clear()
        sends = {p: views_between(r, p, True) for p in range(n) if p != r}
        recvs = {p: views_between(p, r, False) for p in range(n) if p != r}
        stats = exchange(comm, sends, recvs, bucket_bytes=bucket_bytes)
        checked = 0
        for p, views in recvs.items():
            for got, ref in zip(views, views_between(p, r, True), strict=True):
                close(got.reshape(ref.shape), ref, f"view from {p}")
                checked += 1
        buckets = [e for e in events if e["type"] == "transfer_bucket"]
        assert len(buckets) == stats.buckets, (len(buckets), stats.buckets)
        assert sum(e["bytes"] for e in buckets) == stats.bytes_sent + stats.bytes_received
        assert all(e["gbps"] >= 0 and e["seconds"] > 0 for e in buckets)
        out[str(bucket_bytes)] = {
            "checked": checked,
            "rounds": stats.rounds,
            "buckets": stats.buckets,
        }
    segments = sum(len(ch.own_segments) for ch in comm._shm._out.values())
    comm.destroy()
    return {"by_bucket": out, "handoff_segments": segments}


def scenario_direct(a: dict) -> dict:
    """exchange_direct: receive views on arenas (whole, strided, reshaped, empty) are
    written by the senders; views elsewhere, or from a rank that may not map arenas
    (``deny_map``), come through buckets. Twice, so the second run reuses arenas."""
    from nereus.transfer import _arena, _tap
    from nereus.transfer.direct import arena_empty, exchange_direct

    r, n = a["rank"], a["size"]
    events = []
    _tap.add_listener(events.append)
    comm = comm_from(a, a["group"], slot_bytes=1 << 16, slots=2)
    if "eager_bytes" in a:  # records larger than this go both ways in one batch
        comm.eager_bytes = a["eager_bytes"]
    if r == a.get("deny_map", -1):

        def deny(ref):
            raise PermissionError(f"no access to pid {ref.pid}")

        _arena.map_peer = deny
    shapes = [(0, 4), (33, 17), (5000,), (64, 48), (7,)]

    def sources(src: int, dst: int) -> list[torch.Tensor]:
        out = []
        for k, dtype in enumerate(DTYPES.values()):
            for j, shape in enumerate(shapes):
                t = make(shape, dtype, 10000 * src + 100 * dst + 10 * k + j)
                out.append(strided(t) if (k + j) % 2 and len(shape) == 2 else t)
        return out

    def targets(src: int) -> list[torch.Tensor]:
        """Views of one arena, except every 4th (plain memory); some strided, some of
        another shape than the source (same bytes, contiguous)."""
        sizes = [t.numel() * t.element_size() for t in sources(src, r)]
        arena = arena_empty(sum(2 * x + 64 for x in sizes))
        out, off = [], 0
        for i, t in enumerate(sources(src, r)):
            nbytes = t.numel() * t.element_size()
            if i % 4 == 3:
                out.append(torch.zeros(t.shape, dtype=t.dtype))
                continue
            region = arena[off : off + 2 * nbytes].view(t.dtype)
            off += -(-2 * nbytes // 64) * 64
            if i % 3 == 1 and t.dim() == 2:
                out.append(region.view(t.shape[0], 2 * t.shape[1])[:, 1::2])  # strided
            elif i % 3 == 2:
                out.append(region[: t.numel()])  # flat: another shape, same bytes
            else:
                out.append(region[: t.numel()].view(t.shape))
        return out

    def one_run() -> dict:
        events.clear()
        sends = {p: sources(r, p) for p in range(n) if p != r}
        recvs = {p: targets(p) for p in range(n) if p != r}
        local_src = make((300, 40), torch.float32, 99 + r)
        local_dst = arena_empty(300 * 40 * 4).view(torch.float32).view(300, 40)
        stats = exchange_direct(comm, sends, recvs, [(local_src, local_dst)], bucket_bytes=4096)
        close(local_dst, local_src, "local pair")
        checked = 0
        for p, views in recvs.items():
            for got, ref in zip(views, sources(p, r), strict=True):
                close(got.reshape(ref.shape), ref.contiguous(), f"view from {p}")
                checked += 1
        direct = [e for e in events if e["type"] == "transfer_bucket" and e["round"] == -1]
        buckets = [e for e in events if e["type"] == "transfer_bucket" and e["round"] >= 0]
        assert sum(e["bytes"] for e in events if e["type"] == "transfer_bucket") >= (
            stats.bytes_sent + stats.bytes_received
        )
        return {
            "checked": checked,
            "direct_sent": sum(e["bytes"] for e in direct if e["src_rank"] == r),
            "direct_received": sum(e["bytes"] for e in direct if e["dst_rank"] == r),
            "bucket_events": len(buckets),
            "bytes_received": stats.bytes_received,
        }

    runs = [one_run(), one_run()]  # the views die with each run: their arenas go back to the pool
    pool = {**_arena.pool_stats(), "made": _arena._pool.serial}
    comm.destroy()
    return {"runs": runs, "pool": pool}


def scenario_direct_mismatch(a: dict) -> dict:
    """Rank 0 sends 400 bytes into rank 1's 200-byte arena view: both raise, neither waits."""
    from nereus.transfer.direct import arena_empty, exchange_direct

    r = a["rank"]
    comm = comm_from(a, a["group"], timeout_s=a["deadline_s"], slot_bytes=1 << 16, slots=2)
    t0 = time.monotonic()
    try:
        if r == 0:
            exchange_direct(comm, {1: [torch.ones(100)]}, {})
        else:
            exchange_direct(comm, {}, {0: [arena_empty(200).view(torch.float32)]})
    except TransferError as e:
        took = time.monotonic() - t0
        comm.destroy()
        return {"raised": type(e).__name__, "seconds": took, "message": str(e)[:300]}
    raise AssertionError("a size mismatch went unnoticed")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def scenario_churn(a: dict) -> dict:
    """Groups over several device subsets, created and destroyed repeatedly."""
    r = a["rank"]
    subsets = a["subsets"]
    before = None
    counts = []
    for it in range(a["iterations"]):
        for si, members in enumerate(subsets):
            if r not in members:
                continue
            me = members.index(r)
            comm = CpuCommunicator(
                f"churn-{it}-{si}",
                me,
                len(members),
                "127.0.0.1",
                a["port"],
                epoch=it,
                timeout_s=30.0,
                slot_bytes=1 << 16,
            )
            t = torch.full((5,), float(r))
            comm.all_reduce(t)
            assert t[0].item() == float(sum(members)), (t, members)
            if len(members) > 1:
                peer = members[(me + 1) % len(members)]
                src = members[(me - 1) % len(members)]
                got = torch.empty(3)
                comm.batch_p2p(
                    [
                        P2POp("send", torch.full((3,), float(r)), members.index(peer)),
                        P2POp("recv", got, members.index(src)),
                    ]
                )
                assert got[0].item() == float(src)
            comm.destroy()
        counts.append((_fd_count(), _thread_count()))
        if it == 0:
            before = counts[0]
    return {"first": before, "last": counts[-1], "counts": counts}


def main() -> None:
    scenario = sys.argv[1]
    args = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    try:
        result = globals()[f"scenario_{scenario}"](args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(json.dumps({"rank": args["rank"], **result}), flush=True)


if __name__ == "__main__":
    main()
