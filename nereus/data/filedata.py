"""Prompts and ground truth from a local JSONL or Parquet file, in verl's column convention.

``FileTask.load(data, reward)`` reads ``data.path`` through the ``datasets`` package
(its ``json`` or ``parquet`` builder on the local file; nothing is downloaded, and its
Arrow cache goes to a temporary folder removed after reading) and checks every row
before the job starts. The columns (verl's names by default):

- ``prompt`` (``data.prompt_key``): a list of chat messages (``{"role", "content"}``) or
  a string. With ``data.apply_chat_template`` (the default) both go through the model's
  chat template with the generation prompt (a string as one user turn); without it a
  string is tokenized as it is (with the tokenizer's BOS, for base models) and chat
  messages are refused.
- the ground truth (``data.answer_key``, default ``reward_model.ground_truth``: a dotted
  path into nested columns): a string, or a number written as one.
- ``data_source`` (a string) and ``extra_info`` (a map), both optional, passed to a user
  reward function that asks for them. Other columns are ignored.

Refuses (``ConfigError``): a missing file, an unknown format, a file ``datasets`` cannot
read (for JSONL, the first line that is not JSON is named, and a row whose column type
differs from the other rows' is checked on its own), and any bad row: the error names the
file, the row (counted from 0, as ``datasets`` counts) and the column.

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nereus.config import require
from nereus.data.rewards import RewardFunction, RewardInput, add_note
from nereus.data.tasks import Sample, Task
from nereus.data.vocab import Codec
from nereus.errors import ConfigError

__all__ = ["DataConfig", "FileRow", "FileTask", "read_rows", "file_format"]


@dataclass(frozen=True)
class DataConfig:
    """Prompts and ground truth from a local file instead of a synthetic task
    (``nereus.data.filedata``): verl's columns, the model's chat template, the same global
    sample order and exact resume as the tasks. Its rewards come from ``[reward] rule``."""

    path: str = ""
    """The JSONL or Parquet file (local; read through the ``datasets`` package)."""
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """``auto`` tells the format from the suffix (``.jsonl``/``.json``, ``.parquet``)."""
    prompt_key: str = "prompt"
    """The column holding the prompt: chat messages or a string."""
    answer_key: str = "reward_model.ground_truth"
    """The column holding the ground truth; dots step into nested columns."""
    apply_chat_template: bool = True
    """Render prompts with the model's chat template and the generation prompt (a string
    prompt as one user turn); false feeds string prompts as they are (base models)."""
    shuffle: bool = True
    """Visit the rows in a seeded random order per epoch (``run.seed``); false keeps the
    file's order."""
    max_samples: int = 0
    """Use only the first ``max_samples`` rows (0: all)."""

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path", self.path, "must name a JSONL or Parquet file")
        require(
            self.format in ("auto", "jsonl", "parquet"),
            "data.format",
            self.format,
            "must be 'auto', 'jsonl' or 'parquet'",
        )
        for name in ("prompt_key", "answer_key"):
            value = getattr(self, name)
            require(
                bool(value) and all(value.split(".")),
                f"data.{name}",
                value,
                "must be a column name (dots for nested columns)",
            )
        require(
            self.max_samples >= 0,
            "data.max_samples",
            self.max_samples,
            "must be >= 0 (0 = all rows)",
        )


log = logging.getLogger("nereus.rl")

_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class FileRow:
    """One checked row: the prompt as messages or text, and what rewards read."""

    messages: tuple[dict[str, str], ...] | None
    text: str | None
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any]

    @property
    def prompt(self) -> str:
        """The prompt as text: the string, or the content of the last user message."""
        if self.text is not None:
            return self.text
        assert self.messages is not None
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        return users[-1] if users else self.messages[-1]["content"]


def file_format(path: Path, declared: str) -> str:
    """``jsonl`` or ``parquet``: ``declared`` unless it is ``auto``, else from the suffix."""
    if declared != "auto":
        return declared
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"data.path={str(path)!r}: cannot tell the format from the suffix {path.suffix!r}; "
            f"name it with data.format = 'jsonl' or 'parquet' (or use one of {sorted(_FORMATS)})"
        )
    return fmt


