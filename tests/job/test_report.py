"""Metrics JSONL, summary table and PNG plot."""

from __future__ import annotations

import io

from rich.console import Console

from nereus.job.report import (
    MetricsWriter,
    changes_summary,
    plot_metrics,
    read_metrics,
    summary_table,
)


def _records(n):
    return [
        {
            "step": i,
            "reward_mean": i / n,
            "reward_std": 0.1,
            "response_len_mean": 3.0 + i,
            "generate_seconds": 0.5,
            "train_seconds": 0.2,
            "step_seconds": 0.8,
        }
        for i in range(n)
    ]


def test_jsonl_roundtrip_and_resume_truncation(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for r in _records(5):
            w.write(r)
    assert read_metrics(path) == _records(5)
    with MetricsWriter(path, resume_from_step=3) as w:
        w.write({"step": 3, "reward_mean": 9.0})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert read_metrics(path)[-1]["reward_mean"] == 9.0


def test_summary_and_plot(tmp_path):
    recs = _records(45)
    out = io.StringIO()
    Console(file=out, width=160).print(summary_table(recs))
    text = out.getvalue()
    assert "reward_mean" in text and "44" in text  # the last step is always shown
    png = plot_metrics(recs, tmp_path / "plot.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _stage(tp, pp, emus, **kw):
    return {
        "tp": tp,
        "pp": pp,
        "dp": len(emus),
        "devices": emus,
        "recompute": False,
        "waves": 1,
        **kw,
    }


def _ppo_changes():
    """Three changes of a PPO job on 8 devices: memory, a drained device, a joined one."""
    a = {
        "policy_generation": _stage(1, 1, [[0], [1], [2], [3]]),
        "reference_inference": _stage(1, 1, [[4], [5]]),
        "critic_inference": _stage(1, 1, [[6], [7]]),
        "reward_inference": _stage(1, 1, [[6], [7]]),
        "policy_training": _stage(2, 1, [[0, 1], [2, 3]]),
        "critic_training": _stage(1, 2, [[4, 5], [6, 7]], recompute=True),
    }
    b = {
        **a,
        "policy_generation": _stage(2, 1, [[0, 1], [2, 3]], waves=2),
        "policy_training": _stage(1, 1, [[0], [1], [2], [3]]),
    }
    c = {
        **b,
        "reference_inference": _stage(1, 2, [[4, 5]]),
        "critic_inference": _stage(1, 1, [[5], [6]]),
        "reward_inference": _stage(1, 1, [[4]]),
        "critic_training": _stage(1, 2, [[4, 5], [6, 8]], recompute=True),
        "policy_generation": _stage(1, 1, [[0], [2], [3], [5], [8], [9], [11], [13]]),
    }
    change = {
        "predicted_seconds": 0.173,
        "measured_seconds": 0.148,
        "bytes": 3_970_560,
        "reason": "payback",
    }
    return [
        {"step": 0},
        {
            "step": 40,
            "transition": {
                **change,
                "step": 40,
                "triggers": ["memory:over-budget", "drift:length"],
                "from": a,
                "to": b,
            },
        },
        {"step": 41},
        {
            "step": 50,
            "transition": {
                **change,
                "step": 50,
                "triggers": ["device-pool:drained"],
                "from": b,
                "to": c,
            },
        },
    ]


def test_the_plan_change_summary_reads_in_80_columns():
    out = io.StringIO()
    console = Console(file=out, width=80)
    title = (
        "plan changes: 2 (every decision is on the tap: "
        "runs/a-rather-long-output-folder-name/tap.jsonl)"
    )
    console.print(
        changes_summary(_ppo_changes(), title=title, width=console.width),
        markup=False,
        highlight=False,
    )
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = out.getvalue()
    # each change on its own lines: step and triggers, one line per model-stage moved, figures
    assert "before step 40: memory:over-budget, drift:length" in lines
    assert "  policy_generation  tp1·pp1·dp4 [0-3] → tp2·pp1·dp2·2 waves [0-3]" in lines
    assert "  policy_training    tp2·pp1·dp2 [0-3] → tp1·pp1·dp4 [0-3]" in lines
    assert (
        "reference_inference" not in text.split("before step 50")[0]
    )  # unchanged at 40: not listed
    assert "  reference_inference  tp1·pp1·dp2 [4,5] → tp1·pp2·dp1 [4,5]" in lines
    assert "  critic_inference     tp1·pp1·dp2 [6,7] → tp1·pp1·dp2 [5,6]" in lines  # placement only
    # the title breaks between words, not inside the path
    assert lines[:2] == [
        "plan changes: 2 (every decision is on the tap:",
        "runs/a-rather-long-output-folder-name/tap.jsonl)",
    ]
    # a change too long for one line goes on two, the arrow leading the second
    i = lines.index("  policy_generation    tp2·pp1·dp2·2 waves [0-3]")
    assert lines[i + 1] == "                       → tp1·pp1·dp8 [0,2,3,5,8,9,11,13]"
    i = lines.index("  critic_training      tp1·pp2·dp2·recompute [4-7]")
    assert lines[i + 1] == "                       → tp1·pp2·dp2·recompute [4-6,8]"
    assert text.count("predicted 0.173 s, measured 0.148 s, 3.97 MB moved") == 2
