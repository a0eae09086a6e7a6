"""Were adaptive's admission decisions right? Each one against its counterfactual.

    .venv/bin/python -m benchmarks.admission [--spots us-west-2a,us-east-2b] [--seeds 0-4]
        [--length-trace NAME] [--horizon 100]

A simulation (``nereus.sim``), not a measurement. The adaptive policy runs the job of
``nereus simulate``'s real-trace table (PPO llama-8b on a100-256, a spot trace, a real
length trace rescaled to 500-8,000 tokens, 1,000 steps, seed S; ``--length-trace
growth:500:8000`` is the paper-shaped run's), and
``nereus.sim.counterfactual`` forks it at every boundary where ``dynarl``'s rule (admit
any predicted saving) would have decided otherwise: both branches run on as adaptive
for ``--horizon`` steps, and ``delta_s`` is the admitting branch's run time minus
adaptive's at that step (positive: turning the move down was right).

Default: the softgrpo trace under both spot traces and seeds 0-4, the runs where the
policy table has ``dynarl`` ahead of adaptive (BENCHMARKS.md). Each run prints its
differing decisions and a summary line; the last line is one JSON object:
``decisions``, ``keep_better``, ``admit_better``, ``median_delta_s``, ``sum_delta_s``, the
same without the time lost to the device trace (``keep_better_work``,
``admit_better_work``, ``median_delta_work_s``, ``sum_delta_work_s``: aborted steps and
restarts left out, what the payback test predicts), ``largest_deltas_s`` over every run,
``by_payback_over_limit`` (the same counts by how
far past the payback test's limit each turned-down move was), and ``runs`` (each run's figures with
adaptive's ``mean_step_s``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from nereus.sim import SimConfig, build_scenario
from nereus.sim.counterfactual import Counterfactual, admission_counterfactuals, tally

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
# how far past the payback test's limit a turned-down move was (payback / (gamma * H))
BANDS = (("1-2", 1.0, 2.0), ("2-5", 2.0, 5.0), ("5-20", 5.0, 20.0), (">=20", 20.0, math.inf))


def _rounded(t: dict) -> dict:
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in t.items()}


def one_run(
    spot: str, seed: int, trace: str, horizon: int, steps: int = 1000
) -> tuple[dict, list[Counterfactual]]:
    growth = trace.startswith("growth:")  # the paper's shape, as ``nereus simulate`` takes it
    config = SimConfig(
        "a100-256",
        "llama-8b",
        "ppo",
        str(TRACES / "spot-availability" / f"{spot}_v100_1.json"),
        trace if growth else str(TRACES / "response-length" / f"{trace}.json"),
        steps,
        length_range=None if growth else (500, 8000),
        seed=seed,
        policies=("adaptive",),
    )
    t0 = time.perf_counter()
    rep = admission_counterfactuals(build_scenario(config), horizon)
    for r in rep.rows:
        print(
            f"  step {r.step:4d}: {r.action:10s} delta {r.delta_s:+9.1f} s, without the time "
            "lost to the device "
            f"trace {r.delta_work_s:+8.1f} s  (saving {r.saving_s:.3g} s/step, payback "
            f"{r.payback_steps:.3g} "
            f"steps, limit {r.limit_steps:.3g})"
        )
    t = rep.tally()
    print(
        f"{spot} seed {seed}: adaptive {rep.result.mean_step_s:.1f} s/step; {t['decisions']} "
        "decisions differ "
        f"from admitting; turning down reached step +{horizon} sooner {t['keep_better']} "
        "times, admitting "
        f"{t['admit_better']} (without the time lost to the device trace: "
        f"{t['keep_better_work']} and "
        f"{t['admit_better_work']}); median delta {t['median_delta_s']:+.1f} s, sum "
        f"{t['sum_delta_s']:+.0f} s; "
        f"{rep.failed_branches} branches stopped early; {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    summary = {
        "spot": spot,
        "seed": seed,
        "mean_step_s": round(rep.result.mean_step_s, 2),
        "keep_better": t["keep_better"],
        "admit_better": t["admit_better"],
        "decisions": t["decisions"],
        "keep_better_work": t["keep_better_work"],
        "admit_better_work": t["admit_better_work"],
        "median_delta_s": round(t["median_delta_s"], 1),
        "sum_delta_s": round(t["sum_delta_s"], 1),
        "failed_branches": rep.failed_branches,
    }
    return summary, rep.rows


def _over_limit(r: Counterfactual) -> float:
    return r.payback_steps / r.limit_steps if r.limit_steps > 0 else math.inf


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spots", default="us-west-2a,us-east-2b")
    p.add_argument("--seeds", default="0-4")
    p.add_argument("--length-trace", default="softgrpo-llama3.2-3b-grpo")
    p.add_argument("--horizon", type=int, default=100, help="steps each pair of branches runs on")
    args = p.parse_args(argv)
    runs, rows = [], []
    for spot in args.spots.split(","):
        for seed in _seeds(args.seeds):
            summary, mine = one_run(spot, seed, args.length_trace, args.horizon)
            runs.append(summary)
            rows += mine
    by_ratio = {}
    for name, lo, hi in BANDS:
        b = tally([r for r in rows if lo <= _over_limit(r) < hi])
        by_ratio[name] = {k: v for k, v in _rounded(b).items() if not k.startswith("median")}
        print(
            f"payback / limit {name}: {b['decisions']} decisions; turning down better "
            f"{b['keep_better']}, admitting "
            f"{b['admit_better']}, sum {b['sum_delta_s']:+.0f} s; without the time lost to "
            "the device trace "
            f"{b['keep_better_work']} and {b['admit_better_work']}, sum "
            f"{b['sum_delta_work_s']:+.0f} s"
        )
    deltas = [r.delta_s for r in rows]
    print(
        json.dumps(
            {
                "horizon_steps": args.horizon,
                "length_trace": args.length_trace,
                **_rounded(tally(rows)),
                "by_payback_over_limit": by_ratio,
                "largest_deltas_s": [round(d) for d in sorted(deltas, key=abs)[-5:][::-1]],
                "runs": runs,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
