"""The four adaptation policies on a live job under real length and device traces (§7.3.3).

``python -m benchmarks.policies [--steps 40] [--rounds 3] [--cores 0.45]``
``[--lengths PATH --pool PATH [--pool-offset N]]... [--policies payback,always,every-k,static]``
``[--overlap auto|true|false|both]``

One pinned PPO job (critic and reference included; a tiny decoder of ``MODEL``), four
local devices of ``--cores`` cores each (a kernel quota) and ``MEMORY`` each, the same
seeds for every run. Each trace pair gives the job ``[trace] lengths`` (the cap follows
the log, scaled to ``CAP`` tokens, end-of-sequence ignored) and ``[trace] pool`` (the spot
trace from ``offset`` on, one tick a step, mapped onto 2..4 devices, drained and returned
through the cluster API). Every policy runs on every pair, ``--rounds`` rounds with the
order rotated; figures are medians over rounds.

Per policy and pair: mean step seconds (the loop's wall time over its steps: transitions,
waits and the trace's joins included), split into ``boundary_s`` (the summed step time at
the boundaries where the plan changed: each boundary's wall time, the change and a
joined device's worker start included, plus the next step's) and ``steady_step_s`` (the
mean of every other step: the speed of the layouts the policy held), transitions and
their measured seconds, restarts
(checkpoint restarts: none of these policies restarts a live job; a decision to restart
stops it and is counted), memory failures (a run that died of OutOfMemory: the steps it
finished are reported), and the simulator's prediction of the same run (``nereus.sim``
with the same policies, traces, workload and cluster shape: one node of the job's
workers, every device at step 0, the pool drained and joined device by device, the
pinned first plan and the probed calibration prior) beside it. Its ground truth is the
one shipped: for these workers the ``[cpu]`` table, measured by ``benchmarks.cpu_truth``
apart from these runs (never fitted on them).

``--overlap`` sets ``[adapt] overlap`` for every run (default ``auto``, the job's
default: a change runs beside the next step's generation where generation's devices are
untouched; these devices are capped, so "auto" may overlap). ``both`` runs every policy
and pair twice, with ``false`` and ``auto``, on the same seeds and traces, and adds per
pair and policy: the step time at each transition boundary both ways (a boundary's
wall time, the change included, plus the next step's: what a change costs the loop,
whether it ran inside the boundary or beside the next step), over the boundaries where
both runs changed the plan before the same step, and ``overlap_saving_s``, the sum over
them of (without overlap - with overlap), and ``overlapped_saving_s``, the same over
the boundaries whose change did run beside the next step (at the others both runs did
the same, and the difference is the machine's noise; each boundary names the
model-stages its change held back); medians over rounds. The ratios and the main table
are the ``auto`` runs'.

Last line: one JSON object with ``ratio_vs_static``, ``ratio_vs_always``,
``ratio_vs_every_k`` (payback's mean step over the other's, averaged over the pairs),
``payback_best_on_every_trace``, ``memory_failures`` (per policy), ``sim_vs_live_error``
(mean absolute relative error of the simulator's mean step against the live one, over
the policies and pairs it ran), ``sim_errors`` (why a simulated run could not finish,
if one could not), ``overlap_mode``, the table and, with ``--overlap both``, ``overlap``
(its table and ``overlap_saving_s`` summed over it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.config import from_dict
from nereus.errors import OutOfMemory, RemoteError, StateError
from nereus.job.cluster_stages import CALIBRATION_PRIOR_WEIGHT
from nereus.job.config import JobConfig, to_planner_plan
from nereus.job.loop import RLJob
from nereus.job.workload import job_workload
from nereus.models import ModelConfig
from nereus.planner import (
    ClusterSpec,
    Efficiency,
    LengthStats,
    local_cpu_cluster_probed,
    local_cpu_efficiency,
)
from nereus.planner.policies import POLICIES
from nereus.sim.compare import run_policies
from nereus.sim.run import Scenario, SimulationError
from nereus.sim.traces import CapSchedule, LengthTrace, StepPoolTrace, pool_at_steps
from nereus.sim.truth import GroundTruth, load_truth_params

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"

# Chosen before the first measured run (and committed so): three length logs of different
# shapes and the two spot traces, at offsets where the pool changes within 40 steps.
PAIRS: list[tuple[str, str, int]] = [
    (
        "response-length/rasbt-qwen3-0.6b-base-grpo-clip.json",
        "spot-availability/us-west-2a_v100_1.json",
        0,
    ),
    (
        "response-length/cogbehav-countdown-qwen2.5-3b-base-ppo.json",
        "spot-availability/us-east-2b_v100_1.json",
        0,
    ),
    (
        "response-length/unsloth-llama3.1-8b-grpo-gsm8k.json",
        "spot-availability/us-east-2b_v100_1.json",
        40,
    ),
]
MODEL = {
    "kind": "tiny",
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 4,
    "intermediate_size": 256,
    "max_seq_len": 96,
}
CAP = 48
MEMORY = "64MiB"
PLAN = {
    "policy_generation": {"devices": [0, 1], "dp": 2},
    "reference_inference": {"devices": [2]},
    "critic_inference": {"devices": [3]},
    "policy_training": {"devices": [0, 1], "dp": 2},
    "critic_training": {"devices": [2, 3], "dp": 2},
}
SIM_NAME = {
    "payback": "adaptive",
    "always": "dynarl",
    "every-k": "every-k",
    "static": "static",
}


@dataclass(frozen=True)
class Pair:
    lengths: str
    pool: str
    offset: int

    @property
    def name(self) -> str:
        return f"{Path(self.lengths).stem}|{Path(self.pool).stem}+{self.offset}"


OVERLAP_MODES = {"auto": "auto", "true": True, "false": False}


def workload_data(prompts_per_step: int = 8, samples_per_prompt: int = 4) -> dict[str, Any]:
    """The pinned job's model, task, algorithm and optimizer (the live runs use the
    defaults; ``benchmarks.cpu_truth`` measures the same job at other batch sizes)."""
    return {
        "model": MODEL,
        "task": {
            "name": "reverse",
            "options": {"letters": "abc", "min_len": 2, "max_len": 3},
            "dataset_size": 4096,
        },
        "algorithm": {
            "name": "ppo",
            "prompts_per_step": prompts_per_step,
            "samples_per_prompt": samples_per_prompt,
            "kl_coef": 0.01,
            "kl_mode": "penalty",
        },
        "optim": {"lr": 3e-3, "micro_batch_size": 2},
    }


def job_config(
    policy: str, pair: Pair, steps: int, cores: float, out_dir: str, overlap: str = "auto"
) -> JobConfig:
    data = {
        **workload_data(),
        "sampling": {"max_new_tokens": CAP},
        "cluster": {
            "mode": "local",
            "devices": 4,
            "memory_per_device": MEMORY,
            "cores_per_device": cores,
        },
        "plan": PLAN,
        "adapt": {
            "enabled": True,
            "policy": policy,
            "every_k": 3,
            "gamma": 0.5,
            "overlap": OVERLAP_MODES[overlap],
        },
        "trace": {"lengths": pair.lengths, "pool": pair.pool, "pool_offset": pair.offset},
        "run": {
            "steps": steps,
            "out_dir": out_dir,
            "progress": False,
            "seed": 0,
            "checkpoint_every": steps + 1,
        },
    }
    return from_dict(JobConfig, data)


def live_counts(pair: Pair, devices: int, steps: int) -> list[int]:
    """The devices the live job has at each step: all of them at step 0 (``PoolTrace``
    acts at the boundary after a step), then the trace's count for the step."""
    counts = pool_at_steps(pair.pool, devices, steps, offset_ticks=pair.offset)
    return [devices] + counts[1:]


