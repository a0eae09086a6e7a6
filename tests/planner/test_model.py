"""Cluster, workload, plan and cost/memory model: arithmetic a systems engineer can check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError
from nereus.planner import (
    CONSERVATIVE,
    PRESETS,
    ClusterSpec,
    LengthStats,
    ModelShape,
    Plan,
    StagePlan,
    Workload,
    cluster_preset,
    explain,
    local_cpu_cluster,
    model_preset,
    phases,
    stage_cost,
    stage_memory,
)


def _ppo(model: str = "llama-8b", length: int = 2048, **kw) -> Workload:
    return Workload.for_models(
        "ppo",
        model_preset(model),
        prompts_per_step=64,
        samples_per_prompt=4,
        prompt_length=512,
        lengths=LengthStats(length / 2, length * 0.9, length),
        **kw,
    )


def test_presets_describe_the_papers_clusters():
    assert cluster_preset("mi250x-1024").num_devices == 1024
    a100 = cluster_preset("a100-256")
    assert (a100.num_devices, a100.devices_per_node, a100.intra_node_bandwidth) == (256, 4, 600e9)
    h200 = cluster_preset("h200-64")
    assert (h200.num_devices, h200.inter_node_bandwidth) == (64, 25e9)
    assert cluster_preset("h100-8").num_devices == 8
    assert cluster_preset("a100-256", nodes=8).num_devices == 32
    assert a100.node_of(7) == 1
    assert set(PRESETS) == {"mi250x-1024", "a100-256", "h200-64", "h100-8"}
    with pytest.raises(ConfigError, match="cluster='tpu-v5'"):
        cluster_preset("tpu-v5")


def test_cluster_and_local_cpu_validation_names_the_field():
    with pytest.raises(ConfigError, match="ClusterSpec.nodes=0"):
        ClusterSpec("x", 0, 8, 2**30, 1e12, 1e11, 1e10, 1e9)
    with pytest.raises(ConfigError, match="peak_flops"):
        ClusterSpec("x", 1, 8, 2**30, 0.0, 1e11, 1e10, 1e9, workspace_bytes=0)
    local = local_cpu_cluster(
        4, 2 * 2**30, flops_per_device=5e10, memory_bandwidth=1e10, exchange_bandwidth=8e9
    )
    assert (local.nodes, local.devices_per_node, local.device_memory_bytes) == (1, 4, 2 * 2**30)
    with pytest.raises(ConfigError, match="devices=0"):
        local_cpu_cluster(
            0, 2**30, flops_per_device=1.0, memory_bandwidth=1.0, exchange_bandwidth=1.0
        )


def test_model_shapes_count_parameters_like_the_published_models():
    assert model_preset("llama-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert model_preset("llama-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert model_preset("llama-1b").num_params == pytest.approx(1.24e9, rel=0.01)
    m = model_preset("llama-8b")
    assert (
        m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    )  # K and V, 32 layers, 8 kv heads of 128, bf16
    v = m.as_value_model()
    assert v.output_width == 1 and v.num_params < m.num_params
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelShape("bad", 4096, 32, 32, 6, 32000, 11008)
    with pytest.raises(ConfigError, match="model='gpt-5'"):
        model_preset("gpt-5")


def test_algorithms_and_their_phases():
    w = _ppo()
    assert [s.name for s in w.stages] == [
        "policy-generation",
        "reference-inference",
        "critic-inference",
        "reward-inference",
        "policy-training",
        "critic-training",
    ]
    assert phases(w.stages) == (0, 1, 1, 1, 2, 2)
    g = Workload.for_models(
        "grpo",
        model_preset("llama-1b"),
        prompts_per_step=8,
        samples_per_prompt=8,
        prompt_length=128,
        lengths=LengthStats(100, 200, 300),
        reward_model=False,
    )
    assert [s.name for s in g.stages] == [
        "policy-generation",
        "reference-inference",
        "policy-training",
    ]
    r = Workload.for_models(
        "remax",
        model_preset("llama-1b"),
        prompts_per_step=8,
        samples_per_prompt=2,
        prompt_length=128,
        lengths=LengthStats(100, 200, 300),
    )
    assert r.sequences == 8 * 2 + 8


def test_workload_validation_names_the_field():
    with pytest.raises(ConfigError, match="global_batch=100"):
        _ppo(global_batch=100)
    with pytest.raises(ConfigError, match="LengthStats.p95"):
        LengthStats(100, 50, 200)
    with pytest.raises(ConfigError, match="lacks"):
        Workload("ppo", {"policy": model_preset("tiny")}, 1, 1, 1, LengthStats(1, 1, 1))
    assert _ppo(global_batch=64).optimizer_steps == 4


def test_training_costs_six_n_flops_per_token_split_over_tp():
    w = _ppo("llama-8b")
    cluster = cluster_preset("h100-8")
    train = w.stages[4]
    model = w.models["policy"]
    c1 = stage_cost(train, model, w, cluster, CONSERVATIVE, 1, 1, 8, pp_inter=False, dp_inter=False)
    gemm = c1.ideal_by_class()["gemm"]
    tokens = (w.sequences // 8) * (w.prompt_length + w.lengths.mean)
    body = model.num_layers * model.layer_params + model.hidden_size * model.vocab_size
    assert gemm == pytest.approx(6 * body * tokens / cluster.peak_flops, rel=1e-9)
    c2 = stage_cost(train, model, w, cluster, CONSERVATIVE, 2, 1, 4, pp_inter=False, dp_inter=False)
    # twice the tokens per replica over twice the devices per replica: the same GEMM time
    assert c2.ideal_by_class()["gemm"] == pytest.approx(gemm, rel=1e-9)
    assert any(t.name == "tp collectives" for t in c2.terms)
    assert c1.seconds == pytest.approx(sum(t.seconds(CONSERVATIVE) for t in c1.terms))


def test_decode_grows_with_length_and_kv_cache_with_max_length():
    cluster = cluster_preset("h100-8")
    short, long = _ppo(length=1024), _ppo(length=8192)
    gen = short.stages[0]
    m = short.models["policy"]
    a = stage_cost(gen, m, short, cluster, CONSERVATIVE, 1, 1, 8, pp_inter=False, dp_inter=False)
    b = stage_cost(gen, m, long, cluster, CONSERVATIVE, 1, 1, 8, pp_inter=False, dp_inter=False)
    assert b.seconds > 4 * a.seconds
    kv = stage_memory(gen, m, long, 1, 1, 8).kv_cache
    assert kv == pytest.approx(32 * (512 + 8192) * m.kv_bytes_per_token, rel=1e-6)
    assert stage_memory(gen, m, long, 2, 1, 4).kv_cache == pytest.approx(
        kv, rel=1e-6
    )  # 2x seqs / 2 shards


def test_recompute_and_waves_trade_time_for_memory():
    w = _ppo("llama-8b", length=4096)
    cluster = cluster_preset("h100-8")
    gen, train = w.stages[0], w.stages[4]
    m = w.models["policy"]
    one = stage_memory(gen, m, w, 1, 1, 8)
    four = stage_memory(gen, m, w, 1, 1, 8, waves=4)
    assert four.kv_cache == pytest.approx(one.kv_cache / 4, rel=1e-6) and four.params == one.params
    t1 = stage_cost(gen, m, w, cluster, CONSERVATIVE, 1, 1, 8, pp_inter=False, dp_inter=False)
    t4 = stage_cost(
        gen, m, w, cluster, CONSERVATIVE, 1, 1, 8, pp_inter=False, dp_inter=False, waves=4
    )
    assert t4.seconds > t1.seconds
    keep = stage_memory(train, m, w, 1, 1, 8)
    rec = stage_memory(train, m, w, 1, 1, 8, recompute=True)
    assert rec.activations < keep.activations / 4 and rec.resident == keep.resident
    c_keep = stage_cost(train, m, w, cluster, CONSERVATIVE, 1, 1, 8, pp_inter=False, dp_inter=False)
    c_rec = stage_cost(
        train, m, w, cluster, CONSERVATIVE, 1, 1, 8, pp_inter=False, dp_inter=False, recompute=True
    )
    assert c_rec.ideal_by_class()["gemm"] == pytest.approx(
        c_keep.ideal_by_class()["gemm"] * 4 / 3, rel=1e-9
    )


def test_memory_kinds_of_training():
    w = _ppo("llama-8b")
    m = w.models["policy"]
    mem = stage_memory(w.stages[4], m, w, 4, 2, 1)
    # the state layer's rule: a bf16 grad plus an fp32 one for the master copy (6 B), and
    # fp32 m, v and master (12 B) per bf16 parameter
    assert mem.grads == 3 * mem.params and mem.optimizer == 6 * mem.params
    assert mem.resident == mem.params + mem.grads + mem.optimizer
    assert mem.kv_cache == 0 and mem.activations > 0


def test_explain_serializes_shared_devices_and_overlaps_the_rest():
    w = _ppo("llama-1b")
    cluster = cluster_preset("h100-8")
    names = [s.name for s in w.stages]
    lo, hi = StagePlan.on_range(1, 1, 4, 0), StagePlan.on_range(1, 1, 4, 4)
    separated_refs = Plan(
        tuple((n, hi if n in ("reference-inference", "policy-training") else lo) for n in names)
    )
    ex = explain(separated_refs, w, cluster)
    phase1 = ex.phases[1]
    assert phase1.groups == (("reference-inference",), ("critic-inference", "reward-inference"))
    t = {s.name: s.cost.seconds for s in ex.stages}
    assert phase1.seconds == pytest.approx(
        max(t["reference-inference"], t["critic-inference"] + t["reward-inference"])
    )
    assert ex.step_seconds == pytest.approx(sum(p.seconds for p in ex.phases))
    # device 0 holds policy-generation, critic and reward, not reference or policy-training
    d0 = next(m for m in ex.memory if m.device == 0)
    assert {n for n, _ in d0.resident} == {
        "policy-generation",
        "critic-inference",
        "reward-inference",
        "critic-training",
    }
    with pytest.raises(ConfigError, match="lacks"):
        explain(Plan((("policy-generation", lo),)), w, cluster)
    with pytest.raises(ConfigError, match="spans nodes"):
        explain(
            Plan(tuple((n, StagePlan(2, 1, 1, ((3, 4),))) for n in names)),
            w,
            cluster_preset("a100-256"),
        )


@settings(max_examples=40, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    dp=st.integers(1, 4),
    start=st.integers(0, 64),
)
def test_stage_plans_round_trip_through_plain_data(tp, pp, dp, start):
    plan = Plan(
        (
            ("policy-generation", StagePlan.on_range(tp, pp, dp, start, waves=tp)),
            (
                "policy-training",
                StagePlan.on_range(1, 1, 1, start + tp * pp * dp, recompute=pp > 1),
            ),
        )
    )
    assert Plan.from_dict(plan.to_dict()) == plan
    sp = plan["policy-generation"]
    assert sp.num_devices == len(sp.device_set) == tp * pp * dp


def test_stage_plan_validation_names_the_field():
    with pytest.raises(ConfigError, match="StagePlan.tp=3"):
        StagePlan(3, 1, 1, ((0, 1, 2),))
    with pytest.raises(ConfigError, match="listed twice"):
        StagePlan(1, 1, 2, ((0,), (0,)))
    with pytest.raises(ConfigError, match="dp=2"):
        StagePlan(1, 1, 2, ((0,),))
    with pytest.raises(ConfigError, match="must have the keys"):
        Plan.from_dict({"policy-generation": {"tp": 1}})


def test_cluster_and_workload_load_from_plain_data_like_toml():
    from nereus.config import from_dict

    cluster = from_dict(
        ClusterSpec,
        {
            "name": "lab",
            "nodes": 2,
            "devices_per_node": 4,
            "device_memory_bytes": 24 * 2**30,
            "peak_flops": 1e14,
            "memory_bandwidth": 1e12,
            "intra_node_bandwidth": 1e11,
            "inter_node_bandwidth": 1e10,
        },
    )
    assert cluster.num_devices == 8
    shape = {
        "name": "m",
        "hidden_size": 1024,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "vocab_size": 32000,
        "intermediate_size": 2816,
    }
    work = from_dict(
        Workload,
        {
            "algorithm": "grpo",
            "models": {"policy": shape, "reference": shape},
            "prompts_per_step": 8,
            "samples_per_prompt": 4,
            "prompt_length": 128,
            "lengths": {"mean": 100, "p95": 180, "max": 200},
        },
    )
    assert [s.name for s in work.stages] == [
        "policy-generation",
        "reference-inference",
        "policy-training",
    ]
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(Workload, {"algorithm": "grpo", "modles": {}})
