"""The ``[rl]`` table: refill (continuous batching) off by default, and a value that is
not a boolean refused with the field named."""

from __future__ import annotations

import pytest

from nereus.errors import ConfigError
from nereus.rl.mode import RLModeConfig


def test_refill_is_off_by_default_and_must_be_a_boolean():
    assert RLModeConfig(mode="async").refill is False
    assert RLModeConfig(mode="async", refill=True).refill is True
    with pytest.raises(ConfigError, match="rl.refill"):
        RLModeConfig(mode="async", refill="yes")  # type: ignore[arg-type]
