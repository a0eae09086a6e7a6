"""Named scenarios: the paper's §7.3.3 run and its held-out trace pairs.

``paper-7.3.3`` is the paper's Cluster #2 (A100 64 GB, 4 per node, NVLink 3.0, 4 x HDR100
InfiniBand: the ``a100-256`` preset) as a 32-GPU allocation (8 nodes) within which the
pool varies from 8 to 32 devices, Llama-3.1-8B PPO with equal-size actor, critic,
reference and reward models, 26 steps, and its policies: ``static`` (the initial TP/PP
for the job's largest cap, DP following the pool), ``every-k`` (k = 3), ``dynarl``,
``adaptive`` (gamma 0.5) and the ``oracle`` reference.

Each trace pair (``pair`` 0, 1, 2) is a real response-length log and a spot trace, fixed
here before any run of the scenario; pair 0 is the paper's first trace:

- lengths: the log is averaged onto the run's 26 steps (equal blocks of its steps), its
  step-to-step shape kept as the ratio to its own least-squares line, and that shape put
  on a line chosen so the mean of the first three steps is 1,150 tokens and of the last
  three 3,700 (the paper: the mean grows from about 1,150 to 3,700 tokens); no log holds
  a 95th percentile, so each step's p95 is its mean times a ratio linear in the step,
  chosen the same way so the first three average 1,340 and the last three 4,070;
- devices: the spot trace's count of 0-16 instances maps linearly onto 8-32 devices in
  whole nodes, starting ``offset_ticks`` into the trace;
- the job's cap: one cap for the run (``fixed``), twice the largest mean rounded up to a
  power of two, so every policy, static included, plans memory for it from the start.

``PAPER`` holds the paper's figures printed beside the simulation's. Reads the traces
from ``traces_dir`` (default: ``../shared/traces`` beside the project's root); refuses
an unknown preset or pair (``ConfigError``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nereus.config import require
from nereus.errors import ConfigError
from nereus.sim.traces import LengthTrace

__all__ = [
    "TracePair",
    "Preset",
    "PRESETS",
    "PAPER",
    "preset",
    "paper_lengths",
    "default_traces_dir",
    "EDGE_STEPS",
]

EDGE_STEPS = 3  # steps averaged at the start and at the end of a trace

# The paper's figures (§7.3.3): mean step seconds on the first trace, and the mean over
# its three traces (every-3 on the first trace: 2.5% above adaptive).
PAPER = {
    "first": {"adaptive": 861.9, "every-k": 884.0, "dynarl": 939.5, "static": 1191.6},
    "three": {"adaptive": 858.7, "every-k": 873.8, "dynarl": 928.3},
    "reduction_vs_static": 0.277,
}


@dataclass(frozen=True)
class TracePair:
    """A response-length log and a spot trace (file stems), where the spot trace starts,
    and why the pair was chosen."""

    lengths: str
    spot: str
    offset_ticks: int
    why: str


@dataclass(frozen=True)
class Preset:
    cluster: str
    nodes: int
    model: str
    algorithm: str
    steps: int
    pool_range: tuple[int, int]
    mean: tuple[float, float]
    p95: tuple[float, float]
    pairs: tuple[TracePair, ...]
    policies: tuple[str, ...]
    k: int
    gamma: float


PRESETS: dict[str, Preset] = {
    "paper-7.3.3": Preset(
        cluster="a100-256",
        nodes=8,
        model="llama-8b",
        algorithm="ppo",
        steps=26,
        pool_range=(8, 32),
        mean=(1150.0, 3700.0),
        p95=(1340.0, 4070.0),
        pairs=(
            TracePair(
                "softgrpo-llama3.2-3b-grpo",
                "us-east-2b_v100_1",
                0,
                "the paper's first trace: a Llama GRPO log (verl, 8k cap) whose mean grows "
                "over its run",
            ),
            TracePair(
                "rasbt-qwen3-0.6b-base-grpo-clip",
                "us-west-2a_v100_1",
                0,
                "held out: a log that grows fast at first, then oscillates; the other spot trace",
            ),
            TracePair(
                "areal-fork-qwen2.5-0.5b-grpo-gsm8k-a40-reasoning",
                "us-east-2b_v100_1",
                1600,
                "held out: a noisy, slowly growing log; the first spot trace from its middle",
            ),
        ),
        policies=("adaptive", "every-k", "dynarl", "static", "oracle"),
        k=3,
        gamma=0.5,
    ),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(
            f"--scenario={name!r} is not a known preset; expected one of {sorted(PRESETS)}"
        )
    return PRESETS[name]


def default_traces_dir() -> Path:
    """``../shared/traces`` beside the project's root."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def _edge_solve(
    first: tuple[float, float], last: tuple[float, float], want: tuple[float, float]
) -> tuple[float, float]:
    """(a, b) with a x first[0] + b x first[1] = want[0] and likewise for ``last``."""
    m = np.array([first, last])
    a, b = np.linalg.solve(m, np.array(want))
    return float(a), float(b)


