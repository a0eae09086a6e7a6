"""Calibration recovers hidden efficiency factors from noisy synthetic timings."""

from __future__ import annotations

import random

import pytest

from nereus.errors import ConfigError
from nereus.planner import (
    CONSERVATIVE,
    OP_CLASSES,
    Calibrator,
    Efficiency,
    LengthStats,
    Workload,
    cluster_preset,
    model_preset,
    stage_cost,
    stage_memory,
)

HIDDEN = Efficiency(
    gemm=0.62,
    attention=0.41,
    decode=0.78,
    allreduce_intra=0.71,
    allreduce_inter=0.33,
    p2p_intra=0.66,
    p2p_inter=0.52,
)


def _stage_costs(rng: random.Random, n: int = 60):
    """Real stage costs of random layouts and lengths (their ideal terms by class)."""
    cluster = cluster_preset("a100-256")
    out = []
    for _ in range(n):
        length = rng.choice([512, 1024, 2048, 4096])
        work = Workload.for_models(
            "ppo",
            model_preset(rng.choice(["llama-1b", "llama-8b"])),
            prompts_per_step=64,
            samples_per_prompt=4,
            prompt_length=rng.choice([256, 1024]),
            lengths=LengthStats(length / 2, length * 0.9, length),
        )
        stage = rng.choice(work.stages)
        tp, pp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        dp = rng.choice([1, 2, 4, 8, 16])
        out.append(
            stage_cost(
                stage,
                work.models[stage.model],
                work,
                cluster,
                CONSERVATIVE,
                tp,
                pp,
                dp,
                pp_inter=rng.random() < 0.5,
                dp_inter=rng.random() < 0.5,
            )
        )
    return out


def _truth(ideal: dict[str, float]) -> float:
    return sum(t / HIDDEN[c] for c, t in ideal.items())


def test_recovers_hidden_factors_within_5_percent_from_5_percent_noise():
    rng = random.Random(7)
    cal = Calibrator()
    for cost in _stage_costs(rng):
        ideal = cost.ideal_by_class()
        cal.observe(ideal, _truth(ideal) * (1 + rng.uniform(-0.05, 0.05)))
    # and timed single operations, as the runtime's per-op timers report them
    for _ in range(40):
        c = rng.choice(OP_CLASSES)
        ideal = rng.uniform(1e-4, 1e-1)
        cal.observe_op(c, ideal, ideal / HIDDEN[c] * (1 + rng.uniform(-0.05, 0.05)))
    fitted = cal.fit()
    for c in OP_CLASSES:
        assert fitted[c] == pytest.approx(HIDDEN[c], rel=0.05), c


def test_stage_timings_alone_recover_the_classes_they_exercise():
    rng = random.Random(3)
    cal = Calibrator()
    for cost in _stage_costs(rng, 200):
        cal.observe_stage(cost, _truth(cost.ideal_by_class()) * (1 + rng.uniform(-0.05, 0.05)))
    fitted = cal.fit()
    # the classes that dominate stage times; minor ones need per-operation timings
    for c in ("gemm", "decode"):
        assert fitted[c] == pytest.approx(HIDDEN[c], rel=0.05), c


def test_unseen_classes_keep_the_conservative_prior():
    cal = Calibrator()
    assert cal.fit() == CONSERVATIVE
    cal.observe_op("gemm", 1.0, 1.0 / 0.8)
    fitted = cal.fit()
    assert fitted.gemm == pytest.approx(0.8, rel=1e-2)
    for c in OP_CLASSES:
        if c != "gemm":
            assert fitted[c] == CONSERVATIVE[c]
    assert cal.seen() == {"gemm"}


def test_memory_scale_from_measured_peaks_is_conservative():
    work = Workload.for_models(
        "grpo",
        model_preset("llama-1b"),
        prompts_per_step=8,
        samples_per_prompt=4,
        prompt_length=256,
        lengths=LengthStats(512, 900, 1024),
        reward_model=False,
    )
    gen = work.stages[0]
    modelled = stage_memory(gen, work.models["policy"], work, 1, 1, 2)
    cal = Calibrator()
    assert cal.fit().memory_scale == 1.0
    for ratio in (1.1, 1.4, 1.2):
        cal.observe_memory(modelled, int(modelled.resident + ratio * modelled.transient))
    assert cal.memory_scale() == pytest.approx(1.4, rel=1e-6)
    fitted = cal.fit()
    assert fitted.memory_scale == pytest.approx(1.4, rel=1e-6)
    scaled = stage_memory(gen, work.models["policy"], work, 1, 1, 2, scale=fitted.memory_scale)
    assert scaled.resident == modelled.resident
    assert scaled.transient == pytest.approx(1.4 * modelled.transient, rel=1e-6)
    with pytest.raises(ConfigError, match="measured_peak_bytes"):
        cal.observe_memory(modelled, 0)
    with pytest.raises(ConfigError, match="memory_scale"):
        Efficiency(memory_scale=100.0)