def sim_scenario(
    cfg: JobConfig,
    model_config: ModelConfig,
    prompt_length: int,
    pair: Pair,
    steps: int,
    *,
    cluster: ClusterSpec | None = None,
    prior: Efficiency | None = None,
) -> Scenario:
    """The simulator's view of the live job ``cfg``: its workload, its cluster as the
    job describes it to its planner (``cluster``, default: probed as the job probes it,
    one node of ``cluster.devices`` workers of ``cores_per_device`` cores and
    ``memory_per_device`` each), its pool trace, lengths and caps (every response of a
    step as long as its cap: end-of-sequence ignored), its pinned first plan and its
    calibration prior (``prior``, default: the probed CPU figures the job starts from),
    and the ground truth as shipped."""
    caps = [cfg.sampling.cap_at(s) for s in range(steps)]
    first = LengthStats(float(caps[0]), float(caps[0]), caps[0])
    work = job_workload(cfg, model_config, prompt_length=prompt_length, lengths=first)
    n = cfg.cluster.devices
    cores = cfg.cluster.device_cores
    if cluster is None:
        cluster = local_cpu_cluster_probed(
            n, cfg.cluster.memory_bytes, headroom=cfg.adapt.headroom, device_cores=cores
        )
    if prior is None:
        prior = local_cpu_efficiency(cores=min(cores) if cores else None)
    # the simulator's cap bounds memory and never falls: the largest so far
    schedule = CapSchedule(pair.name, tuple(max(caps[: s + 1]) for s in range(steps)))
    truth = GroundTruth(
        load_truth_params(None), cluster, work, caps=schedule, seed=0, p95_ratio=[1.0] * steps
    )
    return Scenario(
        cluster,
        work,
        StepPoolTrace(live_counts(pair, n, steps), pair.name),
        LengthTrace(pair.name, tuple(map(float, caps))),
        steps,
        truth,
        initial_plan=to_planner_plan(cfg.job_plan()),
        prior=prior,
        prior_weight=CALIBRATION_PRIOR_WEIGHT,
    )


