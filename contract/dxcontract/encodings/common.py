"""What every wire encoding shares: limits, dtype and shape checks, JSON text, tree walking.

Typed PRNG keys (``dxcontract.keys``) travel in every encoding as a typed array of dtype
``"key<IMPL>"``, shape the key array's, and the uint32 words as that encoding's data:
``typed_header`` reads their header (the data's dtype and shape), ``typed_value``
makes the ``KeyArray`` of their decoded words, and ``encode_tree`` writes a ``KeyArray``
(or a framework's key, through ``keys.read_key``) with ``encode_key``.

Depends only on numpy, ml_dtypes (bfloat16) and the stdlib (orjson and pysimdjson are
used when importable).
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import BFLOAT16
from ..errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    MalformedRequestError,
    ShapeMismatchError,
)
from ..keys import IMPLS, PREFIX, U32, KeyArray, impl_of, key_dtype, read_key
from . import flat_arrays
from .nodes import NODE_MARKER, NamedNode, named_fields

if TYPE_CHECKING:
    from .base import Encoding

try:
    import orjson
except ImportError:  # pragma: no cover - exercised only without orjson
    orjson = None

JSON_TYPE = "application/json"
MARKER = "__ndarray__"
#: pytree sequence nodes on the wire: ``{"__tuple__": [...]}`` and ``{"__list__": [...]}``
#: (a plain JSON list is always an array); each item is a pytree of its own
TUPLE_MARKER = "__tuple__"
LIST_MARKER = "__list__"
SEQUENCE_MARKERS: dict[str, type] = {TUPLE_MARKER: tuple, LIST_MARKER: list}
#: deepest pytree / list nesting accepted (binary headers: twice this, lists and dicts)
MAX_DEPTH = 32
#: most array elements one ``orjson`` call writes in ``dumps_parts`` (~1 ms of work)
JSON_CHUNK = 1 << 14
#: largest dimension, and largest product of the nonzero dimensions, of one decoded array.
#: A zero-size array holds no data whatever its other dimensions, so its shape is bounded
#: here, before numpy (whose sizes are int64) or XLA ever sees it.
MAX_ELEMENTS = 1 << 31
#: deepest nesting, and largest number, accepted in JSON that is not array data
#: (``loads_checked``: export manifests)
MAX_MANIFEST_DEPTH = 64

#: the wire dtypes of typed PRNG keys (``dxcontract.keys``)
KEY_DTYPES = tuple(key_dtype(impl) for impl in IMPLS)
ALLOWED_DTYPES = (
    "bfloat16", "float16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
)  # fmt: skip
#: name -> little-endian numpy dtype (bfloat16: ``ml_dtypes``', kind 'V', str '<V2')
LE = {
    name: (BFLOAT16 if name == "bfloat16" else np.dtype(name)).newbyteorder("<")
    for name in ALLOWED_DTYPES
}
#: dtype -> its name, for the allowed dtypes in native and little-endian order
NAMES = {**{dt.newbyteorder("="): n for n, dt in LE.items()}, **{dt: n for n, dt in LE.items()}}
#: JSON spellings of the non-finite floats
SPELLINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
TYPED_KEYS = frozenset((MARKER, "dtype", "shape"))
F64 = np.dtype(np.float64)


# --------------------------------------------------------------------------- JSON text


class RawString:
    """A JSON string value given as its ASCII text, with nothing in it to escape (base64).

    ``dumps_parts`` writes the text as a part of its own, never copied; ``dumps`` copies
    it into the one body. orjson would scan a ``str`` of 10 MB for characters to escape
    (~5 ms), and every extra buffer of that size is page faults of its own.
    """

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text


def _raw_string(value: Any) -> Any:
    if type(value) is RawString:
        if orjson is None:
            return value.text.decode("ascii")
        return orjson.Fragment(b"".join((b'"', value.text, b'"')))
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(tree: Any) -> bytes:
    """Serialize a ``from_tree`` result to strict JSON bytes (ndarrays allowed with orjson)."""
    if orjson is not None:
        return orjson.dumps(tree, default=_raw_string, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(
        tree, allow_nan=False, separators=(",", ":"), default=_raw_string
    ).encode()


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
    return _coalesce(out)


#: parts shorter than this are joined with their neighbours: each part is one write,
#: and a dozen 1-byte sends around one base64 string cost more than the string
PART_MIN_BYTES = 64 * 1024


def _coalesce(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    short: list[Any] = []
    for part in parts:
        if len(part) < PART_MIN_BYTES:
            short.append(part)
            continue
        if short:
            out.append(b"".join(short))
            short = []
        out.append(part)
    if short:
        out.append(b"".join(short))
    return out


def _dump_parts(obj: Any, out: list[bytes]) -> None:
    if type(obj) is RawString:
        out += (b'"', obj.text, b'"')
    elif isinstance(obj, np.ndarray) and obj.ndim >= 1 and obj.size > JSON_CHUNK:
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


#: JSON bodies from this size on have their long typed-array strings lifted out before
#: parsing (``loads_body``) ...
LIFT_MIN_BODY = 32 * 1024
#: ... each string at least this many characters long; a body with more than
#: ``LIFT_MAX_KEYS`` typed-array strings is parsed whole (each costs a step in Python)
LIFT_MIN_CHARS = 4096
LIFT_MAX_KEYS = 1024
#: the first typed-array string must open within this many bytes: a body of JSON lists
#: is not searched end to end for one (~5 ms over 20 MB) before being parsed
LIFT_PROBE_BYTES = 64 * 1024
#: a typed array's key and the quote opening its string value (JSON's four whitespace
#: characters allowed around the colon). Inside a JSON string every quote is escaped, so
#: this only ever matches a real ``__ndarray__`` key.
STRING_ARRAY = re.compile(rb'"__ndarray__"[ \t\n\r]*:[ \t\n\r]*"')
#: a lifted string's placeholder parses to a NUL (written as its JSON escape) and the
#: string's index among those lifted. A sender may write such a value too; ``_restore``
#: then finds an index twice, or one missing, and the body is parsed whole.
_LIFTED = "\x00"


def loads_body(
    data: bytes | bytearray | memoryview, field: str | None = None,
    arrays: tuple[str, ...] = (),
) -> Any:
    """``loads`` for a whole body, with typed base64 arrays left unparsed, and the
    top-level ``arrays`` keys' long lists of numbers parsed into float64 arrays.

    In a body of ``LIFT_MIN_BODY`` bytes or more, each string value of an ``__ndarray__``
    key that is at least ``LIFT_MIN_CHARS`` long and holds no escape comes back as a
    ``memoryview`` of its characters in ``data``, not as a ``str``: parsing an 8 MB
    base64 string into a ``str`` takes orjson ~5 ms, several times the base64 decode.
    The top-level value of a key in ``arrays`` that is a list of numbers (or of rows of
    numbers) of at least ``flat_arrays.MIN_CHARS`` characters comes back as the float64
    array ``to_tree`` would make of it (``flat_arrays``). Anything else (short strings,
    a body that doesn't fit the pattern) is parsed as ``loads`` would. The views keep
    ``data`` alive until they are dropped.
    """
    # from ~200 numbers on, simdjson and a short orjson parse beat one orjson parse
    if arrays and _liftable(data, flat_arrays.MIN_CHARS):
        lifted = flat_arrays.lift(data, arrays)
        if lifted is not None:
            text, found = lifted
            try:
                obj = _loads_with_strings(text, field)
            except MalformedRequestError:  # the error is the whole body's: said below
                obj = None
            if obj is not None and flat_arrays.restore(obj, found):
                return obj
    return _loads_with_strings(data, field)


def _loads_with_strings(data: bytes | bytearray | memoryview, field: str | None) -> Any:
    """``loads_body`` without lifting lists of numbers."""
    if not _liftable(data):
        return loads(data, field)
    lifted = _lift(data)
    if lifted is None:
        return loads(data, field)
    text, views = lifted
    try:
        obj = orjson.loads(text)
    except ValueError:  # the error is the whole body's: say it as ``loads`` does
        return loads(data, field)
    return obj if _restore(obj, views) else loads(data, field)


def _liftable(data: Any, min_body: int | None = None) -> bool:
    """Is ``data`` a body whose long base64 strings ``loads_body`` lifts out (at least
    ``min_body`` bytes, by default ``LIFT_MIN_BODY``)?"""
    least = LIFT_MIN_BODY if min_body is None else min_body
    return orjson is not None and len(data) >= least and isinstance(data, bytes | bytearray)


def _lift(data: bytes | bytearray) -> tuple[bytes, list[memoryview]] | None:
    """``data`` with each long ``__ndarray__`` string replaced by its placeholder, and the
    views of the strings replaced (in order); None when ``_long_strings`` finds none."""
    spans = _long_strings(data)
    if not spans:
        return None
    view = memoryview(data)
    parts: list[Any] = []
    at = 0
    for index, (start, end) in enumerate(spans):
        parts += (view[at:start], b"\\u0000%d" % index)
        at = end
    parts.append(view[at:])
    return b"".join(parts), [view[start:end] for start, end in spans]


def _long_strings(data: bytes | bytearray) -> list[tuple[int, int]] | None:
    """Where the long ``__ndarray__`` strings of ``data`` lie, ``(start, end)`` of their
    characters; None (nothing to lift: parse the body as it is) when the first one opens
    past ``LIFT_PROBE_BYTES``, when one holds an escape, or past ``LIFT_MAX_KEYS``
    typed-array strings."""
    spans: list[tuple[int, int]] = []
    match = STRING_ARRAY.search(data, 0, LIFT_PROBE_BYTES)
    for _ in range(LIFT_MAX_KEYS):
        if match is None:
            return spans
        start = match.end()
        end = data.find(b'"', start)
        if end < 0:
            return None  # unterminated: the parser says where
        if end - start >= LIFT_MIN_CHARS:
            if data.find(b"\\", start, end) >= 0:
                return None
            spans.append((start, end))
        match = STRING_ARRAY.search(data, end + 1)
    return None if match is not None else spans


def parsed_bytes(data: bytes | bytearray | memoryview) -> int:
    """How many bytes of ``data`` ``loads_body`` hands to the JSON parser (what is left
    once long base64 strings are lifted out): a measure of how long decoding takes."""
    if not _liftable(data):
        return len(data)
    spans = _long_strings(data)
    return len(data) - sum(end - start for start, end in spans or ())


def _restore(obj: Any, views: list[memoryview]) -> bool:
    """Put each lifted string's view back where its placeholder landed; False unless every
    placeholder turns up exactly once (then the body is parsed whole)."""
    used: set[int] = set()
    stack = [obj]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            value = node.get(MARKER)
            if type(value) is str and value.startswith(_LIFTED):
                digits = value[1:]
                ok = digits.isascii() and digits.isdigit() and len(digits) < 10
                index = int(digits) if ok else -1
                if not 0 <= index < len(views) or index in used:
                    return False
                used.add(index)
                node[MARKER] = views[index]
            stack.extend(node.values())
        elif type(node) is list and node and type(node[0]) in (dict, list):
            stack.extend(node)  # a list of numbers is array data: nothing to look at
    return len(used) == len(views)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_checked(data: bytes | str, max_depth: int = MAX_MANIFEST_DEPTH) -> Any:
    """Parse JSON that holds no array data (an export manifest): only finite numbers,
    objects and arrays nested at most ``max_depth`` deep. Raises ``ValueError``.

    Checked before anything walks the result recursively: ``NaN``, ``Infinity`` and
    overflowing literals (``1e999``) would become floats that ``int()`` cannot take,
    and deep nesting would exhaust the Python stack.
    """
    try:
        if orjson is not None:  # refuses NaN, Infinity and 1e999; its own depth limit
            value = orjson.loads(data)
        else:
            text = data if isinstance(data, str) else bytes(data).decode("utf-8")
            value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (TypeError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None
    # breadth-first, no recursion: the depth of the deepest object or array
    level, frontier = 0, [value]
    while frontier:
        frontier = [
            v
            for item in frontier
            if isinstance(item, dict | list)
            for v in (item.values() if isinstance(item, dict) else item)
            if isinstance(v, dict | list)
        ]
        level += 1
        if frontier and level >= max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return value


def json_kind(value: Any) -> str:
    """How an error message names a JSON value's type ("an array", "null", ...)."""
    if value is None:
        return "null"
    return {list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def json_float(x: float) -> float | str:
    """A Python float as JSON: itself, or the spelling of a non-finite value."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


# --------------------------------------------------------------------------- checks


def join(field: str, key: str) -> str:
    """The error path of ``key`` inside ``field`` ("x" + "w" -> "x.w")."""
    return f"{field}.{key}" if field else key


def dtype_of(name: Any, field: str) -> np.dtype:
    """A typed array's ``"dtype"`` -> the little-endian numpy dtype (allowed ones only)."""
    if not isinstance(name, str):
        raise MalformedRequestError(
            f"typed array: 'dtype' must be a string, got {type(name).__name__}", field=field
        )
    dt = LE.get(name)
    if dt is None:
        raise DtypeMismatchError(
            f"dtype {name!r} is not allowed; allowed: {', '.join(ALLOWED_DTYPES)} "
            f"(and {', '.join(map(repr, KEY_DTYPES))} for PRNG keys)",
            field=field,
        )
    return dt


def shape_of(shape: Any, field: str, max_depth: int) -> tuple[int, ...]:
    """A typed array's ``"shape"`` (a list of at most ``max_depth`` ints >= 0) -> tuple."""
    if not isinstance(shape, list):
        raise MalformedRequestError("typed array: 'shape' must be a list of ints", field=field)
    if len(shape) > max_depth:
        raise MalformedRequestError(
            f"typed array: shape has {len(shape)} dims, more than {max_depth}", field=field
        )
    nonzero = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise MalformedRequestError(
                f"typed array: shape entries must be non-negative ints, got {d!r}", field=field
            )
        if d:
            nonzero *= d
            if nonzero > MAX_ELEMENTS:  # checked per step: products of huge dims stay small
                raise MalformedRequestError(
                    f"typed array: shape {_short_shape(shape)} has dimensions whose product "
                    f"exceeds {MAX_ELEMENTS} elements (zero-size arrays included)",
                    field=field,
                )
    return tuple(shape)


def _short_shape(shape: list) -> str:
    """A shape for an error message, at most ~200 characters."""
    text = str(shape)
    return text if len(text) <= 200 else text[:197] + "..."


def typed_header(obj: dict, field: str, max_depth: int) -> tuple[np.dtype, tuple[int, ...]]:
    """Check a typed array object's keys; return the dtype and shape of its data.

    For a key dtype (``"key<threefry2x32>"``) that is uint32 and the key array's shape
    followed by the implementation's words (``(2,)``); DtypeMismatchError (422) for an
    implementation not in ``keys.IMPLS``. ``typed_value`` makes the key of the data.
    """
    if obj.keys() != TYPED_KEYS:
        raise MalformedRequestError(
            f"typed array must have exactly the keys {sorted(TYPED_KEYS)}, got {sorted(obj)}",
            field=field,
        )
    name = obj["dtype"]
    if type(name) is str and name.startswith(PREFIX):
        words = impl_of(name, field).words
        shape = shape_of(obj["shape"], field, max_depth - len(words))
        return U32, shape_of([*shape, *words], field, max_depth)  # bounds the words too
    return dtype_of(name, field), shape_of(obj["shape"], field, max_depth)


def typed_value(obj: dict, data: np.ndarray) -> Any:
    """A typed array's value from its decoded data (``typed_header``'s dtype and shape):
    ``data`` itself, or the ``KeyArray`` of a key dtype."""
    name = obj["dtype"]
    if type(name) is str and name.startswith(PREFIX):
        return KeyArray.trusted(name[len(PREFIX) : -1], data)
    return data


def key_data_error(name: str, shape: tuple[int, ...], got: str, field: str) -> Exception:
    """The 422 for key data that do not fit their header: ``shape`` is the data's
    (``typed_header``'s), ``got`` what was sent instead."""
    words = IMPLS[name[len(PREFIX) : -1]].words
    keys = list(shape[: len(shape) - len(words)])
    return ShapeMismatchError(
        f"{name} of shape {keys} needs {list(shape)} uint32 words as data "
        f"({prod(shape) * 4} bytes: jax.random.key_data(key) of the keys), got {got}",
        field=field,
    )


def prod(shape: tuple[int, ...]) -> int:
    """Number of elements of ``shape`` (a Python int: no overflow)."""
    n = 1
    for d in shape:
        n *= d
    return n


def wire_ready(a: np.ndarray) -> bool:
    """Are ``a``'s bytes already what the wire carries (C-contiguous, little-endian)?"""
    return a.flags.c_contiguous and a.dtype.byteorder != ">"


def le_contig(a: np.ndarray) -> np.ndarray:
    """C-contiguous little-endian copy-if-needed of ``a``."""
    if wire_ready(a):
        return a
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def check_dtype(a: np.ndarray, field: str) -> str:
    """The wire name of ``a``'s dtype; DtypeMismatchError (422) if it is not allowed."""
    # ``dtype.name`` is computed in Python by numpy (~3 us); the allowed native and
    # little-endian dtypes answer from a dict, which every small request feels.
    name = NAMES.get(a.dtype)
    if name is not None:
        return name
    name = a.dtype.name
    if name not in LE:
        raise DtypeMismatchError(
            f"dtype {a.dtype} is not allowed; allowed: {', '.join(ALLOWED_DTYPES)}", field=field
        )
    return name


# --------------------------------------------------------------------------- tree walking


class SeqNode:
    """A tuple or list node of a pytree, to be sent as its marker object
    (``{"__tuple__": [...]}`` / ``{"__list__": [...]}``) by ``encode_tree``.

    Plain lists and tuples in a payload are JSON lists (arrays, batches of tangents);
    ``mark_sequences`` and ``pytree_to_wire`` wrap the pytree nodes in this.
    """

    __slots__ = ("items", "marker")

    def __init__(self, marker: str, items: list) -> None:
        self.marker = marker
        self.items = items

    def __repr__(self) -> str:
        return f"SeqNode({self.marker!r}, {self.items!r})"


_NUMBERS = (int, float, np.number, np.bool_)


def is_array_list(value: list) -> bool:
    """Is a Python list an array (numbers, nested lists of numbers) rather than a
    list node of a pytree (arrays, dicts, tuples, None...)? Decided by its first leaf
    (``[]`` is an empty array), so it costs O(depth); a list mixing both fails later
    in ``np.asarray``, loudly."""
    v: Any = value
    while type(v) is list:
        if not v:
            return True
        v = v[0]
    return isinstance(v, _NUMBERS)


def mark_sequences(tree: Any) -> Any:
    """A pytree of arrays with its tuple and list nodes as ``SeqNode``s (``tree`` itself
    when it has none). Sparse result objects (a ``"format"`` string) pass as they are."""
    kind = type(tree)
    if kind is np.ndarray:
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # its type's name and fields
        name, fields, items = named_fields(tree, keep=False)
        return NamedNode(name, fields, [mark_sequences(v) for v in items])
    if isinstance(tree, tuple | list):
        marker = LIST_MARKER if isinstance(tree, list) else TUPLE_MARKER
        return SeqNode(marker, [mark_sequences(v) for v in tree])
    if isinstance(tree, dict) and not isinstance(tree.get("format"), str):
        out = {k: mark_sequences(v) for k, v in tree.items()}
        return out if any(out[k] is not v for k, v in tree.items()) else tree
    return tree


def pytree_to_wire(value: Any) -> Any:
    """A caller's input -> what ``encode_tree`` sends: Python numbers and lists of numbers
    become float64 arrays, other lists and tuples ``SeqNode``s, dicts stay dicts, JAX
    arrays and numpy scalars become ndarrays, None stays (a pytree node JAX allows)."""
    if isinstance(value, dict):
        return {k: pytree_to_wire(v) for k, v in value.items()}
    if isinstance(value, list) and not is_array_list(value):
        return SeqNode(LIST_MARKER, [pytree_to_wire(v) for v in value])
    if isinstance(value, tuple):
        named = named_fields(value) if hasattr(value, "_fields") else None
        if named is not None:  # a NamedTuple: its name and fields travel too
            return NamedNode(named[0], named[1], [pytree_to_wire(v) for v in named[2]])
        return SeqNode(TUPLE_MARKER, [pytree_to_wire(v) for v in value])
    if isinstance(value, (list, int, float)) and not isinstance(value, bool):
        return np.asarray(value, dtype=np.float64)
    if is_torch_tensor(value):
        return torch_to_numpy(value)
    if hasattr(value, "__array__") and not isinstance(value, np.ndarray):
        key = read_key(value)  # a typed PRNG key: its impl and words (``dxcontract.keys``)
        return np.asarray(value) if key is None else key  # JAX arrays, numpy scalars
    named = named_fields(value)  # a registered dataclass JAX knows (flax.struct, equinox)
    if named is not None:
        return NamedNode(named[0], named[1], [pytree_to_wire(v) for v in named[2]])
    return value



def is_torch_tensor(value: Any) -> bool:
    """Is ``value`` a torch tensor (``nn.Parameter`` too)? Told from its type's module,
    so that nothing here imports torch."""
    module = type(value).__module__
    return (module == "torch" or module.startswith("torch.")) and hasattr(value, "detach")


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor as numpy reads it: detached from autograd, copied to the host if it
    is on a GPU, a lazy conjugate or negation applied (``z.conj()``, ``z.conj().imag``),
    bfloat16 as ``ml_dtypes``' (numpy has none). torch is imported already: the caller
    made the tensor."""
    torch = sys.modules["torch"]
    host = tensor.detach().cpu().resolve_conj().resolve_neg()
    if host.dtype == torch.bfloat16:
        return host.view(torch.uint16).numpy().view(BFLOAT16)
    return host.numpy()


def is_arraylike(x: Any) -> bool:
    """numpy arrays and scalars, and anything else with ``__array__`` (JAX arrays)."""
    return isinstance(x, np.ndarray | np.generic) or (
        hasattr(x, "__array__") and not isinstance(x, str | bytes | dict | list | tuple)
    )


def encode_tree(tree: Any, encoding: Encoding, buffers: Any, field: str) -> Any:
    """Arrays (anything with ``__array__``), dicts of them, tuples/lists of them -> their
    wire form, each array given by ``encoding.encode_array(array, buffers, field)``; other
    JSON values pass through (non-finite Python floats become their string spellings)."""
    if isinstance(tree, dict):
        out = {}
        for key, v in tree.items():
            if not isinstance(key, str) or key.startswith("__"):
                raise InvalidArgumentError(
                    f"key {key!r} cannot be sent (keys starting with '__' are reserved)",
                    field=join(field, str(key)),
                )
            if type(v) is np.ndarray:  # the common case: a result or an input array
                out[key] = encoding.encode_array(v, buffers, join(field, key))
            else:
                out[key] = encode_tree(v, encoding, buffers, join(field, key))
        return out
    if isinstance(tree, list | tuple):
        return [encode_tree(v, encoding, buffers, f"{field}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, float):
        return json_float(tree)
    if tree is None or isinstance(tree, str | int):
        return tree
    if type(tree) is KeyArray:
        return encode_key(tree, encoding, buffers, field)
    if is_arraylike(tree):
        key = read_key(tree, field)
        if key is not None:
            return encode_key(key, encoding, buffers, field)
        return encoding.encode_array(np.asarray(tree), buffers, field)
    if type(tree) is SeqNode:  # a tuple/list node of a pytree: its marker object
        return {
            tree.marker: [
                encode_tree(v, encoding, buffers, f"{field}[{i}]") for i, v in enumerate(tree.items)
            ]
        }
    if type(tree) is NamedNode:  # a node with named fields: its type's name and its fields
        return {NODE_MARKER: {"type": tree.name, "fields": {
            k: encode_tree(v, encoding, buffers, join(field, k))
            for k, v in zip(tree.fields, tree.items, strict=True)
        }}}
    raise InvalidArgumentError(f"cannot encode a {type(tree).__name__}", field=field or None)


def encode_key(key: KeyArray, encoding: Encoding, buffers: Any, field: str) -> Any:
    """A key array's wire form: its words as ``encoding`` writes a uint32 array, with
    the typed array's ``dtype`` the key's (``"key<threefry2x32>"``) and ``shape`` the key
    array's. An encoding may write keys its own way with an ``encode_key`` method."""
    own = getattr(encoding, "encode_key", None)
    if own is not None:
        return own(key, buffers, field)
    wire = encoding.encode_array(key.data, buffers, field)
    if not (isinstance(wire, dict) and MARKER in wire):
        raise InvalidArgumentError(
            f"the {encoding.name!r} encoding writes no typed arrays, so it cannot carry "
            "PRNG keys; use 'json', 'b64' or 'binary'",
            field=field or None,
        )
    wire["dtype"] = key.dtype
    wire["shape"] = list(key.shape)
    return wire


class JsonBody:
    """Encoding and decoding of a JSON body, for encodings whose arrays are inline.

    A subclass gives ``name``, ``media_type`` and ``encode_array``; arrays in a decoded
    body stay in their JSON form for ``to_tree``.
    """

    name: str
    media_type: str = JSON_TYPE

    def encode_array(self, a: np.ndarray, buffers: Any, field: str) -> Any:  # pragma: no cover
        raise NotImplementedError

    def encode_body(self, payload: dict) -> tuple[bytes, str, dict[str, str]]:
        """``payload`` -> ``(one JSON body, media type, {})``."""
        return dumps(encode_tree(payload, self, None, "")), self.media_type, {}

    def encode_body_parts(self, payload: dict) -> tuple[list[Any], str, dict[str, str]]:
        """``encode_body`` with large arrays written a block at a time (``dumps_parts``)."""
        return dumps_parts(encode_tree(payload, self, None, "")), self.media_type, {}

    def decode_body(
        self, body: bytes | bytearray | memoryview, header_length: str | None,
        max_header_bytes: int,
    ) -> tuple[dict, None]:
        """A JSON body -> ``(its top-level object, None)``; arrays stay in their JSON form
        (lists, typed objects) for ``to_tree``."""
        return decode_json_body(body), None


def decode_json_body(
    body: bytes | bytearray | memoryview, arrays: tuple[str, ...] = ()
) -> dict:
    """``JsonBody.decode_body``'s object; a long list of numbers (or of rows of numbers)
    under a top-level key in ``arrays`` (keys the caller reads as float64 arrays) may
    come back as that array (``loads_body``)."""
    obj = loads_body(body, field="body", arrays=arrays)
    if not isinstance(obj, dict):
        raise MalformedRequestError(
            f"the body must be a JSON object, got {json_kind(obj)}", field="body"
        )
    return obj
