"""Metrics JSONL, summary table and PNG plot."""

from __future__ import annotations

import io

from rich.console import Console

from nereus.job.report import MetricsWriter, plot_metrics, read_metrics, summary_table


def _records(n):
    return [
        {"step": i, "reward_mean": i / n, "reward_std": 0.1, "response_len_mean": 3.0 + i, "generate_seconds": 0.5, "train_seconds": 0.2, "step_seconds": 0.8}
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
