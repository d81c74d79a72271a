"""Kinds of registered function, and the one place a new kind plugs in.

A kind says how a function of that kind comes to exist:

* which fields of a ``POST /functions`` body belong to it (``fields``; the first,
  its ``selector``, is the one whose presence picks the kind);
* how those fields become canonical content bytes (``validate``), so that
  identical registrations hash alike in the store;
* how content bytes become the callable ``fn(x, *contexts)`` and the signature
  shown by ``GET /functions`` (``build``), and how an entry is described;
* whether its functions are stored (``persistent``).

The built-in kinds are ``module`` (the deployer's ``@dxserve.function`` Python,
never stored and never registered over the API), ``expression`` and ``export``.
Another kind is one module defining a ``FunctionKind`` and calling
``add_kind(kind)`` before the server builds its registry; the registry, the
store, the request and response schemas of ``/functions`` and the executable
cache all read the kinds from here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from dxcontract.errors import InvalidArgumentError, MalformedRequestError

if TYPE_CHECKING:
    from dxserve.server.registry import Entry

__all__ = [
    "BaseKind",
    "Built",
    "FunctionKind",
    "RegisterRequest",
    "add_kind",
    "all_kinds",
    "get_kind",
    "names",
    "parse_register_body",
    "register_model",
    "registrable",
    "remove_kind",
    "selector",
    "standard_description",
    "stored_names",
]

#: The fields every ``POST /functions`` body has, whatever the kind.
COMMON_FIELDS: dict[str, tuple[Any, Any]] = {
    "name": (str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")),
    "description": (str, Field("", max_length=4096)),
}
_TRAILING_FIELDS: dict[str, tuple[Any, Any]] = {"replace": (bool, False)}


@dataclass(frozen=True)
class Built:
    """What a kind builds from content: the callable and its signature for ``describe``."""

    fn: Callable = field(repr=False)
    signature: dict[str, Any] = field(default_factory=dict)
    #: What ``dxserve.server.describe`` shows of its shapes (``describe.facts``), if known.
    facts: dict[str, Any] | None = None


@runtime_checkable
class FunctionKind(Protocol):
    """A kind of registered function (see the module docstring)."""

    #: The ``kind`` value shown by ``GET /functions`` and kept in the store.
    name: str
    #: Stored in the ``FunctionStore`` (and so survives restarts) when True.
    persistent: bool
    #: ``POST /functions`` body fields of this kind, as ``create_model`` field
    #: definitions ``{name: (annotation, default or FieldInfo)}``. The first one
    #: (``selector``) must default to None: present, it picks this kind. Empty:
    #: the kind cannot be registered over the API.
    fields: Mapping[str, tuple[Any, Any]]
    #: A noun phrase for documentation: "an expression", "a JAX export".
    summary: str
    #: A whole example ``POST /functions`` body, or None.
    example: dict[str, Any] | None

    def validate(self, values: Mapping[str, Any]) -> bytes:
        """This kind's body fields (already type-checked) -> canonical content bytes.

        Raises the typed errors of ``dxcontract.errors`` with ``field=`` naming the body field.
        """
        ...

    def build(self, content: bytes) -> Built:
        """Content bytes -> the callable ``fn(x, *contexts)`` and its signature.

        Raises the typed errors of ``dxcontract.errors`` for content that does not load.
        """
        ...

    def describe(self, entry: Entry) -> dict[str, Any]:
        """The JSON of ``GET /functions/{name}`` for an entry of this kind."""
        ...

    # Optional: ``bind(**resources) -> FunctionKind``, this kind over one server's
    # resources (the export kind binds its ``export_gate``); each registry binds the
    # kinds it uses, so two servers in one process keep their own.


class BaseKind:
    """Defaults for a ``FunctionKind``: persistent, described like every other kind."""

    name: str = ""
    persistent: bool = True
    fields: Mapping[str, tuple[Any, Any]] = {}
    summary: str = ""
    example: dict[str, Any] | None = None

    def validate(self, values: Mapping[str, Any]) -> bytes:
        raise NotImplementedError

    def build(self, content: bytes) -> Built:
        raise NotImplementedError

    def describe(self, entry: Entry) -> dict[str, Any]:
        return standard_description(entry)


def standard_description(entry: Entry) -> dict[str, Any]:
    """name, kind, description, signature, digest and created when stored, and what
    ``dxserve.server.describe`` tells from the signature: arguments (shapes and dtypes where
    known), output, operators and an example request."""
    from dxserve.server.describe import describe

    out = {
        "name": entry.name,
        "kind": entry.kind,
        "description": entry.description,
        "signature": entry.signature,
    }
    if entry.digest:
        out["digest"] = entry.digest
    if entry.created:
        out["created"] = entry.created
    out.update(describe(entry.name, entry.signature, entry.facts))
    return out


def selector(kind: FunctionKind) -> str | None:
    """The body field whose presence picks ``kind``; None when not registrable over the API."""
    return next(iter(kind.fields), None)


# --- the registry of kinds ----------------------------------------------------
_lock = threading.Lock()
_kinds: dict[str, FunctionKind] = {}  # in the order added, which the schemas keep
_model_cache: list[Any] = []  # [(kinds snapshot, model)]: rebuilt when the kinds change


def add_kind(kind: FunctionKind, *, replace: bool = False) -> FunctionKind:
    """Make ``kind`` known to the registry, the store and ``POST /functions``.

    Call it before the server's registry is built (``create_app``), so stored
    functions of this kind load at start. Raises ``ValueError`` for a name that is
    taken (unless ``replace``) or a body field another kind already owns.
    """
    if not isinstance(kind, FunctionKind):
        raise TypeError(f"{kind!r} does not implement FunctionKind")
    if not isinstance(kind.name, str) or not kind.name.isidentifier():
        raise ValueError(f"a kind's name must be an identifier, got {kind.name!r}")
    taken = set(COMMON_FIELDS) | set(_TRAILING_FIELDS)
    with _lock:
        if kind.name in _kinds and not replace:
            raise ValueError(f"there is already a function kind named {kind.name!r}")
        for other in _kinds.values():
            if other.name != kind.name:
                taken |= set(other.fields)
        clash = sorted(taken & set(kind.fields))
        if clash:
            raise ValueError(f"kind {kind.name!r}: body fields {clash} belong to another kind")
        _kinds[kind.name] = kind
        _model_cache.clear()
    return kind


def remove_kind(name: str) -> FunctionKind | None:
    """Forget a kind (tests); registered functions of it stay until removed."""
    with _lock:
        _model_cache.clear()
        return _kinds.pop(name, None)


def get_kind(name: str) -> FunctionKind | None:
    return _kinds.get(name)


def all_kinds() -> list[FunctionKind]:
    """Every kind, in the order they were added."""
    with _lock:
        return list(_kinds.values())


def names() -> list[str]:
    """Every kind's name (the ``kind`` values of ``GET /functions``)."""
    return [k.name for k in all_kinds()]


