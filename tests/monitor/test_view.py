"""The dashboard's fold of tap events into page updates (no server, no browser): the
recorded job's story, the placement per device, inferred plans, failed changes, bad
events, deaths in the log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.monitor import DashboardView

ASSET = Path(__file__).parents[1] / "assets" / "tap" / "grpo_live_layouts.jsonl"
# the same run as the job's own recorder wrote it (out_dir/tap.jsonl): it subscribed after the
# devices joined
JOB_ASSET = ASSET.with_name("grpo_job_recording.jsonl")


def recorded() -> list[dict]:
    return [json.loads(line) for line in ASSET.read_text().splitlines()]


def holders_of(plan: dict) -> dict[str, list[tuple[str, str, int]]]:
    """The expected holders per device, from a raw plan map, independently of the view."""
    out: dict[str, list] = {}
    for stage, sp in plan.items():
        for emu, devices in enumerate(sp["devices"]):
            for d in devices:
                out.setdefault(str(d), []).append((stage, f"tp{sp['tp']}·pp{sp['pp']}", emu))
    return out


def test_the_recorded_job_folds_into_steps_placements_transitions_and_decisions():
    events = recorded()
    view = DashboardView()
    for event in events:
        view.add(event)
    by_kind: dict[str, list] = {}
    for u in view.updates:
        by_kind.setdefault(u["kind"], []).append(u)
    raw = {t: [e for e in events if e["type"] == t] for t in {e["type"] for e in events}}
    assert view.rejected == 0 and view.problems == type(view.problems)()
    assert view.steps == 7 and [u["step"] for u in by_kind["step"]] == list(range(7))
    assert view.epoch == 3

    # a placement from the job's plan, then one after each change, each as the raw plans say
    placements = by_kind["placement"]
    assert [p["why"] for p in placements] == ["plan", "transition", "transition"]
    plans = [raw["plan"][0]["plan"]] + [t["to_plan"] for t in raw["transition"]]
    for placement, plan in zip(placements, plans, strict=True):
        got = {
            d: [(h["model_stage"], h["layout"], h["emu"]) for h in hs]
            for d, hs in placement["holders"].items()
        }
        assert got == holders_of(plan)
    # device 3 holds generation's fourth replica and the reference at first, nothing at the end
    assert placements[0]["holders"]["3"] == [
        {"model_stage": "policy_generation", "layout": "tp1·pp1", "emu": 3},
        {"model_stage": "reference_inference", "layout": "tp1·pp1", "emu": 0},
    ]
    assert "3" not in placements[-1]["holders"]

    # each transition carries the DAG nodes emitted before it, and ends where its placement starts
    transitions = by_kind["transition"]
    assert [(t["epoch_from"], t["epoch_to"]) for t in transitions] == [(1, 2), (2, 3)]
    assert sum(len(t["nodes"]) for t in transitions) == len(raw["transition_node"])
    for t, p in zip(transitions, placements[1:], strict=True):
        assert t["ok"] and p["t"] == t["t_end"] and t["t_start"] < t["t_end"]
        assert all(0 <= n["start_seconds"] <= n["end_seconds"] for n in t["nodes"])
        assert t["bytes"] > 0 and t["predicted_seconds"] > 0

    decisions = by_kind["decision"]
    assert [d["admitted"] for d in decisions] == [True, False, True]
    assert [d["step"] for d in decisions] == [1, 3, 4]
    assert decisions[2]["triggers"] == [{"kind": "device-pool", "detail": "drained", "device": 3}]
    assert decisions[2]["payback_steps"] is None and decisions[1]["payback_steps"] == pytest.approx(
        26.0
    )
    assert decisions[0]["changed"] == [
        "policy_generation",
        "policy_training",
        "reference_inference",
    ]
    # each change written with tp, pp, dp and devices (nereus.planner.plan_text)
    assert decisions[1]["changes"] == [
        ["policy_generation", "tp2·pp1·dp2 [0-3] → tp1·pp1·dp4 [0-3]"]
    ]
    assert transitions[0]["changes"] == [
        ["policy_generation", "tp1·pp1·dp4 [0-3] → tp2·pp1·dp2 [0-3]"],
        ["reference_inference", "tp1·pp1·dp1 [3] → tp1·pp2·dp1 [0,1]"],
        ["policy_training", "tp2·pp1·dp1 [0,1] → tp1·pp1·dp1 [2]"],
    ]
    assert transitions[1]["changes"] == [
        ["policy_generation", "tp2·pp1·dp2 [0-3] → tp1·pp1·dp2 [0,1]"],
        ["reference_inference", "tp1·pp2·dp1 [0,1] → tp1·pp1·dp1 [0]"],
    ]

    # every step carries the weight sync that ran inside it, and each device's ledger peak
    steps = by_kind["step"]
    assert all(s["weight_sync_seconds"] > 0 for s in steps)
    assert steps[-1]["device_peak_bytes"] == {
        k: v for k, v in raw["step"][-1]["device_peak_bytes"].items()
    }
    assert steps[0]["step_seconds"] == raw["step"][0]["stage_seconds"]["step"]
    assert "step" not in steps[0]["stage_seconds"]

    states = [(u["device"], u["state"]) for u in by_kind["device"] if u["device"] == 3]
    assert states == [(3, "joined"), (3, "draining"), (3, "retired")]
    joined = [u for u in by_kind["device"] if u["state"] == "joined"]
    assert {u["budget_bytes"] for u in joined} == {e["memory_bytes"] for e in raw["worker_join"]}
    assert len(by_kind["memory"]) == len(raw["memory"])
    # types the page does not draw are counted, not shown
    assert view.counts["actor_spawn"] == len(raw["actor_spawn"]) and "actor_spawn" not in by_kind


def test_without_a_plan_event_the_first_change_gives_the_placement_before_it():
    events = [e for e in recorded() if e["type"] != "plan"]
    view = DashboardView()
    for event in events:
        view.add(event)
    placements = [u for u in view.updates if u["kind"] == "placement"]
    first = next(e for e in events if e["type"] == "transition")
    assert placements[0]["why"] == "inferred" and placements[0]["t"] == 0.0
    assert {
        d: [(h["model_stage"], h["layout"], h["emu"]) for h in hs]
        for d, hs in placements[0]["holders"].items()
    } == holders_of(first["from_plan"])


def page_budgets(updates: list[dict]) -> dict[str, int | None]:
    """Each device's memory budget as the page ends up with it (dashboard.html ``apply``:
    a placement's ``budget_bytes`` map, a device's or memory reading's ``budget_bytes``)."""
    out: dict[str, int | None] = {}
    for u in updates:
        if u["kind"] == "placement":
            for d in u["holders"]:
                out.setdefault(d, None)
            out.update(u.get("budget_bytes") or {})
        elif u["kind"] == "step":
            for d in u["device_peak_bytes"]:
                out.setdefault(d, None)
        elif u["kind"] in ("device", "memory"):
            out.setdefault(str(u["device"]), None)
            if u["budget_bytes"] is not None:
                out[str(u["device"])] = u["budget_bytes"]
    return out


