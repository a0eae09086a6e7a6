"""End-to-end GRPO: nereus against TRL's GRPOTrainer, same configuration, same machine.

    python -m benchmarks.e2e_trl [--steps 4] [--warmup 1] [--cores 2] [--hidden 256 --layers 4
    --intermediate 768]

Both sides run the same GRPO step: a Llama-style decoder (by default 3.4M parameters:
hidden 256, 4 layers, 4 heads, SwiGLU 768), the shipped reverse task with its character vocabulary,
8 prompts x 8 samples x 128 new tokens (EOS ignored, so every step does the same work),
AdamW (lr 1e-3, betas 0.9/0.99, no weight decay, clip 1.0), one optimizer step per
generation, clip epsilon 0.2, no reference model (KL coefficient 0), float32.

Each side runs in its own process and gets the same ``--cores`` CPU cores:
- nereus: an embedded local cluster of ``--cores`` devices (one worker process each, one
  torch thread each); policy-generation and policy-training both DP ``--cores`` on them
  (co-resident), micro-batches of 8 rows per worker (cache-friendly on CPU: about 10%
  less CPU per training step than 64), weight sync through the state layer's plans every step;
- TRL 1.16: one process at its fastest on CPU: run with ``--cores`` threads and with 1
  thread (on a busy machine extra intra-op threads can make small ops much slower) and
  keep the faster; float32, gradient checkpointing off, no gradient accumulation so old logprobs
  are not recomputed, plain ``generate`` with its KV cache; ``min_new_tokens`` = 128.

A warm-up step first, then ``--steps`` measured steps; per side the median step time,
its spread (min-max), the median generation time and generated tokens per second.
A third process measures the floor: training is the step's FLOPs (linear layers and
causal attention, 3x forward) over this machine's best single-core float32 matmul rate
(measured for the step's shapes) times the cores; generation is the larger of its FLOPs
(prefill + one forward per new token) at that rate and its memory traffic (every decode
step reads the weights and each row's cached keys and values once) at one core's best
streaming read rate, per core. ``max_speedup`` = TRL's step / that floor: what no
implementation on these cores, at this precision, can beat. The same process also times
one core's share of the training phase (its rows, the same micro-batches, AdamW) in plain
PyTorch (transformers' Llama, forward + backward, no framework around it):
``plain_torch_train_s``, the reference the training phase is up against in practice.

The last line is one JSON object: nereus_step_s, trl_step_s, speedup, nereus_gen_tok_s,
trl_gen_tok_s, floor_step_s, max_speedup (plus spreads, the floor's parts, plain_torch_train_s and
the thread counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 4,
    "max_seq_len": 256,
}
TASK = {"name": "reverse", "options": {}}


def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": {
            **MODEL,
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "intermediate_size": args.intermediate,
        },
        "cores": args.cores,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "seed": 0,
        "prompts_per_step": 8,
        "samples_per_prompt": 8,
        "max_new_tokens": 128,
        "lr": 1e-3,
        "betas": [0.9, 0.99],
        "grad_clip": 1.0,
        "clip_eps": 0.2,
    }


# --------------------------------------------------------------------------- nereus


def run_nereus(b: dict[str, Any]) -> dict[str, Any]:
    import asyncio

    import torch

    torch.set_num_threads(1)
    from nereus.config import from_dict
    from nereus.job.config import JobConfig
    from nereus.job.loop import RLJob

    devices = list(range(b["cores"]))
    with tempfile.TemporaryDirectory() as out:
        cfg = from_dict(
            JobConfig,
            {
                "model": b["model"],
                "task": TASK,
                "algorithm": {
                    "name": "grpo",
                    "prompts_per_step": b["prompts_per_step"],
                    "samples_per_prompt": b["samples_per_prompt"],
                    "clip_eps": b["clip_eps"],
                },
                "sampling": {"max_new_tokens": b["max_new_tokens"], "ignore_eos": True},
                "optim": {
                    "lr": b["lr"],
                    "beta1": b["betas"][0],
                    "beta2": b["betas"][1],
                    "grad_clip": b["grad_clip"],
                    "micro_batch_size": 8,
                },
                "cluster": {"mode": "local", "devices": b["cores"], "memory_per_device": "4GiB"},
                "plan": {
                    "policy_generation": {"devices": devices, "dp": len(devices)},
                    "policy_training": {"devices": devices, "dp": len(devices)},
                },
                "run": {
                    "steps": b["warmup_steps"] + b["steps"],
                    "seed": b["seed"],
                    "out_dir": out,
                    "progress": False,
                },
            },
        )

        async def main() -> list[dict[str, Any]]:
            job = RLJob(cfg)
            await job.start()
            try:
                return [await job.run_step() for _ in range(cfg.run.steps)]
            finally:
                await job.close()

        records = asyncio.run(main())[b["warmup_steps"] :]
    return {
        "step_s": [r["step_seconds"] for r in records],
        "gen_s": [r["generate_seconds"] for r in records],
        "gen_tokens": [r["tokens_generated"] for r in records],
        "train_s": [r["train_seconds"] for r in records],
        "sync_s": [r["sync_seconds"] for r in records],
        "reward": [r["reward_mean"] for r in records],
        "threads": f"{b['cores']} worker processes x 1 thread",
    }


# --------------------------------------------------------------------------- TRL


def run_trl(b: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(b["threads"])
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nereus.data.tasks import make_task
    from nereus.data.vocab import Codec

    task = make_task(TASK["name"], **TASK["options"])
    codec = Codec.for_alphabet(task.alphabet)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=codec.tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    torch.manual_seed(b["seed"])
    m = b["model"]
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=codec.vocab_size,
            hidden_size=m["hidden_size"],
            intermediate_size=m["intermediate_size"],
            num_hidden_layers=m["num_layers"],
            num_attention_heads=m["num_heads"],
            num_key_value_heads=m["num_kv_heads"],
            max_position_embeddings=m["max_seq_len"],
            tie_word_embeddings=False,
            bos_token_id=codec.bos_id,
            eos_token_id=codec.eos_id,
            pad_token_id=codec.pad_id,
        )
    ).float()
    steps = b["warmup_steps"] + b["steps"]
    samples = [task.sample(i, b["seed"]) for i in range(b["prompts_per_step"] * steps)]
    by_prompt = {"<bos>" + s.prompt: s for s in samples}
    data = Dataset.from_list([{"prompt": "<bos>" + s.prompt} for s in samples])

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [
            task.reward(by_prompt[p], c.split("<eos>")[0])
            for p, c in zip(prompts, completions, strict=True)
        ]

    gen_s: list[float] = []
    gen_tokens: list[int] = []
    original = model.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        gen_s.append(time.perf_counter() - t0)
        prompt_len = (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[1]
        gen_tokens.append(int(out.shape[0] * (out.shape[1] - prompt_len)))
        return out

    model.generate = timed_generate  # type: ignore[method-assign]
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - TRL's signature
            step_ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=b["prompts_per_step"] * b["samples_per_prompt"],
            gradient_accumulation_steps=1,
            num_generations=b["samples_per_prompt"],
            max_completion_length=b["max_new_tokens"],
            generation_kwargs={"min_new_tokens": b["max_new_tokens"]},
            learning_rate=b["lr"],
            adam_beta1=b["betas"][0],
            adam_beta2=b["betas"][1],
            weight_decay=0.0,
            max_grad_norm=b["grad_clip"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            beta=0.0,
            epsilon=b["clip_eps"],
            temperature=1.0,
            gradient_checkpointing=False,
            bf16=False,
            fp16=False,
            use_cpu=True,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=b["seed"],
            shuffle_dataset=False,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=data,
            processing_class=tok,
            callbacks=[StepClock()],
        )
        t_start = time.perf_counter()
        trainer.train()
    ends = [t_start, *step_ends]
    warm = b["warmup_steps"]
    return {
        "step_s": [y - x for x, y in zip(ends[:-1], ends[1:], strict=True)][warm:],
        "gen_s": gen_s[warm:],
        "gen_tokens": gen_tokens[warm:],
        "reward": [h["reward"] for h in trainer.state.log_history if "reward" in h][warm:],
        "params": sum(p.numel() for p in model.parameters()),
        "threads": f"1 process x {torch.get_num_threads()} threads",
    }


# --------------------------------------------------------------------------- compute floor


def step_flops(b: dict[str, Any], prompt_len: float, vocab: int) -> dict[str, float]:
    """FLOPs of one GRPO step of this configuration, any implementation: the linear layers
    (2 per multiply-add) and causal attention, forward + backward (3x forward) over every
    row for training, prompt forward plus one forward per new token for generation."""
    m = b["model"]
    h, inter, layers = m["hidden_size"], m["intermediate_size"], m["num_layers"]
    kv = h * m["num_kv_heads"] // m["num_heads"]
    linear = (
        layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + h * vocab
    )  # weights touched per token
    rows = b["prompts_per_step"] * b["samples_per_prompt"]
    new = b["max_new_tokens"]
    length = prompt_len + new

    def attention(ctx: float) -> float:  # QK^T and AV for one token over ``ctx`` keys
        return 4.0 * ctx * h * layers

    train = 3.0 * rows * length * (2.0 * linear + attention((length + 1) / 2))
    prefill = rows * prompt_len * (2.0 * linear + attention((prompt_len + 1) / 2))
    decode = rows * sum(2.0 * linear + attention(prompt_len + t) for t in range(1, new + 1))
    # bytes one core reads over the decode steps: all weights (float32) once a step, and the
    # cached k and v of each of its rows at every context length
    per_core = rows / b["cores"]
    kv_read = sum(2.0 * layers * per_core * (prompt_len + t) * kv * 4 for t in range(1, new + 1))
    return {
        "train": train,
        "generate": prefill + decode,
        "decode_bytes_per_core": new * 4.0 * linear + kv_read,
    }


def run_floor(b: dict[str, Any]) -> dict[str, Any]:
    """This machine's best float32 matmul rate on one core for the step's shapes."""
    import torch

    torch.set_num_threads(1)
    from nereus.data.tasks import make_task
    from nereus.data.vocab import Codec

    task = make_task(TASK["name"], **TASK["options"])
    codec = Codec.for_alphabet(task.alphabet)
    prompt_len = statistics.fmean(
        len(codec.encode(task.sample(i, b["seed"]).prompt)) for i in range(256)
    )
    m = b["model"]
    h, inter = m["hidden_size"], m["intermediate_size"]

    def rate(rows: int) -> float:
        best = 0.0
        for k, n in ((h, 3 * h), (h, 2 * inter), (inter, h)):
            x, w = torch.randn(rows, k), torch.randn(k, n)
            for _ in range(3):
                x @ w
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(5):
                    x @ w
                best = max(best, 2.0 * rows * k * n * 5 / (time.perf_counter() - t0))
        return best

    def read_rate() -> float:  # one core streaming through memory far larger than the caches
        big = torch.ones(64 << 20)
        best = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            big.sum()
            best = max(best, big.numel() * 4 / (time.perf_counter() - t0))
        return best

    length = int(prompt_len + b["max_new_tokens"])
    rows_per_core = b["prompts_per_step"] * b["samples_per_prompt"] // b["cores"]
    return {
        "prompt_len": prompt_len,
        "vocab": codec.vocab_size,
        "train_flops_s": rate(8 * length),  # a micro-batch of 8 rows
        "decode_flops_s": rate(rows_per_core),  # one decode step of a core's rows
        "read_bytes_s": read_rate(),
        "plain_torch_train_s": plain_torch_train(b, codec.vocab_size, rows_per_core, length),
    }


def plain_torch_train(b: dict[str, Any], vocab: int, rows: int, length: int) -> float:
    """Median seconds of one core's training phase in plain PyTorch: ``rows`` rows of
    ``length`` tokens in micro-batches of 8, token log-probabilities, backward, clipping, AdamW."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = b["model"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=m["hidden_size"],
            intermediate_size=m["intermediate_size"],
            num_hidden_layers=m["num_layers"],
            num_attention_heads=m["num_heads"],
            num_key_value_heads=m["num_kv_heads"],
            max_position_embeddings=m["max_seq_len"],
            tie_word_embeddings=False,
        )
    ).float()
    opt = torch.optim.AdamW(
        model.parameters(), lr=b["lr"], betas=tuple(b["betas"]), weight_decay=0.0
    )
    ids = torch.randint(0, vocab, (rows, length))

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        for mb in ids.split(8):
            logits = model(mb).logits[:, :-1]
            logprobs = torch.log_softmax(logits, -1).gather(-1, mb[:, 1:, None]).squeeze(-1)
            (-logprobs.mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), b["grad_clip"])
        opt.step()
        return time.perf_counter() - t0

    step()
    return statistics.median(step() for _ in range(3))


