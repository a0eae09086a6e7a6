"""``[cluster] cores_per_device``: a number, one per device, or "shared"; checked."""

from __future__ import annotations

import pytest

from nereus.config import from_dict
from nereus.errors import ConfigError
from nereus.rl.config import ClusterConfig


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