def stored_names() -> frozenset[str]:
    """The kinds a ``FunctionStore`` keeps."""
    return frozenset(k.name for k in all_kinds() if k.persistent)


def registrable() -> list[FunctionKind]:
    """The kinds a ``POST /functions`` body can name, in order."""
    return [k for k in all_kinds() if k.persistent and k.fields]


# --- POST /functions bodies -----------------------------------------------------
def register_model() -> type[BaseModel]:
    """The pydantic model of a ``POST /functions`` body for the kinds known now."""
    kinds = registrable()
    with _lock:
        if _model_cache and _model_cache[0][0] == kinds:
            return _model_cache[0][1]
    fields: dict[str, tuple[Any, Any]] = dict(COMMON_FIELDS)
    for kind in kinds:
        fields.update(kind.fields)
    fields.update(_TRAILING_FIELDS)
    example = next((k.example for k in kinds if k.example), None)
    doc = "Register " + _either(f"{k.summary} ({' + '.join(f'``{f}``' for f in k.fields)})"
                                for k in kinds) + "."
    config = ConfigDict(extra="forbid", json_schema_extra={"example": example} if example else None)
    model = create_model("RegisterFunction", __config__=config, __doc__=doc, **fields)
    with _lock:
        _model_cache[:] = [(kinds, model)]
    return model


@dataclass(frozen=True)
class RegisterRequest:
    """A validated ``POST /functions`` body: what ``Registry.register`` takes."""

    name: str
    kind: str
    content: bytes = field(repr=False)
    description: str = ""
    replace: bool = False


def parse_register_body(body: Any) -> RegisterRequest:
    """Validate a decoded ``POST /functions`` body into a ``RegisterRequest``.

    In order: a JSON object, the ``RegisterFunction`` model (unknown fields
    refused), exactly one kind's selector field, then that kind's ``validate``.
    """
    if not isinstance(body, dict):
        raise MalformedRequestError("the body must be a JSON object", field="body")
    try:
        spec = register_model().model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _field_of(tuple(first["loc"]))
        raise InvalidArgumentError(f"{where}: {first['msg']}", field=where) from None
    kinds = registrable()
    chosen = [k for k in kinds if getattr(spec, selector(k)) is not None]
    if len(chosen) != 1:
        hints = [_hint(k) for k in kinds]
        where = selector(chosen[0] if chosen else kinds[0]) if kinds else "body"
        raise InvalidArgumentError(f"give exactly one of {_either(hints)}", field=where)
    (kind,) = chosen
    content = kind.validate({f: getattr(spec, f) for f in kind.fields})
    return RegisterRequest(spec.name, kind.name, content, spec.description, spec.replace)


def _hint(kind: FunctionKind) -> str:
    first, *rest = kind.fields
    return f"'{first}'" + (f" (with {', '.join(repr(f) for f in rest)})" if rest else "")


def _either(items: Any) -> str:
    items = list(items)
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else "".join(items)


def _field_of(loc: tuple) -> str:
    # The same dotted path the HTTP layer gives validation errors: args[1], x.w
    out = ""
    for p in (str(p) for p in loc):
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def _add_builtins() -> None:
    from dxserve.server.kinds.export import EXPORT
    from dxserve.server.kinds.expression import EXPRESSION
    from dxserve.server.kinds.module import MODULE

    for kind in (MODULE, EXPRESSION, EXPORT):
        add_kind(kind)


_add_builtins()
