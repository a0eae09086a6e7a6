"""Buffer entries per algorithm, without processes: which prompt an entry is, how many
entries make an update, and that a ReMax baseline row is never among the trained rows."""

from __future__ import annotations

from nereus.job.async_update import EntryShape, entry_rollouts
from nereus.rl.algorithms import AlgorithmConfig
from nereus.rl.async_buffer import Group


def test_an_entry_is_a_group_for_grpo_and_remax_and_a_sample_for_ppo():
    grpo = EntryShape.of(AlgorithmConfig("grpo", samples_per_prompt=4))
    remax = EntryShape.of(AlgorithmConfig("remax", samples_per_prompt=4))
    ppo = EntryShape.of(AlgorithmConfig("ppo", samples_per_prompt=3))
    assert (grpo.per_prompt, grpo.samples, grpo.baseline) == (1, 4, False)
    assert (remax.per_prompt, remax.samples, remax.baseline) == (1, 4, True)
    assert (ppo.per_prompt, ppo.samples, ppo.baseline) == (3, 1, False)
    # PPO: entry e is sample e mod k of prompt e // k; the dataset position counts the
    # prompts of which some sample was issued
    assert [ppo.prompt(e) for e in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [ppo.prompts_before(e) for e in (0, 1, 3, 4, 6)] == [0, 1, 1, 2, 2]
    assert [grpo.prompt(e) for e in range(3)] == [0, 1, 2]
    assert [grpo.prompts_before(e) for e in range(3)] == [0, 1, 2]


def test_the_trained_rows_leave_the_baseline_out():
    g = Group(5, 9, [1, 2], [[3], [4, 5]], [[-1.0], [-1.0, -2.0]], [[0], [0, 1]], 0, [1.0, 0.0])
    g.baseline_ids, g.baseline_versions, g.baseline_score = [6, 7], [0, 1], 0.5
    rollouts = entry_rollouts([g])
    assert rollouts.response_ids == [[3], [4, 5]]
    assert rollouts.scores == [1.0, 0.0] and rollouts.sample_index == [9, 9]
    assert rollouts.policy_version == [0, 0]
    assert g.used_versions == [[0], [0, 1], [0, 1]]
