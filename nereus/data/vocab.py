"""Tokenizers for RL jobs: a character vocabulary for the shipped tasks, or a model's own.

``char_tokenizer(alphabet)`` builds a Hugging Face ``tokenizers`` tokenizer with one token
per character plus ``<pad>`` (0), ``<bos>`` (1) and ``<eos>`` (2), and ``save`` writes it as
``tokenizer.json`` so the folder of a tiny model is a normal Hugging Face folder.
``Codec`` is what the step loop uses: ``encode`` a prompt (with BOS when the tokenizer has
one; wrapped as a ChatML user turn when the tokenizer is a ChatML chat model's, i.e. has
``<|im_start|>``), ``decode`` a response (stopping at EOS), and the ids of the special
tokens. It wraps either kind, so the loop never asks which one it has.
``encode_messages`` renders chat messages with the folder's own chat template
(``nereus.models.chat``: ``chat_template.jinja`` or ``tokenizer_config.json``) and the
generation prompt, as transformers' ``apply_chat_template`` does; prompts read from files
(``nereus.data.filedata``) take this path.

Refuses (``ConfigError``): an empty alphabet, characters that repeat, a folder without a
``tokenizer.json``, a tokenizer without an end-of-sequence token, chat messages for a
tokenizer without a chat template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from nereus.config import require
from nereus.errors import ConfigError
from nereus.models.chat import load_chat_template, render_chat

__all__ = ["SPECIAL_TOKENS", "char_tokenizer", "Codec"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
_FILLERS = "~^_|&%$@!?;,.'`" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def char_tokenizer(alphabet: str) -> Tokenizer:
    """One token per character of ``alphabet`` (ids 3..), after the three special tokens."""
    require(len(alphabet) >= 1, "alphabet", alphabet, "must not be empty")
    require(
        len(set(alphabet)) == len(alphabet), "alphabet", alphabet, "must not repeat a character"
    )
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


class Codec:
    """Encode prompts and decode responses with one tokenizer (character or HF)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_id: int | None = None,
        bos_id: int | None = None,
        pad_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # The special tokens' text (bos_token, eos_token, ...) a chat template may print.
        self.special_tokens = dict(special_tokens or {})
        self.eos_id = eos_id if eos_id is not None else tokenizer.token_to_id("<eos>")
        if self.eos_id is None:
            raise ConfigError(
                "tokenizer has no end-of-sequence token: pass eos_id (e.g. from config.json)"
            )
        self.bos_id = bos_id if bos_id is not None else tokenizer.token_to_id("<bos>")
        pad = pad_id if pad_id is not None else tokenizer.token_to_id("<pad>")
        self.pad_id = pad if pad is not None else self.eos_id
        self.chat = tokenizer.token_to_id("<|im_start|>") is not None

    @classmethod
    def for_alphabet(cls, alphabet: str, multiple_of: int = 8) -> Codec:
        """A character codec whose vocabulary size is a multiple of ``multiple_of`` (so any
        TP degree up to it divides the vocab-parallel embedding): the alphabet is padded
        with filler characters the task never uses, which a policy must learn not to
        emit (they decode as themselves and earn no credit)."""
        size = len(SPECIAL_TOKENS) + len(alphabet)
        fill = [c for c in _FILLERS if c not in alphabet][: (-size) % multiple_of]
        return cls(char_tokenizer(alphabet + "".join(fill)))

    @classmethod
    def from_dir(cls, path: str | Path) -> Codec:
        """The tokenizer.json of a model folder; special ids from its config files."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"model.path={str(folder)!r} has no tokenizer.json")
        tok = Tokenizer.from_file(str(file))
        special: dict[str, str] = {}
        tok_cfg = folder / "tokenizer_config.json"
        if tok_cfg.is_file():
            data = json.loads(tok_cfg.read_text())
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                text = _token_text(data.get(key))
                if text is not None:
                    special[key] = text
        eos = bos = pad = None
        for name in ("generation_config.json", "config.json"):
            cfg_path = folder / name
            if cfg_path.is_file():
                cfg = json.loads(cfg_path.read_text())
                eos = eos if eos is not None else _first(cfg.get("eos_token_id"))
                bos = bos if bos is not None else _first(cfg.get("bos_token_id"))
                pad = pad if pad is not None else _first(cfg.get("pad_token_id"))
        return cls(
            tok,
            eos_id=eos,
            bos_id=bos,
            pad_id=pad,
            chat_template=load_chat_template(folder),
            special_tokens=special,
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def save(self, folder: str | Path) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(out / "tokenizer.json"))
        return out / "tokenizer.json"

    def encode(self, text: str, add_bos: bool = True, raw: bool = False) -> list[int]:
        """Token ids of a prompt; a chat model's prompt becomes one user turn followed by
        the start of the assistant's turn, unless ``raw`` (the text as it is, after BOS)."""
        if self.chat and not raw:
            text = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def encode_messages(
        self, messages: Sequence[dict[str, str]], where: str = "prompt"
    ) -> list[int]:
        """Token ids of chat ``messages`` rendered with the tokenizer's chat template, ending
        with the generation prompt (the start of the assistant's turn). ``where`` names the
        messages' origin in errors (a file's row and column)."""
        if self.chat_template is None:
            raise ConfigError(
                f"{where}: the prompt is chat messages but the model's tokenizer has no chat "
                "template "
                "(chat_template.jinja or tokenizer_config.json 'chat_template')"
            )
        text = render_chat(
            self.chat_template,
            messages,
            self.special_tokens,
            add_generation_prompt=True,
            where=where,
        )
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` up to (not including) the first EOS. Other special tokens
        stay in the text (``<pad>``): a policy must not hide junk behind tokens a
        decoder would drop."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as a string or as {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first(value: object) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return int(value) if isinstance(value, int) else None
