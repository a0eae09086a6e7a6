"""The ground truth: written apart from the planner (no cost, memory or explain function
imported or called), every table with its source, the paper's restart, Extend and
resharding figures at the paper's GPU counts, the measured decode curve reproduced at its
points, deterministic under its seed."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys

import pytest

import nereus.sim.cpu_truth as cpu_truth_module
import nereus.sim.truth as truth_module
import nereus.sim.truth_params as truth_params_module
from nereus.errors import ConfigError
from nereus.planner import LengthStats, Workload, cluster_preset, model_preset, search
from nereus.planner.cluster import local_cpu_cluster
from nereus.planner.plan import Plan, StagePlan
from nereus.sim import CapSchedule, GroundTruth, load_truth_params
from nereus.sim.truth import PARAMS_PATH, SCHEMA, truth_params_from
from tests.sim.helpers import small_cluster, small_work

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

FORBIDDEN_MODULES = {
    "nereus.planner.cost",
    "nereus.planner.explain",
    "nereus.planner.search",
    "nereus.planner.calibrate",
    "nereus.planner.admission",
    "nereus.planner.replan",
}
FORBIDDEN_NAMES = {
    "stage_cost",
    "stage_memory",
    "explain",
    "links_of",
    "usable_bytes",
    "Efficiency",
    "CONSERVATIVE",
    "search",
    "phases",
}
# the modules themselves (``nereus.planner.explain`` the attribute is the function)
cost_module = importlib.import_module("nereus.planner.cost")
explain_module = importlib.import_module("nereus.planner.explain")
SOURCE_KINDS = ("published", "public benchmark", "vendor", "measurement", "derived", "assumption")


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("truth.py", truth_module),
        ("truth_params.py", truth_params_module),
        ("cpu_truth.py", cpu_truth_module),
    ],
)
def test_the_truth_imports_no_planner_cost_or_memory_function(source, module):
    tree = ast.parse(PARAMS_PATH.with_name(source).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module not in FORBIDDEN_MODULES, node.module
            imported |= {a.name for a in node.names}
            if node.module == "nereus.planner":
                imported |= {"<package>"}
        elif isinstance(node, ast.Import):
            for a in node.names:
                assert a.name not in FORBIDDEN_MODULES and a.name != "nereus.planner", a.name
    assert "<package>" not in imported  # names come from their own modules, checked above
    assert not imported & FORBIDDEN_NAMES, imported & FORBIDDEN_NAMES
    for name in FORBIDDEN_NAMES:
        assert not hasattr(module, name), name


def test_a_step_never_calls_the_planners_formulas(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the ground truth called the planner's cost model")

    cluster, work = small_cluster(24), small_work()
    plan = search(work, cluster).plan  # the plan may come from the planner; its time may not
    for module, name in (
        (cost_module, "stage_cost"),
        (cost_module, "stage_memory"),
        (explain_module, "explain"),
    ):
        monkeypatch.setattr(module, name, refuse)
    got = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=0).step(
        plan, 3, 900
    )
    assert got.seconds > 0 and got.device_peak > 0
    # and on CPU workers under a quota (the [cpu] table), with a move and a restart
    cpu = local_cpu_cluster(
        4,
        2**30,
        flops_per_device=3e10,
        memory_bandwidth=5e9,
        exchange_bandwidth=4e9,
        device_cores=[0.45] * 4,
    )
    tiny = Workload.for_models(
        "ppo",
        model_preset("tiny"),
        prompts_per_step=8,
        samples_per_prompt=4,
        prompt_length=8,
        lengths=LengthStats(32, 32, 32),
        micro_batch=2,
    )
    on_cpu = GroundTruth(load_truth_params(), cpu, tiny, max_length=64, seed=0)
    assert on_cpu.cpu is not None
    both, one = _plan(tiny, 4), _plan(tiny, 2)
    assert on_cpu.step(both, 3, 32).seconds > 0
    assert on_cpu.transition_seconds(both, one) > 0 and on_cpu.restart_seconds(one) > 0


def test_every_table_names_its_source():
    data = tomllib.loads(PARAMS_PATH.read_text())
    assert set(data) == set(SCHEMA)
    params = load_truth_params()
    for table in SCHEMA:
        source = params.sources[table]
        assert source.startswith(SOURCE_KINDS), table
        assert len(source) > 60, table  # says what the figure is and where it comes from
    for name, _, source in params.rows():
        assert source, name
    # the paper's components cite the paper's table or section
    for table, where in (("restart", "Table 4"), ("extend", "Table 4"), ("reshard", "7.4.2")):
        assert where in params.sources[table], table


def test_a_table_without_its_source_or_an_unknown_key_is_refused():
    data = tomllib.loads(PARAMS_PATH.read_text())
    bad = {**data, "decode": {**data["decode"], "source": " "}}
    with pytest.raises(ConfigError, match="decode.source"):
        truth_params_from(bad)
    bad = {**data, "restart": {**data["restart"], "seconds": 300.0}}
    with pytest.raises(ConfigError, match="unknown key"):
        truth_params_from(bad)
    bad = {**data, "extra": {"source": "published: nothing"}}
    with pytest.raises(ConfigError, match="unknown table"):
        truth_params_from(bad)
    bad = {**data, "training": {**data["training"], "mfu_by_tp": [[2, 0.4], [1, 0.4]]}}
    with pytest.raises(ConfigError, match="training.mfu_by_tp"):
        truth_params_from(bad)


def _paper_job() -> tuple:
    cluster = cluster_preset("a100-256").with_nodes(8)
    work = Workload.for_models(
        "ppo",
        model_preset("llama-8b"),
        prompts_per_step=256,
        samples_per_prompt=4,
        prompt_length=512,
        lengths=LengthStats(1150, 1340, 1600),
    )
    return cluster, work, GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=0)


def _plan(work: Workload, devices: int, tp: int = 1) -> Plan:
    """Every model-stage on devices 0..devices-1 at ``tp`` x 1, DP the rest."""
    emus = tuple(tuple(range(i, i + tp)) for i in range(0, devices, tp))
    return Plan(tuple((s.name, StagePlan(tp, 1, len(emus), emus)) for s in work.stages))


@pytest.mark.parametrize(
    ("gpus", "restart", "extend", "reshard"), [(8, 695.94, 2.45, 15.7), (32, 981.21, 8.48, 16.1)]
)
def test_restart_extend_and_reshard_equal_the_papers_figures_at_the_papers_gpu_counts(
    gpus, restart, extend, reshard
):
    _, work, truth = _paper_job()
    assert truth.restart_seconds(_plan(work, gpus)) == pytest.approx(restart, abs=1e-9)
    grown = truth.transition_seconds(_plan(work, gpus // 2), _plan(work, gpus))  # DP only: Extend
    assert grown == pytest.approx(extend, abs=1e-9)
    resharded = truth.transition_seconds(_plan(work, gpus), _plan(work, gpus, tp=2))  # TP changes
    params = work.models["policy"].num_params
    assert resharded == pytest.approx(
        reshard * max(params, work.models["critic"].num_params) / 8.03e9, rel=1e-9
    )
    assert truth.transition_seconds(_plan(work, gpus), _plan(work, gpus)) == 0.0


def test_between_the_papers_gpu_counts_costs_grow_log_linearly():
    _, work, truth = _paper_job()
    sixteen = truth.restart_seconds(_plan(work, 16))
    assert sixteen == pytest.approx((695.94 + 981.21) / 2, rel=1e-9)
    assert truth.restart_seconds(_plan(work, 64)) == pytest.approx(
        981.21 + (981.21 - 695.94) / 2, rel=1e-9
    )


def test_the_decode_curve_reproduces_its_measured_points():
    params = load_truth_params()
    a100_40 = dataclasses.replace(
        cluster_preset("a100-256"), memory_bandwidth=params["device.hbm_bytes_per_s"]
    )
    work = Workload.for_models(
        "ppo",
        model_preset("llama-8b"),
        prompts_per_step=8,
        samples_per_prompt=1,
        prompt_length=1024,
        lengths=LengthStats(64, 64, 64),
    )
    truth = GroundTruth(params, a100_40, work, max_length=8192, seed=0)
    sp = StagePlan(1, 1, 1, ((0,),))
    model = work.models["policy"]
    for batch, context, seconds in params["decode.points"]:
        got = truth._decode_step_s(model, sp, batch, context)
        assert got == pytest.approx(
            seconds * 2 * model.num_params / params["decode.weight_bytes"], rel=0.02
        )


def test_the_same_seed_gives_the_same_step_and_another_seed_another():
    cluster, work = small_cluster(24), small_work()
    plan = search(work, cluster).plan
    a = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=7)
    b = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=7)
    c = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=8)
    assert a.step(plan, 3, 900) == b.step(plan, 3, 900)
    assert a.step(plan, 3, 900).seconds != c.step(plan, 3, 900).seconds
    assert (
        a.step(plan, 3, 900, attempt=1).seconds != a.step(plan, 3, 900).seconds
    )  # a redo meets new jitter


def test_longer_responses_take_longer_and_overflow_memory():
    cluster, work = small_cluster(24), small_work()
    plan = search(work, cluster).plan
    truth = GroundTruth(load_truth_params(), cluster, work, max_length=32768, seed=0)
    short, long = truth.step(plan, 0, 300), truth.step(plan, 0, 8000)
    assert not short.failed and short.device_peak <= cluster.device_memory_bytes
    assert long.seconds > 5 * short.seconds
    assert long.failed and all(need > mem for _, need, mem in long.overflow)


def test_a_steps_lengths_follow_the_trace_and_never_exceed_the_cap():
    cluster, work = small_cluster(24), small_work()
    truth = GroundTruth(
        load_truth_params(),
        cluster,
        work,
        caps=CapSchedule("t", (512, 512, 4096)),
        seed=0,
        p95_ratio=(1.2, 1.2, 1.2),
    )
    assert truth.lengths(-1, 480).max == 512 and truth.lengths(1, 480).max == 512
    free = truth.lengths(2, 1000)
    assert free.mean == pytest.approx(1000, rel=0.05) and free.p95 == pytest.approx(1200, rel=0.05)
    assert 1200 < free.max <= 4096
