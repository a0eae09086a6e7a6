"""Shipped tasks: deterministic samples, rule rewards, refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.data.tasks import ArithmeticTask, CountTask, ReverseTask, make_task, positional_match
from nereus.errors import ConfigError


@pytest.mark.parametrize("task", [ArithmeticTask(), ReverseTask(), CountTask()])
def test_sample_is_pure_function_of_seed_and_index(task):
    a = [task.sample(i, seed=3) for i in range(50)]
    b = [task.sample(i, seed=3) for i in reversed(range(50))][::-1]
    assert a == b
    assert [s.prompt for s in a] != [task.sample(i, seed=4).prompt for i in range(50)]
    for s in a:
        assert task.reward(s, s.answer) == 1.0
        assert set(s.prompt + s.answer) <= set(task.alphabet)


def test_arithmetic_answers_are_correct():
    task = ArithmeticTask(max_operand=9, ops="+-*")
    for i in range(200):
        s = task.sample(i, seed=0)
        assert str(eval(s.prompt[:-1])) == s.answer  # the prompt is "a op b="


def test_reverse_and_partial_credit():
    task = ReverseTask()
    s = task.sample(0, seed=1)
    assert s.answer == s.prompt[:-1][::-1]
    assert task.reward(s, " " + s.answer + " ") == 1.0
    assert positional_match("abx", "abc") == pytest.approx(2 / 3)
    assert positional_match("abcdef", "abc") == pytest.approx(0.5)  # too long loses credit
    assert positional_match("", "") == 1.0
    strict = ReverseTask(partial_credit=False)
    assert strict.reward(s, "zz") == 0.0


def test_count_partial_credit_prefers_near_counts():
    task = CountTask()
    s = task.sample(5, seed=0)
    n = int(s.answer)
    near, far = task.reward(s, str(n + 1)), task.reward(s, str(n + 5))
    assert 0.5 > near > far >= 0.0
    assert task.reward(s, "x") == 0.0


def test_natural_style_extracts_the_answer():
    task = ArithmeticTask(style="natural")
    s = task.sample(2, seed=0)
    assert s.prompt.startswith("What is ")
    assert task.reward(s, f"The answer is {s.answer}.") == 1.0
    rev = ReverseTask(style="natural")
    r = rev.sample(0, seed=0)
    assert rev.reward(r, f"'{r.answer}'") == 1.0


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=12), st.text(min_size=0, max_size=12))
def test_positional_match_is_a_fraction(a, b):
    v = positional_match(a, b)
    assert 0.0 <= v <= 1.0
    assert (v == 1.0) == (a == b)


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="ReverseTask.max_len"):
        ReverseTask(min_len=4, max_len=2)
    with pytest.raises(ConfigError, match="ArithmeticTask.ops"):
        ArithmeticTask(ops="/")
    with pytest.raises(ConfigError, match="task.name='nope'"):
        make_task("nope")
    with pytest.raises(ConfigError, match="not options of task"):
        make_task("count", bogus=1)
    assert make_task("reverse", letters="xy").letters == "xy"
