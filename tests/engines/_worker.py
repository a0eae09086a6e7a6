"""One rank of a TP x PP (x DP) EMU for the multi-process engine tests.

Started by tests/engines/test_emu_grid.py as ``python -m tests.engines._worker ...``
(never multiprocessing). It joins its TP, PP and DP groups through the data plane's
low-level CPU communicator (gloo + shared memory, rendezvous at the test's TCP store),
builds the three engines at its position from the same Hugging Face checkpoint, runs
the same requests as the in-process TP=1/PP=1 reference in the test, and writes what it
got to ``OUT/rank{R}.safetensors`` (no pickle):

- greedy generation (tokens, logprobs) and seeded sampled generation (tokens);
- a stepped request whose done slots are refilled (``tests.engines._refill``);
- inference log-probabilities of a fixed batch;
- its parameter shards after one training step (micro-batches + accumulation; with PP
  under both the 1F1B and the GPipe schedule), or, with DP, after a step on its half of
  the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

from nereus.engines import (
    EmuContext,
    GenerationEngine,
    InferenceEngine,
    SamplingParams,
    TrainingEngine,
)
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.models import ModelConfig, ParallelContext
from tests.engines._refill import refilled_run


def make_comm(group_id: str, rank: int, size: int, host: str, port: int):
    from nereus.transfer.cpu import CpuCommunicator

    return CpuCommunicator(group_id, rank, size, store_host=host, store_port=port, timeout_s=60.0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--rank", type=int, required=True)  # dp-major, then pp, then tp
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--params", required=True)  # JSON: sampling + training settings
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    settings = json.loads(args.params)
    tp, pp, dp = args.tp, args.pp, args.dp
    dp_rank, rest = divmod(args.rank, tp * pp)
    pp_rank, tp_rank = divmod(rest, tp)
    host = "127.0.0.1"
    tp_comm = (
        make_comm(f"tp-d{dp_rank}-p{pp_rank}", tp_rank, tp, host, args.port) if tp > 1 else None
    )
    pp_comm = (
        make_comm(f"pp-d{dp_rank}-t{tp_rank}", pp_rank, pp, host, args.port) if pp > 1 else None
    )
    dp_comm = (
        make_comm(f"dp-p{pp_rank}-t{tp_rank}", dp_rank, dp, host, args.port) if dp > 1 else None
    )
    pc = ParallelContext(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, tp_comm=tp_comm)
    ctx = EmuContext(
        pc, pp_comm=pp_comm, dp_rank=dp_rank, dp_size=dp, dp_comm=dp_comm, timeout_s=60.0
    )
    config = ModelConfig.from_hf(args.model_dir)
    inputs = load_file(args.inputs)
    prompts = [row[row >= 0].tolist() for row in inputs["prompts"]]
    ledger = MemoryLedger(f"test-{args.rank}", None)
    out: dict[str, torch.Tensor] = {}

    if dp == 1:
        gen = GenerationEngine(
            config, ctx, options=EngineOptions(model_dir=args.model_dir, ledger=ledger)
        )
        greedy = gen.generate(prompts, SamplingParams(**settings["greedy"]))
        sampled = gen.generate(prompts, SamplingParams(**settings["sampled"]))
        for i, (toks, lps) in enumerate(zip(greedy.token_ids, greedy.logprobs, strict=True)):
            out[f"greedy.tokens.{i}"] = torch.tensor(toks, dtype=torch.long)
            out[f"greedy.logprobs.{i}"] = torch.tensor(lps, dtype=torch.float32)
        for i, toks in enumerate(sampled.token_ids):
            out[f"sampled.tokens.{i}"] = torch.tensor(toks, dtype=torch.long)
        for i, (toks, lps) in enumerate(refilled_run(gen, prompts, seed=11)):
            out[f"refill.tokens.{i}"] = torch.tensor(toks, dtype=torch.long)
            out[f"refill.logprobs.{i}"] = torch.tensor(lps, dtype=torch.float32)
        gen.close()
        inf = InferenceEngine(
            config,
            ctx,
            options=EngineOptions(model_dir=args.model_dir, ledger=ledger),
            micro_batch_size=3,
        )
        out["inference.logprobs"] = inf.logprobs(
            {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        )
        inf.close()

    rows = inputs["input_ids"].shape[0]
    share = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)
    batch = {
        "input_ids": inputs["input_ids"][share],
        "attention_mask": inputs["attention_mask"][share],
    }
    train = TrainingEngine(
        config,
        ctx,
        options=EngineOptions(model_dir=args.model_dir, ledger=ledger),
        optim=settings["optim"],
    )
    metrics = train.train_step(batch, micro_batch_size=settings["micro_batch_size"])
    for name, tensor in train.named_state().items():
        out[f"state.{name}"] = tensor.contiguous()
    if pp > 1:  # the other pipeline schedule must land on the same parameters
        gpipe = TrainingEngine(
            config,
            ctx,
            options=EngineOptions(model_dir=args.model_dir, ledger=ledger, name="training-gpipe"),
            optim=settings["optim"],
            schedule="gpipe",
        )
        gpipe.train_step(batch, micro_batch_size=settings["micro_batch_size"])
        for name, tensor in gpipe.named_state().items():
            out[f"gpipe.{name}"] = tensor.contiguous()
    out["train.grad_norm"] = torch.tensor([metrics["grad_norm"]], dtype=torch.float64)
    if "loss" in metrics:
        out["train.loss"] = torch.tensor([metrics["loss"]], dtype=torch.float64)
    save_file(
        {k: v.contiguous() for k, v in out.items()},
        os.path.join(args.out, f"rank{args.rank}.safetensors"),
    )
    for comm in (tp_comm, pp_comm, dp_comm):
        if comm is not None:
            comm.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
