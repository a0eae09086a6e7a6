"""Rule rewards: math-verify on GSM8K- and MATH-style answers, exact match, user functions."""

from __future__ import annotations

import threading

import pytest

from nereus.data.rewards import RewardInput, exact_reward, load_reward, math_reward
from nereus.errors import ConfigError
from nereus.job.config import RewardConfig


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        (
            "Natalia sold 48 clips in April and 24 in May, so 72 clips in total.",
            "72",
            1.0,
        ),  # the last number
        ("Step 1: 48 / 2 = 24.\n#### 72", "72", 1.0),  # GSM8K's marker
        (
            "The answer is $\\boxed{72}$. Check: 70 + 2.",
            "72",
            1.0,
        ),  # a boxed answer wins over the last number
        ("She has 72 now. Then 5 more", "72", 0.0),  # the last number is 5
        ("It costs $1,000 in total.", "1000", 1.0),
        ("The answer is 72.0", "72", 1.0),
        ("so x = \\frac{1}{2}", "0.5", 1.0),
        (
            "The answer is $\\boxed{\\frac{\\sqrt{3}}{2}}$",
            "\\frac{\\sqrt{3}}{2}",
            1.0,
        ),  # MATH-style
        ("The answer is $\\boxed{\\frac{1}{3}}$", "\\frac{\\sqrt{3}}{2}", 0.0),
        ("I do not know.", "72", 0.0),
        ("", "7", 0.0),
    ],
)
def test_math_reward(response, truth, score):
    assert math_reward(response, truth) == score


def test_math_reward_runs_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("so 3 + 4 = 7", "7")))
    t.start()
    t.join()
    assert out == [1.0]


def test_exact_reward():
    assert exact_reward("  42\n", "42") == 1.0
    assert exact_reward("42.0", "42") == 0.0


def _write_module(tmp_path, body: str, name: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)


def test_user_function_gets_prompt_response_truth_and_asked_extras(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_module(
        tmp_path,
        (
            "calls = []\n"
            "def plain(prompt, response, ground_truth):\n"
            "    calls.append((prompt, response, ground_truth))\n"
            "    return len(response) / 10\n"
            "def with_source(prompt, response, ground_truth, data_source=None):\n"
            "    return 1.0 if data_source == 'openai/gsm8k' else 0.5\n"
            "def with_kwargs(prompt, response, ground_truth, **kw):\n"
            "    return float(kw['extra_info']['index']) + (kw['data_source'] == 'x')\n"
            "def says_yes(prompt, response, ground_truth):\n"
            "    return response == ground_truth\n"
            "def says_text(prompt, response, ground_truth):\n"
            "    return 'one'\n"
            "def says_nan(prompt, response, ground_truth):\n"
            "    return float('nan')\n"
            "def breaks(prompt, response, ground_truth):\n"
            "    raise KeyError('no such row')\n"
            "not_callable = 3\n"
        ),
        "user_rewards_mod",
    )
    x = RewardInput("What is 2+3?", "five!", "5", "openai/gsm8k", {"index": 4})
    assert load_reward("user_rewards_mod:plain")(x) == 0.5
    import user_rewards_mod

    assert user_rewards_mod.calls == [("What is 2+3?", "five!", "5")]
    assert load_reward("user_rewards_mod:with_source")(x) == 1.0
    assert (
        load_reward("user_rewards_mod:with_kwargs")(RewardInput("p", "r", "t", "x", {"index": 2}))
        == 3.0
    )
    assert load_reward("user_rewards_mod:says_yes")(RewardInput("p", "5", "5")) == 1.0
    with pytest.raises(
        ConfigError,
        match=r"user_rewards_mod:says_text returned 'one'; expected a finite real number",
    ):
        load_reward("user_rewards_mod:says_text")(x)
    with pytest.raises(ConfigError, match="returned nan"):
        load_reward("user_rewards_mod:says_nan")(x)
    with pytest.raises(KeyError, match="no such row") as info:
        load_reward("user_rewards_mod:breaks")(x)
    assert "in reward function user_rewards_mod:breaks" in info.value.__notes__
    with pytest.raises(ConfigError, match="no callable 'not_callable'"):
        load_reward("user_rewards_mod:not_callable")
    with pytest.raises(ConfigError, match="no callable 'missing'"):
        load_reward("user_rewards_mod:missing")
    with pytest.raises(ConfigError, match="module 'no_such_module_xyz' does not import"):
        load_reward("no_such_module_xyz:f")


def test_reward_config_names_the_rule():
    assert RewardConfig(rule="math").rule == "math"
    assert RewardConfig(rule="my.pkg.rewards:score").rule == "my.pkg.rewards:score"
    for bad in ("maths", "module:", ":f", "a b:c"):
        with pytest.raises(ConfigError, match=rf"reward.rule={bad!r} must be one of"):
            RewardConfig(rule=bad)
