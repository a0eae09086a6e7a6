"""What an RL job shows and writes: metrics JSONL, a rich progress bar, a summary, a plot.

- ``MetricsWriter`` appends one JSON object per step to ``metrics.jsonl`` (flushed
  each step, so a crash loses nothing already written); on resume it keeps the lines
  of steps before the resume point and drops later ones, so the file always tells one
  history.
- ``StepProgress`` is a rich progress bar over steps whose description shows the
  step's stage times, mean reward and mean response length; it is a no-op when
  disabled (tests, non-interactive runs log instead).
- ``summary_table`` renders the per-step records as a rich table; ``changes_summary``
  writes the plan changes an adapting job made, each on its own lines (step, triggers,
  per model-stage from -> to with tp, pp, dp and devices, predicted and measured
  seconds, MB) so they read in 80 columns; ``plot_metrics`` writes a PNG of reward, response length
  and stage times per step, with every plan change marked (matplotlib, Agg backend: no
  display is ever needed).

A step record is a flat dict: ``step``, ``reward_mean``, ``reward_std``,
``response_len_mean``, ``policy_version``, ``step_seconds``, ``<stage>_seconds`` for
each stage timed, and the losses' metrics; a step after which the plan changed carries
``transition`` (``nereus.job.adapt.Change.as_record``).
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nereus.planner.plan_text import ARROW, plan_changes

__all__ = [
    "MetricsWriter",
    "StepProgress",
    "read_metrics",
    "summary_table",
    "changes_summary",
    "plot_metrics",
]

log = logging.getLogger("nereus.rl")

STAGE_KEYS = ("generate_seconds", "score_seconds", "train_seconds", "sync_seconds")


class MetricsWriter:
    """Appends step records to ``path`` as JSON lines."""

    def __init__(self, path: str | Path, resume_from_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is None:
            self.path.write_text("")
        else:
            kept = (
                [r for r in read_metrics(self.path) if r.get("step", 0) < resume_from_step]
                if self.path.exists()
                else []
            )
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._fh = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def rewind(self, step: int) -> list[int]:
        """Drop the lines of ``step`` and later (a restored checkpoint redoes them);
        returns the steps dropped."""
        self._fh.close()
        records = read_metrics(self.path)
        self.path.write_text(
            "".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) < step)
        )
        self._fh = self.path.open("a")
        return [r.get("step", 0) for r in records if r.get("step", 0) >= step]

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


class StepProgress:
    """A rich progress bar over the job's steps (or nothing when ``enabled`` is False)."""

    def __init__(
        self, total: int, start: int = 0, enabled: bool = True, title: str = "GRPO"
    ) -> None:
        self.enabled = enabled
        self._progress = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.fields[title]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
        )
        self._task = self._progress.add_task("", total=total, completed=start, title=title)
        self._progress.start()

    def update(self, record: dict[str, Any]) -> None:
        if self._progress is None:
            log.info("step %s: %s", record.get("step"), describe(record))
            return
        self._progress.update(self._task, advance=1, description=describe(record))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def describe(record: dict[str, Any]) -> str:
    """One line: reward, length and stage times of a step record."""
    parts = [
        f"reward {record.get('reward_mean', float('nan')):.3f}",
        f"len {record.get('response_len_mean', float('nan')):.1f}",
    ]
    for key in STAGE_KEYS:
        if key in record:
            parts.append(f"{key.removesuffix('_seconds')} {record[key]:.2f}s")
    return " | ".join(parts)


