"""The ground truth: the planner's formulas times effects the planner does not model,
from a parameter file where every value has its reason; deterministic under its seed."""

from __future__ import annotations

import sys

import pytest

from nereus.config import from_dict
from nereus.errors import ConfigError
from nereus.planner import LengthStats, explain, search
from nereus.sim import CapSchedule, GroundTruth, TruthParams, load_truth_params
from nereus.sim.truth import PARAMS_PATH
from tests.sim.helpers import small_cluster, small_work

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


def _params(**overrides: float) -> TruthParams:
    """The project's parameters with some values replaced (``table__name=value``)."""
    data = tomllib.loads(PARAMS_PATH.read_text())
    for key, value in overrides.items():
        table, name = key.split("__")
        data[table][name]["value"] = value
    return from_dict(TruthParams, data)


def test_every_parameter_has_a_reason_and_a_source_kind():
    rows = load_truth_params().rows()
    assert len(rows) >= 20
    for name, _, reason in rows:
        assert reason.startswith(("published", "measurement", "assumption")), name


def test_without_its_effects_the_truth_is_the_planners_formulas():
    cluster, work = small_cluster(24), small_work()
    plan = search(work, cluster).plan
    flat = _params(efficiency__spread=0, drift__amplitude=0, stragglers__device_sigma=0, stragglers__step_sigma=0,
                   congestion__per_doubling=0, lengths__max_over_mean_median=1, lengths__max_over_mean_sigma=0)
    truth = GroundTruth(flat, cluster, work, max_length=8192, seed=0)
    got = truth.step(plan, 5, 1000)
    lengths = LengthStats(1000, 1000, 1000)
    assert got.lengths == lengths
    expected = explain(plan, work.with_lengths(lengths), cluster, truth.efficiency(5))
    assert got.seconds == pytest.approx(expected.step_seconds, rel=1e-12)
    assert got.stage_seconds == pytest.approx({s.name: s.cost.seconds for s in expected.stages}, rel=1e-12)


def test_with_its_effects_the_truth_differs_from_what_the_planner_predicts():
    cluster, work = small_cluster(24), small_work()
    plan = search(work, cluster).plan
    truth = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=0)
    got = truth.step(plan, 5, 1000)
    predicted = explain(plan, work.with_lengths(got.lengths), cluster)
    time_ratios = [got.stage_seconds[s.name] / s.cost.seconds for s in predicted.stages]
    memory_ratios = [got.stage_peaks[s.name] / (s.memory.resident + s.memory.transient) for s in predicted.stages]
    assert max(abs(r - 1) for r in time_ratios) > 0.1
    assert max(memory_ratios) > 1.1  # activations at the longest sequence, fragmentation
    assert got.lengths.max > got.lengths.mean  # the sampled maximum, not the mean
    # efficiencies drift over the run, so calibration has something to follow
    assert truth.efficiency(0).gemm != pytest.approx(truth.efficiency(200).gemm, rel=1e-3)


def test_the_same_seed_gives_the_same_step_and_another_seed_another():
    cluster, work = small_cluster(24), small_work()
    plan = search(work, cluster).plan
    a = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=7)
    b = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=7)
    c = GroundTruth(load_truth_params(), cluster, work, max_length=8192, seed=8)
    assert a.step(plan, 3, 900) == b.step(plan, 3, 900)
    assert a.step(plan, 3, 900).seconds != c.step(plan, 3, 900).seconds
    assert a.step(plan, 3, 900, attempt=1).seconds != a.step(plan, 3, 900).seconds  # a redo meets new jitter


def test_memory_is_checked_against_each_devices_full_memory():
    cluster, work = small_cluster(24), small_work()
    plan = search(work, cluster).plan
    truth = GroundTruth(load_truth_params(), small_cluster(24), work, max_length=8192, seed=0)
    fine = truth.step(plan, 0, 300)
    assert not fine.failed and fine.device_peak <= cluster.device_memory_bytes
    long = truth.step(plan, 0, 8000)  # far longer sequences than the plan was made for
    assert long.failed and all(need > mem for _, need, mem in long.overflow)


def test_a_steps_sampled_maximum_never_exceeds_that_steps_cap():
    cluster, work = small_cluster(24), small_work()
    truth = GroundTruth(load_truth_params(), cluster, work, caps=CapSchedule("t", (512, 512, 4096)), seed=0)
    assert truth.max_length == 4096
    assert truth.lengths(-1, 400).max == 512 and truth.lengths(1, 400).max == 512  # 3.33 x 400 is cut at the cap
    assert 512 < truth.lengths(2, 400).max <= 4096


def test_a_parameter_without_a_reason_or_an_unknown_key_is_refused(tmp_path):
    text = PARAMS_PATH.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('value = 0.50\nreason = "published: Megatron', 'value = 0.50\nreason = " "\nx = "published: Megatron', 1))
    with pytest.raises(ConfigError, match="efficiency.gemm"):
        load_truth_params(bad)
    bad.write_text(text + '\n[restart.extra]\nvalue = 1.0\nreason = "r"\n')
    with pytest.raises(ConfigError, match="unknown key"):
        load_truth_params(bad)
    with pytest.raises(ConfigError, match="efficiency.gemm.value=2.0"):
        _params(efficiency__gemm=2.0)
