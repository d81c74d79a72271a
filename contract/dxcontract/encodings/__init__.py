"""Wire encodings of arrays, one module each, plugged in through ``register_encoding``.

``json_lists`` ("json"), ``typed_b64`` ("b64") and ``binary`` ("binary") are registered
here, in that order; ``common`` holds what they share and ``negotiation`` picks the
encoding of a request body (Content-Type) and of its answer (Accept). A new encoding is
one module with a class following ``Encoding``, registered with ``register_encoding``.
"""

from __future__ import annotations

from .base import (
    ENCODINGS,
    MEDIA_TYPES,
    Encoding,
    EncodingCosts,
    costs_of,
    encoding_named,
    register_encoding,
    unregister_encoding,
)
from .binary import Binary
from .json_lists import JsonLists
from .typed_b64 import TypedB64

__all__ = [
    "ENCODINGS",
    "MEDIA_TYPES",
    "Binary",
    "Encoding",
    "EncodingCosts",
    "JsonLists",
    "TypedB64",
    "costs_of",
    "encoding_named",
    "register_encoding",
    "unregister_encoding",
]

JSON_LISTS = register_encoding(JsonLists())
TYPED_B64 = register_encoding(TypedB64())
BINARY = register_encoding(Binary())
