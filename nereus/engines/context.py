"""Where one engine rank sits inside its EMU and among its model-stage's EMUs.

An EMU is a TP x PP mesh of ranks; DP is the number of EMUs of a model-stage.
``EmuContext`` bundles, for one rank:

- ``parallel``: the model's ``ParallelContext`` (TP rank/size and TP communicator, PP
  rank/size, layer cuts) that the model's layers use;
- ``pp_comm``: the pipeline group of this TP rank (the ``pp_size`` ranks with the same
  ``tp_rank``; rank in the group == ``pp_rank``): activations and their gradients move
  stage to stage over it, sampled tokens move from the last stage back to the first;
- ``dp_comm``: the data-parallel group of this (pp, tp) position across the model-stage's
  EMUs (rank == ``dp_rank``): gradients are reduced over it;
- ``device``: where the rank's stage and buffers live (``"cpu"``, or a CUDA device for
  any engine on a GPU, whose communicators are then NCCL's; in a worker it is the
  worker's ``cuda:0``, the one GPU it sees).

The pipeline helpers here (``send_next``, ``recv_prev``, ...) are the only way engines move
activations between stages: blocking, in place, over ``pp_comm``. Both ends always know
the shape and dtype (every rank of an EMU sees the same request), so no header travels.

Refuses (``ConfigError``): ``pp_size > 1`` without ``pp_comm``, ``dp_size > 1`` without
``dp_comm``, communicators whose rank or size disagree with the position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.config import require
from nereus.models.parallel import ParallelContext
from nereus.transfer.communicator import Communicator, P2POp

__all__ = ["EmuContext"]


@dataclass(frozen=True)
class EmuContext:
    """One engine rank's position: model parallelism plus the PP and DP groups."""

    parallel: ParallelContext
    pp_comm: Communicator | None = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_comm: Communicator | None = None
    timeout_s: float | None = None
    device: str = "cpu"  # where the stage, its activations and its buffers live

    def __post_init__(self) -> None:
        pc = self.parallel
        if pc.pp_size > 1:
            require(
                self.pp_comm is not None,
                "EmuContext.pp_comm",
                None,
                f"is required when pp_size={pc.pp_size} > 1",
            )
            assert self.pp_comm is not None
            require(
                self.pp_comm.size == pc.pp_size,
                "EmuContext.pp_comm.size",
                self.pp_comm.size,
                f"must equal pp_size={pc.pp_size}",
            )
            require(
                self.pp_comm.rank == pc.pp_rank,
                "EmuContext.pp_comm.rank",
                self.pp_comm.rank,
                f"must equal pp_rank={pc.pp_rank}",
            )
        require(self.dp_size >= 1, "EmuContext.dp_size", self.dp_size, "must be >= 1")
        require(
            0 <= self.dp_rank < self.dp_size,
            "EmuContext.dp_rank",
            self.dp_rank,
            f"must be in [0, dp_size={self.dp_size})",
        )
        if self.dp_size > 1:
            require(
                self.dp_comm is not None,
                "EmuContext.dp_comm",
                None,
                f"is required when dp_size={self.dp_size} > 1",
            )
            assert self.dp_comm is not None
            require(
                self.dp_comm.size == self.dp_size,
                "EmuContext.dp_comm.size",
                self.dp_comm.size,
                f"must equal dp_size={self.dp_size}",
            )
            require(
                self.dp_comm.rank == self.dp_rank,
                "EmuContext.dp_comm.rank",
                self.dp_comm.rank,
                f"must equal dp_rank={self.dp_rank}",
            )

    # --- position ------------------------------------------------------------------

    @property
    def tp_rank(self) -> int:
        return self.parallel.tp_rank

    @property
    def tp_size(self) -> int:
        return self.parallel.tp_size

    @property
    def pp_rank(self) -> int:
        return self.parallel.pp_rank

    @property
    def pp_size(self) -> int:
        return self.parallel.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.parallel.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.parallel.is_last_stage

    @property
    def tp_comm(self) -> Communicator | None:
        return self.parallel.tp_comm

    # --- pipeline moves ------------------------------------------------------------

    def _pp(self) -> Communicator:
        assert self.pp_comm is not None, "pipeline move without a pipeline group"
        return self.pp_comm

    def send_next(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` to the next pipeline stage (same TP rank)."""
        self._pp().send(tensor.contiguous(), self.pp_rank + 1, self.timeout_s)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive a tensor of ``shape``/``dtype`` from the previous pipeline stage."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._pp().recv(out, self.pp_rank - 1, self.timeout_s)
        return out

    def send_prev(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (an activation gradient) to the previous pipeline stage."""
        self._pp().send(tensor.contiguous(), self.pp_rank - 1, self.timeout_s)

    def recv_next(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive a tensor of ``shape``/``dtype`` from the next pipeline stage."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._pp().recv(out, self.pp_rank + 1, self.timeout_s)
        return out

    def send_next_recv_next(
        self, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Send ``tensor`` to the next stage and receive one from it, as one batch (the
        1F1B steady state: an activation goes forward while a gradient comes back)."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        peer = self.pp_rank + 1
        self._pp().batch_p2p(
            [P2POp("send", tensor.contiguous(), peer), P2POp("recv", out, peer)], self.timeout_s
        )
        return out

    def send_prev_recv_prev(
        self, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Send ``tensor`` to the previous stage and receive one from it, as one batch."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        peer = self.pp_rank - 1
        self._pp().batch_p2p(
            [P2POp("send", tensor.contiguous(), peer), P2POp("recv", out, peer)], self.timeout_s
        )
        return out

    def broadcast_from_last(self, tensor: torch.Tensor) -> None:
        """Copy the last stage's ``tensor`` into ``tensor`` on every stage (in place)."""
        if self.pp_size > 1:
            self._pp().broadcast(tensor, self.pp_size - 1, self.timeout_s)

    def exchange_first_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """First and last stage swap ``tensor`` and each gets the sum (tied embedding
        gradients); returns ``tensor`` summed in place. Other stages must not call it."""
        peer = self.pp_size - 1 if self.is_first_stage else 0
        other = torch.empty_like(tensor)
        self._pp().batch_p2p(
            [P2POp("send", tensor.contiguous(), peer), P2POp("recv", other, peer)], self.timeout_s
        )
        # Add in a fixed order so both ends hold bit-identical sums.
        first, last = (tensor, other) if self.is_first_stage else (other, tensor)
        summed = first + last
        tensor.copy_(summed)
        return tensor

    def tp_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if self.tp_size > 1 and self.tp_comm is not None:
            self.tp_comm.all_reduce(tensor, op, self.timeout_s)  # type: ignore[arg-type]

    def pp_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if self.pp_size > 1:
            self._pp().all_reduce(tensor, op, self.timeout_s)  # type: ignore[arg-type]

    def dp_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if self.dp_size > 1 and self.dp_comm is not None:
            self.dp_comm.all_reduce(tensor, op, self.timeout_s)  # type: ignore[arg-type]

    def tp_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.tp_size > 1 and self.tp_comm is not None:
            self.tp_comm.broadcast(tensor, src, self.timeout_s)
