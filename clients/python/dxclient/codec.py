"""Wire codec for arrays: shared by the dxserve server and the Python client.

Depends only on numpy and the stdlib (orjson is used when importable).

Three encodings (``ENCODINGS``):

``"json"``  float64 arrays are plain numbers / nested lists; every other dtype is a
    typed object ``{"__ndarray__": <number|nested list>, "dtype": "float32", "shape": [2]}``.
    Non-finite floats are the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.
    Bool data are JSON ``true``/``false``.  Complex data are nested ``[re, im]`` pairs
    (the list has one extra trailing axis of length 2).  A float64 array whose shape has
    a 0 before its last axis (e.g. ``(0, 3)``) is sent as a typed object, because a bare
    nested list cannot carry that shape.
``"b64"``   every array: ``{"__ndarray__": "<base64 LE C-order>", "dtype": ..., "shape": ...}``.
``"binary"`` body = JSON header (space-padded to a multiple of 64 bytes) + raw buffers,
    each padded to a multiple of 64 bytes.  HTTP header ``Dxserve-Header-Length`` is the
    padded header length; arrays are ``{"__ndarray__": {"offset": o, "nbytes": k}, ...}``
    with ``o`` relative to the end of the header.  Decoding returns read-only numpy views
    into the body (no copy).

Pytrees are JSON objects of str -> array-or-pytree; lists are always arrays.  Pytree keys
starting with ``"__"`` are reserved (``__ndarray__`` marks a typed array).

Arrays decoded from "b64" and "binary" are read-only views.  The binary decoder accepts
any offsets (unaligned ones give numpy arrays with ``flags.aligned`` False).  In a typed
object a string ``__ndarray__`` is base64, except a spelling ("NaN", ...) with shape ``[]``
and a float dtype, which is a 0-d JSON value (never valid base64 of that size).
Errors: MalformedRequestError (400), DtypeMismatchError (422), UnsupportedMediaTypeError
(415), each with ``field`` = path such as ``"x[2][1]"`` or ``"tangents[1].w"``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from .errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    MalformedRequestError,
    UnsupportedMediaTypeError,
)

try:
    import orjson
except ImportError:  # pragma: no cover - exercised only without orjson
    orjson = None

__all__ = [
    "ALLOWED_DTYPES",
    "BINARY_TYPE",
    "ENCODINGS",
    "HEADER_LENGTH",
    "JSON_TYPE",
    "MARKER",
    "BinaryLayout",
    "decode_body",
    "decode_body_and_layout",
    "array_bytes",
    "decode_response",
    "decode_result",
    "dumps",
    "dumps_parts",
    "encode_body",
    "encode_body_parts",
    "from_tree",
    "loads",
    "padding",
    "to_tree",
]

JSON_TYPE = "application/json"
BINARY_TYPE = "application/vnd.dxserve.binary"
HEADER_LENGTH = "Dxserve-Header-Length"
ENCODINGS = ("json", "b64", "binary")
MARKER = "__ndarray__"
ALIGN = 64
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 32

ALLOWED_DTYPES = (
    "float16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
)  # fmt: skip
# name -> little-endian numpy dtype
_LE = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}
# dtype -> its name, for the allowed dtypes in native and little-endian order
_NAMES = {**{np.dtype(name): name for name in ALLOWED_DTYPES}, **{dt: n for n, dt in _LE.items()}}
_SPELLINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_TYPED_KEYS = frozenset((MARKER, "dtype", "shape"))
_REF_KEYS = frozenset(("offset", "nbytes"))
_F64 = np.dtype(np.float64)


# --------------------------------------------------------------------------- JSON


def dumps(tree: Any) -> bytes:
    """Serialize a ``from_tree`` result to strict JSON bytes (ndarrays allowed with orjson)."""
    if orjson is not None:
        return orjson.dumps(tree, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(tree, allow_nan=False, separators=(",", ":")).encode()


#: Most array elements one ``orjson`` call writes in ``dumps_parts`` (~1 ms of work).
JSON_CHUNK = 1 << 14


def dumps_parts(tree: Any) -> list[bytes]:
    """``dumps(tree)`` as consecutive parts, large arrays written a block at a time.

    The same bytes as ``dumps``; but a thread serializing an 18 MB Jacobian no longer
    holds the GIL for one ~150 ms call: between blocks, a thread waiting for it (the
    server's event loop) gets it within the switch interval.
    """
    if orjson is None:
        return [dumps(tree)]
    out: list[bytes] = []
    _dump_parts(tree, out)
    return out


def _dump_parts(obj: Any, out: list[bytes]) -> None:
    if isinstance(obj, np.ndarray) and obj.ndim >= 1 and obj.size > JSON_CHUNK:
        row = obj.size // obj.shape[0]
        out.append(b"[")
        if row > JSON_CHUNK:  # a row is itself large: one row at a time
            for i in range(obj.shape[0]):
                if i:
                    out.append(b",")
                _dump_parts(obj[i], out)
        else:
            step = max(1, JSON_CHUNK // row)
            for i in range(0, obj.shape[0], step):
                if i:
                    out.append(b",")
                out.append(dumps(obj[i : i + step])[1:-1])  # "[a,b]" -> "a,b"
        out.append(b"]")
    elif isinstance(obj, dict):
        out.append(b"{")
        for k, (key, value) in enumerate(obj.items()):
            out.append((b"," if k else b"") + dumps(key) + b":")
            _dump_parts(value, out)
        out.append(b"}")
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict | np.ndarray):
        out.append(b"[")  # e.g. a batch of results: each in pieces
        for k, value in enumerate(obj):
            if k:
                out.append(b",")
            _dump_parts(value, out)
        out.append(b"]")
    elif isinstance(obj, list) and len(obj) > 1:  # data, e.g. ``tolist()`` with "NaN"s
        first = obj[0]
        step = max(1, JSON_CHUNK // (len(first) if isinstance(first, list) and first else 1))
        if len(obj) <= step:
            out.append(dumps(obj))
            return
        out.append(b"[")
        for i in range(0, len(obj), step):
            if i:
                out.append(b",")
            out.append(dumps(obj[i : i + step])[1:-1])
        out.append(b"]")
    else:
        out.append(dumps(obj))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"bare {name} is not JSON; use the string spelling")


def loads(data: bytes | bytearray | memoryview | str, field: str | None = None) -> Any:
    """Parse strict JSON; any error -> MalformedRequestError."""
    try:
        if orjson is not None:
            return orjson.loads(data)
        if not isinstance(data, str):
            data = bytes(data).decode("utf-8")
        return json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise MalformedRequestError("JSON nested too deeply", field=field) from None
    except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise MalformedRequestError(f"invalid JSON: {exc}", field=field) from None


# --------------------------------------------------------------------------- helpers


def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _dtype_of(name: Any, field: str) -> np.dtype:
    if not isinstance(name, str):
        raise MalformedRequestError(
            f"typed array: 'dtype' must be a string, got {type(name).__name__}", field=field
        )
    dt = _LE.get(name)
    if dt is None:
        raise DtypeMismatchError(
            f"dtype {name!r} is not allowed; allowed: {', '.join(ALLOWED_DTYPES)}", field=field
        )
    return dt


def _shape_of(shape: Any, field: str, max_depth: int) -> tuple[int, ...]:
    if not isinstance(shape, list):
        raise MalformedRequestError("typed array: 'shape' must be a list of ints", field=field)
    if len(shape) > max_depth:
        raise MalformedRequestError(
            f"typed array: shape has {len(shape)} dims, more than {max_depth}", field=field
        )
    for d in shape:
        if type(d) is not int or d < 0:
            raise MalformedRequestError(
                f"typed array: shape entries must be non-negative ints, got {d!r}", field=field
            )
    return tuple(shape)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _le_contig(a: np.ndarray) -> np.ndarray:
    """C-contiguous little-endian copy-if-needed of ``a``."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def _check_dtype(a: np.ndarray, field: str) -> str:
    # ``dtype.name`` is computed in Python by numpy (~3 us); the allowed native and
    # little-endian dtypes answer from a dict, which every small request feels.
    name = _NAMES.get(a.dtype)
    if name is not None:
        return name
    name = a.dtype.name
    if name not in _LE:
        raise DtypeMismatchError(
            f"dtype {a.dtype} is not allowed; allowed: {', '.join(ALLOWED_DTYPES)}", field=field
        )
    return name


# --------------------------------------------------------------------------- decoding


def _content_kind(content_type: str | None) -> str:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == JSON_TYPE:
        return "json"
    if media == BINARY_TYPE:
        return "binary"
    got = f"content type {content_type!r} is not supported" if content_type else "no Content-Type"
    raise UnsupportedMediaTypeError(f"{got}; use {JSON_TYPE} or {BINARY_TYPE}", field="Content-Type")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def decode_body(
    body: bytes | bytearray | memoryview,
    content_type: str | None,
    header_length: str | None = None,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> dict:
    """Parse a request/response body into a JSON object (dict).

    JSON bodies: typed objects are left as-is (``to_tree`` converts them).
    Binary bodies: every buffer reference is replaced by a read-only
    ``np.frombuffer`` view into ``body`` (zero-copy); everything else is left as-is.
    Raises MalformedRequestError (400) or UnsupportedMediaTypeError (415).
    """
    return decode_body_and_layout(
        body, content_type, header_length, max_header_bytes=max_header_bytes
    )[0]


def decode_body_and_layout(
    body: bytes | bytearray | memoryview,
    content_type: str | None,
    header_length: str | None = None,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[dict, BinaryLayout | None]:
    """``decode_body``, and the ``BinaryLayout`` of a binary body's header (None for
    JSON bodies and headers over ``BinaryLayout.MAX_HEADER`` bytes).

    The same header comes back again and again (same function, backend, shapes and
    dtypes), so its layout is remembered: a repeated header is not parsed again, and a
    caller can keep what it derives from the header in ``layout.memo``.
    """
    kind = _content_kind(content_type)
    if kind == "json":
        obj = loads(body, field="body")
        if not isinstance(obj, dict):
            raise MalformedRequestError(
                f"the body must be a JSON object, got {_json_kind(obj)}", field="body"
            )
        return obj, None

    field = HEADER_LENGTH
    if header_length is None:
        raise MalformedRequestError(f"binary body needs the {HEADER_LENGTH} header", field=field)
    text = header_length.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise MalformedRequestError(
            f"must be a decimal integer, got {header_length!r}", field=field
        )
    n = int(text)
    if n == 0:
        raise MalformedRequestError("header length must be positive", field=field)
    if n > max_header_bytes:
        raise MalformedRequestError(f"header length {n} exceeds {max_header_bytes}", field=field)
    if n > len(body):
        raise MalformedRequestError(
            f"header length {n} exceeds the body length {len(body)}", field=field
        )
    buf = body if isinstance(body, bytes | bytearray) else memoryview(body)
    head = bytes(buf[:n]) if n <= BinaryLayout.MAX_HEADER else None
    layout = _LAYOUTS.get(head) if head is not None else None
    if layout is not None and len(buf) - n >= layout.end:
        return layout.fill(layout.tree, buf, n), layout
    header = loads(memoryview(body)[:n], field="header")
    if not isinstance(header, dict):
        raise MalformedRequestError("the binary header must be a JSON object", field="header")
    for key in list(header):
        header[key] = _resolve_refs(header[key], key, buf, n, 0)
    if head is not None:  # checked in full just now: the next body like it skips all that
        layout = BinaryLayout(loads(head))
        _LAYOUTS.put(head, layout)
    return header, layout


class _Slot:
    """An array's place in a binary body, from a header already checked once."""

    __slots__ = ("count", "dtype", "end", "offset", "shape")

    def __init__(self, ref: dict) -> None:
        self.dtype, self.shape = _LE[ref["dtype"]], tuple(ref["shape"])
        self.count, self.offset = _prod(self.shape), ref[MARKER]["offset"]
        self.end = self.offset + ref[MARKER]["nbytes"]


class BinaryLayout:
    """A checked binary header: its JSON with every buffer reference turned into a slot.

    Decoding a body with a known layout is a copy of the small JSON tree plus one
    ``np.frombuffer`` view per array. Built only from a header ``decode_body`` has just
    checked in full, so a layout is valid for every body at least ``end`` bytes past it.
    ``memo`` is for callers (the server keeps each operator's parsed request there).
    """

    MAX_HEADER = 2048  # bytes; longer headers are parsed every time

    def __init__(self, header: dict) -> None:
        self.end = 0
        self.tree = self._slots(header)
        self.memo: dict[Any, Any] = {}

    def _slots(self, value: Any) -> Any:
        if isinstance(value, dict):
            if MARKER in value and isinstance(value[MARKER], dict):
                slot = _Slot(value)
                self.end = max(self.end, slot.end)
                return slot
            return {k: self._slots(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._slots(v) for v in value]
        return value

    def fill(self, value: Any, body: Any, start: int) -> Any:
        """A fresh copy of ``value`` with read-only views into ``body`` for its slots."""
        kind = type(value)
        if kind is _Slot:
            a = np.frombuffer(body, value.dtype, value.count, start + value.offset)
            return a.reshape(value.shape)
        if kind is dict:
            return {k: self.fill(v, body, start) for k, v in value.items()}
        if kind is list:
            return [self.fill(v, body, start) for v in value]
        return value


class _Memo:
    """A small bounded dict: cleared when full (a working set this large isn't repeating)."""

    def __init__(self, max_entries: int = 512) -> None:
        self.max_entries = max_entries
        self._items: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self._items.get(key)

    def put(self, key: Any, value: Any) -> None:
        if len(self._items) >= self.max_entries:
            self._items.clear()
        self._items[key] = value


#: header bytes -> BinaryLayout, for decoding
_LAYOUTS = _Memo()
#: ``_header_key`` -> padded header bytes, for encoding: the same call, the same header
_HEADERS = _Memo()


def _resolve_refs(value: Any, field: str, body: Any, start: int, depth: int) -> Any:
    """Replace binary buffer references inside ``value`` by views into ``body``."""
    if depth > 2 * MAX_DEPTH:
        raise MalformedRequestError("binary header nested too deeply", field=field)
    if isinstance(value, dict):
        if MARKER in value and isinstance(value[MARKER], dict):
            return _buffer_view(value, field, body, start)
        for key in list(value):
            v = value[key]
            if isinstance(v, dict | list):
                value[key] = _resolve_refs(v, _join(field, key), body, start, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, dict | list):
                value[i] = _resolve_refs(v, f"{field}[{i}]", body, start, depth + 1)
    return value


def _typed_header(obj: dict, field: str, max_depth: int) -> tuple[np.dtype, tuple[int, ...]]:
    """Check a typed array object's keys; return its dtype and shape."""
    if obj.keys() != _TYPED_KEYS:
        raise MalformedRequestError(
            f"typed array must have exactly the keys {sorted(_TYPED_KEYS)}, got {sorted(obj)}",
            field=field,
        )
    return _dtype_of(obj["dtype"], field), _shape_of(obj["shape"], field, max_depth)


def _buffer_view(obj: dict, field: str, body: Any, start: int) -> np.ndarray:
    dt, shape = _typed_header(obj, field, MAX_DEPTH)
    ref = obj[MARKER]
    if ref.keys() != _REF_KEYS:
        raise MalformedRequestError(
            f"buffer reference must have exactly the keys ['nbytes', 'offset'], got {sorted(ref)}",
            field=field,
        )
    offset, nbytes = ref["offset"], ref["nbytes"]
    for name, v in (("offset", offset), ("nbytes", nbytes)):
        if type(v) is not int or v < 0:
            raise MalformedRequestError(
                f"buffer {name} must be a non-negative int, got {v!r}", field=field
            )
    expected = _prod(shape) * dt.itemsize
    if nbytes != expected:
        raise MalformedRequestError(
            f"buffer nbytes {nbytes} != prod(shape {list(shape)}) * itemsize {dt.itemsize} "
            f"= {expected}",
            field=field,
        )
    available = len(body) - start
    if offset > available or nbytes > available - offset:
        raise MalformedRequestError(
            f"buffer [offset {offset}, +{nbytes}) runs past the {available} buffer bytes",
            field=field,
        )
    count = _prod(shape)
    try:
        a = np.frombuffer(body, dtype=dt, count=count, offset=start + offset)
        return a.reshape(shape)
    except ValueError as exc:  # pragma: no cover - guarded above
        raise MalformedRequestError(f"bad buffer: {exc}", field=field) from None


def to_tree(
    value: Any,
    field: str,
    *,
    default_dtype: Any = np.float64,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """Turn one decoded JSON value into an ndarray or a dict-pytree of ndarrays.

    Numbers and (nested) lists become ``default_dtype`` arrays (0-d for numbers);
    typed objects keep their dtype and shape; ndarrays (binary views) pass through.
    Errors: MalformedRequestError (400) / DtypeMismatchError (422) with ``field`` a path
    like ``"x[2][1]"`` or ``"contexts[0].w"``.
    """
    return _to_tree(value, field, np.dtype(default_dtype), max_depth, 0)


def _to_tree(value: Any, field: str, dt: np.dtype, max_depth: int, depth: int) -> Any:
    if depth > max_depth:
        raise MalformedRequestError(f"pytree nested deeper than {max_depth}", field=field)
    if isinstance(value, np.ndarray):
        _check_dtype(value, field)
        return value
    if isinstance(value, dict):
        if MARKER in value:
            return _typed(value, field, max_depth)
        out = {}
        for key, v in value.items():
            if not isinstance(key, str) or key.startswith("__"):
                raise MalformedRequestError(
                    f"pytree key {key!r} is reserved (keys starting with '__' are not allowed)",
                    field=_join(field, str(key)),
                )
            out[key] = _to_tree(v, _join(field, key), dt, max_depth, depth + 1)
        return out
    return _data_to_array(value, field, dt, max_depth - depth)


def _typed(obj: dict, field: str, max_depth: int) -> np.ndarray:
    dt, shape = _typed_header(obj, field, max_depth)
    data = obj[MARKER]
    if isinstance(data, dict):
        raise MalformedRequestError(
            "buffer reference outside a binary body (Content-Type "
            f"{BINARY_TYPE} with {HEADER_LENGTH} needed)",
            field=field,
        )
    if isinstance(data, str) and not (shape == () and dt.kind == "f" and data in _SPELLINGS):
        return _from_b64(data, dt, shape, field)
    # JSON data
    if dt.kind == "c":
        pairs = _data_to_array(data, field, _F64, max_depth + 1, complex_pairs=True)
        _check_shape(pairs.shape, (*shape, 2), field)
        pairs = pairs.reshape((*shape, 2))
        out = np.empty(shape, dtype=np.complex128)
        out.real = pairs[..., 0]
        out.imag = pairs[..., 1]
        return out.astype(dt)
    a = _data_to_array(data, field, dt, max_depth)
    _check_shape(a.shape, shape, field)
    return a.reshape(shape)


def _check_shape(got: tuple[int, ...], declared: tuple[int, ...], field: str) -> None:
    if got == declared:
        return
    # a nested list cannot express axes after a zero-length axis: compare the prefix
    if 0 in declared:
        prefix = declared[: declared.index(0) + 1]
        if got == prefix:
            return
    raise MalformedRequestError(
        f"data has shape {list(got)} but the typed array declares shape {list(declared)}",
        field=field,
    )


def _from_b64(data: str, dt: np.dtype, shape: tuple[int, ...], field: str) -> np.ndarray:
    nbytes = _prod(shape) * dt.itemsize
    expected_len = 4 * ((nbytes + 2) // 3)
    if len(data) != expected_len:
        raise MalformedRequestError(
            f"base64 data has {len(data)} chars but shape {list(shape)} of {dt.name} needs "
            f"{nbytes} bytes = {expected_len} base64 chars",
            field=field,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MalformedRequestError(f"invalid base64: {exc}", field=field) from None
    if len(raw) != nbytes:
        raise MalformedRequestError(
            f"base64 decodes to {len(raw)} bytes, expected {nbytes}", field=field
        )
    return np.frombuffer(raw, dtype=dt).reshape(shape)


def _data_to_array(
    value: Any, field: str, dt: np.dtype, max_depth: int, complex_pairs: bool = False
) -> np.ndarray:
    """JSON number / nested list / spelling string -> ndarray of dtype ``dt``."""
    kind = dt.kind
    if kind == "c" and not complex_pairs:
        # plain numbers for a complex default: real values
        return _data_to_array(value, field, _F64, max_depth).astype(dt)
    t = type(value)
    if t is bool:
        if kind == "b":
            return np.asarray(value, dtype=dt)
        raise MalformedRequestError("booleans are not numbers", field=field)
    if t is float or t is int:
        if kind == "f":
            return _cast_float(np.asarray(float(value) if t is int else value), dt, field)
        if kind in "iu":
            if t is not int:
                raise MalformedRequestError(f"expected an integer for {dt.name}", field=field)
            return _cast_int([value], dt, field).reshape(())
        raise MalformedRequestError(f"expected a boolean for {dt.name}", field=field)
    if t is str:
        if kind == "f" and value in _SPELLINGS:
            return _cast_float(np.asarray(_SPELLINGS[value]), dt, field)
        raise MalformedRequestError(
            f"unexpected string {value[:40]!r}; only 'NaN', 'Infinity', '-Infinity' allowed",
            field=field,
        )
    if t is not list:
        what = "null" if value is None else type(value).__name__
        if isinstance(value, dict):
            what = "object (lists are arrays; pytrees are objects of arrays)"
        raise MalformedRequestError(f"expected a number or a list, got {what}", field=field)

    # probe the depth along first elements (cheap) before handing to numpy
    ndim, v = 0, value
    while type(v) is list:
        ndim += 1
        if ndim > max_depth:
            raise MalformedRequestError(f"list nested deeper than {max_depth}", field=field)
        if not v:
            break
        v = v[0]
    # one C-speed pass over the leaf types (also catches bools, which numpy would
    # silently turn into 0/1, and strings, which make np.asarray very slow)
    if _leaf_types(value, ndim) <= _FAST_TYPES[kind]:
        try:
            if kind == "f":
                if ndim == 1:  # fromiter is the quickest list -> float64 conversion
                    a = np.fromiter(value, dtype=np.float64, count=len(value))
                else:
                    a = np.array(value, dtype=np.float64)
                return _cast_float(a, dt, field)
            if kind in "iu":
                return _cast_int(value, dt, field)
            return np.array(value, dtype=dt)
        except (ValueError, TypeError, OverflowError):
            pass  # ragged or out of range: the slow path says where
    return _slow(value, field, dt, ndim)


def _cast_float(a: np.ndarray, dt: np.dtype, field: str) -> np.ndarray:
    if a.dtype == dt:
        return a
    with np.errstate(over="ignore"):
        out = a.astype(dt)
    if dt.itemsize < a.dtype.itemsize and not np.isfinite(out).all():
        if (np.isfinite(a) != np.isfinite(out)).any():
            raise MalformedRequestError(f"value out of range for {dt.name}", field=field)
    return out


def _cast_int(a: Any, dt: np.dtype, field: str) -> np.ndarray:
    try:
        src = np.asarray(a)
        if src.dtype.kind in "iu" and src.dtype != dt:
            info = np.iinfo(dt)
            if src.size and (src.min() < info.min or src.max() > info.max):
                raise OverflowError
            return src.astype(dt)
        return np.array(a, dtype=dt)
    except OverflowError:
        raise MalformedRequestError(f"integer out of range for {dt.name}", field=field) from None


_FAST_TYPES = {
    "f": frozenset((float, int)),
    "i": frozenset((int,)),
    "u": frozenset((int,)),
    "b": frozenset((bool,)),
}


def _leaf_types(value: list, ndim: int) -> set:
    """Types found at depth ``ndim`` (``list`` when a row is not a list: ragged)."""
    if ndim <= 1:
        return set(map(type, value))
    types: set = set()
    for sub in value:
        if type(sub) is not list:
            return {list}
        types |= _leaf_types(sub, ndim - 1)
    return types


def _slow(value: list, field: str, dt: np.dtype, ndim: int) -> np.ndarray:
    """Element-wise validation with precise error paths (strings, None, ragged...)."""
    shape: list[int] = []
    v = value
    for _ in range(ndim):
        shape.append(len(v))
        if not v:
            break
        v = v[0]
    kind = dt.kind
    flat: list[Any] = []
    append = flat.append

    def leaf(x: Any, path: str) -> None:
        t = type(x)
        if kind == "b":
            if t is bool:
                return append(x)
            raise MalformedRequestError(f"expected a boolean for {dt.name}", field=path)
        if t is bool:
            raise MalformedRequestError("booleans are not numbers", field=path)
        if kind in "iu":
            if t is int:
                return append(x)
            raise MalformedRequestError(f"expected an integer for {dt.name}", field=path)
        if t is float:
            return append(x)
        if t is int:
            try:
                return append(float(x))
            except OverflowError:
                raise MalformedRequestError("integer too large", field=path) from None
        if t is str:
            if x in _SPELLINGS:
                return append(_SPELLINGS[x])
            raise MalformedRequestError(
                f"unexpected string {x[:40]!r}; only 'NaN', 'Infinity', '-Infinity' allowed",
                field=path,
            )
        what = "null" if x is None else type(x).__name__
        if t is dict:
            what = "object (lists are arrays; a list of pytrees is not allowed)"
        if t is list:
            what = "a list (ragged: nesting deeper here than elsewhere)"
        raise MalformedRequestError(f"expected a number, got {what}", field=path)

    fast_type = {"f": float, "i": int, "u": int, "b": bool}[kind]
    last = len(shape) - 1

    def walk(x: Any, path: str, d: int) -> None:
        if d == len(shape):
            return leaf(x, path)
        if d == last and type(x) is list and len(x) == shape[d]:
            # innermost row: convert in bulk, fall back per element only on trouble
            row = [_SPELLINGS.get(y, y) if type(y) is str else y for y in x] if kind == "f" else x
            if set(map(type, row)) <= {fast_type}:
                flat.extend(row)
                return
            for i, y in enumerate(x):
                leaf(y, f"{path}[{i}]")
            return
        if type(x) is not list:
            raise MalformedRequestError(
                f"ragged list: expected a list of length {shape[d]} here", field=path
            )
        if len(x) != shape[d]:
            raise MalformedRequestError(
                f"ragged list: length {len(x)}, expected {shape[d]}", field=path
            )
        for i, y in enumerate(x):
            walk(y, f"{path}[{i}]", d + 1)

    walk(value, field, 0)
    if kind == "f":
        return _cast_float(np.array(flat, dtype=np.float64).reshape(shape), dt, field)
    if kind in "iu":
        return _cast_int(flat, dt, field).reshape(shape)
    return np.array(flat, dtype=dt).reshape(shape)


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
    obj = decode_body(body, content_type, header_length)
    for key in arrays:
        if key in obj:
            obj[key] = decode_result(obj[key], key, False)
    for key in batches:
        if key in obj:
            obj[key] = decode_result(obj[key], key, True)
    return obj


# --------------------------------------------------------------------------- encoding


class _Buffers:
    """Collects the raw buffers of a binary body and their 64-aligned offsets."""

    def __init__(self) -> None:
        self.items: list[np.ndarray] = []
        self.size = 0

    def add(self, a: np.ndarray) -> int:
        offset = self.size
        self.items.append(a)
        self.size += -(-a.nbytes // ALIGN) * ALIGN
        return offset


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, np.ndarray | np.generic) or (
        hasattr(x, "__array__") and not isinstance(x, str | bytes | dict | list | tuple)
    )


def _float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _json_floats(a: np.ndarray) -> Any:
    """float64 array -> JSON-able data (ndarray for orjson, else nested lists)."""
    if a.ndim == 0:
        return _float(float(a))
    if np.isfinite(a).all():
        return np.ascontiguousarray(a) if orjson is not None else a.tolist()
    obj = a.astype(object)
    obj[np.isnan(a)] = "NaN"
    obj[a == np.inf] = "Infinity"
    obj[a == -np.inf] = "-Infinity"
    return obj.tolist()


def _encode_array(a: np.ndarray, encoding: str, buffers: Any, field: str) -> Any:
    name = _check_dtype(a, field)
    shape = list(a.shape)
    if encoding == "json":
        kind = a.dtype.kind
        if kind == "f":
            f = a.astype(np.float64, copy=False)
            data = _json_floats(f)
            if name == "float64" and 0 not in shape[:-1]:
                return data
        elif kind == "c":
            data = _json_floats(np.stack([a.real, a.imag], axis=-1).astype(np.float64))
        elif a.ndim == 0:
            data = a.item()
        elif orjson is not None:
            data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
        else:
            data = a.tolist()
        return {MARKER: data, "dtype": name, "shape": shape}
    le = _le_contig(a)
    if encoding == "b64":
        raw = memoryview(le.reshape(-1).view(np.uint8))
        return {MARKER: base64.b64encode(raw).decode("ascii"), "dtype": name, "shape": shape}
    if encoding == "binary":
        if buffers is None:
            raise ValueError("binary encoding needs a buffers collector")
        offset = buffers.add(le)
        return {MARKER: {"offset": offset, "nbytes": le.nbytes}, "dtype": name, "shape": shape}
    raise ValueError(f"unknown encoding {encoding!r}; use one of {ENCODINGS}")


def from_tree(tree: Any, encoding: str, buffers: Any = None, field: str = "") -> Any:
    """Arrays / numpy scalars / jax arrays (anything with ``__array__``), dicts of them,
    tuples/lists of them -> wire form for ``encoding``; other JSON values pass through
    (non-finite Python floats become their string spellings).

    The result is serializable with ``dumps`` (with orjson it may hold C-contiguous
    ndarrays). For "binary", pass the collector from ``encode_body`` as ``buffers``.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; use one of {ENCODINGS}")
    return _from_tree(tree, encoding, buffers, field)


def _from_tree(tree: Any, encoding: str, buffers: Any, field: str) -> Any:
    if isinstance(tree, dict):
        out = {}
        for key, v in tree.items():
            if not isinstance(key, str) or key.startswith("__"):
                raise InvalidArgumentError(
                    f"key {key!r} cannot be sent (keys starting with '__' are reserved)",
                    field=_join(field, str(key)),
                )
            out[key] = _from_tree(v, encoding, buffers, _join(field, key))
        return out
    if isinstance(tree, list | tuple):
        return [_from_tree(v, encoding, buffers, f"{field}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, float):
        return _float(tree)
    if tree is None or isinstance(tree, str | int):
        return tree
    if _is_arraylike(tree):
        return _encode_array(np.asarray(tree), encoding, buffers, field)
    raise InvalidArgumentError(f"cannot encode a {type(tree).__name__}", field=field or None)


def encode_body(payload: dict, encoding: str) -> tuple[bytes, str, dict[str, str]]:
    """Encode a request/response object -> ``(body, content_type, extra_headers)``.

    ``body`` is one ``bytes``: for "binary" it is built by a single ``b"".join`` over the
    padded header and memoryviews of the arrays, so each array is copied exactly once.
    ``extra_headers`` holds ``Dxserve-Header-Length`` for "binary", else is empty.
    """
    if encoding != "binary":
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}; use one of {ENCODINGS}")
        return dumps(from_tree(payload, encoding)), JSON_TYPE, {}
    parts, content_type, headers = encode_body_parts(payload, encoding)
    return b"".join(parts), content_type, headers


def encode_body_parts(payload: dict, encoding: str) -> tuple[list[Any], str, dict[str, str]]:
    """``encode_body`` without the final join: the body as consecutive parts.

    For "binary" the arrays' parts are byte memoryviews of the arrays themselves (not
    copied), so a server can write them to the socket one after another. (Joining them
    copies with the GIL held -- CPython's ``bytes.join`` lets go of it only when every
    part is ``bytes`` -- which stalls every other thread: ~20 ms for an 18 MB Jacobian.)
    For JSON, large arrays are serialized a block at a time (``dumps_parts``).
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; use one of {ENCODINGS}")
    if encoding != "binary":
        return dumps_parts(from_tree(payload, encoding)), JSON_TYPE, {}
    arrays: list[np.ndarray] = []
    key = _header_key(payload, arrays)
    header = _HEADERS.get(key) if key is not None else None
    if header is None:
        buffers = _Buffers()
        header = dumps(from_tree(payload, "binary", buffers))
        header += b" " * (-len(header) % ALIGN)
        arrays = buffers.items
        if key is not None and len(header) <= BinaryLayout.MAX_HEADER:
            _HEADERS.put(key, header)
    else:
        arrays = [_le_contig(a) for a in arrays]
    parts: list[Any] = [header]
    for a in arrays:
        if a.nbytes:
            parts.append(memoryview(array_bytes(a)))
            if a.nbytes % ALIGN:
                parts.append(padding(a.nbytes))
    return parts, BINARY_TYPE, {HEADER_LENGTH: str(len(header))}


_PADDING = [bytes(k) for k in range(ALIGN)]


def array_bytes(a: np.ndarray) -> np.ndarray:
    """``a`` as the binary encoding stores it: little-endian, C order (copied if needed)."""
    return _le_contig(a).reshape(-1).view(np.uint8)


def padding(nbytes: int) -> bytes:
    """The zero bytes that follow ``nbytes`` of array data in a binary body."""
    return _PADDING[-nbytes % ALIGN]


def _header_key(tree: Any, arrays: list[np.ndarray]) -> Any:
    """What a binary header depends on: the tree with each array reduced to its dtype
    and shape (the arrays are appended to ``arrays`` in ``from_tree``'s order), or None
    when the tree holds something else (floats, scalars, JAX arrays): not remembered."""
    kind = type(tree)
    if kind is np.ndarray:
        arrays.append(tree)
        return tree.dtype, tree.shape
    if kind is dict:
        items = []
        for k, v in tree.items():
            sub = _header_key(v, arrays)
            if sub is None:
                return None
            items.append((k, sub))
        return dict, tuple(items)
    if kind is list or kind is tuple:
        subs = tuple(_header_key(v, arrays) for v in tree)
        return None if None in subs else (list, subs)
    if kind is str or kind is int or kind is bool or tree is None:
        return kind, tree
    return None
