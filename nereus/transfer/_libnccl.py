"""libnccl through ctypes: the calls the nccl backend makes, on non-blocking communicators.

Why not cupy's ``NcclCommunicator``: it creates communicators in blocking mode only
(its ``NcclConfig`` exposes ``split_share`` alone), so a rank that never joins freezes
the others inside ``ncclCommInitRank`` with nothing to abort; and its signatures
changed under us (unique ids as tuples of signed chars in cupy 13, bytes in 14;
``broadcast``'s count a C ``int`` before 13.x). Here every communicator is made with
``ncclConfig_t.blocking = 0``: initialisation and every call return at once
(``ncclInProgress`` while NCCL works in the background), the caller polls
``ncclCommGetAsyncError`` against its own deadline, and ``ncclCommAbort`` frees
everything when the deadline passes. Counts are ``size_t`` element counts.

The library: ``libnccl.so.2`` of the ``nvidia-nccl-cu12``/``-cu13`` wheel when one is
installed (torch's CUDA builds depend on it and load it), else the system's. Loading
it, reading its version and making unique ids need no GPU.

Refuses: NCCL older than 2.14 (no non-blocking communicators) and a missing library
(``TransferError`` saying what to install). ``Timeout`` (a ``TransferError``) means a
deadline passed; the communicator was aborted before it was raised.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time
from typing import Any

from nereus.errors import TransferError

__all__ = [
    "Timeout",
    "Comm",
    "library",
    "version",
    "unique_id",
    "group",
    "DTYPES",
    "OPS",
    "UINT8",
    "SUCCESS",
    "IN_PROGRESS",
]

SUCCESS, IN_PROGRESS = 0, 7
# ncclDataType_t and ncclRedOp_t (nccl.h)
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
DTYPES = {
    "int8": INT8,
    "uint8": UINT8,
    "bool": UINT8,
    "int32": INT32,
    "int64": INT64,
    "float16": FLOAT16,
    "float32": FLOAT32,
    "float64": FLOAT64,
    "bfloat16": BFLOAT16,
}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_MIN_VERSION = 21400  # 2.14: ncclConfig_t.blocking
_API_MAGIC = 0xCAFEBEEF
_POLL_MAX_S = 0.005


class Timeout(TransferError):
    """An NCCL call was still in progress at its deadline (the communicator is aborted)."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class _Config(ctypes.Structure):
    # The head of ncclConfig_t as of NCCL 2.14 (size, magic, version, blocking): NCCL
    # reads ``size`` bytes and gives every field a later version added its default.
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]


_P = ctypes.c_void_p
_I = ctypes.c_int
_S = ctypes.c_size_t
_SIGNATURES: dict[str, list[Any]] = {
    "ncclGetVersion": [ctypes.POINTER(_I)],
    "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
    "ncclCommInitRankConfig": [ctypes.POINTER(_P), _I, _UniqueId, _I, ctypes.POINTER(_Config)],
    "ncclCommGetAsyncError": [_P, ctypes.POINTER(_I)],
    "ncclCommAbort": [_P],
    "ncclCommFinalize": [_P],
    "ncclCommDestroy": [_P],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    "ncclSend": [_P, _S, _I, _I, _P, _P],
    "ncclRecv": [_P, _S, _I, _I, _P, _P],
    "ncclBroadcast": [_P, _P, _S, _I, _I, _P, _P],
    "ncclAllReduce": [_P, _P, _S, _I, _I, _P, _P],
    "ncclAllGather": [_P, _P, _S, _I, _P, _P],
    "ncclReduceScatter": [_P, _P, _S, _I, _I, _P, _P],
}

_LIB: Any = None
_LIB_LOCK = threading.Lock()


def _candidates() -> list[str]:
    paths = []
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        paths.append(os.path.join(root, "lib", "libnccl.so.2"))
    return [p for p in paths if os.path.exists(p)] + ["libnccl.so.2"]


def library() -> Any:
    """The loaded libnccl with its signatures declared (loaded once per process)."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is not None:
            return _LIB
        errors = []
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise TransferError(
                "the nccl backend needs libnccl.so.2 (a CUDA build of torch "
                "brings it; else nereus[nccl-cu12] or nereus[nccl-cu13], after "
                f"torch.version.cuda): {'; '.join(errors)}"
            )
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:
                raise TransferError(f"{lib._name} has no {name}: NCCL >= 2.14 is needed")
            fn.argtypes = argtypes
            fn.restype = _I
        lib.ncclGetErrorString.argtypes = [_I]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        code = _I()
        _check(lib, lib.ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
        if code.value < _MIN_VERSION:
            raise TransferError(
                f"{lib._name} is NCCL {code.value}; >= 2.14 is needed (non-blocking communicators)"
            )
        lib.nereus_version = code.value
        _LIB = lib
        return lib


def _check(lib: Any, result: int, what: str) -> None:
    if result not in (SUCCESS, IN_PROGRESS):
        raise TransferError(
            f"{what} failed: NCCL error {result} "
            f"({lib.ncclGetErrorString(result).decode(errors='replace')})"
        )


def version() -> int:
    """NCCL's version code (e.g. 22703 for 2.27.3)."""
    return library().nereus_version


def unique_id() -> bytes:
    """A fresh NCCL unique id: 128 bytes (it names this process's bootstrap root)."""
    lib = library()
    uid = _UniqueId()
    _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(ctypes.string_at(ctypes.byref(uid), 128))


