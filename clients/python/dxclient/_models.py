"""The request model shared by ``Client`` and ``AsyncClient``.

Both build the same ``Call`` (path, body, headers) and parse answers with the same
functions; they differ only in how bytes travel.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from dxcontract import codec
from dxcontract.arguments import check_wrt
from dxcontract.backends import Backend, backend_to_json
from dxcontract.encodings.common import pytree_to_wire
from dxcontract.errors import DxError, MalformedRequestError
from dxcontract.lru import LRU
from dxcontract.operators import (
    AUX,
    BATCH_RESULTS,
    HOLOMORPHIC_FAMILIES,
    OPERATORS,
    OperatorSpec,
    result_names,
    returned,
)

from . import keys, sparse


@dataclass(frozen=True)
class RemoteFunction:
    """A function registered on the server, by name (``client.function(name)``)."""

    name: str
    kind: str | None = None
    description: str = ""
    signature: dict = field(default_factory=dict, compare=False)
    #: each argument's ``name``, ``role`` (x or context) and, where the server knows
    #: them, ``shape`` and ``dtype`` (``tree`` for a pytree)
    arguments: list = field(default_factory=list, compare=False)
    #: the operators the server says these shapes allow
    operators: list = field(default_factory=list, compare=False)
    #: a request the function answers, ``{"path", "body"}``, or None
    example: dict | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RemotePrep:
    """A handle from ``prepare_<op>``; pass it as ``prep=`` to the same operator."""

    handle: str
    operator: str
    function: str
    backend: dict
    resolved: dict
    #: for a sparse backend: the pattern's ``shape``, ``nnz``, ``colors``, ``coloring``
    #: and ``mode`` the server found at preparation (None otherwise)
    sparsity: dict | None = field(default=None, compare=False)
    #: the ``POST /prepare/<op>`` call this handle came from: the client sends it again
    #: when the server no longer holds the handle (evicted, or the server restarted)
    request: Call | None = field(default=None, compare=False, repr=False)
    #: for ``auto``: why the server chose ``resolved`` (its rule, or the modes that do
    #: not trace for this function and the one used instead); None otherwise
    reason: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]


class PartsCall(Call):
    """A call whose body is consecutive bytes-like ``parts`` (a binary header, then the
    arrays' own memory; or JSON text around base64 strings), so a transport can write
    them one after another with no joined copy; ``body`` joins them only when read
    (once). Made only for calls sent at once (never kept, as a prep's request is: its
    parts would follow later changes to x)."""

    parts: tuple[Any, ...]
    size: int

    def __init__(self, method: str, path: str, parts: Any, headers: dict[str, str]) -> None:
        views = tuple(p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts)
        for name, value in (("method", method), ("path", path), ("headers", headers),
                            ("parts", views), ("size", sum(len(v) for v in views))):
            object.__setattr__(self, name, value)

    @property
    def body(self) -> bytes:  # type: ignore[override]
        joined = self.__dict__.get("_body")
        if joined is None:
            joined = self.__dict__["_body"] = b"".join(self.parts)
        return joined


#: request bodies from this size on are sent as parts (``PartsCall``)
PARTS_MIN_BYTES = 64 * 1024
#: encodings whose large arrays are parts of their own in ``codec.encode_body_parts``
_PARTS_ENCODINGS = frozenset(("binary", "b64"))


def function_name(f: RemoteFunction | str) -> str:
    if isinstance(f, RemoteFunction):
        return f.name
    if isinstance(f, str):
        return f
    raise TypeError(
        f"f must be a function name or client.function(name), got {type(f).__name__}; "
        "register Python functions first with client.register(fn, example_x)"
    )


def to_wire_tree(value: Any) -> Any:
    """numpy in: numbers and lists of numbers become float64 arrays, dicts stay pytrees,
    tuples and other lists become sequence nodes (``encodings.common.pytree_to_wire``)."""
    if type(value) is np.ndarray:
        return value
    return pytree_to_wire(value)


def operator_spec(operator: str) -> OperatorSpec:
    return OPERATORS[operator]


def operator_call(
    operator: str,
    f: RemoteFunction | str,
    backend: Backend | str,
    x: Any,
    tangents: Any,
    contexts: tuple,
    prep: RemotePrep | None,
    encoding: str,
    *,
    prepare: bool = False,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
    cotangent: Any = None,
) -> Call:
    """The request of ``operator`` (``batch_axis=0``: x and the tangents lead with an
    axis of points; sent as ``"batch_axis": 0``, left out when None; ``has_aux``: sent as
    ``"has_aux": true``, left out when False; ``holomorphic`` likewise; ``wrt``: the
    arguments differentiated, sent as a number or a list, left out when None;
    ``cotangent``: the HVP family's, for an array-valued function, left out when None)."""
    wrt = check_wrt(wrt, 1 + len(contexts))
    plain = wrt is None and cotangent is None  # the kind of call that repeats
    repeat = None if not plain else _REPEATS.key(
        operator, f, backend, x, tangents, contexts, prep, encoding, prepare, batch_axis,
        has_aux, holomorphic,
    )
    if repeat is not None:
        call = _REPEATS.call(repeat, x)
        if call is not None:
            return call
    elif encoding in _INLINE_ENCODINGS and plain:
        inline = _INLINE_REPEATS.key(
            operator, f, backend, x, tangents, contexts, prep, prepare, batch_axis, encoding,
            has_aux, holomorphic,
        )
        if inline is not None:
            return _INLINE_REPEATS.call(inline, x, encoding, lambda p: operator_call(
                operator, f, backend, p, None, (), None, encoding, prepare=prepare,
                batch_axis=batch_axis, has_aux=has_aux, holomorphic=holomorphic))
    op = operator_spec(operator)
    payload: dict[str, Any] = {
        "function": function_name(f),
        "backend": backend_to_json(backend),
        "x": to_wire_tree(x),
    }
    if op.takes_tangents:
        if not isinstance(tangents, (tuple, list)):
            raise TypeError(f"{op.name} takes a tuple of tangents, e.g. (t,)")
        payload["tangents"] = [to_wire_tree(t) for t in tangents]
    if contexts:
        payload["contexts"] = [to_wire_tree(c) for c in contexts]
    if prep is not None:
        if prep.operator != op.name and OPERATORS[prep.operator].family != op.family:
            raise ValueError(f"prep was made for {prep.operator}, not {op.name}")
        payload["prep"] = prep.handle
    if batch_axis is not None:
        payload["batch_axis"] = batch_axis
    if has_aux:
        if not op.aux:
            raise ValueError(f"{op.name} takes no has_aux")
        payload["has_aux"] = True
    if holomorphic:
        if op.family not in HOLOMORPHIC_FAMILIES:
            raise ValueError(f"{op.name} takes no holomorphic")
        payload["holomorphic"] = True
    if wrt is not None:
        payload["wrt"] = wrt if isinstance(wrt, int) else list(wrt)
    if cotangent is not None:
        if op.family != "hvp":
            raise ValueError(f"{op.name} takes no cotangent (hvp and gradient_and_hvp do)")
        payload["cotangent"] = to_wire_tree(cotangent)
    if encoding in _PARTS_ENCODINGS and not prepare:
        # sent at once: the arrays' memory (binary) or base64 text (b64) as it is
        parts, content_type, headers = codec.encode_body_parts(payload, encoding)
        body: Any = parts
    else:
        body, content_type, headers = codec.encode_body(payload, encoding)
    headers = {"content-type": content_type, **headers}
    if encoding == "binary":
        headers["accept"] = codec.BINARY_TYPE
    path = f"/prepare/{op.name}" if prepare else f"/{op.name}"
    if type(body) is list:
        size = sum(len(memoryview(p).cast("B")) for p in body)
        call = (PartsCall("POST", path, body, headers) if size >= PARTS_MIN_BYTES
                else Call("POST", path, b"".join(body), headers))
    else:
        call = Call("POST", path, body, headers)
    if repeat is not None:
        _REPEATS.remember(repeat, call)
    return call


class _RepeatCalls:
    """Binary calls that repeat all but x's data, and the header they send.

    An optimizer calls one operator of one function with one backend and one shape
    over and over; only x's bytes change. Such a call (x a numpy array, no tangents,
    contexts or prep) is encoded in full once; the next ones reuse its header (the
    same bytes ``codec.encode_body`` would write) and append x's data.
    """

    MAX_ENTRIES = 256

    def __init__(self) -> None:
        self._calls: LRU[tuple, Call] = LRU(self.MAX_ENTRIES)

    def key(
        self, operator: str, f: Any, backend: Any, x: Any, tangents: Any, contexts: tuple,
        prep: RemotePrep | None, encoding: str, prepare: bool, batch_axis: int | None = None,
        has_aux: bool = False, holomorphic: bool = False,
    ) -> tuple | None:
        """The call's key if it is the repeating kind, else None (a batch of points, or
        has_aux, is keyed apart: its header says so, and x's shape alone cannot tell)."""
        if (
            encoding != "binary" or type(x) is not np.ndarray or tangents is not None
            or contexts or prep is not None or type(f) is not str
            or not isinstance(backend, str | Backend)
        ):
            return None
        return operator, prepare, f, backend, x.dtype, x.shape, batch_axis, has_aux, holomorphic

    def call(self, key: tuple, x: np.ndarray) -> Call | None:
        known = self._calls.get(key)
        if known is None:
            return None
        data = memoryview(codec.array_bytes(x))
        parts = (known.body, data, codec.padding(len(data)))
        if len(data) >= PARTS_MIN_BYTES and not key[1]:  # key[1]: a prepare call, kept
            return PartsCall(known.method, known.path, parts, known.headers)
        return Call(known.method, known.path, b"".join(parts), known.headers)

    def remember(self, key: tuple, call: Call) -> None:
        """Keep ``call``'s header (``key`` from ``self.key``)."""
        n = int(call.headers[codec.HEADER_LENGTH])
        header = call.parts[0] if isinstance(call, PartsCall) else call.body[:n]
        assert len(header) == n
        self._calls.put(key, Call(call.method, call.path, header, call.headers))


_REPEATS = _RepeatCalls()

_INLINE_ENCODINGS = frozenset(("json", "b64"))
#: stands in for x while the rest of a JSON body is encoded once (never sent)
_X_PLACEHOLDER = "\u0000dxclient-x\u0000"


class _InlineRepeats:
    """JSON-encoded ("json", "b64") calls that repeat all but x: the body text around
    x is kept, and only x is encoded each time (``encode_array``, then ``dumps``: the
    same bytes ``encode_tree`` would put there, as JSON text concatenates).

    The same kind of call as ``_RepeatCalls`` (x a numpy array; no tangents, contexts
    or prep); a repeated small call then costs one array's encoding.
    """

    MAX_ENTRIES = 256

    def __init__(self) -> None:
        self._parts: LRU[tuple, tuple[str, str, bytes, bytes, dict]] = LRU(self.MAX_ENTRIES)

    def key(
        self, operator: str, f: Any, backend: Any, x: Any, tangents: Any, contexts: tuple,
        prep: Any, prepare: bool, batch_axis: int | None, encoding: str, has_aux: bool = False,
        holomorphic: bool = False,
    ) -> tuple | None:
        if (
            type(x) is not np.ndarray or tangents is not None or contexts or prep is not None
            or type(f) is not str or not isinstance(backend, str | Backend)
        ):
            return None
        return operator, prepare, f, backend, batch_axis, encoding, has_aux, holomorphic

    def call(self, key: tuple, x: np.ndarray, encoding: str, build: Any) -> Call:
        """The call for ``x``; ``build(placeholder)`` makes the surrounding text once."""
        known = self._parts.get(key)
        if known is None:
            template = build(_X_PLACEHOLDER)
            marker = codec.dumps(_X_PLACEHOLDER)
            head, sep, tail = template.body.partition(marker)
            if not sep or marker in tail:  # pragma: no cover - a name holding the marker
                return build(x)
            known = (template.method, template.path, head, tail, template.headers)
            self._parts.put(key, known)
        method, path, head, tail, headers = known
        wire = codec.ENCODINGS[encoding].encode_array(x, None, "x")
        if x.nbytes >= PARTS_MIN_BYTES and encoding in _PARTS_ENCODINGS and not key[1]:
            return PartsCall(method, path, (head, *codec.dumps_parts(wire), tail), headers)
        return Call(method, path, b"".join((head, codec.dumps(wire), tail)), headers)


_INLINE_REPEATS = _InlineRepeats()


def raise_for_problem(status: int, headers: Any, content: bytes) -> None:
    if status < 400:
        return
    try:
        problem = codec.loads(content)
    except DxError:
        problem = None
    if not isinstance(problem, dict):
        text = content[:200].decode("utf-8", "replace")
        problem = {"detail": f"HTTP {status}: {text}"}
    raise DxError.from_problem(status, problem)


def operator_result(operator: str, headers: Any, content: bytes, has_aux: bool = False) -> Any:
    """Decode an operator's answer to numpy: one result, or a tuple (DI's order); with
    ``has_aux`` JAX's shapes (``dxcontract.operators.returned``), aux from ``"aux"``.
    Typed PRNG keys in it come back as keys (``keys.from_wire``)."""
    op = operator_spec(operator)
    arrays, batches = _result_kinds(op, has_aux)
    content_type, header_length = _wire_headers(headers)
    obj = codec.decode_body(content, content_type, header_length, arrays=arrays)
    for key in arrays:
        if key in obj:
            value = obj[key]
            obj[key] = (
                sparse.from_wire(value, key) if key != AUX and sparse.is_sparse(value)
                else keys.from_wire(codec.decode_result(value, key, False))
            )
    for key in batches:
        if key in obj:
            obj[key] = keys.from_wire(codec.decode_result(obj[key], key, True))
    names = result_names(op, has_aux)
    if has_aux and AUX not in obj:
        raise MalformedRequestError(
            f"the server's {op.name} answer has no aux: it may predate has_aux", field=AUX
        )
    values = tuple(tuple(obj[r]) if r in BATCH_RESULTS else obj[r] for r in names)
    return returned(op, values, has_aux)


@functools.cache
def _result_kinds(op: OperatorSpec, has_aux: bool = False) -> tuple[tuple[str, ...], frozenset[str]]:
    """``op``'s results that are one array (or pytree) each, aux among them with
    ``has_aux``, and those that are a batch of them."""
    names = result_names(op, has_aux)
    return tuple(r for r in names if r not in op.batch_results), op.batch_results


_CONTENT_TYPE, _HEADER_LENGTH = b"content-type", codec.HEADER_LENGTH.lower().encode()


def _wire_headers(headers: Any) -> tuple[str | None, str | None]:
    """``(Content-Type, Dxserve-Header-Length)``; httpx headers read in one pass."""
    if not isinstance(headers, httpx.Headers):
        return headers.get("content-type"), headers.get(codec.HEADER_LENGTH)
    content_type = header_length = None
    for name, value in headers.raw:
        name = name.lower()
        if name == _CONTENT_TYPE and content_type is None:
            content_type = value.decode("latin-1")
        elif name == _HEADER_LENGTH and header_length is None:
            header_length = value.decode("latin-1")
    return content_type, header_length


def prep_result(content: bytes, request: Call | None = None) -> RemotePrep:
    """The handle in a ``/prepare/<op>`` answer (``request``: the call that asked for it)."""
    obj = codec.loads(content)
    return RemotePrep(
        obj["prep"], obj["operator"], obj["function"], obj["backend"], obj["resolved"],
        obj.get("sparsity"), request, obj.get("reason"),
    )


def function_from(obj: dict) -> RemoteFunction:
    return RemoteFunction(
        obj["name"], obj["kind"], obj.get("description", ""), obj.get("signature", {}),
        obj.get("arguments") or [], obj.get("operators") or [], obj.get("example"),
    )


def function_result(content: bytes) -> RemoteFunction:
    return function_from(codec.loads(content))


def register_call(
    name: str, description: str, replace: bool, fields: Mapping[str, Any]
) -> Call:
    """``POST /functions`` for a function of any kind: ``fields`` are the kind's own body
    fields (``{"expression": ..., "args": [...]}``, ``{"export": <base64>}``, or those of
    a kind the server added)."""
    payload: dict[str, Any] = {
        "name": name, "description": description, "replace": replace, **fields,
    }
    return Call("POST", "/functions", codec.dumps(payload), {"content-type": codec.JSON_TYPE})
