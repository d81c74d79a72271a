"""Content negotiation: which encoding reads a request body, which one writes the answer."""

from __future__ import annotations

from ..errors import UnsupportedMediaTypeError
from .base import ENCODINGS, MEDIA_TYPES, SOLE_WRITERS, Encoding
from .common import JSON_TYPE, MARKER, STRING_ARRAY

_MARKER_KEY = b'"' + MARKER.encode() + b'"'


def decoder_for(content_type: str | None) -> Encoding:
    """The encoding that reads a body of ``content_type`` (parameters and case ignored).

    Raises UnsupportedMediaTypeError (415, field "Content-Type") for a media type no
    registered encoding reads, or no Content-Type at all.
    """
    encoding = MEDIA_TYPES.get(content_type)  # the usual, exact spelling: no string work
    if encoding is not None:
        return encoding
    media = (content_type or "").split(";", 1)[0].strip().lower()
    encoding = MEDIA_TYPES.get(media)
    if encoding is not None:
        return encoding
    got = f"content type {content_type!r} is not supported" if content_type else "no Content-Type"
    raise UnsupportedMediaTypeError(f"{got}; use {' or '.join(MEDIA_TYPES)}", field="Content-Type")


def response_encoding(content_type: str | None, accept: str | None, body: bytes) -> str:
    """The name of the answer's encoding: ``Accept`` if it says, else the request's own.

    An ``Accept`` of a media type only one encoding writes (the binary framing, a
    plugged-in encoding) names it; an ``accept_param`` an encoding declares
    (``application/json; arrays=b64`` or ``arrays=lists``) picks among those sharing
    ``application/json``; plain ``application/json`` answers a request of another
    media type with lists. Without those, the answer mirrors the request: its own
    encoding where only one writes its media type, else for JSON "b64" if the request
    carried base64 arrays (found by a byte search, not a parse) and "json" otherwise.
    """
    request = MEDIA_TYPES.get(content_type)  # the usual, exact spelling: no string work
    if request is None and content_type:
        request = MEDIA_TYPES.get(content_type.split(";", 1)[0].strip().lower())
    json_request = request is not None and request.media_type == JSON_TYPE
    if accept:
        accept_l = accept.lower()
        for media, encoding in SOLE_WRITERS.items():
            if media in accept_l:
                return encoding.name
        for encoding in ENCODINGS.values():
            param = getattr(encoding, "accept_param", None)
            if param and param in accept_l:
                return encoding.name
        if request is not None and not json_request and JSON_TYPE in accept_l:
            return "json"
    if request is not None and not json_request:
        sole = SOLE_WRITERS.get(request.media_type.lower())
        if sole is not None:
            return sole.name
    at = body.find(_MARKER_KEY)  # the first typed array: is its data a string?
    if at >= 0 and STRING_ARRAY.match(body, at):
        return "b64"
    return "json"
