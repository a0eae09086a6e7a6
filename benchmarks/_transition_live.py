"""Parts (b) and (c) of ``python -m benchmarks.transition``: transitions of a running job
on this machine's CPU workers.

- ``prediction_error``: a GRPO job on 4 CPU workers whose policy-training cycles through
  layouts. The first ``calibrate`` changes go through ``CYCLE`` and teach the job's
  calibrator from their measured DAG nodes (p2p efficiency, group set-up, call cost,
  local copy cost; each node at a device's full rate, the cores shared between nodes
  running at once taken out) and from their time outside the nodes (the per-transition
  fixed cost); then learning stops, the job moves (untimed) into ``HELD_OUT`` -- layouts
  that appear nowhere in ``CYCLE``, so no plan pair measured was ever calibrated on --
  and each of the next ``measure`` changes, between held-out layouts, is predicted
  before it runs and measured. Two spans: the moves (the DAG's nodes, releasing the
  transition's groups, renaming the EMUs) against the DAG's scheduled makespan plus the
  fixed cost, and the whole change with the engines' stop and restart against that plus
  ``restart_seconds`` per restarted model-stage, frozen at its value when calibration
  ended. ``prediction_error``: the median of |measured - predicted| / measured of the
  whole change (``_p90``: its 90th percentile); ``..._moves``: the same over the moves.
- ``overlap_ratio``: generation tokens per second on devices a transition does not
  touch while policy-training reshards on the others (``apply_plan(overlap=True)``),
  over tokens per second with no transition running. On 2 cores the workers that
  reshard take CPU from the ones that generate, so this is reported, not targeted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from nereus.config import from_dict
from nereus.job.config import JobConfig
from nereus.job.loop import RLJob
from nereus.planner import Plan, StagePlan

GEN = ((0,), (1,))


def _plan(train: tuple[int, int, tuple[tuple[int, ...], ...]], gen=GEN) -> Plan:
    tp, pp, devs = train
    return Plan(
        (
            ("policy_generation", StagePlan(1, 1, len(gen), gen)),
            ("policy_training", StagePlan(tp, pp, len(devs), devs)),
        )
    )


# policy-training's layouts, visited in a cycle: each change moves bytes differently
CYCLE = [
    (2, 1, ((2, 3),)),
    (1, 2, ((2, 3),)),
    (4, 1, ((0, 1, 2, 3),)),
    (2, 1, ((0, 1),)),
    (1, 1, ((2,), (3,))),
    (2, 1, ((2, 3),)),
    (1, 1, ((3,),)),
]


# held-out layouts of policy-training: none of them is in CYCLE (other PP depths, DP
# widths, devices), so no change between two of them was calibrated on
HELD_OUT = [
    (1, 4, ((0, 1, 2, 3),)),
    (2, 1, ((0, 1), (2, 3))),
    (1, 1, ((1,),)),
    (2, 2, ((0, 1, 2, 3),)),
    (1, 1, ((0,), (1,), (2,), (3,))),
    (1, 2, ((0, 1), (2, 3))),
]
assert not set(HELD_OUT) & set(CYCLE), "a held-out layout was calibrated on"


# layouts of policy-training on devices 2 and 3 only: generation's devices stay untouched
BESIDE = [
    (2, 1, ((2, 3),)),
    (1, 2, ((2, 3),)),
    (1, 1, ((2,), (3,))),
    (1, 1, ((3,),)),
]


def _config(out: str, hidden: int, layers: int) -> JobConfig:
    return from_dict(
        JobConfig,
        {
            "task": {"name": "reverse", "options": {"letters": "abc", "min_len": 2, "max_len": 3}},
            "model": {
                "hidden_size": hidden,
                "num_layers": layers,
                "num_heads": 4,
                "num_kv_heads": 2,
                "intermediate_size": 2 * hidden,
            },
            "algorithm": {"prompts_per_step": 8, "samples_per_prompt": 4},
            "sampling": {"max_new_tokens": 16},
            "optim": {"micro_batch_size": 8},
            "cluster": {"mode": "local", "devices": 4, "memory_per_device": "2GiB"},
            "plan": {
                "policy_generation": {"devices": [0, 1], "dp": 2},
                "policy_training": {"devices": [2, 3], "tp": 2},
            },
            "run": {"steps": 1000, "out_dir": out, "progress": False},
        },
    )


def _errors(rows: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Median, 90th percentile and max of |measured - predicted| / measured."""
    errors = sorted(abs(m - p) / m for p, m in rows)
    p90 = (
        statistics.quantiles(errors, n=10, method="inclusive")[8] if len(errors) > 1 else errors[0]
    )
    return statistics.median(errors), p90, errors[-1]


