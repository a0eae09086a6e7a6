"""The ground truth of CPU workers under a quota (``[cpu]``, ``nereus.sim.cpu_truth``): a
measured table, a quota that lets short work run at a full core, memory as the workers'
ledgers count it, and the policies benchmark's job placed and run by the simulator on
the cluster shape the live job uses (one node of 4 workers of 0.45 cores and 64 MiB)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.policies import MODEL, SIM_NAME, Pair, job_config, live_counts, sim_scenario
from nereus.data.vocab import Codec
from nereus.models import ModelConfig
from nereus.planner import LengthStats, ModelShape, Plan, StagePlan, Workload
from nereus.planner.cluster import ClusterSpec, local_cpu_cluster
from nereus.planner.cost import CONSERVATIVE
from nereus.sim import GroundTruth, load_truth_params, run_policies
from nereus.sim.cpu_truth import CPU_KEYS, CpuTruth
from nereus.sim.truth import PARAMS_PATH

MiB = 2**20


def _cluster(devices: int = 4, cores: float = 0.45, memory: int = 64 * MiB) -> ClusterSpec:
    return local_cpu_cluster(
        devices,
        memory,
        flops_per_device=3e10,
        memory_bandwidth=5e9,
        exchange_bandwidth=4e9,
        device_cores=[cores] * devices,
    )


def _work(prompts: int = 8, prompt: int = 5, length: int = 48) -> Workload:
    """The policies benchmark's job: PPO with a critic and a reference, micro-batch 2."""
    shape = ModelShape("policy", 128, 4, 4, 4, 8, 256, dtype="float32")
    models = {"policy": shape, "reference": shape, "critic": shape.as_value_model()}
    lengths = LengthStats(float(length), float(length), length)
    return Workload("ppo", models, prompts, 4, prompt, lengths, micro_batch=2)


def _on(work: Workload, groups: dict[str, tuple[int, ...]]) -> Plan:
    return Plan(
        tuple(
            (s.name, StagePlan(1, 1, len(groups[s.name]), tuple((d,) for d in groups[s.name])))
            for s in work.stages
        )
    )


LIVE_PLAN = {  # benchmarks.policies.PLAN, in the planner's names
    "policy-generation": (0, 1),
    "reference-inference": (2,),
    "critic-inference": (3,),
    "policy-training": (0, 1),
    "critic-training": (2, 3),
}


def _cpu(work: Workload | None = None, cluster: ClusterSpec | None = None) -> CpuTruth:
    return CpuTruth(load_truth_params().tables["cpu"], cluster or _cluster(), work or _work())


def test_the_table_is_a_measurement_with_its_command_and_every_key():
    text = PARAMS_PATH.read_text()
    cpu = text[text.index("[cpu]") :]
    assert "python -m benchmarks.cpu_truth" in cpu  # the command that measured it
    params = load_truth_params()
    assert params.sources["cpu"].startswith("measurement: python -m benchmarks.cpu_truth")
    assert set(params.tables["cpu"]) == set(CPU_KEYS)
    t = params.tables["cpu"]
    # what the ledger holds per parameter: float32 weights, and for training its
    # gradients and both AdamW moments
    assert t["generation_resident_bytes_per_param"] == pytest.approx(4.0, rel=1e-3)
    assert t["training_resident_bytes_per_param"] == pytest.approx(16.0, rel=1e-3)
    assert t["decode_step_s"] > 0 and t["training_token_s"] > 0 and t["inference_token_s"] > 0


def test_a_quota_runs_short_work_at_a_full_core_and_long_work_at_its_share():
    cpu = _cpu()
    period = cpu.t["period_s"]
    budget = 0.45 * period
    assert cpu.elapsed(budget / 2, 0.45) == pytest.approx(budget / 2)  # inside one budget
    assert cpu.elapsed(budget, 0.45) == pytest.approx(budget)
    assert cpu.elapsed(budget + 0.001, 0.45) == pytest.approx(period + 0.001)
    long = cpu.elapsed(10.0, 0.45)
    assert long == pytest.approx(10.0 / 0.45, rel=0.01)
    assert cpu.elapsed(1.0, 2.0) == 1.0  # one thread never runs faster than a core
    xs = [0.001 * i for i in range(1, 400)]
    walls = [cpu.elapsed(x, 0.45) for x in xs]
    assert all(b > a for a, b in zip(walls, walls[1:], strict=False))


