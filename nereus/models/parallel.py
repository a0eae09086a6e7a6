"""Where one rank sits in a model's TP x PP layout, and the differentiable collectives
that tensor-parallel layers are made of.

``ParallelContext`` says which TP and PP rank this process is, holds the TP group's
``Communicator`` (none is needed at ``tp_size == 1``) and the layer cut points of the
pipeline. The collectives are autograd Functions around that communicator, in the
Megatron convention: every tensor outside the TP-split region is *replicated* (each TP
rank holds the same values and computes the same loss), so

- ``copy_to_tp``: identity forward, all-reduce of the gradient backward (the input of a
  column-parallel layer: each rank's gradient is a partial sum);
- ``reduce_from_tp``: all-reduce forward, identity backward (the output of a row-parallel
  layer);
- ``gather_from_tp``: all-gather along the last dim forward, this rank's chunk backward.

Vocab-parallel helpers (``vocab_parallel_logprobs``, ``vocab_parallel_entropy``,
``gather_vocab``) work on logits split along the vocabulary and reduce with the
communicator's all_reduce of max and sum-exp, so engines never need full logits.

Refuses (``ConfigError``): ranks outside their sizes, ``tp_size > 1`` without a
communicator (or one whose size/rank disagree), layer cuts that are not increasing.
Never implements a collective itself: every reduction or gather is the communicator's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nereus.config import require
from nereus.transfer.communicator import Communicator

__all__ = [
    "ParallelContext",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "gather_vocab",
    "vocab_parallel_logprobs",
    "vocab_parallel_entropy",
    "stage_layer_range",
]


@dataclass(frozen=True)
class ParallelContext:
    """One rank's position: TP rank/size (+ communicator), PP rank/size, layer cuts.

    ``layer_cuts`` (optional) lists the first layer of every pipeline stage after the
    first, e.g. ``(10,)`` for two stages of a 24-layer model holding layers 0-9 and 10-23;
    by default layers are cut as evenly as possible with earlier stages taking the extra
    layer. ``tp_comm`` is the TP group's communicator (rank == ``tp_rank``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_comm: Communicator | None = None
    layer_cuts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        require(self.tp_size >= 1, "ParallelContext.tp_size", self.tp_size, "must be >= 1")
        require(self.pp_size >= 1, "ParallelContext.pp_size", self.pp_size, "must be >= 1")
        require(
            0 <= self.tp_rank < self.tp_size,
            "ParallelContext.tp_rank",
            self.tp_rank,
            f"must be in [0, tp_size={self.tp_size})",
        )
        require(
            0 <= self.pp_rank < self.pp_size,
            "ParallelContext.pp_rank",
            self.pp_rank,
            f"must be in [0, pp_size={self.pp_size})",
        )
        if self.tp_size > 1:
            require(
                self.tp_comm is not None,
                "ParallelContext.tp_comm",
                None,
                f"is required when tp_size={self.tp_size} > 1",
            )
            assert self.tp_comm is not None
            require(
                self.tp_comm.size == self.tp_size,
                "ParallelContext.tp_comm.size",
                self.tp_comm.size,
                f"must equal tp_size={self.tp_size}",
            )
            require(
                self.tp_comm.rank == self.tp_rank,
                "ParallelContext.tp_comm.rank",
                self.tp_comm.rank,
                f"must equal tp_rank={self.tp_rank}",
            )
        if self.layer_cuts is not None:
            cuts = tuple(self.layer_cuts)
            object.__setattr__(self, "layer_cuts", cuts)
            require(
                len(cuts) == self.pp_size - 1,
                "ParallelContext.layer_cuts",
                cuts,
                f"must list pp_size-1={self.pp_size - 1} cut points",
            )
            require(
                all(b > a for a, b in zip((0, *cuts), cuts, strict=False)),
                "ParallelContext.layer_cuts",
                cuts,
                "must be strictly increasing and > 0",
            )

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """The global indices of the decoder layers this pipeline stage holds."""
        return stage_layer_range(num_layers, self.pp_size, self.pp_rank, self.layer_cuts)


def stage_layer_range(
    num_layers: int, pp_size: int, pp_rank: int, layer_cuts: Sequence[int] | None = None
) -> range:
    """Layers of stage ``pp_rank`` when ``num_layers`` are cut into ``pp_size`` stages."""
    require(
        pp_size <= num_layers,
        "pp_size",
        pp_size,
        f"must be <= num_hidden_layers={num_layers} (every stage needs a layer)",
    )
    if layer_cuts is None:
        base, extra = divmod(num_layers, pp_size)
        bounds = [0]
        for s in range(pp_size):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    else:
        bounds = [0, *layer_cuts, num_layers]
        require(
            bounds[-2] < num_layers,
            "layer_cuts",
            tuple(layer_cuts),
            f"must all be < num_hidden_layers={num_layers}",
        )
    return range(bounds[pp_rank], bounds[pp_rank + 1])


