"""JobConfig: TOML one-to-one, errors naming field, value and rule."""

from __future__ import annotations

import re

import pytest

from nereus.config import from_dict, load_toml
from nereus.errors import ConfigError
from nereus.job.config import JobConfig, Placement


def test_defaults_are_a_valid_grpo_job():
    cfg = JobConfig()
    assert cfg.algorithm.name == "grpo"
    assert cfg.plan["policy_generation"].emu_devices() == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "data, match",
    [
        (
            {"algorithm": {"samples_per_prompt": 1}},
            "algorithm.samples_per_prompt=1 must be >= 2 for grpo",
        ),
        ({"algorithm": {"name": "a2c"}}, "algorithm.name='a2c' must be one of"),
        ({"sampling": {"temperature": 0}}, "sampling.temperature=0.0 must be > 0"),
        (
            {"sampling": {"max_new_tokens": "8"}},
            "sampling.max_new_tokens='8' must be int | list[list[int]]",
        ),
        (
            {"sampling": {"max_new_tokens": [[4, 16]]}},
            "must start at step 0 with steps strictly increasing",
        ),
        (
            {"sampling": {"max_new_tokens": [[0, 16], [5]]}},
            "must be a number or a list of [step, cap] pairs",
        ),
        ({"optim": {"lr": -1}}, "optim.lr=-1.0 must be > 0"),
        ({"cluster": {"memory_per_device": "lots"}}, "cluster.memory_per_device='lots'"),
        ({"run": {"stepz": 3}}, "unknown key"),
        ({"task": {"name": "chess"}}, "task.name='chess'"),
        (
            {"plan": {"policy_generation": {"devices": [0, 1], "tp": 1}}},
            "plan.devices=[0, 1] must list tp*pp*dp=1 devices",
        ),
        (
            {"plan": {"policy_generation": {"devices": [9]}, "policy_training": {"devices": [0]}}},
            "plan.policy_generation.devices=[9] must be in [0, cluster.devices=4)",
        ),
        (
            {
                "plan": {
                    "policy_generation": {"devices": [0]},
                    "policy_training": {"devices": [0]},
                    "critic_training": {"devices": [1]},
                }
            },
            "does not use",
        ),
        (
            {"plan": {"policy_generation": {"devices": [0]}}},
            "must place model-stage 'policy_training'",
        ),
        (
            {
                "plan": {
                    "policy_generation": {"devices": [0, 1, 2], "tp": 3},
                    "policy_training": {"devices": [0]},
                }
            },
            "plan.tp=3 must be a power of two",
        ),
        (
            {
                "plan": {
                    "policy_generation": {"devices": list(range(8)), "tp": 8},
                    "policy_training": {"devices": [0]},
                },
                "cluster": {"devices": 8},
            },
            "plan.policy_generation.tp=8 must divide model.num_heads=4",
        ),
        (
            {"algorithm": {"prompts_per_step": 6}},
            "plan.policy_generation.dp=4 must divide algorithm.prompts_per_step=6",
        ),
        ({"sampling": {"engine": "tgi"}}, "sampling.engine='tgi' must be one of"),
        ({"adapt": {"pool_wait_s": -1}}, "adapt.pool_wait_s=-1.0 must be >= 0 seconds"),
        (
            {"sampling": {"engine": "vllm"}, "cluster": {"mode": "in_process"}},
            "sampling.engine='vllm' needs cluster.mode 'local' or 'connect'",
        ),
        (
            {
                "sampling": {"engine": "vllm"},
                "plan": {
                    "policy_generation": {"devices": [0, 1], "pp": 2},
                    "policy_training": {"devices": [0]},
                },
            },
            "plan.policy_generation.pp=2 must be 1 with sampling.engine='vllm'",
        ),
    ],
)
def test_bad_fields_are_named(data, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        from_dict(JobConfig, data)


def test_ppo_needs_the_critic_stages_and_reference_only_with_kl(tmp_path):
    with pytest.raises(ConfigError, match="critic_inference"):
        from_dict(
            JobConfig,
            {
                "algorithm": {"name": "ppo"},
                "plan": {
                    "policy_generation": {"devices": [0]},
                    "policy_training": {"devices": [0]},
                },
            },
        )
    plan = {"policy_generation": {"devices": [0]}, "policy_training": {"devices": [0]}}
    assert "reference_inference" not in from_dict(JobConfig, {"plan": plan}).plan
    with pytest.raises(ConfigError, match="reference_inference"):
        from_dict(JobConfig, {"plan": plan, "algorithm": {"kl_coef": 0.1}})
    toml = tmp_path / "job.toml"
    toml.write_text(
        '[algorithm]\nname = "ppo"\nsamples_per_prompt = 2\n'
        "[plan.policy_generation]\ndevices = [0, 1]\ndp = 2\n"
        "[plan.policy_training]\ndevices = [0]\n"
        "[plan.critic_inference]\ndevices = [1]\n"
        "[plan.critic_training]\ndevices = [1]\n"
    )
    cfg = load_toml(JobConfig, toml)
    assert cfg.plan["policy_generation"] == Placement(devices=[0, 1], dp=2)
    assert cfg.algorithm.rollouts_per_step == 16


def test_a_length_cap_schedule_and_the_plan_as_the_planners():
    cfg = from_dict(JobConfig, {"sampling": {"max_new_tokens": [[0, 16], [40, 48]]}})
    assert [cfg.sampling.cap_at(s) for s in (0, 39, 40, 500)] == [16, 16, 48, 48]
    assert cfg.sampling.max_cap == 48
    from nereus.job.config import from_planner_plan, to_planner_plan
    from nereus.planner import Plan

    plan = cfg.job_plan()
    assert isinstance(plan, Plan) and plan.names == [
        "policy_generation",
        "reference_inference",
        "policy_training",
    ]
    assert plan["policy_generation"].devices == ((0,), (1,), (2,), (3,))
    assert to_planner_plan(plan).names == [
        "policy-generation",
        "reference-inference",
        "policy-training",
    ]
    assert from_planner_plan(to_planner_plan(plan)) == plan


def _async_job(algorithm: dict, plan: dict, **more) -> JobConfig:
    return from_dict(
        JobConfig,
        {
            "algorithm": algorithm,
            "cluster": {"mode": "local", "devices": 3},
            "plan": plan,
            "rl": {"mode": "async"},
            **more,
        },
    )


def test_async_mode_takes_ppo_and_remax_with_generation_on_devices_of_its_own():
    ppo = {"name": "ppo", "samples_per_prompt": 1, "kl_coef": 0.05}
    plan = {
        "policy_generation": {"devices": [2]},
        "reference_inference": {"devices": [0]},
        "critic_inference": {"devices": [1]},
        "policy_training": {"devices": [0]},
        "critic_training": {"devices": [1]},
    }
    assert _async_job(ppo, plan).rl.is_async
    # the critic is a training-side model-stage: it may not sit on generation's devices
    with pytest.raises(ConfigError, match=re.escape("must not share devices [2]")):
        _async_job(ppo, {**plan, "critic_inference": {"devices": [2]}})
    remax = {"name": "remax", "samples_per_prompt": 2}
    two = {"policy_generation": {"devices": [1, 2], "dp": 2}, "policy_training": {"devices": [0]}}
    assert _async_job(remax, two).algorithm.name == "remax"
    with pytest.raises(ConfigError, match=re.escape("reward.kind='model' must be 'rule'")):
        _async_job(
            remax,
            {**two, "reward_inference": {"devices": [0]}},
            reward={"kind": "model", "path": "rm"},
        )


def test_async_mode_on_vllm_takes_whole_requests_only():
    grpo = {"name": "grpo", "samples_per_prompt": 2}
    two = {"policy_generation": {"devices": [1, 2], "dp": 2}, "policy_training": {"devices": [0]}}
    vllm = {"engine": "vllm"}
    whole = _async_job(grpo, two, sampling=vllm, rl={"mode": "async", "partial_rollout": False})
    assert whole.sampling.engine == "vllm" and not whole.rl.partial_rollout
    with pytest.raises(ConfigError, match=re.escape("rl.partial_rollout=True must be false")):
        _async_job(grpo, two, sampling=vllm)  # partial rollouts are the default
    with pytest.raises(ConfigError, match=re.escape("rl.refill=True must be false")):
        _async_job(
            grpo,
            two,
            sampling=vllm,
            rl={"mode": "async", "partial_rollout": False, "refill": True},
        )
