"""A running job changes TP, PP, DP and placement between steps over the state its workers
hold: A -> B -> A is bitwise in a PPO job with a critic and the next step equals a job's
that never changed; a GRPO run changes every few steps, each model-stage computing the
same logits before and after; a change that would break a budget is refused before
anything moves."""

from __future__ import annotations

import pytest
import torch

from nereus.errors import InfeasibleTransition, OutOfMemory
from nereus.job.loop import RLJob
from nereus.planner import Plan, StagePlan
from tests.job._jobs import job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRAINED = ("policy_training", "critic_training")


def _plan(**stages: tuple[int, int, list[list[int]]]) -> Plan:
    return Plan(
        tuple(
            (name, StagePlan(tp, pp, len(devs), tuple(tuple(d) for d in devs)))
            for name, (tp, pp, devs) in stages.items()
        )
    )


async def _state(rl: RLJob) -> dict:
    """Everything the transitions must carry, copied: every training EMU's tensors per
    (model-stage, replica, rank), their logical state, the policy version, the position."""
    out: dict = {"policy_version": rl.stages.policy_version, "position": rl.dataset.position}
    for stage in TRAINED:
        for i, emu in enumerate(rl.stages.handles[stage].emus):
            for rank, shards in enumerate(await emu.shards()):
                out[(stage, i, rank)] = {k: v.clone() for k, v in shards.items()}
            out[(stage, i, "state")] = await emu.mesh.get_state.call(emu.name)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if (
            isinstance(a[key], dict)
            and a[key]
            and isinstance(next(iter(a[key].values())), torch.Tensor)
        ):
            assert a[key].keys() == b[key].keys(), key
            for name, t in a[key].items():
                assert t.dtype == b[key][name].dtype and torch.equal(t, b[key][name]), (key, name)
        else:
            assert a[key] == b[key], key


PPO = {"name": "ppo", "samples_per_prompt": 4, "kl_coef": 0.01, "kl_mode": "penalty"}
PPO_A = {
    "policy_generation": {"devices": [0, 1], "dp": 2},
    "reference_inference": {"devices": [1]},
    "critic_inference": {"devices": [3]},
    "policy_training": {"devices": [0]},
    "critic_training": {"devices": [2, 3], "tp": 2},
}
# every model-stage changes: TP up and down, PP up, DP up and down, disjoint devices
PPO_B = _plan(
    policy_generation=(2, 1, [[2, 3]]),
    reference_inference=(1, 2, [[0, 1]]),
    critic_inference=(2, 1, [[0, 1]]),
    policy_training=(1, 1, [[1], [2]]),
    critic_training=(1, 2, [[0, 1]]),
)


async def test_a_to_b_to_a_in_a_running_ppo_job_is_bitwise_and_the_next_step_is_unchanged(tmp_path):
    def config(out: str):
        return job(
            out,
            4,
            algorithm=PPO,
            cluster={"mode": "local", "devices": 4, "memory_per_device": "256MiB"},
            plan=PPO_A,
        )

    steady = RLJob(config(str(tmp_path / "steady")))
    await steady.start()
    try:
        [await steady.run_step() for _ in range(3)]
        want_record = await steady.run_step()
        want_state = await _state(steady)
    finally:
        await steady.close()

    rl = RLJob(config(str(tmp_path / "live")))
    await rl.start()
    try:
        [await rl.run_step() for _ in range(3)]
        a = rl.stages.plan
        before = await _state(rl)
        report = await rl.apply_plan(PPO_B)
        assert sorted(report["changed"]) == sorted(PPO_A) and report["bytes"] > 0
        assert (
            report["bytes_measured"] == report["bytes"]
        )  # the workers' counters, not the plan's figure
        assert rl.stages.plan == PPO_B and report["epoch"] == 2
        # the logical state travelled with the tensors
        for stage in TRAINED:
            for emu in rl.stages.handles[stage].emus:
                states = await emu.mesh.get_state.call(emu.name)
                assert all(s == before[(stage, 0, "state")][0] for s in states), (stage, states)
        await rl.apply_plan(a)
        assert rl.stages.plan == a and rl.stages.epoch == 3
        _assert_same(before, await _state(rl))
        got_record = await rl.run_step()
        _assert_same(want_state, await _state(rl))
    finally:
        await rl.close()
    keys = (
        "reward_mean",
        "response_len_mean",
        "policy_loss",
        "value_loss",
        "grad_norm",
        "critic_grad_norm",
        "policy_version",
        "dataset_position",
    )
    assert {k: got_record[k] for k in keys} == {k: want_record[k] for k in keys}
    assert got_record["epoch"] == 3


