"""Wire codec for arrays: shared by the dxserve server and the Python client.

The formats themselves live in ``dxclient.encodings``, one module each: ``json_lists``
("json": float64 arrays as plain JSON lists, other dtypes as typed objects with list
data), ``typed_b64`` ("b64": every array ``{"__ndarray__": "<base64>", "dtype",
"shape"}``) and ``binary`` ("binary": a JSON header, then raw 64-byte aligned buffers).
This module is their common front: encode by encoding name, decode by Content-Type,
read decoded values into arrays.

Pytrees are JSON objects of str -> array-or-pytree; lists are always arrays. Pytree keys
starting with ``"__"`` are reserved (``__ndarray__`` marks a typed array). A typed PRNG
key is a typed array of dtype ``"key<IMPL>"`` and decodes to a ``dxcontract.keys.KeyArray``.

Arrays decoded from "b64" and "binary" are read-only views. In a typed object a string
``__ndarray__`` is base64, except a spelling ("NaN", ...) with shape ``[]`` and a float
dtype, which is a 0-d JSON value (never valid base64 of that size).
Errors: MalformedRequestError (400), DtypeMismatchError (422), UnsupportedMediaTypeError
(415), each with ``field`` = path such as ``"x[2][1]"`` or ``"tangents[1].w"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .encodings import ENCODINGS, Encoding, register_encoding
from .encodings.base import encoding_named
from .encodings.binary import (
    ALIGN,
    BINARY_TYPE,
    HEADER_LENGTH,
    MAX_HEADER_BYTES,
    BinaryLayout,
    array_bytes,
    padding,
)
from .encodings.common import (
    ALLOWED_DTYPES,
    JSON_CHUNK,
    JSON_TYPE,
    MARKER,
    MAX_DEPTH,
    JsonBody,
    decode_json_body,
    dumps,
    dumps_parts,
    encode_tree,
    loads,
    parsed_bytes,
)
from .encodings.json_lists import to_tree
from .encodings.negotiation import decoder_for, response_encoding
from .errors import MalformedRequestError

__all__ = [
    "ALIGN",
    "ALLOWED_DTYPES",
    "BINARY_TYPE",
    "ENCODINGS",
    "HEADER_LENGTH",
    "JSON_CHUNK",
    "JSON_TYPE",
    "MARKER",
    "MAX_DEPTH",
    "MAX_HEADER_BYTES",
    "BinaryLayout",
    "Encoding",
    "array_bytes",
    "decode_body",
    "decode_body_and_layout",
    "decode_response",
    "decode_result",
    "decoder_for",
    "dumps",
    "dumps_parts",
    "encode_body",
    "encode_body_parts",
    "from_tree",
    "loads",
    "padding",
    "parsed_bytes",
    "register_encoding",
    "response_encoding",
    "to_tree",
]


# --------------------------------------------------------------------------- encoding


def encode_body(payload: dict, encoding: str) -> tuple[bytes, str, dict[str, str]]:
    """Encode a request/response object -> ``(body, content_type, extra_headers)``.

    ``payload`` maps field names to arrays (anything with ``__array__``), pytrees or
    lists of them, and plain JSON values. ``extra_headers`` holds
    ``Dxserve-Header-Length`` for "binary", else is empty. ValueError for an encoding
    name not in ``ENCODINGS``.
    """
    enc = ENCODINGS.get(encoding)
    if enc is None:
        encoding_named(encoding)  # raises, naming the known encodings
    return enc.encode_body(payload)


def encode_body_parts(payload: dict, encoding: str) -> tuple[list[Any], str, dict[str, str]]:
    """``encode_body`` without the final join: the body as consecutive bytes-like parts.

    "binary" gives the arrays' own bytes as memoryviews (not copied); JSON encodings
    write large arrays a block at a time (``dumps_parts``).
    """
    enc = ENCODINGS.get(encoding)
    if enc is None:
        encoding_named(encoding)
    return enc.encode_body_parts(payload)


def from_tree(tree: Any, encoding: str, buffers: Any = None, field: str = "") -> Any:
    """Arrays / numpy scalars / jax arrays (anything with ``__array__``), dicts of them,
    tuples/lists of them -> wire form for ``encoding``; other JSON values pass through
    (non-finite Python floats become their string spellings).

    The result is serializable with ``dumps`` (with orjson it may hold C-contiguous
    ndarrays). For "binary", pass a collector of the arrays' buffers as ``buffers``.
    """
    return encode_tree(tree, encoding_named(encoding), buffers, field)


# --------------------------------------------------------------------------- decoding


def decode_body(
    body: bytes | bytearray | memoryview,
    content_type: str | None,
    header_length: str | None = None,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
    arrays: tuple[str, ...] = (),
) -> dict:
    """Parse a request/response body into a JSON object (dict).

    JSON bodies: typed objects are left as-is (``to_tree`` converts them); a long list
    of numbers (or of rows of numbers) under a top-level key in ``arrays`` (keys the
    caller reads as float64 arrays) may come back as that array.
    Binary bodies: every buffer reference is replaced by a read-only
    ``np.frombuffer`` view into ``body`` (zero-copy); everything else is left as-is.
    Raises MalformedRequestError (400) or UnsupportedMediaTypeError (415).
    """
    return decode_body_and_layout(
        body, content_type, header_length, max_header_bytes=max_header_bytes, arrays=arrays
    )[0]


def decode_body_and_layout(
    body: bytes | bytearray | memoryview,
    content_type: str | None,
    header_length: str | None = None,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
    arrays: tuple[str, ...] = (),
) -> tuple[dict, BinaryLayout | None]:
    """``decode_body``, and the ``BinaryLayout`` of a binary body's header (None for
    JSON bodies and headers over ``BinaryLayout.MAX_HEADER`` bytes).

    A repeated header is not parsed again: the same layout object comes back, so a
    caller may key what it derives from the header on it.
    """
    decoder = decoder_for(content_type)
    # the built-in JSON decoding, not an encoding's own (which gets its body as before)
    if arrays and type(decoder).decode_body is JsonBody.decode_body:
        return decode_json_body(body, arrays), None
    return decoder.decode_body(body, header_length, max_header_bytes)


def decode_result(
    value: Any, field: str, is_batch: bool = False, *, default_dtype: Any = np.float64
) -> Any:
    """One decoded field -> array/pytree, or (``is_batch``) a list of arrays/pytrees.

    A JSON list is ambiguous (one array vs. a list of arrays): the caller says which.
    """
    if not is_batch:
        return to_tree(value, field, default_dtype=default_dtype)
    if not isinstance(value, list):
        raise MalformedRequestError("expected a list of arrays", field=field)
    return [to_tree(v, f"{field}[{i}]", default_dtype=default_dtype) for i, v in enumerate(value)]


def decode_response(
    body: bytes | bytearray | memoryview,
    content_type: str | None,
    header_length: str | None = None,
    *,
    arrays: Iterable[str] = (),
    batches: Iterable[str] = (),
) -> dict:
    """Decode a whole body; fields in ``arrays`` become arrays/pytrees, fields in
    ``batches`` lists of them; other fields are returned as parsed JSON."""
    arrays = tuple(arrays)
    obj = decode_body(body, content_type, header_length, arrays=arrays)
    for key in arrays:
        if key in obj:
            obj[key] = decode_result(obj[key], key, False)
    for key in batches:
        if key in obj:
            obj[key] = decode_result(obj[key], key, True)
    return obj