def test_memory_is_what_the_ledgers_hold():
    work = _work()
    cpu = _cpu(work)
    plan = _on(work, LIVE_PLAN)
    gen = work.stages[0]
    resident, kv = cpu.stage_bytes(gen, plan[gen.name], 48)
    assert resident == pytest.approx(4 * work.models["policy"].num_params, rel=1e-3)
    # KV cache: 16 sequences a replica of (5 + 48) tokens, 4 layers x K and V x 128 x 4 B
    assert kv == pytest.approx(16 * 53 * 4 * 2 * 128 * 4, rel=1e-3)
    train = next(s for s in work.stages if s.name == "policy-training")
    resident, acts = cpu.stage_bytes(train, plan[train.name], 48)
    assert resident == pytest.approx(16 * work.models["policy"].num_params, rel=1e-3)
    assert 0 < acts < resident
    peaks = cpu.device_bytes(
        plan,
        {s.name: cpu.stage_bytes(s, plan[s.name], 48)[0] for s in work.stages},
        {s.name: cpu.stage_bytes(s, plan[s.name], 48)[1] for s in work.stages},
    )
    # device 0 holds policy generation (its KV cache to the step's end) and training
    assert peaks[0] == resident + acts + 4 * work.models["policy"].num_params + kv


def test_the_live_plan_fits_64_mib_and_a_long_cap_does_not():
    work = _work()
    plan = _on(work, LIVE_PLAN)
    fits = GroundTruth(load_truth_params(), _cluster(), work, max_length=48, seed=0)
    step = fits.step(plan, 1, 48.0)
    assert not step.failed and step.device_peak < 64 * MiB / 2
    assert step.seconds > sum(step.stage_seconds.values())  # sync and controller besides
    long = GroundTruth(load_truth_params(), _cluster(), work, max_length=4096, seed=0)
    assert long.step(plan, 1, 4096.0).failed


def test_a_slower_quota_and_longer_responses_take_longer():
    work = _work()
    plan = _on(work, LIVE_PLAN)

    def seconds(cores: float, length: float) -> float:
        truth = GroundTruth(load_truth_params(), _cluster(cores=cores), work, max_length=64)
        return truth.step(plan, 1, length).seconds

    assert seconds(0.25, 48) > seconds(0.45, 48) > seconds(1.0, 48)
    assert seconds(0.45, 48) > seconds(0.45, 16) > seconds(0.45, 4)


def test_moves_and_restarts_cost_the_measured_placements():
    work = _work()
    cpu = _cpu(work)
    live = _on(work, LIVE_PLAN)
    both = {**LIVE_PLAN, "policy-generation": (0,), "policy-training": (0,)}
    smaller = _on(work, both)
    assert cpu.move_seconds(live, live) == 0.0
    move = cpu.move_seconds(live, smaller)
    assert 0 < move < cpu.restart_seconds(smaller)
    assert math.isfinite(move)


def _spot(tmp_path, counts: list[int]) -> str:
    path = tmp_path / "spot.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": counts}))
    return str(path)


def _lengths(tmp_path, means: list[float]) -> str:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"steps": list(range(len(means))), "mean": means}))
    return str(path)


def test_the_simulator_places_and_runs_the_live_job_on_the_live_cluster_shape(tmp_path):
    steps = 8
    # the spot counts map onto 2..4 devices: the pool shrinks to 2 and comes back
    means = [40.0, 60, 80, 100, 120, 140, 160, 160]
    pair = Pair(_lengths(tmp_path, means), _spot(tmp_path, [16, 0, 0, 8, 16, 16, 0, 16]), 0)
    cfg = job_config("payback", pair, steps, 0.45, str(tmp_path / "run"))
    codec = Codec.for_alphabet("abc")
    model = ModelConfig(
        vocab_size=codec.vocab_size,
        hidden_size=MODEL["hidden_size"],
        intermediate_size=MODEL["intermediate_size"],
        num_hidden_layers=MODEL["num_layers"],
        num_attention_heads=MODEL["num_heads"],
        num_key_value_heads=MODEL["num_kv_heads"],
        torch_dtype="float32",
    )
    scn = sim_scenario(cfg, model, 5, pair, steps, cluster=_cluster(), prior=CONSERVATIVE)
    assert (scn.cluster.nodes, scn.cluster.devices_per_node) == (1, 4)
    assert scn.truth.cpu is not None
    counts = live_counts(pair, 4, steps)
    assert counts[0] == 4 and min(counts) == 2
    for policy in ("payback", "always", "every-k", "static"):
        (res,) = run_policies(scn, (SIM_NAME[policy],), gamma=0.5, k=3)
        assert res.steps == steps, policy
        assert res.memory_failures == 0, policy
        assert [r.devices for r in res.records] == counts, policy
        assert res.records[0].plan_devices == 4, policy  # the job's pinned plan
        assert all(r.plan_devices <= r.devices for r in res.records), policy
        assert 0 < res.mean_step_s < 60, policy
