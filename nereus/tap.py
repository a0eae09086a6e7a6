"""``python -m nereus.tap ADDRESS``: the monitoring tap printer (see nereus.monitor.tap)."""

from __future__ import annotations

import sys

from nereus.monitor.tap import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
