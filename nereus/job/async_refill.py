"""The rows of one refilling request of asynchronous RL: which entry each slot serves.

With ``[rl] refill`` a producer keeps its generation EMU's request open and puts the rows
of new buffer entries into the slots of done rows (``SteppedRollout`` refills) instead of
letting them idle until the request's longest row ends. ``OpenRequest`` is its
bookkeeping, pure (no I/O, no ledger): the slots of the first rows (laid out as the
non-refilling request lays them: every entry's sampled rows, entry after entry, then
ReMax's greedy rows), what each entry's rows have produced (tokens, log-probs, the
version of every token), and which slots are free. An entry's rows are placed together
(all of them in one refill, any free slots, its greedy row flagged) and the entry is
complete once all of them are done. A request may open with idle slots (a one-token row
each, its output dropped) for entries the gate does not allow yet.

Promises: a slot serves one row at a time and is free only once that row is done; a row's
tokens are appended in the order the calls return them, each tagged with the version of
its call; an entry is returned by ``record`` exactly once, when its last row is done.
Refuses (``StateError``): placing an entry without a slot for each of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nereus.errors import StateError

__all__ = ["EntryRows", "OpenRequest"]


@dataclass
class EntryRows:
    """One entry's rows in a request: the sampled ones, then a greedy baseline row."""

    position: int
    sample: Any
    prompt: list[int]
    rows: int
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    left: int = 0  # rows not done yet

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.rows)]
        self.logprobs = [[] for _ in range(self.rows)]
        self.versions = [[] for _ in range(self.rows)]
        self.left = self.rows


class OpenRequest:
    """See the module docstring. ``samples`` rows per entry, plus a greedy row when
    ``baseline``."""

    def __init__(self, samples: int, baseline: bool) -> None:
        self.samples, self.baseline = samples, baseline
        self.per_entry = samples + int(baseline)
        self.owner: list[tuple[int, int] | None] = []  # slot -> (position, row of entry)
        self.entries: dict[int, EntryRows] = {}

    def first(
        self, entries: list[tuple[int, Any, list[int]]], idle: int = 0
    ) -> tuple[list[list[int]], list[int]]:
        """The first rows of a request for ``entries`` (position, sample, prompt): the
        prompts by slot and the greedy slots; then ``idle`` free slots (each given the
        first prompt, for a one-token row whose output nobody takes)."""
        k = self.samples
        prompts: list[list[int]] = []
        for position, sample, prompt in entries:
            self.entries[position] = EntryRows(position, sample, prompt, self.per_entry)
            for j in range(k):
                self.owner.append((position, j))
                prompts.append(prompt)
        greedy: list[int] = []
        if self.baseline:
            for position, _, prompt in entries:
                greedy.append(len(prompts))
                self.owner.append((position, k))
                prompts.append(prompt)
        self.owner += [None] * idle
        prompts += [entries[0][2]] * idle
        return prompts, greedy

    @property
    def free(self) -> list[int]:
        """Slots whose row is done."""
        return [s for s, o in enumerate(self.owner) if o is None]

    @property
    def positions(self) -> list[int]:
        """Entries with a row not done yet."""
        return list(self.entries)

    def place(
        self, position: int, sample: Any, prompt: list[int], limits: list[int]
    ) -> list[dict[str, Any]]:
        """Put the entry's rows (bounds ``limits``: its sampled rows, then its greedy row)
        into free slots; returns the refills (``Refill`` fields as maps) to send."""
        free = self.free
        if len(free) < self.per_entry or len(limits) != self.per_entry:
            raise StateError(
                f"entry {position} needs {self.per_entry} free slots and bounds "
                f"(has {len(free)} slots, {len(limits)} bounds)"
            )
        self.entries[position] = EntryRows(position, sample, prompt, self.per_entry)
        out = []
        for j, (slot, bound) in enumerate(zip(free, limits, strict=False)):
            self.owner[slot] = (position, j)
            greedy = self.baseline and j == self.samples
            out.append({"slot": slot, "prompt": prompt, "max_tokens": bound, "greedy": greedy})
        return out

    def record(self, out: dict[str, Any], version: int) -> list[EntryRows]:
        """One call's output (``advance_rollout``), its tokens of policy ``version``;
        returns the entries whose last row is now done (their slots free)."""
        complete = []
        for slot, (tokens, logprobs) in enumerate(zip(out["tokens"], out["logprobs"], strict=True)):
            owner = self.owner[slot]
            if owner is None:
                continue
            entry = self.entries[owner[0]]
            row = owner[1]
            entry.tokens[row] += tokens
            entry.logprobs[row] += logprobs
            entry.versions[row] += [version] * len(tokens)
            if out["done"][slot]:
                self.owner[slot] = None
                entry.left -= 1
                if entry.left == 0:
                    complete.append(self.entries.pop(entry.position))
        return complete