def test_a_recording_begun_after_the_devices_joined_still_shows_every_budget():
    """``make demo``'s tap.jsonl: the job's recorder subscribed after the starting
    devices joined, so no ``worker_join`` says their budgets; the ``plan`` event does.
    (The recording's ``memory`` events are the recorder script's own, not the job's:
    left out here, as the demo's tap has none.)"""
    job_events = [json.loads(line) for line in JOB_ASSET.read_text().splitlines()]
    assert not [e for e in job_events if e["type"] == "worker_join"]
    budget = next(e for e in recorded() if e["type"] == "worker_join")["memory_bytes"]
    events = [e for e in job_events if e["type"] != "memory"]
    view = DashboardView()
    for event in events:
        view.add(event)
    assert view.rejected == 0
    budgets = page_budgets(view.updates)
    assert budgets == {"0": budget, "1": budget, "2": budget, "3": budget}
    plan = next(u for u in view.updates if u["kind"] == "placement")
    assert plan["why"] == "plan" and plan["budget_bytes"] == {d: budget for d in "0123"}

    # the same stream with the plan event's budgets taken out: nothing else says them
    bare = [{k: v for k, v in e.items() if k != "device_memory_bytes"} for e in events]
    view = DashboardView()
    for event in bare:
        view.add(event)
    assert page_budgets(view.updates) == {"0": None, "1": None, "2": None, "3": None}


def _event(type_: str, t: float, **fields) -> dict:
    return {
        "type": type_,
        "v": 1,
        "seq": 1,
        "time_monotonic_seconds": t,
        "epoch": 1,
        "source": "driver",
    } | fields


PLAN = {
    "policy_generation": {"tp": 2, "pp": 1, "dp": 1, "devices": [[0, 1]]},
    "policy_training": {"tp": 1, "pp": 1, "dp": 1, "devices": [[1]]},
}
MOVED = {
    "policy_generation": {"tp": 1, "pp": 1, "dp": 2, "devices": [[0], [1]]},
    "policy_training": {"tp": 1, "pp": 1, "dp": 1, "devices": [[2]]},
}


