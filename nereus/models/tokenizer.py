"""Tokenizers from a local ``tokenizer.json`` (the ``tokenizers`` package), and a tiny
byte-level BPE trained offline.

``train_tiny_tokenizer(dir, texts, vocab_size)`` trains a byte-level BPE on ``texts`` and
saves it in Hugging Face format (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``), so transformers' ``AutoTokenizer`` loads the same folder.
Special tokens: ``<|endoftext|>`` (eos and pad), ``<|im_start|>``, ``<|im_end|>``. With
``chat_template`` (e.g. ``nereus.models.chat.CHATML_TEMPLATE``) the folder carries that
template in ``tokenizer_config.json``, as instruction models' folders do.

``load_tokenizer(dir)`` returns a ``TextTokenizer``: encode/decode plus the eos, bos and
pad ids read from ``tokenizer_config.json`` (falling back to ``<|endoftext|>``,
``</s>``, ``<eos>`` when the config does not name them).

Refuses (``ConfigError``): a folder without ``tokenizer.json``; a vocab_size smaller than
the 256 byte symbols plus the special tokens. Never downloads anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nereus.config import require
from nereus.errors import ConfigError

__all__ = ["TextTokenizer", "load_tokenizer", "train_tiny_tokenizer", "SPECIAL_TOKENS"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_EOS_FALLBACKS = ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>")


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the ids an engine needs."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token: str | None,
        bos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = self._id(eos_token)
        self.bos_token_id = self._id(bos_token)
        pad_id = self._id(pad_token)
        self.pad_token_id = pad_id if pad_id is not None else self.eos_token_id

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [
            e.ids
            for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes a token either as a string or as {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """The tokenizer saved in ``directory`` (Hugging Face format)."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"tokenizer directory {str(d)!r} has no tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    eos = _token_text(cfg.get("eos_token"))
    if eos is None or tok.token_to_id(eos) is None:
        eos = next((t for t in _EOS_FALLBACKS if tok.token_to_id(t) is not None), None)
    return TextTokenizer(
        tok, eos, _token_text(cfg.get("bos_token")), _token_text(cfg.get("pad_token"))
    )


def train_tiny_tokenizer(
    directory: str | Path,
    texts: Iterable[str],
    vocab_size: int = 512,
    chat_template: str | None = None,
) -> TextTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts``; save it to ``directory``."""
    require(
        vocab_size >= 256 + len(SPECIAL_TOKENS),
        "vocab_size",
        vocab_size,
        f"must be >= {256 + len(SPECIAL_TOKENS)} (256 byte symbols + {len(SPECIAL_TOKENS)} "
        "special tokens)",
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    eos = SPECIAL_TOKENS[0]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": eos,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (d / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": eos, "pad_token": eos}, indent=2) + "\n"
    )
    return TextTokenizer(tok, eos, None, eos)
