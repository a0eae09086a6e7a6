"""``nereus simulate``: layout policies on a simulated cluster replaying real traces.

    nereus simulate --cluster a100-256 --model llama-8b --algo ppo \\
        --gpus-trace ../shared/traces/spot-availability/us-east-2b_v100_1.json \\
        --length-trace growth:500:8000 --steps 1000 --json out.json --plot out.png

runs every policy (``--policies``, default all six) on the same traces, ground truth and
seed, prints one table row per policy (mean step time, throughput, transitions and their
share of run time, restarts, memory failures, aborted steps, paused and waiting time, planner and
DAG decision times) and the adaptive policy's reduction against static and against the
best other policy, writes ``--json`` (a list, one object per policy) and ``--plot``
(a PNG). ``--show-truth`` prints the ground truth's parameters with their reasons.
``--scenario paper-7.3.3 [--pair N]`` runs a named scenario (``nereus.sim.presets``) and
prints its table beside the paper's figures. Everything it prints is a simulation and
says so.

Exit status: 0 after a simulation (a policy whose job could not go on is reported up to
there, marked stopped, with the error), 1 when the scenario itself cannot run
(``SimulationError``), 2 on bad arguments (the message names the flag and the value).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from nereus.errors import ConfigError, exit_status
from nereus.planner.cluster import PRESETS
from nereus.planner.workload import ALGORITHMS, MODEL_PRESETS
from nereus.sim.compare import simulate
from nereus.sim.policies import EXTRA_POLICIES, ORACLE, POLICIES
from nereus.sim.presets import PAPER
from nereus.sim.presets import PRESETS as SCENARIOS
from nereus.sim.run import SimConfig, SimulationError, build_scenario, preset_config
from nereus.sim.truth import load_truth_params

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nereus simulate",
        description=(
            "Compare layout policies on a simulated cluster: the real planner and transition "
            "DAG against a "
            "ground-truth cost model, replaying device-availability and response-length "
            "traces. Every figure is "
            "a simulation."
        ),
    )
    p.add_argument("--cluster", default="a100-256", help=f"one of {sorted(PRESETS)}")
    p.add_argument("--model", default="llama-8b", help=f"one of {sorted(MODEL_PRESETS)}")
    p.add_argument("--algo", default="ppo", choices=ALGORITHMS)
    p.add_argument(
        "--scenario",
        help=f"a named scenario ({', '.join(sorted(SCENARIOS))}): its cluster allocation, "
        "traces, cap and policies replace the flags above and below (flags given still set seed, "
        "policies and gamma)",
    )
    p.add_argument(
        "--pair", type=int, default=0, help="the scenario's trace pair (0: the paper's first trace)"
    )
    p.add_argument(
        "--traces-dir",
        help="the shared traces folder (default: ../shared/traces beside the project)",
    )
    p.add_argument(
        "--gpus-trace", help="a spot-availability JSON file, or growth:LO:HI devices over the run"
    )
    p.add_argument(
        "--length-trace", help="a response-length JSON file, or growth:LO:HI tokens over the run"
    )
    p.add_argument(
        "--length-range",
        nargs=2,
        type=float,
        metavar=("LO", "HI"),
        help="rescale the length trace so its minimum and maximum become LO and HI",
    )
    p.add_argument(
        "--pool-scale",
        type=float,
        metavar="K",
        help="devices per spot instance (default: the cluster's devices / 16)",
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument(
        "--gamma", type=float, default=0.5, help="admission's payback factor for adaptive"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=3, help="every-k: steps between searches")
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, from {','.join(POLICIES + EXTRA_POLICIES)} (default: the first "
        "six)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        help="the job's largest generation cap (default: 2 x the largest "
        "mean, rounded up to a power of two)",
    )
    p.add_argument(
        "--cap-schedule",
        default="stepped",
        metavar="stepped|fixed",
        help="stepped (default): the cap is raised as responses grow, at each step the smallest "
        "power "
        "of two >= 2 x its mean length, never lowered; fixed: the largest cap from the first step",
    )
    p.add_argument("--prompts", type=int, default=256, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument(
        "--truth",
        help="another ground-truth parameter file (default: nereus/sim/ground_truth.toml)",
    )
    p.add_argument("--json", metavar="FILE", help="write the per-policy results as a JSON list")
    p.add_argument(
        "--plot", metavar="FILE", help="write a PNG of step time, device pool and lengths"
    )
    p.add_argument(
        "--show-truth", action="store_true", help="print the ground truth's parameters and exit"
    )
    return p


def _policies(args: argparse.Namespace) -> tuple[str, ...] | None:
    if args.policies is None:
        return None
    return tuple(p.strip() for p in args.policies.split(",") if p.strip())


def _config(args: argparse.Namespace) -> SimConfig:
    if args.scenario:
        config = preset_config(
            args.scenario,
            args.pair,
            traces_dir=args.traces_dir,
            seed=args.seed,
            policies=_policies(args),
        )
        return dataclasses.replace(config, gamma=args.gamma) if args.gamma != 0.5 else config
    for flag, value in (("--gpus-trace", args.gpus_trace), ("--length-trace", args.length_trace)):
        if not value:
            raise ConfigError(f"{flag} is required (a file path or growth:LO:HI)")
    if args.cluster not in PRESETS:
        raise ConfigError(
            f"--cluster={args.cluster!r} is not a known preset; expected one of {sorted(PRESETS)}"
        )
    return SimConfig(
        cluster=args.cluster,
        model=args.model,
        algorithm=args.algo,
        gpus_trace=args.gpus_trace,
        length_trace=args.length_trace,
        steps=args.steps,
        length_range=tuple(args.length_range) if args.length_range else None,
        pool_scale=args.pool_scale,
        gamma=args.gamma,
        seed=args.seed,
        k=args.k,
        prompts_per_step=args.prompts,
        samples_per_prompt=args.samples,
        prompt_length=args.prompt_length,
        max_length=args.max_length,
        cap_schedule=args.cap_schedule,
        policies=_policies(args) or POLICIES,
        truth_path=args.truth,
    )


def paper_table(data: list[dict], config: SimConfig) -> Table:
    """Mean step seconds per policy beside the paper's (§7.3.3; its first trace's figures
    for pair 0, the mean over its three traces otherwise)."""
    which = "first" if config.pair == 0 else "three"
    t = Table(
        title="beside the paper (§7.3.3, "
        f"{'first trace' if which == 'first' else 'mean of its three traces'}; "
        "the paper measured, this is a simulation)",
        title_justify="left",
    )
    for name in (
        "policy",
        "simulated mean step s",
        "vs adaptive",
        "paper mean step s",
        "paper vs adaptive",
    ):
        t.add_column(name, justify="left" if name == "policy" else "right")
    by = {r["policy"]: r["mean_step_s"] for r in data}
    paper = PAPER[which]
    for policy, mean in by.items():
        ref = paper.get(policy)
        rel = f"{mean / by['adaptive'] - 1:+.1%}" if "adaptive" in by else "-"
        prel = f"{ref / paper['adaptive'] - 1:+.1%}" if ref is not None else "-"
        if any(r.get("stopped") for r in data if r["policy"] == policy):
            policy += " (stopped)"
        t.add_row(policy, f"{mean:.1f}", rel, f"{ref:.1f}" if ref is not None else "-", prel)
    return t


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return exit_status("nereus simulate", lambda: _simulate(args), failure=(SimulationError,))


def _simulate(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 150)
    if args.show_truth:
        for name, value, reason in load_truth_params(args.truth).rows():
            shown = f"{value:g}" if isinstance(value, (int, float)) else str(value)
            console.print(f"[bold]{name}[/] = {shown}\n    {reason}")
        return 0
    config = _config(args)
    scn = build_scenario(config)
    t0 = time.perf_counter()
    results = simulate(config, scenario=scn)
    wall = time.perf_counter() - t0
    from nereus.sim.report import plot, rows, table

    scenario = {
        "scenario": config.scenario,
        "pair": config.pair,
        "nodes": scn.cluster.nodes,
        "cluster": config.cluster,
        "model": config.model,
        "algo": config.algorithm,
        "gpus_trace": config.gpus_trace,
        "length_trace": config.length_trace,
        "length_range": list(config.length_range) if config.length_range else None,
        "pool_scale": config.pool_scale,
        "steps": config.steps,
        "gamma": config.gamma,
        "seed": config.seed,
        "max_length": scn.truth.max_length,
        "cap_schedule": config.cap_schedule,
        "cap_changes": scn.caps.changes(),
        "prompts_per_step": config.prompts_per_step,
        "samples_per_prompt": config.samples_per_prompt,
    }
    data = rows(results, scenario)
    title = (
        f"SIMULATION (not a measurement): {config.algorithm} {config.model} on {config.cluster}, "
        f"devices {scn.devices.name}, lengths {scn.lengths.name}, {config.steps} steps, "
        f"caps {config.cap_schedule} {'/'.join(str(c) for _, c in scn.caps.changes())}, "
        f"gamma {config.gamma}, seed {config.seed}"
    )
    console.print(table(data, title))
    for r in data:
        if r.get("stopped"):
            console.print(f"{r['policy']} stopped after {r['steps']} steps: {r['stopped']}")
    adaptive = next((r for r in data if r["policy"] == "adaptive"), None)
    if adaptive is not None:
        parts = [
            f"{key} = {adaptive[key]:.4f}"
            for key in (
                "reduction_vs_static",
                "reduction_vs_best_baseline",
                "share_of_oracle_headroom",
            )
            if key in adaptive
        ]
        if "best_baseline" in adaptive:
            parts.append(f"best baseline: {adaptive['best_baseline']}")
        console.print("adaptive: " + ", ".join(parts))
    oracle = next((r for r in data if r["policy"] == ORACLE), None)
    if oracle is not None and "reduction_vs_static" in oracle:
        console.print(
            "oracle (a reference, not a policy: the search's candidates chosen knowing the "
            "truth, transitions and restarts free): "
            f"reduction_vs_static = {oracle['reduction_vs_static']:.4f}"
        )
    if config.scenario is not None:
        console.print(paper_table(data, config))
    console.print(
        "(simulated seconds; decision times are this machine's wall time; "
        f"{wall:.1f} s to simulate)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if args.plot:
        plot(
            results, args.plot, title.replace("SIMULATION (not a measurement): ", ""), caps=scn.caps
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
