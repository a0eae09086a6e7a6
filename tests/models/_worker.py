"""One (pp_rank, tp_rank) worker of the multi-process TP x PP model tests.

Started by tests/models/test_tp_pp.py as ``python -m tests.models._worker ...``; its
communicators are ``nereus.transfer.CpuCommunicator`` (gloo + shared memory). For each
model directory it builds its pipeline stage at its TP rank, loads its slices of the
checkpoint, and runs the same three things as the in-process TP=1/PP=1 reference:

1. a full forward (hidden states passed between stages over gloo p2p), then the
   vocab-parallel logprobs and entropy of the targets, the full (gathered) logits;
2. a backward of a PPO-like loss through the pipeline (input gradients passed back),
   then ``reduce_replicated_grads``; every local gradient is saved;
3. a KV-cached prefill plus one-token decode steps (ragged rows, padding = position -1),
   whose gathered logits must equal the full forward's.

Results go to ``OUT/rank{R}.safetensors`` (no pickle); the test compares them with the
reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

from nereus.models import (
    ParallelContext,
    build_stage,
    gather_vocab,
    load_stage_weights,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from nereus.transfer import CpuCommunicator


def loss_of(local_logits, targets, positions, pc):
    """The scalar both the workers and the reference differentiate."""
    mask = (positions >= 0).float()
    lp = vocab_parallel_logprobs(local_logits, targets, pc)
    ent = vocab_parallel_entropy(local_logits, pc)
    loss = -(lp * mask).sum() / mask.sum() - 0.5 * (ent * mask).sum() / mask.sum()
    return loss, lp, ent


def _stage_input(stage, ids, positions, world, prev, hidden_size, requires_grad):
    if stage.pc.is_first_stage:
        return ids
    h = torch.empty(*positions.shape, hidden_size, dtype=stage.dtype)
    world.recv(h, prev)
    return h.requires_grad_(requires_grad)


def run_model(model_dir, inputs, pc, world, rank, tp, out):
    stage = build_stage(_config(model_dir), pc)
    load_stage_weights(stage, model_dir)
    hidden = stage.config.hidden_size
    prev, nxt = rank - tp, rank + tp
    ids, positions, targets = inputs["ids"], inputs["positions"], inputs["targets"]
    prefill = int(inputs["prefill"].item())
    tag = os.path.basename(model_dir)

    # 1 + 2: full forward and backward through the pipeline.
    x = _stage_input(stage, ids, positions, world, prev, hidden, requires_grad=True)
    y = stage(x, positions)
    if pc.is_last_stage:
        loss, lp, ent = loss_of(y, targets, positions, pc)
        out[f"{tag}.logprobs"] = lp.detach()
        out[f"{tag}.entropy"] = ent.detach()
        out[f"{tag}.loss"] = loss.detach().reshape(1)
        out[f"{tag}.logits"] = gather_vocab(y.detach(), pc)
        loss.backward()
    else:
        world.send(y.detach(), nxt)
        grad = torch.empty_like(y)
        world.recv(grad, nxt)
        y.backward(grad)
    if not pc.is_first_stage:
        world.send(x.grad, prev)
    stage.reduce_replicated_grads()
    for name, p in stage.named_parameters():
        out[f"{tag}.grad.{name}"] = p.grad.detach().clone()

    # 3: KV-cached prefill and decode.
    with torch.no_grad():
        cache = stage.new_kv_cache(ids.shape[0], max_len=32)
        steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]
        pieces = []
        for a, b in steps:
            x = _stage_input(
                stage, ids[:, a:b], positions[:, a:b], world, prev, hidden, requires_grad=False
            )
            y = stage(x, positions[:, a:b], kv_cache=cache)
            if pc.is_last_stage:
                pieces.append(gather_vocab(y, pc))
            else:
                world.send(y, nxt)
        if pc.is_last_stage:
            out[f"{tag}.cached_logits"] = torch.cat(pieces, dim=1)


def _config(model_dir):
    from nereus.models import ModelConfig

    return ModelConfig.from_hf(model_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    world_size = args.tp * args.pp
    pp_rank, tp_rank = divmod(args.rank, args.tp)
    # Hidden states between stages travel over the world group (shared memory between
    # these same-host processes); TP collectives over one gloo group per pipeline stage.
    world = CpuCommunicator(
        "world", args.rank, world_size, "127.0.0.1", args.port, slot_bytes=1 << 20, slots=2
    )
    tp_comm = (
        CpuCommunicator(f"tp{pp_rank}", tp_rank, args.tp, "127.0.0.1", args.port, use_shm=False)
        if args.tp > 1
        else None
    )
    pc = ParallelContext(
        tp_rank=tp_rank, tp_size=args.tp, pp_rank=pp_rank, pp_size=args.pp, tp_comm=tp_comm
    )
    inputs = load_file(args.inputs)
    out: dict[str, torch.Tensor] = {}
    for model_dir in args.models:
        run_model(model_dir, inputs, pc, world, args.rank, args.tp, out)
    save_file(
        {k: v.contiguous() for k, v in out.items()},
        os.path.join(args.out, f"rank{args.rank}.safetensors"),
    )
    world.barrier()
    for comm in (tp_comm, world):
        if comm is not None:
            comm.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