class Comm:
    """One non-blocking NCCL communicator. Every method takes the deadline (a
    ``time.monotonic()`` value) by which NCCL must have accepted the call."""

    def __init__(self, nranks: int, uid: bytes, rank: int, deadline: float) -> None:
        if len(uid) != 128:
            raise TransferError(f"an NCCL unique id has 128 bytes, not {len(uid)}")
        lib = self._lib = library()
        self.handle = _P()
        self.aborted = False
        self.in_group = False  # between ncclGroupStart and ncclGroupEnd (``group``)
        config = _Config(ctypes.sizeof(_Config), _API_MAGIC, _MIN_VERSION, 0)
        raw = _UniqueId()
        ctypes.memmove(ctypes.byref(raw), uid, 128)
        result = lib.ncclCommInitRankConfig(
            ctypes.byref(self.handle), nranks, raw, rank, ctypes.byref(config)
        )
        if result not in (SUCCESS, IN_PROGRESS):
            if self.handle.value:
                self.abort()
            _check(lib, result, "ncclCommInitRankConfig")
        self.settle(deadline, "ncclCommInitRankConfig")

    def settle(self, deadline: float, what: str) -> None:
        """Wait until NCCL finished accepting the last call (the communicator's state
        leaves ``ncclInProgress``); abort and raise ``Timeout`` at the deadline."""
        self._usable(what)
        lib = self._lib
        state = _I(IN_PROGRESS)
        pause = 1e-4
        while True:
            result = lib.ncclCommGetAsyncError(self.handle, ctypes.byref(state))
            if result != SUCCESS:
                self.abort()
                _check(lib, result, "ncclCommGetAsyncError")
            if state.value == SUCCESS:
                return
            if state.value != IN_PROGRESS:
                self.abort()
                _check(lib, state.value, what)
            if time.monotonic() >= deadline:
                self.abort()
                raise Timeout(f"{what} was still in progress at its deadline")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def async_error(self) -> int:
        """NCCL's asynchronous state of this communicator without waiting: ``SUCCESS``,
        ``IN_PROGRESS`` or an error code (a peer failed, a network error). Safe to call
        from another thread while operations run; an aborted communicator reads SUCCESS."""
        if self.aborted:
            return SUCCESS
        state = _I(SUCCESS)
        result = self._lib.ncclCommGetAsyncError(self.handle, ctypes.byref(state))
        return result if result != SUCCESS else state.value

    def error_text(self, code: int) -> str:
        return self._lib.ncclGetErrorString(code).decode(errors="replace")

    def _usable(self, what: str) -> None:
        if self.aborted:  # the handle is freed: NCCL must never see it again
            raise TransferError(f"{what} on an aborted NCCL communicator")

    def call(self, name: str, *args: Any, deadline: float) -> None:
        """``name(*args)`` (the caller passes every argument, the communicator's handle
        and the stream included). Inside a group, NCCL only records the call."""
        self._usable(name)
        lib = self._lib
        result = getattr(lib, name)(*args)
        if result == IN_PROGRESS and not self.in_group:
            self.settle(deadline, name)
        elif result not in (SUCCESS, IN_PROGRESS):
            if not self.in_group:  # inside a group, ncclGroupEnd comes first (``group``)
                self.abort()
            _check(lib, result, name)

    def abort(self) -> None:
        """Free the communicator at once, whatever is in flight (idempotent)."""
        if self.aborted or not self.handle.value:
            self.aborted = True
            return
        self.aborted = True
        self._lib.ncclCommAbort(self.handle)

    def destroy(self, deadline: float) -> None:
        """Finalize (flush what is in flight) and free; abort if that outlives
        ``deadline``."""
        if self.aborted or not self.handle.value:
            return
        lib = self._lib
        result = lib.ncclCommFinalize(self.handle)
        if result == IN_PROGRESS:
            self.settle(deadline, "ncclCommFinalize")
        elif result != SUCCESS:
            self.abort()
            _check(lib, result, "ncclCommFinalize")
        _check(lib, lib.ncclCommDestroy(self.handle), "ncclCommDestroy")
        self.aborted = True  # nothing left to free


class group:  # noqa: N801 - a context manager named like NCCL's calls
    """``ncclGroupStart`` ... ``ncclGroupEnd`` around calls on ``comm``; a group end
    that is still in progress waits (until ``deadline``) like any other call."""

    def __init__(self, comm: Comm, deadline: float) -> None:
        self.comm = comm
        self.deadline = deadline

    def __enter__(self) -> group:
        self.comm._usable("ncclGroupStart")
        lib = self.comm._lib
        _check(lib, lib.ncclGroupStart(), "ncclGroupStart")
        self.comm.in_group = True
        return self

    def __exit__(self, *exc: Any) -> None:
        lib = self.comm._lib
        self.comm.in_group = False
        result = lib.ncclGroupEnd()  # always: NCCL's group state is per thread
        if exc[0] is not None:
            self.comm.abort()  # a call in the group failed: nothing of it may run
            return  # the caller's error wins
        if result == IN_PROGRESS:
            self.comm.settle(self.deadline, "ncclGroupEnd")
        elif result != SUCCESS:
            self.comm.abort()
            _check(lib, result, "ncclGroupEnd")
