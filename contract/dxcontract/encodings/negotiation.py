"""Content negotiation: which encoding reads a request body, which one writes the answer."""

from __future__ import annotations

from ..errors import UnsupportedMediaTypeError
from .base import MEDIA_TYPES, Encoding
from .binary import BINARY_TYPE
from .common import JSON_TYPE, MARKER, STRING_ARRAY

_BUILT_IN_MEDIA = frozenset((JSON_TYPE, BINARY_TYPE))
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

    ``Accept: application/vnd.dxserve.binary`` -> "binary"; ``application/json;
    arrays=b64`` or ``arrays=lists`` picks the JSON flavour ("b64", "json"); plain
    ``application/json`` answers a binary request with lists and otherwise mirrors the
    request ("b64" if it carried base64 arrays, found by a byte search, not a parse).
    The media type of any other registered encoding, in ``Accept`` or as the request's
    Content-Type, picks that encoding.
    """
    binary_request = (content_type or "").lower().startswith(BINARY_TYPE)
    if accept:
        accept_l = accept.lower()
        if BINARY_TYPE in accept_l:
            return "binary"
        if "arrays=b64" in accept_l:
            return "b64"
        if "arrays=lists" in accept_l:
            return "json"
        if binary_request and JSON_TYPE in accept_l:
            return "json"
        if len(MEDIA_TYPES) > len(_BUILT_IN_MEDIA):  # only with encodings plugged in
            for media, encoding in MEDIA_TYPES.items():
                if media not in _BUILT_IN_MEDIA and media in accept_l:
                    return encoding.name
    if binary_request:
        return "binary"
    if len(MEDIA_TYPES) > len(_BUILT_IN_MEDIA) and content_type:
        encoding = MEDIA_TYPES.get(content_type.split(";", 1)[0].strip().lower())
        if encoding is not None and encoding.media_type.lower() not in _BUILT_IN_MEDIA:
            return encoding.name
    at = body.find(_MARKER_KEY)  # the first typed array: is its data a string?
    if at >= 0 and STRING_ARRAY.match(body, at):
        return "b64"
    return "json"
