"""Per-response length draws (``nereus.sim.lengths``): a step's lengths average its mean
and their longest over the step's responses comes near its maximum (statistical, fixed
keys, wide margins); a key always draws the same length; no maximum, no spread; every
length within [1, bound]; bad inputs name the field."""

from __future__ import annotations

import statistics

import pytest

from nereus.errors import ConfigError
from nereus.sim.lengths import (
    draw_length,
    expected_max_ratio,
    key_normal,
    length_law,
    widest_spread,
)


def _steps(mean: float, maximum: float | None, n: int, bound: int, steps: int) -> list[list[int]]:
    """``steps`` steps of ``n`` responses, each step's rows keyed by distinct sample indices."""
    return [
        [draw_length(mean, maximum, n, bound, 7, s * n + i, 0) for i in range(n)]
        for s in range(steps)
    ]


@pytest.mark.parametrize(
    ("mean", "maximum", "n"), [(100.0, 300.0, 64), (40.0, 100.0, 16), (200.0, 260.0, 8)]
)
def test_the_mean_is_the_logs_and_the_steps_longest_comes_near_its_maximum(mean, maximum, n):
    bound = round(maximum)
    steps = _steps(mean, maximum, n, bound, 400)
    every = [x for step in steps for x in step]
    assert statistics.fmean(every) == pytest.approx(mean, rel=0.05)
    longest = statistics.fmean(max(step) for step in steps)
    assert 0.75 * maximum <= longest <= maximum
    assert min(every) >= 1 and max(every) <= bound
    assert len(set(every)) > n  # a spread, not one length


def test_the_spread_is_fitted_to_the_expected_maximum_and_kept_below_the_widest():
    law = length_law(100.0, 300.0, 64, 10_000)  # a bound far away: the plain lognormal
    assert expected_max_ratio(law.sigma, 64) == pytest.approx(3.0, rel=1e-3)
    assert law.sigma < widest_spread(64)
    # a ratio out of reach for 8 responses takes the widest spread, no more
    assert length_law(100.0, 5000.0, 8, 5000).sigma == pytest.approx(widest_spread(8))
    assert widest_spread(1) == 0.0 and expected_max_ratio(0.0, 8) == pytest.approx(1.0)


def test_a_key_draws_the_same_length_and_other_keys_other_lengths():
    a = [draw_length(50.0, 150.0, 32, 150, 3, 11, r) for r in range(4)]
    assert a == [draw_length(50.0, 150.0, 32, 150, 3, 11, r) for r in range(4)]
    assert key_normal(3, 11, 0) == key_normal(3, 11, 0)
    assert len({key_normal(3, 11, r) for r in range(8)}) == 8
    assert key_normal(4, 11, 0) != key_normal(3, 11, 0)
    assert key_normal(3, 12, 0) != key_normal(3, 11, 0)


def test_without_a_maximum_every_response_is_the_mean():
    assert {x for step in _steps(37.4, None, 16, 64, 20) for x in step} == {37}
    assert {x for step in _steps(37.4, 37.4, 16, 64, 5) for x in step} == {37}
    assert {x for step in _steps(37.4, 90.0, 1, 90, 20) for x in step} == {37}  # one response
    assert {x for step in _steps(70.0, None, 4, 64, 2) for x in step} == {64}  # the bound holds


def test_bad_inputs_name_the_field():
    with pytest.raises(ConfigError, match="length mean"):
        length_law(0.5, None, 4, 8)
    with pytest.raises(ConfigError, match="length maximum"):
        length_law(10.0, 5.0, 4, 8)
    with pytest.raises(ConfigError, match="responses per step"):
        length_law(10.0, 20.0, 0, 8)
    with pytest.raises(ConfigError, match="length bound"):
        length_law(10.0, 20.0, 4, 0)
