"""The four policies of ``nereus.planner.policies``, one definition for the simulator and
the running job: each simulated run's boundary reports, replayed through
``nereus.planner.replay`` (which rebuilds the policy from the first report), give the
decisions the simulator took; every-k acts on soft triggers only every k steps and
relabels its targets like the other policies; static never changes a model-stage's TP
or PP and relieves a measured memory failure with waves or recompute."""

from __future__ import annotations

import math

import pytest

from nereus.errors import ConfigError
from nereus.planner.policies import POLICIES, SIM_NAMES, PolicySpec, make_replanner, relieved
from nereus.planner.replay import replay
from nereus.sim.compare import run_policies
from nereus.sim.policies import AdaptivePolicy
from tests.sim.helpers import small_scenario

pytestmark = pytest.mark.timeout(300)

# the simulator's name of each planner policy
RUN_AS = {"payback": "adaptive", "always": "dynarl", "every-k": "every-k", "static": "static"}


def _decided(outcome) -> tuple:
    d = outcome.decision
    return (
        [t.kind for t in outcome.triggers],
        d.action,
        d.admitted,
        d.target.plan.to_dict() if d.target is not None else None,
    )


def _recorded(r: dict) -> tuple:
    return (r["triggers"], r["action"], r["admitted"], r["target"])


@pytest.fixture(scope="module")
def simulated():
    """Each policy on a scenario whose pool changes and whose lengths grow, with its
    boundary reports (since its last fresh start) kept as they were written."""
    scn = small_scenario(
        memory_gib=32, steps=12, counts=[16, 16, 12, 12, 16, 16, 8, 8, 16] * 40, gap_s=400.0
    )
    kept: dict[str, list[list[dict]]] = {}
    real = AdaptivePolicy._fresh

    def fresh(self, b):
        plan = real(self, b)
        kept.setdefault(self.name, []).append(self.boundaries)
        return plan

    AdaptivePolicy._fresh = fresh
    try:
        runs = {r.policy: r for r in run_policies(scn, tuple(RUN_AS.values()))}
    finally:
        AdaptivePolicy._fresh = real
    return scn, runs, kept


def test_every_name_maps_onto_the_planners_four():
    assert set(RUN_AS) == set(POLICIES) and {SIM_NAMES[v] for v in RUN_AS.values()} == set(POLICIES)
    with pytest.raises(ConfigError, match="adapt.policy"):
        PolicySpec("sometimes")
    with pytest.raises(ConfigError, match="adapt.every_k"):
        PolicySpec("every-k", every_k=0)
    assert (
        PolicySpec("always").admission_gamma == math.inf
        and PolicySpec("payback", gamma=0.7).admission_gamma == 0.7
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_the_simulators_decisions_replay_identically(simulated, policy):
    _, runs, kept = simulated
    name = RUN_AS[policy]
    assert runs[name].steps == 12
    segments = [s for s in kept[name] if s]
    assert segments, f"{name} recorded no boundary"
    for records in segments:
        assert records[0]["replanner"]["policy"] == policy
        _, outcomes = replay(records)
        assert [_decided(o) for o in outcomes] == [_recorded(r) for r in records]


def test_the_policies_decide_differently_on_the_same_run(simulated):
    _, _, kept = simulated
    actions = {
        p: [(r["step"], r["action"], r["admitted"]) for s in kept[RUN_AS[p]] for r in s]
        for p in POLICIES
    }
    assert len({tuple(a) for a in actions.values()}) >= 2


def test_every_k_acts_on_soft_triggers_only_every_k_steps(simulated):
    _, _, kept = simulated
    for records in kept["every-k"]:
        for r in records:
            soft_only = (
                r["triggers"]
                and not r["lost"]
                and not r["drained"]
                and "memory" not in r["triggers"]
            )
            if soft_only:
                assert r["step"] % 3 == 0, r["step"]
        assert (
            any("periodic" in r["triggers"] for r in records if r["step"] % 3 == 0) or not records
        )


def test_static_never_changes_tp_or_pp(simulated):
    _, _, kept = simulated
    layouts = set()
    for records in kept["static"]:
        for r in [records[0]["replanner"]] + [x for x in records if x["target"] is not None]:
            plan = r["plan"] if "replanner" not in r else r["plan"]
            for name, sp in (r.get("target") or plan).items():
                layouts.add((name, sp["tp"], sp["pp"]))
    names = {n for n, _, _ in layouts}
    assert len(layouts) == len(names), sorted(layouts)


def test_static_relieves_a_measured_failure_without_touching_tp_or_pp(simulated):
    scn, _, kept = simulated
    records = next(s for s in kept["static"] if s)
    rp, _ = replay(records[:1])
    before = rp.plan
    spec = PolicySpec("static")
    again = make_replanner(spec, rp.work, rp.cluster, plan=before, eff=rp.eff)
    out = again.on_boundary(
        records[0]["step"] + 1, failed=True, transition_seconds=lambda a, b: 0.0
    )
    assert out.decision.admitted and "memory" in [t.kind for t in out.triggers]
    after = out.plan
    assert [(n, sp.tp, sp.pp) for n, sp in after] == [(n, sp.tp, sp.pp) for n, sp in before]
    assert after != before and all(
        a.waves >= b.waves and a.recompute >= b.recompute
        for (_, a), (_, b) in zip(after, before, strict=True)
    )
    assert relieved(before, rp.work, rp.cluster, rp.eff, must_fit=False)
