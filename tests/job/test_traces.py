"""Traces as a running job reads them (``nereus.job.traces``), through the simulator's
reader: a length log becomes the job's cap schedule with the end-of-sequence token
ignored, scaled so the longest step bound is the cap, and its per-step mean and maximum
become every response's own drawn length (the same for a prompt in synchronous and
asynchronous mode; a live job's responses are exactly those lengths); a spot trace
becomes a live device count per step mapped onto the cluster's devices; bad specs name
the field."""

from __future__ import annotations

import statistics

import pytest

from nereus.config import from_dict, to_dict
from nereus.errors import ConfigError
from nereus.job.async_loop import AsyncRun
from nereus.job.config import JobConfig
from nereus.job.loop import RLJob
from nereus.job.traces import PoolTrace, length_schedule, response_lengths, with_lengths
from nereus.sim.traces import length_trace, pool_at_steps
from tests._leaks import children, wait_gone
from tests.job._jobs import TRACES, job

LOG = TRACES / "response-length" / "rasbt-qwen3-0.6b-base-grpo-clip.json"
# a log with each step's longest response (seq_len_max)
TOPS = TRACES / "response-length" / "areal-fork-qwen2.5-0.5b-grpo-gsm8k-a40-reasoning.json"
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
    # no maximum in the log: every response of a step is the step's cap, as before
    assert cfg.sampling.lengths is not None and cfg.sampling.lengths.maxima is None
    assert response_lengths(cfg, 3, [0, 5], 2) == [caps[3]] * 4


def test_a_log_with_maxima_caps_each_step_at_its_longest_and_spreads_the_responses(tmp_path):
    cfg = with_lengths(
        job(str(tmp_path), 12, sampling={"max_new_tokens": 48}, trace={"lengths": str(TOPS)})
    )
    lengths = cfg.sampling.lengths
    trace = length_trace(str(TOPS), 12)
    assert lengths is not None and lengths.maxima is not None and trace.maxima is not None
    scale = 48 / max(trace.maxima)
    caps = [cfg.sampling.cap_at(s) for s in range(12)]
    assert caps == [round(x * scale) for x in trace.maxima] and max(caps) == 48
    assert lengths.means == pytest.approx([m * scale for m in trace.means])
    assert all(m <= c for m, c in zip(lengths.means, caps, strict=True))
    # the job config is the single source: it survives plain data (config.json)
    assert from_dict(JobConfig, to_dict(cfg)) == cfg
    rows = response_lengths(cfg, 5, list(range(40)), 8)
    assert len(rows) == 320 and all(1 <= n <= caps[5] for n in rows)
    assert len(set(rows)) > 4  # a spread within the step
    assert statistics.fmean(rows) == pytest.approx(lengths.means[5], rel=0.1)
    assert rows[8:16] == response_lengths(cfg, 5, [1], 8)  # a key draws one length
    with pytest.raises(ConfigError, match="sampling.lengths"):
        response_lengths(job(str(tmp_path), 4), 0, [0], 1)
    with pytest.raises(ConfigError, match="sampling.ignore_eos"):
        from_dict(
            JobConfig,
            {**to_dict(cfg), "sampling": {**to_dict(cfg.sampling), "ignore_eos": False}},
        )


def test_async_requests_draw_the_lengths_a_synchronous_step_draws(tmp_path):
    """A prompt's responses get the same lengths in either mode: an asynchronous request
    for positions across a step boundary takes each group's from its position's step."""
    base = dict(
        sampling={"max_new_tokens": 32},
        trace={"lengths": str(TOPS)},
        algorithm={"prompts_per_step": 4, "samples_per_prompt": 3},
    )
    sync = RLJob(job(str(tmp_path / "sync"), 6, **base))
    run = AsyncRun(
        RLJob(
            job(
                str(tmp_path / "async"),
                6,
                **base,
                cluster={"mode": "local", "devices": 2},
                plan={"policy_generation": {"devices": [1]}, "policy_training": {"devices": [0]}},
                rl={"mode": "async"},
            )
        )
    )
    positions = [6, 7, 8, 9, 10]  # the end of step 1 and the start of step 2
    params = run._params(positions, {p: run.job.dataset.at(p) for p in positions}, 0)
    by_step = {
        s: sync._lengths(s, [sync.dataset.at(p).index for p in range(4 * s, 4 * s + 4)], 3)
        for s in (1, 2)
    }
    want = by_step[1][6:] + by_step[2][:9]
    assert params["row_max_tokens"] == want
    assert params["max_tokens"] == max(sync.cfg.sampling.cap_at(s) for s in (1, 2))
    assert params["stop_token_ids"] == []
    # generation's memory holds the largest cap a request may run at, max_staleness ahead
    caps = [sync.cfg.sampling.cap_at(s) for s in range(6)]
    assert [run.request_cap(v) for v in range(6)] == [max(caps[v : v + 2]) for v in range(6)]


