"""The paper's §7.3.3 scenario preset: Cluster #2 as a 32-GPU allocation, the pool between
8 and 32 devices, four equal-size 8B models under PPO, and on every trace pair lengths
whose mean and 95th percentile at the start and the end, as the ground truth samples
them, lie within 5% of the paper's description."""

from __future__ import annotations

import numpy as np
import pytest

from nereus.errors import ConfigError
from nereus.sim import build_scenario
from nereus.sim.presets import EDGE_STEPS, PRESETS, edge_stats, preset
from nereus.sim.run import preset_config

PAPER_MEAN = (1150.0, 3700.0)  # the paper: the mean grows from about 1,150 to 3,700 tokens
PAPER_P95 = (1340.0, 4070.0)  # and the 95th percentile from about 1,340 to 4,070


@pytest.fixture(scope="module", params=range(len(PRESETS["paper-7.3.3"].pairs)))
def scenario(request):
    return request.param, build_scenario(preset_config("paper-7.3.3", request.param))


def test_the_cluster_job_and_pool_are_the_papers(scenario):
    _, scn = scenario
    c = scn.cluster
    assert (c.num_devices, c.devices_per_node, c.device_memory_bytes) == (32, 4, 64 * 2**30)
    assert c.inter_node_bandwidth == pytest.approx(4 * 12.5e9)  # 4 x HDR100 a node
    assert scn.steps == 26 and scn.work.algorithm == "ppo"
    shapes = {
        name: (m.hidden_size, m.num_layers, m.intermediate_size)
        for name, m in scn.work.models.items()
    }
    assert (
        set(shapes) == {"policy", "reference", "critic", "reward"}
        and len(set(shapes.values())) == 1
    )
    sizes = {len(scn.devices.nodes_at(300.0 * tick, 0)) * 4 for tick in range(2000)}
    assert min(sizes) >= 8 and max(sizes) <= 32 and len(sizes) >= 3


def test_the_traces_mean_and_p95_at_start_and_end_are_within_5pct_of_the_papers(scenario):
    _, scn = scenario
    # the trace as rescaled
    for got, want in (
        (edge_stats(scn.lengths.means), PAPER_MEAN),
        (edge_stats(scn.lengths.p95s), PAPER_P95),
    ):
        assert got == pytest.approx(want, rel=0.05)
    # the lengths the ground truth generates from it (1,024 responses a step)
    sampled = [scn.truth.lengths(s, scn.lengths.mean_at(s)) for s in range(scn.steps)]
    e = EDGE_STEPS
    for pick, want in ((lambda x: x.mean, PAPER_MEAN), (lambda x: x.p95, PAPER_P95)):
        start = float(np.mean([pick(x) for x in sampled[:e]]))
        end = float(np.mean([pick(x) for x in sampled[-e:]]))
        assert start == pytest.approx(want[0], rel=0.05) and end == pytest.approx(want[1], rel=0.05)
    assert all(x.max <= scn.caps.cap_at(s) for s, x in enumerate(sampled))


def test_static_plans_memory_for_the_largest_cap_from_the_first_step(scenario):
    _, scn = scenario
    assert scn.caps.name == "fixed" and scn.caps.cap_at(0) == scn.caps.largest
    assert scn.caps.largest >= 2 * max(scn.lengths.means)


def test_the_pairs_were_fixed_in_the_preset():
    p = preset("paper-7.3.3")
    assert [(t.lengths, t.spot, t.offset_ticks) for t in p.pairs] == [
        ("softgrpo-llama3.2-3b-grpo", "us-east-2b_v100_1", 0),
        ("rasbt-qwen3-0.6b-base-grpo-clip", "us-west-2a_v100_1", 0),
        ("areal-fork-qwen2.5-0.5b-grpo-gsm8k-a40-reasoning", "us-east-2b_v100_1", 1600),
    ]
    assert (
        p.policies == ("adaptive", "every-k", "dynarl", "static", "oracle")
        and p.k == 3
        and p.gamma == 0.5
    )


def test_an_unknown_preset_or_pair_is_refused():
    with pytest.raises(ConfigError, match="--scenario='paper-9'"):
        preset_config("paper-9")
    with pytest.raises(ConfigError, match="pair=3"):
        preset_config("paper-7.3.3", 3)
