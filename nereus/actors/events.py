"""The controller's event stream as a reader outside the runtime sees it.

A controller publishes every ``emit``ted event on its monitoring tap (a ZeroMQ PUB
socket), stamped with ``SCHEMA_VERSION`` and signed with the cluster key like every
other frame. This module is the public surface a subscriber (``nereus.monitor``) needs
to read that stream: the schema version the publisher stamps, the cluster key and
CURVE helpers, and ``open_event``, which verifies one tap frame and returns its
envelope and body.

Promises: ``open_event`` refuses (``AuthenticationError``, ``ProtocolError``,
``Refused``) a frame whose signature does not verify under the key or whose envelope
is malformed; without a key it reads the frame unverified. It never decodes the body.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nereus.actors import _session, _wire
from nereus.actors._curve import CurveKey, load_curve, secure
from nereus.actors._keys import CURVE_ENV, KEY_ENV, load_key

__all__ = [
    "BROADCAST",
    "CURVE_ENV",
    "KEY_ENV",
    "SCHEMA_VERSION",
    "SIGNATURE_BYTES",
    "CurveKey",
    "Refused",
    "load_curve",
    "load_key",
    "open_event",
    "secure",
]

# the version of the tap's event schema (nereus.monitor.schema describes the fields);
# a change that removes or renames a field bumps it
SCHEMA_VERSION = 1

SIGNATURE_BYTES = _wire.SIGNATURE_BYTES
BROADCAST = _session.ANY  # the receiver of every event the tap publishes
Refused = _session.Refused


def open_event(key: bytes | None, frames: Sequence[Any]) -> tuple[bytes, bytes, int, Any]:
    """(sender, receiver, sequence number, body) of one tap frame, verified under
    ``key`` (unverified when ``key`` is None)."""
    head = _wire.verify(key, frames) if key is not None else memoryview(frames[0])[SIGNATURE_BYTES:]
    return _session.parse(head)
