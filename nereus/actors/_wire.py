"""The wire format: one msgpack header frame, zero-copy buffer frames, an HMAC.

A message on the wire is the multipart ZeroMQ message ``[signature + head, *buffers]``
(the 32-byte signature and the head share the first frame: one zmq frame less per
message on the hot path). The head is an optional fixed-size prefix (the channels put
their session envelope there, ``nereus.actors._session``) followed by the header:

Promises: ``decode(encode(x))`` equals ``x`` for every supported value (tensors of any
dtype incl. bfloat16 and bool, any shape incl. 0-size; non-contiguous ones are made
contiguous). Received tensors and arrays are writable views of the received frame
(no copy). ``verify`` and ``decode`` raise ``AuthenticationError`` / ``ProtocolError``
for every bad input and never anything else.

Refuses: pickle in any form, CUDA tensors (they go through the data plane), objects
of other types (``ProtocolError`` naming the type), a buffer whose declared size does
not match its frame.

More (how it works): docs/actors.md.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from nereus.errors import AuthenticationError, ProtocolError

__all__ = [
    "SIGNATURE_BYTES",
    "Encoder",
    "Signer",
    "encode",
    "decode",
    "sign",
    "verify",
    "message",
    "register_ext",
]

SIGNATURE_BYTES = 32
_ONE_FRAME = struct.Struct("<IQ")

_EXT_BUF = 1
_EXT_TUPLE = 2
_KIND_BYTES, _KIND_NUMPY, _KIND_TORCH = 0, 1, 2

# ext code -> (type, to_plain, from_plain); used for ActorRef so this module stays below it.
_EXT_TYPES: dict[int, tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = {}
_EXT_BY_TYPE: dict[type, int] = {}

_TORCH_DTYPES: dict[str, Any] = {}


def register_ext(
    code: int, cls: type, to_plain: Callable[[Any], Any], from_plain: Callable[[Any], Any]
) -> None:
    """Let instances of ``cls`` cross the wire as ``to_plain(obj)`` (plain data)."""
    if code in (_EXT_BUF, _EXT_TUPLE) or not 0 <= code < 128:
        raise ValueError(f"ext code {code} is reserved or out of range 0..127")
    _EXT_TYPES[code] = (cls, to_plain, from_plain)
    _EXT_BY_TYPE[cls] = code


def _torch_dtype(name: str) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: PLC0415 - only when a tensor arrives
    dt = _TORCH_DTYPES.get(name)
    if dt is None:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise ProtocolError(f"unknown torch dtype {name!r} in header")
        _TORCH_DTYPES[name] = dt
    return dt


class Encoder:
    """``encode`` with one msgpack packer reused across calls (a few times cheaper for
    the small headers of the call path). Not thread-safe: one per thread or loop."""

    __slots__ = ("_buffers", "_packer", "_torch", "_busy")

    def __init__(self) -> None:
        self._buffers: list[Any] = []
        self._torch: Any = None
        self._busy = False
        self._packer = msgpack.Packer(default=self._default, use_bin_type=True, strict_types=True)

    def encode(self, obj: Any) -> tuple[bytes, list[Any]]:
        """``(header, buffers)`` for ``obj``; buffers are zero-copy views (bytes/memoryview)."""
        if self._busy:  # called again from inside a pack (a registered type's to_plain)
            return Encoder().encode(obj)
        self._busy = True
        self._buffers = buffers = []
        self._torch = sys.modules.get("torch")
        try:
            return self._packer.pack(obj), buffers
        except ProtocolError:
            raise
        except (OverflowError, ValueError, TypeError, RecursionError) as e:
            # msgpack's own refusals: an int beyond 64 bits, a cycle or too deep a nesting
            raise ProtocolError(f"cannot encode the value: {type(e).__name__}: {e}") from None
        finally:
            self._buffers = []
            self._busy = False

    def _packb(self, o: Any) -> bytes:
        # Nested values (a tuple's items, a ref's fields) need their own packer: the
        # shared one is in the middle of packing the enclosing value.
        return msgpack.packb(o, default=self._default, use_bin_type=True, strict_types=True)

    def _default(self, o: Any) -> Any:
        t = type(o)
        if t is tuple:
            return msgpack.ExtType(_EXT_TUPLE, self._packb(list(o)))
        if t is np.ndarray:
            return self._array_ext(o)
        torch = self._torch
        if torch is not None and isinstance(o, torch.Tensor):
            return self._tensor_ext(o)
        code = _EXT_BY_TYPE.get(t)
        if code is not None:
            return msgpack.ExtType(code, self._packb(_EXT_TYPES[code][1](o)))
        if isinstance(o, np.generic):
            return o.item()
        if t is int:
            raise ProtocolError(f"cannot send the int {o}: outside the 64-bit range of msgpack")
        raise ProtocolError(
            f"cannot send a value of type {t.__module__}.{t.__qualname__}: only None, bool, "
            "int, float, str, bytes, list, tuple, dict, numpy arrays, CPU torch tensors and "
            "actor refs cross the wire"
        )

    def _array_ext(self, a: np.ndarray) -> msgpack.ExtType:
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise ProtocolError(f"cannot send a numpy array of dtype {a.dtype} (object/struct)")
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (ascontiguousarray would turn 0-d into 1-d)
        buffers = self._buffers
        buffers.append(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
        meta = [_KIND_NUMPY, a.dtype.str, list(a.shape), len(buffers) - 1, a.nbytes]
        return msgpack.ExtType(_EXT_BUF, msgpack.packb(meta))

    def _tensor_ext(self, x: Any) -> msgpack.ExtType:
        torch = self._torch
        if x.device.type != "cpu":
            raise ProtocolError(
                f"cannot send a {x.device.type} tensor through the actor wire; "
                "move it with the data plane (nereus.transfer) or .cpu() it"
            )
        x = x.detach()
        if x.is_sparse or x.layout != torch.strided:
            raise ProtocolError(f"cannot send a tensor with layout {x.layout}")
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        buffers = self._buffers
        if nbytes:
            buffers.append(memoryview(x.reshape(-1).view(torch.uint8).numpy()))
        else:
            buffers.append(b"")
        dtype = str(x.dtype).removeprefix("torch.")
        meta = [_KIND_TORCH, dtype, list(x.shape), len(buffers) - 1, nbytes]
        return msgpack.ExtType(_EXT_BUF, msgpack.packb(meta))


_LOCAL = threading.local()


def encode(obj: Any) -> tuple[bytes, list[Any]]:
    """``(header, buffers)`` for ``obj``; buffers are zero-copy views (bytes/memoryview)."""
    enc = getattr(_LOCAL, "encoder", None)
    if enc is None:
        enc = _LOCAL.encoder = Encoder()
    return enc.encode(obj)


def decode(header: bytes, buffers: Sequence[Any] = ()) -> Any:
    """The value of a header and its buffer frames (zmq Frames, bytes or memoryviews).

    Raises ``ProtocolError`` for malformed msgpack, unknown ext codes, bad buffer
    indices, or a declared size that does not match the frame."""
    if buffers:

        def hook(code: int, data: bytes) -> Any:
            return _ext(code, data, hook, buffers)
    else:
        hook = _plain_hook  # no closure for the common header-only message
    try:
        return _unpackb(header, hook)
    except ProtocolError:
        raise
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        OverflowError,
        RecursionError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as e:
        raise ProtocolError(f"malformed header: {type(e).__name__}: {e}") from None


def _unpackb(data: bytes, hook: Callable[[int, bytes], Any]) -> Any:
    return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False, use_list=True)


def _plain_hook(code: int, data: bytes) -> Any:
    return _ext(code, data, _plain_hook, ())


def _ext(code: int, data: bytes, hook: Callable[[int, bytes], Any], buffers: Sequence[Any]) -> Any:
    if code == _EXT_TUPLE:
        return tuple(_unpackb(data, hook))
    if code == _EXT_BUF:
        return _buffer(msgpack.unpackb(data, raw=False), buffers)
    entry = _EXT_TYPES.get(code)
    if entry is None:
        raise ProtocolError(f"unknown ext code {code} in header")
    return entry[2](_unpackb(data, hook))


def _buffer(meta: Any, buffers: Sequence[Any]) -> Any:
    if not (isinstance(meta, list) and len(meta) == 5):
        raise ProtocolError(
            f"buffer descriptor {meta!r} must be [kind, dtype, shape, index, nbytes]"
        )
    kind, dtype, shape, index, nbytes = meta
    if not isinstance(index, int) or not 0 <= index < len(buffers):
        raise ProtocolError(f"buffer index {index!r} out of range 0..{len(buffers) - 1}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ProtocolError(f"buffer shape {shape!r} must be a list of ints >= 0")
    frame = buffers[index]
    mv = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    if mv.readonly and kind != _KIND_BYTES:
        mv = memoryview(bytearray(mv))  # received tensors are always writable
    if not isinstance(nbytes, int) or mv.nbytes != nbytes:
        raise ProtocolError(
            f"buffer {index} declares {nbytes!r} bytes but its frame holds {mv.nbytes}"
        )
    if kind == _KIND_BYTES:
        return bytes(mv)
    count = 1
    for s in shape:
        count *= s
    if kind == _KIND_NUMPY:
        try:
            dt = np.dtype(dtype)
        except TypeError as e:
            raise ProtocolError(f"unknown numpy dtype {dtype!r}: {e}") from None
        if dt.hasobject or count * dt.itemsize != nbytes:
            raise ProtocolError(f"array {dtype}{shape} does not match {nbytes} bytes")
        return (
            np.frombuffer(mv, dtype=np.uint8).view(dt).reshape(tuple(shape))
            if count
            else np.empty(tuple(shape), dt)
        )
    if kind == _KIND_TORCH:
        if not isinstance(dtype, str):
            raise ProtocolError(f"torch dtype {dtype!r} must be a string")
        dt = _torch_dtype(dtype)
        torch = sys.modules["torch"]
        itemsize = torch.empty((), dtype=dt).element_size()
        if count * itemsize != nbytes:
            raise ProtocolError(f"tensor {dtype}{shape} does not match {nbytes} bytes")
        if not count:
            return torch.empty(shape, dtype=dt)
        flat = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8))
        return flat.view(dt).reshape(shape)
    raise ProtocolError(f"unknown buffer kind {kind!r}")


_PAD_INNER = bytes(x ^ 0x36 for x in range(256))
_PAD_OUTER = bytes(x ^ 0x5C for x in range(256))
_SHA256_BLOCK = 64


class Signer:
    """HMAC-SHA256 (RFC 2104) with one key: the keyed inner and outer hash states are
    computed once and copied per message. Thread-safe."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        key = bytes(key)
        if len(key) > _SHA256_BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_SHA256_BLOCK, b"\0")
        self._inner = hashlib.sha256(key.translate(_PAD_INNER))
        self._outer = hashlib.sha256(key.translate(_PAD_OUTER))

    def sign(self, header: Any, buffers: Sequence[Any] = (), prefix: bytes = b"") -> bytes:
        """HMAC-SHA256 over the frame count and lengths, then ``prefix + header`` (the
        first frame after the signature) and every buffer, in order."""
        inner = self._inner.copy()
        head_bytes = len(prefix) + _nbytes(header)
        if buffers:
            inner.update(
                struct.pack(
                    f"<I{len(buffers) + 1}Q",
                    len(buffers) + 1,
                    head_bytes,
                    *[_nbytes(b) for b in buffers],
                )
            )
        else:
            inner.update(_ONE_FRAME.pack(1, head_bytes))
        if prefix:
            inner.update(prefix)
        inner.update(header)
        for b in buffers:
            inner.update(b)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def verify(self, frames: Sequence[Any]) -> memoryview:
        """Check ``frames = [signature + head, *buffers]`` and return the head.

        Raises ``ProtocolError`` when the first frame cannot hold a signature and a
        head, ``AuthenticationError`` when the signature does not match the key, the
        frames or their lengths."""
        if not frames:
            raise ProtocolError("empty message")
        first = frames[0]
        first = first.buffer if hasattr(first, "buffer") else memoryview(first)
        if first.nbytes <= SIGNATURE_BYTES:
            raise ProtocolError(
                f"first frame has {first.nbytes} bytes; it must hold a "
                f"{SIGNATURE_BYTES}-byte signature followed by a header"
            )
        header = first[SIGNATURE_BYTES:]
        if len(frames) == 1:
            signature = self.sign(header)
        else:
            signature = self.sign(
                header, [f.buffer if hasattr(f, "buffer") else f for f in frames[1:]]
            )
        if not hmac.compare_digest(first[:SIGNATURE_BYTES], signature):
            raise AuthenticationError("signature does not match the cluster key")
        return header