async def prediction_error(
    calibrate: int = 14, measure: int = 12, hidden: int = 512, layers: int = 4
) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="nereus-bench-transition-")
    rl = RLJob(_config(out, hidden, layers))
    await rl.start()
    rows = []
    try:
        await rl.run_step()
        k = 1
        for _ in range(calibrate):
            rl.stages.learn_transitions = True
            await rl.apply_plan(_plan(CYCLE[k % len(CYCLE)]))
            k += 1
        rl.stages.learn_transitions = False
        restart_s = rl.stages.restart_seconds  # frozen: later changes teach nothing
        await rl.apply_plan(_plan(HELD_OUT[0]))  # into the held-out layouts, untimed
        for i in range(measure):
            report = await rl.apply_plan(_plan(HELD_OUT[(i + 1) % len(HELD_OUT)]))
            restarted = len(report["changed"]) + len(report["retuned"])
            rows.append(
                (
                    report["predicted_seconds"] + restarted * restart_s,
                    report["seconds"],
                    report["predicted_seconds"],
                    report["measured_seconds"],
                    report["bytes"],
                    report["nodes"],
                )
            )
        eff = rl.stages.calibrator.fit()
    finally:
        await rl.close()
        shutil.rmtree(out, ignore_errors=True)  # the job's model and tap: nothing read afterwards
    whole = _errors([(p, m) for p, m, _, _, _, _ in rows])
    moves = _errors([(p, m) for _, _, p, m, _, _ in rows])
    return {
        "prediction_error": whole[0],
        "prediction_error_p90": whole[1],
        "prediction_error_max": whole[2],
        "prediction_error_moves": moves[0],
        "prediction_error_moves_p90": moves[1],
        "restart_seconds": restart_s,
        "transitions_calibrated": calibrate,
        "transitions_measured": len(rows),
        "calibrated": {
            "p2p_intra": eff.p2p_intra,
            "group_setup_s": eff.group_setup_s,
            "transition_call_s": eff.transition_call_s,
            "transition_s": eff.transition_s,
            "group_release_s": eff.group_release_s,
            "copy_s_per_gb": eff.copy_s_per_gb,
            "host_s_per_gb": eff.host_s_per_gb,
        },
        "predicted_vs_measured_s": [
            [round(p, 4), round(m, 4), round(pm, 4), round(mm, 4), b, n]
            for p, m, pm, mm, b, n in rows
        ],
    }


async def _tokens_per_second(
    rl: RLJob, prompts: list[list[int]], params: dict, until: asyncio.Future | None, rounds: int
) -> float:
    tokens, t0, n = 0, time.perf_counter(), 0
    while (until is not None and not until.done()) or (until is None and n < rounds):
        out = await rl.stages.generate(prompts, params)
        tokens += sum(len(t) for t in out["token_ids"])
        n += 1
    return tokens / (time.perf_counter() - t0)


async def overlap_ratio(rounds: int = 6, hidden: int = 512, layers: int = 4) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="nereus-bench-overlap-")
    rl = RLJob(_config(out, hidden, layers))
    await rl.start()
    try:
        await rl.run_step()
        prompts = [rl.codec.encode("abcabc")] * 16
        params = {"max_tokens": 16, "temperature": 1.0, "seed": 1, "stop_token_ids": []}
        alone, during = [], []
        k = 1
        for _ in range(rounds):
            alone.append(await _tokens_per_second(rl, prompts, params, None, 3))
            await rl.apply_plan(_plan(BESIDE[k % len(BESIDE)]), overlap=True)
            k += 1
            done = asyncio.ensure_future(rl.stages.transition_done())
            during.append(await _tokens_per_second(rl, prompts, params, done, 0))
            await done
    finally:
        await rl.close()
        shutil.rmtree(out, ignore_errors=True)
    return {
        "overlap_ratio": statistics.median(during) / statistics.median(alone),
        "tokens_per_s_alone": statistics.median(alone),
        "tokens_per_s_during": statistics.median(during),
        "cores": os.cpu_count(),
    }
