"""Job configs shared by the RL tests (small, seeded, in-process unless a test says)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nereus.config import from_dict
from nereus.job.config import JobConfig

# the real traces the workplace keeps beside the repository (never copied into it)
TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
REVERSE = {"name": "reverse", "options": {"letters": "abc", "min_len": 2, "max_len": 3}}


def job(out_dir: str, steps: int, **sections: dict[str, Any]) -> JobConfig:
    data: dict[str, Any] = {
        "task": REVERSE,
        "algorithm": {"prompts_per_step": 8, "samples_per_prompt": 8},
        "sampling": {"max_new_tokens": 6},
        "optim": {"lr": 3e-3},
        "cluster": {"mode": "in_process"},
        "plan": {"policy_generation": {"devices": [0]}, "policy_training": {"devices": [0]}},
        "run": {"steps": steps, "out_dir": out_dir, "progress": False, "seed": 0},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if key != "plan" else value
    return from_dict(JobConfig, data)


def window_mean(records: list[dict[str, Any]], key: str, start: int, stop: int) -> float:
    part = records[start:stop]
    return sum(r[key] for r in part) / len(part)
