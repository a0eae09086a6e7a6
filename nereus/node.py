"""``python -m nereus.node``: the per-host node daemon (``nereus node``), one worker
process per device. The daemon is part of the actor runtime (``nereus.actors``); this
module only keeps its ``python -m`` entry where launch scripts expect it."""

from __future__ import annotations

import sys

from nereus.actors import node_main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
