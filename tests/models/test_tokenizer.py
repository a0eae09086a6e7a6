"""A byte-level BPE trained offline, saved in Hugging Face format."""

from __future__ import annotations

import json

import pytest

from nereus.errors import ConfigError
from nereus.models import load_tokenizer, train_tiny_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 7? The answer is 19.",
    "Reinforcement learning from human feedback, with PPO and GRPO.",
    "naïve café — unicode survives byte-level BPE 🙂",
] * 20


def test_train_save_load_round_trip(tmp_path):
    tok = train_tiny_tokenizer(tmp_path, TEXTS, vocab_size=320)
    assert tok.vocab_size == 320
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token_id == tok.eos_token_id == loaded.pad_token_id
    assert loaded.eos_token_id == loaded.tokenizer.token_to_id("<|endoftext|>")
    for text in [*TEXTS[:4], "text never seen: zebra 42 ∑"]:
        ids = loaded.encode(text)
        assert all(0 <= i < 320 for i in ids)
        assert loaded.decode(ids) == text
    assert len(loaded.encode("The quick brown fox")) < len(b"The quick brown fox")  # merges learned
    batch = loaded.encode_batch(["a b", "the answer"])
    assert batch == [loaded.encode("a b"), loaded.encode("the answer")]
    assert loaded.decode([*loaded.encode("hi"), loaded.eos_token_id]) == "hi"


def test_transformers_reads_the_same_folder(tmp_path):
    from transformers import AutoTokenizer

    ours = train_tiny_tokenizer(tmp_path, TEXTS, vocab_size=300)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = "What is 3 + 4? The quick fox."
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert hf.eos_token_id == ours.eos_token_id and hf.pad_token_id == ours.pad_token_id


def test_errors(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size=100"):
        train_tiny_tokenizer(tmp_path, TEXTS, vocab_size=100)
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_eos_falls_back_when_config_is_absent(tmp_path):
    train_tiny_tokenizer(tmp_path, TEXTS, vocab_size=300)
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_tokenizer(tmp_path).eos_token_id is not None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_end|>"}})
    )
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_id == tok.tokenizer.token_to_id("<|im_end|>")
