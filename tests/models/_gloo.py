"""A test-only ``Communicator`` over torch's ProcessGroupGloo, for model worker processes.

The TP/PP tests need real collectives between real processes; this adapter wraps a
``ProcessGroupGloo`` made from a ``TCPStore`` (no ``init_process_group``, no global world)
behind the ``nereus.transfer.communicator.Communicator`` contract, so the model layers run
exactly as they do on the project's own communicators. Collectives are gloo's: nothing
here reduces or gathers by hand.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from nereus.errors import TransferError
from nereus.transfer.communicator import Communicator, P2POp

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class GlooCommunicator(Communicator):
    def __init__(self, store: dist.Store, group_id: str, rank: int, size: int, timeout_s: float = 60.0) -> None:
        self.group_id = group_id
        self.rank = rank
        self.size = size
        self.epoch = 0
        self.backend = "gloo"
        self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            dist.PrefixStore(group_id, store), rank, size, datetime.timedelta(seconds=timeout_s)
        )

    @property
    def pg(self) -> dist.ProcessGroupGloo:
        if self._pg is None:
            raise TransferError(f"group {self.group_id!r} was destroyed")
        return self._pg

    def batch_p2p(self, ops: Sequence[P2POp], timeout_s: float | None = None) -> None:
        works = []
        for op in ops:
            if op.kind == "send":
                works.append(self.pg.send([op.tensor.contiguous()], op.peer, 0))
            else:
                works.append(self.pg.recv([op.tensor], op.peer, 0))
        for w in works:
            w.wait()

    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", timeout_s: float | None = None) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self.pg.allreduce([tensor], opts).wait()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, timeout_s: float | None = None) -> None:
        parts = [torch.empty_like(input) for _ in range(self.size)]
        self.pg.allgather([parts], [input.contiguous()]).wait()
        output.view(self.size, *input.shape).copy_(torch.stack(parts))

    def reduce_scatter(self, output, input, op="sum", timeout_s=None) -> None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        chunks = [c.contiguous() for c in input.chunk(self.size)]
        self.pg.reduce_scatter([output], [chunks], opts).wait()

    def barrier(self, timeout_s: float | None = None) -> None:
        self.all_reduce(torch.zeros(1))

    def destroy(self) -> None:
        self._pg = None

    def abort(self) -> None:
        self._pg = None
