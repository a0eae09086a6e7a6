"""The fixed cost of layer passes: what recompute and a micro-batch's ends add are the
probe's figures (not one bare forward, not nothing), timed on the project's decoder."""

from __future__ import annotations

import json

import pytest

from nereus.errors import ConfigError
from nereus.planner import CONSERVATIVE, LengthStats, ModelShape, Workload, _probe
from nereus.planner.cluster import local_cpu_cluster
from nereus.planner.cost import stage_cost

MiB = 2**20


def _training_layer_passes(recompute: bool, recompute_passes: float, ends: float = 0.0) -> float:
    model = ModelShape("tiny", 64, 4, 4, 4, 128, 32)
    work = Workload.for_models(
        "grpo",
        model,
        prompts_per_step=8,
        samples_per_prompt=8,
        prompt_length=5,
        lengths=LengthStats(16, 16, 16),
        reward_model=False,
        micro_batch=2,
    )
    cluster = local_cpu_cluster(
        2,
        64 * MiB,
        flops_per_device=1e11,
        memory_bandwidth=1e10,
        exchange_bandwidth=8e9,
        cores=2,
        device_cores=[0.45, 0.45],
    )
    eff = CONSERVATIVE.replace(
        layer_pass_s=1e-3, recompute_passes=recompute_passes, micro_batch_passes=ends
    )
    training = next(s for s in work.stages if s.kind == "training")
    cost = stage_cost(
        training,
        model,
        work,
        cluster,
        eff,
        1,
        1,
        2,
        pp_inter=False,
        dp_inter=False,
        recompute=recompute,
    )
    return cost.term_seconds(eff)["layer passes"]


def test_recompute_costs_the_measured_layer_passes():
    plain = _training_layer_passes(False, 5.0)
    assert _training_layer_passes(False, 1.0) == pytest.approx(plain)  # no recompute: unused
    # 32 sequences per replica in micro-batches of 2, 4 layers, 0.45 of a core
    assert plain == pytest.approx(16 * 3 * 4 * 1e-3 / 0.45)
    assert _training_layer_passes(True, 1.0) == pytest.approx(plain * 4 / 3)
    assert _training_layer_passes(True, 5.0) == pytest.approx(plain * 8 / 3)


def test_every_micro_batch_pays_its_ends():
    plain = _training_layer_passes(False, 1.0)
    # 16 micro-batches, each 12 layer passes of layers and 6 of ends
    assert _training_layer_passes(False, 1.0, ends=6.0) == pytest.approx(plain * 18 / 12)
    assert _training_layer_passes(True, 5.0, ends=6.0) == pytest.approx(plain * 38 / 12)


def test_recompute_and_ends_are_checked():
    with pytest.raises(ConfigError, match="recompute_passes"):
        CONSERVATIVE.replace(recompute_passes=0.5)
    with pytest.raises(ConfigError, match="micro_batch_passes"):
        CONSERVATIVE.replace(micro_batch_passes=-1.0)


def test_the_probe_times_the_projects_decoder():
    figures = _probe._layer_costs()
    # a layer's forward and backward on the decoder the engines run costs tens of
    # microseconds at least; recomputing it costs more than nothing
    assert 1e-5 < figures["layer_pass_s"] < 0.5
    assert 1.0 <= figures["recompute_passes"] <= 20.0
    assert 0.0 <= figures["micro_batch_passes"] <= 50.0


def test_the_efficiency_prior_carries_the_probed_figures(tmp_path, monkeypatch):
    cache = tmp_path / "nereus" / "cpu_probe.json"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {
        "flops_per_device": 1e10,
        "memory_bandwidth": 1e10,
        "exchange_bandwidth": 8e9,
        "layer_pass_s": 7e-4,
        "recompute_passes": 4.5,
        "micro_batch_passes": 2.5,
    }
    key = f"{_probe.platform.node()}/{_probe.os.cpu_count()}/{_probe._PROBE_VERSION}"
    cache.parent.mkdir()
    cache.write_text(json.dumps({key: figures}))
    eff = _probe.local_cpu_efficiency()
    assert (eff.layer_pass_s, eff.recompute_passes, eff.micro_batch_passes) == (7e-4, 4.5, 2.5)
    # an entry of an earlier probe (no recompute_passes) is measured again, not trusted
    stale = {k: v for k, v in figures.items() if k != "micro_batch_passes"}
    cache.write_text(json.dumps({key: stale}))
    assert "micro_batch_passes" in _probe.local_cpu_probe(cache=cache)
