"""Admission sequences against recorded boundary reports.

``data/demo_boundaries.jsonl`` holds the ``boundary`` events of one run of ``make demo``
(80 steps of GRPO on 4 CPU devices: the length cap grows 16 -> 32 -> 64, a device is
drained before step 50 and a fresh one joins before step 60), as the job put them on
its tap. Replayed through a fresh Replanner they give the decisions the job made; among
them drifts with no saving to be had (rejected, and the reference reset to the lengths of
that boundary), a memory overflow predicted from the next cap (urgent), a drained device
(urgent) and a join judged by the payback rule (taken: generation's DP grows back onto
the new device, paying back well inside gamma times the pool's mean lifetime)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.planner import Plan, boundary_record, replay
from nereus.planner.replay import workload_from_dict, workload_to_dict

RECORDED = Path(__file__).with_name("data") / "demo_boundaries.jsonl"


def recorded() -> list[dict]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines() if line.strip()]


def decided(outcome) -> tuple:
    d = outcome.decision
    return (
        [t.kind for t in outcome.triggers],
        d.action,
        d.admitted,
        d.target.plan.to_dict() if d.target is not None else None,
    )


def test_the_recorded_run_replays_decision_for_decision():
    records = recorded()
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    _, outcomes = replay(records)
    assert len(outcomes) == len(records)
    for r, o in zip(records, outcomes, strict=True):
        assert decided(o) == (r["triggers"], r["action"], r["admitted"], r["target"]), r["step"]
    kinds = {k for r in records for k in r["triggers"]}
    assert {"memory", "drift", "device-pool"} <= kinds
    # the urgent ones were taken; a memory trigger came before the cap that needed it
    memory = next(r for r in records if "memory" in r["triggers"])
    assert (
        memory["admitted"]
        and memory["work"]["memory_lengths"]["max"] > memory["work"]["lengths"]["max"]
    )
    drained = next(r for r in records if r["drained"])
    assert drained["admitted"]


def test_a_rejected_drift_resets_the_reference_and_does_not_fire_again_until_lengths_move():
    records = recorded()
    i = next(i for i, r in enumerate(records) if r["triggers"] == ["drift"] and not r["admitted"])
    rp, outcomes = replay(records[: i + 1])
    rejected = outcomes[-1]
    assert rejected.decision.action == "keep" and not rejected.decision.admitted
    signal = rp.monitor.signals["length"]
    mean = records[i]["work"]["lengths"]["mean"]
    assert signal.reference == pytest.approx(mean) and signal.reference_step == records[i]["step"]
    # until the next drift trigger, lengths stay within the threshold of the new reference
    for r in records[i + 1 :]:
        moved = abs(r["work"]["lengths"]["mean"] - mean) / mean
        if "drift" in r["triggers"]:
            assert moved > signal.threshold
            break
        assert moved <= signal.threshold or r["triggers"], r["step"]


def test_a_join_is_judged_by_payback_and_gamma_moves_the_verdict():
    records = recorded()
    i = next(i for i, r in enumerate(records) if r["joined"])
    assert "device-pool" in records[i]["triggers"]
    _, outcomes = replay(records[: i + 1])
    join = outcomes[-1]
    assert not any(t.hard for t in join.triggers)  # a join is soft
    assert join.decision.limit_steps is not None and join.decision.payback_steps is not None
    assert join.decision.admitted == (join.decision.payback_steps <= join.decision.limit_steps)
    # the same boundaries under another gamma: the join's verdict flips, the urgent ones stay
    other = 1e-6 if join.decision.admitted else 1e6
    _, again = replay(records[: i + 1], gamma=other)
    assert again[-1].decision.admitted != join.decision.admitted
    for a, b in zip(again[:-1], outcomes[:-1], strict=True):
        if any(t.hard for t in a.triggers):
            assert decided(a) == decided(b)


def test_a_target_the_run_never_priced_is_refused_by_name():
    records = recorded()
    i = next(i for i, r in enumerate(records) if r["priced"])
    broken = [dict(r) for r in records[: i + 1]]
    broken[-1]["priced"] = []
    with pytest.raises(ConfigError, match=f"step {broken[-1]['step']}: target"):
        replay(broken)
    with pytest.raises(ConfigError, match="records\\[0\\]"):
        replay(records[1:])


def test_records_round_trip_as_plain_data():
    records = recorded()
    work = workload_from_dict(records[0]["work"])
    assert workload_to_dict(work) == records[0]["work"]
    rp, outcomes = replay(records[:1])
    init = records[0]["replanner"]
    again = boundary_record(
        rp,
        outcomes[0],
        eff=rp.eff,
        priced={Plan.from_dict(p): s for p, s in records[0]["priced"]},
        first=True,
        initial=(
            workload_from_dict(init["work"]),
            rp.cluster,
            Plan.from_dict(init["plan"]),
            rp.eff,
        ),
    )
    json.dumps(again)  # JSON safe
    for key in ("step", "triggers", "action", "admitted", "target", "work", "plan"):
        assert again[key] == records[0][key], key
