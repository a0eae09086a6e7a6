"""`nereus run`: config errors are one line naming the field; overrides apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.cli import main as nereus_main
from nereus.job.cli import parse_job

DEMO = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.toml"


def test_bad_field_is_reported_by_name(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace("samples_per_prompt = 8", "samples_per_prompt = 1"))
    assert nereus_main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "algorithm.samples_per_prompt=1 must be >= 2 for grpo" in err
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text(DEMO.read_text().replace("lr = 3e-3", 'lr = "fast"'))
    assert nereus_main(["run", str(wrong_type)]) == 2
    assert "optim.lr='fast' must be a number" in capsys.readouterr().err
    assert nereus_main(["run", str(tmp_path / "missing.toml")]) == 2


def test_overrides_and_in_process(tmp_path):
    cfg = parse_job(
        [
            str(DEMO),
            "--steps",
            "3",
            "--out",
            str(tmp_path),
            "--in-process",
            "--no-progress",
            "--seed",
            "5",
        ]
    )
    assert (
        cfg.run.steps == 3
        and cfg.run.out_dir == str(tmp_path)
        and cfg.run.seed == 5
        and not cfg.run.progress
    )
    assert cfg.cluster.mode == "in_process"
    assert all(p.dp == 1 and len(p.devices) == 1 for p in cfg.plan.values())


@pytest.mark.timeout(120)
def test_run_in_process_end_to_end(tmp_path, capsys):
    assert (
        nereus_main(
            [
                "run",
                str(DEMO),
                "--steps",
                "4",
                "--out",
                str(tmp_path),
                "--in-process",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "done: 4 steps" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 4


def test_smollm2_example_config_is_valid():
    cfg = parse_job([str(DEMO.with_name("grpo_smollm2.toml"))])
    assert cfg.model.kind == "smollm2" and cfg.task.options["style"] == "natural"
    assert set(cfg.plan) == {"policy_generation", "reference_inference", "policy_training"}


def test_connect_overrides_the_files_cluster(tmp_path):
    cfg = parse_job(
        [str(DEMO), "--connect", "tcp://10.0.0.1:5555", "--key-file", "k", "--cluster-devices", "8"]
    )
    assert (cfg.cluster.mode, cfg.cluster.address, cfg.cluster.key_file, cfg.cluster.devices) == (
        "connect",
        "tcp://10.0.0.1:5555",
        "k",
        8,
    )
    assert cfg.cluster.memory_per_device == "256MiB"  # the rest of [cluster] is kept
    assert parse_job([str(DEMO)]).cluster.mode == "local"


def test_connect_overrides_are_checked(tmp_path, capsys):
    assert nereus_main(["run", str(DEMO), "--connect", "head-0:5555"]) == 2
    assert (
        "cluster.address='head-0:5555' must be the controller's address" in capsys.readouterr().err
    )
    assert nereus_main(["run", str(DEMO), "--connect", "tcp://h:1", "--cluster-devices", "0"]) == 2
    assert "cluster.devices=0 must be >= 1" in capsys.readouterr().err
    assert nereus_main(["run", str(DEMO), "--connect", "tcp://h:1", "--in-process"]) == 2
    assert "--in-process cannot be combined with --connect" in capsys.readouterr().err
