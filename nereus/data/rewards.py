"""Verifiable rule rewards over a prompt, a response and a ground truth.

``[reward] rule`` names one of:

- ``"math"``: the response's final answer (a ``\\boxed{...}`` one, else the last number or
  LaTeX expression) checked against the ground truth with ``math-verify``: equal values
  score 1.0 whatever their form, anything else 0.0;
- ``"exact"``: 1.0 when the stripped response equals the stripped ground truth, else 0.0;
- ``"module:function"``: a user function called as ``function(prompt, response,
  ground_truth)`` (plus ``data_source`` and ``extra_info`` when its signature names
  them), returning a real number;
- ``"task"``: the synthetic task's own rule (the default, synthetic tasks only).

Rewards run in the job's driver process, one response at a time, right after responses
are decoded; they see text, never tensors or workers.

Refuses (``ConfigError``): an unknown rule, a ``module:function`` that does not import
or is not callable, a user function that returns something other than a finite real
number (the error names the function and the value). Exceptions a user function raises
propagate with a note naming the function: a reward that cannot be computed stops the job.

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nereus.errors import ConfigError

__all__ = [
    "add_note",
    "RULES",
    "RewardInput",
    "RewardFunction",
    "math_reward",
    "exact_reward",
    "load_reward",
    "is_function_spec",
]

RULES = ("task", "math", "exact")
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class RewardInput:
    """What a rule reward sees of one response."""

    prompt: str
    response: str
    ground_truth: str
    data_source: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)


RewardFunction = Callable[[RewardInput], float]


def is_function_spec(rule: str) -> bool:
    """True when ``rule`` reads as ``module:function``."""
    return bool(_SPEC.match(rule))


def _timeout() -> int | None:
    # math-verify's timeout is signal.alarm, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 when ``response``'s final answer equals ``ground_truth`` (see the module docstring)."""
    from math_verify import parse, verify

    timeout = _timeout()
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
    if not gold:
        raise ConfigError(f"ground truth {ground_truth!r} holds no answer math-verify can read")
    answer = parse(response, parsing_timeout=timeout)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=timeout) else 0.0


def exact_reward(response: str, ground_truth: str) -> float:
    """1.0 when the stripped strings are equal, else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


def _user_function(spec: str) -> RewardFunction:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"reward.rule={spec!r}: module {module_name!r} does not import: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward.rule={spec!r}: {module_name} has no callable {attr!r}")
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extras = [k for k in ("data_source", "extra_info") if takes_all or k in params]

    def call(x: RewardInput) -> float:
        kwargs = {k: getattr(x, k) for k in extras}
        try:
            value = fn(x.prompt, x.response, x.ground_truth, **kwargs)
        except Exception as e:
            add_note(e, f"in reward function {spec}")
            raise
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(
                f"reward function {spec} returned {value!r}; expected a finite real number"
            )
        return float(value)

    call.__name__ = spec
    return call


def add_note(e: BaseException, text: str) -> None:
    if hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(text)


def load_reward(rule: str) -> RewardFunction:
    """The reward function ``rule`` names (not ``"task"``: a task scores itself)."""
    if rule == "math":
        return lambda x: math_reward(x.response, x.ground_truth)
    if rule == "exact":
        return lambda x: exact_reward(x.response, x.ground_truth)
    if is_function_spec(rule):
        return _user_function(rule)
    raise ConfigError(f"reward.rule={rule!r} must be 'math', 'exact' or 'module:function' here")
