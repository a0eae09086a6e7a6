"""Greedy accuracy of a Hugging Face model folder on GSM8K-shaped problems, scored like the
job scores them (math-verify on the final answer).

    python -m examples.make_gsm8k_easy --rows 64 --seed 1 --out runs/gsm8k_easy_heldout.jsonl
    python -m examples.eval_gsm8k runs/smollm2-135m-instruct runs/gsm8k_easy_heldout.jsonl
    python -m examples.eval_gsm8k runs/grpo_gsm8k_smollm2/hf runs/gsm8k_easy_heldout.jsonl

Prompts go through the folder's chat template; answers are decoded greedily with the
built-in engine up to ``--max-tokens``. Prints the accuracy, the mean response length and
two responses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nereus.data.rewards import math_reward
from nereus.data.vocab import Codec
from nereus.engines.generation import GenerationEngine
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.models import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "model", help="a Hugging Face folder (config.json, *.safetensors, tokenizer files)"
    )
    ap.add_argument(
        "data", help="a JSONL file in verl's columns (prompt, reward_model.ground_truth)"
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    config, codec = ModelConfig.from_hf(args.model), Codec.from_dir(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    prompts = [codec.encode_messages(r["prompt"]) for r in rows]
    engine = GenerationEngine(
        config,
        options=EngineOptions(model_dir=args.model, ledger=MemoryLedger("eval", None), name="eval"),
    )
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, "stop_token_ids": [codec.eos_id]}
    out = engine.generate(prompts, params).token_ids
    engine.close()
    texts = [codec.decode(ids) for ids in out]
    correct = sum(
        math_reward(t, str(r["reward_model"]["ground_truth"]))
        for t, r in zip(texts, rows, strict=True)
    )
    print(
        f"{args.model}: greedy accuracy {correct / len(rows):.3f} ({int(correct)}/{len(rows)}), "
        f"mean response length {sum(map(len, out)) / len(out):.1f} tokens"
    )
    for t in texts[:2]:
        print(f"  {t!r}")


if __name__ == "__main__":
    main()
