"""nereus: RL post-training of LLMs that changes each model-stage's parallel layout
while the job runs, built on a small, fast async actor framework.

The public API is what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

from nereus.errors import (
    ActorDied,
    AuthenticationError,
    Backpressure,
    ConfigError,
    DeadlineExceeded,
    InfeasiblePlan,
    NereusError,
    OutOfMemory,
    ProtocolError,
    RemoteError,
    StateError,
    StuckCollective,
    TransferError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "ActorDied",
    "AuthenticationError",
    "Backpressure",
    "ConfigError",
    "DeadlineExceeded",
    "InfeasiblePlan",
    "NereusError",
    "OutOfMemory",
    "ProtocolError",
    "RemoteError",
    "StateError",
    "StuckCollective",
    "TransferError",
]
