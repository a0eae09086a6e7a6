"""The Communicator contract: collectives and p2p over one group of devices.

A ``Communicator`` is one rank's handle on a group (a subset of the cluster's
devices) for one layout epoch. Backends implement it: ``gloo`` (torch's
ProcessGroupGloo, CPU, any host), shared memory for intra-host CPU p2p, and
``nccl`` (libnccl through ctypes on CUDA tensors).

Promises:
- Every operation is in place on the tensors given, like torch.distributed. CPU
  backends block until it is done; the nccl backend is stream-ordered: it returns once
  NCCL accepted the work, and later work on the caller's current CUDA stream sees the
  result. ``synchronize`` waits on the host (where the host needs the data). Callers
  on an event loop run operations in a thread (``asyncio.to_thread``).
- Every operation has a deadline (``timeout_s``, default the group's); one that outlives
  it raises ``StuckCollective`` naming the ranks that never entered it, and the group
  is aborted; later operations on it raise ``TransferError``.
- ``batch_p2p`` runs a list of sends and receives as one group, so any set of pairwise
  transfers completes without deadlock whatever the order the ranks list them in.
- Reductions and gathers come from the backend (NCCL or gloo): never home-made.
- ``recv_new`` / ``batch_p2p_new`` receive into fresh tensors; a backend that can hand
  memory over (shared memory within a host) returns the sender's copy itself.

Refuses: tensors of mismatched size across ranks (``TransferError``), operations after
``destroy``/``abort`` (``TransferError``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from nereus.errors import TransferError

__all__ = ["Communicator", "P2POp", "ReduceOp"]

ReduceOp = Literal["sum", "max", "min", "avg"]


@dataclass(frozen=True)
class P2POp:
    """One point-to-point half: ``send`` ``tensor`` to ``peer``, or ``recv`` into it."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int  # rank within the group


class Communicator(abc.ABC):
    """One rank's handle on a group. See the module docstring for the contract."""

    group_id: str
    rank: int
    size: int
    epoch: int
    backend: str
    # Cluster device index of each rank, when the group was made for devices
    # (make_group); None for groups built by hand. Used to label tap events.
    devices: tuple[int, ...] | None = None
    # Whether operations run on a CUDA stream of the communicator's own and it offers
    # ``enqueue_p2p(ops, new, after, timeout_s) -> (fresh tensors, done event)`` (nccl).
    streamed: bool = False

    @abc.abstractmethod
    def batch_p2p(self, ops: Sequence[P2POp], timeout_s: float | None = None) -> None:
        """Run all sends and receives of this rank as one group (no deadlock)."""

    def batch_p2p_new(
        self, ops: Sequence[P2POp], new: Sequence[tuple[int, int]], timeout_s: float | None = None
    ) -> list[torch.Tensor]:
        """``batch_p2p(ops)`` plus, in the same group, receives into fresh uint8 tensors:
        ``new`` lists (peer, bytes); returns those tensors in that order. Backends that
        can hand memory over return the sender's copy itself (see ``recv_new``)."""
        device = getattr(self, "device", torch.device("cpu"))
        fresh = [torch.empty(n, dtype=torch.uint8, device=device) for _, n in new]
        self.batch_p2p(
            [*ops, *(P2POp("recv", t, p) for (p, _), t in zip(new, fresh, strict=True))], timeout_s
        )
        return fresh

    def send(self, tensor: torch.Tensor, dst: int, timeout_s: float | None = None) -> None:
        self.batch_p2p([P2POp("send", tensor, dst)], timeout_s)

    def recv(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        self.batch_p2p([P2POp("recv", tensor, src)], timeout_s)

    def recv_new(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, timeout_s: float | None = None
    ) -> torch.Tensor:
        """Receive from ``src`` into a fresh tensor of ``shape`` and ``dtype``.

        Backends that can hand memory over (shared memory within a host) return a
        tensor backed by the sender's copy, with no copy on this side; the default
        allocates one and receives into it."""
        out = torch.empty(tuple(shape), dtype=dtype)
        self.recv(out, src, timeout_s)
        return out

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float | None = None) -> None:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank."""

    @abc.abstractmethod
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", timeout_s: float | None = None
    ) -> None:
        """Reduce ``tensor`` across ranks, result in place on every rank."""

    @abc.abstractmethod
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        """``output`` (size * input.numel(), shaped ``[size, *input.shape]`` or flat) gets
        every rank's ``input`` in rank order."""

    @abc.abstractmethod
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = "sum",
        timeout_s: float | None = None,
    ) -> None:
        """``input`` holds ``size`` equal chunks along dim 0; rank r gets the reduction of
        chunk r across ranks in ``output``."""

    def _check_all_gather_sizes(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.dtype != input.dtype or output.numel() != self.size * input.numel():
            raise TransferError(
                f"all_gather output ({output.dtype}, {output.numel()} elements) must be "
                f"{input.dtype} with size*input.numel() = {self.size * input.numel()} elements"
            )

    def _check_reduce_scatter_sizes(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.dtype != input.dtype or input.numel() != self.size * output.numel():
            raise TransferError(
                f"reduce_scatter input ({input.dtype}, {input.numel()} elements) must be "
                f"{output.dtype} with size*output.numel() = {self.size * output.numel()} elements"
            )

    @abc.abstractmethod
    def barrier(self, timeout_s: float | None = None) -> None:
        """Return once every rank has entered."""

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Return once every operation this rank enqueued is done, raising what a failed
        one raises. Backends whose operations block have nothing to wait for."""
        return None

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the group's resources (sockets, segments, threads). Idempotent."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Fail every pending and future operation on this group at once. Idempotent."""