def _nbytes(b: Any) -> int:
    """The size in bytes of a bytes-like frame (a memoryview may have items wider than one)."""
    t = type(b)
    if t is bytes or t is bytearray:
        return len(b)
    if t is memoryview:
        return b.nbytes
    return memoryview(b).nbytes


_SIGNERS: dict[bytes, Signer] = {}


def _signer(key: bytes) -> Signer:
    signer = _SIGNERS.get(key)
    if signer is None:
        if len(_SIGNERS) >= 16:  # a process knows one or two keys; never grow unbounded
            _SIGNERS.clear()
        signer = _SIGNERS[bytes(key)] = Signer(key)
    return signer


def sign(key: bytes, header: bytes, buffers: Sequence[Any] = (), prefix: bytes = b"") -> bytes:
    """The signature of ``[prefix + header, *buffers]`` (see ``Signer.sign``)."""
    return _signer(key).sign(header, buffers, prefix)


def message(
    key: bytes, header: bytes, buffers: Sequence[Any] = (), prefix: bytes = b""
) -> list[Any]:
    """The frames of one signed message: ``[signature + prefix + header, *buffers]``."""
    return [sign(key, header, buffers, prefix) + prefix + header, *buffers]


def verify(key: bytes, frames: Sequence[Any]) -> memoryview:
    """Check ``frames = [signature + head, *buffers]`` and return the head.

    Raises ``ProtocolError`` when the first frame cannot hold a signature and a header,
    ``AuthenticationError`` when the signature does not match the cluster key."""
    return _signer(key).verify(frames)