# --- differentiable collectives ------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, "sum")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, op: str) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, op)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        ctx.local = x.shape[-1]
        x = x.contiguous()
        out = x.new_empty((comm.size, *x.shape))
        comm.all_gather(out, x)
        # [size, ..., local] -> [..., size * local], rank-major along the last dim.
        return torch.movedim(out, 0, -2).reshape(*x.shape[:-1], comm.size * ctx.local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.comm.rank * ctx.local
        return grad[..., start : start + ctx.local].contiguous(), None


def copy_to_tp(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """Identity forward; gradient all-reduced over TP backward."""
    if pc.tp_size == 1:
        return x
    return _CopyToTP.apply(x, pc.tp_comm)


def reduce_from_tp(x: torch.Tensor, pc: ParallelContext, op: str = "sum") -> torch.Tensor:
    """All-reduce over TP forward; identity backward (the result is replicated)."""
    if pc.tp_size == 1:
        return x
    return _ReduceFromTP.apply(x, pc.tp_comm, op)


def gather_from_tp(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along the last dim (rank order)."""
    if pc.tp_size == 1:
        return x
    return _GatherFromTP.apply(x, pc.tp_comm)


# --- vocab-parallel logits -----------------------------------------------------------


def gather_vocab(local_logits: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """Full logits ``[..., vocab]`` from this rank's ``[..., vocab / tp]`` slice."""
    return gather_from_tp(local_logits, pc)


def _logsumexp(
    local_logits: torch.Tensor, pc: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (max, logsumexp) over the split vocabulary, both ``[...]``; differentiable
    in the logits (the max is a constant shift and carries no gradient)."""
    logits = local_logits.float()
    local_max = logits.detach().amax(dim=-1)
    global_max = reduce_from_tp(local_max, pc, "max")
    sum_exp = torch.exp(logits - global_max.unsqueeze(-1)).sum(dim=-1)
    sum_exp = reduce_from_tp(sum_exp, pc, "sum")
    return global_max, global_max + torch.log(sum_exp)


def vocab_parallel_logprobs(
    local_logits: torch.Tensor, targets: torch.Tensor, pc: ParallelContext, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` for every position, in float32.

    ``local_logits`` is ``[..., vocab / tp]`` (this rank holds vocabulary rows
    ``[tp_rank * V/tp, (tp_rank + 1) * V/tp)``), ``targets`` is ``[...]`` of global token
    ids. The result is replicated on every TP rank and differentiable. A target outside
    ``[0, V)`` (an ignore index such as -100) gives ``-logsumexp``: mask it out."""
    logits = local_logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    _, lse = _logsumexp(logits, pc)
    vocab_local = logits.shape[-1]
    start = pc.tp_rank * vocab_local
    local_ids = targets.long() - start
    is_local = (local_ids >= 0) & (local_ids < vocab_local)
    picked = torch.gather(logits, -1, local_ids.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tp(torch.where(is_local, picked, torch.zeros_like(picked)), pc, "sum")
    return picked - lse


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy with an explicit backward: ``dH/dz_j = -p_j (z_j - E_p[z])``.

    Autograd through the pieces would be wrong at TP > 1: the global logsumexp feeds each
    rank's local probabilities, so its gradient would be only a partial sum. The formula
    needs only local probabilities and the (replicated) expectation."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
        top, lse = _logsumexp(logits, pc)
        # Shifted by the max, both terms stay small: no cancellation of large values.
        shifted = logits - top.unsqueeze(-1)
        lse_shifted = lse - top
        probs = torch.exp(shifted - lse_shifted.unsqueeze(-1))
        expected = reduce_from_tp((probs * shifted).sum(dim=-1), pc, "sum")
        ctx.save_for_backward(probs, shifted, expected)
        return lse_shifted - expected

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, shifted, expected = ctx.saved_tensors
        return -grad.unsqueeze(-1) * probs * (shifted - expected.unsqueeze(-1)), None


def vocab_parallel_entropy(local_logits: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position (float32, replicated, differentiable)."""
    return _VocabParallelEntropy.apply(local_logits.float(), pc)
