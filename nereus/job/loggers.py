"""Step loggers: the job's per-step record, written where users look for it.

``make_loggers(run, out_dir, config, resume_from_step)`` returns one ``StepLoggers`` that
fans each record out to the loggers ``[run] loggers`` names:

- ``jsonl``: ``metrics.jsonl`` (``nereus.job.report.MetricsWriter``), the whole record as
  JSON; always on, because the job resumes and plots from it.
- ``tensorboard``: event files under ``out_dir/tensorboard`` (one scalar per key).
- ``wandb``: a W&B run in ``run.wandb_mode`` (``offline`` by default: files under
  ``out_dir/wandb``, nothing sent; ``wandb sync`` uploads them later), project
  ``run.experiment``, the job's config as the run's config.
- ``mlflow``: an MLflow run in experiment ``run.experiment`` at ``run.mlflow_tracking_uri``
  (default a SQLite store, ``out_dir/mlflow.db``), the job's config as its parameters.

Each step is recorded once, also when the job goes back to a checkpoint: ``rewind(step)``
and a resume drop what came from ``step`` on (``metrics.jsonl`` lines, TensorBoard events
through ``purge_step``); W&B and MLflow, which cannot take a step back, get a record only
once a later checkpoint is saved (``commit``).

Refuses (``ConfigError``): a logger whose package is missing, with the command that
installs it (checked when the job starts, before any step runs).

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError
from nereus.job.report import MetricsWriter

__all__ = ["StepLogger", "StepLoggers", "make_loggers", "numeric_leaves", "INSTALL"]

log = logging.getLogger("nereus.rl")

INSTALL = "pip install 'nereus[loggers]'"
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def numeric_leaves(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(key, value)`` for every finite numeric leaf of ``record``; nested keys joined by ``/``."""
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from numeric_leaves(value, f"{name}/")
        elif isinstance(value, bool):
            yield name, float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            yield name, float(value)


class StepLogger:
    """One destination of step records. ``final``: it cannot take a step back, so it
    gets only records no restore can drop (``StepLoggers`` holds them until then)."""

    name = ""
    final = False

    def log(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def rewind(self, step: int) -> None:
        """Forget what was logged for ``step`` and later (only a logger that is not ``final``)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlLogger(StepLogger):
    name = "jsonl"

    def __init__(self, out_dir: Path, resume_from_step: int | None) -> None:
        self.writer = MetricsWriter(out_dir / "metrics.jsonl", resume_from_step=resume_from_step)

    def log(self, record: dict[str, Any]) -> None:
        self.writer.write(record)

    def rewind(self, step: int) -> None:
        self.writer.rewind(step)

    def close(self) -> None:
        self.writer.close()


class TensorBoardLogger(StepLogger):
    name = "tensorboard"

    def __init__(self, out_dir: Path, resume_from_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = out_dir / "tensorboard"
        self._writer = SummaryWriter
        # purge_step drops events a crashed run wrote past the checkpoint it resumes from.
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=resume_from_step)

    def rewind(self, step: int) -> None:
        self.writer.close()
        self.writer = self._writer(log_dir=str(self.dir), purge_step=step)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in numeric_leaves(record):
            if key != "step":
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger(StepLogger):
    name = "wandb"
    final = True  # a W&B run's step only grows

    def __init__(
        self,
        out_dir: Path,
        experiment: str,
        run_name: str,
        mode: str,
        config: dict[str, Any],
        resume_from_step: int | None,
    ) -> None:
        import wandb

        root = out_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        run_id = (
            id_file.read_text().strip()
            if resume_from_step is not None and id_file.is_file()
            else uuid.uuid4().hex[:8]
        )
        id_file.write_text(run_id + "\n")
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        self.run = wandb.init(
            project=experiment,
            name=run_name,
            id=run_id,
            dir=str(out_dir),
            mode=mode,
            config=config,
            resume="allow",
            settings=settings,
        )

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self.run.log({k: v for k, v in numeric_leaves(record) if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger(StepLogger):
    name = "mlflow"
    final = True  # a metric logged twice at one step keeps both values

    def __init__(
        self,
        out_dir: Path,
        experiment: str,
        run_name: str,
        uri: str,
        config: dict[str, Any],
        resume_from_step: int | None,
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = uri or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id if found is not None else self.client.create_experiment(experiment)
        )
        id_file = out_dir / "mlflow_run_id"
        if resume_from_step is not None and id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id + "\n")
            params = [Param(k, str(v)[:6000]) for k, v in _flat_config(config)]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(record["step"])
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in numeric_leaves(record) if k != "step"]
        for i in range(0, len(metrics), 1000):  # MLflow's cap on metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat_config(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from _flat_config(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class StepLoggers:
    """Every configured logger; ``log`` writes one record to each, in order, holding the
    records for ``final`` loggers until ``commit`` (or ``close``) says they stand."""

    def __init__(self, loggers: list[StepLogger]) -> None:
        self.loggers = loggers
        self.held: list[dict[str, Any]] = []  # records not yet handed to the final loggers

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            if not logger.final:
                logger.log(record)
        if any(logger.final for logger in self.loggers):
            self.held.append(record)

    def commit(self, step: int) -> None:
        """Records of steps before ``step`` stand (a checkpoint at ``step`` was saved):
        the final loggers get them now."""
        ready = [r for r in self.held if int(r["step"]) < step]
        self.held = [r for r in self.held if int(r["step"]) >= step]
        for record in ready:
            for logger in self.loggers:
                if logger.final:
                    logger.log(record)

    def rewind(self, step: int) -> None:
        """The job went back to a checkpoint at ``step``: every logger forgets ``step``
        and later (the final ones never saw them), so the redone steps are logged once."""
        self.held = [r for r in self.held if int(r["step"]) < step]
        for logger in self.loggers:
            if not logger.final:
                logger.rewind(step)

    def close(self) -> None:
        # What is still held is dropped: a run that stops past its last checkpoint
        # resumes from that checkpoint and logs those steps again.
        # Close all even when one fails; the first failure is raised after the rest closed.
        first: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:
                log.error("closing the %s logger failed: %s", logger.name, e)
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> StepLoggers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_loggers(names: list[str]) -> None:
    """``ConfigError`` unless every package the named loggers need is installed."""
    for name in names:
        package = _PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"run.loggers includes {name!r} but the {package} package is not installed: "
                f"{INSTALL}"
            )


def make_loggers(
    run: Any, out_dir: str | Path, config: dict[str, Any], resume_from_step: int | None = None
) -> StepLoggers:
    """The loggers ``run.loggers`` names (a ``RunConfig``), writing under ``out_dir``.
    ``resume_from_step``: the step a resumed job starts at (None for a fresh job)."""
    check_loggers(list(run.loggers))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = run.run_name or out.resolve().name
    made: list[StepLogger] = []
    try:
        for logger in run.loggers:
            if logger == "jsonl":
                made.append(JsonlLogger(out, resume_from_step))
            elif logger == "tensorboard":
                made.append(TensorBoardLogger(out, resume_from_step))
            elif logger == "wandb":
                made.append(
                    WandbLogger(out, run.experiment, name, run.wandb_mode, config, resume_from_step)
                )
            elif logger == "mlflow":
                made.append(
                    MlflowLogger(
                        out, run.experiment, name, run.mlflow_tracking_uri, config, resume_from_step
                    )
                )
            else:
                raise ConfigError(f"run.loggers: unknown logger {logger!r}")
    except BaseException:
        StepLoggers(made).close()
        raise
    return StepLoggers(made)
