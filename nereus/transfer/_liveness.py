"""Which peers of a failed group operation died: named by rank, device and process.

A CPU group's operation that fails with every rank entered (gloo's connection closed,
a shared-memory peer's pidfd fired) was cut short by a peer that died or gave up.
``dead_peers`` tells them apart so the error names the rank: a peer on this host is
dead when its process (pid recorded at the rendezvous) is gone or a zombie; a peer on
another host is presumed dead when it does not record, in the group's store within a
short grace, that it is alive too (every survivor records itself on failure). It
never blocks longer than the grace and never raises: a store that cannot be read
leaves the remote peers unnamed.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

__all__ = ["dead_peers", "process_alive", "GRACE_S"]

log = logging.getLogger("nereus.transfer")

GRACE_S = 1.0  # how long a survivor waits for its peers to show they are alive
_POLL_S = 0.01


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this host) is running: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X", "x")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def dead_peers(
    kv: Any, rank: int, peers: list[int], local_pids: dict[int, int], grace_s: float = GRACE_S
) -> tuple[list[int], list[int]]:
    """``(dead, silent)`` among ``peers``: same-host peers whose process is gone (a
    process that is exiting gets ``grace_s`` to finish), remote peers that did not
    record themselves alive in ``kv`` within ``grace_s``. Records this rank alive."""
    deadline = time.monotonic() + grace_s
    try:
        kv.set(f"alive/{rank}", "1")
    except RuntimeError as e:
        log.warning("cannot record rank %d alive: %s", rank, e)
    local = [p for p in peers if p in local_pids]
    dead = [p for p in local if not process_alive(local_pids[p])]
    # A peer whose socket just closed may still be tearing its process down.
    while len(dead) < len(local) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        dead = [p for p in local if not process_alive(local_pids[p])]
    remote = [p for p in peers if p not in local_pids]
    silent: list[int] = []
    if remote:
        keys = [f"alive/{p}" for p in remote]
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            kv.wait(keys, datetime.timedelta(seconds=left))
        except RuntimeError:  # some never showed up: they are the silent ones
            pass
        try:
            silent = [p for p in remote if not kv.check([f"alive/{p}"])]
        except RuntimeError as e:
            log.warning("cannot read which peers are alive: %s", e)
    return sorted(dead), silent