GiB = 2**30


def test_memory_fit_separates_a_fixed_term_from_a_proportional_one():
    # devices hold 1 GiB the model does not count plus 15% more than its transient
    # bytes: one ratio measured at short responses overstates memory at long ones
    cal = Calibrator()
    small = [0.5 * GiB, 1 * GiB, 2 * GiB]
    for t in small:
        cal.observe_memory_bytes(10 * GiB, int(t), int(10 * GiB + GiB + 1.15 * t))
    scale, fixed = cal.memory_fit()
    assert scale == pytest.approx(1.15, rel=1e-6) and fixed == pytest.approx(GiB, rel=1e-6)
    fitted = cal.fit()
    assert (fitted.memory_scale, fitted.memory_fixed_bytes) == (
        cal.memory_scale(),
        cal.memory_fixed_bytes(),
    )
    # at 40 GiB of transient bytes the fit is exact, the largest ratio (3.15) far off
    assert fixed + scale * 40 * GiB == pytest.approx(GiB + 1.15 * 40 * GiB, rel=1e-6)
    assert max(y / t for t, y in zip(small, [GiB + 1.15 * t for t in small], strict=True)) > 3
    # the model applies both terms to every model-stage's transient bytes
    work = Workload.for_models(
        "grpo",
        model_preset("llama-1b"),
        prompts_per_step=8,
        samples_per_prompt=4,
        prompt_length=256,
        lengths=LengthStats(512, 900, 1024),
        reward_model=False,
    )
    gen = work.stages[0]
    plain = stage_memory(gen, work.models["policy"], work, 1, 1, 2)
    both = stage_memory(
        gen,
        work.models["policy"],
        work,
        1,
        1,
        2,
        scale=fitted.memory_scale,
        fixed=fitted.memory_fixed_bytes,
    )
    assert both.resident == plain.resident
    assert both.transient == pytest.approx(GiB + 1.15 * plain.transient, rel=1e-6)


def test_memory_fit_lies_on_or_above_every_measured_pair():
    # two kinds of device (activations fragment by 15%, the KV cache by 4%) and noise:
    # the line is raised to the pairs' upper envelope, so no measured peak exceeds it
    rng = random.Random(5)
    cal = Calibrator(window=64)
    pairs = []
    for _ in range(64):
        t = rng.uniform(0.2, 30) * GiB
        y = GiB + (1.15 if rng.random() < 0.5 else 1.04) * t + rng.uniform(-0.05, 0.05) * GiB
        pairs.append((t, y))
        cal.observe_memory_bytes(5 * GiB, int(t), int(5 * GiB + y))
    scale, fixed = cal.memory_fit()
    assert 1.04 <= scale <= 1.15
    assert all(fixed + scale * t >= y - 2 for t, y in pairs)  # (bytes are rounded to integers)
    assert fixed == pytest.approx(max(y - scale * t for t, y in pairs), abs=2)


def test_memory_fit_without_spread_is_one_conservative_ratio():
    cal = Calibrator()
    for y in (1.1, 1.4, 1.2):
        cal.observe_memory_bytes(0, GiB, int(y * GiB))
    assert cal.memory_fit() == (pytest.approx(1.4, rel=1e-6), 0.0)
    with pytest.raises(ConfigError, match="memory_fixed_bytes"):
        Efficiency(memory_fixed_bytes=-1.0)
    assert (
        CONSERVATIVE.replace(memory_scale=2.0, memory_fixed_bytes=GiB).uncalibrated_memory()
        == CONSERVATIVE
    )


def test_window_forgets_old_timings():
    cal = Calibrator(window=10)
    for _ in range(10):
        cal.observe_op("decode", 1.0, 1.0 / 0.2)
    for _ in range(10):
        cal.observe_op("decode", 1.0, 1.0 / 0.9)
    assert len(cal) == 10
    assert cal.fit().decode == pytest.approx(0.9, rel=1e-2)


