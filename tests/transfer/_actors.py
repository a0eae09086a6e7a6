"""Actor classes the group tests spawn (workers import this module by path)."""

from __future__ import annotations

import asyncio
import os

import torch

from nereus.actors import Actor, current_device, endpoint
from nereus.transfer import P2POp, _tap, exchange, get_communicator, local_groups, release_epoch


class Member(Actor):
    """Uses whatever group the controller names, from a worker thread."""

    @endpoint
    async def all_reduce(self, group_id: str, value: float) -> list:
        def run() -> list:
            comm = get_communicator(group_id)
            t = torch.full((4,), value)
            comm.all_reduce(t)
            return [comm.rank, comm.size, t[0].item()]

        return await asyncio.to_thread(run)

    @endpoint
    async def ring(self, group_id: str) -> list:
        """Send this device's index to the next rank, receive from the previous."""

        def run() -> list:
            comm = get_communicator(group_id)
            got = torch.empty(3, dtype=torch.int64)
            nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            me = torch.full((3,), current_device().index, dtype=torch.int64)
            comm.batch_p2p([P2POp("recv", got, prv), P2POp("send", me, nxt)])
            return got.tolist()

        return await asyncio.to_thread(run)

    @endpoint
    async def swap_weights(self, group_id: str) -> list:
        """Exchange a few views with rank 0 <-> 1 through the bucketed path; returns the
        received values and the (src, dst) device labels of the bucket tap events."""

        def run() -> list:
            comm = get_communicator(group_id)
            peer = 1 - comm.rank
            mine = [torch.full((100, 10), float(comm.rank)), torch.arange(7.0) + comm.rank]
            theirs = [torch.empty(100, 10), torch.empty(7)]
            events: list = []
            _tap.add_listener(events.append)
            try:
                exchange(comm, {peer: mine}, {peer: theirs}, bucket_bytes=1024)
            finally:
                _tap.remove_listener(events.append)
            pairs = sorted({(e["src"], e["dst"]) for e in events if e["type"] == "transfer_bucket"})
            return [theirs[0][0, 0].item() + theirs[1][0].item(), [list(p) for p in pairs]]

        return await asyncio.to_thread(run)

    @endpoint
    async def groups(self) -> list:
        return [list(g) for g in local_groups()]

    @endpoint
    async def release(self, epoch: int) -> int:
        return await asyncio.to_thread(release_epoch, epoch)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


class CudaMember(Actor):
    """A member of an NCCL group on its worker's one GPU (``cuda:0``)."""

    @endpoint
    async def all_reduce(self, group_id: str, value: float) -> list:
        def run() -> list:
            comm = get_communicator(group_id)
            t = torch.full((4,), value, device="cuda:0")
            comm.all_reduce(t)
            return [comm.rank, str(comm.device), torch.cuda.device_count(), t[0].item()]

        return await asyncio.to_thread(run)
