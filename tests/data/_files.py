"""Small GSM8K-shaped files and tiny chat models for the file-data tests (nothing downloaded)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from nereus.models import ModelConfig, save_tiny_model, train_tiny_tokenizer
from nereus.models.chat import CHATML_TEMPLATE

NAMES = ["Tom", "Anna", "Ben", "Mia"]


def gsm8k_rows(n: int, seed: int = 0, text_prompts: bool = False) -> list[dict[str, Any]]:
    """``n`` rows in verl's GSM8K shape: chat-message prompts (or strings), the final number
    as ``reward_model.ground_truth``, ``data_source`` and ``extra_info``."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = r.randint(1, 9), r.randint(1, 9)
        name = r.choice(NAMES)
        question = f"{name} has {a} apples and buys {b} more. How many apples does {name} have now?"
        prompt: Any = question if text_prompts else [{"role": "user", "content": question}]
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def tiny_chat_model(
    folder: Path, architecture: str = "qwen2", seed: int = 0, **overrides: Any
) -> tuple[Path, ModelConfig]:
    """A tiny random decoder with a byte-level BPE tokenizer trained on GSM8K-shaped text and
    a ChatML chat template: a Hugging Face folder a job loads with ``model.kind = "hf"``."""
    texts = [
        row["prompt"][0]["content"] + " " + row["reward_model"]["ground_truth"]
        for row in gsm8k_rows(64, seed)
    ]
    tok = train_tiny_tokenizer(folder, texts, vocab_size=320, chat_template=CHATML_TEMPLATE)
    vocab = tok.vocab_size + (-tok.vocab_size) % 8  # TP up to 8 divides the embedding
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    base = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        architecture=architecture,
        attention_bias=architecture == "qwen2",
        eos_token_id=im_end,
        bos_token_id=None,
    )
    base.update(overrides)
    config = ModelConfig(**base)
    save_tiny_model(folder, config, seed=seed)
    return folder, config
