"""The request model shared by ``Client`` and ``AsyncClient``.

Both build the same ``Call`` (path, body, headers) and parse answers with the same
functions; they differ only in how bytes travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codec
from .backends import Backend, backend_from_json
from .errors import DxError
from .operators import ALIASES, OPERATORS, OperatorSpec

BATCH_RESULTS = frozenset({"pushforwards", "pullbacks", "hvps"})


@dataclass(frozen=True)
class RemoteFunction:
    """A function registered on the server, by name (``client.function(name)``)."""

    name: str
    kind: str | None = None
    description: str = ""
    signature: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class RemotePrep:
    """A handle from ``prepare_<op>``; pass it as ``prep=`` to the same operator."""

    handle: str
    operator: str
    function: str
    backend: dict
    resolved: dict


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]


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
    """numpy in: lists and numbers become float64 arrays, dicts stay pytrees."""
    if isinstance(value, dict):
        return {k: to_wire_tree(v) for k, v in value.items()}
    if isinstance(value, (list, int, float)) and not isinstance(value, bool):
        return np.asarray(value, dtype=np.float64)
    if hasattr(value, "__array__") and not isinstance(value, np.ndarray):
        return np.asarray(value)  # JAX arrays, numpy scalars
    return value


def operator_spec(operator: str) -> OperatorSpec:
    return OPERATORS[ALIASES.get(operator, operator)]


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
) -> Call:
    op = operator_spec(operator)
    payload: dict[str, Any] = {
        "function": function_name(f),
        "backend": backend_from_json(backend).to_json(),
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
    body, content_type, headers = codec.encode_body(payload, encoding)
    headers = {"content-type": content_type, **headers}
    if encoding == "binary":
        headers["accept"] = codec.BINARY_TYPE
    path = f"/prepare/{op.name}" if prepare else f"/{op.name}"
    return Call("POST", path, body, headers)


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


def operator_result(operator: str, headers: Any, content: bytes) -> Any:
    """Decode an operator's answer to numpy: one result, or a tuple (DI's order)."""
    op = operator_spec(operator)
    arrays = [r for r in op.results if r not in BATCH_RESULTS]
    batches = [r for r in op.results if r in BATCH_RESULTS]
    obj = codec.decode_response(
        content,
        headers.get("content-type"),
        headers.get(codec.HEADER_LENGTH),
        arrays=arrays,
        batches=batches,
    )
    values = tuple(tuple(obj[r]) if r in BATCH_RESULTS else obj[r] for r in op.results)
    return values[0] if len(values) == 1 else values


def prep_result(content: bytes) -> RemotePrep:
    obj = codec.loads(content)
    return RemotePrep(obj["prep"], obj["operator"], obj["function"], obj["backend"], obj["resolved"])


def function_from(obj: dict) -> RemoteFunction:
    return RemoteFunction(obj["name"], obj["kind"], obj.get("description", ""), obj.get("signature", {}))


def function_result(content: bytes) -> RemoteFunction:
    return function_from(codec.loads(content))


def register_call(
    name: str,
    description: str,
    replace: bool,
    *,
    expression: str | None = None,
    args: tuple[str, ...] = ("x",),
    export: bytes | None = None,
) -> Call:
    import base64

    payload: dict[str, Any] = {"name": name, "description": description, "replace": replace}
    if expression is not None:
        payload["expression"] = expression
        payload["args"] = list(args)
    else:
        payload["export"] = base64.b64encode(export or b"").decode("ascii")
    return Call("POST", "/functions", codec.dumps(payload), {"content-type": codec.JSON_TYPE})
