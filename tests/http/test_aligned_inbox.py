"""Large binary bodies are received into one 64-byte aligned buffer of their declared
size (``pipeline.BodyBuffer``), so the device can use their arrays as they are (on the
CPU, ``jax.device_put`` aliases them instead of copying); JSON bodies stay bytes-like.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from dxcontract import codec
from dxcontract.errors import MalformedRequestError, PayloadTooLargeError
from dxserve.frameworks.jax.precision import float64_scope
from dxserve.pipeline import BodyBuffer, RequestHead
from dxserve.pipeline.operators import ONE_BUFFER_BYTES, aligned_buffer
from dxserve.server.admission import Budget


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 100_000, 800_469])
def test_aligned_buffer_is_aligned_writable_and_exact(size: int) -> None:
    buf = aligned_buffer(size)
    assert len(buf) == size and not buf.readonly
    assert np.frombuffer(buf, np.uint8).ctypes.data % 64 == 0 or size == 0
    buf[:] = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert bytes(buf[:3]) == bytes(range(min(size, 3)))


def _binary_request(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    body, media, headers = codec.encode_body({"x": x}, "binary")
    return body, {**headers, "content-type": media}


def _call(length: int | None, binary: bool, limit: int = 1 << 30) -> SimpleNamespace:
    """What a ``BodyBuffer`` reads of its ``OperatorCall``."""
    head = RequestHead(codec.BINARY_TYPE if binary else codec.JSON_TYPE, content_length=length)
    ticket = Budget(1 << 30, 1 << 30, 1).ticket()
    return SimpleNamespace(head=head, views=binary, limit=limit, ticket=ticket,
                           decode_factor=1 if binary else 16)


def _received(body: bytes, call: SimpleNamespace, piece: int = 65_536) -> object:
    buffer = BodyBuffer(call)  # type: ignore[arg-type]
    for start in range(0, len(body), piece):  # as a server hands a body over: in pieces
        buffer.add(body[start:start + piece])
    return buffer.take()


def test_arrays_decoded_from_a_large_binary_body_are_used_without_a_copy() -> None:
    x = np.random.default_rng(0).standard_normal(100_000)
    body, headers = _binary_request(x)
    received = _received(body, _call(len(body), binary=True))
    assert isinstance(received, memoryview) and bytes(received) == body
    assert np.frombuffer(received, np.uint8).ctypes.data % 64 == 0
    decoded = codec.decode_body(received, codec.BINARY_TYPE, headers[codec.HEADER_LENGTH])["x"]
    assert decoded.ctypes.data % 64 == 0
    np.testing.assert_array_equal(decoded, x)
    with float64_scope():
        on_device = jax.device_put(decoded)
    if jax.default_backend() == "cpu":
        assert on_device.unsafe_buffer_pointer() == decoded.ctypes.data  # aliased


def test_large_json_bodies_stay_bytes_like_and_small_bodies_as_received() -> None:
    """JSON bodies are searched and sliced as bytes (``response_encoding``): never a
    memoryview."""
    body = b'{"x": [' + b"1.5, " * 200_000 + b"2.0]}"
    received = _received(body, _call(len(body), binary=False))
    assert isinstance(received, bytearray) and received == body
    small = b'{"x": [1.0]}'
    assert len(small) < ONE_BUFFER_BYTES
    assert _received(small, _call(len(small), binary=False)) == small
    # no declared length (a chunked body): kept as received, held in the budget as it grows
    call = _call(None, binary=False)
    assert _received(body, call) == body
    assert call.ticket.held == len(body) * 16


def test_bodies_past_their_limit_or_length_are_refused() -> None:
    with pytest.raises(PayloadTooLargeError):
        _received(b"x" * 2000, _call(None, binary=False, limit=1000))
    with pytest.raises(MalformedRequestError):  # more than it declared
        _received(b"x" * 2000, _call(1000, binary=False))
    buffer = BodyBuffer(_call(100_000, binary=True))  # type: ignore[arg-type]
    buffer.add(b"x" * 10)
    with pytest.raises(MalformedRequestError):  # less than it declared
        buffer.take()
