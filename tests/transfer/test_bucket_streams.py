"""GPU tier: the bucketed exchange's CUDA path (packing and unpacking on a side stream,
the transfer on the communicator's stream, events between them) on one GPU.

NCCL refuses two ranks on one GPU, so the two ranks here are two threads of this process
over ``Loopback``, a streamed communicator that moves each send with a device copy on its
own stream, ordered by events exactly as the nccl backend orders its kernels: it starts
after the ``after`` event, and a send's end waits for the receiver's copy of it. The
sources are written on the caller's stream behind a long sleep kernel, so a pack that
did not wait for the caller's stream, a send that did not wait for its pack, or a send
buffer reused before its round left would show as wrong bytes. Skipped (by
tests/conftest.py) where CUDA is absent; with two GPUs, tests/transfer/test_nccl.py runs
the same exchange over NCCL."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from nereus.transfer import exchange
from nereus.transfer.communicator import Communicator, P2POp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

WAIT_S = 30.0


class Mailbox:
    """What the two ranks hand each other: posted send buffers and read receipts."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.posts: dict[tuple[int, int, int], tuple[torch.Tensor, Any]] = {}
        self.reads: dict[tuple[int, int, int], Any] = {}

    def put(self, table: dict, key: tuple[int, int, int], value: Any) -> None:
        with self.cond:
            table[key] = value
            self.cond.notify_all()

    def take(self, table: dict, key: tuple[int, int, int]) -> Any:
        with self.cond:
            assert self.cond.wait_for(lambda: key in table, WAIT_S), f"nothing for {key}"
            return table.pop(key)


class Loopback(Communicator):
    """One rank of a two-thread group on one GPU (see the module docstring)."""

    backend = "loopback"
    streamed = True

    def __init__(self, rank: int, box: Mailbox, device: torch.device) -> None:
        self.group_id, self.rank, self.size, self.epoch = "loopback", rank, 2, 0
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.box = box
        self.sent: Counter = Counter()
        self.got: Counter = Counter()

    def enqueue_p2p(
        self,
        ops: Sequence[P2POp],
        new: Sequence[tuple[int, int]],
        after: Any,
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], Any]:
        assert all(o.kind == "send" and o.tensor.is_contiguous() for o in ops)
        caller = torch.cuda.current_stream(self.device)
        if after is None:
            after = torch.cuda.Event()
            after.record(caller)
        self.stream.wait_event(after)
        posted = torch.cuda.Event()
        posted.record(self.stream)
        keys = []
        for o in ops:
            key = (self.rank, o.peer, self.sent[o.peer])
            self.sent[o.peer] += 1
            keys.append(key)
            self.box.put(self.box.posts, key, (o.tensor, posted))
        fresh = [torch.empty(n, dtype=torch.uint8, device=self.device) for _, n in new]
        for (peer, n), out in zip(new, fresh, strict=True):
            key = (peer, self.rank, self.got[peer])
            self.got[peer] += 1
            src, ready = self.box.take(self.box.posts, key)
            assert src.numel() * src.element_size() == n, (key, src.numel(), n)
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                out.copy_(src.view(torch.uint8).reshape(-1))
            read = torch.cuda.Event()
            read.record(self.stream)
            src.record_stream(self.stream)
            out.record_stream(self.stream)
            self.box.put(self.box.reads, key, read)
        for key in keys:  # a send ends when its receiver has copied it (as NCCL's does)
            self.stream.wait_event(self.box.take(self.box.reads, key))
        for o in ops:
            o.tensor.record_stream(self.stream)
        done = torch.cuda.Event(enable_timing=True)
        done.record(self.stream)
        return fresh, done

    def synchronize(self, timeout_s: float | None = None) -> None:
        self.stream.synchronize()

    def batch_p2p(self, ops, timeout_s=None):
        raise NotImplementedError

    def broadcast(self, tensor, src, timeout_s=None):
        raise NotImplementedError

    def all_reduce(self, tensor, op="sum", timeout_s=None):
        raise NotImplementedError

    def all_gather(self, output, input, timeout_s=None):
        raise NotImplementedError

    def reduce_scatter(self, output, input, op="sum", timeout_s=None):
        raise NotImplementedError

    def barrier(self, timeout_s=None):
        raise NotImplementedError

    def destroy(self):
        pass

    def abort(self):
        pass


def _views(rank: int, peer: int, fill: bool, device: torch.device) -> list[torch.Tensor]:
    """What ``rank`` sends ``peer`` (``fill``) or the empty views it receives into: small
    views packed together, a strided view, one cut across several buckets, bfloat16."""
    g = torch.Generator().manual_seed(100 * rank + peer)
    shapes = [
        ((3000,), torch.float32),
        ((517, 129), torch.bfloat16),
        ((40000, 64), torch.float32),
        ((0,), torch.int64),
        ((777,), torch.int64),
        ((128, 256), torch.float32),
    ]
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        base = (
            torch.randn(shape, generator=g).to(dtype)
            if dtype.is_floating_point
            else torch.randint(0, 1 << 40, shape, generator=g)
        )
        t = base.to(device) if fill else torch.zeros(shape, dtype=dtype, device=device)
        out.append(t[:, ::2] if i == 5 else t)  # a strided view
    return out


@pytest.mark.parametrize("adopt", [False, True])
def test_streamed_exchange_between_two_ranks_on_one_gpu(adopt):
    device = torch.device("cuda", 0)
    box = Mailbox()
    comms = [Loopback(r, box, device) for r in range(2)]
    expect = {r: [v.clone() for v in _views(1 - r, r, True, device)] for r in range(2)}
    got: dict[int, list[torch.Tensor]] = {}
    stats: dict[int, Any] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            sends = _views(r, 1 - r, False, device)
            fill = _views(r, 1 - r, True, device)
            torch.cuda._sleep(200_000_000)  # the producer is slow: packing must wait for it
            for dst, src in zip(sends, fill, strict=True):
                dst.copy_(src)
            recvs = _views(1 - r, r, False, device)
            stats[r] = exchange(
                comms[r], {1 - r: sends}, {1 - r: recvs}, bucket_bytes=1 << 20, adopt=adopt
            )
            got[r] = recvs
            for s in sends:
                s.fill_(0)  # after exchange returns, the sources are the caller's again
        except BaseException as e:  # delivered to the test below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    for r in range(2):
        assert stats[r].rounds >= 4  # several rounds: both send buffers are reused
        assert stats[r].bytes_sent == stats[1 - r].bytes_received > 8 << 20
        for i, (a, b) in enumerate(zip(got[r], expect[r], strict=True)):
            assert torch.equal(a, b.reshape(a.shape)), f"rank {r} view {i}"
