"""Async plans priced as a pipeline: the slower side plus the sync; longer responses move
devices from training to generation; PPO's critic and the reference priced on the training
side, ReMax's greedy rows on the generation side."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.errors import InfeasiblePlan
from nereus.planner import ClusterSpec
from nereus.planner.async_cost import async_step_seconds, search_async, snapshot_bytes
from nereus.planner.candidates import stage_candidates
from nereus.planner.cost import CONSERVATIVE, usable_bytes
from nereus.planner.workload import LengthStats, ModelShape, Workload

GiB = 2**30
CLUSTER = ClusterSpec(
    name="test-1x8",
    nodes=1,
    devices_per_node=8,
    device_memory_bytes=80 * GiB,
    peak_flops=100e12,
    memory_bandwidth=1.5e12,
    intra_node_bandwidth=300e9,
    inter_node_bandwidth=25e9,
    workspace_bytes=GiB // 4,
)
MODEL = ModelShape("m24x2048", 2048, 24, 16, 4, 32000, 2048 * 3)


def _work(length: int, algorithm: str = "grpo") -> Workload:
    return Workload.for_models(
        algorithm,
        MODEL,
        prompts_per_step=24,
        samples_per_prompt=8,
        prompt_length=256,
        lengths=LengthStats(length * 0.5, length * 0.9, length),
        reward_model=False,
        value=None,
    )


def test_the_price_is_the_slower_side_generation_with_its_sync_training_with_its_publish():
    assert async_step_seconds(3.0, 2.0, 0.5) == 3.5
    assert async_step_seconds(1.0, 2.0, 0.5) == 2.0  # the sync overlaps the training side
    assert async_step_seconds(1.0, 2.0, 0.5, 0.25) == 2.25
    got = search_async(_work(1024), CLUSTER)
    gen = got.plan["policy-generation"]
    assert 0 < got.publish_seconds < got.sync_seconds  # a local copy of a share, not a send
    assert got.step_seconds == pytest.approx(
        max(
            got.generation_seconds + got.sync_seconds,
            got.training_seconds + got.publish_seconds,
        )
    )
    assert gen.device_set.isdisjoint(got.plan["policy-training"].device_set)
    # the generation side's price is the fastest candidate of the same cost model on its devices
    fastest = min(
        c.seconds
        for c in stage_candidates(_work(1024), CLUSTER, CONSERVATIVE, 0, got.generation_devices)
    )
    assert got.generation_seconds == pytest.approx(fastest)


def test_longer_responses_move_devices_to_generation():
    splits = [search_async(_work(n), CLUSTER).generation_devices for n in (64, 512, 4096, 16384)]
    assert splits == sorted(splits) and splits[-1] > splits[0], splits


def test_one_device_cannot_run_generation_apart():
    with pytest.raises(InfeasiblePlan, match="at least 2 devices"):
        search_async(_work(256), CLUSTER, budget=1)


def test_ppo_prices_the_critic_and_the_reference_on_the_training_side():
    work = _work(1024, "ppo")
    names = [s.name for s in work.stages]
    assert {"critic-inference", "critic-training", "reference-inference"} <= set(names)
    got = search_async(work, CLUSTER, budget=8, generation_devices=4)
    # every model-stage but generation shares the other devices, so their times add
    assert got.training_seconds == pytest.approx(
        sum(
            min(c.seconds for c in stage_candidates(work, CLUSTER, CONSERVATIVE, i, 4))
            for i, name in enumerate(names)
            if name != "policy-generation"
        )
    )
    gen = got.plan["policy-generation"].device_set
    for name in names:
        if name != "policy-generation":
            assert got.plan[name].device_set.isdisjoint(gen), name
    grpo = search_async(_work(1024), CLUSTER, budget=8, generation_devices=4)
    assert got.training_seconds > grpo.training_seconds


def test_remax_prices_its_greedy_rows_on_the_generation_side():
    remax = search_async(_work(1024, "remax"), CLUSTER, budget=8, generation_devices=4)
    grpo = search_async(_work(1024), CLUSTER, budget=8, generation_devices=4)
    assert _work(1024, "remax").sequences == _work(1024).sequences + 24
    assert remax.generation_seconds > grpo.generation_seconds


def test_policy_training_fits_beside_its_snapshot():
    """The training layout picked leaves room for the snapshot on its devices; on some
    device sizes that rules out the layout that would be fastest without it."""
    work = _work(512)
    training = [s.name for s in work.stages].index("policy-training")
    ruled_out = 0
    for gib in (8, 9, 10, 12, 16, 24):
        cluster = replace(CLUSTER, device_memory_bytes=gib * 2**30)
        try:
            got = search_async(work, cluster)
        except InfeasiblePlan:
            continue
        t = got.plan["policy-training"]
        cap = usable_bytes(cluster) - cluster.workspace_bytes
        cands = stage_candidates(work, cluster, CONSERVATIVE, training, 8 - got.generation_devices)
        [chosen] = [
            c for c in cands if (c.tp, c.pp, c.dp, c.recompute) == (t.tp, t.pp, t.dp, t.recompute)
        ]
        assert chosen.resident + chosen.transient + snapshot_bytes(work, t.tp, t.pp) <= cap
        ruled_out += min(cands, key=lambda c: c.seconds) != chosen
    assert ruled_out > 0
