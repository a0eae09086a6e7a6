"""``[cluster] cores_per_device``: a number, one per device, or "shared"; checked; the
demo says when limits cannot be set."""

from __future__ import annotations

import pytest

import nereus.actors._cpulimit as cpulimit
from examples import demo
from nereus.config import from_dict
from nereus.errors import ConfigError
from nereus.job.cli import parse_job
from nereus.job.config import ClusterConfig


def test_cores_per_device_reads_as_each_devices_cores():
    assert from_dict(ClusterConfig, {"devices": 3}).device_cores is None
    assert (
        from_dict(ClusterConfig, {"devices": 3, "cores_per_device": 0.45}).device_cores
        == [0.45] * 3
    )
    got = from_dict(ClusterConfig, {"devices": 2, "cores_per_device": [0.25, 0.5]})
    assert got.device_cores == [0.25, 0.5]


@pytest.mark.parametrize("value", ["half", 0, [0.25], [0.25, 0.5, 1.0]])
def test_bad_cores_per_device_is_named(value):
    with pytest.raises(ConfigError, match="cluster.cores_per_device"):
        from_dict(ClusterConfig, {"devices": 2, "cores_per_device": value})


def test_the_demo_says_when_limits_cannot_be_set_and_runs_on_shared_cores(monkeypatch):
    cfg = parse_job([str(demo.CONFIG)])
    assert cfg.cluster.device_cores == [0.45] * cfg.cluster.devices
    monkeypatch.setattr(cpulimit, "V1_ROOT", cpulimit.Path("/nonexistent-cgroup"))
    monkeypatch.setattr(cpulimit, "V2_MOUNTS", ())
    shared, line = demo.capacity_line(cfg)
    assert line.startswith("CPU LIMITS COULD NOT BE SET") and "cores_per_device" in line
    assert shared.cluster.device_cores is None
    # the job's own config never falls back: starting a capped local cluster is refused
    with pytest.raises(ConfigError, match="cores_per_device"):
        cpulimit.CpuLimits([0.45], owner="test")
