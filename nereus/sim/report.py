"""What a simulation reports: a table per policy, a JSON list, a PNG plot.

- ``rows(results, scenario)``: one plain dict per policy (the JSON list): at least
  ``policy``, ``mean_step_s``, ``transitions``, ``transition_overhead_pct``,
  ``memory_failures``, and for ``adaptive`` also ``reduction_vs_static`` and
  ``reduction_vs_best_baseline`` (fractions of the other policy's mean step time, when
  those policies ran); the ``oracle`` reference (``nereus.sim.oracle``), when it ran,
  carries ``reference: true`` and its own ``reduction_vs_static`` (the headroom of the
  scenario) and is never a baseline, and adaptive's row then has
  ``share_of_oracle_headroom`` (the share of the oracle's gain on static that adaptive
  gains too); a run that ended in ``SimulationError`` carries ``stopped`` (the error)
  and is never a baseline; every object carries ``simulated: true`` and the scenario.
- ``table(rows)``: a ``rich`` table titled as a simulation; when the oracle ran, a
  "plan gap %" column: how much longer each run's steps took than the oracle's plans on
  the same steps, pools and straggler draws (``PolicyResult.plan_gap``).
- ``plot(results, path, title, caps)``: step time per policy over the run with its
  transitions (triangles) and restarts (crosses) marked (the oracle dashed, unmarked),
  the device pool and the response lengths (mean, sampled maximum, the job's cap)
  below; matplotlib (Agg) is imported only here, and its absence is a ``ConfigError``
  that says how to install it.

Never runs anything: it formats results it is given.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from nereus.errors import ConfigError
from nereus.sim.policies import ORACLE
from nereus.sim.run import PolicyResult
from nereus.sim.traces import CapSchedule

__all__ = ["rows", "table", "plot"]


def rows(
    results: Sequence[PolicyResult], scenario: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The JSON list (see the module docstring)."""
    by = {r.policy: r for r in results}
    static = by.get("static")
    if static is not None and static.stopped is not None:
        static = None  # a run that did not finish is no baseline
    out = []
    for r in results:
        row = r.to_dict()
        if r.policy in ("adaptive", ORACLE) and static is not None:
            row["reduction_vs_static"] = 1.0 - r.mean_step_s / static.mean_step_s
        if r.policy == ORACLE:
            row["reference"] = True
        if r.policy == "adaptive":
            oracle = by.get(ORACLE)
            if (
                static is not None
                and oracle is not None
                and oracle.mean_step_s < static.mean_step_s
            ):
                # how much of what the oracle gains on static adaptive gains too
                row["share_of_oracle_headroom"] = (static.mean_step_s - r.mean_step_s) / (
                    static.mean_step_s - oracle.mean_step_s
                )
            others = [
                o for o in results if o.policy not in ("adaptive", ORACLE) and o.stopped is None
            ]
            if others:
                best = min(others, key=lambda o: o.mean_step_s)
                row["reduction_vs_best_baseline"] = 1.0 - r.mean_step_s / best.mean_step_s
                row["best_baseline"] = best.policy
        if scenario:
            row["scenario"] = scenario
        out.append(row)
    return out


def table(data: Sequence[dict[str, Any]], title: str) -> Table:
    """Per policy: mean step time, throughput, transitions and their share of run time,
    restarts, memory failures, aborted steps, paused and waiting time, decision times."""
    t = Table(title=title, title_justify="left")
    matched = any("plan_gap" in r for r in data)
    names = [
        "policy",
        "mean step s",
        "steps/h",
        "transitions",
        "transition %",
        "restarts",
        "mem failures",
        "aborted",
        "paused s",
        "waiting s",
        "planner ms",
        "DAG ms",
    ] + (["plan gap %"] if matched else [])
    for name in names:
        t.add_column(name, justify="left" if name == "policy" else "right")
    for r in data:
        cells = [
            r["policy"] + (f" (stopped at step {r['steps']})" if r.get("stopped") else ""),
            f"{r['mean_step_s']:.1f}",
            f"{r['throughput_steps_per_hour']:.2f}",
            str(r["transitions"]),
            f"{r['transition_overhead_pct']:.3f}",
            str(r["restarts"]),
            str(r["memory_failures"]),
            str(r["aborted_steps"]),
            f"{r['paused_s']:.0f}",
            f"{r['waiting_s']:.0f}",
            f"{r['planner_ms_per_decision']:.1f}",
            f"{r['dag_ms_per_decision']:.1f}",
        ]
        if matched:
            cells.append(f"{100 * r['plan_gap']:.1f}" if r.get("plan_gap") is not None else "-")
        t.add_row(*cells)
    return t


def plot(
    results: Sequence[PolicyResult], path: str | Path, title: str, caps: CapSchedule | None = None
) -> None:
    """Write the PNG (see the module docstring); ``caps``: the job's cap schedule, drawn
    with the lengths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(
            f"--plot={str(path)!r} needs matplotlib, which is not importable ({e}); install "
            "it with "
            "`pip install matplotlib` (a dependency of nereus) or leave --plot out"
        ) from None
    fig, (ax_t, ax_d, ax_l) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.2, 1.2]}
    )
    for i, r in enumerate(results):
        color = f"C{i}"
        steps = [s.step for s in r.records]
        if r.policy == ORACLE:  # a reference: dashed, its free plan changes unmarked
            ax_t.plot(
                steps,
                [s.seconds for s in r.records],
                color=color,
                lw=0.8,
                ls="--",
                label=f"oracle, a reference (mean {r.mean_step_s:.0f} s)",
            )
            ax_d.step(
                steps, [s.devices for s in r.records], where="post", color=color, lw=0.8, ls="--"
            )
            continue
        ax_t.plot(
            steps,
            [s.seconds for s in r.records],
            color=color,
            lw=0.9,
            label=f"{r.policy} (mean {r.mean_step_s:.0f} s)",
        )
        moved = [s for s in r.records if s.transition]
        ax_t.scatter(
            [s.step for s in moved],
            [s.seconds for s in moved],
            marker="^",
            color=color,
            s=18,
            zorder=3,
        )
        restarted = [s for s in r.records if s.restart]
        ax_t.scatter(
            [s.step for s in restarted],
            [s.seconds for s in restarted],
            marker="x",
            color=color,
            s=22,
            zorder=3,
        )
        ax_d.step(steps, [s.devices for s in r.records], where="post", color=color, lw=0.8)
    ax_t.set_ylabel("step time (simulated s)")
    heading = textwrap.fill(f"SIMULATION: {title}", 120)
    ax_t.set_title(
        f"{heading}\n(triangles: transitions; crosses: checkpoint restarts)", fontsize=10
    )
    ax_t.legend(fontsize=8, ncol=2)
    ax_d.set_ylabel("devices in the pool")
    first = results[0]
    ax_l.plot(
        [s.step for s in first.records],
        [s.mean_length for s in first.records],
        color="k",
        lw=1,
        label="mean",
    )
    ax_l.plot(
        [s.step for s in first.records],
        [s.max_length for s in first.records],
        color="0.6",
        lw=0.6,
        label="sampled maximum",
    )
    if caps is not None:
        last = first.records[-1].step if first.records else 0
        ax_l.step(
            range(last + 1),
            [caps.cap_at(s) for s in range(last + 1)],
            where="post",
            color="C3",
            lw=0.8,
            ls="--",
            label="cap",
        )
    ax_l.set_ylabel("response tokens")
    ax_l.set_xlabel("RL step")
    ax_l.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
