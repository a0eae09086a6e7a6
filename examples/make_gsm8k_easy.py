"""Write ``examples/data/gsm8k_easy.jsonl``: one-step word problems in GSM8K's shape.

Each row follows verl's column convention, as GSM8K prepared for verl does:
``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model``
(``style`` and ``ground_truth``, the final number) and ``extra_info``. The problems are
one addition, subtraction or multiplication of small numbers told as a short story, easy
enough that a 135M-parameter instruction model solves some of them from the start and
GRPO can raise that share within a few dozen steps on CPU.

    python -m examples.make_gsm8k_easy [--rows 512] [--seed 0] [--out PATH]

The same seed writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe"]
ITEMS = ["apples", "books", "pencils", "stickers", "marbles", "cookies", "stamps", "cards"]
INSTRUCTION = "Answer with the final number."


def _problem(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    kind = r.choice(["add", "sub", "mul", "add2"])
    if kind == "add":
        a, b = r.randint(2, 20), r.randint(2, 20)
        return (
            f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does "
            f"{name} have now?"
        ), a + b
    if kind == "sub":
        a = r.randint(5, 30)
        b = r.randint(1, a - 1)
        return (
            f"{name} has {a} {item} and gives {b} of them to a friend. How many {item} does "
            f"{name} have left?"
        ), a - b
    if kind == "mul":
        a, b = r.randint(2, 6), r.randint(2, 6)
        return (
            f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?",
            a * b,
        )
    a, b = r.randint(2, 20), r.randint(2, 20)
    return (
        f"{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did "
        f"{name} read in total?"
    ), a + b


def rows(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        question, answer = _problem(r)
        out.append(
            {
                "data_source": "gsm8k_easy",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": "train", "index": i, "question": question},
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "data" / "gsm8k_easy.jsonl"))
    args = ap.parse_args()
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(args.rows, args.seed)))
    print(f"wrote {args.rows} rows to {path}")


if __name__ == "__main__":
    main()
