"""The wire format: round trips, signatures, and refusal of bad input (no processes)."""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.actors import _wire
from nereus.actors.mesh import ActorRef
from nereus.errors import AuthenticationError, ProtocolError

KEY = b"k" * 32

plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=6000),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5) | st.integers(0, 9), inner, max_size=4)
    ),
    max_leaves=20,
)


def round_trip(value):
    header, buffers = _wire.encode(value)
    frames = _wire.message(KEY, header, [bytes(b) for b in buffers])
    assert _wire.verify(KEY, frames) == header
    return _wire.decode(_wire.verify(KEY, frames), frames[1:])


@settings(max_examples=150, deadline=None)
@given(plain)
def test_plain_values_round_trip(value):
    assert round_trip(value) == value


TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TORCH_DTYPES), st.lists(st.integers(0, 4), max_size=3), st.booleans())
def test_tensors_round_trip(dtype, shape, transpose):
    t = (torch.rand(shape) * 10).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    back = round_trip({"t": t})["t"]
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    if back.numel():
        back.view(-1)[0] = back.view(-1)[0]  # writable, no warning-only view


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["<f4", "<f8", "<i2", "|u1", "|b1", "<c8"]),
    st.lists(st.integers(0, 4), max_size=3),
)
def test_arrays_round_trip(dtype, shape):
    a = np.asarray(np.random.random_sample(shape) * 10).astype(dtype)
    back = round_trip(a)
    assert back.dtype == a.dtype and back.shape == a.shape and np.array_equal(back, a)
    assert back.flags.writeable


def test_buffers_are_zero_copy_frames():
    t = torch.arange(100_000, dtype=torch.float32)
    header, buffers = _wire.encode([t, b"y" * 10, np.zeros(50_000, np.uint8)])
    assert len(buffers) == 2  # the bytes went inline, the array and tensor in frames
    assert len(header) < 200
    assert memoryview(buffers[0]).nbytes == 400_000
    assert _wire.decode(header, buffers)[1] == b"y" * 10


def test_refs_round_trip():
    ref = ActorRef("ipc:///tmp/x", "trainer/3", 2, 5, "trainer", 3, "m:C")
    assert round_trip([ref]) == [ref]


def test_refuses_unsupported_and_cuda_values():
    with pytest.raises(ProtocolError, match="cannot send a value of type"):
        _wire.encode({"x": {1, 2}})
    with pytest.raises(ProtocolError, match="object"):
        _wire.encode(np.array([object()]))


def test_signature_covers_every_frame():
    header, buffers = _wire.encode({"t": torch.ones(10000)})
    good = _wire.message(KEY, header, [bytes(buffers[0])])
    assert len(good) == 2 and good[0][32:] == header  # signature + header share a frame
    _wire.verify(KEY, good)
    with pytest.raises(AuthenticationError):
        _wire.verify(b"other-key-0123456789", good)
    tampered = bytearray(good[1])
    tampered[7] ^= 1
    with pytest.raises(AuthenticationError):
        _wire.verify(KEY, [good[0], bytes(tampered)])
    with pytest.raises(AuthenticationError):
        _wire.verify(KEY, [good[0]])  # a dropped frame
    with pytest.raises(AuthenticationError):
        _wire.verify(KEY, [good[0], good[1], b"extra"])  # an added frame
    with pytest.raises(AuthenticationError):
        _wire.verify(KEY, [*good, b""])  # an added empty frame
    with pytest.raises(AuthenticationError):
        _wire.verify(KEY, [good[0], good[1][:5], good[1][5:]])  # a frame split in two
    empty = _wire.message(KEY, header, [b"", bytes(buffers[0])])
    with pytest.raises(AuthenticationError):
        _wire.verify(KEY, [empty[0], empty[2]])  # an empty frame removed
    flipped = bytearray(good[0])
    flipped[40] ^= 1
    with pytest.raises(AuthenticationError):
        _wire.verify(KEY, [bytes(flipped), good[1]])  # the header itself
    with pytest.raises(ProtocolError, match="must hold a 32-byte signature"):
        _wire.verify(KEY, [good[0][:32]])
    with pytest.raises(ProtocolError):
        _wire.verify(KEY, [])


@settings(max_examples=100, deadline=None)
@given(
    st.binary(min_size=16, max_size=150),
    st.binary(max_size=300),
    st.lists(st.binary(max_size=200), max_size=3),
)
def test_signer_is_standard_hmac_sha256(key, header, buffers):
    lengths = struct.pack(
        f"<I{len(buffers) + 1}Q", len(buffers) + 1, len(header), *map(len, buffers)
    )
    expected = hmac.new(key, lengths + header + b"".join(buffers), hashlib.sha256).digest()
    signer = _wire.Signer(key)
    assert signer.sign(header, buffers) == expected
    assert signer.sign(header, buffers) == expected  # the keyed states are not consumed
    assert _wire.sign(key, header, buffers) == expected
    frames = [expected + header, *buffers]
    if header:
        assert bytes(signer.verify(frames)) == header


def test_encoder_is_reusable_after_a_refused_value():
    enc = _wire.Encoder()
    t = torch.arange(6, dtype=torch.int16)
    with pytest.raises(ProtocolError):
        enc.encode([t, {1, 2}])  # fails half-way, after a buffer was taken
    header, buffers = enc.encode(("a", [t, (np.ones(3), t)]))
    assert len(buffers) == 3  # only this value's buffers, indexed from 0
    back = _wire.decode(header, [bytes(b) for b in buffers])
    assert back[0] == "a" and torch.equal(back[1][0], t) and torch.equal(back[1][1][1], t)
    assert np.array_equal(back[1][1][0], np.ones(3))
    assert enc.encode([1, "x"]) == (msgpack.packb([1, "x"]), [])


class _Nested:
    pass


def test_encode_is_reentrant_through_a_registered_type():
    # a registered type whose to_plain encodes something itself (on the same thread)
    _wire.register_ext(77, _Nested, lambda o: _wire.encode(("inner", 1))[0], lambda p: p)
    header, buffers = _wire.encode(["outer", _Nested(), 2])
    assert buffers == []
    back = _wire.decode(header)
    assert back[0] == "outer" and back[2] == 2
    assert _wire.decode(back[1]) == ("inner", 1)


@pytest.mark.parametrize(
    "header, buffers, match",
    [
        (b"\xc1", [], "malformed"),
        (msgpack.packb([1, 2])[:-1], [], "malformed"),
        (
            msgpack.packb(msgpack.ExtType(1, msgpack.packb([1, "<f4", [2**40], 0, 4]))),
            [b"1234"],
            "does not match|declares",
        ),
        (
            msgpack.packb(msgpack.ExtType(1, msgpack.packb([1, "<f4", [1], 3, 4]))),
            [b"1234"],
            "out of range",
        ),
        (
            msgpack.packb(msgpack.ExtType(1, msgpack.packb([2, "nonsense", [1], 0, 4]))),
            [b"1234"],
            "unknown torch dtype",
        ),
        (
            msgpack.packb(msgpack.ExtType(1, msgpack.packb([1, "O", [1], 0, 8]))),
            [b"12345678"],
            "does not match|object|dtype",
        ),
        (msgpack.packb(msgpack.ExtType(99, b"")), [], "unknown ext"),
        (msgpack.packb(msgpack.ExtType(1, b"\x93\x01")), [], "malformed|descriptor"),
    ],
)
def test_malformed_headers_raise_protocol_error(header, buffers, match):
    with pytest.raises(ProtocolError, match=match):
        _wire.decode(header, buffers)
