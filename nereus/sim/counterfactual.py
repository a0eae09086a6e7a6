"""Each admission decision against its counterfactual: was turning a move down right?

``admission_counterfactuals(scn, horizon)`` runs the ``adaptive`` policy over ``scn`` as
``run_policy`` does and, at every boundary, forks the process. The child decides as
``dynarl`` would at that one boundary (gamma infinite: any predicted saving is
admitted); the parent decides as adaptive does. Where the two decisions differ, the
child runs on, as adaptive again, until ``horizon`` steps later, and reports the run
time it needed to get there (paused time left out, as ``mean_step_s`` counts it); the
parent compares it with its own at the same step. A ``Counterfactual``'s ``delta_s`` is
the admitting branch's run time minus adaptive's: positive when turning the move down
reached the horizon sooner. ``delta_lost_s`` is the part lost to the device trace
(aborted steps and restarts: a move shifts the clock by its transition, so the two
branches meet the trace's losses inside other steps); ``delta_work_s``, the rest
(compute, transitions, waiting), is what the payback test predicts.

Promises: the parent's run is the adaptive policy's run, step for step (the result
equals ``run_policy``'s on a fresh ``adaptive`` policy); a child never returns into the
caller (it ends with ``os._exit``). Needs ``os.fork`` (POSIX) and runs children
concurrently with the parent. Refuses ``horizon < 1`` (``ConfigError``). A branch that
stops early (a ``SimulationError`` in the child) is counted in ``failed_branches``,
never compared. No boundary within ``horizon`` steps of the end forks.

More (how it works): docs/simulation.md.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from nereus.config import require
from nereus.sim.policies import AdaptivePolicy, Boundary, Move, _Ctx
from nereus.sim.run import PolicyResult, Scenario, StepRecord, policy_context, run_policy

__all__ = ["Counterfactual", "CounterfactualReport", "admission_counterfactuals", "tally"]


@dataclass(frozen=True)
class Counterfactual:
    """One boundary where admitting would have decided otherwise: what adaptive did,
    the predicted saving, payback and limit of the move it weighed, and ``delta_s``."""

    step: int
    action: str
    reason: str
    saving_s: float
    payback_steps: float
    limit_steps: float
    delta_s: float
    delta_lost_s: float

    @property
    def delta_work_s(self) -> float:
        """``delta_s`` without the time lost to the device trace: the difference in
        compute, transitions and waiting."""
        return self.delta_s - self.delta_lost_s


def tally(rows: Sequence[Counterfactual]) -> dict[str, float | int]:
    """Counts and totals over ``rows``: ``decisions``; ``keep_better`` and
    ``admit_better`` (turning the move down or taking it reached the horizon sooner),
    ``median_delta_s`` and ``sum_delta_s``; and the same for ``delta_work_s`` (keys
    ending ``_work``, ``median_delta_work_s``, ``sum_delta_work_s``)."""
    out: dict[str, float | int] = {"decisions": len(rows)}
    for suffix, values in (
        ("", [r.delta_s for r in rows]),
        ("_work", [r.delta_work_s for r in rows]),
    ):
        out[f"keep_better{suffix}"] = sum(v > 0 for v in values)
        out[f"admit_better{suffix}"] = sum(v < 0 for v in values)
        out[f"median_delta{suffix}_s"] = statistics.median(values) if values else 0.0
        out[f"sum_delta{suffix}_s"] = sum(values)
    return out


@dataclass
class CounterfactualReport:
    """The adaptive run and its counterfactuals (see the module docstring)."""

    result: PolicyResult
    horizon: int
    rows: list[Counterfactual] = field(default_factory=list)
    failed_branches: int = 0

    def tally(self) -> dict[str, float | int]:
        return tally(self.rows)

    @property
    def keep_better(self) -> int:
        return int(tally(self.rows)["keep_better"])

    @property
    def admit_better(self) -> int:
        return int(tally(self.rows)["admit_better"])


@dataclass
class _Pending:
    """A branch forked at ``step``: its exit code and report once it has ended."""

    step: int
    pid: int
    fd: int
    info: dict
    status: int | None = None
    got: bytes = b""


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    os.close(fd)
    return data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _signature(move: Move) -> str:
    return json.dumps([move.action, move.plan.to_dict() if move.plan is not None else None])


class _ForkingAdaptive(AdaptivePolicy):
    """The adaptive policy, forking an admitting branch at each boundary."""

    def __init__(self, ctx: _Ctx, report: CounterfactualReport, steps: int, gamma: float) -> None:
        super().__init__(ctx, gamma=gamma)
        self.report, self.steps = report, steps
        self.until: int | None = None  # in a child: the step it reports at
        self.report_fd = -1
        self.pending: list[_Pending] = []

    def decide(self, b: Boundary, plan) -> Move:
        if (
            self.until is not None
            or self.replanner is None
            or b.step + self.report.horizon >= self.steps
        ):
            return super().decide(b, plan)
        from_parent, to_child = os.pipe()
        report_read, report_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(to_child)
            os.close(report_read)
            try:
                gamma, self.replanner.gamma = self.replanner.gamma, math.inf
                move = super().decide(b, plan)
                if self.replanner is not None:
                    self.replanner.gamma = gamma
                same = _read_all(from_parent).decode() == _signature(move)
            except BaseException:
                os._exit(1)
            if same:
                os._exit(0)
            self.until, self.report_fd, self.pending = (
                b.step + self.report.horizon,
                report_write,
                [],
            )
            return move
        os.close(from_parent)
        os.close(report_write)
        move = super().decide(b, plan)
        _write_all(
            to_child, _signature(move).encode()
        )  # a plan over 1,024 devices outgrows one pipe buffer
        os.close(to_child)
        d = (
            self.outcome.decision
            if self.outcome is not None and self.outcome.step == b.step
            else None
        )
        self.pending.append(
            _Pending(
                b.step,
                pid,
                report_read,
                {
                    "step": b.step,
                    "action": move.action,
                    "reason": move.reason,
                    "saving_s": d.saving_seconds if d else 0.0,
                    "payback_steps": d.payback_steps if d else math.inf,
                    "limit_steps": d.limit_steps if d else math.inf,
                },
            )
        )
        return move

    def on_step(self, record: StepRecord, result: PolicyResult) -> None:
        step = record.step
        run_s = record.start_s + record.seconds - result.paused_s
        lost_s = result.wasted_s + result.restart_s
        if self.until is not None:
            if step >= self.until:
                _write_all(self.report_fd, json.dumps({"run_s": run_s, "lost_s": lost_s}).encode())
                os._exit(0)
            return
        for p in list(self.pending):
            due = step >= p.step + self.report.horizon
            if p.status is None:
                pid, status = os.waitpid(p.pid, 0 if due else os.WNOHANG)
                if pid == 0:
                    continue  # still running, and not due yet
                p.status, p.got = os.waitstatus_to_exitcode(status), _read_all(p.fd)
            if not p.got:
                # exit 0 without a report: the child decided as the parent did
                self.report.failed_branches += p.status != 0
                self.pending.remove(p)
            elif due:
                got = json.loads(p.got)
                self.report.rows.append(
                    Counterfactual(
                        **p.info, delta_s=got["run_s"] - run_s, delta_lost_s=got["lost_s"] - lost_s
                    )
                )
                self.pending.remove(p)


def admission_counterfactuals(
    scn: Scenario, horizon: int = 100, *, gamma: float = 0.5
) -> CounterfactualReport:
    """The adaptive policy over ``scn`` with every differing decision's counterfactual
    over ``horizon`` steps (see the module docstring)."""
    require(
        isinstance(horizon, int) and horizon >= 1,
        "horizon",
        horizon,
        "must be an integer >= 1 (steps)",
    )
    ctx = policy_context(scn)
    report = CounterfactualReport(PolicyResult("adaptive"), horizon)
    policy = _ForkingAdaptive(ctx, report, scn.steps, gamma)
    try:
        result = run_policy(scn, policy, on_step=policy.on_step)
    except BaseException:
        if policy.until is not None:
            os._exit(1)  # a branch that stopped early: its parent counts it
        for p in policy.pending:  # the adaptive run raised: reap its branches
            if p.status is None:
                os.close(p.fd)
                os.waitpid(p.pid, 0)
        raise
    if policy.until is not None:
        os._exit(1)  # unreachable: a branch reports at its horizon, which is before the end
    report.result = result
    return report