GRPO = {"prompts_per_step": 8, "samples_per_prompt": 4, "kl_coef": 0.01}
MODEL = {
    "hidden_size": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
}
GRPO_0 = {
    "policy_generation": {"devices": [0, 1, 2, 3], "dp": 4},
    "reference_inference": {"devices": [3]},
    "policy_training": {"devices": [0, 1], "tp": 2},
}
CHANGES = [
    # TP down and a move (training), TP up and DP down (generation), PP up onto disjoint devices
    # (reference)
    _plan(
        policy_generation=(2, 1, [[0, 1], [2, 3]]),
        reference_inference=(1, 2, [[0, 1]]),
        policy_training=(1, 1, [[2]]),
    ),
    # PP up (training), TP down and DP up (generation), PP down (reference)
    _plan(
        policy_generation=(1, 1, [[0], [1], [2], [3]]),
        reference_inference=(1, 1, [[1]]),
        policy_training=(1, 2, [[2, 3]]),
    ),
    # back to the start: PP down and TP up onto disjoint devices (training), a move (reference)
    _plan(
        policy_generation=(1, 1, [[0], [1], [2], [3]]),
        reference_inference=(1, 1, [[3]]),
        policy_training=(2, 1, [[0, 1]]),
    ),
]


def _layouts(plan: Plan) -> dict[str, tuple[int, int]]:
    return {name: (sp.tp, sp.pp) for name, sp in plan}


async def _logprobs(rl: RLJob, batch: dict) -> dict[str, list[torch.Tensor]]:
    """Each model-stage's per-token log-probabilities of ``batch``, every EMU on all of it."""
    return {
        stage: [await emu.logprobs(batch) for emu in handle.emus]
        for stage, handle in rl.stages.handles.items()
    }


async def test_a_grpo_run_changes_every_few_steps_and_each_model_stage_computes_the_same(tmp_path):
    from nereus.job.local_stages import prepare_model
    from nereus.models import model_spec

    optim = {
        "lr": 3e-3,
        "micro_batch_size": 8,
    }  # a step's activations stay small beside the weights
    probe = RLJob(job(str(tmp_path), 8, algorithm=GRPO, model=MODEL, plan=GRPO_0, optim=optim))
    config, _, _ = prepare_model(probe.cfg, probe.codec, tmp_path / "probe")
    weights = model_spec(config).nbytes  # P: one copy of the policy's weights
    # training at TP 1 needs 3P (weights and moments) + P of gradients on one device; the
    # budget takes every plan below with room for a step's activations, not 6P on device 3
    budget = int(5.5 * weights)
    rl = RLJob(
        job(
            str(tmp_path),
            8,
            algorithm=GRPO,
            model=MODEL,
            plan=GRPO_0,
            optim=optim,
            cluster={"mode": "local", "devices": 4, "memory_per_device": str(budget)},
        )
    )
    await rl.start()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, rl.model_config.vocab_size, (6, 10), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    try:
        records = [await rl.run_step() for _ in range(2)]
        for target in CHANGES:
            before, layouts = await _logprobs(rl, batch), _layouts(rl.stages.plan)
            await rl.stages.memory_peaks(reset=True)
            report = await rl.apply_plan(target)
            peaks = await rl.stages.memory_peaks(reset=True)
            assert all(p <= budget for p in peaks.values()), (peaks, budget)
            assert report["bytes_measured"] == report["bytes"] > 0
            after = await _logprobs(rl, batch)
            for stage, outs in after.items():
                ref = before[stage][0]
                exact = layouts[stage] == _layouts(target)[stage]
                for out in outs:
                    if exact:
                        assert torch.equal(out, ref), stage
                    else:
                        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=stage)
            records += [await rl.run_step() for _ in range(2)]

        # a change that would break a budget is refused before anything moves
        held = {d: await h.held.call_one() for d, h in rl.stages.hosts.items()}
        plan = rl.stages.plan
        too_big = _plan(
            policy_generation=(1, 1, [[0], [1], [2], [3]]),
            reference_inference=(1, 1, [[3]]),
            policy_training=(1, 1, [[2], [3]]),
        )
        with pytest.raises((OutOfMemory, InfeasibleTransition)) as info:
            await rl.apply_plan(too_big)
        err = info.value
        assert (
            err.device == 3
            and getattr(err, "budget_bytes", getattr(err, "cap_bytes", None)) == budget
        )
        assert rl.stages.plan == plan
        assert {d: await h.held.call_one() for d, h in rl.stages.hosts.items()} == held
        records.append(await rl.run_step())
    finally:
        await rl.close()
    assert [r["step"] for r in records] == list(range(9))
    assert [r["epoch"] for r in records] == [1, 1, 2, 2, 3, 3, 4, 4, 4]
    assert all(max(r["device_peak_bytes"].values()) <= budget for r in records)