@pytest.mark.parametrize("algorithm", ["ppo", "remax"])
def test_async_ppo_and_remax_entries_draw_the_synchronous_lengths(tmp_path, algorithm):
    """A PPO entry is one row of its prompt's k: it gets that row's draw; ReMax's greedy
    baseline rows get row 0's, as the synchronous greedy request does."""
    k = 3
    base = dict(
        sampling={"max_new_tokens": 32},
        trace={"lengths": str(TOPS)},
        algorithm={"name": algorithm, "prompts_per_step": 4, "samples_per_prompt": k},
    )
    stages = {"policy_generation": {"devices": [1]}, "policy_training": {"devices": [0]}}
    if algorithm == "ppo":
        stages |= {"critic_inference": {"devices": [0]}, "critic_training": {"devices": [0]}}
    sync = RLJob(job(str(tmp_path / "sync"), 6, **base, plan=stages))
    run = AsyncRun(
        RLJob(
            job(
                str(tmp_path / "async"),
                6,
                **base,
                cluster={"mode": "local", "devices": 2},
                plan=stages,
                rl={"mode": "async"},
            )
        )
    )
    per = run.shape.per_prompt
    positions = [4 * per + 1, 4 * per + 2] if algorithm == "ppo" else [4, 5]
    samples = {p: run.job.dataset.at(run.shape.prompt(p)) for p in positions}
    greedy = 0 if algorithm == "ppo" else len(positions)
    params = run._params(positions, samples, greedy)
    want: list[int] = []
    for p in positions:
        drawn = sync._lengths(1, [samples[p].index], k)
        want += drawn[(p % per) * run.K : (p % per) * run.K + run.K]
    want += [sync._lengths(1, [samples[p].index], 1)[0] for p in positions[:greedy]]
    assert params["row_max_tokens"] == want


@pytest.mark.timeout(180)
async def test_a_live_job_generates_each_response_to_its_drawn_length(tmp_path):
    cfg = job(
        str(tmp_path),
        6,
        sampling={"max_new_tokens": 32},
        trace={"lengths": str(TOPS)},
    )
    rl = RLJob(cfg)
    records = await rl.run()
    lengths = rl.cfg.sampling.lengths
    assert lengths is not None
    b, k = cfg.algorithm.prompts_per_step, cfg.algorithm.samples_per_prompt
    for s, record in enumerate(records):
        indices = [rl.dataset.at(p).index for p in range(s * b, (s + 1) * b)]
        drawn = response_lengths(rl.cfg, s, indices, k)
        assert record["tokens_generated"] == sum(drawn)
        assert record["response_len_max"] == max(drawn) <= record["max_new_tokens"]
        assert record["response_len_mean"] == pytest.approx(statistics.fmean(drawn))
        assert max(drawn) > min(drawn)  # lengths differ within a step
        # the step's mean follows the trace's (64 responses a step: a few percent apart)
        assert record["response_len_mean"] == pytest.approx(lengths.mean_at(s), rel=0.2)


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


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_an_async_job_generates_each_response_to_its_drawn_length(tmp_path):
    procs = children()
    cfg = job(
        str(tmp_path),
        3,
        sampling={"max_new_tokens": 24},
        trace={"lengths": str(TOPS)},
        algorithm={"prompts_per_step": 4, "samples_per_prompt": 4},
        cluster={"mode": "local", "devices": 2, "memory_per_device": "256MiB"},
        plan={"policy_generation": {"devices": [1]}, "policy_training": {"devices": [0]}},
        rl={"mode": "async"},
    )
    rl = RLJob(cfg)
    records = await rl.run()
    assert len(records) == 3 and rl.async_run is not None
    trained = rl.async_run.trained_log
    assert len(trained) == 12
    spread = False
    for _, position, index, rows in trained:
        # one token version per generated token: a row's versions are its response
        drawn = response_lengths(rl.cfg, position // 4, [index], 4)
        assert [len(r) for r in rows] == drawn
        spread |= len(set(drawn)) > 1
    assert spread
    assert not wait_gone(children() - procs, timeout_s=10), "leaked worker processes"
