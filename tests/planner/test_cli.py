"""`nereus plan` prints a plan with its terms, memory and alternatives; --json is
machine-readable."""

from __future__ import annotations

import json

import pytest

from nereus.cli import main as nereus_main
from nereus.planner import LengthStats, Plan, Workload, cluster_preset, explain, model_preset
from nereus.planner._probe import local_cpu_probe
from nereus.planner.cli import main


def test_plan_prints_tables_a_systems_engineer_can_check(capsys):
    assert (
        nereus_main(
            [
                "plan",
                "--cluster",
                "a100-256",
                "--model",
                "llama-8b",
                "--algo",
                "ppo",
                "--length",
                "4096",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for text in (
        "plan:",
        "policy-generation",
        "critic-training",
        "phase 0: max(",
        "step =",
        "terms:",
        "ideal_c / efficiency_c",
        "memory per device",
        "usable",
        "next-best placements",
        "why it lost",
        "tp collectives",
        "dp sync",
        "other layouts on the same devices",
        "slower by",
        "does not fit",
    ):
        assert text in out, text


def test_plan_json_matches_explain():
    args = [
        "--cluster",
        "h200-64",
        "--model",
        "llama-8b",
        "--algo",
        "grpo",
        "--length",
        "2048",
        "--json",
        "--no-reward-model",
    ]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    got = json.loads(buf.getvalue())
    plan = Plan.from_dict(got["plan"])
    work = Workload.for_models(
        "grpo",
        model_preset("llama-8b"),
        prompts_per_step=256,
        samples_per_prompt=4,
        prompt_length=512,
        lengths=LengthStats(1024, 0.9 * 2048, 2048),
        reward_model=False,
    )
    ex = explain(plan, work, cluster_preset("h200-64"))
    assert ex.fits
    assert ex.step_seconds == pytest.approx(got["step_seconds"], rel=1e-9)


def test_plan_exit_codes(capsys):
    assert main(["--cluster", "h100-8", "--model", "llama-70b", "--length", "1024"]) == 1
    assert "no plan" in capsys.readouterr().err
    assert main(["--cluster", "nope"]) == 2
    assert "cluster='nope'" in capsys.readouterr().err


def test_local_cpu_probe_is_measured_once_and_cached(tmp_path):
    cache = tmp_path / "probe.json"
    first = local_cpu_probe(cache=cache)
    assert cache.exists()
    assert first["flops_per_device"] > 1e8 and first["memory_bandwidth"] > 1e8
    assert local_cpu_probe(cache=cache) == first  # read back, not re-measured
    cache.write_text("{not json")
    assert local_cpu_probe(cache=cache)["memory_bandwidth"] > 0  # unreadable cache: measured again


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_planner_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, nereus.planner as p; p.search; "
        "assert 'torch' not in sys.modules, 'torch'; assert 'numpy' not in sys.modules, 'numpy'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
