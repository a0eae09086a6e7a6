"""The one exception hierarchy of nereus.

Every error nereus raises on purpose is a ``NereusError``. Each layer raises the
most specific type that fits, with a message that names the field or object, the
value it saw and what it expected. Nothing in nereus swallows an exception: an
error is either raised to the caller or delivered to an owner (supervision).

This module imports nothing from nereus and nothing heavy, so every layer may use
it. ``exit_status`` turns these errors into a command's exit status, the same for
every ``nereus`` command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = [
    "exit_status",
    "NereusError",
    "ConfigError",
    "ProtocolError",
    "AuthenticationError",
    "RemoteError",
    "DeadlineExceeded",
    "ActorDied",
    "Backpressure",
    "OutOfMemory",
    "InfeasiblePlan",
    "StuckCollective",
    "TransferError",
    "PeerDied",
    "StateError",
]


class NereusError(Exception):
    """Base of every error nereus raises on purpose."""


class ConfigError(NereusError, ValueError):
    """A configuration value breaks a rule: the message names field, value and rule."""


class ProtocolError(NereusError):
    """A frame or message does not follow the wire format (malformed, truncated,
    unknown actor or method, wrong argument types, oversized payload)."""


class AuthenticationError(ProtocolError):
    """A frame's signature is missing or does not match the cluster key."""


class RemoteError(NereusError):
    """An endpoint raised on the callee. Carries the remote exception type name,
    its message, the remote traceback text, and which actor and device it ran on."""

    def __init__(
        self,
        remote_type: str,
        message: str,
        traceback_text: str = "",
        actor: str = "",
        device: str | int | None = None,
    ) -> None:
        self.remote_type = remote_type
        self.remote_message = message
        self.traceback_text = traceback_text
        self.actor = actor
        self.device = device
        where = f" on actor {actor!r}" if actor else ""
        if device is not None:
            where += f" (device {device})"
        text = f"{remote_type}: {message}{where}"
        if traceback_text:
            text += "\n--- remote traceback ---\n" + traceback_text.rstrip()
        super().__init__(text)


class DeadlineExceeded(NereusError, TimeoutError):
    """A call or operation did not finish before its deadline."""


class ActorDied(NereusError):
    """The callee's process (or its incarnation) died; in-flight calls fail with this."""

    def __init__(self, actor: str, device: str | int | None = None, reason: str = "") -> None:
        self.actor = actor
        self.device = device
        self.reason = reason
        where = f" on device {device}" if device is not None else ""
        super().__init__(f"actor {actor!r}{where} died" + (f": {reason}" if reason else ""))


class Backpressure(NereusError):
    """A callee's queue of pending calls is full; the call was not enqueued."""


class OutOfMemory(NereusError, MemoryError):
    """An allocation would exceed a device's memory budget.

    Names the device, the bytes needed and the budget."""

    def __init__(
        self, device: str | int, need_bytes: int, budget_bytes: int, what: str = ""
    ) -> None:
        self.device = device
        self.need_bytes = int(need_bytes)
        self.budget_bytes = int(budget_bytes)
        self.what = what
        for_what = f" for {what}" if what else ""
        super().__init__(
            f"out of memory on device {device}{for_what}: needs {need_bytes} bytes "
            f"({need_bytes / 2**20:.1f} MiB) but the budget is {budget_bytes} bytes "
            f"({budget_bytes / 2**20:.1f} MiB)"
        )


class InfeasiblePlan(NereusError):
    """No plan (or transition) satisfies the devices and memory available."""


class InfeasibleTransition(InfeasiblePlan):
    """A transition DAG cannot run: an acquisition blocked on a device's memory with no
    Destroy on that device to wait for. Names the node, the device, the need and the cap."""

    def __init__(self, node: str, device: int, need_bytes: int, cap_bytes: int) -> None:
        self.node = node
        self.device = device
        self.need_bytes = int(need_bytes)
        self.cap_bytes = int(cap_bytes)
        super().__init__(
            f"transition node {node} is blocked on device {device}: it needs {need_bytes} bytes "
            f"({need_bytes / 2**20:.1f} MiB) and the cap is {cap_bytes} bytes "
            f"({cap_bytes / 2**20:.1f} MiB), "
            "with no Destroy on that device left to wait for"
        )


class StuckCollective(NereusError, TimeoutError):
    """A collective outlived its deadline; names the ranks that never entered it."""

    def __init__(self, group: str, op: str, missing_ranks: list[int], seconds: float) -> None:
        self.group = group
        self.op = op
        self.missing_ranks = list(missing_ranks)
        self.seconds = float(seconds)
        super().__init__(
            f"collective {op!r} in group {group!r} stuck for {seconds:.2f} s; "
            f"ranks that have not entered it: {self.missing_ranks}"
        )


class TransferError(NereusError):
    """A data-plane operation failed (a peer died, a group was aborted, a size mismatch)."""


class PeerDied(TransferError):
    """A group operation was cut short because peers died in it; names each one's rank
    and device (``dead``: their process is gone; ``silent``: on another host and no
    sign of life within a short grace)."""

    def __init__(
        self,
        group: str,
        op: str,
        dead: list[int],
        silent: list[int],
        devices: tuple[int, ...] | None,
        seconds: float,
    ) -> None:
        self.group = group
        self.op = op
        self.dead_ranks = list(dead)
        self.silent_ranks = list(silent)
        self.devices = [devices[r] if devices else None for r in (*dead, *silent)]
        self.seconds = float(seconds)

        def name(r: int) -> str:
            return f"rank {r} (device {devices[r]})" if devices else f"rank {r}"

        parts = []
        if dead:
            parts.append(", ".join(map(name, dead)) + " died")
        if silent:
            parts.append(", ".join(map(name, silent)) + " stopped answering (presumed dead)")
        super().__init__(
            f"{op!r} in group {group!r} failed after {seconds:.2f} s: " + "; ".join(parts)
        )


class StateError(NereusError):
    """A state primitive was refused (a layout that does not divide, destroying the last
    copy, extending onto devices that are not disjoint). Nothing was freed."""


def exit_status(
    command: str,
    body: Callable[[], int | None],
    *,
    usage: tuple[type[BaseException], ...] = (ConfigError,),
    failure: tuple[type[BaseException], ...] = (),
) -> int:
    """What a ``nereus`` command exits with: ``body()``'s status (None: 0), or, when it
    raises one of ``usage`` (a bad argument or config), 2 after ``command: message`` on
    stderr, or for one of ``failure`` (the command could not do its work) 1, printed
    alike. Any other exception goes up with its traceback."""
    try:
        return int(body() or 0)
    except usage as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 2
    except failure as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 1