def summary_table(records: Sequence[dict[str, Any]], title: str = "RL job summary") -> Any:
    """A rich Table with one row per step (at most ~20 rows: evenly spaced steps)."""
    from rich.table import Table

    table = Table(title=title)
    cols = ["step", "reward_mean", "response_len_mean", *STAGE_KEYS, "step_seconds"]
    present = [c for c in cols if any(c in r for r in records)]
    for c in present:
        table.add_column(
            c.removesuffix("_seconds") + (" s" if c.endswith("_seconds") else ""), justify="right"
        )
    stride = max(1, len(records) // 20)
    shown = list(records[::stride])
    if records and shown[-1] is not records[-1]:
        shown.append(records[-1])
    for r in shown:
        table.add_row(*[_fmt(r.get(c)) for c in present])
    return table


def changes_summary(
    records: Sequence[dict[str, Any]], title: str = "plan changes", width: int = 80
) -> str:
    """The plan changes the records carry (``transition``), each on its own lines: the
    step it ran before and its triggers, then one line per model-stage it moved
    (``nereus.planner.plan_text``: tp, pp, dp and devices, before and after), then its
    predicted and measured seconds and the MB it moved. Lines fit in ``width`` columns
    where the words allow (a model-stage's change too long for one line goes on two)."""
    lines = textwrap.wrap(title, width, break_on_hyphens=False) or [""]
    for r in records:
        t = r.get("transition")
        if not t:
            continue
        head = f"before step {t['step']}: " + (", ".join(t["triggers"]) or "no trigger")
        lines += textwrap.wrap(head, width, subsequent_indent="    ", break_on_hyphens=False)
        moved = plan_changes(t["from"], t["to"])
        pad = max((len(name) for name, _ in moved), default=0)
        for name, change in moved:
            one = f"  {name:<{pad}}  {change}"
            if len(one) <= width:
                lines.append(one)
                continue
            before, after = change.split(f" {ARROW} ", 1)
            lines += [f"  {name:<{pad}}  {before}", f"  {'':<{pad}}  {ARROW} {after}"]
        if not moved:
            lines.append("  no model-stage moved")
        lines.append(
            f"  predicted {t['predicted_seconds']:.3f} s, "
            f"measured {t['measured_seconds']:.3f} s, {t['bytes'] / 1e6:.2f} MB moved"
        )
    return "\n".join(lines)


def faults_table(faults: Sequence[dict[str, Any]], title: str = "faults recovered from") -> Any:
    """A rich Table with one row per fault (``nereus.job.recovery.Fault.as_record``)."""
    from rich.table import Table

    table = Table(title=title)
    for c in (
        "step",
        "devices",
        "during",
        "update committed",
        "step redone",
        "checkpoint restored",
        "recovery s",
    ):
        table.add_column(c, justify="right" if c in ("step", "recovery s") else "left")
    for f in faults:
        table.add_row(
            str(f["step"]),
            ", ".join(map(str, f["devices"])),
            f["during"],
            "yes" if f["committed"] else "no",
            "yes" if f["redone"] else "no",
            f["restored_from"] or "-",
            f"{f['recover_seconds']:.2f}",
        )
    return table


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def _staleness_panel(ax: Any, steps: list[int], records: Sequence[dict[str, Any]]) -> None:
    """Stacked tokens per staleness (versions behind the update) of every update."""
    hists = [r.get("staleness_histogram") or {} for r in records]
    lags = sorted({int(k) for h in hists for k in h})
    bottom = [0] * len(steps)
    for lag in lags:
        counts = [int(h.get(str(lag), 0)) for h in hists]
        ax.bar(steps, counts, bottom=bottom, width=1.0, label=f"{lag} behind")
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylabel("trained tokens")
    ax.legend(loc="upper right", fontsize="small", title="staleness", title_fontsize="small")


def plot_metrics(records: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """PNG with three panels over steps: reward (mean and spread), response length,
    stage times; an asynchronous run's records (``staleness_histogram``) add a fourth,
    each update's trained tokens by how many versions behind they were generated.
    Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    stale = any("staleness_histogram" in r for r in records)
    fig, axes = plt.subplots(4 if stale else 3, 1, figsize=(7, 10.5 if stale else 8), sharex=True)
    mean = [r.get("reward_mean", float("nan")) for r in records]
    std = [r.get("reward_std", 0.0) for r in records]
    axes[0].plot(steps, mean, color="tab:blue", label="reward mean")
    axes[0].fill_between(
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        alpha=0.2,
        color="tab:blue",
    )
    axes[0].set_ylabel("reward")
    axes[1].plot(
        steps, [r.get("response_len_mean", float("nan")) for r in records], color="tab:orange"
    )
    axes[1].set_ylabel("response length (tokens)")
    for key in STAGE_KEYS:
        if any(key in r for r in records):
            axes[2].plot(
                steps,
                [r.get(key, float("nan")) for r in records],
                label=key.removesuffix("_seconds"),
            )
    axes[2].set_ylabel("stage time (s)")
    if stale:
        _staleness_panel(axes[3], steps, records)
    axes[-1].set_xlabel("step")
    changes = [r["transition"] for r in records if r.get("transition")]
    for i, t in enumerate(changes):
        # a change runs between step t["step"] - 1 and t["step"]
        for ax in axes:
            ax.axvline(
                t["step"] - 0.5,
                color="tab:red",
                linestyle="--",
                linewidth=0.9,
                alpha=0.7,
                label="plan change" if ax is axes[0] and i == 0 else None,
            )
        axes[0].annotate(
            t["triggers"][0] if t["triggers"] else "",
            (t["step"] - 0.5, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize="x-small",
            va="top",
            ha="right",
            color="tab:red",
        )
    axes[2].legend(loc="upper right", fontsize="small")
    axes[0].legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
