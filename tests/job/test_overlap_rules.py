"""What a change started with overlap holds back, when ``[adapt] overlap = "auto"`` runs
it beside the next step, and how the wait for it behaves: every model-stage that waits
waits until the change is done, its failure reaches every one of them, and recovery does
not swallow a failure that is not a worker's death. No processes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nereus.config import from_dict
from nereus.errors import ActorDied, ConfigError
from nereus.job.config import AdaptConfig
from nereus.job.overlap import held_back, overlaps
from nereus.job.plan_changes import PlanChanges
from nereus.job.recovery import forget_dead
from nereus.planner.plan import StagePlan


def _sp(*replicas: tuple[int, ...]) -> StagePlan:
    return StagePlan(1, 1, len(replicas), tuple(replicas))


CURRENT = {
    "policy_generation": _sp((0,), (1,)),
    "reference_inference": _sp((1,)),
    "policy_training": _sp((2,), (3,)),
}


def test_a_change_holds_back_what_it_changes_and_whatever_shares_a_device_with_it():
    # training shrinks onto device 2: generation and the reference keep devices 0 and 1
    target = {**CURRENT, "policy_training": _sp((2,))}
    assert held_back(CURRENT, target, ["policy_training"], {3}) == {"policy_training"}
    # training grows onto device 1: the reference there waits, and so does generation
    target = {**CURRENT, "policy_training": _sp((1,), (2,), (3,))}
    held = held_back(CURRENT, target, ["policy_training"], {1})
    assert held == {"policy_training", "reference_inference", "policy_generation"}
    # generation decodes in more waves (its engines restart, nothing moves): it waits,
    # and so does the reference on its device 1, though the DAG touches no device
    target = {**CURRENT, "policy_generation": StagePlan(1, 1, 2, ((0,), (1,)), waves=2)}
    held = held_back(CURRENT, target, ["policy_generation"], set())
    assert held == {"policy_generation", "reference_inference"}
    # a model-stage a fault left without an EMU is built on device 3: training waits
    current = {s: sp for s, sp in CURRENT.items() if s != "reference_inference"}
    target = {**current, "reference_inference": _sp((3,))}
    held = held_back(current, target, ["reference_inference"], set())
    assert held == {"reference_inference", "policy_training"}


def test_auto_overlaps_where_generation_is_free_on_devices_of_fixed_compute():
    free, held = {"policy_training"}, {"policy_training", "policy_generation"}
    assert overlaps("auto", free, fixed_compute=True)
    assert not overlaps("auto", held, fixed_compute=True)  # the step waits at its first call
    assert not overlaps("auto", free, fixed_compute=False)  # shared cores: nothing to gain
    assert overlaps(True, held, fixed_compute=False) and not overlaps(False, free, True)
    with pytest.raises(ConfigError, match="adapt.overlap"):
        overlaps("sometimes", free, True)


def test_overlap_is_auto_by_default_and_checked():
    assert AdaptConfig().overlap == "auto"
    assert from_dict(AdaptConfig, {"overlap": False}).overlap is False
    with pytest.raises(ConfigError, match="adapt.overlap"):
        from_dict(AdaptConfig, {"overlap": "yes"})
    with pytest.raises(ConfigError, match="adapt.overlap"):
        AdaptConfig(overlap=1)


def _running(changes: PlanChanges, work, held: set[str]) -> None:
    changes._waiting, changes._report = held, {}
    changes._transition = asyncio.ensure_future(work)


async def test_every_held_model_stage_waits_for_the_change_and_the_rest_run_beside_it():
    changes = PlanChanges(SimpleNamespace(last_transition=None), None)
    order: list[str] = []
    gate = asyncio.Event()

    async def change() -> dict:
        await gate.wait()
        order.append("change done")
        return {"ok": True}

    async def work(stage: str) -> None:
        await changes.ready(stage)
        order.append(stage)

    _running(changes, change(), {"policy_training", "critic_training"})
    waiters = [
        asyncio.ensure_future(work(s))
        for s in ("policy_training", "critic_training", "policy_generation")
    ]
    await asyncio.sleep(0.05)
    assert order == ["policy_generation"] and "policy_generation" in changes._report["ran_beside"]
    gate.set()
    await asyncio.gather(*waiters)
    assert order == ["policy_generation", "change done", "policy_training", "critic_training"]
    assert not changes.running and changes.state.last_transition == {"ok": True}


async def test_a_failed_change_reaches_every_model_stage_that_waits_for_it():
    changes = PlanChanges(SimpleNamespace(last_transition=None), None)
    gate = asyncio.Event()

    async def change() -> dict:
        await gate.wait()
        raise ActorDied("host", 3)

    _running(changes, change(), {"policy_training", "critic_training"})
    waiters = [
        asyncio.ensure_future(changes.ready(s)) for s in ("policy_training", "critic_training")
    ]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in waiters)
    gate.set()
    got = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(e, ActorDied) for e in got), got
    assert not changes.running and await changes.transition_done() is None


async def test_recovery_raises_a_failure_of_the_change_that_is_not_a_death():
    async def transition_done() -> None:
        raise ValueError("a change that went wrong on its own")

    stages = SimpleNamespace(transition_done=transition_done)
    with pytest.raises(ValueError, match="on its own"):
        await forget_dead(stages, {3})
