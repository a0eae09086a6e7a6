"""Traces as a running job reads them (``nereus.job.traces``), through the simulator's
reader: a length log becomes the job's cap schedule with the end-of-sequence token
ignored, scaled so the longest step is the cap; a spot trace becomes a live device count
per step mapped onto the cluster's devices; bad specs name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.job.traces import PoolTrace, length_schedule, with_lengths
from nereus.sim.traces import length_trace, pool_at_steps
from tests.job._jobs import job

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
LOG = TRACES / "response-length" / "rasbt-qwen3-0.6b-base-grpo-clip.json"
SPOT = TRACES / "spot-availability" / "us-west-2a_v100_1.json"


def test_a_length_log_becomes_the_caps_schedule_scaled_to_the_cap(tmp_path):
    cfg = with_lengths(
        job(str(tmp_path), 12, sampling={"max_new_tokens": 48}, trace={"lengths": str(LOG)})
    )
    sched = cfg.sampling.max_new_tokens
    assert cfg.sampling.ignore_eos and cfg.trace.lengths is None
    caps = [cfg.sampling.cap_at(s) for s in range(12)]
    means = length_trace(str(LOG), 12).means
    assert max(caps) == 48 and sched[0][0] == 0
    assert [round(m * 48 / max(means)) for m in means] == caps
    assert length_schedule("growth:10:40", 4, 40) == [[0, 10], [1, 20], [2, 30], [3, 40]]


def test_a_length_trace_needs_one_cap_and_a_real_spec(tmp_path):
    with pytest.raises(ConfigError, match="trace.lengths"):
        job(
            str(tmp_path),
            4,
            sampling={"max_new_tokens": [[0, 8], [2, 16]]},
            trace={"lengths": str(LOG)},
        )
    with pytest.raises(ConfigError, match="length-trace"):
        with_lengths(job(str(tmp_path), 4, trace={"lengths": str(tmp_path / "none.json")}))


def test_a_spot_trace_is_a_device_count_per_step_on_the_cluster(tmp_path):
    assert pool_at_steps(str(SPOT), 4, 6, offset_ticks=35) == [4, 4, 3, 3, 4, 4]
    assert pool_at_steps(str(SPOT), 4, 8) == [2] * 8  # the trace starts with no instance: the floor
    assert pool_at_steps("growth:2:4", 4, 3) == [2, 3, 4]
    cfg = job(
        str(tmp_path),
        5,
        cluster={"mode": "local", "devices": 4},
        plan={"policy_generation": {"devices": [0]}, "policy_training": {"devices": [0]}},
        trace={"pool": str(SPOT), "pool_offset": 35},
    )
    trace = PoolTrace.of(cfg)
    assert trace is not None and trace.counts == [4, 4, 3, 3, 4] and trace.live_at(9) == 4
    with pytest.raises(ConfigError, match="trace.pool"):
        job(str(tmp_path), 5, trace={"pool": str(SPOT)})  # in_process: no cluster to drain
