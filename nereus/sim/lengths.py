"""Per-response lengths drawn from a length log's per-step mean and maximum.

A response-length log (``nereus.sim.traces.length_trace``) gives, per step, the mean
response length ``m`` and, for some logs, the longest response ``M`` of that step. A
running job that replays the log (``[trace] lengths``, ``nereus.job.traces``) generates
with the end-of-sequence token ignored, each response to a length drawn here, as
throughput benchmarks do.

The law (``length_law``): a response's length is ``min(bound, max(1, round(X)))`` with
``X = exp(mu + sigma * Z)``, ``Z`` standard normal: a lognormal, the usual two-parameter
long-tailed law for lengths (most responses near the median, a few far longer), whose
two parameters the log's two numbers fix:

- ``sigma`` makes the expected maximum of the step's ``n`` responses ``M`` (with
  ``mu = ln m - sigma**2 / 2``, the lognormal of mean ``m``). The maximum is what is
  matched because a batch decodes until its longest row is done: the step's straggler
  sets its generation time, and ``n`` is the job's own number of responses per step
  (the log's batch is often not stated, or far larger). ``E[max]`` is computed by
  quadrature: ``m * integral of exp(sigma z - sigma**2 / 2) * n phi(z) Phi(z)**(n - 1)``;
  it rises with ``sigma`` towards ``n * m`` (one response holding nearly every token).
  ``sigma`` is kept at most ``z_n = Phi^-1(2**(-1/n))``, the spread at which the
  *median* step's longest response, ``m * exp(sigma z_n - sigma**2 / 2)``, is longest:
  past it a wider law shortens most steps' longest response (and sinks the median
  response towards one token) to lengthen only rare ones. A ratio ``M / m`` beyond
  that reach (a log whose batch was far larger than the job's) leaves the step's
  expected longest response below ``M``.
- ``bound`` (the job's cap at that step: the log's maximum scaled, no response longer
  than the log's longest) clamps the draw; ``mu`` is then raised so the clamped law's
  mean is ``m`` again (closed form: ``E[min(X, B)] = e^(mu + sigma^2/2) Phi((ln B - mu -
  sigma^2) / sigma) + B (1 - Phi((ln B - mu) / sigma))``). Rounding and the floor of one
  token move the mean by well under a token. The clamp trims the longest draws, so a
  step's longest response averages somewhat under ``M`` (about 0.9 ``M`` for ratios
  ``M / m`` of 2 to 5).

Where the log gives no maximum (or ``M <= m``, or ``n == 1``), nothing says how lengths
spread within a step and none is invented: every response is ``m`` tokens (rounded, at
most ``bound``).

The draw (``draw_length``) is a pure function of (run seed, sample index, row): ``Z`` is
the normal quantile of a uniform hashed from the three, so a prompt's responses get the
same lengths whatever the mode, policy or plan, and the step only picks the law.

Refuses (``ConfigError``): a mean below one token, a maximum below the mean, ``n`` or a
bound below 1.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from nereus.config import require

__all__ = [
    "LengthLaw",
    "length_law",
    "key_normal",
    "draw_length",
    "expected_max_ratio",
    "widest_spread",
]

_UNIT = NormalDist()
_Z = np.linspace(-9.0, 12.0, 8401)  # quadrature nodes for E[max]; the tails past are < 1e-18


@dataclass(frozen=True)
class LengthLaw:
    """One step's law of response lengths (module docstring): ``sigma == 0`` is every
    response ``round(mean)`` tokens."""

    mean: float
    bound: int
    mu: float
    sigma: float

    def length(self, z: float) -> int:
        """The length at standard-normal quantile ``z``, in [1, bound]."""
        if self.sigma == 0.0:
            return max(1, min(self.bound, round(self.mean)))
        log_x = self.mu + self.sigma * z
        if log_x >= math.log(self.bound):
            return self.bound
        return max(1, min(self.bound, round(math.exp(log_x))))


@lru_cache(maxsize=64)
def _max_weights(n: int) -> np.ndarray:
    """Trapezoid weights of the density of the largest of ``n`` standard normals at ``_Z``."""
    cdf = np.array([_UNIT.cdf(float(z)) for z in _Z])
    log_pdf = -0.5 * _Z**2 - 0.5 * math.log(2 * math.pi)
    with np.errstate(divide="ignore"):
        log_w = math.log(n) + log_pdf + (n - 1) * np.log(cdf)
    w = np.exp(log_w)
    step = _Z[1] - _Z[0]
    w[0] *= 0.5
    w[-1] *= 0.5
    return w * step


def expected_max_ratio(sigma: float, n: int) -> float:
    """``E[max of n draws] / mean`` of a lognormal of spread ``sigma`` (any mean)."""
    require(n >= 1, "n", n, "must be >= 1 response")
    w = _max_weights(n)
    return float(np.sum(w * np.exp(sigma * _Z - 0.5 * sigma * sigma)))


def widest_spread(n: int) -> float:
    """``z_n``, the largest ``sigma`` a step of ``n`` responses is given (module docstring)."""
    require(n >= 1, "n", n, "must be >= 1 response")
    return 0.0 if n == 1 else _UNIT.inv_cdf(0.5 ** (1.0 / n))


def _spread(ratio: float, n: int) -> float:
    """The sigma whose expected maximum over ``n`` is ``ratio`` times the mean, at most
    ``widest_spread(n)``."""
    top = widest_spread(n)
    if ratio >= expected_max_ratio(top, n):
        return top
    lo, hi = 0.0, top
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if expected_max_ratio(mid, n) < ratio:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _clamped_mean(mu: float, sigma: float, bound: float) -> float:
    """``E[min(exp(mu + sigma Z), bound)]``."""
    log_b = math.log(bound)
    head = math.exp(mu + 0.5 * sigma * sigma) * _UNIT.cdf((log_b - mu - sigma * sigma) / sigma)
    return head + bound * (1.0 - _UNIT.cdf((log_b - mu) / sigma))


def _location(mean: float, sigma: float, bound: float) -> float:
    """The mu whose law clamped at ``bound`` has mean ``mean`` (< bound)."""
    lo = math.log(mean) - 0.5 * sigma * sigma  # unclamped mean ``mean``: clamped, less
    hi = math.log(bound) + 10.0 * sigma  # nearly every draw at the bound
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _clamped_mean(mid, sigma, bound) < mean:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@lru_cache(maxsize=4096)
def length_law(mean: float, maximum: float | None, n: int, bound: int) -> LengthLaw:
    """The law of one step's response lengths: ``mean`` and (None: the log gives none)
    ``maximum`` tokens over the step's ``n`` responses, clamped to [1, ``bound``]
    (module docstring)."""
    require(mean >= 1, "length mean", mean, "must be >= 1 token")
    require(isinstance(n, int) and n >= 1, "responses per step", n, "must be an integer >= 1")
    require(isinstance(bound, int) and bound >= 1, "length bound", bound, "must be an integer >= 1")
    require(
        maximum is None or maximum >= mean,
        "length maximum",
        maximum,
        f"must be >= the step's mean {mean}",
    )
    if maximum is None or maximum <= mean or n == 1 or bound <= mean:
        return LengthLaw(float(mean), bound, math.log(mean), 0.0)
    sigma = _spread(maximum / mean, n)
    if sigma == 0.0:
        return LengthLaw(float(mean), bound, math.log(mean), 0.0)
    return LengthLaw(float(mean), bound, _location(mean, sigma, bound), sigma)


def key_normal(seed: int, index: int, row: int) -> float:
    """The standard-normal quantile of (run ``seed``, sample ``index``, ``row``): the
    normal quantile of a uniform in (0, 1) hashed from the three."""
    digest = hashlib.blake2b(f"{seed}:{index}:{row}".encode(), digest_size=8).digest()
    u = ((int.from_bytes(digest, "little") >> 11) + 0.5) / float(1 << 53)
    return _UNIT.inv_cdf(u)


def draw_length(
    mean: float, maximum: float | None, n: int, bound: int, seed: int, index: int, row: int
) -> int:
    """The length of response ``row`` of sample ``index`` under run ``seed``, in a step of
    ``n`` responses whose log gives ``mean`` and ``maximum`` (module docstring)."""
    return length_law(mean, maximum, n, bound).length(key_normal(seed, index, row))
