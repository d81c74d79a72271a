"""From a decoded body to a validated operator request, and from results to the wire.

The codec (``dxcontract.codec``, formats in ``dxcontract.encodings``) owns the array
formats; this module knows which fields of an operator request hold arrays, and
checks each field once (a request repeating the fields of an earlier one is not
validated again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dxcontract import codec
from dxcontract.arguments import check_wrt
from dxcontract.backends import Backend, backend_from_json
from dxcontract.encodings.common import mark_sequences
from dxcontract.errors import InvalidArgumentError, InvalidBackendError, MalformedRequestError
from dxcontract.lru import LRU
from dxcontract.operators import OperatorSpec
from dxserve.core.holomorphic import FAMILIES as HOLOMORPHIC_FAMILIES

OPERATOR_FIELDS = (
    "function", "backend", "x", "tangents", "contexts", "prep", "batch_axis", "has_aux",
    "holomorphic", "wrt", "cotangent",
)
#: second-order nests one level; anything deeper is refused before parsing (no recursion).
MAX_BACKEND_DEPTH = 4

if TYPE_CHECKING:
    from dxserve.frameworks.jax.signature import Signature


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of JSON objects/lists in ``value``, counted up to ``limit + 1``."""
    level, frontier = 0, [value]
    while level <= limit:
        frontier = [
            v
            for item in frontier
            if isinstance(item, dict | list)
            for v in (item.values() if isinstance(item, dict) else item)
        ]
        if not frontier:
            break
        level += 1
    return level


@dataclass(slots=True)  # made per request: a frozen dataclass's __init__ costs ~2 us more
class OperatorRequest:
    function: str
    backend: Backend
    x: Any
    tangents: tuple | None
    contexts: tuple
    prep: str | None
    #: the inputs' ``Signature`` when already known (a repeated request), else None
    signature: Signature | None = None
    #: 0: x and the tangents lead with an axis of points; None: one point
    batch_axis: int | None = None
    #: the function returns ``(output, aux)``: aux is returned as the ``aux`` result
    has_aux: bool = False
    #: the caller declares the function holomorphic (Jacobians of complex x)
    holomorphic: bool = False
    #: the arguments differentiated (``dxcontract.arguments``); None: x
    wrt: int | tuple[int, ...] | None = None
    #: the HVP family: the HVPs of ``<cotangent, f>`` for an array-valued f
    cotangent: Any = None


class WireMemo:
    """The requests one door into a server has validated, so that a repeat of one is
    not validated again: by binary header (its ``BinaryLayout``) and operator, and by a
    JSON request's fields besides x (``_json_frame``); each bounded by count. A door
    (the HTTP app) owns one; nothing of it is shared between servers."""

    def __init__(self, size: int = 256) -> None:
        self.binary: LRU[tuple[Any, str], _Repeat] = LRU(size)
        self.json: LRU[tuple, _JsonRepeat] = LRU(size)


def decode_operator_request(
    body: bytes, content_type: str | None, header_length: str | None, op: OperatorSpec,
    memo: WireMemo | None = None,
) -> OperatorRequest:
    """Decode and validate the body of ``POST /{op}``; errors name the field.

    With a ``memo``, a binary header seen before for this operator is not validated
    again (``_Repeat``: only the arrays are new), and a JSON request that repeats all but
    x has its other fields checked once (``_JsonRepeat``).
    """
    obj, layout = codec.decode_body_and_layout(body, content_type, header_length, arrays=_X)
    if memo is None:
        return parse_operator_request(obj, op)
    if layout is not None:
        key = (layout, op.name)  # the memo holds the layout: its identity stays its own
        repeat = memo.binary.get(key)
        if repeat is not None:
            return repeat.request(obj)
        frame = None
    else:
        frame = _json_frame(obj, op)
        if frame is not None:
            repeat = memo.json.get(frame)
            if repeat is not None:
                return repeat.request(obj)
    req = parse_operator_request(obj, op)
    if req.cotangent is not None:  # its own array, every time: not memoized
        return req
    if layout is not None and _all_binary(obj):
        memo.binary.put(key, _Repeat(req))
    elif frame is not None:
        memo.json.put(frame, _JsonRepeat(req))
    return req


#: x is one array or pytree: a long flat JSON list of numbers there may be parsed
#: straight into its float64 array
_X = ("x",)
_FRAME_FIELDS = frozenset(("function", "backend", "x", "prep", "batch_axis", "has_aux"))
_MAX_FRAME_CHARS = 2048


