"""A stepped request whose done slots keep taking new prompts: the same script for the
in-process engine and every rank of a TP x PP EMU (``tests.engines._worker``)."""

from __future__ import annotations

from typing import Any

from nereus.engines.stepped import Refill, SteppedRollout

# (prompt suffix, bound, greedy) of the rows that take done slots, in order
QUEUE = [([7, 3], 5, False), ([9], 3, True), ([4, 4, 2, 1], 6, False), ([5, 6, 7], 2, False)]


def refilled_run(engine: Any, prompts: list[list[int]], seed: int) -> list[tuple[list, list]]:
    """Calls of two steps; after each, every done slot takes the next row of ``QUEUE``
    (its prompt the first prompt's first token and the suffix) until none is left. Returns
    each occupant's (tokens, log-probs): the first rows, then the refilled ones in order."""
    params = {"max_tokens": 6, "temperature": 1.0, "seed": seed, "row_max_tokens": [2, 6, 4]}
    r = SteppedRollout(engine, prompts, params, prompt_width=5)
    occupant = list(range(len(prompts)))  # slot -> index into out
    out: list[tuple[list, list]] = [([], []) for _ in prompts]
    queue = list(QUEUE)
    refill: list[Refill] = []
    while True:
        got = r.advance(2, refill)
        for slot, (tk, lp) in enumerate(zip(got["tokens"], got["logprobs"], strict=True)):
            out[occupant[slot]][0].extend(tk)
            out[occupant[slot]][1].extend(lp)
        refill = []
        for slot, done in enumerate(got["done"]):
            if done and queue:
                suffix, bound, greedy = queue.pop(0)
                refill.append(Refill(slot, [prompts[0][0], *suffix], bound, greedy))
                occupant[slot] = len(out)
                out.append(([], []))
        if got["finished"] and not refill:
            return out
