"""Traces: spot availability as node sets (seeded, the same for every policy), growth,
losses inside a window, response lengths resampled and rescaled, the job's cap
schedule; errors name the flag."""

from __future__ import annotations

import json

import pytest

from nereus.errors import ConfigError
from nereus.planner import cluster_preset
from nereus.sim import (
    CapSchedule,
    GrowthTrace,
    LengthTrace,
    SpotTrace,
    cap_schedule,
    device_trace,
    length_trace,
)
from tests.sim.helpers import small_cluster


def test_spot_counts_become_whole_nodes_and_losses_pick_seeded_nodes():
    cluster = cluster_preset("a100-256")  # 64 nodes of 4; default scale 256/16 = 16 devices a count
    t = SpotTrace([16, 10, 16, 0, 3], 300, cluster, 16, seed=5)
    sizes = [len(t.nodes_at(300 * i + 1, 0)) for i in range(5)]
    assert sizes == [64, 40, 64, 0, 12]
    again = SpotTrace([16, 10, 16, 0, 3], 300, cluster, 16, seed=5)
    assert [t.nodes_at(300 * i, 0) for i in range(5)] == [
        again.nodes_at(300 * i, 0) for i in range(5)
    ]
    other = SpotTrace([16, 10, 16, 0, 3], 300, cluster, 16, seed=6)
    assert t.nodes_at(300, 0) != other.nodes_at(300, 0)  # which nodes leave is drawn from the seed
    assert t.nodes_at(600, 0) == frozenset(range(64))  # a rise takes the lowest free nodes
    assert t.nodes_at(300 * 5 + 1, 0) == t.nodes_at(1, 0)  # past the end the trace starts again


def test_first_loss_finds_the_tick_that_removes_a_used_node():
    t = SpotTrace([16, 16, 8, 16], 100, small_cluster(), 1.0, seed=1)
    used = t.nodes_at(0, 0)
    gone = used - t.nodes_at(200, 0)
    assert gone and t.first_loss(10, 150, used) is None
    assert t.first_loss(10, 250, used) == 200
    assert t.first_loss(10, 250, used - gone) is None  # a step on the surviving nodes goes on
    assert t.next_available(0, 0) == 0 and t.next_change(0, 0) == 200


def test_growth_trace_adds_whole_nodes_by_step():
    cluster = cluster_preset("mi250x-1024")
    g = GrowthTrace(512, 1024, 1000, cluster)
    assert g.devices_at_step(0) == 512 and g.devices_at_step(999) == 1024
    assert all(g.devices_at_step(i) % 8 == 0 for i in range(0, 1000, 37))
    assert g.first_loss(0, 1e9, frozenset(range(64))) is None
    assert device_trace("growth:512:1024", cluster, 1000).nodes_at(0, 999) == frozenset(range(128))


def test_device_trace_reads_a_spot_file_and_scales_it(tmp_path):
    path = tmp_path / "spot.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [16, 4]}))
    cluster = cluster_preset("a100-256")
    t = device_trace(str(path), cluster, 10, seed=0)
    assert len(t.nodes_at(0, 0)) == 64 and len(t.nodes_at(60, 0)) == 16
    half = device_trace(str(path), cluster, 10, pool_scale=8, seed=0)
    assert len(half.nodes_at(0, 0)) == 32


def test_length_trace_resamples_and_rescales(tmp_path):
    path = tmp_path / "len.json"
    path.write_text(json.dumps({"steps": [1, 2, 3, 5], "mean": [100, 300, 200, 500], "max": None}))
    plain = length_trace(str(path), 9)
    assert plain.means[0] == 100 and plain.means[-1] == 500
    assert plain.means[2] == pytest.approx(300)  # run step 2 sits on trace step 2
    scaled = length_trace(str(path), 9, length_range=(500, 8000))
    assert min(scaled.means) == pytest.approx(500) and max(scaled.means) == pytest.approx(8000)
    growth = length_trace("growth:500:8000", 1000)
    assert (
        growth.means[0] == 500 and growth.means[-1] == 8000 and growth.default_max_length() == 16384
    )


def test_length_trace_reads_each_steps_maximum_from_max_or_seq_len_max(tmp_path):
    path = tmp_path / "len.json"
    path.write_text(
        json.dumps(
            {"steps": [1, 2, 3, 5], "mean": [100, 300, 200, 500], "max": [400, 600, 250, 900]}
        )
    )
    t = length_trace(str(path), 9)
    assert t.maxima is not None and t.maxima[0] == 400 and t.maxima[-1] == 900
    assert t.maxima[2] == pytest.approx(600)  # resampled as the means are
    scaled = length_trace(str(path), 9, length_range=(50, 100))
    assert scaled.maxima is not None and scaled.maxima[0] == pytest.approx(50 * 4)  # ratio kept
    both = tmp_path / "seq.json"
    both.write_text(
        json.dumps({"steps": [1, 2], "mean": [10, 20], "max": None, "seq_len_max": [30, 15]})
    )
    assert length_trace(str(both), 2).maxima == (30.0, 20.0)  # never below the mean
    assert length_trace("growth:1:2", 3).maxima is None
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"steps": [1, 2], "mean": [10, 20], "max": None}))
    assert length_trace(str(plain), 4).maxima is None
    with pytest.raises(ConfigError, match="LengthTrace.maxima"):
        LengthTrace("bad", (10.0, 20.0), maxima=(30.0, 15.0))


def test_bad_specs_name_the_flag():
    with pytest.raises(ConfigError, match="--gpus-trace='nope.json'"):
        device_trace("nope.json", small_cluster(), 10)
    with pytest.raises(ConfigError, match="--length-trace='growth:9:1'"):
        length_trace("growth:9:1", 10)
    with pytest.raises(ConfigError, match="spot trace count=17"):
        SpotTrace([16, 17], 300, small_cluster(), 1.0, seed=0)
    with pytest.raises(ConfigError, match="--length-range"):
        length_trace("growth:10:20", 5, length_range=(50, 10))


def test_the_stepped_cap_schedule_doubles_as_responses_grow_and_never_falls():
    growth = length_trace("growth:500:8000", 1000)
    caps = cap_schedule("stepped", growth)
    assert caps.changes() == [(0, 1024), (2, 2048), (70, 4096), (207, 8192), (479, 16384)]
    assert all(caps.cap_at(s) >= 2 * m for s, m in enumerate(growth.means))
    assert (
        caps.largest == growth.default_max_length()
        and caps.cap_at(-1) == 1024
        and caps.cap_at(5000) == 16384
    )
    falling = LengthTrace("falling", (100.0, 900.0, 300.0))
    assert cap_schedule("stepped", falling).caps == (256, 2048, 2048)
    assert cap_schedule("stepped", growth, max_length=4096).largest == 4096
    assert cap_schedule("fixed", growth).caps == (16384,) * 1000
    assert cap_schedule("fixed", growth, max_length=20000).caps == (20000,) * 1000


def test_a_bad_cap_schedule_is_refused_by_name():
    with pytest.raises(ConfigError, match="--cap-schedule='doubling'"):
        cap_schedule("doubling", length_trace("growth:500:8000", 10))
    with pytest.raises(ConfigError, match="CapSchedule.caps"):
        CapSchedule("shrinking", (4096, 2048))