def _json_frame(obj: dict, op: OperatorSpec) -> tuple | None:
    """What a JSON request says besides x, as a key, when that is all it holds (no
    tangents or contexts) and each field has the type a valid request gives it; else
    None (parsed in full, so an error names its field as usual). Only exact types pass:
    ``false`` must not pass for a ``0`` seen before."""
    if not _FRAME_FIELDS.issuperset(obj) or "x" not in obj:
        return None
    function, backend = obj.get("function"), obj.get("backend", "auto")
    prep, batch_axis, has_aux = obj.get("prep"), obj.get("batch_axis"), obj.get("has_aux")
    if type(backend) is dict:
        try:
            backend = codec.dumps(backend)
        except (TypeError, ValueError, RecursionError):  # too deep, say: parsed in full
            return None
    elif type(backend) is not str:
        return None
    if (
        type(function) is not str
        or (prep is not None and type(prep) is not str)
        or (batch_axis is not None and type(batch_axis) is not int)
        or (has_aux is not None and (type(has_aux) is not bool or not op.aux))
    ):
        return None
    if len(function) + len(backend) + (len(prep) if prep else 0) > _MAX_FRAME_CHARS:
        return None  # a memo of 256 frames stays small whatever names are sent
    return op.name, tuple(obj), function, backend, prep, batch_axis, has_aux


class _Repeat:
    """What a binary header says about a request, checked once: all but the arrays."""

    def __init__(self, req: OperatorRequest) -> None:
        self.function, self.backend, self.prep = req.function, req.backend, req.prep
        self.takes_tangents = req.tangents is not None
        self.batch_axis, self.has_aux, self.wrt = req.batch_axis, req.has_aux, req.wrt
        self.holomorphic = req.holomorphic
        # with wrt the service differentiates other inputs than those sent: it finds
        # their signature itself
        self.signature = None if req.wrt is not None else _signature_of(
            req.x, req.tangents, req.contexts, req.batch_axis, req.has_aux
        )

    def request(self, obj: dict) -> OperatorRequest:
        """The request for a body with this header (``obj``: its decoded JSON)."""
        tangents = tuple(obj["tangents"]) if self.takes_tangents else None
        return OperatorRequest(
            self.function, self.backend, obj["x"], tangents, tuple(obj.get("contexts", ())),
            self.prep, self.signature, self.batch_axis, self.has_aux, self.holomorphic,
            self.wrt,
        )


class _JsonRepeat:
    """What a JSON request says besides x (no tangents or contexts), checked once. x is
    validated every time; it may change shape from one request to the next, so its
    signature is kept for the last shape and dtype seen."""

    def __init__(self, req: OperatorRequest) -> None:
        self.function, self.backend, self.prep = req.function, req.backend, req.prep
        self.batch_axis, self.has_aux = req.batch_axis, req.has_aux
        #: ``(shape, dtype, Signature)`` of the last array x, or None
        self.last_x: tuple | None = None

    def request(self, obj: dict) -> OperatorRequest:
        """The request for a body with these fields (``obj``: its decoded JSON)."""
        x = codec.to_tree(obj["x"], "x")
        return OperatorRequest(
            self.function, self.backend, x, None, (), self.prep, self._signature_of(x),
            self.batch_axis, self.has_aux,
        )

    def _signature_of(self, x: Any) -> Signature | None:
        """x's signature when it is one array (None for a pytree: found later)."""
        if type(x) is not np.ndarray:
            return None
        last = self.last_x  # one read: another thread may replace it meanwhile
        if last is not None and last[0] == x.shape and last[1] is x.dtype:
            return last[2]
        signature = _signature_of(x, None, (), self.batch_axis, self.has_aux)
        self.last_x = (x.shape, x.dtype, signature)
        return signature


def _signature_of(*args: Any) -> Signature:
    """``Signature.of(x, tangents, contexts, batch_axis, has_aux)``: the inputs' signature,
    as preparation finds it (loaded when the first request is read)."""
    from dxserve.frameworks.jax.signature import Signature

    return Signature.of(*args)


def _all_binary(obj: dict) -> bool:
    """Every input array came from a binary buffer (nothing inline to validate again)."""

    def arrays_only(tree: Any) -> bool:
        if isinstance(tree, dict):
            return all(arrays_only(v) for v in tree.values())
        return isinstance(tree, np.ndarray)

    return arrays_only(obj["x"]) and all(
        arrays_only(t) for key in ("tangents", "contexts") for t in obj.get(key) or ()
    )


def _array_list(value: Any, field: str) -> tuple:
    if not isinstance(value, list):
        raise MalformedRequestError(
            f"{field} must be a JSON list (one entry per {field[:-1]})", field=field
        )
    return tuple(codec.to_tree(v, f"{field}[{i}]") for i, v in enumerate(value))


