"""A plan's layout rescaled to a grown or shrunk pool, and the Replanner offering it."""

from __future__ import annotations

import math

from nereus.planner import (
    ClusterSpec,
    LengthStats,
    ModelShape,
    Plan,
    Replanner,
    StagePlan,
    Workload,
    explain,
)
from nereus.planner.rescale import layout_of, rescaled

GiB = 2**30


def _setup() -> tuple[Workload, ClusterSpec]:
    model = ModelShape("m", 2048, 4, 16, 4, 32000, 6144)
    work = Workload.for_models(
        "grpo",
        model,
        prompts_per_step=8,
        samples_per_prompt=4,
        prompt_length=256,
        lengths=LengthStats(1000, 1800, 2000),
        reward_model=False,
    )
    cluster = ClusterSpec(
        "test", 4, 4, 16 * GiB, 100e12, 1.5e12, 300e9, 25e9, workspace_bytes=GiB // 2
    )
    return work, cluster


def _plan(work: Workload) -> Plan:
    # generation alone on devices 0-3 (tp 2, 2 replicas), the rest together on 4-7
    out = []
    for s in work.stages:
        out.append(
            (
                s.name,
                StagePlan.on_range(2, 1, 2, 0, waves=2)
                if s.kind == "generation"
                else StagePlan.on_range(2, 2, 1, 4, recompute=s.kind == "training"),
            )
        )
    return Plan(tuple(out))


def test_rescaling_keeps_tp_pp_recompute_pools_and_concurrency():
    work, cluster = _setup()
    plan = _plan(work)
    layout = layout_of(plan, work)
    assert sorted(n for _, n in layout.pools) == [4, 4] and layout.devices == 8
    grown = rescaled(plan, work, cluster)  # 16 devices: each pool doubles
    assert grown is not None and len(grown.devices) == 16
    for name, sp in grown:
        old = plan[name]
        assert (sp.tp, sp.pp, sp.recompute) == (
            old.tp,
            old.pp,
            old.recompute,
        ) and sp.dp == 2 * old.dp
    gen = next(s.name for s in work.stages if s.kind == "generation")
    # the engine's concurrency is kept: twice the replicas decode their sequences in one wave
    assert grown[gen].waves == 1
    # model-stages that shared devices still share them
    others = [n for n, _ in grown if n != gen]
    assert len({grown[n].device_set for n in others}) == 1
    assert not grown[gen].device_set & grown[others[0]].device_set
    assert (
        rescaled(plan, work, cluster.with_nodes(1)) is None
    )  # 2 devices a pool cannot hold tp 2 x pp 2 and tp 2 x 2


def test_a_join_takes_the_rescaled_layout_when_the_best_plan_cannot_be_reached():
    work, cluster = _setup()
    small = cluster.with_nodes(2)
    plan = _plan(work)
    r = Replanner(work, small, plan=plan, join_horizon_steps=20)

    def only_dp_moves(cur: Plan, tgt: Plan) -> float:
        # a move that changes some model-stage's TP, PP or recompute is impossible here
        same = all(
            (cur[n].tp, cur[n].pp, cur[n].recompute) == (sp.tp, sp.pp, sp.recompute)
            for n, sp in tgt
        )
        return 1.0 if same else math.inf

    out = r.on_boundary(
        3, cluster=cluster, joined=list(range(8, 16)), transition_seconds=only_dp_moves
    )
    assert out.decision.action == "transition", out.decision.reason
    assert out.decision.target.label == "rescaled"
    assert len(r.plan.devices) > 8 and all(
        (r.plan[n].tp, r.plan[n].pp) == (plan[n].tp, plan[n].pp) for n, _ in plan
    )
    assert explain(r.plan, work, cluster).step_seconds < explain(plan, work, small).step_seconds


def test_a_compromise_move_is_followed_up_at_the_next_boundary():
    work, cluster = _setup()
    small = cluster.with_nodes(2)
    r = Replanner(work, small, plan=_plan(work), join_horizon_steps=20)

    def only_dp_moves(cur: Plan, tgt: Plan) -> float:
        same = all(
            (cur[n].tp, cur[n].pp, cur[n].recompute) == (sp.tp, sp.pp, sp.recompute)
            for n, sp in tgt
        )
        return 1.0 if same else math.inf

    out = r.on_boundary(
        3, cluster=cluster, joined=list(range(8, 16)), transition_seconds=only_dp_moves
    )
    assert out.decision.target.label == "rescaled" and r.pending is not None
    # nothing else fires at the next boundary; the Replanner searches again from the new plan
    out = r.on_boundary(4, transition_seconds=only_dp_moves)
    assert [t.info["detail"] for t in out.triggers] == ["follow-up"] and not out.triggers[0].hard
    # the best plan is still out of reach and nothing was admitted: no further follow-up
    assert out.decision.action == "keep" and r.pending is None
    assert r.on_boundary(5, transition_seconds=only_dp_moves).decision.reason == "no trigger"
    # when the faster plan can be reached, the follow-up takes it
    r2 = Replanner(work, small, plan=_plan(work), join_horizon_steps=20)
    r2.on_boundary(3, cluster=cluster, joined=list(range(8, 16)), transition_seconds=only_dp_moves)
    out = r2.on_boundary(4, transition_seconds=lambda c, t: 1.0)
    assert out.decision.action == "transition" and out.decision.target.step_seconds < r.step_seconds


def test_devices_that_rounding_leaves_idle_go_to_the_pool_it_served_worst():
    work, cluster = _setup()
    gen = next(s.name for s in work.stages if s.kind == "generation")
    # generation alone on 1 device, the rest together on 2: 3 devices rescaled to 4 give
    # shares of 1.33 and 2.67, rounded to 1 and 2; the idle device goes to generation
    plan = Plan(
        tuple(
            (
                s.name,
                StagePlan.on_range(1, 1, 1, 2)
                if s.kind == "generation"
                else StagePlan.on_range(1, 1, 2, 0),
            )
            for s in work.stages
        )
    )
    four = ClusterSpec(
        "test", 1, 4, 16 * GiB, 100e12, 1.5e12, 300e9, 25e9, workspace_bytes=GiB // 2
    )
    grown = rescaled(plan, work, four)
    assert grown is not None and len(grown.devices) == 4
    assert grown[gen].dp == 2 and all(sp.dp == 2 for n, sp in grown if n != gen)
    assert not grown[gen].device_set & grown[next(n for n, _ in grown if n != gen)].device_set
