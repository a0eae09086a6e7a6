"""`make demo`: GRPO on a tiny model over an embedded local cluster of 4 CPU devices.

Runs examples/grpo_tiny.toml: a progress bar per step (stage times, reward, lengths),
a summary table at the end, metrics in runs/grpo_tiny/metrics.jsonl and a plot in
runs/grpo_tiny/plot.png. The mean reward rises from under 0.1 to about 0.6 in 120 steps
(about 20 s on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

from nereus.rl.cli import main

CONFIG = Path(__file__).with_name("grpo_tiny.toml")

if __name__ == "__main__":
    sys.exit(main([str(CONFIG), *sys.argv[1:]]))
