"""The "json" encoding: float64 arrays as plain JSON numbers and nested lists.

Every other dtype is a typed object ``{"__ndarray__": <number|nested list>, "dtype":
"float32", "shape": [2]}``. Non-finite floats are the strings ``"NaN"``, ``"Infinity"``,
``"-Infinity"``. Bool data are JSON ``true``/``false``. Complex data are nested
``[re, im]`` pairs (the list has one extra trailing axis of length 2). A float64 array
whose shape has a 0 before its last axis (e.g. ``(0, 3)``) is sent as a typed object,
because a bare nested list cannot carry that shape. A typed PRNG key is a typed object
of dtype ``"key<IMPL>"``, shape the key array's and its uint32 words as (nested) list
data, shape ``shape + words``: ``{"__ndarray__": [0, 0], "dtype": "key<threefry2x32>",
"shape": []}`` (``dxcontract.keys``; base64 data are read too).

Reading arrays back is ``to_tree``: it turns any decoded JSON value into arrays, lists
and typed objects of every inline form (list data, base64), and passes the numpy views
of a binary body through.
"""

from __future__ import annotations

from math import isfinite
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import DtypeMismatchError, InvalidArgumentError, MalformedRequestError
from ..keys import PREFIX, U32, KeyArray
from . import common
from .binary import BINARY_TYPE, HEADER_LENGTH
from .common import (
    F64,
    JSON_TYPE,
    MARKER,
    MAX_DEPTH,
    SEQUENCE_MARKERS,
    SPELLINGS,
    JsonBody,
    check_dtype,
    join,
    json_float,
    json_kind,
    key_data_error,
    prod,
    typed_header,
    typed_value,
)
from .nodes import NODE_MARKER, build, read_node
from .typed_b64 import from_b64


class JsonLists(JsonBody):
    """float64 arrays as JSON numbers / nested lists, other dtypes as typed objects."""

    name = "json"
    media_type = JSON_TYPE
    accept_param = "arrays=lists"

    def encode_array(self, a: np.ndarray, buffers: Any, field: str) -> Any:
        """An array -> nested lists (float64), else ``{"__ndarray__": data, "dtype",
        "shape"}`` with list data; with orjson the data may be a C-contiguous ndarray."""
        name = check_dtype(a, field)
        shape = list(a.shape)
        kind = dtypes.kind(a.dtype)
        if kind == "f":  # float16/32 and bfloat16 widen exactly: their values are written
            if a.dtype.kind == "V":  # ml_dtypes warns of signalling NaNs: NaN all the same
                with np.errstate(invalid="ignore"):
                    a = a.astype(np.float64)
            data = _json_floats(a.astype(np.float64, copy=False))
            if name == "float64" and 0 not in shape[:-1]:
                return data
        elif kind == "c":
            data = _json_floats(np.stack([a.real, a.imag], axis=-1).astype(np.float64))
        elif a.ndim == 0:
            data = a.item()
        elif common.orjson is not None:
            data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
        else:
            data = a.tolist()
        return {MARKER: data, "dtype": name, "shape": shape}


#: up to this length, a 1-d float64 array is checked for finite values as a list
_SMALL_FLOATS = 64


def _json_floats(a: np.ndarray) -> Any:
    """float64 array -> JSON-able data (ndarray for orjson, else nested lists)."""
    if a.ndim == 0:
        return json_float(float(a))
    if a.ndim == 1 and len(a) <= _SMALL_FLOATS:
        # a finite sum means finite values (one that overflows is checked below): a
        # quicker test than np.isfinite for a few numbers, and the same JSON
        data = a.tolist()
        if isfinite(sum(data)):
            return data
    if np.isfinite(a).all():
        return np.ascontiguousarray(a) if common.orjson is not None else a.tolist()
    obj = a.astype(object)
    obj[np.isnan(a)] = "NaN"
    obj[a == np.inf] = "Infinity"
    obj[a == -np.inf] = "-Infinity"
    return obj.tolist()


# --------------------------------------------------------------------------- reading


