"""Faults in an asynchronous run: sync mode's recovery at the async loop's boundaries.

``AsyncRecovery(run)`` exists with ``[adapt]`` enabled (as sync mode recovers only then).
``await recovery.guarded(work, during)`` returns what ``work`` returns, or None when a
worker died inside it (``during``: "update" for a batch, its update and weight sync;
"boundary" for the adapter, hooks and checkpoint) or every generation EMU had died
(``GenerationLost``). Recovery then:

1. stops the producers (``AsyncRun.pause``): finished groups stay in the buffer,
   unfinished ones go back to the ledger (``regenerated_groups``);
2. runs the job's recovery (``RLJob.recover``: ``forget_dead``, ``settle_updates``, the
   newest checkpoint when a training model-stage lost its last copy, a retry if another
   worker dies) with the async adapter's replan (``AsyncAdapter.after_fault``);
3. rewinds the ledger with a restored checkpoint; else commits an update the workers
   committed and the ledger did not, or redoes one they did not (its batch stays finished);
4. resumes the producers after a weight sync; the ``fault`` event adds
   ``regenerated_groups`` and ``rewound_groups``.

A rewind issues again every group trained after the checkpoint and every finished one not
yet trained: their tokens came from weights that no longer exist (their version numbers
will name other weights), and the run then trains what a run resumed there would.
``ledger_state`` reads a checkpoint's ledger; ``is_own_death`` tells a generation EMU's
own death from one elsewhere. Keeps no copy of the sync machinery; raises what the job's
recovery raises, and ``StateError`` when the devices left cannot hold generation apart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nereus.errors import ActorDied, PeerDied, StateError
from nereus.job.recovery import Fault, is_fault, update_counts

__all__ = ["AsyncRecovery", "GenerationLost", "is_own_death", "ledger_state"]

log = logging.getLogger("nereus.rl")

NOTICE_S = 10.0  # how long a death seen from a survivor waits for the cluster's notice


class GenerationLost(StateError):
    """Every policy-generation EMU died: the async run cannot generate."""


def ledger_state(
    saved: dict[str, Any], batch_groups: int, steps: int, per_prompt: int = 1
) -> dict[str, Any]:
    """The async ledger (``AsyncLedger.state_dict``) a checkpoint's ``job.json`` holds.
    One without it (a synchronous run's, or the one a job with ``[adapt]`` saves before
    its first step) trained exactly the entries before its dataset position (which
    counts prompts: ``per_prompt`` entries each, a PPO prompt's samples)."""
    if "async" in saved:
        return saved["async"]
    position = int(saved["dataset"]["position"]) * per_prompt
    step = int(saved["step"])
    origin = position - step * batch_groups
    return {
        "frontier": position,
        "trained": [],
        "next_new": position,
        "end": origin + steps * batch_groups,
        "origin": origin,
    }


async def is_own_death(
    stages: Any, devices: tuple[int, ...], error: Exception, lost: set[int]
) -> bool:
    """Whether ``error`` (``is_fault``) means a worker on ``devices`` died. An ``ActorDied``
    or ``PeerDied`` names the dead; a death seen from a survivor (a remote error) waits up
    to ``NOTICE_S`` for the cluster's notice of a device of the plan not in ``lost``
    (already handled); with none, a death with no device named counts as ``devices``'."""
    if isinstance(error, ActorDied) and error.device is not None:
        return int(error.device) in devices
    if isinstance(error, PeerDied) and any(d is not None for d in error.devices):
        return bool(set(error.devices) & set(devices))
    deadline = time.monotonic() + NOTICE_S
    while True:
        stages.failure_event.clear()  # cleared before the look, so a notice after it wakes us
        news = ({f.device for f in stages.failures} & set(stages.plan.devices)) - lost
        if news:
            return bool(news & set(devices))
        try:
            await asyncio.wait_for(stages.failure_event.wait(), deadline - time.monotonic())
        except asyncio.TimeoutError:
            break
    device = getattr(error, "device", None)
    return device is None or int(device) in devices


class AsyncRecovery:
    """See the module docstring."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.job = run.job
        self.stages = run.stages
        self.full_plan = self.stages.plan  # the last plan with every model-stage
        self.rewound_groups = 0

    async def guarded(self, work: Callable[[], Awaitable[Any]], during: str) -> Any:
        """``await work()``; None after recovering from a death inside it (see the module
        docstring); anything else is raised."""
        run, job = self.run, self.job
        counts: dict[str, list[int]] = {}  # a death before they are read: nothing committed
        start = (job.step, job.dataset.state_dict(), run.version, counts)
        if set(self.stages.plan.names) >= set(self.full_plan.names):
            self.full_plan = self.stages.plan
        try:
            if during == "update":
                counts.update(await update_counts(self.stages))
            return await work()
        except Exception as e:
            if not (is_fault(e) or isinstance(e, GenerationLost)):
                raise
            batch = list(run.training)
            await self._recover(e, during, start, batch)
            return None

    async def _recover(self, error: Exception, during: str, start: tuple, batch: list[Any]) -> None:
        run, job = self.run, self.job
        step0, _, version0, _ = start
        regenerated0 = run.ledger.regenerated_groups
        rewound0 = self.rewound_groups
        await run.pause(after_fault=True)

        async def replan(step: int, dead: list[int]) -> None:
            await run.adapter.after_fault(step, dead, self.full_plan)
            self.full_plan = self.stages.plan

        async def settle(fault: Fault) -> dict[str, Any]:
            await run.pause(after_fault=True)  # a resume that another death stopped
            if not fault.restored_from:
                await self._settle_update(fault, during, batch, step0, version0)
            await run.resume()
            return {
                "regenerated_groups": run.ledger.regenerated_groups - regenerated0,
                "rewound_groups": self.rewound_groups - rewound0,
            }

        await job.recover(error, during, start, replan=replan, restored=self._rewind, settle=settle)

    async def _settle_update(
        self, fault: Fault, during: str, batch: list[Any], step0: int, version0: int
    ) -> None:
        """No checkpoint was restored: the update in flight stands or runs again."""
        run = self.run
        if run.version > version0:
            fault.committed = True  # the ledger committed it: the death came in the weight sync
        elif fault.committed and batch:
            await run.commit(batch)  # the workers stepped; the reply went with the death
        elif during == "update" and batch:
            fault.redone = True  # its batch is still finished: the next update trains it
        self.job.step = step0 + run.version - version0

    async def _rewind(self, checkpoint: Path) -> None:
        """The job restored ``checkpoint`` (``RLJob.recover``): the ledger, the version and
        the run's records go back with it (see the module docstring)."""
        run, ledger = self.run, self.run.ledger
        saved = json.loads((checkpoint / "job.json").read_text())
        version = int(saved["policy_version"])
        after = [t for t in run.trained_log if t[0] >= version]
        rewound = self.rewound_groups
        self.rewound_groups += len(after) + len(ledger.finished)
        counters = ledger.regenerated_groups, ledger.restarted_groups
        first = ledger.start  # the run's first position: those below the frontier stay trained
        state = ledger_state(saved, run.B, run.cfg.run.steps, run.shape.per_prompt)
        ledger.end = int(state["end"])
        ledger.load_state_dict(state)
        ledger.regenerated_groups, ledger.restarted_groups = counters
        ledger.trained |= set(range(first, ledger.start))
        run.version = version
        self.stages.policy_version = version
        run.trained_log = [t for t in run.trained_log if t[0] < version]
        ledger.staleness = Counter(
            u - v for u, _, _, rows in run.trained_log for row in rows for v in row
        )
        run.records = [r for r in run.records if r["step"] < self.job.step]
        log.warning(
            "async: back to %s (update %d): %d groups trained or finished after it are "
            "issued again",
            checkpoint.name,
            self.job.step,
            self.rewound_groups - rewound,
        )
