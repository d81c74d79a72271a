"""The "b64" encoding: every array a typed object with base64 data.

``{"__ndarray__": "<base64 of the little-endian C-order bytes>", "dtype": "float32",
"shape": [2, 3]}`` inside an ``application/json`` body. Decoded arrays are read-only
views of the decoded bytes. A typed PRNG key is ``{"__ndarray__": "<base64 of its uint32
words>", "dtype": "key<threefry2x32>", "shape": <the key array's>}``: ``prod(shape +
words) * 4`` bytes (``dxcontract.keys``).

With ``pybase64`` installed (a client dependency; SIMD base64) an 8 MB array encodes
and decodes in well under a millisecond, where the standard library takes ~20-40 ms;
without it the standard library's ``base64`` gives the same text and the same bytes.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from ..errors import MalformedRequestError
from .common import (
    JSON_TYPE,
    LIFT_MIN_CHARS,
    MARKER,
    JsonBody,
    RawString,
    check_dtype,
    le_contig,
    prod,
    wire_ready,
)

try:
    import pybase64
except ImportError:  # pragma: no cover - exercised only without pybase64
    pybase64 = None


def b64_text(raw: Any) -> str:
    """Standard base64 (with padding) of a bytes-like object, as ``str``."""
    if pybase64 is not None:
        return pybase64.b64encode_as_string(raw)
    return base64.b64encode(raw).decode("ascii")


def b64_json(raw: Any) -> Any:
    """Base64 of a bytes-like object as a JSON string value: a ``RawString`` of the
    base64 bytes for a long one (written into a body without being copied or scanned),
    else the ``str``."""
    if len(raw) < LIFT_MIN_CHARS:
        return b64_text(raw)
    return RawString(pybase64.b64encode(raw) if pybase64 is not None else base64.b64encode(raw))


def b64_bytes(data: str | memoryview) -> bytes:
    """Strict standard base64 (text, or its ASCII bytes) -> bytes; ``binascii.Error``
    for anything else."""
    if pybase64 is not None:
        return pybase64.b64decode(data, validate=True)
    return base64.b64decode(data, validate=True)


class TypedB64(JsonBody):
    """Arrays as ``{"__ndarray__": "<base64>", "dtype", "shape"}`` in a JSON body."""

    name = "b64"
    media_type = JSON_TYPE
    accept_param = "arrays=b64"
    encode_factor = 2.0  # base64 text is 4/3 of the bytes

    def encode_array(self, a: np.ndarray, buffers: Any, field: str) -> Any:
        """An array -> its typed object with base64 of its little-endian C-order bytes."""
        name = check_dtype(a, field)
        # its memory is the wire's bytes already; bfloat16 (kind 'V') has no buffer format
        if a.ndim == 1 and wire_ready(a) and a.dtype.kind != "V":
            raw = memoryview(a).cast("B")
        else:
            raw = memoryview(le_contig(a).reshape(-1).view(np.uint8))
        return {MARKER: b64_json(raw), "dtype": name, "shape": list(a.shape)}


def from_b64(
    data: str | memoryview, dt: np.dtype, shape: tuple[int, ...], field: str
) -> np.ndarray:
    """A typed object's base64 data (a ``str``, or a view of its characters in the body)
    -> a read-only array view of the decoded bytes."""
    nbytes = prod(shape) * dt.itemsize
    expected_len = 4 * ((nbytes + 2) // 3)
    if len(data) != expected_len:
        raise MalformedRequestError(
            f"base64 data has {len(data)} chars but shape {list(shape)} of {dt.name} needs "
            f"{nbytes} bytes = {expected_len} base64 chars",
            field=field,
        )
    try:
        raw = b64_bytes(data)
    except (binascii.Error, ValueError) as exc:
        raise MalformedRequestError(f"invalid base64: {exc}", field=field) from None
    if len(raw) != nbytes:
        raise MalformedRequestError(
            f"base64 decodes to {len(raw)} bytes, expected {nbytes}", field=field
        )
    out = np.frombuffer(raw, dtype=dt)
    return out if len(shape) == 1 else out.reshape(shape)
