"""The bookkeeping of a refilling request: the first rows laid out as a request without
refills lays them, an entry's rows placed together in any free slots (its greedy row
flagged), tokens appended per row with their versions, an entry complete exactly once."""

from __future__ import annotations

import pytest

from nereus.errors import StateError
from nereus.job.async_refill import OpenRequest


def _out(tokens, done):
    return {"tokens": tokens, "logprobs": [[0.0] * len(t) for t in tokens], "done": done}


def test_entries_take_free_slots_together_and_complete_once():
    req = OpenRequest(samples=2, baseline=True)  # ReMax: 2 sampled rows and a greedy one
    rows, greedy = req.first([(10, "a", [1]), (11, "b", [2])])
    # sampled rows entry after entry, then the greedy rows
    assert rows == [[1], [1], [2], [2], [1], [2]] and greedy == [4, 5]
    with pytest.raises(StateError):
        req.place(12, "c", [3], [2, 2, 2])  # no free slot yet
    # entry 10's rows 0 and greedy done, row 1 not; entry 11's sampled rows done
    done = req.record(_out([[5], [6], [7], [8], [9], [4]], [1, 0, 1, 1, 1, 0]), 0)
    assert done == [] and req.free == [0, 2, 3, 4]
    assert req.positions == [10, 11]
    out = req.place(12, "c", [3], [2, 4, 1])
    assert [(r["slot"], r["max_tokens"], r["greedy"]) for r in out] == [
        (0, 2, False),
        (2, 4, False),
        (3, 1, True),
    ]
    assert req.free == [4]
    done = req.record(_out([[1], [6], [2], [3], [], [4]], [0, 1, 0, 1, 1, 1]), 1)
    assert [e.position for e in done] == [10, 11]
    ten = done[0]
    assert ten.tokens == [[5], [6, 6], [9]]
    assert ten.versions == [[0], [0, 1], [0]]
    assert done[1].tokens == [[7], [8], [4, 4]]
    # a free slot's output is nobody's; entry 12 is complete once, then never again
    done = req.record(_out([[2], [], [5], [], [], []], [1, 1, 1, 1, 1, 1]), 2)
    assert [(e.position, e.tokens) for e in done] == [(12, [[1, 2], [2, 5], [3]])]
    assert req.record(_out([[]] * 6, [1] * 6), 3) == [] and req.positions == []
    assert req.free == list(range(6))


def test_a_request_may_open_with_idle_slots():
    req = OpenRequest(samples=3, baseline=False)  # GRPO
    rows, greedy = req.first([(4, "a", [7, 8])], idle=3)
    assert rows == [[7, 8]] * 6 and greedy == [] and req.free == [3, 4, 5]
    # an idle slot's one token is nobody's; the entry's rows are
    done = req.record(_out([[1], [2], [3], [9], [9], [9]], [1, 1, 0, 1, 1, 1]), 0)
    assert done == [] and req.free == [0, 1, 3, 4, 5]
    with pytest.raises(StateError):
        req.place(5, "b", [1], [2, 2])  # a bound per row: three rows
    out = req.place(5, "b", [1], [2, 2, 2])
    assert [r["slot"] for r in out] == [0, 1, 3] and req.positions == [4, 5]
