"""The ``Encoding`` protocol and the registry of encodings by name and by media type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class Encoding(Protocol):
    """One way of writing arrays on the wire.

    ``name`` is what a client asks for ("json", "b64", "binary"); ``media_type`` the
    Content-Type of its bodies. Several encodings may share a media type ("json" and
    "b64" are both ``application/json``): the first one registered decodes it, and
    ``accept_param`` (``"arrays=b64"``) is how an ``Accept`` header picks among them.

    What the server reads of an encoding (see ``EncodingCosts``; an encoding that
    declares none of it is treated as one that parses JSON): ``decode_factor``, bytes
    held while decoding per body byte; ``encode_factor``, encoded bytes per result byte
    besides the result itself; ``body_limit``, the server setting that caps its
    bodies; ``views``, whether its arrays decode as views of the body (no copies).
    """

    name: str
    media_type: str

    def encode_array(self, a: np.ndarray, buffers: Any, field: str) -> Any:
        """One array (any shape, an allowed dtype) -> its JSON-able wire form.

        ``buffers`` is the body's collector of out-of-line data (None for encodings
        that keep arrays inline); ``field`` is the error path, e.g. ``"x.w"``.
        Raises DtypeMismatchError for a dtype outside ``ALLOWED_DTYPES``.
        """
        ...

    def encode_body(self, payload: dict) -> tuple[bytes, str, dict[str, str]]:
        """``payload`` (str -> arrays, pytrees, lists of them, JSON values) ->
        ``(body, media type, extra HTTP headers)``."""
        ...

    def encode_body_parts(self, payload: dict) -> tuple[list[Any], str, dict[str, str]]:
        """``encode_body`` with the body as consecutive bytes-like parts (joined, the
        same bytes), so large bodies are written without one long GIL-holding call."""
        ...

    def decode_body(
        self, body: bytes | bytearray | memoryview, header_length: str | None,
        max_header_bytes: int,
    ) -> tuple[dict, Any]:
        """A body -> ``(its top-level object, a reusable layout or None)``.

        Arrays the encoding carries out of line come back as numpy arrays; inline ones
        (lists, typed objects) are left for ``to_tree``, which also passes numpy arrays
        through. ``header_length`` is the ``Dxserve-Header-Length`` HTTP header, if any.
        Raises MalformedRequestError (400) for a body it cannot read.
        """
        ...


@dataclass(frozen=True)
class EncodingCosts:
    """What handling an encoding's bodies costs a server (see ``Encoding``)."""

    decode_factor: float = 16.0  # JSON numbers become Python objects: ~16x, measured
    encode_factor: float = 3.0  # float64 as JSON text: up to ~3x its binary size
    body_limit: str = "max_json_body_bytes"
    views: bool = False
    accept_param: str | None = None


def costs_of(encoding: Encoding) -> EncodingCosts:
    """``encoding``'s declarations, the defaults where it declares none (read once, when
    it is registered: every request asks)."""
    known = _COSTS.get(encoding.name)
    if known is not None and ENCODINGS.get(encoding.name) is encoding:
        return known
    return _declared(encoding)


def _declared(encoding: Encoding) -> EncodingCosts:
    default = EncodingCosts()
    return EncodingCosts(**{
        name: getattr(encoding, name, getattr(default, name))
        for name in EncodingCosts.__dataclass_fields__
    })


#: name -> encoding, in registration order
ENCODINGS: dict[str, Encoding] = {}
#: media type (lower case) -> the encoding that decodes bodies of that type
MEDIA_TYPES: dict[str, Encoding] = {}
#: media type (lower case) -> the one encoding that writes it, for media types only one
#: encoding writes (an ``Accept`` of that type names the encoding: no parameter needed)
SOLE_WRITERS: dict[str, Encoding] = {}
#: name -> the registered encoding's ``EncodingCosts``
_COSTS: dict[str, EncodingCosts] = {}


def register_encoding(encoding: Encoding) -> Encoding:
    """Make ``encoding`` available by its name (``encode_body(payload, name)``) and its
    media type (decoding, content negotiation). A name registered again is replaced.
    Returns ``encoding``, so a module can keep what it registered."""
    if encoding.name in ENCODINGS:
        unregister_encoding(encoding.name)
    ENCODINGS[encoding.name] = encoding
    _COSTS[encoding.name] = _declared(encoding)
    MEDIA_TYPES.setdefault(encoding.media_type.lower(), encoding)
    _count_writers()
    return encoding


def unregister_encoding(name: str) -> None:
    """Forget the encoding called ``name`` (and its media type, if it decoded it)."""
    encoding = ENCODINGS.pop(name)
    _COSTS.pop(name, None)
    media = encoding.media_type.lower()
    if MEDIA_TYPES.get(media) is encoding:
        del MEDIA_TYPES[media]
        for other in ENCODINGS.values():  # another one of that media type takes over
            if other.media_type.lower() == media:
                MEDIA_TYPES[media] = other
                break
    _count_writers()


def _count_writers() -> None:
    writers: dict[str, list[Encoding]] = {}
    for encoding in ENCODINGS.values():
        writers.setdefault(encoding.media_type.lower(), []).append(encoding)
    SOLE_WRITERS.clear()
    SOLE_WRITERS.update({media: found[0] for media, found in writers.items() if len(found) == 1})


def encoding_named(name: str) -> Encoding:
    """The registered encoding called ``name``; ValueError naming the known ones."""
    encoding = ENCODINGS.get(name)
    if encoding is None:
        raise ValueError(f"unknown encoding {name!r}; use one of {tuple(ENCODINGS)}")
    return encoding
