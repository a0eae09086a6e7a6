"""Devices of a fixed CPU capacity: priced per device, the heavier pool on the faster."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.errors import ConfigError
from nereus.planner import (
    CONSERVATIVE,
    LengthStats,
    ModelShape,
    Plan,
    StagePlan,
    Workload,
    explain,
    search,
)
from nereus.planner.candidates import stage_candidates
from nereus.planner.cluster import local_cpu_cluster
from nereus.planner.search import place_by_capacity

MiB = 2**20


def _cluster(cores: list[float] | None, devices: int = 4, memory: int = 64 * MiB):
    return local_cpu_cluster(
        devices,
        memory,
        flops_per_device=2e10,
        memory_bandwidth=5e9,
        exchange_bandwidth=4e9,
        cores=2,
        device_cores=cores,
    )


def _work(length: int = 64) -> Workload:
    model = ModelShape("tiny", 256, 4, 4, 4, 512, 512)
    return Workload.for_models(
        "grpo",
        model,
        prompts_per_step=16,
        samples_per_prompt=8,
        prompt_length=8,
        lengths=LengthStats(length, length, length),
        reward_model=False,
        micro_batch=2,
    )


def test_a_device_computes_its_cores_worth():
    work = _work()
    plan = Plan(tuple((s.name, StagePlan.on_range(1, 1, 1, 0)) for s in work.stages))
    half = explain(plan, work, _cluster([0.5] * 4), CONSERVATIVE).step_seconds
    quarter = explain(plan, work, _cluster([0.25] * 4), CONSERVATIVE).step_seconds
    assert quarter == pytest.approx(2 * half, rel=1e-9)
    # the same plan on a faster device of a mixed cluster is priced at that device's cores
    moved = Plan(tuple((n, StagePlan.on_range(1, 1, 1, 3)) for n, _ in plan))
    assert explain(
        moved, work, _cluster([0.25, 0.25, 0.25, 0.5]), CONSERVATIVE
    ).step_seconds == pytest.approx(half, rel=1e-9)


def test_the_heavier_model_stage_goes_to_the_faster_devices():
    work = _work()
    cluster = _cluster([0.25, 0.25, 0.5, 0.5])
    by_name = {s.name: s for s in work.stages}
    assert set(by_name) == {"policy-generation", "policy-training", "reference-inference"}
    # generation and training apart, two devices each, the wrong way round to start
    separated = Plan(
        (
            ("policy-generation", StagePlan.on_range(1, 1, 2, 2)),
            ("reference-inference", StagePlan.on_range(1, 1, 2, 2)),
            ("policy-training", StagePlan.on_range(1, 1, 2, 0)),
        )
    )
    ex = explain(separated, work, cluster, CONSERVATIVE)
    seconds = {s.name: s.cost.seconds for s in ex.stages}
    heavier = max(seconds, key=seconds.get)
    placed, step = place_by_capacity(separated, work, cluster, CONSERVATIVE)
    assert placed[heavier].devices == ((2,), (3,))
    assert step < ex.step_seconds
    assert step == pytest.approx(explain(placed, work, cluster, CONSERVATIVE).step_seconds)
    # the search places what it picks the same way: no order of its pools is faster
    got = search(work, cluster, CONSERVATIVE)
    assert got.step_seconds == pytest.approx(
        explain(got.plan, work, cluster, CONSERVATIVE).step_seconds
    )
    again, best = place_by_capacity(got.plan, work, cluster, CONSERVATIVE)
    assert best == pytest.approx(got.step_seconds)


def test_capacities_are_checked():
    with pytest.raises(ConfigError, match="device_cores"):
        _cluster([0.5, 0.5])
    with pytest.raises(ConfigError, match="device_cores"):
        _cluster([0.5, 0.5, 0.0, 0.5])


def test_capped_collectives_are_a_ring_of_wake_ups():
    capped, shared = _cluster([0.5] * 4), _cluster(None)
    assert [capped.collective_latency_steps(n) for n in (1, 2, 4)] == [0, 2, 6]
    assert [shared.collective_latency_steps(n) for n in (1, 2, 4)] == [0, 2, 4]


def test_a_one_node_pool_shrinks_by_single_devices_as_a_running_job_describes_it():
    # a running job on 4 worker processes that loses 2 plans for local_cpu_cluster(2, ...)
    two = _cluster([0.45] * 4).with_devices(2)
    want = _cluster([0.45] * 2, devices=2)
    assert dataclasses.replace(two, name=want.name) == want
    assert (two.nodes, two.devices_per_node, two.device_cores) == (1, 2, (0.45, 0.45))
    assert _cluster([0.45] * 4).with_devices(4) == _cluster([0.45] * 4)
    # one node of 2 still holds a TP 2 replica; two nodes of 1 (the whole-node view of
    # the same pool) cannot, so the two shapes search different spaces
    work = _work()
    tps = {c.tp for c in stage_candidates(work, two, CONSERVATIVE, 0, 2, prune=False)}
    nodes = _cluster([0.45], devices=1).with_nodes(2)
    split = {c.tp for c in stage_candidates(work, nodes, CONSERVATIVE, 0, 2, prune=False)}
    assert tps == {1, 2} and split == {1}


def test_several_nodes_change_by_whole_nodes_and_unlike_devices_are_named():
    nodes = _cluster([0.45] * 2, devices=2).with_nodes(3)
    assert nodes.with_devices(4).nodes == 2
    with pytest.raises(ConfigError, match="whole nodes of 2 devices"):
        nodes.with_devices(3)
    with pytest.raises(ConfigError, match="one capacity for every device"):
        _cluster([0.45, 0.45, 0.45, 0.9]).with_devices(3)
    with pytest.raises(ConfigError, match="devices"):
        _cluster(None).with_devices(0)
