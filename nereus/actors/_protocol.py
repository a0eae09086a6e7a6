"""Message kinds of the actor protocol (the first element of every header).

Hot-path messages are msgpack arrays, not maps, to keep headers short:

    CALL  [1, call_id, actor, incarnation, method, timeout_s|None, args, kwargs, mode]
    OK    [2, call_id, incarnation, value]
    ERR   [3, call_id, incarnation, kind, remote_type, message, traceback_text]
    ITEM  [4, call_id, incarnation, value]          one item of a stream
    END   [5, call_id, incarnation]                 end of a stream
    CTRL  [10, call_id, op, body]                   control request (spawn, stop, ...)
    NOTE  [11, op, body]                            controller notice (no reply)
    BATCH [6, [header, ...], [buffer_count, ...]]   several messages in one (see _channel)
    HELLO   [12]                                    a connecting channel's first message
    WELCOME [13, ticket]                            the serving channel's answer
    READY   [14]                                    the first message under the ticket

HELLO, WELCOME and READY are the channels' handshake (``_session``); handlers never
see them.

``mode`` is NO_REPLY (broadcast), REPLY or STREAM. ``kind`` in ERR says which nereus
error the caller raises: remote -> RemoteError, protocol -> ProtocolError,
backpressure -> Backpressure, deadline -> DeadlineExceeded, died -> ActorDied.
"""

from __future__ import annotations

__all__ = [
    "WORKER_READY",
    "CALL",
    "OK",
    "ERR",
    "ITEM",
    "END",
    "CTRL",
    "NOTE",
    "BATCH",
    "HELLO",
    "WELCOME",
    "READY",
    "NO_REPLY",
    "REPLY",
    "STREAM",
    "ERR_REMOTE",
    "ERR_PROTOCOL",
    "ERR_BACKPRESSURE",
    "ERR_DEADLINE",
    "ERR_DIED",
]

CALL, OK, ERR, ITEM, END, CTRL, NOTE, BATCH = 1, 2, 3, 4, 5, 10, 11, 6
HELLO, WELCOME, READY = 12, 13, 14
NO_REPLY, REPLY, STREAM = 0, 1, 2
ERR_REMOTE = "remote"
ERR_PROTOCOL = "protocol"
ERR_BACKPRESSURE = "backpressure"
ERR_DEADLINE = "deadline"
ERR_DIED = "died"

# What a worker prints on stdout once it serves (its node daemon reads it); here, not in
# ``_worker``, so the daemon never imports the module it runs as ``python -m``.
WORKER_READY = "NEREUS_WORKER_READY "