def paper_lengths(
    path: str | Path, steps: int, mean: tuple[float, float], p95: tuple[float, float]
) -> LengthTrace:
    """The log at ``path`` as the module docstring says: ``steps`` steps whose first and
    last ``EDGE_STEPS`` average ``mean`` and ``p95`` at the start and the end."""
    data = json.loads(Path(path).read_text())
    y = np.array([float(v) for v in data["mean"] if v is not None])
    require(len(y) >= steps, "length log", str(path), f"must hold at least {steps} steps")
    blocks = np.array([b.mean() for b in np.array_split(y, steps)])
    t = np.arange(steps, dtype=float)
    slope, icept = np.polyfit(t, blocks, 1)
    shape = blocks / (icept + slope * t)
    e = EDGE_STEPS
    a, b = _edge_solve(
        (shape[:e].mean(), (t * shape)[:e].mean()),
        (shape[-e:].mean(), (t * shape)[-e:].mean()),
        mean,
    )
    line = a + b * t
    require(
        bool((line > 0).all()), "length log", str(path), "must keep a positive trend once rescaled"
    )
    means = line * shape
    c, d = _edge_solve(
        (means[:e].mean(), (t * means)[:e].mean()),
        (means[-e:].mean(), (t * means)[-e:].mean()),
        p95,
    )
    ratio = c + d * t
    require(
        bool((ratio >= 1).all()), "p95 ratio", [float(ratio[0]), float(ratio[-1])], "must stay >= 1"
    )
    return LengthTrace(
        Path(path).stem, tuple(float(v) for v in means), tuple(float(v) for v in means * ratio)
    )


def pair_paths(
    p: Preset, pair: int, traces_dir: str | Path | None = None
) -> tuple[Path, Path, TracePair]:
    """The length log's and spot trace's paths of pair ``pair``."""
    require(
        isinstance(pair, int) and 0 <= pair < len(p.pairs),
        "pair",
        pair,
        f"must be in [0, {len(p.pairs)})",
    )
    root = Path(traces_dir) if traces_dir else default_traces_dir()
    tp = p.pairs[pair]
    lengths = root / "response-length" / f"{tp.lengths}.json"
    spot = root / "spot-availability" / f"{tp.spot}.json"
    for f in (lengths, spot):
        if not f.is_file():
            raise ConfigError(
                f"trace {str(f)!r} does not exist (set --traces-dir to the shared traces folder)"
            )
    return lengths, spot, tp


def edge_stats(values: tuple[float, ...]) -> tuple[float, float]:
    """The mean of the first and of the last ``EDGE_STEPS`` values."""
    e = EDGE_STEPS
    return float(np.mean(values[:e])), float(np.mean(values[-e:]))


def cap_for(trace: LengthTrace) -> int:
    """The job's one cap: twice the largest mean, rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(2 * max(trace.means))))