def test_a_change_that_stopped_part_way_leaves_the_placement_as_it_was():
    view = DashboardView()
    view.add(_event("plan", 10.0, plan=PLAN, predicted_step_seconds=1.5))
    view.add(
        _event(
            "transition_node",
            11.0,
            node=0,
            kind="split",
            model_stage="policy_generation",
            devices=[0, 1],
            bytes=10,
            start_seconds=0.0,
            end_seconds=0.4,
            ok=False,
        )
    )
    out = view.add(
        _event(
            "transition",
            11.5,
            from_plan=PLAN,
            to_plan=MOVED,
            changed=["policy_generation"],
            bytes=10,
            measured_seconds=1.0,
            predicted_seconds=0.5,
            epoch_from=1,
            ok=False,
        )
    )
    assert [u["kind"] for u in out] == ["transition"]
    assert out[0]["epoch_to"] == 1 and not out[0]["ok"] and len(out[0]["nodes"]) == 1
    assert out[0]["t_start"] == pytest.approx(0.5) and out[0]["t_end"] == pytest.approx(1.5)
    assert view.plan is not None and view.plan["policy_training"]["devices"] == [[1]]
    placements = [u for u in view.updates if u["kind"] == "placement"]
    assert len(placements) == 1 and placements[0]["predicted_step_seconds"] == 1.5


def test_dp_and_placement_changes_read_as_changes_in_decisions_and_transitions():
    view = DashboardView()
    view.add(_event("plan", 10.0, plan=PLAN, predicted_step_seconds=1.5))
    decision = view.add(
        _event(
            "decision",
            10.5,
            step=4,
            triggers=[{"kind": "drift", "detail": "length"}],
            current_plan=PLAN,
            target_plan=MOVED,
            admitted=True,
            reason="payback",
        )
    )[0]
    transition = view.add(
        _event(
            "transition",
            11.5,
            from_plan=PLAN,
            to_plan=MOVED,
            bytes=10,
            measured_seconds=1.0,
            changed=["policy_generation", "policy_training"],
            epoch_from=1,
            ok=True,
        )
    )[0]
    expected = [
        ["policy_generation", "tp2·pp1·dp1 [0,1] → tp1·pp1·dp2 [0,1]"],
        ["policy_training", "tp1·pp1·dp1 [1] → tp1·pp1·dp1 [2]"],
    ]
    assert decision["changes"] == expected and transition["changes"] == expected


@pytest.mark.parametrize(
    "event, problem",
    [
        (_event("step", 1.0, step="three"), "step='three' must be an integer"),
        (_event("step", 1.0, step=3, reward=float("nan")), "reward=nan must be a finite number"),
        (
            _event("step", 1.0, step=3, model_stage_seconds=[1, 2]),
            "model_stage_seconds=[1, 2] must be a map",
        ),
        (
            _event("plan", 1.0, plan={"policy_generation": {"tp": 0, "pp": 1, "devices": [[0]]}}),
            "plan.policy_generation.tp=0 must be an integer >= 1",
        ),
        (
            _event("plan", 1.0, plan={"policy_generation": {"tp": 1, "pp": 1, "devices": [0]}}),
            "plan.policy_generation.devices=[0] must be a list of EMUs",
        ),
        (
            _event("memory", 1.0, device=0, used_bytes="lots"),
            "used_bytes='lots' must be an integer",
        ),
        (
            _event("plan", 1.0, plan=PLAN, device_memory_bytes={"gpu0": 1}),
            "key 'gpu0'; it must be a device index",
        ),
        (
            _event(
                "plan",
                1.0,
                plan={"policy_generation": {"tp": 1, "pp": 1, "devices": [[0]], "waves": 0}},
            ),
            "plan.policy_generation.waves=0 must be an integer >= 1",
        ),
        (
            _event("transition", 1.0, from_plan=PLAN, to_plan=MOVED),
            "measured_seconds=None must be a finite number",
        ),
        ({"no": "type"}, "must be a map with a string 'type'"),
    ],
)
def test_a_bad_event_is_counted_and_named_and_the_stream_goes_on(event, problem):
    view = DashboardView()
    assert view.add(event) == []
    assert view.rejected == 1 and problem in view.problems[-1]
    out = view.add(_event("step", 2.0, step=0, reward=0.5, stage_seconds={"step": 1.0}))
    assert [u["kind"] for u in out] == ["step"] and out[0]["step_seconds"] == 1.0


def test_failures_and_deaths_reach_the_log():
    view = DashboardView()
    view.add(_event("worker_join", 0.0, device=2, node_id="a", memory_bytes=1 << 30))
    out = view.add(_event("worker_death", 3.0, device=2, node_id="a", reason="SIGKILL"))
    assert out[0] == {
        "kind": "device",
        "t": 3.0,
        "device": 2,
        "state": "died",
        "node_id": "a",
        "budget_bytes": 1 << 30,
        "reason": "SIGKILL",
    }
    assert out[1]["kind"] == "note" and out[1]["level"] == "error" and "SIGKILL" in out[1]["text"]
    note = view.add(
        _event(
            "stuck_collective", 4.0, group="g1", op="all_reduce", missing_ranks=[1], seconds=30.0
        )
    )
    assert "all_reduce" in note[0]["text"] and "[1]" in note[0]["text"]
