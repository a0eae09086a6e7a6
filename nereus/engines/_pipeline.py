"""Running a decoder stage over a batch inside an EMU: positions, heads, pipeline schedules.

Shared by the engines (generation has its own KV-cache loop for sampling).

- ``activation_bytes``: what one micro-batch's activations are reserved at;
  ``token_logprobs``: per-token log-probabilities from vocab-parallel logits.
- ``right_padded_positions``: positions of a right-padded batch (padding = -1).
- ``forward_only``: every micro-batch through the pipeline without autograd; the last
  stage applies a head and the per-token result reaches every stage (so every rank of an
  EMU returns the same tensor).
- ``forward_backward_1f1b``: the one-forward-one-backward schedule (as Megatron's
  non-interleaved pipeline): stage ``s`` runs ``pp - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains the backwards. An activation
  going forward and a gradient coming back travel as one batch of p2p ops, so no pair
  of stages can deadlock. A stage holds at most ``pp - s`` micro-batches' activations.
- ``forward_backward_gpipe``: the GPipe schedule -- all micro-batch forwards (activations
  sent stage to stage), then all backwards in reverse order -- holding every
  micro-batch's activations at once. Both evaluate the loss on the last stage.

Every rank of an EMU must call these with the same batch (same shapes): no shape header
travels between stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nereus.engines.context import EmuContext
from nereus.models.config import ModelConfig
from nereus.models.decoder import DecoderStage
from nereus.models.parallel import vocab_parallel_logprobs

__all__ = [
    "activation_bytes",
    "token_logprobs",
    "right_padded_positions",
    "Head",
    "forward_only",
    "forward_backward_gpipe",
    "forward_backward_1f1b",
    "in_flight_micro_batches",
]


def activation_bytes(
    config: ModelConfig,
    ctx: EmuContext,
    rows: int,
    length: int,
    dtype: torch.dtype,
    training: bool,
    recompute: bool = False,
) -> int:
    """An estimate of the activation bytes one micro-batch of ``rows x length`` needs on
    this rank: per local layer the residual stream, attention and MLP intermediates (kept
    for backward when training; with ``recompute`` only each layer's input is kept, and
    one layer's intermediates live at a time), plus float32 vocab-parallel logits on the
    last stage."""
    from nereus.models.parallel import stage_layer_range

    c = config
    elem = torch.empty((), dtype=dtype).element_size()
    layers = len(
        stage_layer_range(c.num_hidden_layers, ctx.pp_size, ctx.pp_rank, ctx.parallel.layer_cuts)
    )
    tokens = rows * length
    qkv = (c.q_size + 2 * c.kv_size) // ctx.tp_size
    per_layer = (
        tokens * (4 * c.hidden_size + 2 * qkv + 3 * c.intermediate_size // ctx.tp_size) * elem
    )
    per_layer += rows * (c.num_attention_heads // ctx.tp_size) * length * length * elem  # scores
    live_layers = layers if training and not recompute else 1
    total = per_layer * live_layers + 2 * tokens * c.hidden_size * elem
    if training and recompute:
        total += layers * tokens * c.hidden_size * elem  # the layer inputs kept for backward
    if ctx.is_last_stage:
        total += 3 * tokens * (c.vocab_size // ctx.tp_size) * 4
    return total


def token_logprobs(
    local_logits: torch.Tensor, input_ids: torch.Tensor, ctx: EmuContext, temperature: float
) -> torch.Tensor:
    """``[B, T]`` log-probabilities of ``input_ids`` from ``[B, T, V/tp]`` logits (first
    column 0), differentiable, replicated over TP."""
    lp = vocab_parallel_logprobs(local_logits[:, :-1], input_ids[:, 1:], ctx.parallel, temperature)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


# head(last-stage output, micro-batch) -> per-token [b, T] float32 tensor
Head = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def right_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``positions[b, t] = t`` on real tokens, ``-1`` on (right) padding."""
    t = attention_mask.shape[1]
    pos = (
        torch.arange(t, dtype=torch.long, device=attention_mask.device)
        .unsqueeze(0)
        .expand_as(attention_mask)
    )
    return torch.where(attention_mask.bool(), pos, torch.full_like(pos, -1))


def _stage_input(
    ctx: EmuContext, stage: DecoderStage, mb: dict[str, torch.Tensor], requires_grad: bool
) -> torch.Tensor:
    ids = mb["input_ids"]
    if ctx.is_first_stage:
        return ids
    shape = (ids.shape[0], ids.shape[1], stage.config.hidden_size)
    x = ctx.recv_prev(shape, stage.dtype)
    if requires_grad:
        x.requires_grad_(True)
    return x


def forward_only(
    stage: DecoderStage,
    ctx: EmuContext,
    micro_batches: list[dict[str, torch.Tensor]],
    head: Head,
    output: str = "logits",
) -> torch.Tensor:
    """Concatenated ``[B, T]`` head results over all micro-batches, on every rank.

    Stages do not wait for each other between micro-batches (one broadcast at the end),
    so stage ``s`` computes micro-batch ``i + 1`` while stage ``s + 1`` computes ``i``."""
    results: list[torch.Tensor] = []
    with torch.inference_mode():
        for mb in micro_batches:
            x = _stage_input(ctx, stage, mb, requires_grad=False)
            positions = right_padded_positions(mb["attention_mask"])
            out = stage(x, positions, output=output)
            if not ctx.is_last_stage:
                ctx.send_next(out)
            else:
                results.append(head(out, mb).float())
        rows = sum(mb["input_ids"].shape[0] for mb in micro_batches)
        length = micro_batches[0]["input_ids"].shape[1]
        result = (
            torch.cat(results, dim=0).contiguous()
            if results
            else torch.empty(rows, length, dtype=torch.float32, device=ctx.device)
        )
        ctx.broadcast_from_last(result)
    return result


def forward_backward_gpipe(
    stage: DecoderStage,
    ctx: EmuContext,
    micro_batches: list[dict[str, torch.Tensor]],
    loss_of: Callable[[torch.Tensor, dict[str, torch.Tensor], int], torch.Tensor],
    output: str = "logits",
) -> None:
    """Forward every micro-batch, then backward in reverse (GPipe).

    ``loss_of(last-stage output, micro-batch, index)`` runs on the last stage and returns
    the (already weighted) scalar loss of that micro-batch; gradients accumulate in the
    stage's parameters."""
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for i, mb in enumerate(micro_batches):
        x = _stage_input(ctx, stage, mb, requires_grad=True)
        positions = right_padded_positions(mb["attention_mask"])
        out = stage(x, positions, output=output)
        if ctx.is_last_stage:
            out = loss_of(out, mb, i)
        else:
            ctx.send_next(out.detach())
        inputs.append(x)
        outputs.append(out)
    for i in reversed(range(len(micro_batches))):
        out = outputs[i]
        if ctx.is_last_stage:
            out.backward()
        else:
            grad = ctx.recv_next(tuple(out.shape), out.dtype)
            out.backward(grad)
        if not ctx.is_first_stage:
            x = inputs[i]
            ctx.send_prev(x.grad if x.grad is not None else torch.zeros_like(x))
        # Free the graph of this micro-batch as soon as it is done.
        outputs[i] = inputs[i] = None  # type: ignore[call-overload]


def in_flight_micro_batches(ctx: EmuContext, count: int, schedule: str) -> int:
    """How many micro-batches' activations a stage holds at once under ``schedule``."""
    if schedule == "gpipe":
        return count
    return min(count, ctx.pp_size - ctx.pp_rank)


def forward_backward_1f1b(
    stage: DecoderStage,
    ctx: EmuContext,
    micro_batches: list[dict[str, torch.Tensor]],
    loss_of: Callable[[torch.Tensor, dict[str, torch.Tensor], int], torch.Tensor],
    output: str = "logits",
) -> None:
    """One forward, one backward (see the module docstring); same contract as
    ``forward_backward_gpipe``."""
    n = len(micro_batches)
    first, last = ctx.is_first_stage, ctx.is_last_stage
    hidden, dtype = stage.config.hidden_size, stage.dtype
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}

    def shape(i: int) -> tuple[int, int, int]:
        rows, length = micro_batches[i]["input_ids"].shape
        return (rows, length, hidden)

    def forward(i: int, x: torch.Tensor) -> torch.Tensor:
        mb = micro_batches[i]
        out = stage(x, right_padded_positions(mb["attention_mask"]), output=output)
        if last:
            out = loss_of(out, mb, i)
        inputs[i], outputs[i] = x, out
        return out

    def backward(i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        out, x = outputs.pop(i), inputs.pop(i)
        if last:
            out.backward()
        else:
            out.backward(grad)
        if first:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    def as_input(x: torch.Tensor) -> torch.Tensor:
        return x.requires_grad_(True)

    def first_input(i: int) -> torch.Tensor:
        if first:
            return micro_batches[i]["input_ids"]
        return as_input(ctx.recv_prev(shape(i), dtype))

    warmup = min(ctx.pp_size - ctx.pp_rank - 1, n)
    for i in range(warmup):
        out = forward(i, first_input(i))
        if not last:
            ctx.send_next(out.detach())
    fwd, bwd = warmup, 0
    x = first_input(fwd) if fwd < n else None
    while fwd < n:
        assert x is not None
        out = forward(fwd, x)
        grad = None if last else ctx.send_next_recv_next(out.detach(), shape(bwd), dtype)
        dx = backward(bwd, grad)
        fwd, bwd = fwd + 1, bwd + 1
        if fwd < n:
            if first:
                x = micro_batches[fwd]["input_ids"]
            else:
                assert dx is not None
                x = as_input(ctx.send_prev_recv_prev(dx, shape(fwd), dtype))
        elif dx is not None:
            ctx.send_prev(dx)
    while bwd < n:
        grad = None if last else ctx.recv_next(shape(bwd), dtype)
        dx = backward(bwd, grad)
        if dx is not None:
            ctx.send_prev(dx)
        bwd += 1