def simulate(rl: RLJob, policy: str, pair: Pair, steps: int) -> tuple[float | None, str]:
    """The simulator's mean step seconds for the same job, traces and cluster shape, or
    None and why when it cannot run it."""
    scn = sim_scenario(rl.cfg, rl.model_config, rl.max_prompt_tokens(), pair, steps)
    try:
        return run_policies(scn, (SIM_NAME[policy],), gamma=0.5, k=3)[0].mean_step_s, ""
    except SimulationError as e:  # a run the simulator cannot finish: said, not hidden
        return None, str(e)


def boundaries(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each transition boundary of a run, by the step the change ran before (or beside):
    its ``seconds`` (the boundary's wall time plus the next step's) and whether the
    change ``overlapped`` that step, and the model-stages it ``held_back`` (with overlap,
    those that waited for it). Changes that failed are left out."""
    by_step = {r["step"]: r for r in records}
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        t = r.get("transition")
        nxt = by_step.get(r["step"] + 1)
        if not t or not t.get("ok", True) or nxt is None:
            continue
        out[str(t["step"])] = {
            "seconds": r["boundary_seconds"] + nxt["step_seconds"],
            "overlapped": bool(t.get("overlapped", False)),
            "held_back": t.get("held_back", []),
        }
    return out


async def run_one(
    policy: str, pair: Pair, steps: int, cores: float, with_sim: bool, overlap: str = "auto"
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="nereus-policies-") as out:
        rl = RLJob(job_config(policy, pair, steps, cores, out, overlap))
        await rl.start()
        failed = 0
        restarts = 0
        try:
            t0 = time.perf_counter()
            try:
                records = await rl._loop()
            except (OutOfMemory, RemoteError) as e:
                if isinstance(e, RemoteError) and e.remote_type != "OutOfMemory":
                    raise
                failed, records = 1, list(rl.records)
            except StateError as e:  # a decision to restart: a live job stops there
                if "no change reaches a runnable plan" not in str(e):
                    raise
                restarts, records = 1, list(rl.records)
            wall = time.perf_counter() - t0
            sim, sim_error = simulate(rl, policy, pair, steps) if with_sim else (None, "")
        finally:
            await rl.close()
    moved = [r["transition"] for r in records if r.get("transition") and r["transition"]["ok"]]
    done = max(1, len(records))
    at = boundaries(records)
    boundary_s = sum(b["seconds"] for b in at.values())
    return {
        "policy": policy,
        "pair": pair.name,
        "overlap": overlap,
        "boundaries": at,
        "steps": len(records),
        "mean_step_s": wall / done,
        # where the time went: the boundaries where the plan changed (each one's wall time
        # and the next step's) and the mean of every other step (the layouts' own speed)
        "boundary_s": boundary_s,
        "steady_step_s": (wall - boundary_s) / max(1, done - len(at)),
        "transitions": len(moved),
        "transition_s": sum(t["measured_seconds"] for t in moved),
        "restarts": restarts,
        "memory_failures": failed,
        "sim_mean_step_s": sim,
        "sim_error": sim_error,
    }


def _median(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.median(vals) if vals else math.nan


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    pairs = [Pair(str(TRACES / a), str(TRACES / b), o) for a, b, o in PAIRS]
    if args.lengths or args.pool:
        if len(args.lengths) != len(args.pool):
            raise SystemExit("--lengths and --pool come in pairs")
        offsets = args.pool_offset or [0] * len(args.pool)
        pairs = [Pair(a, b, o) for a, b, o in zip(args.lengths, args.pool, offsets, strict=True)]
    pairs = pairs[: args.pairs] if args.pairs else pairs
    policies = args.policies.split(",")
    modes = ["false", "auto"] if args.overlap == "both" else [args.overlap]
    primary = modes[-1]
    runs: list[dict[str, Any]] = []
    every: list[dict[str, Any]] = []  # every mode's runs; ``runs`` holds the primary's
    for rnd in range(args.rounds):
        order = policies[rnd % len(policies) :] + policies[: rnd % len(policies)]
        for pair in pairs:
            for policy in order:
                for mode in modes:
                    sim = rnd == 0 and mode == primary
                    row = await run_one(policy, pair, args.steps, args.cores, sim, mode)
                    row["round"] = rnd
                    every.append(row)
                    if mode == primary:
                        runs.append(row)
                    print(json.dumps(row), flush=True)
    table = []
    for pair in pairs:
        for policy in policies:
            rows = [r for r in runs if r["pair"] == pair.name and r["policy"] == policy]
            table.append(
                {
                    "pair": pair.name,
                    "policy": policy,
                    **{
                        k: _median(rows, k)
                        for k in (
                            "mean_step_s",
                            "boundary_s",
                            "steady_step_s",
                            "transitions",
                            "transition_s",
                            "restarts",
                            "memory_failures",
                            "sim_mean_step_s",
                        )
                    },
                }
            )

    def step(pair: Pair, policy: str) -> float:
        return next(
            t["mean_step_s"] for t in table if t["pair"] == pair.name and t["policy"] == policy
        )

    out: dict[str, Any] = {}
    for other, key in (
        ("static", "ratio_vs_static"),
        ("always", "ratio_vs_always"),
        ("every-k", "ratio_vs_every_k"),
    ):
        if "payback" in policies and other in policies:
            out[key] = statistics.mean(step(p, "payback") / step(p, other) for p in pairs)
    if "payback" in policies:
        out["payback_best_on_every_trace"] = all(
            step(p, "payback") <= min(step(p, q) for q in policies) for p in pairs
        )
    out["memory_failures"] = {
        q: sum(r["memory_failures"] for r in runs if r["policy"] == q) for q in policies
    }
    errors = [
        abs(t["sim_mean_step_s"] - t["mean_step_s"]) / t["mean_step_s"]
        for t in table
        if not math.isnan(t["sim_mean_step_s"])
    ]
    out["sim_vs_live_error"] = statistics.mean(errors) if errors else None
    out["sim_errors"] = sorted({r["sim_error"] for r in runs if r.get("sim_error")})
    out.update(
        steps=args.steps,
        rounds=args.rounds,
        cores=args.cores,
        overlap_mode=args.overlap,
        pairs=[p.name for p in pairs],
        table=table,
    )
    if args.overlap == "both":
        rows = overlap_table(every, pairs, policies, args.rounds)
        out["overlap"] = {
            "overlap_saving_s": sum(r["overlap_saving_s"] for r in rows),
            "table": rows,
        }
    return out


def overlap_row(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """One policy on one pair, one round, without and with overlap: the boundaries where
    both runs changed the plan before the same step, each one's step time both ways, and
    the saving summed over them."""
    common = sorted(set(off["boundaries"]) & set(on["boundaries"]), key=int)
    both = [
        {
            "step": int(s),
            "off_s": off["boundaries"][s]["seconds"],
            "on_s": on["boundaries"][s]["seconds"],
            "overlapped": on["boundaries"][s]["overlapped"],
            "held_back": on["boundaries"][s]["held_back"],
        }
        for s in common
    ]
    return {
        "boundaries": both,
        "boundary_step_s_off": sum(b["off_s"] for b in both),
        "boundary_step_s_on": sum(b["on_s"] for b in both),
        "overlap_saving_s": sum(b["off_s"] - b["on_s"] for b in both),
        # the part of it at boundaries whose change did overlap (the rest is run-to-run noise)
        "overlapped_saving_s": sum(b["off_s"] - b["on_s"] for b in both if b["overlapped"]),
        "overlapped": sum(b["overlapped"] for b in both),
        "unmatched_off": len(off["boundaries"]) - len(both),
        "unmatched_on": len(on["boundaries"]) - len(both),
    }


def overlap_table(
    runs: list[dict[str, Any]], pairs: list[Pair], policies: list[str], rounds: int
) -> list[dict[str, Any]]:
    """Per pair and policy, ``overlap_row`` of every round; the sums are medians over
    rounds, the boundaries the first round's."""

    def run(pair: Pair, policy: str, rnd: int, mode: str) -> dict[str, Any]:
        return next(
            r
            for r in runs
            if (r["pair"], r["policy"], r["round"], r["overlap"]) == (pair.name, policy, rnd, mode)
        )

    table = []
    for pair in pairs:
        for policy in policies:
            per_round = [
                overlap_row(run(pair, policy, k, "false"), run(pair, policy, k, "auto"))
                for k in range(rounds)
            ]
            table.append(
                {
                    "pair": pair.name,
                    "policy": policy,
                    **{
                        k: statistics.median(r[k] for r in per_round)
                        for k in (
                            "overlap_saving_s",
                            "overlapped_saving_s",
                            "boundary_step_s_off",
                            "boundary_step_s_on",
                            "overlapped",
                            "unmatched_off",
                            "unmatched_on",
                        )
                    },
                    "rounds_saving_s": [r["overlap_saving_s"] for r in per_round],
                    "boundaries": per_round[0]["boundaries"],
                }
            )
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.policies", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", type=float, default=0.45)
    ap.add_argument("--lengths", action="append", default=[])
    ap.add_argument("--pool", action="append", default=[])
    ap.add_argument("--pool-offset", action="append", type=int, default=[])
    ap.add_argument("--pairs", type=int, default=0, help="only the first N pairs (smoke runs)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--overlap",
        choices=[*OVERLAP_MODES, "both"],
        default="auto",
        help="[adapt] overlap of every run; both: each run without and with it (false, auto)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(asyncio.run(_main(args))))


if __name__ == "__main__":
    main()