def floor_summary(b: dict[str, Any], floor: dict[str, Any]) -> dict[str, float]:
    """The step time of an implementation whose every FLOP runs at the best single-core
    matmul rate on each of the side's cores, with no other cost."""
    flops = step_flops(b, floor["prompt_len"], floor["vocab"])
    cores = b["cores"]
    train_s = flops["train"] / (cores * floor["train_flops_s"])
    gen_compute_s = flops["generate"] / (cores * floor["decode_flops_s"])
    gen_memory_s = flops["decode_bytes_per_core"] / floor["read_bytes_s"]
    gen_s = max(gen_compute_s, gen_memory_s)
    return {
        "train_gflop": flops["train"] / 1e9,
        "gen_gflop": flops["generate"] / 1e9,
        "gen_gb_per_core": flops["decode_bytes_per_core"] / 1e9,
        "read_gb_s": floor["read_bytes_s"] / 1e9,
        "floor_train_s": train_s,
        "floor_gen_compute_s": gen_compute_s,
        "floor_gen_memory_s": gen_memory_s,
        "floor_gen_s": gen_s,
        "floor_step_s": train_s + gen_s,
        "plain_torch_train_s": floor["plain_torch_train_s"],
    }


# --------------------------------------------------------------------------- driver


def _side(name: str, b: dict[str, Any]) -> dict[str, Any]:
    """Run one side in a fresh process pinned to the first ``cores`` CPUs."""
    env = dict(os.environ, OMP_NUM_THREADS=str(b.get("threads", 1)))
    cmd = [sys.executable, "-m", "benchmarks.e2e_trl", "--side", name, "--config", json.dumps(b)]
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) > b["cores"]:
        cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: b["cores"]])
        cmd = ["taskset", "-c", cpus, *cmd]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{name} side failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(res: dict[str, Any]) -> dict[str, float]:
    step = res["step_s"]
    gen_rate = [t / s for t, s in zip(res["gen_tokens"], res["gen_s"], strict=True)]
    return {
        "step_s": statistics.median(step),
        "step_min_s": min(step),
        "step_max_s": max(step),
        "gen_s": statistics.median(res["gen_s"]),
        "gen_tok_s": statistics.median(gen_rate),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.e2e_trl", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--steps", type=int, default=4, help="measured steps per side")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per side (not measured)")
    p.add_argument("--cores", type=int, default=2, help="CPU cores given to each side")
    p.add_argument("--hidden", type=int, default=MODEL["hidden_size"], help="model hidden size")
    p.add_argument("--layers", type=int, default=MODEL["num_layers"], help="decoder layers")
    p.add_argument(
        "--intermediate", type=int, default=MODEL["intermediate_size"], help="SwiGLU width"
    )
    p.add_argument("--side", choices=["nereus", "trl", "floor"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side:
        b = json.loads(args.config)
        run = {"nereus": run_nereus, "trl": run_trl, "floor": run_floor}[args.side]
        print(json.dumps(run(b)))
        return 0
    b = bench_config(args)
    print(
        f"GRPO end to end: decoder hidden {args.hidden} x {args.layers} layers (SwiGLU "
        f"{args.intermediate}), {b['prompts_per_step']} prompts x {b['samples_per_prompt']} "
        "samples x "
        f"{b['max_new_tokens']} new tokens, {args.warmup} warm-up + {args.steps} measured "
        f"steps, {args.cores} cores per side"
    )
    results = {"nereus": _side("nereus", b)}
    trl_runs = [_side("trl", {**b, "threads": t}) for t in sorted({args.cores, 1}, reverse=True)]
    for run in trl_runs:
        print(f"   trl with {run['threads']}: median step {statistics.median(run['step_s']):.2f} s")
    results["trl"] = min(trl_runs, key=lambda r: statistics.median(r["step_s"]))
    floor = floor_summary(b, _side("floor", b))
    sums = {k: _summary(v) for k, v in results.items()}
    for name, s in sums.items():
        extra = (
            (
                f", train {statistics.median(results[name]['train_s']):.2f} s, sync "
                f"{statistics.median(results[name]['sync_s']):.3f} s"
            )
            if name == "nereus"
            else ""
        )
        print(
            f"{name:>6}: step {s['step_s']:.2f} s (min {s['step_min_s']:.2f}, max "
            f"{s['step_max_s']:.2f}), "
            f"generate {s['gen_s']:.2f} s = {s['gen_tok_s']:.0f} tok/s{extra}; threads: "
            f"{results[name]['threads']}"
        )
    print(
        f" floor: {floor['train_gflop']:.1f} GFLOP training + {floor['gen_gflop']:.1f} GFLOP "
        "generation a step; at this machine's "
        f"best one-core matmul rate on every core: train {floor['floor_train_s']:.2f} s; "
        "generation reads "
        f"{floor['gen_gb_per_core']:.1f} GB per core at {floor['read_gb_s']:.1f} GB/s: "
        f"{floor['floor_gen_memory_s']:.2f} s "
        f"(compute {floor['floor_gen_compute_s']:.2f} s); floor {floor['floor_step_s']:.2f} "
        "s, so no implementation beats TRL "
        f"by more than {sums['trl']['step_s'] / floor['floor_step_s']:.2f}x here"
    )
    print(
        f"        one core's training phase in plain PyTorch: {floor['plain_torch_train_s']:.2f} s "
        f"(nereus's training phase: {statistics.median(results['nereus']['train_s']):.2f} s)"
    )
    out = {
        "nereus_step_s": round(sums["nereus"]["step_s"], 4),
        "trl_step_s": round(sums["trl"]["step_s"], 4),
        "speedup": round(sums["trl"]["step_s"] / sums["nereus"]["step_s"], 3),
        "nereus_gen_tok_s": round(sums["nereus"]["gen_tok_s"], 1),
        "trl_gen_tok_s": round(sums["trl"]["gen_tok_s"], 1),
        "nereus_step_spread_s": [
            round(sums["nereus"]["step_min_s"], 4),
            round(sums["nereus"]["step_max_s"], 4),
        ],
        "trl_step_spread_s": [
            round(sums["trl"]["step_min_s"], 4),
            round(sums["trl"]["step_max_s"], 4),
        ],
        "floor_step_s": round(floor["floor_step_s"], 4),
        "max_speedup": round(sums["trl"]["step_s"] / floor["floor_step_s"], 3),
        "nereus_train_s": round(statistics.median(results["nereus"]["train_s"]), 4),
        "floor_train_s": round(floor["floor_train_s"], 4),
        "floor_gen_s": round(floor["floor_gen_s"], 4),
        "floor_gen_compute_s": round(floor["floor_gen_compute_s"], 4),
        "floor_gen_memory_s": round(floor["floor_gen_memory_s"], 4),
        "plain_torch_train_s": round(floor["plain_torch_train_s"], 4),
        "cores_per_side": args.cores,
        "params": results["trl"]["params"],
        "nereus_threads": results["nereus"]["threads"],
        "trl_threads": results["trl"]["threads"],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