def to_tree(
    value: Any,
    field: str,
    *,
    default_dtype: Any = np.float64,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """Turn one decoded JSON value into an ndarray or a pytree of ndarrays.

    Numbers and (nested) lists become ``default_dtype`` arrays (0-d for numbers);
    typed objects keep their dtype and shape; ndarrays (binary views) pass through;
    typed PRNG keys become ``KeyArray``s (``dxcontract.keys``). Objects are dicts,
    ``{"__tuple__": [...]}`` / ``{"__list__": [...]}`` tuples / lists of pytrees;
    ``null`` inside a pytree is a None node.
    Errors: MalformedRequestError (400) / DtypeMismatchError (422) with ``field`` a path
    like ``"x[2][1]"`` or ``"contexts[0].w"``.
    """
    if type(value) is list and default_dtype is np.float64:  # the common case, directly
        return _data_to_array(value, field, F64, max_depth)
    return _to_tree(value, field, np.dtype(default_dtype), max_depth, 0)


def _to_tree(value: Any, field: str, dt: np.dtype, max_depth: int, depth: int) -> Any:
    if depth > max_depth:
        raise MalformedRequestError(f"pytree nested deeper than {max_depth}", field=field)
    if isinstance(value, np.ndarray):
        check_dtype(value, field)
        return value
    if type(value) is KeyArray:  # a key of a binary body: checked there
        return value
    if isinstance(value, dict):
        if MARKER in value:
            return _typed(value, field, max_depth)
        out = {}
        for key, v in value.items():
            if not isinstance(key, str) or key.startswith("__"):
                if key in SEQUENCE_MARKERS:  # checked only here: plain dicts pay nothing
                    return _sequence(value, key, field, dt, max_depth, depth)
                if key == NODE_MARKER:  # a node with named fields
                    name, names, items = read_node(value, field)
                    return build(name, names, [
                        _to_tree(v, join(field, k), dt, max_depth, depth + 1)
                        for k, v in zip(names, items, strict=True)
                    ])
                if isinstance(key, str) and len(key) > 4 and key.endswith("__"):
                    raise InvalidArgumentError(  # a marker of a node type we do not know
                        f"unknown pytree node type {key[:40]!r}; nodes are objects (dicts), "
                        f"{', '.join(SEQUENCE_MARKERS)}, {NODE_MARKER} (named fields) and "
                        f"{MARKER} (typed arrays)",
                        field=join(field, key[:40]),
                    )
                raise MalformedRequestError(
                    f"pytree key {key!r} is reserved (keys starting with '__' are not allowed; "
                    f"{', '.join(SEQUENCE_MARKERS)} mark sequence nodes, {MARKER} arrays)",
                    field=join(field, str(key)),
                )
            out[key] = _to_tree(v, join(field, key), dt, max_depth, depth + 1)
        return out
    if value is None and depth:  # a None node inside a pytree, as JAX allows
        return None
    return _data_to_array(value, field, dt, max_depth - depth)


def _sequence(
    value: dict, key: str, field: str, dt: np.dtype, max_depth: int, depth: int
) -> tuple | list:
    """``{"__tuple__": [...]}`` / ``{"__list__": [...]}`` -> a tuple / list pytree node."""
    items = value[key]
    if len(value) != 1 or type(items) is not list:
        raise MalformedRequestError(
            f"a sequence node must be exactly {{{key!r}: [item, ...]}} (each item a pytree), "
            f"got keys {sorted(map(str, value))} and "
            f"{'an object' if isinstance(items, dict) else json_kind(items)}",
            field=field,
        )
    out = [_to_tree(v, f"{field}[{i}]", dt, max_depth, depth + 1) for i, v in enumerate(items)]
    return out if SEQUENCE_MARKERS[key] is list else tuple(out)


def _typed(obj: dict, field: str, max_depth: int) -> Any:
    dt, shape = typed_header(obj, field, max_depth)
    data = obj[MARKER]
    if isinstance(data, dict):
        raise MalformedRequestError(
            "buffer reference outside a binary body (Content-Type "
            f"{BINARY_TYPE} with {HEADER_LENGTH} needed)",
            field=field,
        )
    name = obj["dtype"]
    if name.startswith(PREFIX):
        return typed_value(obj, _key_words(name, data, shape, field, max_depth))
    if type(data) is memoryview:  # base64 left unparsed in a large body (``loads_body``)
        return from_b64(data, dt, shape, field)
    if isinstance(data, str) and not (
        shape == () and dtypes.kind(dt) == "f" and data in SPELLINGS
    ):
        return from_b64(data, dt, shape, field)
    # JSON data
    if dt.kind == "c":
        pairs = _data_to_array(data, field, F64, max_depth + 1, complex_pairs=True)
        _check_shape(pairs.shape, (*shape, 2), field)
        pairs = pairs.reshape((*shape, 2))
        out = np.empty(shape, dtype=np.complex128)
        out.real = pairs[..., 0]
        out.imag = pairs[..., 1]
        return out.astype(dt)
    a = _data_to_array(data, field, dt, max_depth)
    _check_shape(a.shape, shape, field)
    return a.reshape(shape)


def _key_words(
    name: str, data: Any, shape: tuple[int, ...], field: str, max_depth: int
) -> np.ndarray:
    """A key's data (base64 or nested lists of uint32 words) -> its uint32 array of
    ``shape`` (the key array's shape + the words); 422 for data that do not fit."""
    if type(data) is memoryview or isinstance(data, str):
        chars = 4 * ((prod(shape) * 4 + 2) // 3)
        if len(data) != chars:
            raise key_data_error(name, shape, f"{len(data)} base64 characters, not {chars}", field)
        return from_b64(data, U32, shape, field)
    try:
        a = _data_to_array(data, field, U32, max_depth)
    except MalformedRequestError as exc:
        raise DtypeMismatchError(
            f"{name} data must be uint32 words, integers 0 to 4294967295 "
            f"(jax.random.key_data(key)): {exc.detail}",
            field=exc.field,
        ) from None
    if a.shape != shape and not (0 in shape and a.shape == shape[: shape.index(0) + 1]):
        raise key_data_error(name, shape, f"data of shape {list(a.shape)}", field)
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


def _data_to_array(
    value: Any, field: str, dt: np.dtype, max_depth: int, complex_pairs: bool = False
) -> np.ndarray:
    """JSON number / nested list / spelling string -> ndarray of dtype ``dt``."""
    kind = dtypes.kind(dt)
    if kind == "c" and not complex_pairs:
        # plain numbers for a complex default: real values
        return _data_to_array(value, field, F64, max_depth).astype(dt)
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
        if kind == "f" and value in SPELLINGS:
            return _cast_float(np.asarray(SPELLINGS[value]), dt, field)
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
                if ndim == 1 and len(value) >= _FROMITER_MIN:
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


#: from this length on, fromiter turns a flat list into float64 quicker than np.array
_FROMITER_MIN = 100

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
    kind = dtypes.kind(dt)
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
            if x in SPELLINGS:
                return append(SPELLINGS[x])
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
            row = [SPELLINGS.get(y, y) if type(y) is str else y for y in x] if kind == "f" else x
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