def parse_operator_request(obj: dict, op: OperatorSpec) -> OperatorRequest:
    """Validate the decoded body of ``POST /{op}``; errors name the field."""
    for key in obj:
        if key not in OPERATOR_FIELDS:
            raise InvalidArgumentError(
                f"unknown field {key!r}; {op.name} takes {', '.join(OPERATOR_FIELDS)}", field=key
            )
    function = obj.get("function")
    if not isinstance(function, str) or not function:
        raise InvalidArgumentError(
            "function must be the name of a registered function (GET /functions)",
            field="function",
        )
    if "x" not in obj:
        raise InvalidArgumentError("x (the active input) is required", field="x")
    backend = obj.get("backend", "auto")
    if _depth(backend, MAX_BACKEND_DEPTH) > MAX_BACKEND_DEPTH:
        raise InvalidBackendError(
            f"backend nested deeper than {MAX_BACKEND_DEPTH} levels", field="backend"
        )
    backend = backend_from_json(backend)
    x = codec.to_tree(obj["x"], "x")
    tangents = None
    if op.takes_tangents:
        if "tangents" not in obj:
            raise InvalidArgumentError(
                f"{op.name} needs tangents: a list of arrays shaped like "
                f"{'f(x)' if op.family == 'pullback' else 'x'}",
                field="tangents",
            )
        tangents = _array_list(obj["tangents"], "tangents")
    elif obj.get("tangents") is not None:
        raise InvalidArgumentError(f"{op.name} takes no tangents", field="tangents")
    contexts = _array_list(obj.get("contexts", []), "contexts")
    prep = obj.get("prep")
    if prep is not None and not isinstance(prep, str):
        raise InvalidArgumentError("prep must be a handle string from POST /prepare", field="prep")
    batch_axis = obj.get("batch_axis")
    if batch_axis is not None and (type(batch_axis) is not int or batch_axis != 0):
        raise InvalidArgumentError(
            f"batch_axis must be 0 (x and the tangents lead with an axis of points) or "
            f"null (one point), got {batch_axis!r}",
            field="batch_axis",
        )
    has_aux = obj.get("has_aux", False)
    if type(has_aux) is not bool:
        raise InvalidArgumentError(
            f"has_aux must be true (the function returns a pair (output, aux): output is "
            f"differentiated, aux returned as the answer's \"aux\") or false, got {has_aux!r}",
            field="has_aux",
        )
    if has_aux and not op.aux:
        raise InvalidArgumentError(
            f"{op.name} takes no has_aux (it returns no values to put aux beside); "
            "leave has_aux out",
            field="has_aux",
        )
    holomorphic = obj.get("holomorphic", False)
    if type(holomorphic) is not bool:
        raise InvalidArgumentError(
            f"holomorphic must be true (the function is holomorphic: its Jacobian of complex "
            f"x is f'(z)) or false, got {holomorphic!r}",
            field="holomorphic",
        )
    if holomorphic and op.family not in HOLOMORPHIC_FAMILIES:
        raise InvalidArgumentError(
            f"{op.name} takes no holomorphic (it is answered for any function of complex x); "
            "leave holomorphic out",
            field="holomorphic",
        )
    wrt = check_wrt(obj.get("wrt"))
    cotangent = obj.get("cotangent")
    if cotangent is not None:
        if op.family != "hvp":
            raise InvalidArgumentError(
                f"{op.name} takes no cotangent (hvp and gradient_and_hvp do: the HVP of "
                "<cotangent, f> for an array-valued f); leave it out",
                field="cotangent",
            )
        cotangent = codec.to_tree(cotangent, "cotangent")
    return OperatorRequest(
        function, backend, x, tangents, contexts, prep, None, batch_axis, has_aux, holomorphic,
        wrt, cotangent,
    )


def result_nbytes(tree: Any) -> int:
    """Bytes of array data in a ``payload`` (dicts and tuples of arrays)."""
    if isinstance(tree, dict):
        return sum(result_nbytes(v) for v in tree.values())
    if isinstance(tree, tuple | list):
        return sum(result_nbytes(v) for v in tree)
    return getattr(tree, "nbytes", 0)


def results_to_wire(results: dict, op: OperatorSpec) -> dict:
    """``results`` with the tuple and list nodes of pytree results marked for the wire
    (``{"__tuple__": [...]}``, ``{"__list__": [...]}``); array results are left alone, and
    batch results (one entry per tangent) stay lists of such pytrees."""
    for name, value in results.items():
        if type(value) is np.ndarray:
            continue
        if name in op.batch_results:
            results[name] = [mark_sequences(v) for v in value]
        else:
            results[name] = mark_sequences(value)
    return results
