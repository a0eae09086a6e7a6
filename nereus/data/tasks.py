"""Verifiable synthetic tasks with rule rewards: arithmetic, reversing a string, counting.

A task turns a global sample index into a ``Sample`` (prompt text and the answer)
deterministically from ``(seed, index)``, and scores a response with a rule reward in
``[0, 1]``. Nothing here touches a model or a tokenizer: the RL step loop tokenizes
prompts (``Task.prompt_ids``, with the codec it is given) and decodes responses, then
asks the task for the reward. Prompts from files are a task too
(``nereus.data.filedata.FileTask``).

Rewards (every task): 1.0 for an exact answer. With ``partial_credit`` (the default)
a wrong answer earns the positional character match ``matches / max(len(answer),
len(response))``, so a response that is too long or too short loses credit; with
``partial_credit=False`` it earns 0.0. The counting task's partial credit is
``0.5 * (1 - |guess - count| / (len(prompt) + 1))`` instead, because a near count
is nearer.

Refuses (``ConfigError``): empty alphabets, lengths or operand ranges that are empty
or negative, unknown operators or styles.

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import abc
import random
import re
from dataclasses import dataclass
from typing import Literal

from nereus.config import require
from nereus.data.vocab import Codec
from nereus.errors import ConfigError

__all__ = [
    "Sample",
    "Task",
    "ArithmeticTask",
    "ReverseTask",
    "CountTask",
    "TASKS",
    "make_task",
    "positional_match",
]

Style = Literal["compact", "natural"]
_NUMBER = re.compile(r"-?\d+")
_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Sample:
    """One prompt of a task: its global index, the prompt text and the exact answer."""

    index: int
    prompt: str
    answer: str


def positional_match(response: str, answer: str) -> float:
    """Fraction of answer characters matched at the same position, over the longer length."""
    longest = max(len(answer), len(response))
    if longest == 0:
        return 1.0
    matches = sum(1 for a, b in zip(response, answer, strict=False) if a == b)
    return matches / longest


def _rng(seed: int, index: int) -> random.Random:
    # One independent stream per (seed, index): sample i never depends on sample i-1,
    # so any position in the global order can be produced directly (resume, DP ranks).
    return random.Random(seed * 1_000_003 + index)


class Task(abc.ABC):
    """A verifiable task. Subclasses define ``sample``, ``alphabet`` and the scoring."""

    name: str = ""
    style: Style = "compact"
    partial_credit: bool = True

    @abc.abstractmethod
    def sample(self, index: int, seed: int) -> Sample:
        """The sample at global ``index`` under ``seed`` (pure function of both)."""

    @property
    @abc.abstractmethod
    def alphabet(self) -> str:
        """Every character a compact prompt or answer can contain."""

    def extract(self, response: str) -> str:
        """The answer part of a response (compact: the stripped response)."""
        return response.strip()

    def prompt_ids(self, sample: Sample, codec: Codec) -> list[int]:
        """The token ids the policy is prompted with (a file task applies a chat template)."""
        return codec.encode(sample.prompt)

    def score(self, guess: str, sample: Sample) -> float:
        if guess == sample.answer:
            return 1.0
        return positional_match(guess, sample.answer) if self.partial_credit else 0.0

    def reward(self, sample: Sample, response: str) -> float:
        """Rule reward of ``response`` for ``sample``, in [0, 1]."""
        return float(self.score(self.extract(response), sample))

    def _check_style(self) -> None:
        require(
            self.style in ("compact", "natural"),
            f"{type(self).__name__}.style",
            self.style,
            "must be 'compact' or 'natural'",
        )


@dataclass
class ArithmeticTask(Task):
    """``a OP b`` with ``0 <= a, b <= max_operand`` and OP drawn from ``ops``."""

    max_operand: int = 20
    ops: str = "+-"
    style: Style = "compact"
    partial_credit: bool = True
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        require(
            self.max_operand >= 1, "ArithmeticTask.max_operand", self.max_operand, "must be >= 1"
        )
        require(
            len(self.ops) >= 1 and set(self.ops) <= set("+-*"),
            "ArithmeticTask.ops",
            self.ops,
            "must be a non-empty string of '+', '-', '*'",
        )
        self._check_style()

    @property
    def alphabet(self) -> str:
        return "0123456789" + "".join(sorted(set(self.ops) | {"=", "-"}))

    def sample(self, index: int, seed: int) -> Sample:
        r = _rng(seed, index)
        a, b = r.randint(0, self.max_operand), r.randint(0, self.max_operand)
        op = r.choice(self.ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        if self.style == "compact":
            prompt = f"{a}{op}{b}="
        else:
            prompt = f"What is {a}{op}{b}? Answer with only the number."
        return Sample(index, prompt, str(value))

    def extract(self, response: str) -> str:
        if self.style == "compact":
            return response.strip()
        numbers = _NUMBER.findall(response)
        return numbers[-1] if numbers else ""


@dataclass
class ReverseTask(Task):
    """Reverse a string of ``min_len..max_len`` characters drawn from ``letters``."""

    letters: str = "abcd"
    min_len: int = 2
    max_len: int = 4
    style: Style = "compact"
    partial_credit: bool = True
    name: str = "reverse"

    def __post_init__(self) -> None:
        require(
            len(self.letters) >= 2 and self.letters.isalpha(),
            "ReverseTask.letters",
            self.letters,
            "must be >= 2 letters",
        )
        require(self.min_len >= 1, "ReverseTask.min_len", self.min_len, "must be >= 1")
        require(
            self.max_len >= self.min_len,
            "ReverseTask.max_len",
            self.max_len,
            f"must be >= min_len={self.min_len}",
        )
        self._check_style()

    @property
    def alphabet(self) -> str:
        return "".join(sorted(set(self.letters))) + ">"

    def sample(self, index: int, seed: int) -> Sample:
        r = _rng(seed, index)
        word = "".join(r.choice(self.letters) for _ in range(r.randint(self.min_len, self.max_len)))
        if self.style == "compact":
            prompt = f"{word}>"
        else:
            prompt = (
                f"Reverse the letters of the word '{word}'. Answer with only the reversed word."
            )
        return Sample(index, prompt, word[::-1])

    def extract(self, response: str) -> str:
        if self.style == "compact":
            return response.strip()
        m = _WORD.search(response.replace("'", " "))
        return m.group(0).lower() if m else ""


@dataclass
class CountTask(Task):
    """Count how often ``target`` letter (first of ``letters``) occurs in a random string."""

    letters: str = "ab"
    min_len: int = 3
    max_len: int = 6
    style: Style = "compact"
    partial_credit: bool = True
    name: str = "count"

    def __post_init__(self) -> None:
        require(
            len(self.letters) >= 2 and self.letters.isalpha(),
            "CountTask.letters",
            self.letters,
            "must be >= 2 letters",
        )
        require(self.min_len >= 1, "CountTask.min_len", self.min_len, "must be >= 1")
        require(
            9 >= self.max_len >= self.min_len,
            "CountTask.max_len",
            self.max_len,
            f"must be in [min_len={self.min_len}, 9]",
        )
        self._check_style()

    @property
    def alphabet(self) -> str:
        return "".join(sorted(set(self.letters))) + "0123456789#:="

    def sample(self, index: int, seed: int) -> Sample:
        r = _rng(seed, index)
        word = "".join(r.choice(self.letters) for _ in range(r.randint(self.min_len, self.max_len)))
        target = self.letters[0]
        count = word.count(target)
        if self.style == "compact":
            prompt = f"#{target}:{word}="
        else:
            prompt = (
                f"How many times does the letter '{target}' occur in '{word}'? Answer with only "
                "the number."
            )
        return Sample(index, prompt, str(count))

    def extract(self, response: str) -> str:
        if self.style == "compact":
            return response.strip()
        numbers = _NUMBER.findall(response)
        return numbers[-1] if numbers else ""

    def score(self, guess: str, sample: Sample) -> float:
        if guess == sample.answer:
            return 1.0
        if not self.partial_credit or not guess.isdigit():
            return 0.0
        length = len(sample.prompt)  # an upper bound on the count, so credit stays in [0, 1)
        return max(0.0, 1.0 - abs(int(guess) - int(sample.answer)) / (length + 1)) * 0.5


TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "reverse": ReverseTask,
    "count": CountTask,
}


def make_task(name: str, **options: object) -> Task:
    """Build a shipped task by name with its options (``ConfigError`` for unknown names)."""
    if name not in TASKS:
        raise ConfigError(f"task.name={name!r} must be one of {sorted(TASKS)}")
    cls = TASKS[name]
    try:
        return cls(**options)  # type: ignore[arg-type]
    except TypeError as e:
        raise ConfigError(
            f"task.options={options!r} are not options of task {name!r}: {e}"
        ) from None
