"""Step loggers, each checked by reading back what it wrote: metrics.jsonl, TensorBoard event
files, a W&B offline run file and an MLflow SQLite store."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.job.config import RunConfig
from nereus.job.loggers import check_loggers, make_loggers, numeric_leaves
from nereus.job.report import read_metrics

ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]


def _record(step: int) -> dict:
    """A step record shaped like the job's, with nested and non-numeric fields."""
    return {
        "step": step,
        "reward_mean": 0.25 * step,
        "response_len_mean": 10.0 + step,
        "generate_seconds": 1.5,
        "train_seconds": 2.0 + step,
        "model_stage_seconds": {"policy_generation": 1.25, "policy_training": 2.5 + step},
        "plan_epoch": step // 2,
        "transitions": [{"kind": "merge"}],
        "is_resumed": False,
        "note": "text stays in jsonl",
    }


def read_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_wandb(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """History and config of the offline runs under ``folder``, from W&B's run file (a
    LevelDB-style log: 32 KiB blocks of 7-byte-headed chunks, each a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    history: dict[str, list[tuple[int, float]]] = {}
    config: dict = {}
    for file in sorted(folder.glob("offline-run-*/run-*.wandb")):
        data = file.read_bytes()
        assert data[:4] == b":W&B"
        pos, record = 7, b""
        while pos + 7 <= len(data):
            room = 32768 - pos % 32768
            if room < 7:  # the rest of a block too small for a header is padding
                pos += room
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0:
                break
            record += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: one whole protobuf
                r = pb.Record()
                r.ParseFromString(record)
                record = b""
                which = r.WhichOneof("record_type")
                if which == "history":
                    items = {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in r.history.item
                    }
                    step = int(items.pop("_step", r.history.step.num))
                    for k, v in items.items():
                        if not k.startswith("_"):
                            history.setdefault(k, []).append((step, v))
                elif which in ("config", "run"):
                    updates = r.config.update if which == "config" else r.run.config.update
                    for item in updates:
                        config[item.key] = json.loads(item.value_json)
    return history, config


def read_mlflow(db: Path, experiment: str) -> tuple[dict[str, list[tuple[int, float]]], dict, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    metrics = {
        k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
        for k in run.data.metrics
    }
    return metrics, run.data.params, run.info.status


def test_numeric_leaves_flatten_nested_maps():
    leaves = dict(numeric_leaves(_record(3)))
    assert leaves["model_stage_seconds/policy_training"] == 5.5 and leaves["is_resumed"] == 0.0
    assert "note" not in leaves and "transitions" not in leaves
    assert dict(numeric_leaves({"x": float("nan"), "y": 1})) == {"y": 1.0}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_every_logger_writes_the_same_record(tmp_path):
    run = RunConfig(
        out_dir=str(tmp_path), loggers=ALL, experiment="nereus-test", run_name="grpo-file"
    )
    config = {"algorithm": {"name": "grpo", "lr": 1e-5}, "run": {"steps": 3}}
    with make_loggers(run, tmp_path, config) as loggers:
        for step in range(3):
            loggers.log(_record(step))
        loggers.commit(3)  # the job's last checkpoint: W&B and MLflow get what it covers
    expected = {
        k: [(s, v) for s in range(3) for k2, v in numeric_leaves(_record(s)) if k2 == k]
        for k, _ in numeric_leaves(_record(0))
        if k != "step"
    }

    assert read_metrics(tmp_path / "metrics.jsonl") == [
        json.loads(json.dumps(_record(s))) for s in range(3)
    ]
    tb = read_tensorboard(tmp_path / "tensorboard")
    assert {k: [(s, pytest.approx(v)) for s, v in vals] for k, vals in expected.items()} == tb
    wb, wb_config = read_wandb(tmp_path / "wandb")
    assert wb == expected
    assert wb_config["algorithm"] == {"name": "grpo", "lr": 1e-5}, wb_config
    mf, params, status = read_mlflow(tmp_path / "mlflow.db", "nereus-test")
    assert mf == expected
    assert params["algorithm.lr"] == "1e-05" and params["run.steps"] == "3" and status == "FINISHED"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_resume_keeps_one_history(tmp_path):
    run = RunConfig(
        out_dir=str(tmp_path), loggers=["jsonl", "tensorboard", "mlflow"], experiment="resume"
    )
    with make_loggers(run, tmp_path, {}) as loggers:
        for step in range(4):
            loggers.log(_record(step))
            if step == 1:
                loggers.commit(2)  # a checkpoint at step 2; the process stops after step 3
    # The job resumes from the checkpoint at step 2: steps 2 and 3 run again.
    with make_loggers(run, tmp_path, {}, resume_from_step=2) as loggers:
        for step in range(2, 5):
            loggers.log({**_record(step), "reward_mean": 100.0 + step})
        loggers.commit(5)
    want = [(0, 0.0), (1, 0.25), (2, 102.0), (3, 103.0), (4, 104.0)]
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == want
    tb = read_tensorboard(tmp_path / "tensorboard")
    assert tb["reward_mean"] == want
    mf, _, _ = read_mlflow(
        tmp_path / "mlflow.db", "resume"
    )  # the same MLflow run goes on, each step once
    assert mf["reward_mean"] == want


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_rewind_to_a_checkpoint_leaves_each_step_once_in_every_logger(tmp_path):
    """A running job restores the checkpoint at step 4 after step 6: steps 4-6 are redone,
    with other figures, and every logger holds each step once, the redone one."""
    run = RunConfig(out_dir=str(tmp_path), loggers=ALL, experiment="rewind", run_name="rewind")
    with make_loggers(run, tmp_path, {}) as loggers:
        for step in range(7):
            loggers.log(_record(step))
            if step == 3:
                loggers.commit(4)
        loggers.rewind(4)
        for step in range(4, 8):
            loggers.log({**_record(step), "reward_mean": 100.0 + step})
        loggers.commit(8)
    want = [(s, 0.25 * s) for s in range(4)] + [(s, 100.0 + s) for s in range(4, 8)]
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == want
    assert read_tensorboard(tmp_path / "tensorboard")["reward_mean"] == want
    assert read_wandb(tmp_path / "wandb")[0]["reward_mean"] == want
    assert read_mlflow(tmp_path / "mlflow.db", "rewind")[0]["reward_mean"] == want


def test_logger_config_errors(monkeypatch):
    for bad, words in [
        (["jsonl", "csv"], "must name loggers from"),
        (["tensorboard"], "must include 'jsonl'"),
        (["jsonl", "jsonl"], "must not repeat"),
    ]:
        with pytest.raises(ConfigError, match=rf"run.loggers=.* {words}"):
            RunConfig(loggers=bad)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError,
        match=r"run.loggers includes 'wandb' but the wandb package is not installed: pip install",
    ):
        check_loggers(["jsonl", "wandb"])
