"""Instructions per cold DAG build of ``benchmarks.transition`` part (a): a figure that
a loaded machine does not change, for comparing two versions of the code.

    bash benchmarks/transition_instructions.sh [tree]

runs this module under ``valgrind --tool=cachegrind`` (CPython 3.11's own instructions,
user space only; ``PYTHONHASHSEED=0`` so that two runs of one tree execute the same
instructions) once with no timed builds and once with ``BUILDS`` of them, and prints
the difference divided by ``BUILDS`` for the pinned case from fresh inputs
(``fresh``), from reused inputs (``warm``) and for the edges case (``edges``). The
inputs of every build are made in both runs, so making them cancels out.

    python -m benchmarks.transition_instructions {fresh,warm,edges} BUILDS

builds the DAG plus its schedule ``BUILDS`` times after one warm-up build, making
``BUILDS + 1`` cases whatever ``BUILDS`` is (0 gives the baseline). No output.
"""

from __future__ import annotations

import sys

from benchmarks.transition import _build_and_schedule, _cold, edges_case, pinned_case

MADE = 30  # cases made by every run: at least the most BUILDS compared


def main() -> None:
    kind, builds = sys.argv[1], int(sys.argv[2])
    if kind not in ("fresh", "warm", "edges") or not 0 <= builds <= MADE:
        raise SystemExit(f"usage: {{fresh,warm,edges}} BUILDS (0..{MADE}), got {sys.argv[1:]}")
    make = edges_case if kind == "edges" else pinned_case
    cases = [make() for _ in range(MADE + 1)]
    _cold()
    _build_and_schedule(cases[0])
    for i in range(builds):
        _cold()
        _build_and_schedule(cases[0] if kind == "warm" else cases[1 + i])


if __name__ == "__main__":
    main()