def _json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of every non-empty line; ``ConfigError`` naming the first line
    that is not a JSON object."""
    out = []
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(
                    f"data.path={str(path)!r}: line {number} is not valid JSON ({e})"
                ) from None
            if not isinstance(row, dict):
                raise ConfigError(f"data.path={str(path)!r}: line {number} is not a JSON object")
            out.append((number, row))
    return out


def _load_table(path: Path, fmt: str, data: DataConfig) -> list[dict[str, Any]]:
    import datasets
    from datasets.utils import logging as ds_logging

    builder = "json" if fmt == "jsonl" else "parquet"
    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory(prefix="nereus-datasets-") as cache:
            table = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
            return table.to_list()
    except Exception as e:  # datasets and pyarrow raise many types for a bad file
        if fmt == "jsonl":
            # Arrow refuses a column whose type changes between rows before any row is
            # seen; read the lines directly to name the row and column that broke it.
            for i, (_, row) in enumerate(_json_lines(path)):
                _check_row(row, i, data, str(path))
        raise ConfigError(
            f"data.path={str(path)!r} could not be read as {fmt} (a column must keep one type "
            f"across rows): {type(e).__name__}: {e}"
        ) from e
    finally:
        if bars:
            ds_logging.enable_progress_bar()


def _dig(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _check_row(row: dict[str, Any], i: int, data: DataConfig, where: str) -> FileRow:
    def bad(column: str, expected: str, value: Any) -> ConfigError:
        return ConfigError(
            f"{where}: row {i} column {column!r}: expected {expected}, got {value!r:.200}"
        )

    # Arrow fills a column a row lacks with null: missing and null read the same.
    found, prompt = _dig(row, data.prompt_key)
    if not found or prompt is None:
        raise bad(
            data.prompt_key,
            "a prompt (chat messages or a string); the column is missing or null",
            None,
        )
    messages = text = None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad(data.prompt_key, "a non-empty string", prompt)
        text = prompt
    elif isinstance(prompt, (list, tuple)):
        if not data.apply_chat_template:
            raise bad(
                data.prompt_key,
                "a string (chat messages need data.apply_chat_template = true)",
                prompt,
            )
        if not prompt:
            raise bad(data.prompt_key, "a non-empty list of chat messages", prompt)
        for m in prompt:
            # (Arrow gives every message the union of the keys; extra keys are null.)
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise bad(data.prompt_key, "chat messages with string 'role' and 'content'", m)
        messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    else:
        raise bad(data.prompt_key, "chat messages or a string", prompt)
    found, truth = _dig(row, data.answer_key)
    if not found or truth is None:
        raise bad(data.answer_key, "a ground truth; the column is missing or null", None)
    if (
        isinstance(truth, bool)
        or not isinstance(truth, (str, int, float))
        or (isinstance(truth, float) and not math.isfinite(truth))
    ):
        raise bad(data.answer_key, "a string or a number", truth)
    truth = truth if isinstance(truth, str) else str(truth)
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise bad("data_source", "a string", source)
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise bad("extra_info", "a map", extra)
    return FileRow(messages, text, truth, source or "", dict(extra or {}))


def read_rows(data: DataConfig) -> tuple[list[FileRow], str]:
    """The checked rows of ``data.path`` and the file's fingerprint (see the module docstring)."""
    path = Path(data.path)
    if not path.is_file():
        raise ConfigError(f"data.path={data.path!r} is not a file")
    fmt = file_format(path, data.format)
    raw = _load_table(path, fmt, data)
    if not raw:
        raise ConfigError(f"data.path={data.path!r} holds no rows")
    if data.max_samples:
        raw = raw[: data.max_samples]
    rows = [_check_row(row, i, data, str(path)) for i, row in enumerate(raw)]
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    settings = (data.prompt_key, data.answer_key, data.apply_chat_template, data.max_samples)
    digest.update(repr(settings).encode())
    log.info("read %d rows from %s (%s)", len(rows), path, fmt)
    return rows, digest.hexdigest()[:16]


class FileTask(Task):
    """The rows of a file as a task: sample ``i`` is row ``i``, scored by ``reward``."""

    name = "file"

    def __init__(
        self,
        rows: list[FileRow],
        reward: RewardFunction,
        source: str,
        fingerprint: str,
        answer_key: str = "reward_model.ground_truth",
        apply_chat_template: bool = True,
    ) -> None:
        if not rows:
            raise ConfigError(f"data.path={source!r} holds no rows")
        self.rows = rows
        self.reward_fn = reward
        self.source = source
        self.fingerprint = fingerprint
        self.answer_key = answer_key
        self.apply_chat_template = apply_chat_template

    @classmethod
    def load(cls, data: DataConfig, reward: RewardFunction) -> FileTask:
        rows, fingerprint = read_rows(data)
        return cls(rows, reward, data.path, fingerprint, data.answer_key, data.apply_chat_template)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def alphabet(self) -> str:
        raise ConfigError(
            "file data needs the model's own tokenizer; a character vocabulary "
            "(model.kind='tiny') cannot spell it"
        )

    def sample(self, index: int, seed: int) -> Sample:
        row = self.rows[index]
        return Sample(index, row.prompt, row.ground_truth)

    def prompt_ids(self, sample: Sample, codec: Codec) -> list[int]:
        row = self.rows[sample.index]
        if self.apply_chat_template:
            messages = row.messages or ({"role": "user", "content": row.prompt},)
            return codec.encode_messages(list(messages), where=f"{self.source}: row {sample.index}")
        return codec.encode(row.prompt, add_bos=True, raw=True)

    def reward(self, sample: Sample, response: str) -> float:
        row = self.rows[sample.index]
        try:
            return self.reward_fn(
                RewardInput(row.prompt, response, row.ground_truth, row.data_source, row.extra_info)
            )
        except ConfigError as e:
            raise ConfigError(
                f"{self.source}: row {sample.index} column {self.answer_key!r}: {e}"
            ) from e
        except Exception as e:
            add_note(e, f"scoring {self.source}: row {sample.index}")
            raise