def test_bad_observations_are_refused_with_the_field():
    cal = Calibrator()
    with pytest.raises(ConfigError, match="measured_seconds"):
        cal.observe_op("gemm", 1.0, 0.0)
    with pytest.raises(ConfigError, match="op class"):
        cal.observe({"matmul": 1.0}, 1.0)
    with pytest.raises(ConfigError, match="ideal seconds of gemm"):
        cal.observe({"gemm": -1.0}, 1.0)
    with pytest.raises(ConfigError, match="Efficiency.gemm"):
        Efficiency(gemm=0.0)


def test_transition_nodes_calibrate_p2p_efficiency_and_fixed_costs():
    from nereus.planner import CONSERVATIVE, Calibrator

    cal = Calibrator()
    truth_eff, setup, call = 0.25, 0.05, 0.002
    for i in range(1, 12):
        ideal = {"p2p_intra": 0.01 * i, "groups": 1.0 if i % 3 else 0.0, "calls": 1.0}
        measured = ideal["p2p_intra"] / truth_eff + ideal["groups"] * setup + call
        cal.observe_transition(ideal, measured)
    eff = cal.fit()
    assert abs(eff.p2p_intra - truth_eff) < 1e-3
    assert abs(eff.group_setup_s - setup) < 1e-3 and abs(eff.transition_call_s - call) < 1e-3
    assert eff.p2p_inter == CONSERVATIVE.p2p_inter  # unseen: the prior
    import pytest

    from nereus.errors import ConfigError

    with pytest.raises(ConfigError, match="transition class"):
        cal.observe_transition({"warp": 1.0}, 1.0)


def test_a_class_that_is_a_small_share_of_its_timings_does_not_swing_between_bounds():
    # GEMMs decide every timing, attention is 2-2.4% of it, the timings scatter by 3%:
    # what attention takes is not in the data. Fitted after each timing, the efficiency
    # of attention stays near its prior instead of taking up the scatter (it went from
    # 0.06 to the 1.5 bound and back, step after step), and the GEMMs' is still learned.
    cal = Calibrator(prior=CONSERVATIVE)
    fits = []
    for i in range(24):
        cal.observe(
            {"gemm": 1.0, "attention": 0.02 * (1 + 0.1 * (i % 3))}, 3.0 * (1 + 0.03 * (-1) ** i)
        )
        fits.append(cal.fit())
    attention = [f["attention"] for f in fits]
    assert max(attention) < 1.5 * CONSERVATIVE["attention"]
    assert min(attention) > CONSERVATIVE["attention"] / 1.5
    assert fits[-1]["gemm"] == pytest.approx(
        1.0 / (3.0 - 0.02 * 1.1 / CONSERVATIVE["attention"]), rel=0.03
    )


def _transition_total(eff: Efficiency, nodes: list[dict[str, float]]) -> float:
    """A transition's predicted seconds: its nodes one after another, at ``eff``."""
    per = {"calls": eff.transition_call_s, "copy_gb": eff.copy_s_per_gb}
    return sum(sum(per[c] * t for c, t in node.items()) for node in nodes)


def test_a_transition_node_weighs_by_its_share_of_the_transition():
    # Each transition: one node copies 100 MB in 100 ms (1 s/GB); a small one copies
    # 20 MB in 4 ms (it stays in cache: 0.2 s/GB) and three only call (1 ms each), what
    # the model cannot tell apart. Divided by its own time, each small node weighs as
    # much as the large one and a GB costs what the small copy took, so the transition
    # comes out 4x too fast; divided by the transition's total, the large node decides.
    cal = Calibrator()
    big, small = {"calls": 1.0, "copy_gb": 0.1}, {"calls": 1.0, "copy_gb": 0.02}
    call = {"calls": 1.0}
    nodes, times = [big, small, call, call, call], [0.1, 0.004, 0.001, 0.001, 0.001]
    for _ in range(3):
        for node, t in zip(nodes, times, strict=True):
            cal.observe_transition(node, t, sum(times))
    eff = cal.fit()
    assert _transition_total(eff, nodes) == pytest.approx(sum(times), rel=0.15)
    assert eff.copy_s_per_gb > 0.8  # the large node's 1 s/GB, not the small copy's 0.2
    with pytest.raises(ConfigError, match="of_seconds"):
        cal.observe_transition(big, 0.2, 0.1)  # a node longer than its transition
